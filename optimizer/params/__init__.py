"""The search space and what one config needs: vLLM's knobs, their ranges, memory, parallelism."""
