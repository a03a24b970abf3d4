"""The last screen of a run leads with the answer: the decision's line, the command that deploys it (the one
`optimize export` prints), then the table, in lines a terminal holds; `optimize report` leads with the same two, and
keeps the statistics' definitions."""

import json
import shlex
import subprocess

import pytest

from optimizer.cli.main import main
from optimizer.decision.decide import decide
from optimizer.decision.report import WIDTH, summary_text
from optimizer.decision.verdict import answer_line, verdict_line
from tests.support.fakes import config_only_model_in, make_config, run_study, unwrapped

DEFINITIONS = ("Student t", "group-sequential", "ratio of the two medians")  # the report's, not the last screen's


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory):
    """A study on the simulator, 4 search trials then 2 confirmation rounds, in its studies folder."""
    d = tmp_path_factory.mktemp("screen")
    config = make_config(d, config_only_model_in(d), study_name="default", storage_url=f"sqlite:///{d}/default.db",
                         budget=10, confirm=2)
    return config, run_study(d, config), d


def deploy_block(text: str) -> str:
    """The command after 'deploy: ', over its lines, up to the blank line below it."""
    return text[text.index("deploy: ") + len("deploy: "):text.index("\n\n")]


def bash_words(command: str) -> list[str]:
    done = subprocess.run(["bash", "-c", f"set -- {command}\nprintf '%s\\0' \"$@\""], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


def test_the_last_screen_leads_with_the_decision_and_the_command_export_prints(confirmed, capsys):
    config, study, d = confirmed
    text = summary_text(study, config)
    lines = text.splitlines()
    dec = decide(study, config)
    assert dec.confirmed
    assert lines[0] == answer_line(dec) and lines[0].startswith("decision: ") and lines[0].endswith("(2 rounds)")
    assert lines[1].startswith("deploy: ")
    assert main(["export", "--studies-dir", str(d), "--out", str(d / "export")]) == 0
    exported = capsys.readouterr().out.strip()
    # pasted into a shell, the wrapped command runs exactly what `optimize export` prints
    assert bash_words(deploy_block(text)) == bash_words(exported) == shlex.split(exported)
    table = lines[lines.index("") + 1:]
    assert table[0].startswith("confirmed in 2 rounds at TTFT P99 <= 30ms: ")
    assert table[1].split()[:3] == ["config", "rounds", "tok/s"]
    rows = [line for line in table if line.startswith("#")]
    assert [int(r.split()[0][1:]) for r in rows] == [c.number for c in dec.confirmation.configs]
    assert rows[0].startswith(f"#{dec.baseline.number} vLLM defaults")
    assert "recommended" in next(r for r in rows if r.startswith(f"#{dec.best.number} "))
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert not any(words in text for words in DEFINITIONS)  # defined in `optimize report` and docs/report.md
    assert verdict_line(dec) not in unwrapped(text)  # the first line says it


def test_the_report_leads_with_the_same_two_and_keeps_the_definitions(confirmed, capsys):
    config, study, d = confirmed
    screen = summary_text(study, config)
    assert main(["report", "--studies-dir", str(d), "--out", str(d / "report")]) == 0
    out = capsys.readouterr().out
    head = screen[:screen.index("\n\n")]
    assert out.startswith(head + "\n\n")  # the decision and its deploy command
    assert all(words in out for words in DEFINITIONS)
    assert main(["report", "--studies-dir", str(d), "--out", str(d / "report"), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answer"] == screen.splitlines()[0] and err.startswith(head + "\n")


def test_a_search_without_a_confirmation_says_it_is_one_measurement_each(syn):
    study, config, _ = syn
    text = summary_text(study, config)
    lines = text.splitlines()
    dec = decide(study, config)
    # the synthetic study's gain over vLLM's defaults, by hand: +83.3% (tests/support/synthetic.py)
    assert lines[0].startswith(f"decision: deploy #{dec.best.number}: +83.3% output tok/s over vLLM's defaults "
                               f"(one measurement each")
    assert lines[0].endswith("not confirmed)") and lines[1].startswith("deploy: ")
    assert "TTFT P99 <= 100ms, one measurement each (not confirmed)" in lines
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)


def test_no_config_that_meets_the_limit_has_nothing_to_deploy(tmp_path):
    config = make_config(tmp_path, config_only_model_in(tmp_path), ttft_p99_ms=0.001, budget=2)
    study = run_study(tmp_path, config)
    lines = unwrapped(summary_text(study, config))
    assert lines[0] == "decision: nothing to deploy: no config met TTFT P99 <= 0.0ms"
    assert not any(line.startswith("deploy: ") for line in lines)
    assert lines[-1].startswith("No trial met the limit: TTFT P99 <= 0.0ms. Relax it (--ttft-p99 0.001ms)")
