"""`optimize --dry-run`: the plan of a run, printed without starting an engine or writing anything; its bad inputs
are the run's own one-line errors."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.cli.main import main
from optimizer.hardware.device import installed_build
from optimizer.search.probe import TARGET_S_PER_TRIAL
from optimizer.search.progress import clock_text
from optimizer.search.split import plan
from optimizer.search.study import finished_count
from tests.support.fakes import config_only_model_in, make_config, run_study

REPO = Path(__file__).resolve().parents[2]
LABELS = ["vLLM", "machine", "study", "model", "workload", "limits", "space", "budget", "time"]


def fields(out: str) -> dict[str, str]:
    """The dry run's labelled fields, each with its wrapped lines joined."""
    found: dict[str, str] = {}
    label = None
    for line in out.splitlines()[1:]:
        if not line.startswith(" "):
            label, _, text = line.partition(":")
            found[label] = text.strip()
        else:
            found[label] += " " + line.strip()
    return found


def test_a_new_demo_study_is_planned_and_nothing_is_made(tmp_path):
    studies = tmp_path / "studies"
    proc = subprocess.run([sys.executable, "-m", "optimizer", "--dry-run", "--ttft-p99", "150ms", "--studies-dir",
                           str(studies)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "dry run: what the run would do; no engine starts, nothing is written"
    # lines fit 100 columns; a path longer than a line stays whole on its own line so it can be copied
    assert all(len(line) <= 100 or len(line.split()) == 1 for line in lines[1:]), proc.stdout
    f = fields(proc.stdout)
    assert list(f) == LABELS
    assert f["vLLM"] == f"{installed_build().describe()}; the trials run on cpu"
    assert f["study"] == f"'default', new, in sqlite:///{studies.resolve()}/default.db"
    assert f["model"].startswith("embedded tiny-llama-17m (a Llama, random weights): 17M parameters")
    assert "1000 requests per replay" in f["workload"] and f["limits"].startswith("TTFT P99 <= 150ms")
    assert "max_num_seqs 2-256 (log)" in f["space"] and "fixed: enforce_eager=True" in f["space"]
    assert f["budget"] == f"40 trials; {plan(40, None, True).line}"  # 14 search trials, 24 runs, 2 served
    # the demo's probe (an engine start) fits it to this machine at TARGET_S_PER_TRIAL a trial: the dry run says so
    assert f["time"].startswith(f"~{clock_text(40 * TARGET_S_PER_TRIAL)} at most: the probe at the start fits")
    assert not studies.exists() and list(tmp_path.iterdir()) == []


def test_a_model_of_one_s_own_has_no_estimate_before_an_engine_starts(tmp_path, capsys, config_only_model):
    argv = ["--dry-run", "--ttft-p99", "200ms", "--model", str(config_only_model), "--dummy-weights", "--budget", "20",
            "--studies-dir", str(tmp_path / "s")]
    assert main(argv) == 0
    f = fields(capsys.readouterr().out)
    assert f["model"].startswith(f"{config_only_model} with random weights (load_format=dummy): 17M parameters")
    assert "requests per replay chosen by a pilot trial" in f["workload"]
    assert f["time"].startswith("known after the first trial: it rests on an engine start")
    assert f["budget"].startswith("20 trials; confirmation: up to 3 rounds")
    assert not (tmp_path / "s").exists()


def test_a_ray_cluster_is_named_and_not_joined(tmp_path, capsys):
    argv = ["--dry-run", "--engine", "sim", "--ttft-p99", "150ms", "--ray", "127.0.0.1:1", "--budget", "20",
            "--studies-dir", str(tmp_path / "s")]
    assert main(argv) == 0  # nothing answers at that address: a dry run does not ask
    f = fields(capsys.readouterr().out)
    assert f["cluster"] == ("the Ray cluster at 127.0.0.1:1 (a dry run does not join it): each trial a task on one "
                            "node with its layout's GPUs, as many at once as the cluster's GPUs hold")
    assert not (tmp_path / "s").exists()


def test_a_resumed_study_is_planned_from_its_own_trials_and_left_unchanged(tmp_path, capsys):
    config = make_config(tmp_path, config_only_model_in(tmp_path), study_name="default",
                         storage_url=f"sqlite:///{tmp_path}/default.db")
    study = run_study(tmp_path, config)
    db = tmp_path / "default.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    assert main(["--dry-run", "--studies-dir", str(tmp_path), "--budget", "12"]) == 0
    f = fields(capsys.readouterr().out)
    assert f["study"] == f"'default', resumed, in sqlite:///{db}" and f["limits"].startswith("TTFT P99 <= 30ms")
    assert f["time"].endswith(f"; {finished_count(study)} search trials finished") and f["time"].startswith("~")
    assert main(["--dry-run", "--studies-dir", str(tmp_path)]) == 0  # its budget of 3 is spent
    assert fields(capsys.readouterr().out)["time"] == ("none: nothing is left to run (3 search trials finished); a "
                                                       "larger --budget adds trials")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("argv, said", [
    (["--dry-run"], "error: a new study needs a latency limit, e.g. `optimize --ttft-p99 150ms --budget 40`"),
    (["--dry-run", "--ttft-p99", "150ms", "--budget", "10", "--confirm", "5"],
     "error: --confirm 5 takes 17 of the 10 trials of --budget"),
    (["--dry-run", "--ttft-p99", "fast"], "error: --ttft-p99"),
])
def test_bad_input_is_the_run_s_one_line_and_exit_2(tmp_path, capsys, argv, said):
    assert main([*argv, "--studies-dir", str(tmp_path / "s")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and said in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()


def test_a_path_longer_than_a_line_stays_whole_on_a_line_of_its_own():
    from optimizer.cli.dryrun import field
    path = "sqlite:///" + "/very-long-directory-name" * 5 + "/default.db"
    lines = field("study", f"'default', new, in {path}")
    assert lines[0].split() == ["study:", "'default',", "new,", "in"] and lines[1].strip() == path
