"""Run-to-run noise and slow drift for the simulator: a real machine is not the same machine twice.

On a shared machine one whole trial of one config varies by a CV of 12-18%, and a fresh engine is faster or slower
as a whole (its threads land on busier or quieter cores). The simulator reproduces that with multiplicative factors
on every per-step cost of its time model (optimizer/engines/sim/steptime.py):

    step time = nominal step time x engine factor x replay factor x drift factor

- the engine factor, exp(N(0, run_cv)), drawn once per engine start;
- the replay factor, exp(N(0, replay_cv)), drawn once per replay;
- the drift factor, 1 + drift_per_hour x virtual hours since the noise source began (the machine's load creeps).

The log-normal factors have median 1 and a CV of sqrt(exp(sigma^2) - 1), close to sigma for small sigma. Engine
start and shutdown times are not scaled: they do not rank configs. All randomness comes from the seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from optimizer.engines.sim.steptime import StepTimeModel

LIFECYCLE_FIELDS = ("engine_start_s", "engine_shutdown_s")  # per engine, not per step: never scaled
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class SimNoise:
    """The noise settings; all zero (the default, `SimNoise.none()`) is the deterministic simulator."""

    run_cv: float = 0.0  # log-normal sigma of the per-engine-start step-time factor
    replay_cv: float = 0.0  # log-normal sigma of the per-replay step-time factor
    drift_per_hour: float = 0.0  # step time grows by this fraction per virtual hour (0.05: +5% per hour)
    seed: int = 0

    @classmethod
    def none(cls) -> SimNoise:
        return cls()


# A shared 2-core CPU machine: whole trials of vLLM's defaults vary by a CV of 12-18% (docs/simulator.md, "Noise and
# drift"; measured by benchmarks/sim_noise.py, which picked these).
SHARED_CPU = SimNoise(run_cv=0.15, replay_cv=0.05, drift_per_hour=0.04)


class NoiseSource:
    """One per study or benchmark run, shared by every engine it makes: the draws and the virtual time elapsed.

    Engine factors and replay factors come from separate streams of the seed, so that the k-th engine's factor
    does not depend on how many replays the engines before it ran (an early stop on and off see the same engines).
    """

    def __init__(self, settings: SimNoise) -> None:
        self.settings = settings
        engine_seq, replay_seq = np.random.SeedSequence(settings.seed).spawn(2)
        self._engine_rng = np.random.Generator(np.random.PCG64(engine_seq))
        self._replay_rng = np.random.Generator(np.random.PCG64(replay_seq))
        self.elapsed_s = 0.0  # virtual seconds the engines of this source have spent: starts, replays, shutdowns

    def engine_factor(self) -> float:
        """The step-time factor of one engine start, exp(N(0, run_cv))."""
        return lognormal_factor(self._engine_rng.standard_normal(), self.settings.run_cv)

    def replay_factor(self) -> float:
        """The step-time factor of one replay, exp(N(0, replay_cv))."""
        return lognormal_factor(self._replay_rng.standard_normal(), self.settings.replay_cv)

    def drift_factor(self) -> float:
        """The step-time factor of the slow drift at the current elapsed virtual time."""
        return drift_factor(self.settings.drift_per_hour, self.elapsed_s)

    def advance(self, seconds: float) -> None:
        """Count `seconds` of virtual engine time (start, replay, shutdown) toward the drift."""
        self.elapsed_s += max(seconds, 0.0)


def lognormal_factor(z: float, sigma: float) -> float:
    """exp(sigma x z): a standard normal draw `z` as a multiplicative factor of median 1 (exactly 1 at sigma 0)."""
    return math.exp(sigma * float(z))


def drift_factor(drift_per_hour: float, elapsed_s: float) -> float:
    """1 + drift_per_hour x hours elapsed: linear in virtual time (exactly 1 without drift)."""
    return 1.0 + drift_per_hour * elapsed_s / SECONDS_PER_HOUR


def scaled(model: StepTimeModel, factor: float) -> StepTimeModel:
    """`model` with every per-step cost multiplied by `factor`; engine start and shutdown unchanged."""
    if factor == 1.0:
        return model
    return replace(model, **{f.name: getattr(model, f.name) * factor for f in fields(model)
                             if f.name not in LIFECYCLE_FIELDS})
