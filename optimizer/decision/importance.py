"""Which parameters mattered: Optuna's importance evaluators over the study's trials."""

from __future__ import annotations

import importlib.util
import math
import warnings
import optuna
from optuna.trial import TrialState

from optimizer.decision.trial import TrialView


MIN_TRIALS_FOR_IMPORTANCE = 3
# Below this many trials behind it, an importance is a hint, not a finding (docs/report.md): fANOVA's forest and
# PED-ANOVA's top quantile then rest on a handful of points, and one noisy trial reorders the ranking.
TRUSTED_TRIALS_FOR_IMPORTANCE = 20


def importance_trials(views: list[TrialView]) -> list[TrialView]:
    """The trials an importance rests on: searched trials (parameters sampled) that meet the limit."""
    return [v for v in views if v.ranked.answerable and v.trial.state == TrialState.COMPLETE and v.trial.params]


def importance_caveat(n_trials: int) -> str | None:
    """What a reader must know of an importance computed over `n_trials` trials; None from the threshold on."""
    if n_trials >= TRUSTED_TRIALS_FOR_IMPORTANCE:
        return None
    return (f"a hint, not a finding: computed from {n_trials} trials (below {TRUSTED_TRIALS_FOR_IMPORTANCE}, one "
            f"noisy trial can reorder it); parameters the trials hardly varied may rank high by chance")


def param_importances(views: list[TrialView]) -> tuple[dict[str, float], str]:
    """fANOVA importances for output throughput over the trials that meet the limit, or an empty dict and why."""
    usable = importance_trials(views)
    if len(usable) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (f"not enough trials: parameter importance needs at least {MIN_TRIALS_FOR_IMPORTANCE} searched "
                    f"trials that meet the limit, {len(usable)} do")
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(direction="maximize")
        scratch.add_trials([optuna.trial.create_trial(params=v.trial.params, distributions=v.trial.distributions,
                                                      value=v.ranked.output_throughput_tok_s) for v in usable])
        evaluator, how = _evaluator(len(usable))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            result = optuna.importance.get_param_importances(scratch, evaluator=evaluator)
    except Exception as exc:  # noqa: BLE001 - e.g. every trial measured the same throughput
        return {}, f"parameter importance could not be computed ({type(exc).__name__}: {exc})"
    finally:
        optuna.logging.set_verbosity(verbosity)
    clean = {k: float(v) for k, v in result.items() if math.isfinite(v)}
    if not clean:
        return {}, "parameter importance could not be computed (the trials do not differ enough)"
    return clean, f"{how} over {len(usable)} searched trials that meet the limit, target output tokens/s"


def _evaluator(n_trials: int) -> tuple[optuna.importance.BaseImportanceEvaluator, str]:
    """Optuna's default fANOVA when scikit-learn is installed; else PED-ANOVA, which needs no extra package.

    PED-ANOVA compares the top quantile of trials with all of them; its default quantile (0.1) holds no trial
    in a small study, so the quantile is widened to hold about three trials.
    """
    if importlib.util.find_spec("sklearn") is not None:
        return optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
    quantile = min(0.5, max(0.1, 3 / n_trials))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=quantile)
    return evaluator, f"PED-ANOVA, top {quantile:.0%}"
