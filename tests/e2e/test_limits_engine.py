"""A TPOT limit beside the TTFT one, on the real vLLM CPU engine, as a user runs `optimize`: the limit binds the
trial, the trial line names it, and the rate it fails at is one whose TTFT was within its limit (the TTFT limit alone
would not have stopped it there)."""

import subprocess
import sys

import pytest

from optimizer.core.units import format_ms
from tests.conftest import REPO, subprocess_env
from tests.support.fakes import load

pytestmark = pytest.mark.engine

SMALL = ["--num-requests", "40", "--input-len", "16:96", "--output-len", "8:24", "--budget", "1", "--no-served"]


def optimize(cache, studies, *args):
    proc = subprocess.run([sys.executable, "-m", "optimizer", *args, "--studies-dir", str(studies)], cwd=REPO,
                          env=subprocess_env(cache), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_a_tpot_limit_binds_vllms_defaults_and_the_trial_line_names_it(tmp_path, tiny_model, model_cache):
    alone = optimize(model_cache, tmp_path, *SMALL, "--study", "ttft", "--ttft-p99", "150ms")
    base = load(tmp_path, "ttft").trials[0]
    result = base.user_attrs["result"]
    assert result["feasible"], alone[-2000:]
    best = next(p for p in base.user_attrs["curve"] if p["offered_rate_rps"] == result["rate_rps"])
    # a TPOT limit well under what vLLM's defaults stream at their rate under TTFT alone: it must bind them. TPOT P99
    # changes little with the rate on this engine, and a second run may stream a tenth faster than the first: the
    # limit sits a fifth under, so the second run cannot pass it by chance at every rate the TTFT limit allows
    tpot_ms = round(0.8 * best["stats"]["tpot"]["p99"], 1)
    both = optimize(model_cache, tmp_path, *SMALL, "--study", "both", "--ttft-p99", "150ms",
                    "--tpot-p99", f"{tpot_ms}ms")
    trial = load(tmp_path, "both").trials[0]
    r = trial.user_attrs["result"]
    assert r["bound_by"]["limit"] == "tpot:p99", r
    assert r["bound_by"]["text"] in both and f"TPOT P99 <= {format_ms(tpot_ms)}" in both
    assert set(trial.constraints) >= {"ttft_p99_over_limit", "tpot_p99_over_limit"}
    if r["feasible"]:  # it holds TPOT at its rate; the rate above failed on TPOT while its TTFT was within
        assert r["values_at_rate_ms"]["tpot:p99"] <= tpot_ms * 1.05
        failed = next(p for p in trial.user_attrs["curve"] if p["offered_rate_rps"] == r["bound_by"]["rate_rps"])
        parts = {d["key"]: d for d in failed["limits"]}
        assert failed["binding"] == "tpot:p99" and parts["ttft:p99"]["within"], failed
    else:  # or at no rate the search tried: its closest point misses TPOT
        assert "over the limit" in both and trial.constraints["tpot_p99_over_limit"] > 0
