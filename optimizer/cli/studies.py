"""`optimize studies`: the studies in the studies folder (every STUDY.db in it) or at a storage URL, one row each:
its limits, the trials it finished of its budget, its best so far as `optimize report` decides it, and when it last
did something. It reads the studies and makes no file or folder; a SQLite file that is not a study database is left
as it is.
"""

from __future__ import annotations

import argparse
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

from optimizer.cli.common import add_format_flag, guarded, studies_dir_default
from optimizer.cli.manual import new_parser
from optimizer.core.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    """The parser of `optimize studies`, with its help page (cli/manual.py)."""
    p = new_parser(
        "optimize studies",
        "List the studies in the studies folder (each STUDY.db in it), or in the database at --storage: each study's "
        "latency limits, the trials and confirmation runs it finished of its budget, its best so far (the "
        "recommendation `optimize report` gives, in output tokens/s and requests/s at the limit, and the decision in "
        "a few words) and its last activity. No file or folder is made.",
        [("optimize studies", "the studies in ./studies"),
         ("optimize studies --studies-dir /data/studies --format csv", "another folder, as CSV"),
         ("optimize studies --storage postgresql://user@db/optimize", "the studies of a PostgreSQL database")])
    p.add_argument("--studies-dir", default=studies_dir_default(),
                   help="the folder whose STUDY.db files are listed (default: %(default)s)")
    p.add_argument("--storage", help="SQLAlchemy URL of a study database to list instead of the folder's files")
    add_format_flag(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="print only the rows")
    return p


def cmd_studies(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _studies(ns), "studies")


def _studies(ns: argparse.Namespace) -> int:
    import sys

    from optimizer.core.paths import check_studies_dir
    from optimizer.decision.tables import check_format, format_output

    check_format(ns.format)
    if ns.storage:
        urls, where = storage_urls(ns.storage), ns.storage
    else:
        check_studies_dir(ns.studies_dir)
        urls, where = folder_urls(Path(ns.studies_dir)), ns.studies_dir
    rows = [row for url in urls for row in study_rows(url)]
    if not rows:
        line = empty_line(ns)
        if ns.format == "table":
            print(line)
        else:
            print(format_output([], ns.format) if ns.format == "json" else "")
            print(line, file=sys.stderr)
        return 0
    print(format_output(rows, ns.format))
    if not ns.quiet and ns.format == "table":
        print(f"({len(rows)} {'study' if len(rows) == 1 else 'studies'} in {where}; `optimize report --study NAME` "
              f"for one)", file=sys.stderr)
    return 0


def empty_line(ns: argparse.Namespace) -> str:
    """The one line for a place that holds no study, with the command that makes one there."""
    if ns.storage:
        import shlex

        from optimizer.core.hints import without_password
        from optimizer.search.study import redact

        bare, _ = without_password(ns.storage)  # pasteable, and no password printed
        return f"no studies at {redact(ns.storage)}: create one with `optimize --storage {shlex.quote(bare)} " \
               f"--ttft-p99 150ms`"
    import shlex

    folder = Path(ns.studies_dir)
    state = "does not exist yet" if not folder.exists() else "holds no study database"
    where = "" if ns.studies_dir == studies_dir_default() else f" --studies-dir {shlex.quote(ns.studies_dir)}"
    return f"no studies: {folder} {state}; create one with `optimize{where} --ttft-p99 150ms`"


def folder_urls(folder: Path) -> list[str]:
    """The SQLite URLs of the study databases in `folder` (none where it does not exist)."""
    if not folder.is_dir():
        return []
    if "?" in str(folder.resolve()):  # a SQLite URL ends its path at '?': it would name (and make) another file
        raise UsageError(f"--studies-dir {str(folder)!r} has a '?' in its path, which no SQLite URL can hold: move "
                         f"the studies to a folder without one")
    return [f"sqlite:///{path.resolve()}" for path in sorted(folder.glob("*.db")) if is_study_database(path)]


def storage_urls(url: str) -> list[str]:
    """[url], checked: a SQLite file that does not exist or is no study database is none (nothing is created); any
    other URL is opened as given, and one that cannot be is a UsageError naming the fix."""
    from optimizer.core.paths import check_sqlite_url, sqlite_path

    check_sqlite_url(url, create=False)
    path = sqlite_path(url)
    if path is not None and not (path.is_file() and is_study_database(path)):
        return []
    return [url]


def is_study_database(path: Path) -> bool:
    """Whether the SQLite file `path` holds Optuna's tables, read without writing anything (Optuna would create them
    in any other database it opened)."""
    try:
        with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as db:
            return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='studies'").fetchone() \
                is not None
    except sqlite3.Error:
        return False


def study_rows(url: str) -> list[dict[str, Any]]:
    """One row per study at `url` that optimize made (its confirmation studies are part of their study's row)."""
    import optuna

    from optimizer.search.attrs import STUDY_CONFIG, STUDY_CONFIRMS
    from optimizer.search.study import storage_for

    storage = storage_for(url)
    names = [s.study_name for s in storage.get_all_studies()
             if STUDY_CONFIG.of(s) is not None and STUDY_CONFIRMS.of(s) is None]
    return [study_row(optuna.load_study(study_name=name, storage=storage)) for name in sorted(names)]


def study_row(study: Any) -> dict[str, Any]:
    """A study as one row: name, limits, finished trials and runs of its budget, the best so far as `optimize report`
    decides it (decision/decide.py: confirmed numbers where there are), the decision in a few words, last activity."""
    import json

    from optimizer.config.settings import StudyConfig
    from optimizer.decision.decide import decide
    from optimizer.decision.document import verdict
    from optimizer.decision.views import confirmation_records, trial_row
    from optimizer.search.attrs import STUDY_CONFIG
    from optimizer.search.measured import OlderSchemaError, check_schema
    from optimizer.search.study import confirmation_runs, finished_count

    config = StudyConfig.model_validate(json.loads(STUDY_CONFIG.of(study) or "{}"))
    runs = confirmation_runs(study)
    done = finished_count(study) + len(runs)
    try:
        check_schema(study, [*study.get_trials(deepcopy=False), *runs])
    except OlderSchemaError as e:  # listed, not read: the line says what it is
        return {"study": study.study_name, "limits": config.limits.text,
                "trials": f"{done}/{config.budget}" if config.budget is not None else f"{done} (time budget)",
                "best": "-", "tok/s": None, "req/s": None, "decision": f"not read: {e.args[0].split(':')[0]}",
                "last activity": last_activity(study, runs)}
    d = decide(study, config)
    tok_s = rate_rps = None
    if d.best is not None:
        tok_s = d.throughput(d.best).output_throughput_tok_s
        if d.confirmed_of(d.best) is not None:  # the rounds' median rate, as the confirmation's table gives it
            rate_rps = next(r["rate_at_limit_rps"] for r in confirmation_records(d) if r["trial"] == d.best.number)
        else:
            row = trial_row(d, d.best, [])
            rate_rps = row["rate_at_limit_rps"] if row["rate_at_limit_rps"] is not None else row["rate_rps"]
    return {"study": study.study_name, "limits": config.limits.text,
            "trials": f"{done}/{config.budget}" if config.budget is not None else f"{done} (time budget)",
            "best": "-" if d.best is None else f"#{d.best.number}",
            "tok/s": tok_s, "req/s": rate_rps, "decision": verdict(d),
            "last activity": last_activity(study, runs)}


def last_activity(study: Any, runs: list) -> str:
    """When the study last finished (or started) a trial or run, local time; its creation where it has none."""
    from optimizer.search.attrs import STUDY_CREATED

    times = [t for trial in [*study.get_trials(deepcopy=False), *runs]
             for t in (trial.datetime_complete, trial.datetime_start) if t is not None]
    if times:
        return max(times).strftime("%Y-%m-%d %H:%M")
    created = STUDY_CREATED.of(study)
    if not created:
        return "-"
    return datetime.fromisoformat(created).astimezone().strftime("%Y-%m-%d %H:%M")
