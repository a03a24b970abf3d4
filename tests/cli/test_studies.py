"""`optimize studies` on real SQLite studies made by the simulated engine: one row a study with its limit, trials,
best so far (as `optimize report` decides it) and last activity; nothing written, and every bad input one line."""

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from optimizer.cli.main import main
from optimizer.decision.decide import decide
from optimizer.decision.document import verdict
from optimizer.search.study import confirmation_runs, finished_count
from tests.support.fakes import config_only_model_in, make_config, run_study

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A studies folder with two studies (one confirmed), and a SQLite file that is no study database."""
    d = tmp_path_factory.mktemp("studies")
    model = config_only_model_in(d)
    made = {}
    for name, kw in (("alpha", dict(budget=3)), ("beta", dict(budget=10, confirm=2, ttft_p99_ms=40.0))):
        config = make_config(d, model, study_name=name, storage_url=f"sqlite:///{d}/{name}.db", **kw)
        made[name] = (config, run_study(d, config))
    with sqlite3.connect(d / "notes.db") as db:
        db.execute("CREATE TABLE notes (line TEXT)")
    return d, made


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows_of(capsys, *argv) -> list[dict]:
    assert main(["studies", *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_study_is_one_row_with_the_numbers_the_report_gives(folder, capsys):
    d, made = folder
    before = {p.name: digest(p) for p in d.glob("*.db")}
    rows = rows_of(capsys, "--studies-dir", str(d))
    assert [r["study"] for r in rows] == ["alpha", "beta"]  # not beta.confirmation, not notes
    for row in rows:
        config, study = made[row["study"]]
        dec = decide(study, config)
        runs = len(confirmation_runs(study))
        assert row["limits"] == {"alpha": "TTFT P99 <= 30ms", "beta": "TTFT P99 <= 40ms"}[row["study"]]
        assert row["trials"] == f"{finished_count(study) + runs}/{config.budget}"
        assert row["best"] == f"#{dec.best.number}" and row["decision"] == verdict(dec)
        assert row["tok/s"] == pytest.approx(dec.throughput(dec.best).output_throughput_tok_s)
        assert row["req/s"] is not None and row["req/s"] > 0
        last = max(t.datetime_complete for t in [*study.trials, *confirmation_runs(study)])
        assert row["last activity"] == last.strftime("%Y-%m-%d %H:%M")
    assert made["beta"][1].trials and len(confirmation_runs(made["beta"][1])) > 0  # beta's row counts its runs
    assert {p.name: digest(p) for p in d.glob("*.db")} == before  # nothing written, notes.db left alone


def test_the_table_as_the_command_prints_it(folder):
    d, made = folder
    proc = subprocess.run([sys.executable, "-m", "optimizer", "studies", "--studies-dir", str(d)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert lines[0].split() == ["study", "limits", "trials", "best", "tok/s", "req/s", "decision", "last",
                                "activity"]
    assert [line.split()[0] for line in lines[2:]] == ["alpha", "beta"]
    assert all(len(line) <= 100 for line in lines)
    assert proc.stderr.strip() == f"(2 studies in {d}; `optimize report --study NAME` for one)"


def test_a_storage_url_lists_that_database_alone(folder, capsys):
    d, _ = folder
    assert [r["study"] for r in rows_of(capsys, "--storage", f"sqlite:///{d}/beta.db")] == ["beta"]


def test_a_missing_or_empty_folder_is_one_line_and_stays_as_it_was(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["studies", "--studies-dir", str(missing)]) == 0
    out, err = capsys.readouterr()
    assert out == f"no studies: {missing} does not exist yet; create one with `optimize --studies-dir {missing} " \
                  f"--ttft-p99 150ms`\n" and err == ""
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    assert main(["studies", "--studies-dir", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "holds no study database" in out
    assert list((tmp_path / "empty").iterdir()) == []


@pytest.mark.parametrize("url, said", [
    ("nosuchdb://x/y", "error: cannot open storage nosuchdb://x/y (NoSuchModuleError): check the URL"),
    ("sqlite:///{tmp}", "is a directory, not a database file"),
])
def test_a_bad_storage_url_is_one_line_and_exit_2(tmp_path, capsys, url, said):
    assert main(["studies", "--storage", url.format(tmp=tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and said in err and "Traceback" not in err


def test_a_sqlite_url_of_no_file_creates_none(tmp_path, capsys):
    url = f"sqlite:///{tmp_path}/sub/none.db"
    assert main(["studies", "--storage", url]) == 0
    assert capsys.readouterr().out.startswith(f"no studies at {url}: ")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_no_sqlite_url_can_name_is_one_line_and_nothing_is_made(folder, tmp_path, capsys):
    d, _ = folder
    odd = tmp_path / "what?"
    odd.mkdir()
    (odd / "alpha.db").write_bytes((d / "alpha.db").read_bytes())
    assert main(["studies", "--studies-dir", str(odd)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --studies-dir '{odd}' has a '?' in its path") and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["what?"]  # not the file 'what' its URL would name
