"""A study on the fake engine whose start takes a minute, run as a process that a test stops with a signal.

    python -m tests.support.stop_helper STUDIES_DIR MODEL_DIR

It handles a stop as `optimize` does (optimizer/core/signals.py): one line, exit code 130 or 143.
"""

import asyncio
import sys
from pathlib import Path

from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.signals import install_stop_handlers, interrupted_exit_code, interrupted_message
from tests.support.fake_engine import FakeEngine
from optimizer.search.runner import prepare, run


class SlowStart(FakeEngine):
    """Starts like a real engine on a slow machine: long enough to be stopped in the middle of it."""

    async def start(self, params, log_path=None):
        print("engine starting", flush=True)
        await asyncio.sleep(60)
        return await super().start(params, log_path)


def main(studies: Path, model: str) -> int:
    install_stop_handlers()
    config = StudyConfig(study_name="s", storage_url=f"sqlite:///{studies}/s.db", ttft_p99_ms=100.0, budget=2,
                         model=model, dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=20, warmup_requests=1, input_len_min=8, input_len_max=16,
                                               output_len_min=2, output_len_max=4))
    try:
        prepared = prepare(config, studies, say=lambda *a: None, engine_factory=SlowStart, memory_probe=lambda: None)
        run(prepared, quiet=True)
    except KeyboardInterrupt:
        print(interrupted_message(), file=sys.stderr)
        return interrupted_exit_code()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
