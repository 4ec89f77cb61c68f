"""`ascendserve bench`: datasets, the streaming HTTP client (serve), metrics, report and plots, and the
offline throughput and latency benchmarks."""
