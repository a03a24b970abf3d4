"""What runs a config behind the Engine protocol: vLLM in process, over HTTP, simulated, fake."""
