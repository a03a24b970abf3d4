import pytest

from optimizer.core.errors import UsageError
from optimizer.core.units import format_ms, parse_duration_ms


@pytest.mark.parametrize("text,ms", [("150ms", 150.0), ("0.2s", 200.0), ("2min", 120_000.0), ("1h", 3_600_000.0),
                                     ("500us", 0.5), (" 75 ms ", 75.0), ("1.5S", 1500.0)])
def test_parses_durations(text, ms):
    assert parse_duration_ms(text) == pytest.approx(ms)


@pytest.mark.parametrize("text,hint", [("150", "no unit"), ("150 parsecs", "unknown unit"), ("-5ms", "negative"),
                                       ("fast", "not a duration"), ("0ms", "greater than zero"), ("", "not a duration")])
def test_refuses_bad_durations_with_the_fix(text, hint):
    with pytest.raises(UsageError) as err:
        parse_duration_ms(text, "--ttft-p99")
    assert hint in str(err.value)
    assert "--ttft-p99" in str(err.value)


def test_bare_number_is_refused():
    with pytest.raises(UsageError, match="no unit"):
        parse_duration_ms(150)


def test_format_ms():
    assert format_ms(86.4) == "86ms"
    assert format_ms(1520) == "1.52s"
    assert format_ms(4.25) == "4.2ms"
