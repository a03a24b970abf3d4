"""A worker of a study on PostgreSQL (simulated engine) whose database blinks at the end of its second trial.

    python -m tests.support.pg_worker URL STUDIES_DIR MODEL_DIR BUDGET OUTAGE_S

OUTAGE_S > 0: when the second trial's engine shuts down (its end is about to be written), the server is stopped
and started again OUTAGE_S later. OUTAGE_S < 0: stopped and left down. 0: no outage. The commands that stop and
start the server come in PG_STOP and PG_START (shell lines). A short retry schedule keeps the give-up case quick.
It reports as `optimize` does: one line and the exit code of the error.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import OptimizerError
from optimizer.core.signals import quiet_interrupted_trials
from optimizer.search import dbretry
from optimizer.search.runner import prepare, run
from tests.support.fakes import SimEngine

dbretry.RETRY_DELAYS_S = (0.5, 1, 2, 4, 4, 4)
dbretry.MAX_TOTAL_S = 20.0


def blinking_engine(outage_s: float):
    shutdowns = []

    class Blinks(SimEngine):
        async def shutdown(self):
            await super().shutdown()
            first = id(self) not in shutdowns  # the baseline's engine may shut down twice (memory fallback)
            shutdowns.append(id(self))
            if first and len(set(shutdowns)) == 2 and outage_s != 0:
                subprocess.run(os.environ["PG_STOP"], shell=True, check=True, capture_output=True)
                print(f"database stopped at {time.time():.3f}", file=sys.stderr, flush=True)
                if outage_s > 0:
                    def start_again():
                        time.sleep(outage_s)
                        subprocess.run(os.environ["PG_START"], shell=True, check=True, capture_output=True)
                        print(f"database back at {time.time():.3f}", file=sys.stderr, flush=True)

                    threading.Thread(target=start_again, daemon=True).start()

    return Blinks


def main(url: str, studies: Path, model: str, budget: int, outage_s: float) -> int:
    quiet_interrupted_trials()
    config = StudyConfig(study_name="s", storage_url=url, ttft_p99_ms=30.0, budget=budget, model=model,
                         dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64,
                                               input_len_max=256, output_len_min=2, output_len_max=6))
    try:
        prepared = prepare(config, studies, say=lambda *a: None, engine_factory=blinking_engine(outage_s),
                           memory_probe=lambda: None)
        run(prepared, quiet=True)
    except OptimizerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
