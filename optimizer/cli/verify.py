"""`optimize verify`: measure the best configs of a study again under other seeds, bursts and long prompts.

Same edge rules as the main command: flags -> typed values -> library -> print; bad input is a UsageError
(exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimizer.cli.common import add_common_flags, guarded, load_study, positive_int
from optimizer.cli.manual import new_parser
from optimizer.core.errors import UsageError
from optimizer.search.attrs import STUDY_VERIFY


def build_parser() -> argparse.ArgumentParser:
    """The parser of `optimize verify`, with its help page (cli/manual.py)."""
    p = new_parser(
        "optimize verify",
        "Run the recommended config and the next best ones again, each on a fresh engine at the rate it was "
        "recommended for, under other arrival seeds, burstier (gamma) arrivals and a surge of long prompts; report "
        "the worst case of each of the study's limits and recommend the most robust config (the most headroom under "
        "every limit) within a small throughput margin of the best. Starts engines: minutes per config.",
        [("optimize verify --study llama", "the 3 best configs, 2 other seeds each"),
         ("optimize verify --study llama --top 1 --seeds 4 --margin 10%", "the recommendation alone, 4 seeds")])
    add_common_flags(p)
    p.add_argument("--top", default="3", help="how many of the best feasible configs to verify (default: %(default)s)")
    p.add_argument("--seeds", default="2", help="other arrival seeds per config (default: %(default)s)")
    p.add_argument("--margin", default="5%", help="throughput margin within which the most robust config wins "
                   "(default: %(default)s)")
    return p


def cmd_verify(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _verify(ns), "verify")


def _percent(text: str, what: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a share: write e.g. 5% or 0.05") from None
    if not 0 <= value < 1:
        raise UsageError(f"{what} {text!r} must be between 0% and 100%")
    return value


def _verify(ns: argparse.Namespace) -> int:
    import asyncio
    import json

    from optimizer.decision.tables import format_output
    from optimizer.core.errors import OptimizerError
    from optimizer.config.model import inspect_model
    from optimizer.search.score import best_first
    from optimizer.search.runner import factory_for, model_path
    from optimizer.decision.verify import report_rows, robust_choice, values_heading, verify_trial

    top, seeds = positive_int(ns.top, "--top"), positive_int(ns.seeds, "--seeds")
    margin = _percent(ns.margin, "--margin")
    config, study = load_study(ns)
    ranked = best_first(study)  # the one score (search/score.py), best first
    if not ranked:
        raise OptimizerError(f"study {ns.study!r} has no trial that meets {config.limits.text}: nothing to verify. "
                             f"Relax the limits or run more trials first.")
    path = model_path(config)
    info = inspect_model(path, config.dummy_weights)
    factory = factory_for(config, path)  # the backend the study measured with
    logs = Path(ns.studies_dir) / f"{config.study_name}.logs"
    results = []
    for t in ranked[:top]:
        if not ns.quiet:
            print(f"verifying trial #{t.number} ({t.values[0]:.1f} tok/s) ...", file=sys.stderr)
        results.append(asyncio.run(verify_trial(t, config, factory, info.vocab_size, seeds or 1,
                                                logs / f"verify-{t.number:05d}.log")))
    limits = config.limits
    chosen = robust_choice(results, margin, limits)
    print(values_heading(limits))
    print(format_output(report_rows(results, limits, chosen), "table"))
    if chosen is None:
        print(f"No verified config holds {limits.text} under every variant: deploy with headroom (a lower rate "
              f"than recommended), or run a study with stricter limits than {limits.flags}.")
    else:
        best = results[0]
        note = "" if chosen is best else (f" (trial #{best.trial_number} serves {best.throughput_tok_s:.1f} tok/s but is "
                                          f"less robust)")
        worst = ", ".join(f"{lim.name} {chosen.worst_ms(lim, limits):.0f}ms" for lim in limits)
        print(f"most robust within {margin:.0%} of the best throughput: trial #{chosen.trial_number}, "
              f"{chosen.throughput_tok_s:.1f} tok/s, worst {worst}{note}")
    out = Path(ns.studies_dir) / f"{config.study_name}.verify.json"
    payload = {"limits": limits.model_dump(mode="json"), "margin": margin,
               "recommended_trial": None if chosen is None else chosen.trial_number,
               "results": [r.to_dict(limits) for r in results]}
    out.write_text(json.dumps(payload, indent=2, default=str))
    STUDY_VERIFY.set(study, payload)
    if not ns.quiet:
        print(f"wrote {out}", file=sys.stderr)
    return 0
