"""The recommended configuration in the forms people deploy with: `vllm serve` flags and a `--config` YAML."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import FrozenTrial

from optimizer.config import StudyConfig
from optimizer.errors import OptimizerError
from optimizer.space import SEARCHABLE
from optimizer.units import format_ms


def serve_args(trial: FrozenTrial, config: StudyConfig, model: str) -> dict[str, Any]:
    """Engine arguments to deploy: the trial's resolved values of the searched knobs, plus what was fixed."""
    resolved = trial.user_attrs.get("engine_config", {})
    args: dict[str, Any] = {"model": model}
    args.update({k: v for k, v in config.engine_args.items() if k != "disable_log_stats"})
    if config.dummy_weights:
        args["load_format"] = "dummy"
    args.update({k: v for k, v in config.space.fixed.items() if k not in SEARCHABLE})
    args.update({k: resolved[k] for k in SEARCHABLE if k in resolved and resolved[k] is not None})
    return args


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def to_serve_command(args: dict[str, Any]) -> str:
    parts = ["vllm", "serve", shlex.quote(str(args["model"]))]
    for k, v in args.items():
        if k == "model":
            continue
        if isinstance(v, bool):
            parts.append(_flag(k) if v else "--no-" + k.replace("_", "-"))
        else:
            parts += [_flag(k), shlex.quote(str(v))]
    return " ".join(parts)


def to_yaml(args: dict[str, Any], header: list[str]) -> str:
    body = yaml.safe_dump({k.replace("_", "-"): v for k, v in args.items()}, sort_keys=False)
    return "".join(f"# {line}\n" for line in header) + body


def header_lines(trial: FrozenTrial, config: StudyConfig) -> list[str]:
    r = trial.user_attrs.get("result", {})
    w = config.workload
    rate = r.get("rate_rps")
    return [
        f"Recommended by optimize, study {config.study_name!r}, trial #{trial.number}.",
        f"SLO: TTFT P99 <= {format_ms(config.ttft_p99_ms)}.",
        f"Workload: Poisson arrivals, {w.num_requests} requests per replay, inputs {w.input_len_min}-"
        f"{w.input_len_max} tokens, outputs {w.output_len_min}-{w.output_len_max} tokens, seed {w.seed}.",
        f"Measured: {r.get('output_throughput_tok_s', 0):.1f} output tok/s at "
        f"{'a burst' if rate is None else f'{rate:.2f} req/s'}, TTFT P50 {format_ms(r.get('ttft_p50_ms', 0))}, "
        f"P99 {format_ms(r.get('ttft_p99_ms', 0))}.",
    ]


def export(trial: FrozenTrial | None, config: StudyConfig, out_dir: Path, model: str) -> tuple[str, Path]:
    """Write `<study>.recommended.yaml` (for `vllm serve --config`); return the serve command and the path."""
    if trial is None:
        raise OptimizerError(
            f"study {config.study_name!r} has no trial that meets TTFT P99 <= {format_ms(config.ttft_p99_ms)}: "
            f"nothing to export. Relax the limit (--ttft-p99), widen the search space, or run more trials."
        )
    args = serve_args(trial, config, model)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{config.study_name}.recommended.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(args, header_lines(trial, config)))
    tmp.replace(path)
    return to_serve_command(args), path
