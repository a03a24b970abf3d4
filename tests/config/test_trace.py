import pytest

from optimizer.cli.main import main
from optimizer.config.trace import load_trace
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import UsageError
from optimizer.measurement.workload import build_workload


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_with_timestamps(tmp_path):
    p = write(tmp_path, "t.csv", "input_len,output_len,timestamp\n10,5,0\n20,6,0.5\n30,7,2.0\n")
    assert load_trace(p) == [(10, 5, 0.0), (20, 6, 0.5), (30, 7, 2.0)]


def test_jsonl_without_timestamps(tmp_path):
    p = write(tmp_path, "t.jsonl", '{"input_len": 10, "output_len": 5}\n\n{"prompt_tokens": 12, "output_tokens": 3}\n')
    assert load_trace(p) == [(10, 5, None), (12, 3, None)]


@pytest.mark.parametrize("name,text,hint", [
    ("a.csv", "input_len,output_len\n10,5\n10,x\n", "line 3: output_len must be a whole number"),
    ("b.csv", "input_len,output_len\n10,5\n-4,5\n", "line 3: input_len must be a whole number"),
    ("c.csv", "input_len,output_len\n10,5\n2.5,5\n", "line 3: input_len"),
    ("d.csv", "prompt,completion\n10,5\n", "needs a header"),
    ("e.jsonl", '{"input_len": 1, "output_len": 2}\n{oops\n', "line 2: not valid JSON"),
    ("f.jsonl", '{"input_len": 1, "output_len": 2}\n[1, 2]\n', "line 2: expected an object"),
    ("g.csv", "input_len,output_len,timestamp\n10,5,1.0\n10,5,0.5\n", "must not decrease"),
    ("h.csv", "input_len,output_len,timestamp\n10,5,1.0\n10,5,\n", "every row or on none"),
    ("i.csv", "input_len,output_len\n10,5\n", "at least 2"),
    ("j.csv", "input_len,output_len\n10,5\ninf,5\n", "line 3: input_len must be a whole number"),  # OverflowError
])
def test_malformed_traces_name_the_line_and_the_fix(tmp_path, name, text, hint):
    with pytest.raises(UsageError) as err:
        load_trace(write(tmp_path, name, text))
    assert hint in str(err.value)


def test_workload_from_a_trace_keeps_lengths_and_rhythm():
    rows = [(10, 5, 100.0), (20, 6, 101.0), (30, 7, 103.0), (40, 8, 104.0)]
    w = build_workload(WorkloadSpec(num_requests=10, trace=rows, warmup_requests=1), 1000)
    assert [(r.input_len, r.output_len) for r in w.requests] == [(10, 5), (20, 6), (30, 7), (40, 8)]
    # gaps 1, 2, 1 s rescaled to 1 request/s on average: 3 gaps over 3 s -> unchanged; at 2 req/s, halved
    assert w.arrivals_s(1.0) == pytest.approx([0.0, 0.75, 2.25, 3.0])
    assert w.arrivals_s(2.0) == pytest.approx([0.0, 0.375, 1.125, 1.5])
    assert WorkloadSpec(num_requests=10, trace=rows).max_total_len == 48


def test_cli_refuses_a_malformed_trace_and_writes_nothing(tmp_path, capsys):
    bad = write(tmp_path, "bad.csv", "input_len,output_len\n10,5\nten,5\n")
    out = tmp_path / "studies"
    code = main(["--ttft-p99", "150ms", "--trace", str(bad), "--studies-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "bad.csv line 3" in err and not out.exists()


def test_original_timing_replays_the_traces_own_timestamps_at_its_own_rate():
    rows = [(10, 5, 100.0), (20, 6, 101.0), (30, 7, 103.0), (40, 8, 104.0)]
    from optimizer.measurement.workload import fixed_load_rate

    s = WorkloadSpec(num_requests=10, trace=rows, trace_timing="original")
    w = build_workload(s, 1000)
    assert w.native_rate_rps == pytest.approx(0.75)  # 3 gaps over 4 s
    assert fixed_load_rate(s, w) == w.native_rate_rps
    assert w.arrivals_s(w.native_rate_rps) == pytest.approx([0.0, 1.0, 3.0, 4.0])  # real time, as recorded
    # the same requests as the rescaled trace: only whether the rate is searched differs
    assert w.requests == build_workload(WorkloadSpec(num_requests=10, trace=rows), 1000).requests


def test_original_timing_needs_timestamps_and_open_arrivals():
    from optimizer.config.settings import build

    with pytest.raises(UsageError, match="needs a trace with timestamps"):
        build(WorkloadSpec, {"num_requests": 10, "trace": [(1, 1, None), (2, 2, None)], "trace_timing": "original"},
              "workload")
    with pytest.raises(UsageError, match="drop arrivals"):
        build(WorkloadSpec, {"num_requests": 10, "trace": [(1, 1, 0.0), (2, 2, 1.0)], "trace_timing": "original",
                             "arrivals": "constant"}, "workload")


def test_a_trace_with_constant_arrivals_keeps_its_lengths_and_spaces_them_evenly():
    rows = [(10, 5, 100.0), (20, 6, 101.0), (30, 7, 103.0), (40, 8, 104.0)]
    w = build_workload(WorkloadSpec(num_requests=10, trace=rows, arrivals="constant"), 1000)
    assert [(r.input_len, r.output_len) for r in w.requests] == [(10, 5), (20, 6), (30, 7), (40, 8)]
    assert w.arrivals_s(2.0) == [0.0, 0.5, 1.0, 1.5] and w.native_rate_rps is None


def test_a_study_at_the_traces_own_timestamps_measures_once_per_trial(tmp_path, config_only_model):
    from optimizer.config.settings import StudyConfig
    from tests.support.fake_engine import FakeEngine
    from optimizer.search.runner import prepare, run

    rows = [(20 + i % 7, 2 + i % 3, 0.05 * i) for i in range(30)]  # 20 req/s for 1.45 s
    config = StudyConfig(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=200.0, budget=2,
                         model=str(config_only_model), dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=30, warmup_requests=1, trace=rows,
                                               trace_timing="original"))
    study = run(prepare(config, tmp_path, say=lambda *a: None, engine_factory=FakeEngine, memory_probe=lambda: None),
                quiet=True)
    for t in study.trials:
        curve = t.user_attrs["curve"]  # one replay, no rate search (the baseline repeats it for the noise level)
        assert len(curve) == (3 if t.user_attrs.get("baseline") else 1)
        assert [p["offered_rate_rps"] for p in curve] == pytest.approx([20.0] * len(curve))  # 29 gaps in 1.45 s
        assert t.user_attrs["result"]["rate_rps"] == pytest.approx(20.0)
