"""One answer everywhere: on a confirmed study made with the simulator, the console's end table, `optimize report` in
every format, `--trial` of a confirmation run, `--bench-json` and export give the same recommendation with the same
confirmed numbers; each number shown follows from its neighbours. Older shapes (no confirmation) still report."""

import csv
import io
import json
import statistics

import optuna
import pytest
from optuna.trial import create_trial

from optimizer.cli.main import main
from optimizer.config.model import DEFAULT_MODEL_CONFIG
from optimizer.config.settings import StudyConfig
from optimizer.decision.decide import decide
from optimizer.decision.document import report_document
from optimizer.decision.report import summary_text
from optimizer.decision.trial import TrialView
from optimizer.decision.views import confirmation_records, confirmation_row, curve_rows, summary_lines
from optimizer.measurement.rerank import rank_curve
from optimizer.search.attrs import CONFIRM, STUDY_CONFIG
from optimizer.search.objective import CONSTRAINT, CPU_BASELINE_MEMORY_FALLBACK
from optimizer.search.confirmed import confirmation
from optimizer.search.study import DIRECTIONS, confirmation_runs, is_confirmation
from tests.support import synthetic
from tests.support.fakes import make_config, run_study


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory):
    """A study on the simulator: 4 search trials, then 2 confirmation rounds. Its baseline cannot take vLLM's 0.92
    of the simulated device's memory (90% usable), so it runs with this machine's fallback (0.2)."""
    d = tmp_path_factory.mktemp("confirmed")
    model = d / "arch"
    model.mkdir()
    model.joinpath("config.json").write_text(json.dumps({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}))
    config = make_config(d, model, budget=10, confirm=2)
    return config, run_study(d, config), d


def stored(study):
    """The config as the study stored it (resolved: the CPU build's engine arguments), as `optimize report` reads it."""
    return StudyConfig.model_validate(json.loads(STUDY_CONFIG.of(study)))


def cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def report_json(capsys, config, d, *args):
    rc, out, err = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--out",
                       str(d / "out"), "--format", "json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_the_json_holds_the_confirmed_numbers_the_console_table_shows(confirmed, capsys):
    config, study, d = confirmed
    c = confirmation(study)
    assert c is not None and c.complete and len(c.full_rounds) == 2
    doc = report_json(capsys, config, d)
    table = summary_text(study, stored(study))  # what the run printed at its end
    configs = {r["trial"]: r for r in doc["confirmation"]["configs"]}
    assert list(configs) == c.plan["candidates"] and doc["confirmation"]["rounds"] == 2
    base_values = c.values_tok_s(c.base)
    for x in c.configs:
        r = configs[x.number]
        values = c.values_tok_s(x)
        assert r["values_tok_s"] == values and r["rounds"] == 2
        assert r["output_throughput_tok_s"] == pytest.approx(statistics.median(values))  # by hand: 2 rounds
        mean, s = statistics.mean(values), statistics.stdev(values)
        assert r["low_tok_s"] == pytest.approx(max(mean - 12.706 * s / 2 ** 0.5, 0.0))  # t(1) = 12.706
        row = next(line for line in table.splitlines() if line.startswith(f"#{x.number} "))  # its table row
        assert f"{r['output_throughput_tok_s']:.1f}" in row and f"[{r['low_tok_s']:.1f}, {r['high_tok_s']:.1f}]" in row
        if x.baseline:
            assert r["gain_pct"] is None
            continue
        # the gain follows from the two medians shown beside it; its interval is the per-round ratios'
        assert r["gain_pct"] == pytest.approx((statistics.median(values) / statistics.median(base_values) - 1) * 100)
        assert f"{r['gain_pct']:+.1f}%" in row
        ratios = [b / a - 1 for a, b in zip(base_values, values)]
        assert r["gain_low_pct"] == pytest.approx(
            (statistics.mean(ratios) - 12.706 * statistics.stdev(ratios) / 2 ** 0.5) * 100)
    best = doc["recommendation"]
    assert best["trial"] == c.best.number and best["output_throughput"]["source"] == "confirmation"
    # the numbers say how they were made: a run by its pooled fit, the looks paid for group-sequentially
    assert "pooled fit" in best["output_throughput"]["statistic"]
    assert "group-sequential" in best["output_throughput"]["statistic"]
    assert best["output_throughput"]["output_throughput_tok_s"] == configs[c.best.number]["output_throughput_tok_s"]
    assert best["output_throughput"]["rounds"] == 2
    assert doc["summary"] == summary_lines(decide(study, stored(study)))  # the sentences the table format prints
    tied = {n for n, r in configs.items() if "tied" in r["role"]}
    assert {t["trial"] for t in doc["ties"]} == tied
    if c.best is c.base:
        assert doc["verdict"] == "keep vLLM's defaults" and doc["gain_over_defaults"] is None
    else:
        assert doc["gain_over_defaults"]["gain_pct"] == pytest.approx(configs[c.best.number]["gain_pct"])


def test_a_config_that_met_the_limit_in_no_round_reads_misses_not_zero_rates(confirmed):
    """A run over the limit at every rate it tried stores 0 tok/s (search/score.py); a row of such runs would read
    "0.0 tok/s, 0.00 req/s at the limit, -100.0%" as if measured. The JSON keeps the stored numbers; the table says
    it met the limit in no round."""
    config, study, _ = confirmed
    d = decide(study, stored(study))
    measured = confirmation_records(d)[0]
    shown = confirmation_row(measured)  # a config that met the limit: its numbers, as before
    assert shown["tok/s (median)"] == f"{measured['output_throughput_tok_s']:.1f}"
    assert shown["config"] == measured["role"]
    assert shown["req/s at the limit, in process (median)"] == f"{measured['rate_at_limit_rps']:.2f}"
    zeros = [0.0] * len(measured["values_tok_s"])  # what the rounds store for runs that met the limit nowhere
    missed = {**measured, "values_tok_s": zeros, "output_throughput_tok_s": 0.0, "low_tok_s": 0.0, "high_tok_s": 0.0,
              "gain_pct": -100.0, "gain_low_pct": -100.0, "gain_high_pct": -100.0, "rate_at_limit_rps": 0.0}
    row = confirmation_row(missed)
    assert row["config"] == measured["role"] + ": met the limit in no round"
    assert row["tok/s (median)"] == row["req/s at the limit, in process (median)"] == "misses"
    assert row["95% interval of the mean"] == row["gain (ratio of medians)"] == row["per-round gain, 95% interval"] \
        == "-"
    assert row["in the search tok/s"] == shown["in the search tok/s"]  # the search's own number is its own
    one_met = {**missed, "values_tok_s": [*zeros[:-1], 10.0]}  # met it in one round: numbers, not "misses"
    assert confirmation_row(one_met)["tok/s (median)"] == "0.0"
    # as served: "-" only where it was not served; a run through `vllm serve` that found no rate names its run
    served = "req/s at the limit, as served (vllm serve)"
    assert confirmation_row({**measured, "served_rate_at_limit_rps": None, "served_run": None})[served] == "-"
    assert confirmation_row({**measured, "served_rate_at_limit_rps": None, "served_run": "c8"})[served] \
        == "not measured (c8)"
    assert confirmation_row({**measured, "served_rate_at_limit_rps": 12.5, "served_low_rps": 11.0,
                             "served_high_rps": None, "served_run": "c8"})[served] == "12.50 [11.00, open]"


def test_the_json_lists_every_trial_with_its_reason_and_the_baseline_as_run(confirmed, capsys):
    config, study, d = confirmed
    doc = report_json(capsys, config, d)
    searched = [t.number for t in study.trials if not is_confirmation(t) and t.state.is_finished()]
    assert [t["trial"] for t in doc["trials"]] == searched  # confirmation runs are not search trials
    assert all(t["reason"] for t in doc["trials"])
    base = doc["baseline"]
    assert base["trial"] == 0 and base["engine_config"]["gpu_memory_utilization"] == CPU_BASELINE_MEMORY_FALLBACK
    fallback = base["not_vllm_defaults"]["gpu_memory_utilization"]
    assert fallback["value"] == CPU_BASELINE_MEMORY_FALLBACK
    assert fallback["why"].startswith("this machine's fallback: vLLM's default")
    assert base["not_vllm_defaults"]["load_format"]["value"] == "dummy"


def test_the_csv_holds_the_front_and_the_confirmation_in_one_sheet(confirmed, capsys):
    config, _, d = confirmed
    doc = report_json(capsys, config, d)
    rc, out, _ = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--out",
                     str(d / "out"), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rc == 0 and {r["section"] for r in rows} == {"front", "confirmation"}
    assert [int(r["trial"]) for r in rows if r["section"] == "front"] == [r["trial"] for r in doc["front"]]
    conf = [r for r in rows if r["section"] == "confirmation"]
    assert [int(r["trial"]) for r in conf] == [r["trial"] for r in doc["confirmation"]["configs"]]
    for r, j in zip(conf, doc["confirmation"]["configs"]):
        assert float(r["output_throughput_tok_s"]) == pytest.approx(j["output_throughput_tok_s"])
        assert r["runs"] == " ".join(str(n) for n in j["runs"])
    baseline_rows = [r for r in rows if r["trial"] == "0"]
    assert baseline_rows and all("this machine's fallback" in r["not_vllm_defaults"] for r in baseline_rows)


def test_the_headline_gives_the_confirmed_number_with_its_interval_and_rounds(confirmed, capsys):
    config, _, d = confirmed
    doc = report_json(capsys, config, d)
    tp = doc["recommendation"]["output_throughput"]
    rc, out, _ = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--out",
                     str(d / "out"))
    headline = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert rc == 0 and headline.startswith(
        f"recommended: trial #{doc['recommendation']['trial']}: {tp['output_throughput_tok_s']:.1f} output tok/s "
        f"(median of 2 confirmation rounds, 95% interval of the mean [{tp['low_tok_s']:.1f}, {tp['high_tok_s']:.1f}])")
    assert "in the search: " in headline  # the search's own number, named as such
    assert "tok/s: the median of the full rounds" in out and "gain over vLLM's defaults: the ratio of" in out
    assert f"gpu_memory_utilization={CPU_BASELINE_MEMORY_FALLBACK} (this machine's fallback" in out


def test_report_trial_reaches_a_confirmation_run(confirmed, capsys):
    config, study, d = confirmed
    assert not any(is_confirmation(t) for t in study.trials)  # the runs are in their own study
    run = confirmation_runs(study)[-1]
    of, round_ = CONFIRM.of(run)["of"], CONFIRM.of(run)["round"]
    rc, out, err = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--trial",
                       f"c{run.number}", "--bench-json", str(d / "run.json"))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"confirmation round {round_ + 1}, trial #{of} again (run c{run.number}")
    assert lines[1].startswith(f"it measured trial #{of}") and "max_num_seqs=" in lines[1]
    assert any(line.startswith("replay") for line in lines)  # its probes
    bench = json.loads((d / "run.json").read_text())
    assert bench["optimizer_trial"] == run.number and bench["label"].endswith(f":s.confirmation#{run.number}")
    assert bench["optimizer_confirmation_run"] == {"of": of, "round": round_ + 1, "run": f"c{run.number}"}
    doc = report_json(capsys, config, d)
    mine = next(r for r in doc["confirmation"]["configs"] if r["trial"] == of)
    assert bench["optimizer_output_throughput"]["output_throughput_tok_s"] == pytest.approx(
        mine["output_throughput_tok_s"])  # the config's confirmed number, beside the run's own replay
    rc, _, err = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--trial", "99")
    assert rc == 2 and f"c{run.number}" in err.split("confirmation runs: ")[1]


def test_export_and_bench_json_carry_the_recommendation_and_its_confirmed_numbers(confirmed, capsys):
    config, _, d = confirmed
    doc = report_json(capsys, config, d)
    best = doc["recommendation"]
    rc, _, err = cli(capsys, "export", "--study", config.study_name, "--studies-dir", str(d), "--out",
                     str(d / "export"))
    assert rc == 0, err
    meta = json.loads((d / "export" / f"{config.study_name}.engine_args.json").read_text())["metadata"]
    assert meta["trial"] == best["trial"] and meta["confirmed"]["rounds"] == 2
    assert meta["confirmed"]["output_throughput"] == best["output_throughput"]
    header = (d / "export" / f"{config.study_name}.recommended.yaml").read_text()
    assert f"{best['output_throughput']['output_throughput_tok_s']:.1f} output tok/s (median" in header
    # the deployed file says what the rounds decided, as the report does: "Confirmed" was printed whatever they did
    said = doc["confirmation"]["verdict_line"]
    assert meta["confirmed"]["verdict"] == said and f"Verdict: {said}.\n" in header
    assert "Measured again in 2 rounds on fresh engines" in header and "Confirmed in" not in header
    compose = (d / "export" / f"{config.study_name}.compose.yaml").read_text()
    assert "None" not in compose and "optimize.confirmed.output_throughput_tok_s" in compose
    rc, _, err = cli(capsys, "report", "--study", config.study_name, "--studies-dir", str(d), "--bench-json",
                     str(d / "best.json"))
    bench = json.loads((d / "best.json").read_text())
    assert rc == 0 and bench["optimizer_trial"] == best["trial"] and bench["optimizer_recommended"]
    assert bench["optimizer_output_throughput"] == best["output_throughput"]


def test_an_unconfirmed_study_reports_the_search_numbers_and_says_what_they_are(syn):
    study, config, _ = syn  # no confirmation: no plan, no runs
    doc = report_document(decide(study, config))
    assert doc["confirmation"] is None and doc["verdict"] == "gain from one measurement each"
    assert doc["recommendation"]["output_throughput"] == {
        "source": "search", "output_throughput_tok_s": pytest.approx(770.0), "low_tok_s": None, "high_tok_s": None,
        "rounds": 0, "answer": "measured", "statistic": "the search's one measurement"}
    assert doc["gain_over_defaults"]["gain_pct"] == pytest.approx((770 / 420 - 1) * 100)
    pruned = next(t for t in doc["trials"] if t["trial"] == 4)
    assert pruned["reason"] == "cannot run: out_of_memory"


def test_a_recommendation_that_is_the_baseline_claims_no_gain(tmp_path):
    config = synthetic.make_config(tmp_path, "alone")
    study = optuna.create_study(study_name="alone", storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    c = synthetic.curve(0)
    study.add_trial(create_trial(values=[420.0, 98.0], constraints={CONSTRAINT: 0.0},
                                 user_attrs={**synthetic.stored(c), "engine_config": synthetic.BASELINE_ENGINE,
                                             "baseline": True}))
    d = decide(study, config)
    assert d.best is d.baseline
    lines = summary_lines(d)
    assert not any("+0.0%" in line or "uncertain" in line for line in lines)
    assert "the recommendation is vLLM's defaults (vllm serve): keep them; no trial measured more" in lines
    assert report_document(d)["verdict"] == "keep vLLM's defaults"


def test_a_trial_curve_shows_no_sent_rate_for_a_burst_and_the_kv_peak_in_percent(syn):
    study, config, _ = syn
    burst = {**synthetic.point(None, 900, burst_rps=10.0), "sent_rate_rps": 188879.9,  # all sent at once
             "engine": {"kv_usage_peak": 0.0642, "running_peak": 40, "preemptions": 0}}
    poisson = synthetic.point(4.2, 98)
    trial = create_trial(values=[420.0, 98.0], user_attrs=synthetic.stored([burst, poisson]))
    v = TrialView(trial, rank_curve([burst, poisson], 100.0))
    rows = curve_rows(decide(study, config), v)
    assert rows[0]["arrivals"] == "burst" and rows[0]["sent_rate_rps"] is None
    assert rows[0]["engine_kv_usage_peak_pct"] == 6.4  # as the limits line says "KV peak 6%"
    assert rows[1]["sent_rate_rps"] == 4.2 and rows[1]["chosen"]


def test_the_charts_put_the_recommendation_at_its_confirmed_number(confirmed):
    """The PNG's Pareto and history panels draw the recommendation's star at the number every other view gives: the
    confirmation's median, its interval as an error bar and the rounds in the legend (not the search's one run)."""
    from optimizer.decision.plots import figure

    config, study, _ = confirmed
    d = decide(study, stored(study))
    tp = d.throughput(d.best)
    assert tp.confirmed and tp.low_tok_s is not None
    panels = [ax for ax in figure(d).axes if ax.get_title().startswith(("Pareto front", "Optimization history"))]
    assert len(panels) == 2
    for ax in panels:
        star = next(c for c in ax.collections if c.get_label().startswith(f"recommended (#{d.best.number})"))
        assert star.get_offsets()[0][1] == pytest.approx(tp.output_throughput_tok_s)
        assert f"median of {tp.rounds} confirmation rounds" in star.get_label()
        assert f"[{tp.low_tok_s:.0f}, {tp.high_tok_s:.0f}]" in star.get_label()
