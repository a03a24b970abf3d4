"""`optimize calibrate`: fit the simulator's step-time model to the real engine and report its error.

Same edge rules as the main command: flags -> typed values -> library (optimizer/engines/sim/calibrate.py) -> print;
bad input exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from optimizer.cli.common import guarded, positive_int
from optimizer.cli.manual import new_parser
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD


def build_parser() -> argparse.ArgumentParser:
    """The parser of `optimize calibrate`, with its help page (cli/manual.py)."""
    p = new_parser(
        "optimize calibrate",
        "Run short probes on the real engine (one start), fit the simulator's step-time model, then replay the "
        "workload on held-out configs on both the real engine and the simulator and print the simulator's error "
        "(output throughput, TTFT P99). Writes a JSON that `--calibration FILE` of a study or benchmark reads. "
        "Takes about 5 minutes on the CPU engine with the default model.",
        [("optimize calibrate --out studies/calibration.json", "fit and check the simulator on this machine"),
         ("optimize --prescreen 60 --calibration studies/calibration.json --ttft-p99 150ms --budget 15",
          "then use it: 60 simulated trials before 15 real ones")])
    p.add_argument("--model", help="local model directory, or one of the embedded demo models (tiny-llama-17m, "
                   "tiny-llama-7m, tiny-llama-4m: calibrate the one your demo study chose); default: tiny-llama-17m")
    p.add_argument("--dummy-weights", action="store_true", help="random weights from config.json alone")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="engine build (default: %(default)s)")
    p.add_argument("--out", default="studies/calibration.json", help="where to write it (default: %(default)s)")
    p.add_argument("--repeats", default="3", help="repeats of each probe (default: %(default)s)")
    p.add_argument("--validate", default="3", help="held-out configs to check the simulator on, 0 to skip "
                   "(default: %(default)s)")
    p.add_argument("--num-requests", default=str(CPU_DEMO_WORKLOAD["num_requests"]),
                   help="requests per validation replay, of the CPU demo workload (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_calibrate(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _calibrate(ns), "calibrate")


def _calibrate(ns: argparse.Namespace) -> int:
    from optimizer.engines.sim.calibrate import VALIDATION_PARAMS, calibrate
    from optimizer.core.clock import MonotonicClock
    from optimizer.config.workload_spec import WorkloadSpec
    from optimizer.engines.simulated import SimulatedEngine
    from optimizer.core.errors import UsageError
    from optimizer.search.fitting import cpu_engine_args
    from optimizer.hardware.machine import fingerprint
    from optimizer.config.model import DEFAULT_MODEL_NAME, DEMO_LADDER, default_model, inspect_model
    from optimizer.params.preflight import DeviceMemory
    from optimizer.search.runner import vllm_factory
    from optimizer.measurement.workload import build_workload

    from optimizer.core.paths import check_output_file
    from optimizer.hardware.device import check_build, gpu_name

    check_build(ns.device)  # --device cuda on the CPU build (or the reverse): exit 2, naming the install
    repeats = positive_int(ns.repeats, "--repeats")
    num_requests = positive_int(ns.num_requests, "--num-requests")
    if num_requests < 10:
        raise UsageError("--num-requests must be at least 10: a TTFT P99 needs requests to stand on")
    try:
        n_validate = int(ns.validate)
    except ValueError:
        raise UsageError(f"--validate {ns.validate!r} is not a whole number") from None
    if not 0 <= n_validate <= len(VALIDATION_PARAMS):
        raise UsageError(f"--validate must be between 0 and {len(VALIDATION_PARAMS)}")
    out = check_output_file(ns.out, "--out", "calibration.json")
    embedded = {shape.name for shape in DEMO_LADDER}
    path = str(default_model(ns.model or DEFAULT_MODEL_NAME)) if ns.model in (None, *embedded) else ns.model
    info = inspect_model(path, ns.dummy_weights)
    base = {"model": info.path, **(cpu_engine_args(info.dtype) if ns.device == "cpu" else {"enforce_eager": False})}
    if ns.dummy_weights:
        base["load_format"] = "dummy"
    memory = DeviceMemory.probe(ns.device)
    total = memory.total_bytes if memory else 24 * 1024**3
    name = gpu_name(ns.device)  # the GPU's name picks vLLM's defaults, as for the engine
    workload = build_workload(WorkloadSpec(**{**CPU_DEMO_WORKLOAD, "num_requests": num_requests}), info.vocab_size)

    def say(*a):
        print(*a, file=sys.stderr)

    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    say(f"calibrating on {info.path}: engine output goes to {log_path}")

    def simulated(m):
        return SimulatedEngine(info, m, ns.device, total, device_name=name)

    result = asyncio.run(calibrate(vllm_factory(base), simulated, workload, info.max_len, MonotonicClock(),
                                   VALIDATION_PARAMS[:n_validate], repeats, say, log_path))
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps({**result.to_dict(), "machine": fingerprint(ns.device)}, indent=2) + "\n")
    tmp.replace(out)
    m = result.model
    print(f"step time = {m.fixed_s * 1e3:.2f} ms + {m.prefill_token_s * 1e6:.1f} us/prefill token + "
          f"{m.decode_seq_s * 1e6:.0f} us/decode sequence + {m.context_token_s * 1e9:.0f} ns/context token + "
          f"{m.prefill_attention_s * 1e9:.1f} ns/attended token pair + {m.request_s * 1e3:.2f} ms/new request")
    if result.validation:
        thr, ttft = result.median_abs_error("throughput_error"), result.median_abs_error("ttft_p99_error")
        spread_thr = result.median_abs_error("real_throughput_spread")
        spread_ttft = result.median_abs_error("real_ttft_p99_spread")
        print(f"simulator vs real engine on {n_validate} held-out configs ({len(result.validation)} points): "
              f"median |error| output throughput {_pct(thr)}, TTFT P99 {_pct(ttft)}; the real engine against "
              f"itself (two runs of each point): {_pct(spread_thr)}, {_pct(spread_ttft)}")
    print(f"wrote {out} (use: --calibration {out})")
    return 0


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"
