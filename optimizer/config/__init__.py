"""What a user sets: one typed StudyConfig (with its workload), presets, traces, the model."""
