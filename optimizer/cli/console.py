"""What the libraries under the tool may print on the console: their warnings and banners are kept off it unless
`--debug` asks for them. The engine's own output goes to its log file (core/processes.py), not through here.

Each entry names one library and one kind of message, so that the tool's own warnings (a recovered study, a
caveat) still reach the user:

- vLLM's "Triton is installed, but doesn't include CPU backend" (a logger warning at `import vllm` on the CPU
  build: true and harmless, and printed by every command that imports vLLM). vLLM configures its loggers when it is
  imported, with `disable_existing_loggers` off, so a level set on that one module's logger before the import
  holds.
- Optuna's `ExperimentalWarning` ("X is experimental (supported from v2.8.0) ..."): it names our source line, as
  warnings name their caller, and says nothing about the study.
- Optuna's `UserWarning`s (e.g. the importance evaluator's "Some regimes for parameter ... have less than 2
  trials"), printed with a site-packages path. From Python 3.12 Optuna attributes them to the calling module
  instead of its own, so the importance evaluator's ones are also matched by their text.
"""

from __future__ import annotations

import logging
import warnings

# logger name -> the lowest level that still reaches the console
QUIET_LOGGERS = {"vllm.triton_utils.importing": logging.ERROR}

# (message regex, category, module regex) of the warnings kept off the console
QUIET_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r".* is experimental \(supported from v", Warning, ""),  # optuna.exceptions.ExperimentalWarning
    ("", UserWarning, r"optuna\."),
    (r"Some regimes for parameter .* have less than", UserWarning, ""),
    (r".*Parameter importances will be equal", UserWarning, ""),
    (r".* computes the importances of params to achieve low `target` values", UserWarning, ""),
)


def quiet_libraries(debug: bool) -> None:
    """Keep the library warnings and banners above off the console, unless `debug`. Call it before vLLM or Optuna
    is used (importing is fine for Optuna; vLLM's logger level must be set before `import vllm`)."""
    if debug:
        return
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
