"""The latency limits a study is tuned for, as the user states them, parsed once at the edge.

A limit is a metric, a statistic and a value: `ttft:p99=150ms`. The metrics are those of `vllm bench serve`, with its
definitions: TTFT (send to first token), TPOT (time per output token after the first: (E2E - TTFT) / (output
tokens - 1)), ITL (every gap between consecutive token chunks, pooled over the requests) and E2E (send to last
token). The statistics are percentiles (p50, p90, p95, p99, p99.9) or the mean.

A percentile limit is a statement on a share: TPOT P99 <= 50 ms says at most 1% of requests stream slower than
50 ms a token. Several limits hold together: a rate holds when every one of them does.

With `--goodput P%` the limits are per request instead, as vLLM's `--goodput` and DistServe define it: a request
is good when it meets every limit at once, and a rate holds when at least P% of the requests are good. The two
differ when the slow requests are different ones on each metric: TTFT P99 and TPOT P99 limits allow 1% slow on each
(up to 2% slow on one or the other); goodput 99% allows 1% slow on either.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from decimal import Decimal

from pydantic import Field, field_validator, model_validator

from optimizer.config.strict import StrictModel
from optimizer.core.errors import UsageError
from optimizer.core.units import format_ms, parse_duration_ms

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("p50", "p90", "p95", "p99", "p99.9", "mean")  # the usual ones; any percentile in (0, 100) is taken
GOODPUT_METRICS = ("ttft", "tpot", "e2e")  # vLLM's --goodput: a per-request value each (ITL is per gap)
_SLO_RE = re.compile(r"^\s*([a-zA-Z0-9]+)\s*(?::\s*([a-zA-Z0-9.]+))?\s*=\s*(.+?)\s*$")


def stat_text(stat: str) -> str:
    return "mean" if stat == "mean" else stat.upper()


def key_name(key: str) -> str:
    """'tpot:p99' -> 'TPOT P99'; 'goodput' -> 'goodput'."""
    metric, _, stat = key.partition(":")
    if not stat:
        return metric
    return metric.upper() + ("" if stat == "request" else f" {stat_text(stat)}")


class Limit(StrictModel):
    """One limit: `metric`'s `stat` at most `value_ms` (under goodput, `stat` is 'request': each request's own)."""

    metric: str
    stat: str
    value_ms: float = Field(gt=0)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v not in METRICS:
            raise ValueError(f"unknown metric {v!r}: one of {', '.join(METRICS)}")
        return v

    @property
    def key(self) -> str:
        """'tpot:p99': the limit's name in stored results and Optuna's constraints."""
        return f"{self.metric}:{self.stat}"

    @property
    def percentile(self) -> float | None:
        """99.0 for p99; None for the mean and for a per-request limit."""
        return float(self.stat[1:]) if self.stat.startswith("p") else None

    @property
    def share(self) -> float:
        """The share of requests (gaps, for ITL) a percentile limit allows over its value: 0.01 for p99."""
        q = self.percentile
        return math.nan if q is None else round(1.0 - q / 100.0, 10)

    @property
    def name(self) -> str:
        """'TPOT P99' (a per-request limit: 'TPOT')."""
        return self.metric.upper() + ("" if self.stat == "request" else f" {stat_text(self.stat)}")

    @property
    def text(self) -> str:
        """'TPOT P99 <= 50ms'."""
        return f"{self.name} <= {format_ms(self.value_ms)}"

    @property
    def flag(self) -> str:
        """How the command line gives it: '--tpot-p99 50ms', '--slo tpot:p90=50ms'."""
        if self.stat == "p99":
            return f"--{self.metric}-p99 {exact_ms(self.value_ms)}"
        if self.stat == "request":
            return f"--slo {self.metric}={exact_ms(self.value_ms)}"
        return f"--slo {self.key}={exact_ms(self.value_ms)}"

    def over_text(self, measured_ms: float, rate_rps: float | None = None) -> str:
        """'TPOT P99 61 ms > 50 ms at 48.2 req/s'."""
        at = "" if rate_rps is None else \
            (" in the burst" if not math.isfinite(rate_rps) else f" at {rate_rps:.1f} req/s")
        if not math.isfinite(measured_ms):
            return f"{self.name} not measured > {_ms(self.value_ms)}{at}"
        sign = ">" if measured_ms > self.value_ms else "<="
        digits = 0 if abs(measured_ms - self.value_ms) >= 1 and min(measured_ms, self.value_ms) >= 10 else 1
        return f"{self.name} {_ms(measured_ms, digits)} {sign} {_ms(self.value_ms, digits)}{at}"


def exact_ms(value_ms: float) -> str:
    """'150ms', '1234.5ms': the value as a flag gives it back exactly (format_ms rounds: 1234.5 -> '1.23s')."""
    text = format(Decimal(repr(float(value_ms))), "f")  # the shortest exact digits, never an exponent
    return (text.rstrip("0").rstrip(".") if "." in text else text) + "ms"


def _ms(value_ms: float, digits: int = 0) -> str:
    """'61 ms'; below 10 ms, or with `digits`, that many decimals ('30.4 ms')."""
    return f"{value_ms:.{max(digits, 0 if value_ms >= 10 else 1)}f} ms"


class Limits(StrictModel):
    """Every limit of a study, in the order given; `goodput_pct`: per-request limits, at least this share good."""

    items: tuple[Limit, ...] = Field(min_length=1)
    goodput_pct: float | None = Field(None, gt=0, lt=100)

    @model_validator(mode="after")
    def _consistent(self) -> Limits:
        keys = [lim.key for lim in self.items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a limit is given twice: {', '.join(keys)}")
        per_request = [lim.stat == "request" for lim in self.items]
        if self.goodput_pct is not None and not all(per_request):
            raise ValueError("under goodput every limit is per request")
        if self.goodput_pct is None and any(per_request):
            raise ValueError("a per-request limit needs goodput")
        for lim in self.items:
            if lim.stat not in ("request", "mean") and not re.fullmatch(r"p[0-9.]+", lim.stat):
                raise ValueError(f"unknown statistic {lim.stat!r}")
        return self

    @classmethod
    def ttft_p99(cls, value_ms: float) -> Limits:
        return cls(items=(Limit(metric="ttft", stat="p99", value_ms=value_ms),))

    def __iter__(self):  # type: ignore[override]
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def first(self) -> Limit:
        """The first limit given: the one the front's latency axis shows."""
        return self.items[0]

    @property
    def goodput_share(self) -> float:
        """The share of requests goodput allows bad: 0.01 at 99%."""
        return math.nan if self.goodput_pct is None else round(1.0 - self.goodput_pct / 100.0, 10)

    def stat_of(self, limit: Limit) -> str:
        """The statistic a replay's summary is read at for `limit`: its own; under goodput (per-request limits), the
        metric's stored percentile at or above the goodput share (P99 for 97%): a necessary condition only, since
        goodput counts the requests that meet every limit at once."""
        if self.goodput_pct is None:
            return limit.stat
        stored = [q for q in (50.0, 90.0, 95.0, 99.0, 99.9) if q >= self.goodput_pct - 1e-9]
        return f"p{(stored[0] if stored else 99.9):g}"

    def get(self, metric: str, stat: str | None = None) -> Limit | None:
        return next((lim for lim in self.items if lim.metric == metric and (stat is None or lim.stat == stat)), None)

    @property
    def text(self) -> str:
        """'TTFT P99 <= 150ms, TPOT P99 <= 50ms' (goodput: '99% of requests within TTFT <= 150ms and ...')."""
        joined = ", ".join(lim.text for lim in self.items)
        if self.goodput_pct is None:
            return joined
        return f"goodput {self.goodput_pct:g}% (each request within {' and '.join(lim.text for lim in self.items)})"

    @property
    def key(self) -> str:
        """One string that names the set exactly (a probe's verdict is reused only for the same set)."""
        body = ",".join(f"{lim.key}={lim.value_ms:g}" for lim in self.items)
        return body if self.goodput_pct is None else f"goodput{self.goodput_pct:g}:{body}"

    @property
    def flags(self) -> str:
        """The command-line flags that give these limits."""
        out = " ".join(lim.flag for lim in self.items)
        return out if self.goodput_pct is None else f"{out} --goodput {self.goodput_pct:g}%"


def parse_limits(ttft_p99: str | None = None, tpot_p99: str | None = None, itl_p99: str | None = None,
                 e2e_p99: str | None = None, slo: Iterable[str] = (), goodput: str | None = None) -> Limits | None:
    """The limits the command line gives (None: none given), or one UsageError line naming the fix."""
    items: list[Limit] = []
    seen: dict[str, str] = {}

    def add(metric: str, stat: str, value: str, given_as: str, value_of: str) -> None:
        key = f"{metric}:{stat}"
        if key in seen:
            which = "per request" if stat == "request" else stat_text(stat)
            raise UsageError(f"{metric.upper()} {which} is limited twice ({seen[key]} and {given_as}): give each "
                             f"limit once")
        seen[key] = given_as
        items.append(Limit(metric=metric, stat=stat, value_ms=parse_duration_ms(value, value_of)))

    for metric, value in (("ttft", ttft_p99), ("tpot", tpot_p99), ("itl", itl_p99), ("e2e", e2e_p99)):
        if value is not None:
            add(metric, "p99", value, f"--{metric}-p99", f"--{metric}-p99")
    goodput_pct = parse_goodput(goodput) if goodput is not None else None
    for text in slo:
        metric, stat, value = parse_slo(text, per_request=goodput_pct is not None)
        add(metric, stat, value, f"--slo {text.strip()}", f"--slo {text.strip()!r}:")
    if not items:
        if goodput_pct is not None:
            raise UsageError("--goodput needs per-request limits: add e.g. --slo ttft=200ms --slo tpot=50ms")
        return None
    if goodput_pct is not None:
        pct = [lim for lim in items if lim.stat != "request"]
        if pct:
            raise UsageError(f"--goodput counts requests within per-request limits, not percentiles: give "
                             f"{pct[0].name} as --slo {pct[0].metric}={exact_ms(pct[0].value_ms)}")
        itl = [lim for lim in items if lim.metric == "itl"]
        if itl:
            raise UsageError("--goodput counts ttft, tpot and e2e per request, as vLLM's --goodput does; ITL is per "
                             "token gap: drop --slo itl=..., or give it without --goodput as --slo itl:p99=...")
    return Limits(items=tuple(items), goodput_pct=goodput_pct)


def parse_goodput(text: str) -> float:
    """'99%' -> 99.0, or one UsageError line."""
    raw = text.strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", raw)
    if not m:
        raise UsageError(f"--goodput {text!r} is not a share of requests: write it as e.g. --goodput 99%")
    pct = float(m.group(1))
    if not 0 < pct < 100:
        raise UsageError(f"--goodput {text!r} is outside 0-100%: give the share of requests that must meet every "
                         "limit, e.g. 99%")
    return pct


def parse_slo(text: str, per_request: bool = False) -> tuple[str, str, str]:
    """'tpot:p90=50ms' -> ('tpot', 'p90', '50ms'); under goodput 'tpot=50ms' -> ('tpot', 'request', '50ms')."""
    m = _SLO_RE.match(text)
    example = "--slo tpot=50ms" if per_request else "--slo tpot:p90=50ms"
    if not m:
        raise UsageError(f"--slo {text!r} is not METRIC:STAT=VALUE: write it as e.g. {example}")
    metric, stat, value = m.group(1).lower(), (m.group(2) or "").lower(), m.group(3)
    if metric not in METRICS:
        raise UsageError(f"--slo {text!r}: unknown metric {metric!r}; use one of {', '.join(METRICS)} "
                         f"(e.g. {example})")
    if per_request:
        if stat:
            raise UsageError(f"--slo {text!r}: under --goodput a limit is per request, with no statistic: write "
                             f"--slo {metric}={value}")
        return metric, "request", value
    if not stat:
        raise UsageError(f"--slo {text!r} has no statistic: write e.g. --slo {metric}:p99={value} (or add --goodput "
                         f"99% for per-request limits)")
    if stat == "mean":
        return metric, stat, value
    q = re.fullmatch(r"p([0-9]*\.?[0-9]+)", stat)
    if not q:
        raise UsageError(f"--slo {text!r}: unknown statistic {stat!r}; use a percentile such as "
                         f"{', '.join(STATS[:-1])}, or mean")
    if not 0 < float(q.group(1)) < 100:
        raise UsageError(f"--slo {text!r}: the percentile {stat} is outside 0-100; use one such as "
                         f"{', '.join(STATS[:-1])}")
    return metric, f"p{float(q.group(1)):.12g}", value  # p99.0 -> p99; p99.99999 stays itself


def check_workload_shows(limits: Limits, min_output_tokens: int) -> None:
    """A limit the workload cannot show fails here: TPOT and ITL need requests of at least 2 output tokens."""
    if min_output_tokens >= 2:
        return
    for lim in limits:
        if lim.metric in ("tpot", "itl"):
            raise UsageError(f"{lim.name} needs requests of 2 or more output tokens, and this workload has requests "
                             f"of {min_output_tokens}: raise its shortest output length to 2 (--output-len MIN:MAX, or "
                             f"the workload file or trace) or drop {lim.flag}")
