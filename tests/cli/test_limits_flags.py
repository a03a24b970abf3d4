"""The limit flags of `optimize` and `optimize report` as a user gives them: every bad input is one line naming the
fix, exit code 2, and nothing made; the valid ones are accepted and printed as the dry run's limits line; a resume
with other limits is refused; the flags a Limits writes give it back through the real parsers."""

import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.cli.common import limits_given
from optimizer.cli.main import main
from optimizer.cli.report import build_parser as report_parser
from optimizer.cli.run import build_parser as run_parser
from optimizer.config.limits import Limits, parse_limits
from optimizer.search.study import open_study, storage_for
from tests.support.fakes import make_config, run_cli

REPO = Path(__file__).resolve().parents[2]

BAD = [  # (the flags, what the one line says: the fix it names)
    (["--ttft-p99", "150ms", "--slo", "ttft:p99=100ms"],
     "error: TTFT P99 is limited twice (--ttft-p99 and --slo ttft:p99=100ms): give each limit once"),
    (["--slo", "tpot:p150=50ms"],
     "error: --slo 'tpot:p150=50ms': the percentile p150 is outside 0-100; use one such as p50, p90, p95, p99, p99.9"),
    (["--tpot-p99", "50"], "error: --tpot-p99 '50' has no unit: write it as e.g. '50ms' or '50s'"),
    (["--slo", "tpot:p90=50"], "error: --slo 'tpot:p90=50': '50' has no unit: write it as e.g. '50ms' or '50s'"),
    (["--slo", "queue:p99=50ms"],
     "error: --slo 'queue:p99=50ms': unknown metric 'queue'; use one of ttft, tpot, itl, e2e (e.g. --slo "
     "tpot:p90=50ms)"),
    (["--slo", "ttft:max=50ms"],
     "error: --slo 'ttft:max=50ms': unknown statistic 'max'; use a percentile such as p50, p90, p95, p99, p99.9, or "
     "mean"),
    (["--slo", "ttft=200ms"],
     "error: --slo 'ttft=200ms' has no statistic: write e.g. --slo ttft:p99=200ms (or add --goodput 99% for "
     "per-request limits)"),
    (["--goodput", "99%"], "error: --goodput needs per-request limits: add e.g. --slo ttft=200ms --slo tpot=50ms"),
    (["--goodput", "99", "--slo", "ttft=200ms"],
     "error: --goodput '99' is not a share of requests: write it as e.g. --goodput 99%"),
    (["--goodput", "99%", "--ttft-p99", "150ms"],
     "error: --goodput counts requests within per-request limits, not percentiles: give TTFT P99 as --slo ttft=150ms"),
    (["--goodput", "99%", "--slo", "ttft:p99=150ms"],
     "error: --slo 'ttft:p99=150ms': under --goodput a limit is per request, with no statistic: write --slo "
     "ttft=150ms"),
    (["--goodput", "99%", "--slo", "ttft=200ms", "--slo", "itl=50ms"],
     "error: --goodput counts ttft, tpot and e2e per request, as vLLM's --goodput does; ITL is per token gap: drop "
     "--slo itl=..., or give it without --goodput as --slo itl:p99=..."),
    ([], "error: a new study needs a latency limit, e.g. `optimize --ttft-p99 150ms --budget 40`; the others: "
         "--tpot-p99, --itl-p99, --e2e-p99, --slo METRIC:STAT=VALUE, --goodput (optimize --help)"),
    (["--ttft-p99", "150ms", "--tpot-p99", "50ms", "--output-len", "1:64"],
     "error: TPOT P99 needs requests of 2 or more output tokens, and this workload has requests of 1: raise its "
     "shortest output length to 2 (--output-len MIN:MAX, or the workload file or trace) or drop --tpot-p99 50ms"),
    (["--slo", "itl:p90=20ms", "--output-len", "1:1"],
     "error: ITL P90 needs requests of 2 or more output tokens, and this workload has requests of 1: raise its "
     "shortest output length to 2 (--output-len MIN:MAX, or the workload file or trace) or drop --slo itl:p90=20ms"),
]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["run", "dry-run"])
@pytest.mark.parametrize("argv, said", BAD, ids=[said[7:40] for _, said in BAD])
def test_every_bad_limit_is_one_line_naming_the_fix_and_nothing_is_made(tmp_path, capsys, argv, said, dry):
    assert main([*argv, *dry, "--studies-dir", str(tmp_path / "studies")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and one_line(err) == said
    assert list(tmp_path.iterdir()) == []


def test_a_workload_file_of_one_token_outputs_cannot_show_tpot(tmp_path, capsys):
    given = tmp_path / "given"
    given.mkdir()
    (given / "w.yaml").write_text("output_mixture:\n  - {min: 1, max: 4, weight: 0.1}\n")
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--slo", "tpot:mean=30ms", "--workload", str(given / "w.yaml"),
                        "--studies-dir", str(tmp_path / "studies"))
    assert code == 2 and one_line(err).startswith("error: TPOT mean needs requests of 2 or more output tokens")
    assert "drop --slo tpot:mean=30ms" in err and sorted(tmp_path.iterdir()) == [given]
    (given / "t.csv").write_text("input_len,output_len\n64,1\n" + "64,32\n" * 20)
    code, err = run_cli(capsys, "--itl-p99", "20ms", "--trace", str(given / "t.csv"), "--studies-dir",
                        str(tmp_path / "studies"))
    assert code == 2 and one_line(err).startswith("error: ITL P99 needs requests of 2 or more output tokens")
    assert sorted(tmp_path.iterdir()) == [given]


def test_a_bad_limit_as_a_user_runs_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "optimizer", "--slo", "tpot:p150=50ms", "--budget", "10",
                           "--studies-dir", str(tmp_path / "studies")], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc.stderr).startswith("error: --slo 'tpot:p150=50ms': the percentile p150 is outside 0-100")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--slo", "tpot:p150=50ms"], ["--goodput", "99%"], ["--e2e-p99", "5"]])
def test_the_report_refuses_a_bad_limit_before_it_opens_the_study(tmp_path, capsys, argv):
    code, err = run_cli(capsys, "report", "--study", "ghost", *argv, "--studies-dir", str(tmp_path / "studies"))
    assert code == 2 and one_line(err).startswith(("error: --slo", "error: --goodput", "error: --e2e-p99"))
    assert list(tmp_path.iterdir()) == []


def dry_limits(capsys, tmp_path, *argv) -> str:
    assert main(["--dry-run", *argv, "--studies-dir", str(tmp_path / "studies")]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("limits:")]
    assert list(tmp_path.iterdir()) == []
    return line


@pytest.mark.parametrize("argv, shown", [
    (["--ttft-p99", "150ms", "--tpot-p99", "50ms"], "TTFT P99 <= 150ms, TPOT P99 <= 50ms; a trial stops after"),
    (["--goodput", "99%", "--slo", "ttft=200ms", "--slo", "tpot=50ms"],
     "goodput 99% (each request within TTFT <= 200ms and TPOT <= 50ms); a trial stops after"),
    (["--slo", "ttft:p99.9=300ms", "--slo", "e2e:mean=2s"], "TTFT P99.9 <= 300ms, E2E mean <= 2.00s; a trial"),
    (["--tpot-p99", "50ms"], "TPOT P99 <= 50ms; a trial stops after"),  # no TTFT limit at all
])
def test_valid_limits_are_accepted_and_printed_by_the_dry_run(tmp_path, capsys, argv, shown):
    assert dry_limits(capsys, tmp_path, *argv).removeprefix("limits:").strip().startswith(shown)


def test_a_resume_with_other_limits_is_refused_and_the_same_ones_resume(tmp_path, capsys, config_only_model):
    config = make_config(tmp_path, config_only_model, study_name="mine", storage_url=f"sqlite:///{tmp_path}/mine.db"
                         ).model_copy(update={"limits": Limits.ttft_p99(150.0)})
    open_study(config, storage_for(config.storage_url))
    before = (tmp_path / "mine.db").read_bytes()
    for extra, new in ((["--tpot-p99", "50ms"], "--tpot-p99 50ms"),
                       (["--ttft-p99", "150ms", "--tpot-p99", "50ms"], "--ttft-p99 150ms --tpot-p99 50ms"),
                       (["--goodput", "99%", "--slo", "ttft=150ms"], "--slo ttft=150ms --goodput 99%")):
        code, err = run_cli(capsys, "--study", "mine", "--studies-dir", str(tmp_path), *extra)
        assert code == 2 and one_line(err) == (
            "error: study 'mine' already exists with other settings (limits: its own are TTFT P99 <= 150ms); a study "
            "measures one thing. Drop those flags to resume it, or pass --study NEW_NAME to start another; "
            f"`optimize report --study mine --studies-dir {tmp_path} {new}` re-ranks its stored replays for the new "
            "limits.")
    assert (tmp_path / "mine.db").read_bytes() == before
    from optimizer.cli.run import resolve_config

    for same in ([], ["--ttft-p99", "150ms"], ["--slo", "ttft:p99=0.15s"]):
        resumed, stored = resolve_config(run_parser().parse_args(["--study", "mine", "--studies-dir", str(tmp_path),
                                                                  *same]))
        assert stored is not None and resumed.limits == Limits.ttft_p99(150.0)
    assert (tmp_path / "mine.db").read_bytes() == before


@pytest.mark.parametrize("parser", [run_parser, report_parser], ids=["optimize", "report"])
@pytest.mark.parametrize("kw", [
    dict(ttft_p99="150ms", tpot_p99="50ms"),
    dict(itl_p99="0.1s", e2e_p99="12.5s", slo=["ttft:p99.9=300ms", "tpot:mean=20ms"]),
    dict(slo=["ttft=200ms", "tpot=50ms", "e2e=8s"], goodput="99.5%"),
])
def test_the_flags_of_limits_parse_back_to_them(parser, kw):
    limits = parse_limits(**kw)
    assert limits_given(parser().parse_args(limits.flags.split())) == limits
