"""The sampling side: the vLLM server (launch, lifecycle, HTTP client), weight sync, offline generation, the serving sweep."""
