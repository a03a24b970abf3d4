"""How often a probe's joint verdict on several limits is wrong: the error rates docs/limits.md states.

Each probe replays requests sent one after another at a steady pace, each with a first token and a decode drawn so
that a set share of the requests is over each limit (TTFT and TPOT independently), through the probe's own rule
(optimizer/measurement/probe_rule.py), as a live replay would ask it, up to the workload's request count. A rate
with more than 1% over either limit is bad: its pass is a wrong pass. A rate with at most 1% over every limit is
good: its fail is a wrong fail. The rule promises at most 5% wrong passes (the intersection-union test, with no
correction) and at most 5% wrong fails (Bonferroni over the limits on the fail side); near 1% the test is unsettled
at the cap more often, and an unsettled probe reads by its counts.

    .venv/bin/python benchmarks/joint_verdict.py --probes 400
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.config.limits import parse_limits  # noqa: E402
from optimizer.measurement.metrics import RequestRecord  # noqa: E402
from optimizer.measurement.probe_rule import ProbeRule  # noqa: E402

TTFT_MS, TPOT_MS, TOKENS, RATE_RPS = 150.0, 50.0, 8, 20.0
# (name, share over TTFT, share over TPOT, bad): rates on each side of the limits and at them
SCENARIOS = [
    ("good: 0.2% over each", 0.002, 0.002, False),
    ("good: 0.5% over TPOT only", 0.0, 0.005, False),
    ("at the limits: 1% over TPOT only", 0.0, 0.01, None),
    ("at the limits: 1% over each", 0.01, 0.01, None),
    ("bad: 2% over TPOT only", 0.0, 0.02, True),
    ("bad: 2% over each", 0.02, 0.02, True),
    ("bad: 3% over TPOT only", 0.0, 0.03, True),
]


def records(rng: np.random.Generator, n: int, ttft_share: float, tpot_share: float) -> list[RequestRecord]:
    out = []
    for i in range(n):
        sent = i / RATE_RPS
        ttft_ms = TTFT_MS * (1.5 if rng.random() < ttft_share else rng.uniform(0.2, 0.9))
        tpot_ms = TPOT_MS * (1.5 if rng.random() < tpot_share else rng.uniform(0.3, 0.9))
        r = RequestRecord(index=i, input_len=64, planned_s=sent, sent_s=sent)
        r.first_token_s = sent + ttft_ms / 1000
        r.chunk_times_s = [r.first_token_s + j * tpot_ms / 1000 for j in range(TOKENS)]
        r.output_tokens, r.ok = TOKENS, True
        out.append(r)
    return out


def verdict(rule: ProbeRule, recs: list[RequestRecord]) -> bool:
    """Whether the probe passes, asked send by send as a live replay asks it."""
    for k in range(1, len(recs) + 1):
        if rule(recs[:k], recs[k - 1].sent_s):
            recs = recs[:k]
            break
    return rule.evidence(recs).passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=300, help="probes per scenario")
    ap.add_argument("--requests", type=int, default=1000, help="the most requests a probe sends")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    limits = parse_limits(f"{TTFT_MS}ms", f"{TPOT_MS}ms")
    print(f"limits {limits.text}; {args.probes} probes of up to {args.requests} requests each")
    print(f"{'scenario':36} {'passed':>8} {'wrong':>8}")
    for name, ttft_share, tpot_share, bad in SCENARIOS:
        passed = sum(verdict(ProbeRule(limits, args.requests), records(rng, args.requests, ttft_share, tpot_share))
                     for _ in range(args.probes))
        share = passed / args.probes
        wrong = "" if bad is None else f"{share if bad else 1 - share:8.1%}"
        print(f"{name:36} {share:8.1%} {wrong:>8}")


if __name__ == "__main__":
    main()
