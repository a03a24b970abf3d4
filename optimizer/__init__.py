"""optimizer: find the vLLM engine configuration with the most throughput under a TTFT P99 limit."""

__version__ = "0.1.0"
