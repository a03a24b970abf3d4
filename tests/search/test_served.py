"""The runs as served (search/confirm.py, issue 20 item 7): once the confirmation's rounds are over, vLLM's defaults
and the leader run once more through the study's `served_factory` (`vllm serve` in a real run; here a simulator
whose steps are slower, as a server sharing the cores is), and every view names which rate is which."""

import json

import pytest

from optimizer.decision.decide import decide
from optimizer.decision.document import render, report_document
from optimizer.decision.served import served_record
from optimizer.engines.sim.noise import scaled
from optimizer.search import confirm, split
from optimizer.search.attrs import CONFIRM
from optimizer.search.runner import prepare, run
from optimizer.search.confirmed import confirmation
from optimizer.search.study import confirmation_runs, finished_count
from tests.support.fakes import SimEngine, config_only_model_in, make_config

SERVED_SLOWDOWN = 1.3  # every step of the "server" takes 30% longer: its rate at the limit is lower


class ServedSim(SimEngine):
    """The simulator standing in for `vllm serve`: the same scheduler, every step SERVED_SLOWDOWN x slower."""

    made = 0

    def __init__(self):
        super().__init__()
        self.time_model = scaled(self.time_model, SERVED_SLOWDOWN)
        ServedSim.made += 1


def test_plan_counts_the_served_runs_in_the_budget():
    p = split.plan(40, None, served=True)
    assert (p.rounds, p.search_budget, p.served, p.runs) == (8, 14, 2, 26)
    assert "14 search trials" in p.line and "2 runs through `vllm serve`" in p.line
    assert split.plan(40, None).search_budget == 16  # without them: 8 rounds all the same (the cap)
    assert split.plan(40, 0, served=True).runs == 0  # no confirmation, no runs as served


@pytest.fixture(scope="module")
def served_study(tmp_path_factory):
    """One study for the module: 6 search trials, 2 rounds, then the runs as served."""
    tmp_path = tmp_path_factory.mktemp("served")
    config = make_config(tmp_path, config_only_model_in(tmp_path), budget=14, confirm=2, ttft_p99_ms=45.0)
    ServedSim.made = 0
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None,
                       served_factory=ServedSim)
    return config, run(prepared, quiet=True), tmp_path


def test_the_rounds_end_with_the_defaults_and_the_leader_as_served(served_study):
    config, study, _ = served_study
    assert finished_count(study) == 14 - 2 * split.CONFIGS - split.SERVED_CONFIGS
    c = confirmation(study)
    assert c is not None and c.complete
    runs = confirmation_runs(study)  # in the study NAME.confirmation
    served = [t for t in runs if CONFIRM.of(t).get("served")]
    # the last runs, one per config served, after every round, each on the served engine
    assert runs[-len(served):] == served and ServedSim.made == len(served) == split.SERVED_CONFIGS
    assert sorted(CONFIRM.of(t)["of"] for t in served) == sorted(x.number for x in c.served_configs)
    assert c.base in c.served_configs and c.served_missing == []
    # one draw for both, a draw no round replayed
    assert {CONFIRM.of(t)["workload_seed"] for t in served} == {confirm.round_seed(config.workload.seed, c.rounds)}
    assert c.full_rounds == [0, 1]  # the served runs are no round of the confirmation
    for x in c.served_configs:  # the slower "server" holds the limit to a lower rate than the engine in process
        assert x.served_rate is not None and x.served_rate.rate_rps < c.rate_interval(x).median


def test_every_view_names_the_rate_in_process_and_as_served(served_study):
    config, study, tmp_path = served_study
    d = decide(study, config)
    c = d.confirmation
    doc = report_document(d)
    rows = {r["trial"]: r for r in doc["confirmation"]["configs"]}
    for x in c.served_configs:
        r = rows[x.number]
        assert r["rate_measured_as"] == "in process (AsyncLLM)"
        assert r["served_measured_as"] == "as served (vllm serve over HTTP)"
        assert r["served_rate_at_limit_rps"] == pytest.approx(x.served_rate.rate_rps)
        assert r["rate_at_limit_rps"] == pytest.approx(c.rate_interval(x).median)
        # 30% slower per step at a 45 ms limit: a quarter of the rate, outside both intervals, and said with both
        assert r["served_differs"] is True
    text, _ = render(d, "table")
    assert "req/s at the limit, as served (vllm serve)" in text and "in process (AsyncLLM)" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("as served (vllm serve over HTTP")]
    assert len(lines) == len(c.served_configs)
    assert all("differ by more than their intervals" in ln and "req/s in process" in ln for ln in lines)
    import html

    from optimizer.decision.html import render_html

    page = html.unescape(render_html(d, b"png"))
    assert all(page.count(ln) == 1 for ln in lines)  # once, under the decision; the table has the column
    from optimizer.cli.main import main

    best = d.confirmed_of(d.best)
    assert main(["export", "--study", config.study_name, "--storage", config.storage_url, "--studies-dir",
                 str(tmp_path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    meta = json.loads((tmp_path / "out" / f"{config.study_name}.engine_args.json").read_text())["metadata"]
    assert best is not None and best.served is not None  # the recommendation is always among the configs served
    assert meta["rate_at_limit"] == json.loads(json.dumps(served_record(c, best)))
    yaml_text = (tmp_path / "out" / f"{config.study_name}.recommended.yaml").read_text()
    assert "As served (vllm serve over HTTP):" in yaml_text and "in process" in yaml_text
    assert f"provision for {meta['rate_at_limit']['served_provision_rps']:.2f} req/s as served" in yaml_text


def test_the_rates_to_provision_for_lie_under_the_rates_measured_by_the_rounds_spread(served_study):
    """Each config served gets a rate to provision for in process and as served: the geometric mean of its rounds
    (or its one run as served) times the one-sided 95% prediction factor of the rounds' spread, recomputed here."""
    import math

    config, study, _ = served_study
    d = decide(study, config)
    c = d.confirmation
    rows = [[x.rate_rps(r) for r in c.full_rounds] for x in c.configs]  # 2 full rounds, every config measured
    logs = [[math.log(v) for v in row] for row in rows]
    df = sum(len(row) - 1 for row in logs)
    s = math.sqrt(sum((v - sum(row) / len(row)) ** 2 for row in logs for v in row) / df)
    t = {2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015}[df]  # one-sided 95% (two-sided 90%) Student t table
    for x in c.served_configs:
        r, own = served_record(c, x), logs[c.configs.index(x)]
        level = math.exp(sum(own) / len(own))
        assert r["provision_rps"] == pytest.approx(level * math.exp(-t * s * math.sqrt(1 + 1 / len(own))), rel=1e-3)
        assert r["served_provision_rps"] == pytest.approx(x.served_rate.rate_rps * math.exp(-t * s * math.sqrt(2)),
                                                          rel=1e-3)
        assert r["provision_rps"] < c.rate_interval(x).median and r["served_provision_rps"] < x.served_rate.rate_rps
    text, _ = render(d, "table")
    line = next(ln for ln in text.splitlines() if ln.startswith("provision for"))
    assert "19 times in 20" in line
    assert all(f"{served_record(c, x)['provision_rps']:.2f} in process" in line for x in c.served_configs)


def test_a_plan_made_without_runs_as_served_gets_none_on_a_resume(tmp_path, config_only_model):
    """A study confirmed before the runs as served existed (or with --no-served) had no room for them in its budget:
    running it again with a server to hand adds none."""
    from tests.support.fakes import run_study

    config = make_config(tmp_path, config_only_model, budget=10, confirm=2)
    study = run_study(tmp_path, config)  # no served_factory: the plan is made without runs as served
    before = len(confirmation_runs(study))
    ServedSim.made = 0
    again = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None,
                    served_factory=ServedSim)
    study = run(again, quiet=True)
    assert len(confirmation_runs(study)) == before and ServedSim.made == 0
    assert not any(CONFIRM.of(t).get("served") for t in confirmation_runs(study))


def test_runs_as_served_that_rank_the_pair_the_other_way_round_are_said_so():
    from optimizer.decision.served import order_as_served_line

    def record(inproc, served, low, high):
        return {"rate_at_limit_rps": inproc, "served_rate_at_limit_rps": served, "served_low_rps": low,
                "served_high_rps": high}

    # a real study's: #15 +13% in process, -10% as served, the served intervals overlapping
    base = record(95.28, 89.98, 81.26, 106.87)
    line = order_as_served_line(15, record(107.44, 80.82, 74.46, 89.32), base, "vllm serve")
    assert line is not None and line.startswith("as served the order is the other way round: #15 held 80.82 req/s")
    assert "(-10.2%; in process +12.8%; one run each, their 95% intervals overlap" in line  # 80.82/89.98, 107.44/95.28
    # a real study's: 95.40 against 95.65 as served read "-0%" with whole percents
    close = order_as_served_line(11, record(122.27, 95.40, 87.99, 116.31), record(105.82, 95.65, 88.38, 104.65),
                                 "vllm serve")
    assert "(-0.3%; in process +15.5%;" in close
    # within a twentieth of a percent (95.62 against 95.65: -0.03%) one decimal would print "-0.0%": even
    even = order_as_served_line(11, record(122.27, 95.62, 87.99, 116.31), record(105.82, 95.65, 88.38, 104.65),
                                "vllm serve")
    assert even is not None and even.startswith("as served they are even: #11 held 95.62 req/s")
    assert "(even to a tenth of a percent; in process +15.5%;" in even and "-0.0%" not in even
    apart = order_as_served_line(15, record(107.44, 70.0, 65.0, 75.0), base, "vllm serve")
    # apart beyond the intervals is not a ranking either: a real pair -25% so read -3%, -5% and +72% when its runs
    # as served were measured again in rounds (benchmarks/served_order.py)
    assert apart is not None and "apart beyond their 95% intervals, which hold one run, not the next: these runs " \
        "alone do not rank them" in apart
    assert order_as_served_line(15, record(107.44, 95.0, 90.0, 99.0), base, "vllm serve") is None  # the same order
    assert order_as_served_line(15, record(107.44, None, None, None), base, "vllm serve") is None  # not measured
    # the defaults met the limit in none of their rounds in process (median 0) but held it as served: no ratio
    assert order_as_served_line(15, record(107.44, 80.82, 74.46, 89.32), {**base, "rate_at_limit_rps": 0.0},
                                "vllm serve") is None
    assert "open" not in (order_as_served_line(15, record(107.44, 70.0, 65.0, None), base, "vllm serve") or "")
