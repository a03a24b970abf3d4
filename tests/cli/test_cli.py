"""Bad input ends in a one-line message naming the fix, exit code 2, and no study created or changed."""

import json

import optuna
import pytest

from optimizer.config.limits import Limits
from optimizer.config.settings import StudyConfig
from optimizer.search.study import open_study, storage_for
from tests.support.fakes import run_cli


@pytest.mark.parametrize("slo", ["150", "150 parsecs", "-5ms", "fast", "0ms"])
def test_bad_slo(tmp_path, capsys, slo):
    code, err = run_cli(capsys, "--ttft-p99", slo, "--studies-dir", str(tmp_path))
    assert code == 2 and err.startswith("error: --ttft-p99") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("budget", ["0", "-3", "many", "99999999999999h"])
def test_bad_budget(tmp_path, capsys, budget):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--budget", budget, "--studies-dir", str(tmp_path))
    assert code == 2 and "--budget" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("repeats", ["0", "-1", "twice"])
def test_bad_repeats(tmp_path, capsys, repeats):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--repeats", repeats, "--studies-dir", str(tmp_path))
    assert code == 2 and "--repeats" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,hint", [
    (["--seed", "-1"], "--seed -1 is out of range: give a whole number from 0 to 4294967295"),  # Optuna's
    (["--seed", "4294967296"], "--seed 4294967296 is out of range"),  # sampler refused it after the first engines
    (["--workload-seed", "-1"], "workload.seed: Input should be greater than or equal to 0"),
])
def test_a_seed_out_of_range_is_refused_before_anything_runs(tmp_path, capsys, argv, hint):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", *argv, "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and hint in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv,hint", [
    (["--repeats", "0"], "--repeats"), (["--validate", "7"], "--validate"),
    (["--model", "/no/such/model"], "does not exist"),
])
def test_bad_calibrate_input(tmp_path, capsys, argv, hint):
    out = tmp_path / "cal.json"
    code, err = run_cli(capsys, "calibrate", "--out", str(out), *argv)
    assert code == 2 and hint in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_slo_for_a_new_study(tmp_path, capsys):
    code, err = run_cli(capsys, "--budget", "3", "--studies-dir", str(tmp_path))
    assert code == 2 and "a new study needs a latency limit, e.g. `optimize --ttft-p99 150ms" in err
    assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("space,hint", [
    ("max_num_sequences: {min: 1, max: 8}\n", "unknown parameter"),
    ("max_num_seqs: {min: 16, max: 4}\n", "min 16 > max 4"),
    ("max_num_seqs: [\n", "not valid YAML"),
    # what Optuna would refuse only at the first searched trial, after the baseline's engine had run
    ("max_num_seqs: {min: 0, max: 256, log: true}\n", "a log range needs min >= 1, got 0"),
    ("max_num_seqs: {min: 1, max: 256, step: 0}\n", "step 0 must be at least 1"),
    ("max_num_seqs: {min: 8, max: 256, log: true, step: 8}\n", "a log range takes no step, got step 8"),
    ("gpu_memory_utilization: {min: 0.1, max: 0.3, step: -0.05}\n", "step -0.05 must be above 0"),
    ("gpu_memory_utilization: {min: 0.1, max: .nan}\n", "must be finite numbers"),
])
def test_bad_space_file(tmp_path, capsys, config_only_model, space, hint):
    f = tmp_path / "space.yaml"
    f.write_text(space)
    out = tmp_path / "studies"
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        "--space", str(f), "--studies-dir", str(out))
    assert code == 2 and hint in err, err
    assert not out.exists()


def test_missing_model_path(tmp_path, capsys):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(tmp_path / "nope"),
                        "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "does not exist" in err and not (tmp_path / "s").exists()


def test_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(tmp_path / "empty"),
                        "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "no config.json" in err


@pytest.mark.parametrize("content, said", [
    (b"[]", "holds a JSON list, not an object of the model's settings"),  # was AttributeError, exit 1
    ("{}".encode("utf-16"), "is not valid JSON"),  # was UnicodeDecodeError, exit 1
])
def test_a_config_json_that_is_no_settings_object_is_refused(tmp_path, capsys, content, said):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(content)
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(tmp_path / "m"), "--dummy-weights",
                        "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s").exists()


def test_a_space_file_that_is_not_utf8_says_so(tmp_path, capsys, config_only_model):
    f = tmp_path / "space.yaml"
    f.write_bytes("max_num_seqs: [8, 16]\n".encode("utf-16"))  # what PowerShell's `>` writes
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        "--space", str(f), "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "is not UTF-8 text" in err and "save it as UTF-8" in err, err
    assert not (tmp_path / "s").exists()


def test_config_without_weights_needs_dummy_flag(tmp_path, capsys, config_only_model):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model),
                        "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "--dummy-weights" in err


def test_workload_longer_than_context(tmp_path, capsys, config_only_model):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        "--input-len", "64:1000", "--output-len", "100:300", "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "exceeds the model's context of 1024" in err
    assert not (tmp_path / "s").exists()


def test_bad_length_range(tmp_path, capsys):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--input-len", "512:64", "--studies-dir", str(tmp_path))
    assert code == 2 and "MIN <= MAX" in err


def test_another_slo_on_an_existing_study_is_refused_and_nothing_changes(tmp_path, capsys, config_only_model):
    url = f"sqlite:///{tmp_path}/mine.db"
    config = StudyConfig(study_name="mine", storage_url=url, ttft_p99_ms=150.0, budget=3,
                         model=str(config_only_model), dummy_weights=True)
    open_study(config, storage_for(url))
    before = (tmp_path / "mine.db").read_bytes()
    code, err = run_cli(capsys, "--study", "mine", "--ttft-p99", "300ms", "--studies-dir", str(tmp_path))
    assert code == 2 and "already exists with other settings (limits: its own are TTFT P99 <= 150ms)" in err
    assert "--study NEW_NAME" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "mine.db").read_bytes() == before
    stored = json.loads(optuna.load_study(study_name="mine", storage=url).user_attrs["optimizer_config"])
    assert StudyConfig.model_validate(stored).limits == Limits.ttft_p99(150.0)
    # the same file named by a URL with a query (SQLite's busy timeout): the same study, not a new one
    code, err = run_cli(capsys, "--study", "mine", "--ttft-p99", "300ms", "--storage", f"{url}?timeout=60")
    assert code == 2 and "already exists with other settings (limits: its own are TTFT P99 <= 150ms)" in err
    assert (tmp_path / "mine.db").read_bytes() == before


def test_export_of_a_missing_study(tmp_path, capsys):
    code, err = run_cli(capsys, "export", "--study", "ghost", "--studies-dir", str(tmp_path))
    assert code == 2 and "no study 'ghost'" in err


def test_malformed_storage_url_hides_the_password(tmp_path, capsys):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--storage", "postgresql://bob:s3cret@127.0.0.1:1/db",
                        "--studies-dir", str(tmp_path))
    assert code == 2 and "s3cret" not in err and "cannot open storage" in err


def test_malformed_storage_url(tmp_path, capsys):
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--storage", "not a url", "--studies-dir", str(tmp_path))
    assert code == 2 and "cannot open storage" in err and "sqlite:///" in err


def test_locked_sqlite_file_is_a_clear_error_and_changes_nothing(tmp_path, capsys, config_only_model, monkeypatch):
    """The file stays locked through every attempt to open it, so the test waits out each attempt's busy timeout:
    60 s in the product, five attempts. A 0.5 s timeout gives the same error; that the product waits long for a
    reader is tests/search/test_db_faults.py's (the timeout's value, and a write that waits out a reader)."""
    import sqlite3

    from optimizer.search import dbretry

    monkeypatch.setattr(dbretry, "SQLITE_BUSY_TIMEOUT_S", 0.5)
    url = f"sqlite:///{tmp_path}/locked.db"
    config = StudyConfig(study_name="locked", storage_url=url, ttft_p99_ms=150.0, budget=3,
                         model=str(config_only_model), dummy_weights=True)
    open_study(config, storage_for(url))
    before = (tmp_path / "locked.db").read_bytes()
    holder = sqlite3.connect(tmp_path / "locked.db", timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        code, err = run_cli(capsys, "--study", "locked", "--studies-dir", str(tmp_path))
    finally:
        holder.rollback()
        holder.close()
    assert code == 2 and "locked" in err and "another process" in err, err
    assert (tmp_path / "locked.db").read_bytes() == before
