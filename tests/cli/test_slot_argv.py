"""A run's slots (--gpus) get its command line without --budget: they read the budget and deadline the run stored."""

from optimizer.cli.parallel import slot_argv


def test_the_slots_command_line_leaves_the_budget_to_the_stored_study():
    argv = ["--study", "big", "--budget", "8h", "--gpus", "all", "--budget=40", "--ttft-p99", "150ms"]
    assert slot_argv(argv) == ["--study", "big", "--gpus", "all", "--ttft-p99", "150ms"]
    assert slot_argv(["--budget-x"]) == ["--budget-x"]  # only the flag itself
