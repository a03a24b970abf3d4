"""Fakes and small builders shared by the tests: one definition each, imported where they are used.

`SimEngine`: the simulator (optimizer/engines/simulated.py) for the architecture of the `config_only_model`
fixture; `make_config`: a short study on it; `run_study`: prepare and run it to its budget; `run_cli`: the CLI
in-process, with its exit code and stderr; `load`: a study of a SQLite file that `optimize` wrote.
"""

from __future__ import annotations

import optuna

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.engines.simulated import SimulatedEngine
from optimizer.search.runner import prepare, run


class SimEngine(SimulatedEngine):
    """The simulator for the architecture of `config_only_model` (its own memory: 24 GiB, 90% usable)."""

    def __init__(self):
        super().__init__(model_info({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}, "sim"))


def make_config(tmp_path, model, **kw) -> StudyConfig:
    """A 3-trial study of 40 short requests with a 30 ms TTFT P99 limit; `kw` overrides any field."""
    base = dict(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=30.0, budget=3,
                model=str(model), dummy_weights=True, device="cpu",
                workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64, input_len_max=256,
                                      output_len_min=2, output_len_max=6))
    return StudyConfig(**{**base, **kw})


def run_study(tmp_path, config, engine=SimEngine) -> optuna.Study:
    # the simulated engine has its own memory limit: this machine's memory must not decide these tests
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=engine, memory_probe=lambda: None)
    return run(prepared, quiet=True)


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`optimize ARGV` in-process: its exit code and what it wrote to stderr."""
    from optimizer.cli.main import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def load(studies, name: str = "default") -> optuna.Study:
    """Study `name` of `studies/<name>.db`, as `optimize --studies-dir STUDIES` writes it."""
    return optuna.load_study(study_name=name, storage=f"sqlite:///{studies}/{name}.db")
