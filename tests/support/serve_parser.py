"""`vllm serve`'s own command-line parser, built as `vllm`'s entry point builds it (vllm/entrypoints/cli/main.py):
the top-level FlexibleArgumentParser with the serve subcommand on it. `--config FILE` is expanded by the top-level
parser, which is where vLLM drops `false` booleans; a flat `AsyncEngineArgs.add_cli_args` parser would hide that."""

from __future__ import annotations

import argparse


def serve_parser() -> argparse.ArgumentParser:
    """The top-level `vllm` parser with its `serve` subcommand (import vLLM lazily: it takes seconds)."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    return parser


def serve_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` subparser of `parser`, whose flags are the engine's."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["serve"]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """What `vllm serve ARGV...` parses to (argv without the leading `vllm serve`), with the positional model
    taking precedence over --model as `ServeSubcommand.cmd` applies it."""
    ns = serve_parser().parse_args(["serve", *argv])
    if getattr(ns, "model_tag", None) is not None:
        ns.model = ns.model_tag
    return ns


def module_parser() -> argparse.ArgumentParser:
    """The parser of `python -m vllm.entrypoints.openai.api_server` (engines/server.py's SERVER_MODULE), built as
    its `main` builds it: one flat parser, whose positional model is parsed and then ignored (only `vllm serve`
    copies it into --model)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_printed(command: str) -> argparse.Namespace:
    """What a printed serve command parses to, by the parser of whichever launcher it names: `vllm serve ...`, or
    `PYTHON -m SERVER_MODULE ...`. Leading NAME=VALUE environment assignments are skipped."""
    import shlex

    from optimizer.engines.server import SERVER_MODULE

    words = shlex.split(command)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)
    if words[:2] == ["vllm", "serve"]:
        return parse_serve(words[2:])
    assert words[1:3] == ["-m", SERVER_MODULE], command
    return module_parser().parse_args(words[3:])
