"""Does a finished study's recommendation hold its limits as its users would check it: `vllm bench serve` against
`vllm serve`? The recommended config's serve command exactly as `optimize export` writes it (decision/export.py
`export_all`, into the output folder) is started on a free port, then vLLM's own benchmark client (what `vllm bench
serve` runs: `vllm.benchmarks.serve`; the CPU build's `vllm` console script fails on a package-metadata look-up, so
the module is run where it does) sends the study's workload at the recommendation's rate at the limits, and again
at `--factor` times that rate. Reads the study, writes nothing to it.

`--layout study` (the default) starts that server as the study's own runs through `vllm serve` started it
(engines/http_engine.py): on vLLM's CPU build its workers bound where vLLM binds them, the API server and the client
on the CPUs they leave, the engine core at a lower priority (engines/cpu_layout.py: on a machine of few cores, its
spinning otherwise starves the server and the client for seconds at a time). `--layout plain` runs the exported
command alone, as it would start on a machine of its own.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/served_check.py --studies-dir DIR --study NAME
        [--prompts 1000] [--factor 1.15] [--rate R] [--warmup-prompts N] [--layout study|plain] [--out FOLDER]

The rate: by default the config's rate at the limits as served (the confirmation's run through `vllm serve`,
search/confirmed.py `Confirmed.served_rate`); without one, its rate at the limits in process (the search trial's
stored "rate_at_limit"); `--rate` overrides. The line "rate:" says which was used.

The requests: the study's workload drawn afresh for `--prompts` requests (measurement/workload.py, the study's spec
and seed): each prompt and output length as the study draws them, written as a JSONL for vLLM's `timed_trace`
dataset (token-id prompts of exactly those lengths, ignore_eos, so every output has its set length; a request with a
shared prefix shares its first tokens with its group). The arrivals are vLLM's client's own (`--no-self-timed
--request-rate R --burstiness B`: Poisson for the usual workload, gamma for a bursty one, evenly spaced (`inf`) for
constant arrivals); a timestamped trace is replayed at its own rhythm scaled to the rate (`--self-timed`).
Closed-loop workloads and traces at their original timing have no rate to check: refused.

Each run: `--warmup-prompts` requests first (default the study's warm-up under load, capped at --prompts; 0: none)
at the run's first rate, not reported; then before each measured run the server's prefix cache is reset
(`/reset_prefix_cache`, VLLM_SERVER_DEV_MODE=1). Printed per run: the rate, the prompts, each limit with the
statistic vLLM's result JSON gives for it (`p99_ttft_ms`, `mean_tpot_ms`, `p99.9_itl_ms`, ...; E2E is vLLM's
`e2el`), holds or misses; then one summary line per run. Files (the export, the trace, the server's log, each
client's log and result JSON) go to --out (default: a new temporary folder). The server and every process it
started (the EngineCore included) are ended by the PIDs recorded at start; the last line says whether any is left.

Exit code: 0 when every limit holds at the rate (the factor's run is for information), 1 when one misses there,
2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.cli.common import add_common_flags, guarded, load_study
from optimizer.core.errors import OptimizerError, UsageError

# `vllm bench serve` without the `vllm` console script (the CPU build's fails on a package-metadata look-up)
VLLM_BENCH = """
import sys
import vllm.benchmarks.serve as S
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); S.add_cli_args(p); S.main(p.parse_args(sys.argv[1:]))
"""
BASE_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
VLLM_METRIC = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}  # ours -> vLLM's result-JSON name
HOST = "127.0.0.1"
START_TIMEOUT_S = 900.0
RESET_WAIT_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(p)
    p.add_argument("--prompts", type=int, default=1000, help="requests per measured run (default: %(default)s)")
    p.add_argument("--factor", type=float, default=1.15,
                   help="the second run's rate, as a multiple of the first's (default: %(default)s; 0: no second run)")
    p.add_argument("--rate", type=float, help="the rate to check, req/s (default: the recommendation's rate at the "
                                              "limits as served, else in process)")
    p.add_argument("--warmup-prompts", type=int, default=None,
                   help="requests sent at the rate before the measured runs, not reported (default: the study's warm-up "
                        "under load, at most --prompts; 0: none)")
    p.add_argument("--layout", choices=["study", "plain"], default="study",
                   help="how the server starts: 'study' as the study's own runs through `vllm serve` started it (on "
                   "vLLM's CPU build: its workers bound, the server and this client on the CPUs they leave, the engine "
                   "core at a lower priority; engines/cpu_layout.py), 'plain' as the exported command alone "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of vLLM's client (its arrival gaps; default %(default)s)")
    p.add_argument("--out", help="folder for the export, traces, logs and result JSONs (default: a new temp folder)")
    return p


# --- the study: its recommendation, its serve command, the rate to check ------------------------------------------

def export_command(ns: argparse.Namespace, out: Path) -> tuple[Any, Any, Any, Any, Any]:
    """(config, decision, recommended TrialView, Exported, the study's machine fingerprint) as `optimize export`
    makes them (cli/export.py::export_decision), the files written into `out`."""
    from optimizer.decision.decide import decide
    from optimizer.cli.export import export_decision
    from optimizer.search.attrs import STUDY_MACHINE

    config, study = load_study(ns)
    d = decide(study, config)
    return config, d, d.best, export_decision(d, config, study, out), STUDY_MACHINE.of(study)


def rate_to_check(d: Any, best: Any) -> tuple[float | None, str]:
    """The recommendation's rate at the limits as served (the confirmation's run through `vllm serve`), else in
    process (its search trial's pooled fit; a trial stored without one: the highest rate it passed), and what it is."""
    from optimizer.search.measured import measurement_of
    from optimizer.search.study import run_name

    conf = d.confirmed_of(best)
    why_not = "the study has no run as served (run with --no-served, or no confirmation)"
    if conf is not None and conf.served is not None:
        fit = conf.served_rate
        if fit is not None:
            bound = (" (a lower bound: no probe went past the limits)" if not math.isfinite(fit.high_rps)
                     else "")
            high = "open" if not math.isfinite(fit.high_rps) else f"{fit.high_rps:.2f}"
            return fit.rate_rps, (f"as served: the confirmation's run through vllm serve ({run_name(conf.served)}), "
                                  f"95% interval [{fit.low_rps:.2f}, {high}]{bound}")
        why_not = f"its run as served ({run_name(conf.served)}) found no rate at the limits"
    m = measurement_of(best.trial)
    fit = None if m is None else m.rate_at_limit
    if fit is not None:
        open_above = not math.isfinite(fit.high_rps)
        bound = " (a lower bound: no probe went past the limits)" if open_above else ""
        return fit.rate_rps, (
            f"in process: trial #{best.number}'s stored rate_at_limit, 95% interval [{fit.low_rps:.2f}, "
            f"{'open' if open_above else format(fit.high_rps, '.2f')}]{bound}; no served rate: {why_not}")
    if m is not None and m.rate_rps is not None:
        return float(m.rate_rps), (f"in process: the highest rate trial #{best.number} passed (no rate_at_limit "
                                   f"stored); no served rate: {why_not}")
    return None, f"trial #{best.number} stored no rate (a burst?), and {why_not}"


# --- the requests ---------------------------------------------------------------------------------------------------

def arrivals_mode(spec: Any) -> tuple[str, float]:
    """('poisson', burstiness) for vLLM's own arrivals at the rate (burstiness inf: evenly spaced), or ('trace', 0)
    for a timestamped trace replayed at its rhythm (vLLM's --self-timed); a UsageError where there is no rate."""
    if spec.arrivals == "closed_loop":
        raise UsageError(f"the study's workload is closed-loop ({spec.concurrency} clients): it has no rate to check; "
                         f"run vllm bench serve --max-concurrency {spec.concurrency} --request-rate inf yourself")
    if spec.trace and spec.trace_timing == "original":
        raise UsageError("the study replays its trace at the trace's own timing: there is no rate to check")
    if spec.trace and spec.trace[0][2] is not None and spec.arrivals == "poisson" and spec.burstiness == 1.0:
        return "trace", 0.0
    if spec.arrivals == "constant":
        return "poisson", math.inf
    return "poisson", float(spec.burstiness)


def chunk_size(spec: Any) -> int:
    """vLLM's timed_trace expands a prompt in chunks of this many tokens, one per hash id: a shared prefix is then
    whole chunks of its group's hash ids."""
    return spec.prefix_len if spec.prefixed and spec.prefix_len > 0 else 16


def write_trace(workload: Any, rate: float, chunk: int, path: Path) -> Path:
    """The workload as vLLM's timed_trace JSONL: each request's input and output length, its send offset at `rate`
    (used only with --self-timed), and hash ids: its shared prefix's (the group's) then fresh ones, so that no two
    prompts share tokens but a shared prefix."""
    next_hash = 0
    group_hash: dict[int, int] = {}
    with path.open("w") as f:
        for req, t in zip(workload.requests, workload.arrivals_s(rate)):
            hashes: list[int] = []
            own = req.input_len
            if req.prefix_group is not None:
                if req.prefix_group not in group_hash:
                    group_hash[req.prefix_group] = next_hash
                    next_hash += 1
                hashes.append(group_hash[req.prefix_group])
                own -= chunk
            n = max(0, math.ceil(own / chunk))
            hashes += list(range(next_hash, next_hash + n))
            next_hash += n
            f.write(json.dumps({"timestamp": t, "input_length": req.input_len, "output_length": req.output_len,
                                "hash_ids": hashes}) + "\n")
    return path


# --- the server -----------------------------------------------------------------------------------------------------

def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """`optimize export`'s command -> (its NAME=value environment, the argv after it)."""
    words = shlex.split(command)
    env: dict[str, str] = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(server: Any, base: str, timeout_s: float = START_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while server.exit_code() is None:
        server.refresh()
        if healthy(base):
            server.refresh()
            return True
        if time.monotonic() > deadline:
            raise OptimizerError(f"the server did not answer /health within {timeout_s:.0f} s: see {server.log_path}")
        time.sleep(0.5)
    return False


def reset_prefix_cache(base: str) -> str:
    """POST /reset_prefix_cache, retried while running requests still hold blocks; what happened, in words."""
    deadline = time.monotonic() + RESET_WAIT_S
    while True:
        try:
            req = urllib.request.Request(f"{base}/reset_prefix_cache", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=10) as resp:
                body = json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return f"not reset (HTTP {exc.code}: the server lacks VLLM_SERVER_DEV_MODE=1?)"
        if not isinstance(body, dict) or body.get("success", True):
            return "reset"
        if time.monotonic() >= deadline:
            return f"not reset (blocks still held after {RESET_WAIT_S:.0f} s)"
        time.sleep(0.25)


# --- vLLM's client --------------------------------------------------------------------------------------------------

def bench_launcher() -> list[str]:
    """`vllm bench serve` where the console script runs, else the same code (vllm.benchmarks.serve) by module."""
    import shutil

    from optimizer.decision.export import vllm_console_script_works

    if vllm_console_script_works() and shutil.which("vllm"):
        return ["vllm", "bench", "serve"]
    return [sys.executable, "-c", VLLM_BENCH]


def percentiles_for(limits: Any) -> list[float]:
    """vLLM's --metric-percentiles: the usual ones plus any a limit (or goodput's reading) asks for."""
    wanted = set(BASE_PERCENTILES)
    for lim in limits:
        stat = limits.stat_of(lim)
        if stat.startswith("p"):
            wanted.add(float(stat[1:]))
    return sorted(wanted)


def p_word(p: float) -> str:
    """vLLM's spelling of a percentile in its result keys (serve.py: '99', '99.9')."""
    return str(int(p)) if int(p) == p else str(p)


def result_key(metric: str, stat: str) -> str:
    """'p99_ttft_ms', 'p99.9_itl_ms', 'mean_e2el_ms': the result-JSON key of our metric's statistic."""
    m = VLLM_METRIC[metric]
    return f"mean_{m}_ms" if stat == "mean" else f"p{p_word(float(stat[1:]))}_{m}_ms"


def run_bench(launcher: list[str], base: str, served_name: str, tokenizer: str, trace: Path, chunk: int, mode: str,
              burstiness: float, rate: float, n: int, seed: int, limits: Any, out: Path, tag: str) -> dict[str, Any]:
    """One `vllm bench serve` run; its result JSON (the client's output in out/tag.log)."""
    args = ["--backend", "vllm", "--base-url", base, "--endpoint", "/v1/completions", "--model", served_name,
            "--tokenizer", tokenizer, "--dataset-name", "timed_trace", "--dataset-path", str(trace),
            "--timed-trace-chunk-hash-size", str(chunk),
            *(["--self-timed"] if mode == "trace" else
              ["--no-self-timed", "--request-rate", repr(rate), "--burstiness", repr(burstiness)]),
            "--num-prompts", str(n), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(p_word(p) for p in percentiles_for(limits))]
    if limits.goodput_pct is not None:
        args += ["--goodput", *(f"{VLLM_METRIC[lim.metric]}:{lim.value_ms:g}" for lim in limits)]
    args += ["--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{tag}.json"]
    log = out / f"{tag}.log"
    shown = ["vllm", "bench", "serve"] if launcher[:2] != ["vllm", "bench"] else []
    with log.open("w") as f:
        f.write(f"$ {shlex.join([*(shown or launcher), *args])}\n")
        f.flush()
        env = {**os.environ, "PYTHONHASHSEED": "0"}  # timed_trace seeds each chunk's tokens by hash(): reproducible
        proc = subprocess.Popen([*launcher, *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(600.0, 30.0 * n / rate if rate > 0 else 600.0))
        except BaseException:  # Ctrl-C, SIGTERM, a timeout: the client goes too
            _end_group(proc)
            raise
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise OptimizerError(f"vllm bench serve failed (exit {code}); its log {log}:\n{tail}")
    return json.loads((out / f"{tag}.json").read_text())


def _end_group(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the verdicts ---------------------------------------------------------------------------------------------------

def ms(v: float) -> str:
    return f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


def verdicts(result: dict[str, Any], limits: Any, n: int) -> tuple[list[str], list[str]]:
    """(one line per limit, the misses for the summary)."""
    lines, misses = [], []
    if limits.goodput_pct is not None:
        good = round((result.get("request_goodput") or 0.0) * result["duration"])
        share = 100.0 * good / n
        ok = share >= limits.goodput_pct - 1e-9
        lines.append(f"goodput {limits.goodput_pct:g}% (each request within {' and '.join(l.text for l in limits)}): "
                     f"request_goodput x duration = {good} of {n} requests good ({share:.1f}%): "
                     f"{'holds' if ok else 'misses'}")
        if not ok:
            misses.append(f"goodput misses ({share:.1f}% < {limits.goodput_pct:g}%)")
        for lim in limits:  # for reading only: goodput counts requests within every limit at once
            key = result_key(lim.metric, limits.stat_of(lim))
            lines.append(f"  ({lim.metric.upper()} {limits.stat_of(lim).upper()}: {key} "
                         f"{ms(float(result.get(key, math.nan)))}, limit {ms(lim.value_ms)})")
        return lines, misses
    width = max(len(lim.text) for lim in limits)
    for lim in limits:
        key = result_key(lim.metric, lim.stat)
        value = result.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            lines.append(f"{lim.text:<{width}}  {key} not in vLLM's result: misses")
            misses.append(f"{lim.name} not measured")
            continue
        ok = value <= lim.value_ms
        lines.append(f"{lim.text:<{width}}  {key} = {ms(value)}: {'holds' if ok else 'misses'}")
        if not ok:
            misses.append(f"{lim.name} misses ({ms(value)} > {ms(lim.value_ms)})")
    return lines, misses


def run_line(result: dict[str, Any], rate: float, n: int) -> str:
    failed = int(result.get("failed") or 0)
    return (f"{result['completed']} of {n} completed, {failed} failed, in {result['duration']:.2f} s: "
            f"{result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} output tok/s "
            f"(offered {rate:.2f} req/s), at most {result.get('max_concurrent_requests', '?')} requests at once")


def client_line(result: dict[str, Any], workload: Any, n: int, mode: str, rate: float) -> str:
    """How vLLM's client sent the run: its send span beside its schedule's, and whether the lengths it sent and
    got are the workload's (its detailed result: --save-detailed)."""
    starts = [t for t in result.get("start_times") or [] if t]
    span = max(starts) - min(starts) if len(starts) > 1 else math.nan
    planned = (workload.arrivals_s(rate)[n - 1] if mode == "trace" else n / rate)
    want_in = sorted(q.input_len for q in workload.requests[:n])
    want_out = sorted(q.output_len for q in workload.requests[:n])
    got_in, got_out = sorted(result.get("input_lens") or []), sorted(result.get("output_lens") or [])
    lengths = ("prompt and output lengths as drawn" if (got_in, got_out) == (want_in, want_out) else
               f"lengths differ from the draw: inputs {sum(got_in)} tokens (drawn {sum(want_in)}), outputs "
               f"{sum(got_out)} (drawn {sum(want_out)})")
    return (f"client: first to last send {span:.2f} s (the schedule spans about {planned:.2f} s: "
            f"{'vLLM draws n gaps to n/rate' if mode != 'trace' else 'the trace'}); {lengths}")


# --- main -----------------------------------------------------------------------------------------------------------

def check(ns: argparse.Namespace) -> int:
    from optimizer.config.model import inspect_model
    from optimizer.core.processes import remove_rpc_dir, renew_rpc_dir
    from optimizer.decision.export import allocator_line
    from optimizer.engines import allocator
    from optimizer.engines.server import ServerProcess, free_port
    from optimizer.hardware.machine import allocator_here, find_tcmalloc, study_allocator
    from optimizer.measurement.workload import build_workload
    from optimizer.search.runner import model_path

    if ns.prompts < 1:
        raise UsageError("--prompts must be at least 1")
    if ns.factor < 0 or (ns.rate is not None and not (ns.rate > 0 and math.isfinite(ns.rate))):
        raise UsageError("--factor must be 0 or more, --rate a finite rate above 0 (req/s)")
    out = Path(ns.out or tempfile.mkdtemp(prefix="served-check-"))
    out.mkdir(parents=True, exist_ok=True)
    config, d, best, done, machine = export_command(ns, out)
    limits, spec = config.limits, config.workload
    mode, burstiness = arrivals_mode(spec)
    print(f"study {config.study_name!r}: {limits.text}; recommended trial #{best.number}"
          + (" (vLLM's defaults)" if best.baseline else ""))
    print(f"serve command (optimize export, files in {out}):\n  {done.command}")
    for note in done.notes:
        print(f"  note: {note}")

    rate, source = rate_to_check(d, best)
    if ns.rate is not None:
        source, rate = f"--rate (the study's: {f'{rate:.2f} req/s' if rate else 'none'}; {source})", ns.rate
    if rate is None or not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"no rate to check: {source}; give --rate R")
    rates = [("the rate", rate)] + ([(f"{ns.factor:g} x the rate", ns.factor * rate)] if ns.factor > 0 else [])
    print(f"rate: {rate:.2f} req/s, {source}")

    model = model_path(config)
    n = ns.prompts
    if spec.trace and n > len(spec.trace):
        print(f"note: the study's trace has {len(spec.trace)} rows: {len(spec.trace)} prompts per run, not {n}")
        n = len(spec.trace)
    warm = min(spec.warmup_load_requests, n) if ns.warmup_prompts is None else max(0, min(ns.warmup_prompts, n))
    workload = build_workload(spec.model_copy(update={"num_requests": n}), inspect_model(model).vocab_size)
    chunk = chunk_size(spec)
    traces = {r: write_trace(workload, r, chunk, out / f"trace-{i}.jsonl") for i, (_, r) in enumerate(rates)}
    ins = [q.input_len for q in workload.requests]
    outs = [q.output_len for q in workload.requests]
    how = ("the trace's timestamps scaled to each rate (--self-timed)" if mode == "trace" else
           "vLLM's client's evenly spaced arrivals (--burstiness inf)" if burstiness == math.inf else
           f"vLLM's client's Poisson arrivals (--request-rate, seed {ns.seed})" if burstiness == 1 else
           f"vLLM's client's gamma arrivals (--burstiness {burstiness:g}, seed {ns.seed})")
    print(f"workload: {spec.describe()}; drawn for {n} prompts: inputs {min(ins)}-{max(ins)} tokens (mean "
          f"{sum(ins) / n:.1f}), outputs {min(outs)}-{max(outs)} (mean {sum(outs) / n:.1f}), ignore_eos; {how}")
    if spec.skip_first_fraction or spec.skip_last_fraction:
        print(f"note: the study leaves the first {spec.skip_first_fraction:.0%} and last {spec.skip_last_fraction:.0%} "
              f"of each replay out of its percentiles; vLLM's client counts every request")

    words_env, argv = split_command(done.command)
    env = {**os.environ, **words_env, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: for /reset_prefix_cache
    said = None
    if allocator_line(config.device, study_allocator(machine, allocator_here()), find_tcmalloc()):
        said = allocator.preload_tcmalloc(env)  # as the export's note says: the study's engines ran on it
        print(f"allocator: {said.removeprefix('optimizer: ')}")
    launcher = bench_launcher()
    server = None
    rpc = None
    engine, loop = None, None
    results: list[tuple[str, float, dict[str, Any], list[str], list[str]]] = []
    try:
        if ns.layout == "study":  # the study's own served runs' engine: the same start, layout and priorities
            import asyncio

            from optimizer.search.attrs import ENGINE_PARAMS
            from optimizer.search.runner import served_factory_for

            engine, loop = served_factory_for(config, str(model))(), asyncio.new_event_loop()
            t0 = time.monotonic()
            loop.run_until_complete(engine.start(ENGINE_PARAMS.of(best.trial), out / "server.log"))
            base = engine.base_url
        for attempt in range(0 if engine is not None else 3):
            port = free_port(HOST)
            rpc, sockets = renew_rpc_dir(rpc, env)
            server = ServerProcess([*argv, "--host", HOST, "--port", str(port)], out / "server.log",
                                   {**env, **sockets})
            base = f"http://{HOST}:{port}"
            t0 = time.monotonic()
            server.start()
            if said:
                server.note(said)
            if wait_ready(server, base):
                break
            server.stop()
            text = server.log_text()
            if "address already in use" in text.lower() and attempt < 2:
                continue
            raise OptimizerError(f"the server exited with code {server.exit_code()} before it answered /health:\n"
                                 f"{text[-3000:]}")
        models = get_json(f"{base}/v1/models")["data"]
        served_name = models[0]["id"]
        pids = engine.pids if engine is not None else [r.pid for r in server.refresh()]
        print(f"server: up in {time.monotonic() - t0:.0f} s at {base} ({ns.layout} layout), PIDs "
              f"{', '.join(map(str, pids))}, model {served_name!r}; log {out / 'server.log'}")

        if warm:
            t1 = time.monotonic()
            run_bench(launcher, base, served_name, model, traces[rates[0][1]], chunk, mode, burstiness, rates[0][1],
                      warm, ns.seed + 1, limits, out, "warmup")
            print(f"warm-up: {warm} prompts at {rates[0][1]:.2f} req/s in {time.monotonic() - t1:.0f} s, not reported")
        for i, (label, r) in enumerate(rates):
            reset = reset_prefix_cache(base)
            result = run_bench(launcher, base, served_name, model, traces[r], chunk, mode, burstiness, r, n,
                               ns.seed, limits, out, f"run-{i + 1}")
            lines, misses = verdicts(result, limits, n)
            if int(result.get("failed") or 0):
                misses.append(f"{result['failed']} of {n} requests failed")
            results.append((label, r, result, lines, misses))
            print(f"\nrun {i + 1} of {len(rates)}: {label}, {r:.2f} req/s, {n} prompts (prefix cache {reset})")
            print(f"  {run_line(result, r, n)}")
            print(f"  {client_line(result, workload, n, mode, r)}")
            for line in lines:
                print(f"  {line}")
            print(f"  {summary(label, r, rate, ns.factor, misses)}")
            print(f"  client log {out / f'run-{i + 1}.log'}, result {out / f'run-{i + 1}.json'}")
    finally:
        if engine is not None:
            pids = list(engine.pids)
            loop.run_until_complete(engine.shutdown())
            loop.close()
            import psutil

            left = [pid for pid in pids if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            print(f"\nserver ended: PIDs {', '.join(map(str, pids))}; "
                  + (f"STILL RUNNING: {left}" if left else "none left"))
        if server is not None:
            refs = server.refresh()
            server.stop()
            left = [r.pid for r in refs if r.alive() is not None]
            print(f"\nserver ended: PIDs {', '.join(str(r.pid) for r in refs)}; "
                  + (f"STILL RUNNING: {left}" if left else "none left"))
        remove_rpc_dir(rpc)

    print("\nsummary:")
    for label, r, _, _, misses in results:
        print(f"  {summary(label, r, rate, ns.factor, misses)}")
    return 1 if results and results[0][4] else 0


def summary(label: str, r: float, rate: float, factor: float, misses: list[str]) -> str:
    """'at 211.47 req/s: every limit holds'; 'at 1.15 x 211.47 = 243.19 req/s: TPOT P99 misses (61 ms > 50 ms)'."""
    at = f"at {r:.2f} req/s" if label == "the rate" else f"at {factor:g} x {rate:.2f} = {r:.2f} req/s"
    return f"{at}: " + ("every limit holds" if not misses else "; ".join(misses))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    def run() -> int:
        from optimizer.core.signals import interrupted_exit_code

        try:
            return check(ns)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (guarded's handlers): the server and client are ended by now
            print("served_check stopped before it finished: nothing to resume, run it again", file=sys.stderr)
            return interrupted_exit_code()

    return guarded(ns.debug, run)


if __name__ == "__main__":
    sys.exit(main())
