"""What every subcommand shares: the study flags, the workload flags, number parsing, loading a stored study,
and the guard that turns an error into one line and an exit code (1 failure, 2 bad usage, 130/143 a stop)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.core.errors import OptimizerError, UsageError

if TYPE_CHECKING:
    from optimizer.config.limits import Limits

DEFAULT_STUDY = "default"


def studies_dir_default() -> str:
    return os.environ.get("OPTIMIZER_STUDIES_DIR", "studies")


def int_range(text: str, what: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not MIN:MAX in tokens, e.g. 64:512") from None
    if lo < 1 or lo > hi:
        raise UsageError(f"{what} {text!r} needs 1 <= MIN <= MAX, e.g. 64:512")
    return lo, hi


def add_common_flags(p: Any, output: Any = None) -> None:
    """--study, --storage and --studies-dir on `p` (a parser or one of its argument groups), then --debug and --quiet
    on `output` (default: `p`)."""
    p.add_argument("--study", default=DEFAULT_STUDY, help="study name (default: %(default)s)")
    p.add_argument("--storage", help="SQLAlchemy URL of the study database "
                   "(default: sqlite:///STUDIES_DIR/STUDY.db; postgresql://... for many workers)")
    p.add_argument("--studies-dir", default=studies_dir_default(),
                   help="where studies, engine logs and exports live by default (default: %(default)s)")
    output = p if output is None else output
    output.add_argument("--debug", action="store_true", help="show tracebacks")
    output.add_argument("--quiet", action="store_true", help="print only the result")


def add_format_flag(p: argparse.ArgumentParser) -> None:
    """`--format`: how rows are printed, by the one renderer (decision/tables.py), which checks the name (so a wrong
    one is the usual one-line error, not argparse's usage dump); the choices are listed in the help."""
    from optimizer.decision.tables import FORMATS

    p.add_argument("--format", default="table", metavar="{" + ",".join(FORMATS) + "}",
                   help="how the rows are printed (default: %(default)s)")


def positive_int(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a whole number") from None
    if value <= 0:
        raise UsageError(f"{what} must be at least 1, got {value}")
    return value


def add_workload_flags(p: Any, count_help: str) -> None:
    """The flags that describe the replayed requests, shared by a study and by `optimize measure`, on `p` (a parser
    or one of its argument groups)."""
    p.add_argument("--workload", help="YAML file of workload fields (num_requests, input_len_min, ..., preset); "
                   "see docs/workload.md")
    from optimizer.config.presets import PRESETS

    p.add_argument("--preset", metavar="{" + ",".join(PRESETS) + "}",
                   help="named workload: chat, rag (long prompts, shared prefixes), batch (long "
                   "outputs), bursty (gamma arrivals); flags and --workload fields override its fields; scaled down "
                   "for the embedded CPU demo model")
    p.add_argument("--num-requests", type=str, help=count_help)
    p.add_argument("--input-len", help="prompt lengths MIN:MAX in tokens")
    p.add_argument("--output-len", help="completion lengths MIN:MAX in tokens")
    p.add_argument("--workload-seed", type=str, help="seed of the workload (lengths, tokens, arrivals)")
    p.add_argument("--trace", help="CSV or JSONL of requests (input_len, output_len[, timestamp]): replayed in its "
                   "own rhythm, rescaled to each rate; replaces the length ranges")


LIMIT_METRICS = {"ttft": "time to first token", "tpot": "time per output token after the first",
                 "itl": "each gap between streamed tokens, pooled over the requests", "e2e": "send to last token"}


def add_limit_flags(p: Any, rerank: bool = False) -> None:
    """The flags that state latency limits (config/limits.py), on `p` (a parser or one of its argument groups): a
    study's limits, or with `rerank` the limits `optimize report` re-ranks the stored replays for."""
    lead = "re-rank for this " if rerank else "the "
    for metric, what in LIMIT_METRICS.items():
        example = {"ttft": "150ms or 0.5s", "tpot": "50ms", "itl": "100ms", "e2e": "5s"}[metric]
        new_study = " (a new study needs at least one limit)" if metric == "ttft" and not rerank else ""
        p.add_argument(f"--{metric}-p99", metavar="DURATION",
                       help=f"{lead}{metric.upper()} P99 limit ({what}) with a unit, e.g. {example}: at most 1%% of "
                       f"{'gaps' if metric == 'itl' else 'requests'} over it{new_study}")
    p.add_argument("--slo", action="append", default=[], metavar="METRIC:STAT=VALUE",
                   help="any limit, repeatable: METRIC ttft, tpot, itl or e2e; STAT a percentile (p50, p90, p95, p99, "
                   "p99.9, any in (0, 100)) or mean; VALUE with a unit, e.g. --slo tpot:p90=40ms --slo ttft:mean=80ms. "
                   "Under --goodput, METRIC=VALUE: a limit each request must meet")
    p.add_argument("--goodput", metavar="P%",
                   help="per-request limits, as vLLM's --goodput: a request is good when it meets every --slo "
                   "METRIC=VALUE at once (ttft, tpot, e2e), and a rate holds when at least P%% of the requests are "
                   "good, e.g. --goodput 99%% --slo ttft=200ms --slo tpot=50ms")


def limits_given(ns: argparse.Namespace) -> Limits | None:
    """The Limits the flags of `add_limit_flags` give (None: none given), or a UsageError line naming the fix."""
    from optimizer.config.limits import parse_limits

    return parse_limits(ns.ttft_p99, ns.tpot_p99, ns.itl_p99, ns.e2e_p99, ns.slo or (), ns.goodput)


def workload_settings(ns: argparse.Namespace) -> tuple[dict[str, Any], bool | None]:
    """The workload fields the flags of `add_workload_flags` give (validated), and whether the count is 'auto'
    (None: not given)."""
    from optimizer.config.settings import load_yaml

    workload: dict[str, Any] = {}
    auto: bool | None = None
    if ns.workload is not None:
        workload.update(load_yaml(ns.workload, "workload"))
    if ns.preset is not None:
        workload["preset"] = ns.preset
    if workload.get("preset") is not None:
        from optimizer.config.presets import get

        get(workload["preset"])  # an unknown name fails here, with the list of names
    if ns.num_requests is not None and ns.num_requests.strip().lower() == "auto":
        auto = True
    elif ns.num_requests is not None:
        workload["num_requests"] = positive_int(ns.num_requests, "--num-requests")
        if workload["num_requests"] < 10:
            raise UsageError(f"--num-requests {ns.num_requests} is too few to measure a P99: give at least 10, or "
                             f"'auto' to let a pilot trial choose")
        auto = False
    if ns.input_len is not None:
        workload["input_len_min"], workload["input_len_max"] = int_range(ns.input_len, "--input-len")
        workload.update(input_len_dist="uniform", input_len_mean=None, input_len_std=None)  # MIN:MAX is uniform
    if ns.output_len is not None:
        workload["output_len_min"], workload["output_len_max"] = int_range(ns.output_len, "--output-len")
        workload.update(output_len_dist="uniform", output_len_mean=None, output_len_std=None)
    if ns.workload_seed is not None:
        try:
            workload["seed"] = int(ns.workload_seed)
        except ValueError:
            raise UsageError(f"--workload-seed {ns.workload_seed!r} is not a whole number") from None
    if ns.trace is not None:
        from optimizer.config.trace import load_trace

        workload["trace"] = load_trace(ns.trace)
        workload["num_requests"] = min(workload.get("num_requests", len(workload["trace"])), len(workload["trace"]))
    return workload, auto


def storage_url(ns: argparse.Namespace) -> str:
    from optimizer.core.paths import check_sqlite_url, check_studies_dir, check_study_name
    from optimizer.search.study import default_storage_url

    check_study_name(ns.study)
    check_studies_dir(ns.studies_dir)
    if ns.storage:
        check_sqlite_url(ns.storage, create=False)
        return ns.storage
    return default_storage_url(ns.study, Path(ns.studies_dir))


def existing_config(url: str, study: str):
    """The stored config of the study, without creating any file when the study does not exist."""
    from optimizer.core.paths import sqlite_path
    from optimizer.search.study import storage_for, stored_config

    path = sqlite_path(url)  # the file, without a query such as ?timeout=60
    if path is not None and not path.exists():
        return None
    return stored_config(storage_for(url), study)


def create_command(ns: argparse.Namespace) -> str:
    """The command that creates study `ns.study` where `ns` looks for it (its --storage, or a --studies-dir other
    than the default), with the demo's limit as an example."""
    import shlex

    return shlex.join(["optimize", "--study", ns.study, *where_flags(ns), "--ttft-p99", "150ms"])


def where_flags(ns: argparse.Namespace) -> list[str]:
    """The flags that find study `ns.study` where `ns` looks for it: its --storage, or a --studies-dir other than the
    default."""
    return ["--storage", ns.storage] if ns.storage else \
        ["--studies-dir", ns.studies_dir] if ns.studies_dir != studies_dir_default() else []


def load_study(ns: argparse.Namespace):
    """The stored config and the study, or a UsageError that names the fix."""
    url = storage_url(ns)
    config = existing_config(url, ns.study)
    if config is None:
        raise UsageError(f"no study {ns.study!r} in {ns.storage or ns.studies_dir}: create it first, e.g. "
                         f"`{create_command(ns)}`, or pass the right --study/--storage")
    import optuna

    from optimizer.search.measured import check_schema
    from optimizer.search.study import confirmation_study, storage_for

    study = optuna.load_study(study_name=ns.study, storage=storage_for(url))
    runs = confirmation_study(study)
    for s in (study, *([runs] if runs is not None else [])):
        check_schema(s)
    return config, study


def guarded(debug: bool, fn, command: str | None = None) -> int:
    """Run a command: library noise kept off the console unless `debug` (cli/console.py), and any error turned into
    one line and its exit code. Ctrl-C and SIGTERM (`timeout`, `docker stop`) stop every command alike
    (core/signals.py): the engines it started are shut down on the way out, and the line says what to do next (a
    study's run resumes; another `command` is run again)."""
    from optimizer.cli.console import quiet_libraries
    from optimizer.core.signals import RUN_STOPPED, install_stop_handlers

    quiet_libraries(debug)  # before the command imports vLLM or uses Optuna
    stopped = RUN_STOPPED if command is None else f"`optimize {command}` stopped before it finished; run it again"
    try:
        if threading.current_thread() is threading.main_thread():  # signal handlers are the main thread's alone
            install_stop_handlers()
        return fn()
    except OptimizerError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        from optimizer.core.signals import interrupted_exit_code, interrupted_message

        print(interrupted_message(stopped), file=sys.stderr)
        return interrupted_exit_code()  # 130 after Ctrl-C, 143 after SIGTERM
    except Exception as exc:  # a bug: short message unless --debug
        if debug:
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--budget -3` -> `--budget=-3`, so that argparse hands the value to our checks instead of failing on it."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(token) > 1 and token[0] == "-" \
                and (token[1].isdigit() or token[1] == "."):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out
