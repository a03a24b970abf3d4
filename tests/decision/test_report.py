"""`optimize report`: the Pareto front, re-ranking for another limit, the PNG/HTML report and the bench JSON.

Hand-checked answers come from the synthetic study (tests/support/synthetic.py); a short study on the fake engine checks
that the report agrees with what the study itself recorded.
"""

import csv
import importlib.util
import io
import json
from pathlib import Path

import optuna
import pytest

from optimizer.cli.main import main
from optimizer.config.limits import Limits
from optimizer.config.model import DEFAULT_MODEL_CONFIG
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.decision.decide import decide
from optimizer.decision.tables import format_output
from optimizer.decision.document import render
from optimizer.decision.views import front_rows
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.rerank import Answer
from optimizer.search.runner import prepare, run
from optimizer.search.confirmed import recommended
from tests.support import synthetic

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fake_study(tmp_path_factory):
    """A short real study on the fake engine, built once for this module."""
    d = tmp_path_factory.mktemp("fake")
    model = d / "arch"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}))
    config = StudyConfig(study_name="f", storage_url=f"sqlite:///{d}/f.db", ttft_p99_ms=30.0, budget=4,
                         model=str(model), dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64,
                                               input_len_max=256, output_len_min=2, output_len_max=6))
    study = run(prepare(config, d, say=lambda *a: None, engine_factory=FakeEngine, memory_probe=lambda: None),
                quiet=True)
    return study, config, d


def cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_at_the_searched_limit_the_report_agrees_with_the_study(fake_study):
    study, config, _ = fake_study
    d = decide(study, config)
    assert not d.reranked
    best = recommended(study)
    assert (d.best.number if d.best else None) == (best.number if best else None)
    for v in d.views:  # re-ranking from the curve reproduces the stored objective values
        if v.ranked.answerable:
            assert v.ranked.output_throughput_tok_s == pytest.approx(v.trial.values[0])
            assert v.ranked.latency_ms == pytest.approx(v.trial.values[1], abs=1e-3)  # stored to the microsecond
    # Optuna's own feasible Pareto front (best_trials honours constraints) is the same set of trials.
    assert {v.number for v in d.front} == {t.number for t in study.best_trials}


def test_hand_checked_front_recommendation_and_gain(syn):
    study, config, _ = syn
    d = decide(study, config)
    assert [v.number for v in d.front] == [2, 3]
    assert d.best.number == 2 and d.best.ranked.output_throughput_tok_s == pytest.approx(770)
    assert d.baseline.number == 0 and d.baseline.ranked.output_throughput_tok_s == pytest.approx(420)
    assert d.gain_pct == pytest.approx((770 / 420 - 1) * 100)
    assert d.views[4].ranked.answer == Answer.NOT_RUN
    assert [r["role"] for r in front_rows(d)] == ["recommended", ""]


def test_a_looser_limit_recommends_from_the_curves_and_flags_a_lower_bound(syn):
    study, config, _ = syn
    d = decide(study, config, Limits.ttft_p99(250.0))
    # #2's 8.8 req/s (200 ms) is the highest Poisson rate it tried: 880 tok/s is only a lower bound.
    assert d.best.number == 2 and d.best.ranked.answer == Answer.LOWER_BOUND
    assert d.best.ranked.output_throughput_tok_s == pytest.approx(880)
    assert [v.number for v in d.front] == [2, 1, 3]  # #1 at 6.48 req/s (130 ms) now beats the baseline's 4.8
    text, _ = render(d, "table")
    assert "lower bound" in text and "may sustain more" in text and "re-ranked" in text


def test_a_limit_every_burst_meets_recommends_the_ceiling(syn):
    study, config, _ = syn
    d = decide(study, config, Limits.ttft_p99(1000.0))
    assert d.best.number == 1 and d.best.ranked.answer == Answer.CEILING
    assert d.best.ranked.output_throughput_tok_s == pytest.approx(1200)


def test_a_stricter_limit_than_any_stored_point_says_the_data_cannot_answer(syn, capsys):
    study, config, tmp_path = syn
    d = decide(study, config, Limits.ttft_p99(10.0))
    assert d.best is None and d.front == []
    rc, out, _ = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--ttft-p99", "10ms")
    assert rc == 0
    assert "cannot answer" in out and "the closest stored is trial #3 at 3.00 req/s: TTFT P99 20ms" in out
    assert "not enough trials" in out
    assert (tmp_path / "syn.report.png").read_bytes().startswith(PNG_MAGIC)


def test_importances_need_three_feasible_searched_trials(syn):
    study, config, _ = syn
    d = decide(study, config)  # #1, #2 and #3 are searched and meet the limit
    assert set(d.importances) <= set(synthetic.DISTRIBUTIONS) and d.importances
    assert sum(d.importances.values()) == pytest.approx(1.0)
    d = decide(study, config, Limits.ttft_p99(90.0))  # only #2 (6.6/s at 60 ms), #3 (and #1 at 80 ms) -> still 3
    assert d.importances
    d = decide(study, config, Limits.ttft_p99(50.0))  # only #3 meets it
    assert d.importances == {} and "not enough trials" in d.importance_note


def test_one_formatter_gives_the_same_rows_as_table_json_and_csv(syn):
    study, config, _ = syn
    rows = front_rows(decide(study, config))
    as_json = json.loads(format_output(rows, "json"))
    as_csv = list(csv.DictReader(io.StringIO(format_output(rows, "csv"))))
    table = format_output(rows, "table").splitlines()
    assert [r["trial"] for r in as_json] == [2, 3] == [int(r["trial"]) for r in as_csv]
    assert as_json[0]["output_throughput_tok_s"] == pytest.approx(770)
    assert float(as_csv[0]["output_throughput_tok_s"]) == pytest.approx(770)
    assert table[0].split()[:3] == ["trial", "role", "output_throughput_tok_s"] and len(table) == 2 + len(rows)
    assert list(as_json[0]) == list(as_csv[0])  # same columns, same order


def test_cli_report_prints_the_front_and_writes_png_and_self_contained_html(syn, capsys):
    _, _, tmp_path = syn
    out_dir = tmp_path / "out"
    rc, out, err = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--out", str(out_dir))
    assert rc == 0, err
    assert "TTFT P99 <= 100ms" in out and "recommended: trial #2" in out and "+83.3%" in out
    assert f"wrote {out_dir / 'syn.report.png'}" in err
    png = (out_dir / "syn.report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    page = (out_dir / "syn.report.html").read_text()
    assert "data:image/png;base64," in page and "<table>" in page
    assert "src='http" not in page and "<link" not in page and "<script" not in page  # nothing fetched
    assert "out_of_memory" in page  # the pruned trial is listed with its reason


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_machine_formats_keep_stdout_parseable(syn, capsys, fmt):
    _, _, tmp_path = syn
    rc, out, err = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--format", fmt,
                       "--ttft-p99", "250ms")
    assert rc == 0
    rows = json.loads(out)["front"] if fmt == "json" else \
        [r for r in csv.DictReader(io.StringIO(out)) if r["section"] == "front"]
    assert [int(r["trial"]) for r in rows] == [2, 1, 3]
    assert rows[0]["answer"] == "lower bound"
    assert "lower bound" in err  # the caveat still reaches the reader


@pytest.mark.parametrize("args, message", [
    (["--study", "nope"], "no study 'nope'"),
    (["--format", "xml"], "--format 'xml' is not one of table, json, csv"),
    (["--ttft-p99", "300"], "has no unit"),
    (["--ttft-p99", "soon"], "is not a duration"),
    (["--trial", "x"], "is not a trial number"),
    (["--trial", "42"], "no finished trial #42"),
])
def test_bad_input_is_one_line_and_exit_code_2(syn, capsys, args, message):
    _, _, tmp_path = syn
    study_args = [] if "--study" in args else ["--study", "syn"]
    rc, _, err = cli(capsys, "report", "--studies-dir", str(tmp_path), *study_args, *args)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "syn.report.png").exists()


def test_trial_curve_and_bench_json_in_vllm_format(syn, capsys):
    _, _, tmp_path = syn
    path = tmp_path / "bench.json"
    rc, out, err = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--trial", "1",
                       "--bench-json", str(path), "--format", "json")
    assert rc == 0, err
    replays = json.loads(out)
    assert [r["chosen"] for r in replays] == [False, False, False, True, False]  # 5.76 req/s at 99 ms
    result = json.loads(path.read_text())
    assert result["request_rate"] == 5.76 and result["burstiness"] == 1.0
    assert result["output_throughput"] == pytest.approx(576) and result["request_throughput"] == 5.76
    assert result["p99_ttft_ms"] == 99 and result["median_ttft_ms"] == 49.5 and result["p99_tpot_ms"] == 5.0
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["duration"] == pytest.approx(40 / 5.76)
    assert result["total_output_tokens"] == 4000
    assert result["optimizer_trial"] == 1 and result["optimizer_slo"] == "TTFT P99 <= 100ms"
    assert result["optimizer_limits"] == {"items": [{"metric": "ttft", "stat": "p99", "value_ms": 100.0}],
                                          "goodput_pct": None}
    assert "mean_ttft_ms" not in result  # not stored, so not guessed


def test_bench_json_of_a_burst_and_of_the_recommendation(syn, capsys):
    _, _, tmp_path = syn
    rc, _, _ = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--ttft-p99", "1s",
                   "--bench-json", str(tmp_path / "best.json"))
    result = json.loads((tmp_path / "best.json").read_text())
    assert rc == 0 and result["optimizer_trial"] == 1 and result["request_rate"] == "inf"
    rc, _, err = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--trial", "4",
                     "--bench-json", str(tmp_path / "pruned.json"))
    assert rc == 1 and "could not run: out_of_memory" in err and not (tmp_path / "pruned.json").exists()


def test_bench_json_keys_are_the_ones_vllm_writes(syn):
    spec = importlib.util.find_spec("vllm")
    source = Path(spec.origin).parent / "benchmarks" / "serve.py" if spec and spec.origin else None
    if source is None or not source.exists():
        pytest.skip("vLLM's benchmark source is not installed")
    from optimizer.decision.benchjson import bench_result, chosen_point

    study, config, _ = syn
    trial = study.trials[2]
    result = bench_result(trial, config, chosen_point(trial, config.limits), config.limits)
    text = source.read_text()
    for key in result:
        if key.startswith("optimizer_"):
            continue  # our metadata, as --metadata KEY=VALUE would add it
        stat, _, metric = key.partition("_")
        literal = f'"{key}"' in text
        templated = metric.endswith("_ms") and f'f"{stat}_{{metric_attribute_name}}_ms"' in text \
            or key.startswith("p") and 'f"p{p_word}_{metric_attribute_name}_ms"' in text
        assert literal or templated, key


def test_the_study_database_opens_with_plain_optuna(fake_study):
    """What optuna-dashboard does: load by name and URL, read directions, values, params and attributes."""
    _, config, _ = fake_study
    study = optuna.load_study(study_name=config.study_name, storage=config.storage_url)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert complete and all(len(t.values) == 2 for t in complete)
    assert any(t.params for t in complete)  # the searched trials carry their sampled params
    json.dumps([t.user_attrs for t in study.trials])  # every attribute is plain JSON
    summaries = {s.study_name: s for s in optuna.get_all_study_summaries(storage=config.storage_url)}
    assert summaries[config.study_name].n_trials == len(study.trials)  # the dashboard's study list
    assert {t.number for t in study.best_trials} <= {t.number for t in complete}


def test_cli_report_with_a_tpot_limit(fake_study, capsys):
    study, config, d = fake_study
    rc, out, err = cli(capsys, "report", "--study", "f", "--studies-dir", str(d), "--out", str(d / "o"),
                       "--tpot-p99", "1000s", "--format", "json")
    assert rc == 0, err
    loose = json.loads(out)["front"]
    rc, out, err = cli(capsys, "report", "--study", "f", "--studies-dir", str(d), "--out", str(d / "o"),
                       "--tpot-p99", "0.001ms", "--format", "json")
    assert rc == 0, err
    assert loose and json.loads(out)["front"] == []  # no stored replay has a TPOT P99 that low
    assert "TPOT P99 <= " in err
    rc, _, err = cli(capsys, "report", "--study", "f", "--studies-dir", str(d), "--e2e-p99", "fast")
    assert rc == 2 and "--e2e-p99" in err


def test_a_challenger_within_noise_is_not_reported_as_better(tmp_path):
    """The baseline's three replays at 4.2/s give 400, 420, 440 tok/s: CV 4.76%. A gain must then exceed
    2 x 4.76% x sqrt(1/1 + 1/3) = 11.0%: #1 (+4.8%) is within noise, #2 (+83%) is not."""
    from optuna.trial import create_trial

    from optimizer.search.objective import CONSTRAINT
    from optimizer.search.attrs import STUDY_CONFIG
    from optimizer.search.study import DIRECTIONS

    def pt(rate, tput, ttft):
        return {**synthetic.point(rate, ttft, burst_rps=10.0), "output_throughput_tok_s": float(tput)}

    config = synthetic.make_config(tmp_path, "noise")
    study = optuna.create_study(study_name="noise", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    curves = {0: [pt(None, 1000, 900), pt(4.2, 400, 90), pt(4.2, 420, 95), pt(4.2, 440, 99)],
              1: [pt(None, 1000, 900), pt(4.4, 440, 95)],
              2: [pt(None, 1000, 900), pt(7.7, 770, 97)]}
    for n, c in curves.items():
        attrs = {**synthetic.stored(c), "engine_config": synthetic.BASELINE_ENGINE,
                 **({"baseline": True} if n == 0 else {})}
        study.add_trial(create_trial(values=[c[-1]["output_throughput_tok_s"], 95.0], user_attrs=attrs,
                                     constraints={CONSTRAINT: 0.0}))
    d = decide(study, config)
    assert d.noise_cv == pytest.approx(20 / 420)
    one, two = d.views[1], d.views[2]
    assert not d.beyond_noise(one, d.baseline) and d.beyond_noise(two, d.baseline)
    assert d.best is two and d.ties == []  # #1 is far below #2
    # without #2 the recommendation is #1: its gain is reported, but as within noise
    study2 = optuna.create_study(study_name="noise2", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study2, config.model_copy(update={"study_name": "noise2"}).model_dump_json())
    for t in study.get_trials()[:2]:
        study2.add_trial(t)
    d2 = decide(study2, config.model_copy(update={"study_name": "noise2"}))
    assert d2.best.number == 1
    from optimizer.decision.views import summary_lines

    gain = next(line for line in summary_lines(d2) if line.startswith("gain over"))
    assert "+4.8%" in gain and "within measurement noise" in gain and "11.0%" in gain


def test_a_challenger_inside_the_incumbents_rate_bracket_is_not_better(tmp_path):
    """#0 passed 4.0/s and missed 5.0/s: its true best lies in [4, 5), so #1 at 4.4/s (+10%) is not proven better;
    #2 at 5.2/s (+30%) is."""
    from optuna.trial import create_trial

    from optimizer.search.objective import CONSTRAINT
    from optimizer.search.attrs import STUDY_CONFIG
    from optimizer.search.study import DIRECTIONS

    config = synthetic.make_config(tmp_path, "bracket")
    study = optuna.create_study(study_name="bracket", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    p = synthetic.point
    curves = {0: [p(None, 900, 10.0), p(5.0, 200), p(4.0, 90)], 1: [p(None, 900, 10.0), p(4.4, 95)],
              2: [p(None, 900, 10.0), p(5.2, 95)]}
    for n, c in curves.items():
        attrs = {**synthetic.stored(c), "engine_config": synthetic.BASELINE_ENGINE,
                 **({"baseline": True} if n == 0 else {})}
        study.add_trial(create_trial(values=[c[-1]["output_throughput_tok_s"], 95.0], user_attrs=attrs,
                                     constraints={CONSTRAINT: 0.0}))
    d = decide(study, config)
    base, one, two = d.views
    assert d.required_gain(one, base) == pytest.approx(0.25)
    assert not d.beyond_noise(one, base) and d.beyond_noise(two, base)


def test_trial_table_fits_a_terminal_and_names_where_every_column_is(syn, capsys):
    from optimizer.decision.tables import CURVE_TABLE_COLUMNS

    _, _, tmp_path = syn
    rc, out, err = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--trial", "1")
    assert rc == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("replay"))
    assert set(header.split()) <= set(CURVE_TABLE_COLUMNS) and "ttft_p99_ms" in header.split()
    assert max(len(line) for line in lines if not line.startswith("trial #")) <= 220
    assert "(every column of its replays: --format csv or --format json)" in lines
    rc, out, _ = cli(capsys, "report", "--study", "syn", "--studies-dir", str(tmp_path), "--trial", "1", "--format",
                     "csv")
    assert rc == 0 and {"sent_rate_rps", "tpot_p99_ms", "e2e_p99_ms"} <= set(out.splitlines()[0].split(","))


def test_a_recommendation_that_changes_the_model_s_numbers_says_so_at_the_run_end(tmp_path, monkeypatch):
    """The export's accuracy line (params/accuracy.py) is in the decision's notes too, so the run's end and
    `optimize report` repeat it: a user who deploys from the console reads it. Only for what was searched."""
    from optuna.distributions import CategoricalDistribution

    from optimizer.decision.report import summary_text

    monkeypatch.setitem(synthetic.DISTRIBUTIONS, "kv_cache_dtype", CategoricalDistribution(["auto", "fp8"]))
    monkeypatch.setitem(synthetic.PARAMS, 2, {**synthetic.PARAMS[2], "kv_cache_dtype": "fp8"})
    monkeypatch.setitem(synthetic.PARAMS, 4, {**synthetic.PARAMS[4], "kv_cache_dtype": "auto"})  # every distribution
    study, config = synthetic.build(tmp_path)
    d = decide(study, config)
    assert d.best.number == 2
    assert [n for n in d.notes if n.startswith("Not checked: kv_cache_dtype=fp8")]
    assert "note: Not checked: kv_cache_dtype=fp8 changes what the model computes" in summary_text(study, config)
    monkeypatch.setitem(synthetic.PARAMS, 2, {**synthetic.PARAMS[2], "kv_cache_dtype": "auto"})
    clean, config = synthetic.build(tmp_path, name="clean")
    assert not [n for n in decide(clean, config).notes if n.startswith("Not checked")]


def test_the_chart_takes_two_probes_at_one_rate(tmp_path, monkeypatch):
    """A trial that probed one rate twice (a repeat at its best rate) is drawn, not a TypeError from comparing the
    two probes' dicts where their rates tie."""
    from optimizer.decision.plots import render_png

    monkeypatch.setitem(synthetic.CURVES, 2, [*synthetic.CURVES[2], (7.7, 95)])
    study, config = synthetic.build(tmp_path)
    d = decide(study, config)
    assert sum(p["offered_rate_rps"] == 7.7 for p in d.best.curve) == 2
    assert render_png(d).startswith(b"\x89PNG")


def test_a_two_limit_study_names_both_limits_and_reports_the_point_over_tpot(two_limits):
    """TTFT P99 <= 100ms and TPOT P99 <= 50ms (tests/decision/conftest.py): #1's 6.0 req/s is within TTFT but its TPOT
    P99 is 61 ms, so it is held to 5.0 req/s, and every view says TPOT is what it missed."""
    from optimizer.decision.html import trial_rows
    from optimizer.decision.report import table_lines
    from optimizer.decision.views import curve_rows, summary_lines, title

    study, config, _ = two_limits
    d = decide(study, config)
    assert d.limits.text == "TTFT P99 <= 100ms, TPOT P99 <= 50ms" and not d.reranked
    assert d.best.number == 1 and d.best.ranked.rate_rps == 5.0 and d.best.ranked.next_rate_rps == 6.0
    assert title(d) == ("study 'two': feasible Pareto front of output throughput vs TTFT P99, TTFT P99 <= 100ms, "
                        "TPOT P99 <= 50ms (as searched)")
    assert summary_lines(d)[0] == ("recommended: trial #1: 500.0 output tok/s at 5.00 req/s, TTFT P99 50ms, TPOT P99 "
                                   "40ms (measured)")
    assert table_lines(d, config)[0] == "TTFT P99 <= 100ms, TPOT P99 <= 50ms, one measurement each (not confirmed)"
    assert table_lines(d, config)[1].splitlines()[0].endswith("TTFT P50  TTFT P99  TPOT P99")
    rows = {r["trial"]: r for r in trial_rows(d)}
    assert rows["#1"]["what stopped it"] == "at 6.00 req/s failed: TPOT P99 61ms over 50ms"
    assert rows["#1"]["TTFT P99, TPOT P99"] == "50ms, 40ms"
    curve = curve_rows(d, d.best)
    assert [r["meets_limit"] for r in curve] == [True, False] and curve[1]["tpot_p99_ms"] == 61.0

    doc = json.loads(render(d, "json")[0])
    assert doc["limits"] == {"limits": [{"metric": "ttft", "stat": "p99", "value_ms": 100.0},
                                        {"metric": "tpot", "stat": "p99", "value_ms": 50.0}],
                             "goodput_pct": None, "text": "TTFT P99 <= 100ms, TPOT P99 <= 50ms",
                             "searched": [{"metric": "ttft", "stat": "p99", "value_ms": 100.0},
                                          {"metric": "tpot", "stat": "p99", "value_ms": 50.0}],
                             "searched_goodput_pct": None, "reranked": False}
    assert doc["front"][0]["tpot_p99_ms"] == 40.0 and doc["front"][0]["rate_rps"] == 5.0

    # re-ranked at TTFT P99 alone, 6.0 req/s holds; the report says what it re-ranked for and what was searched
    ttft = decide(study, config, Limits.ttft_p99(100.0))
    assert ttft.reranked and ttft.best.ranked.rate_rps == 6.0
    doc = json.loads(render(ttft, "json")[0])
    assert doc["limits"]["limits"] == [{"metric": "ttft", "stat": "p99", "value_ms": 100.0}]
    assert len(doc["limits"]["searched"]) == 2 and doc["limits"]["reranked"] is True
    assert any("re-ranked for TTFT P99 <= 100ms (the study searched for TTFT P99 <= 100ms, TPOT P99 <= 50ms): from "
               "each stored replay's statistics (its requests were not stored)" in n for n in ttft.notes), ttft.notes


def test_the_figure_of_a_tpot_first_study_draws_tpot_and_its_limit(two_limits):
    """The latency axes are the first limit's: with TPOT P99 first, the front's x and the probes' y are TPOT P99s,
    and the dashed line is the TPOT limit."""
    from optimizer.config.limits import Limits as L
    from optimizer.decision.plots import figure

    study, config, _ = two_limits
    tpot_first = L(items=tuple(reversed(config.limits.items)))
    fig = figure(decide(study, config, tpot_first))
    pareto, _, curves, _ = fig.axes[:4]
    assert pareto.get_xlabel() == "TPOT P99 at the best sustained rate (ms)"
    assert curves.get_ylabel() == "TPOT P99 (ms, log scale)"
    labels = [t.get_text() for t in pareto.get_legend().get_texts()]
    assert "TPOT P99 limit 50ms" in labels
    assert [line.get_xdata()[0] for line in pareto.get_lines() if line.get_linestyle() == "--"] == [50.0]
