"""The GPU demo's estimated time on one H100 (search/gpu_demo.py), checked by hand, and the start's line that says it."""

from __future__ import annotations

import pytest

from optimizer.config.demo import demo_for
from optimizer.config.settings import StudyConfig
from tests.support.fake_engine import FakeEngine
from optimizer.search.gpu_demo import START_PHASES_S, estimate_s, estimate_text, start_s
from optimizer.search.runner import prepare


def gpu_demo_config(tmp_path, **fields) -> StudyConfig:
    """What resolve_config makes of `optimize --ttft-p99 150ms --budget 40` on a GPU host with the CUDA build."""
    return StudyConfig(**{"study_name": "demo", "storage_url": f"sqlite:///{tmp_path}/demo.db", "ttft_p99_ms": 150.0,
                          "budget": 40, "device": "cuda", **demo_for("cuda").settings(), **fields})


def test_an_engine_start_is_the_sum_of_its_phases():
    assert len(START_PHASES_S) == 6 and "torch.compile" in START_PHASES_S and "CUDA graph capture" in START_PHASES_S
    assert start_s() == (37.0, 94.0)


def test_the_readmes_study_on_one_h100_by_hand(tmp_path):
    """--budget 40: 14 search trials and 26 runs (8 rounds of 3, 2 served). A probe at the cap is 2000 requests at
    80 or 40 req/s (25 or 50 s), the warm-up under load 300 (3.75 or 7.5 s); a search trial replays 1 probe, a run 2.5,
    the baseline 3 more:
    least 14 x (37 + 3.75 + 25) + 3 x 25 + 26 x (37 + 3.75 + 62.5) = 920.5 + 75 + 2684.5 = 3680 s;
    most 14 x (94 + 7.5 + 50) + 3 x 50 + 26 x (94 + 7.5 + 125) = 2121 + 150 + 5889 = 8160 s."""
    config = gpu_demo_config(tmp_path)
    assert estimate_s(config) == (3680.0, 8160.0)
    assert estimate_text(config) == ("about 60-135 min on one H100 (an estimate from vLLM's start-up phases, not a "
                                     "measurement)")
    # no confirmation: 40 search trials, the baseline's 3 more probes
    assert estimate_s(gpu_demo_config(tmp_path, confirm=0)) == pytest.approx(
        (40 * (37 + 3.75 + 25) + 75, 40 * (94 + 7.5 + 50) + 150))


def test_no_estimate_where_a_deadline_alone_decides(tmp_path):
    config = gpu_demo_config(tmp_path, budget=None, deadline_unix_s=2e9, time_budget_s=8 * 3600.0)
    assert estimate_s(config) is None and estimate_text(config) is None


def test_the_start_says_the_estimate_and_the_gpu_scale(tmp_path, model_cache):
    """prepare() on the GPU demo's config (a fake engine: no GPU here) names the model and its estimate in one line,
    and the workload is not called scaled down."""
    said: list[str] = []
    prepare(gpu_demo_config(tmp_path), tmp_path, say=lambda *a: said.append(" ".join(map(str, a))),
            engine_factory=FakeEngine, memory_probe=lambda: None)
    model_lines = [line for line in said if line.startswith("model: ")]
    assert len(model_lines) == 1
    assert model_lines[0].startswith("model: embedded default llama3.2-1b-dummy (Llama-3.2-1B's config.json, random "
                                     "weights: vLLM's load_format=dummy) at ")
    assert model_lines[0].endswith("; this study takes about 60-135 min on one H100 (an estimate from vLLM's "
                                   "start-up phases, not a measurement)")
    workload = [line for line in said if line.startswith("workload")]
    assert workload and workload[0].startswith("workload: Poisson arrivals, 2000 requests per replay")
