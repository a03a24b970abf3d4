"""The simulator's parts: vLLM's scheduler replayed in virtual time, its step-time model, calibration."""
