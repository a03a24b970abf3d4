"""The study: storage, the budget loop, the objective (one trial), its record, pilot, pre-screen, runner."""
