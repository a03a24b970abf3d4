"""The limits a study is tuned for, parsed from the command line's words: each limit's name, text, key and share,
the flags that give a set of limits back exactly, and every bad input one UsageError line naming the fix."""

import math

import pytest

from optimizer.config.limits import Limit, Limits, check_workload_shows, exact_ms, parse_limits
from optimizer.core.errors import UsageError


def from_flags(flags: str) -> Limits | None:
    """parse_limits of the words `Limits.flags` writes, read as the command line reads them."""
    kw: dict = {"slo": []}
    words = flags.split()
    for flag, value in zip(words[::2], words[1::2]):
        if flag == "--slo":
            kw["slo"].append(value)
        else:
            kw[flag.removeprefix("--").replace("-", "_")] = value
    return parse_limits(**kw)


def test_one_limit_reads_as_a_person_writes_it():
    lim = Limit(metric="tpot", stat="p99", value_ms=50.0)
    assert (lim.name, lim.text, lim.key, lim.flag) == ("TPOT P99", "TPOT P99 <= 50ms", "tpot:p99", "--tpot-p99 50ms")
    assert lim.percentile == 99.0 and lim.share == 0.01
    assert Limit(metric="ttft", stat="p99.9", value_ms=300.0).share == 0.001
    assert Limit(metric="itl", stat="p50", value_ms=20.0).share == 0.5
    mean = Limit(metric="e2e", stat="mean", value_ms=2000.0)
    assert mean.text == "E2E mean <= 2.00s" and mean.percentile is None and math.isnan(mean.share)
    assert mean.flag == "--slo e2e:mean=2000ms"


def test_flags_give_the_limits_in_a_fixed_order_with_their_text_and_key():
    limits = parse_limits(ttft_p99="150ms", tpot_p99="0.05s")
    assert limits == Limits(items=(Limit(metric="ttft", stat="p99", value_ms=150.0),
                                   Limit(metric="tpot", stat="p99", value_ms=50.0)))
    assert limits.text == "TTFT P99 <= 150ms, TPOT P99 <= 50ms" and limits.key == "ttft:p99=150,tpot:p99=50"
    assert limits.first.metric == "ttft" and len(limits) == 2 and limits.get("tpot").value_ms == 50.0
    assert parse_limits() is None  # none given: the caller decides (a new study needs one; a resume keeps its own)


@pytest.mark.parametrize("slo, key, share", [
    ("tpot:p90=40ms", "tpot:p90", 0.1), ("ttft:P99.9=1s", "ttft:p99.9", 0.001), ("itl:p99.0=100ms", "itl:p99", 0.01),
    ("e2e:p95=5s", "e2e:p95", 0.05), ("ttft:p37.5=80ms", "ttft:p37.5", 0.625),
])
def test_any_percentile_in_0_100_is_taken_and_named_once(slo, key, share):
    (lim,) = parse_limits(slo=[slo])
    assert lim.key == key and lim.share == share


def test_goodput_makes_every_limit_per_request():
    limits = parse_limits(slo=["ttft=200ms", "tpot=50ms"], goodput="99%")
    assert limits.goodput_pct == 99.0 and limits.goodput_share == 0.01
    assert [lim.stat for lim in limits] == ["request", "request"]
    assert limits.text == "goodput 99% (each request within TTFT <= 200ms and TPOT <= 50ms)"
    assert limits.key == "goodput99:ttft:request=200,tpot:request=50"
    assert limits.flags == "--slo ttft=200ms --slo tpot=50ms --goodput 99%"


@pytest.mark.parametrize("kw", [
    dict(ttft_p99="150ms"),
    dict(ttft_p99="150ms", tpot_p99="50ms", itl_p99="0.1s", e2e_p99="12.5s"),
    dict(tpot_p99="1234.5ms", slo=["ttft:p99.9=300ms", "tpot:mean=20ms", "e2e:p50=0.3s"]),
    dict(slo=["ttft=200ms", "tpot=50ms", "e2e=8s"], goodput="99.5%"),
    dict(slo=["ttft:p90=0.30000000000000004ms"]),  # a value no rounding may change
])
def test_the_flags_of_limits_give_the_same_limits_back(kw):
    limits = parse_limits(**kw)
    assert from_flags(limits.flags) == limits


def test_exact_ms_never_rounds_nor_writes_an_exponent():
    assert [exact_ms(v) for v in (150.0, 1234.5, 1e6, 1e-5)] == ["150ms", "1234.5ms", "1000000ms", "0.00001ms"]


@pytest.mark.parametrize("kw, said", [
    (dict(ttft_p99="150ms", slo=["ttft:p99=100ms"]),
     "TTFT P99 is limited twice (--ttft-p99 and --slo ttft:p99=100ms): give each limit once"),
    (dict(slo=["tpot:p150=50ms"]), "the percentile p150 is outside 0-100"),
    (dict(slo=["tpot:p0=50ms"]), "the percentile p0 is outside 0-100"),
    (dict(tpot_p99="50"), "--tpot-p99 '50' has no unit: write it as e.g. '50ms' or '50s'"),
    (dict(slo=["tpot:p90=50"]), "--slo 'tpot:p90=50': '50' has no unit"),
    (dict(slo=["queue:p99=50ms"]), "unknown metric 'queue'; use one of ttft, tpot, itl, e2e"),
    (dict(slo=["ttft:max=50ms"]), "unknown statistic 'max'; use a percentile such as p50, p90, p95, p99, p99.9, or "
                                   "mean"),
    (dict(slo=["ttft=50ms"]), "has no statistic: write e.g. --slo ttft:p99=50ms"),
    (dict(slo=["ttft:p99"]), "is not METRIC:STAT=VALUE"),
    (dict(goodput="99%"), "--goodput needs per-request limits: add e.g. --slo ttft=200ms --slo tpot=50ms"),
    (dict(goodput="99", slo=["ttft=200ms"]), "--goodput '99' is not a share of requests: write it as e.g. "
                                             "--goodput 99%"),
    (dict(goodput="100%", slo=["ttft=200ms"]), "--goodput '100%' is outside 0-100%"),
    (dict(goodput="99%", ttft_p99="150ms"), "not percentiles: give TTFT P99 as --slo ttft=150ms"),
    (dict(goodput="99%", slo=["ttft:p99=150ms"]), "under --goodput a limit is per request, with no statistic: write "
                                                  "--slo ttft=150ms"),
    (dict(goodput="99%", slo=["itl=50ms"]), "ITL is per token gap"),
    (dict(goodput="99%", slo=["ttft=1s", "ttft=2s"]), "TTFT per request is limited twice"),
])
def test_every_bad_input_is_one_line_naming_the_fix(kw, said):
    with pytest.raises(UsageError) as caught:
        parse_limits(**kw)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_tpot_and_itl_need_outputs_of_two_tokens():
    limits = parse_limits(ttft_p99="150ms", tpot_p99="50ms")
    check_workload_shows(limits, 2)
    check_workload_shows(parse_limits(ttft_p99="150ms", e2e_p99="5s"), 1)  # TTFT and E2E show on one token
    with pytest.raises(UsageError, match="TPOT P99 needs requests of 2 or more output tokens.* drop --tpot-p99 50ms"):
        check_workload_shows(limits, 1)
    with pytest.raises(UsageError, match="ITL P90 needs .* drop --slo itl:p90=20ms"):
        check_workload_shows(parse_limits(slo=["itl:p90=20ms"]), 1)


def test_a_set_of_limits_that_cannot_be_is_refused_where_it_is_built():
    ttft = Limit(metric="ttft", stat="p99", value_ms=150.0)
    with pytest.raises(ValueError, match="given twice"):
        Limits(items=(ttft, ttft))
    with pytest.raises(ValueError, match="needs goodput"):
        Limits(items=(Limit(metric="ttft", stat="request", value_ms=150.0),))
    with pytest.raises(ValueError, match="per request"):
        Limits(items=(ttft,), goodput_pct=99.0)
    with pytest.raises(ValueError, match="unknown metric"):
        Limit(metric="queue", stat="p99", value_ms=1.0)
