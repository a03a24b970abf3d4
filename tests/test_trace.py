import pytest

from optimizer.cli import main
from optimizer.config import WorkloadSpec
from optimizer.errors import UsageError
from optimizer.trace import load_trace
from optimizer.workload import build_workload


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
