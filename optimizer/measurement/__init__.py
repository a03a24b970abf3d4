"""One config under load: the workload, the Engine protocol, replay, metrics and the rate search."""
