"""`optimize`: one entry, one module per subcommand. Exit 0 ok, 1 failure, 2 bad usage, 130/143 a stop.

    optimize --ttft-p99 150ms --budget 40       run (or resume) a study                      (cli/run.py)
    optimize export --study NAME                the serve command, YAML, JSON, compose        (cli/export.py)
    optimize report --study NAME [--ttft-p99 X] the Pareto front, plots, a re-ranking          (cli/report.py)
    optimize verify --study NAME                the best configs again under other seeds, ...  (cli/verify.py)
    optimize measure --url URL --rate 5         the workload against a running server         (cli/measure.py)
    optimize calibrate                          fit the simulator to the real engine          (cli/calibrate.py)
    optimize studies [--studies-dir DIR]        the studies: limit, trials, best so far       (cli/studies.py)

Each subcommand module has its own parser (cli/manual.py: examples and exit codes in every --help) and one
`cmd_NAME(argv)`; the study itself is the command without a subcommand, so `optimize --ttft-p99 150ms` needs no verb.
"""

from __future__ import annotations

import importlib
import sys

from optimizer.cli.common import attach_negative_values
from optimizer.cli.manual import SUBCOMMANDS
from optimizer.core.signals import quiet_resource_tracker


def main(argv: list[str] | None = None) -> int:
    quiet_resource_tracker()  # before any engine starts: its tracker process reads the filter at its start
    argv = attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        return getattr(module, f"cmd_{argv[0]}")(argv[1:])
    from optimizer.cli.run import cmd_run

    return cmd_run(argv)
