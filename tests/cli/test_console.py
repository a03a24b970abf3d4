"""Normal output is signal: vLLM's Triton banner, Optuna's ExperimentalWarning (which names our source line) and the
importance evaluator's UserWarnings (with site-packages paths) stay off the console; `--debug` shows them. Each
test runs `optimize` as a user does, in a child process, so that nothing in this process hides or adds a warning."""

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from tests.support import synthetic

REPO = Path(__file__).resolve().parents[2]
NOISE = ("Warning:", "ExperimentalWarning", "is experimental", "site-packages", "Triton is installed")


def optimize(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optimizer", *argv], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": ""})


def noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in NOISE)]


@pytest.fixture
def sparse_study(tmp_path) -> Path:
    """The synthetic study plus six searched trials, one of them with a parameter no other trial has: Optuna's
    importance evaluator warns that its regime has fewer than 2 trials, as it did on the README's demo."""
    study, _ = synthetic.build(tmp_path)
    extra = []
    for i, n in enumerate((1, 2, 3, 1, 2, 3)):
        t = study.trials[n]
        params, distributions = {**t.params, "max_num_seqs": t.params["max_num_seqs"] + i + 1}, dict(t.distributions)
        if i == 0:
            params["max_model_len"] = 1024
            distributions["max_model_len"] = optuna.distributions.IntDistribution(256, 2048)
        extra.append(optuna.trial.create_trial(values=t.values, params=params, distributions=distributions,
                                               user_attrs={**t.user_attrs, "engine_params": params},
                                               constraints={synthetic.CONSTRAINT: 0.0}))
    study.add_trials(extra)
    return tmp_path


def test_report_and_export_print_no_library_warnings_unless_debug(sparse_study):
    args = ["--study", "syn", "--studies-dir", str(sparse_study)]
    report, export = optimize("report", *args), optimize("export", *args)
    assert report.returncode == 0 and export.returncode == 0, report.stderr + export.stderr
    assert noise(report.stderr) == [] and noise(export.stderr) == [], report.stderr + export.stderr
    assert "--max-num-seqs 128" in export.stdout  # the command is still printed
    debug = optimize("report", *args, "--debug")
    assert debug.returncode == 0
    shown = "\n".join(noise(debug.stderr))
    assert "ExperimentalWarning" in shown and "Some regimes for parameter `max_model_len`" in shown, debug.stderr


def test_a_command_that_imports_vllm_prints_no_triton_banner_unless_debug(tmp_path, config_only_model):
    """An unknown name in the space file is checked against vLLM's EngineArgs: vLLM is imported, then the run
    ends with one line, exit 2."""
    space = tmp_path / "space.yaml"
    space.write_text("max_num_sequences: {min: 1, max: 8}\n")
    args = ["--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights", "--space", str(space),
            "--studies-dir", str(tmp_path / "s")]
    quiet = optimize(*args)
    assert quiet.returncode == 2 and quiet.stderr.startswith("error: search space: unknown parameter"), quiet.stderr
    assert noise(quiet.stderr) == [] and len(quiet.stderr.strip().splitlines()) == 1, quiet.stderr
    debug = optimize(*args, "--debug")
    if "Triton is installed" not in debug.stderr:
        pytest.skip("this vLLM build prints no Triton banner here (not the CPU build, or no vLLM)")


def test_a_log_of_a_study_has_one_line_per_trial_and_per_run_and_no_redraws(tmp_path, config_only_model, capsys,
                                                                           monkeypatch):
    """`optimize` with its stderr in a file (here: captured, no terminal), on the simulated engine: 2 search trials,
    2 rounds of confirmation runs and 2 runs as served. Each trial and each run is one line, and nothing is redrawn or
    padded."""
    from optimizer.search import runner
    from optimizer.search.attrs import CONFIRM
    from optimizer.search.study import confirmation_study
    from tests.support.fakes import SimEngine, load, run_cli

    monkeypatch.setattr(runner, "factory_for", lambda config, path: SimEngine)
    monkeypatch.setattr(runner, "served_factory_for", lambda config, path: SimEngine)
    code, err = run_cli(capsys, "--ttft-p99", "30ms", "--budget", "10", "--confirm", "2", "--model",
                        str(config_only_model), "--dummy-weights", "--device", "cpu", "--num-requests", "40",
                        "--input-len", "64:256", "--output-len", "2:6", "--studies-dir", str(tmp_path))
    assert code == 0, err
    assert "\r" not in err and all(line.strip() for line in err.splitlines()), err  # no redraws, no blank padding
    heads = [line for line in err.splitlines() if line.startswith(("baseline (vLLM defaults) #", "trial #",
                                                                   "confirmation round ", "as served ("))]
    study = load(tmp_path)
    is_run = ("confirmation", "as served (")
    numbers = sorted(int(line.split("#")[1].split(":")[0].split(" ")[0]) for line in heads
                     if not line.startswith(is_run))
    names = [line.split("(run ")[1].split(",")[0].split(")")[0] for line in heads if line.startswith(is_run)]
    assert numbers == [t.number for t in study.get_trials(deepcopy=False)], err  # each trial once
    runs = confirmation_study(study).get_trials(deepcopy=False)  # each run once, by the name the report takes
    assert names == [f"c{t.number}" for t in runs], err
    assert any(line.startswith("confirmation round 2,") for line in heads), err
    served = [t for t in runs if (CONFIRM.of(t) or {}).get("served")]  # vLLM's defaults and the leader, if any
    assert served and sum(line.startswith("as served (") for line in heads) == len(served), err
    assert sum(line.startswith("estimated time: ") for line in err.splitlines()) == 1  # one estimate, at the start
