"""The machine a study runs on: its GPUs (NVML) and CPU, and the fingerprint stored with a study."""
