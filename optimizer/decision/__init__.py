"""What the study found: the decision, its tables and plots, export, verify."""
