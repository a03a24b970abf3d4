"""Every hint that names a command runs as printed: each `optimize ...` a message puts in backticks parses with that
command's own parser and passes the checks the command makes before it runs (the study it names, the settings a
resume may not change, the budget a confirmation needs). The one that changes a study is run too."""

import re
import shlex

from optimizer.cli.common import limits_given, load_study
from optimizer.cli.run import resolve_config
from optimizer.config.limits import Limits
from optimizer.decision.decide import decide
from optimizer.decision.views import summary_lines
from optimizer.search.attrs import STUDY_CONFIRMATION
from optimizer.search.split import CONFIGS, plan
from optimizer.search.confirmed import confirmation
from optimizer.search.study import finished_count, open_study, storage_for
from tests.cli.test_help import _parser_for
from tests.support import synthetic
from tests.support.fakes import make_config, run_cli, run_study


def commands(text: str) -> list[list[str]]:
    """The argv of every `optimize ...` in `text`."""
    found = [shlex.split(c) for c in re.findall(r"`(optimize[^`]*)`", text)]
    assert found, f"no command in backticks: {text!r}"
    return found


def accepted(argv: list[str]):
    """`argv` as the command takes it before it runs: a study run resolves its settings and plans its
    confirmation (a UsageError here is a hint that fails as printed); a subcommand finds its study."""
    parser, rest = _parser_for(argv)
    ns = parser.parse_args(rest)  # a SystemExit here is a hint that does not parse
    if argv[1:2] and not argv[1].startswith("-"):
        return load_study(ns)
    config, _ = resolve_config(ns)
    plan(config.budget, config.confirm, config.serves_after)
    return config


def test_the_missing_study_hint_creates_it_where_it_was_looked_for(tmp_path, capsys):
    code, err = run_cli(capsys, "report", "--study", "ghost", "--studies-dir", str(tmp_path))
    assert code == 2
    (argv,) = commands(err)
    config = accepted(argv)
    assert config.study_name == "ghost" and config.storage_url == f"sqlite:///{tmp_path}/ghost.db"


def test_the_missing_limit_hint_starts_a_study(tmp_path, capsys):
    code, err = run_cli(capsys, "--studies-dir", str(tmp_path))
    assert code == 2
    (argv,) = commands(err)
    assert accepted(argv + ["--studies-dir", str(tmp_path)]).limits == Limits.ttft_p99(150.0)


def test_the_changed_limits_hint_re_ranks_the_stored_study_for_the_new_limits(tmp_path, capsys, config_only_model):
    config = make_config(tmp_path, config_only_model, study_name="mine", storage_url=f"sqlite:///{tmp_path}/mine.db")
    open_study(config, storage_for(config.storage_url))
    code, err = run_cli(capsys, "--study", "mine", "--studies-dir", str(tmp_path), "--ttft-p99", "30ms", "--slo",
                        "tpot:p90=40ms")
    assert code == 2 and len(err.strip().splitlines()) == 1
    (argv,) = commands(err)
    assert argv[:2] == ["optimize", "report"] and accepted(argv)[0].limits == config.limits  # it finds the study
    parser, rest = _parser_for(argv)
    assert limits_given(parser.parse_args(rest)).text == "TTFT P99 <= 30ms, TPOT P90 <= 40ms"


def test_the_hints_of_a_re_ranked_report_name_commands_that_run(tmp_path):
    study, config = synthetic.build(tmp_path)
    # 1 ms: no stored replay meets it; 300 ms: the best's highest rate meets it. Both: measure it anew
    for limit_ms in (1.0, 300.0):
        notes = "\n".join(summary_lines(decide(study, config, Limits.ttft_p99(limit_ms))))
        for argv in commands(notes):
            config_new = accepted(argv + ["--studies-dir", str(tmp_path)])
            assert config_new.limits == Limits.ttft_p99(limit_ms) and config_new.study_name == "NEW_NAME"


def test_the_command_that_adds_a_confirmation_round_adds_one_and_leaves_the_search(tmp_path, config_only_model):
    first = make_config(tmp_path, config_only_model, budget=12, confirm=2)
    study = run_study(tmp_path, first)
    d = decide(study, first)
    assert d.more_rounds == f"optimize --study {first.study_name} --budget {12 + CONFIGS} --confirm 3"
    config = accepted(shlex.split(d.more_rounds) + ["--storage", first.storage_url])
    again = run_study(tmp_path, config)
    assert finished_count(again) == finished_count(study)  # the search kept its trials
    assert STUDY_CONFIRMATION.of(again)["rounds"] == 3 and confirmation(again).full_rounds == [0, 1, 2]
