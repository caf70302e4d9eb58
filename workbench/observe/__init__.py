"""Observation: JSON-lines records, the sampler and its probes, the Prometheus scraper, the advisor, figures, HTML views, the live dashboard and the report."""
