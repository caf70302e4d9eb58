"""The readers of finished and running runs: the run's data (rundata.py), the training figure (figures.py), text
and HTML views (views.py), the live dashboard (dashboard.py), the advisor (advisor.py), GRPO groups (groups.py),
runs side by side (compare.py) and the report (report.py). The instruments they read are written below: records
(workbench/records.py), the sampler (training/monitor.py), probes (platform/probes/), the scraper (serving/)."""
