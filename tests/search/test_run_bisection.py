"""A confirmation run bisects its bracket to 3% whatever its fit says (measurement/rate_search.py::RUN_FIT_BRACKET);
a search trial may stop on its fit inside 6%. Through search/probes.py::TrialReplays.measure, its probes scripted
with the counts of a real run (vLLM's defaults on the README's demo, one engine)."""

import asyncio

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.clock import MonotonicClock
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.evidence import FAIL, PASS
from optimizer.measurement.rate_search import BRACKET_PRECISION, FIT_BRACKET, RUN_FIT_BRACKET
from optimizer.measurement.workload import build_workload
from optimizer.search.confirm import prior_spec
from optimizer.search.probes import TrialReplays
from tests.measurement.test_rate_search import point
from tests.support.fakes import make_config

# That run's counts: 0 of 1000 over at 73.9 and 78.2 req/s, 386 of 803 at 82.8. The crossing lies between 78.2 and
# 82.8; the same engine failed 78.2 in other searches (29-203 over).
COUNTS = {73.9: (1000, 0, PASS), 78.2: (1000, 0, PASS), 82.8: (803, 386, FAIL)}


def scripted(rate):
    """The real run's counts at its rates; between 78.2 and 82.8, the crossing at 80: a pass under it, else a fail."""
    near = min(COUNTS, key=lambda r: abs(r - rate))
    if abs(near - rate) < 0.05:
        return point(rate, *COUNTS[near])
    return point(rate, 1000, 2, PASS) if rate < 80.0 else point(rate, 1000, 60, FAIL)


def measured(tmp_path, confirm):
    config = make_config(tmp_path, tmp_path, workload=WorkloadSpec(
        num_requests=40, warmup_requests=2, warmup_load_requests=0, input_len_min=16, input_len_max=32,
        output_len_min=2, output_len_max=4), search={"max_replays": 8})
    engine = FakeEngine(step_s=0.001)
    replays = TrialReplays(engine, build_workload(config.workload, 1000), config, MonotonicClock(), None, 0, [])
    rates = []

    async def probe_at(rate):
        rates.append(round(rate, 1))
        return scripted(round(rate, 1))

    replays.probe_at = probe_at

    async def main():
        await engine.start({"max_num_seqs": 8})
        try:
            return await replays.measure(incumbent_rate_rps=None if confirm else 73.9, confirm=confirm)
        finally:
            await engine.shutdown()
    return asyncio.run(main()), rates


def test_a_confirmation_run_bisects_to_three_percent_where_its_fit_alone_would_stop(tmp_path):
    # a later round's run starts 2.9% under its config's rate so far (76.0) and steps by 5.9%: 73.9, 78.2, 82.8,
    # the real run's probes; it stopped there (its fit: 81.5 within +-3%), the rule now probes 80.5 too
    result, rates = measured(tmp_path, prior_spec([76.0]))
    assert rates[:3] == [73.9, 78.2, 82.8]
    passed = max(p.offered_rate_rps for p in result.points if p.verdict == PASS)
    failed = min(p.offered_rate_rps for p in result.points if p.verdict == FAIL)
    assert failed <= passed * (1 + BRACKET_PRECISION)  # bisected to within 3%
    assert len(rates) == 4 and 78.2 < rates[3] < 82.8  # a probe inside the 5.9% bracket of the real run
    assert 78.2 <= result.fit.rate_rps <= rates[3]


def test_a_search_trial_still_stops_on_its_fit_inside_six_percent(tmp_path, monkeypatch):
    # from the incumbent's 73.9: once passed and failed are within 6%, the fit's own +-3% may end it (FIT_BRACKET),
    # as it did before; a confirmation run's search is told to bisect on (RUN_FIT_BRACKET)
    import optimizer.search.probes as probes

    told = []
    real = probes.search_rate

    async def search_rate(*args, **kwargs):
        told.append(kwargs.get("fit_bracket", FIT_BRACKET))
        return await real(*args, **kwargs)

    monkeypatch.setattr(probes, "search_rate", search_rate)
    result, rates = measured(tmp_path, None)
    measured(tmp_path, prior_spec([76.0]))
    assert told == [FIT_BRACKET, RUN_FIT_BRACKET] and RUN_FIT_BRACKET < BRACKET_PRECISION
    passed = max(p.offered_rate_rps for p in result.points if p.verdict == PASS)
    failed = min(p.offered_rate_rps for p in result.points if p.verdict == FAIL)
    assert failed <= passed * (1 + FIT_BRACKET)
