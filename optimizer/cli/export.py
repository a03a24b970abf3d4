"""`optimize export`: write the recommended config of a study in the forms people deploy.

Same edge rules as the main command: flags -> typed values -> library -> print; bad input is a UsageError
(exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from optimizer.cli.common import add_common_flags, guarded, load_study
from optimizer.cli.manual import new_parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of `optimize export`, with its help page (cli/manual.py)."""
    p = new_parser(
        "optimize export",
        "Write the recommended config of a study as a serve command (printed on stdout; on the CPU build, whose "
        "`vllm` console script cannot run, the server module), as a YAML file for the server's --config, as a JSON "
        "of engine keyword arguments (AsyncEngineArgs) and as a docker compose service. Each carries the limits, the "
        "workload, the measured numbers and what was not tuned in its header.",
        [("optimize export --study llama", "print the serve command; write studies/llama.recommended.yaml, ..."),
         ("optimize export --study llama --out deploy/", "the files into deploy/ instead"),
         ("optimize export --study llama | sh", "start the server with the recommended config")])
    add_common_flags(p)
    p.add_argument("--out", help="folder for the exported files (default: the studies dir)")
    return p


def cmd_export(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _export(ns), "export")


def _export(ns: argparse.Namespace) -> int:
    from optimizer.core.paths import check_output_dir
    from optimizer.decision.decide import decide

    if ns.out is not None:
        check_output_dir(ns.out, "--out", "a folder for the exported files")
    config, study = load_study(ns)
    d = decide(study, config)  # the recommendation and its numbers, as `optimize report` gives them
    done = export_decision(d, config, study, Path(ns.out or ns.studies_dir))
    print(done.command)
    if not ns.quiet:
        for note in done.notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {done.yaml_path} (use: {done.config_command})", file=sys.stderr)
        print(f"wrote {done.json_path} (use: AsyncEngineArgs(**json.load(f)['engine_args']))", file=sys.stderr)
        print(f"wrote {done.compose_path} (use: docker compose -f {done.compose_path} up)", file=sys.stderr)
    return 0


def export_decision(d: Any, config: Any, study: Any, out_dir: Path) -> Any:
    """`export_all` for the recommendation of decision `d` (decision/decide.py) of `study`: its confirmed numbers,
    gain and verdict where confirmed, its rates as served where measured, the study's machine fingerprint."""
    from optimizer.decision.export import export_all
    from optimizer.decision.served import served_record
    from optimizer.decision.verdict import verdict_line
    from optimizer.search.attrs import STUDY_MACHINE
    from optimizer.search.runner import model_path

    best = d.best
    confirmed = None
    if best is not None and d.throughput(best).confirmed:
        confirmed = (d.throughput(best), d.gain(best), verdict_line(d))
    conf = d.confirmed_of(best) if best is not None else None
    served = None
    if conf is not None and conf.served is not None:
        assert d.confirmation is not None
        served = served_record(d.confirmation, conf)
    return export_all(best.trial if best is not None else None, config, out_dir, model_path(config), confirmed,
                      served, STUDY_MACHINE.of(study))
