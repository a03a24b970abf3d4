"""Hostile names and paths: each is one line that says what is wrong, exit code 2, and nothing written anywhere."""

from pathlib import Path

import optuna
import pytest

from optimizer.core.paths import check_study_name
from tests.support.fakes import run_cli


def files_under(root):
    return sorted(p.relative_to(root) for p in root.rglob("*"))


@pytest.mark.parametrize("name", ["../escaped", "a/b", "/abs", ".hidden", "..", "sp ace", "x;rm", "é", "a\\b", ""])
def test_a_study_name_that_would_leave_its_folder_is_refused(tmp_path, capsys, name):
    studies = tmp_path / "studies"
    for sub in ([], ["export"], ["report"]):
        code, err = run_cli(capsys, *sub, "--study", name, "--ttft-p99", "150ms", "--studies-dir", str(studies)) \
            if not sub else run_cli(capsys, *sub, "--study", name, "--studies-dir", str(studies))
        assert code == 2, err
        assert err.startswith("error: --study") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "letters, digits" in err or "empty" in err
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("name", ["llama8b", "Llama-3.1_8B", "a.b.c", "0", "x-" * 40])
def test_ordinary_study_names_pass(name):
    assert check_study_name(name) == name


def test_a_study_name_too_long_for_its_files_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, "--study", "a" * 101, "--ttft-p99", "150ms", "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "at most 100" in err and files_under(tmp_path) == []


@pytest.mark.parametrize("make,hint", [
    (lambda tmp: ("sqlite:////etc/hostname/x.db", []), "'/etc/hostname' is a file, not a directory"),
    (lambda tmp: (f"sqlite:///{tmp}/blocker/deeper/x.db", ["blocker"]), "is a file, not a directory"),
    (lambda tmp: (f"sqlite:///{tmp}", []), "is a directory, not a database file"),
])
def test_a_storage_path_that_cannot_be_created_is_a_usage_error(tmp_path, capsys, make, hint):
    url, blockers = make(tmp_path)
    for b in blockers:
        (tmp_path / b).write_text("not a folder")
    before = files_under(tmp_path)
    for sub in ([], ["export"]):
        argv = [*sub, "--storage", url, "--studies-dir", str(tmp_path / "s")] + ([] if sub else ["--ttft-p99", "1s"])
        code, err = run_cli(capsys, *argv)
        assert code == 2, err
        assert hint in err and "internal error" not in err and len(err.strip().splitlines()) == 1, err
    assert files_under(tmp_path) == before


def test_the_library_refuses_such_a_storage_path_too(tmp_path):
    from optimizer.core.errors import UsageError
    from optimizer.search.study import storage_for

    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        storage_for(f"sqlite:///{tmp_path}/f/x.db")
    # and a good one still opens
    storage = storage_for(f"sqlite:///{tmp_path}/new/dir/x.db")
    optuna.create_study(storage=storage, study_name="ok")
    assert (tmp_path / "new" / "dir" / "x.db").is_file()


@pytest.mark.parametrize("flag,what", [("--trace", "trace"), ("--space", "search space"),
                                       ("--workload", "workload"), ("--calibration", "calibration")])
def test_an_input_file_that_is_a_directory_says_so(tmp_path, capsys, config_only_model, flag, what):
    (tmp_path / "adir").mkdir()
    out = tmp_path / "studies"
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        flag, str(tmp_path / "adir"), "--studies-dir", str(out))
    assert code == 2, err
    assert f"{what} file" in err and "is a directory, not a file" in err and "does not exist" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("flag", ["--trace", "--space", "--workload"])
def test_an_input_file_under_a_file_says_why_it_cannot_exist(tmp_path, capsys, config_only_model, flag):
    (tmp_path / "plain").write_text("x")
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        flag, str(tmp_path / "plain" / "f.yaml"), "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and "is a file, not a directory" in err, err


@pytest.mark.parametrize("text,message", [
    ("max_num_seqs: {min: 16, max: 4}\n", "error: invalid search space range 'max_num_seqs': min 16 > max 4"),
    ("gpu_memory_utilization: {min: 0.9, max: 0.5}\n",
     "error: invalid search space range 'gpu_memory_utilization': min 0.9 > max 0.5"),
])
def test_an_inverted_range_names_its_prefix_once(tmp_path, capsys, config_only_model, text, message):
    f = tmp_path / "space.yaml"
    f.write_text(text)
    code, err = run_cli(capsys, "--ttft-p99", "150ms", "--model", str(config_only_model), "--dummy-weights",
                        "--space", str(f), "--studies-dir", str(tmp_path / "s"))
    assert code == 2 and err.strip() == message, err


@pytest.mark.parametrize("sub", [[], ["report"]])
def test_a_studies_dir_that_is_a_file_says_so(tmp_path, capsys, sub):
    (tmp_path / "f").write_text("x")
    for where in (tmp_path / "f", tmp_path / "f" / "deeper"):
        code, err = run_cli(capsys, *sub, "--studies-dir", str(where), *([] if sub else ["--ttft-p99", "1s"]))
        assert code == 2 and "--studies-dir" in err and "is a file, not a directory" in err, err
        assert len(err.strip().splitlines()) == 1
    assert files_under(tmp_path) == [Path("f")]


@pytest.mark.parametrize("argv, said", [
    (["report", "--out", "{file}"], "--out '{file}' is a file, not a directory: give a folder for the PNG and HTML"),
    (["export", "--out", "{file}"], "--out '{file}' is a file, not a directory: give a folder for the exported"),
    (["report", "--out", "{file}/deeper"], "cannot be created: '{file}' is a file, not a directory"),
    (["report", "--bench-json", "{dir}"], "--bench-json '{dir}' is a directory: give a file name, e.g. {dir}/result"),
    (["calibrate", "--out", "{file}/cal.json"], "--out '{file}/cal.json' cannot be created: '{file}' is a file"),
])
def test_an_output_path_in_the_way_is_refused_before_any_work(tmp_path, capsys, argv, said):
    # before: FileExistsError, IsADirectoryError (a `.tmp` left beside it) or NotADirectoryError, after the work
    (tmp_path / "report.html").write_text("x")
    (tmp_path / "results").mkdir()
    names = {"file": str(tmp_path / "report.html"), "dir": str(tmp_path / "results")}
    where = [] if argv[0] == "calibrate" else ["--studies-dir", str(tmp_path / "s")]
    code, err = run_cli(capsys, *[a.format(**names) for a in argv], *where)
    assert code == 2 and said.format(**names) in err and len(err.strip().splitlines()) == 1, err
    assert files_under(tmp_path) == [Path("report.html"), Path("results")]
