"""Tests for healthlog.timestamps; scenario ids refer to specs/timestamps.md."""

import json
import logging
import re
import time
import unicodedata
from datetime import UTC, datetime, timedelta, timezone

import pytest
from fixtures import MemoryProjection, fold
from hypothesis import given
from hypothesis import strategies as st

from healthlog import timestamps
from healthlog.fold import PARTIAL
from healthlog.logs import JsonFormatter, KeyValueFormatter
from healthlog.points import gregorian, instant_of
from healthlog.timestamps import TimestampError, format_instant, hour_of, parse_instant

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_US = timedelta(microseconds=1)
HOUR_US = 3_600_000_000
FIRST_US = (datetime(1, 1, 1, tzinfo=UTC) - EPOCH) // ONE_US
LAST_US = (datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC) - EPOCH) // ONE_US


def expected(
    year: int,
    month: int,
    day: int,
    hour: int = 0,
    minute: int = 0,
    second: int = 0,
    micro: int = 0,
    offset_minutes: int = 0,
) -> int:
    """The instant computed by the standard library, independently of the module."""
    zone = timezone(timedelta(minutes=offset_minutes))
    local = datetime(year, month, day, hour, minute, second, micro, tzinfo=zone)
    return (local - EPOCH) // ONE_US


def offset_text(offset_minutes: int, colon: bool) -> str:
    sign = "-" if offset_minutes < 0 else "+"
    hours, minutes = divmod(abs(offset_minutes), 60)
    return f"{sign}{hours:02d}{':' if colon else ''}{minutes:02d}"


FEB_6_15H = expected(2024, 2, 6, 15)
SEPT_21_0757 = expected(2024, 9, 21, 7, 57, offset_minutes=600)
SEPT_21_1957 = expected(2024, 9, 21, 19, 57, offset_minutes=600)

ACCEPTED = [
    pytest.param("2024-02-06 07:00:00 -0800", FEB_6_15H, id="TIME-1 app shape"),
    pytest.param("2024-02-06 15:00:00 +0000", FEB_6_15H, id="TIME-1 +0000"),
    pytest.param("2024-02-06 15:00:00 -0000", FEB_6_15H, id="TIME-1 -0000"),
    pytest.param("2024-02-07 01:00:00 +10:00", FEB_6_15H, id="TIME-1 colon offset"),
    pytest.param("2024-02-06 15:00:00 Z", FEB_6_15H, id="TIME-1 Z"),
    pytest.param("2024-02-07 02:00:00 +1100", FEB_6_15H, id="TIME-1 next day"),
    pytest.param("2024-02-06 07:00:00-0800", FEB_6_15H, id="TIME-1 offset unspaced"),
    pytest.param("2024-02-06 09:30:00 -0530", FEB_6_15H, id="TIME-1 half hour offset"),
    pytest.param("2024-09-21 7:57:00\u202fam +1000", SEPT_21_0757, id="TIME-2 narrow nbsp"),
    pytest.param("2024-09-21 7:57:00 am +1000", SEPT_21_0757, id="TIME-2 space"),
    pytest.param("2024-09-21 7:57:00\u00a0am +1000", SEPT_21_0757, id="TIME-2 nbsp"),
    pytest.param("2024-09-21 7:57:00am +1000", SEPT_21_0757, id="TIME-2 no space"),
    pytest.param("2024-09-21 07:57:00 AM +1000", SEPT_21_0757, id="TIME-2 AM"),
    pytest.param("2024-09-21 7:57:00 a.m. +1000", SEPT_21_0757, id="TIME-2 a.m."),
    pytest.param("2024-09-21 7:57:00\u202fpm +1000", SEPT_21_1957, id="TIME-2 pm"),
    pytest.param("2024-09-21 7:57:00 PM +1000", SEPT_21_1957, id="TIME-2 PM"),
    pytest.param("2024-09-21 7:57:00 p.m. +1000", SEPT_21_1957, id="TIME-2 p.m."),
    pytest.param("2024-09-21 7:57 pm +1000", SEPT_21_1957, id="TIME-2 no seconds"),
    pytest.param("2024-09-21 12:05:00 am +0000", expected(2024, 9, 21, 0, 5), id="TIME-2 12am"),
    pytest.param("2024-09-21 12:05:00 pm +0000", expected(2024, 9, 21, 12, 5), id="TIME-2 12pm"),
    pytest.param("2024-09-21 11:59:59 pm", expected(2024, 9, 21, 23, 59, 59), id="TIME-2 11pm"),
    pytest.param("2024-02-06 7:00:00 -0800", FEB_6_15H, id="TIME-3 one digit hour"),
    pytest.param("2024-02-06 07:00 -0800", FEB_6_15H, id="TIME-3 no seconds"),
    pytest.param("2024-02-06 7:00 -0800", FEB_6_15H, id="TIME-3 both"),
    pytest.param("2024-02-06 07:00:00.123456 -0800", FEB_6_15H + 123_456, id="TIME-4 six digits"),
    pytest.param("2024-02-06 07:00:00.5 -0800", FEB_6_15H + 500_000, id="TIME-4 one digit"),
    pytest.param("2024-02-06T15:00:00.000001Z", FEB_6_15H + 1, id="TIME-4 one microsecond"),
    pytest.param("2024-02-06T15:00:00.1234567Z", FEB_6_15H + 123_456, id="TIME-4 seven digits"),
    pytest.param("2024-02-06T15:00:00.999999999Z", FEB_6_15H + 999_999, id="TIME-4 nine digits"),
    pytest.param("1969-12-31T23:59:59.9999999Z", -1, id="TIME-4 floor before epoch"),
    pytest.param("2024-02-06T15:00:00Z", FEB_6_15H, id="TIME-5 Z"),
    pytest.param("2024-02-06T15:00:00.5+01:00", FEB_6_15H - HOUR_US + 500_000, id="TIME-5 frac"),
    pytest.param("2024-02-06T15:00:00+0100", FEB_6_15H - HOUR_US, id="TIME-5 +0100"),
    pytest.param("2024-02-06T07:00:00-08:00", FEB_6_15H, id="TIME-5 -08:00"),
    pytest.param("2024-02-06T15:00:00 +0000", FEB_6_15H, id="TIME-5 spaced offset"),
    pytest.param("2024-02-06 15:00:00", FEB_6_15H, id="TIME-6 app shape"),
    pytest.param("2024-02-06T15:00", FEB_6_15H, id="TIME-6 ISO minutes"),
    pytest.param("2024-02-06T15:00:00.25", FEB_6_15H + 250_000, id="TIME-6 ISO fraction"),
    pytest.param("2024-02-06", expected(2024, 2, 6), id="TIME-7 date"),
    pytest.param("1960-02-29", expected(1960, 2, 29), id="TIME-7 leap day before epoch"),
    pytest.param(" 2024-02-06 07:00:00 -0800", FEB_6_15H, id="TIME-8 leading"),
    pytest.param("2024-02-06 07:00:00 -0800\n", FEB_6_15H, id="TIME-8 newline"),
    pytest.param("\t2024-02-06T15:00:00Z  ", FEB_6_15H, id="TIME-8 tab"),
    pytest.param(" 2024-02-06 ", expected(2024, 2, 6), id="TIME-8 date"),
    pytest.param(
        "\u202f2024-09-21 7:57:00\u202fam +1000\u00a0", SEPT_21_0757, id="TIME-8 unicode spaces"
    ),
    pytest.param("2024-02-06 15:00:00 +18:00", FEB_6_15H - 18 * HOUR_US, id="TIME-11 +18:00"),
    pytest.param("2024-02-06 15:00:00 -1800", FEB_6_15H + 18 * HOUR_US, id="TIME-11 -1800"),
    pytest.param("2024-02-29 00:00:00 +0000", expected(2024, 2, 29), id="TIME-11 leap day"),
    pytest.param("2000-02-29", expected(2000, 2, 29), id="TIME-11 leap century"),
    pytest.param("0001-01-01 00:00:00 -0100", FIRST_US + HOUR_US, id="TIME-11 year 1"),
    pytest.param("0001-01-01T00:00:00Z", FIRST_US, id="TIME-11 first instant"),
    pytest.param("9999-12-31T23:59:59.999999Z", LAST_US, id="TIME-11 last instant"),
    pytest.param("9999-12-31 23:59:59 +0100", LAST_US - HOUR_US - 999_999, id="TIME-11 year 9999"),
]


@pytest.mark.parametrize(("text", "instant"), ACCEPTED)
def test_time_1_to_8_and_11_accepted(text: str, instant: int) -> None:
    """TIME-1, TIME-2, TIME-3, TIME-4, TIME-5, TIME-6, TIME-7, TIME-8, TIME-11."""
    assert parse_instant(text) == instant


def test_time_1_same_instant_across_offsets() -> None:
    """TIME-1: one moment written in three zones."""
    instants = {
        parse_instant("2024-02-06 07:00:00 -0800"),
        parse_instant("2024-02-06T15:00:00Z"),
        parse_instant("2024-02-07 02:00:00 +1100"),
    }
    assert instants == {1_707_231_600_000_000}


@pytest.mark.parametrize("value", [None, True, False, 0, 1_707_231_600, 1.5, b"2024-02-06"])
def test_time_9_not_a_string(value: object) -> None:
    """TIME-9"""
    with pytest.raises(TimestampError, match="must be a str"):
        parse_instant(value)


def test_time_9_datetime_is_not_a_string() -> None:
    """TIME-9"""
    with pytest.raises(TimestampError):
        parse_instant(datetime(2024, 2, 6, tzinfo=UTC))


MALFORMED = [
    "",
    "   ",
    "garbage",
    "2024",
    "2024-02",
    "24-02-06",
    "2024-2-6",
    "2024/02/06",
    "20240206",
    "2024-02-06T",
    "2024-02-06 07",
    "2024-02-06 07:0",
    "2024-02-06 007:00:00",
    "2024-02-06 07:00:0",
    "2024-02-06 07:00:00.",
    "2024-02-06 07:00:00.1234567890",
    "2024-02-06 07:00:00 -0800 x",
    "2024-02-06 07:00:00 -0800Z",
    "2024-02-06 07:00:00 -08",
    "2024-02-06 07:00:00 -8:00",
    "2024-02-06 07:00:00 -08:0",
    "2024-02-06 07:00:00 UTC",
    "2024-02-06 07:00:00  -0800",
    "2024-02-06  07:00:00",
    "2024-02-06t07:00:00",
    "2024-02-06 07:00:00z",
    "2024-02-06Z",
    "2024-02-06 +0000",
    "2024-02-06 07:00:00 am pm",
    "2024-02-06 07:00:00 a.m",
    "2024-02-06 07:00:00 am.",
    "2024-02-06 07:00:00 xm",
    "\u0662\u0660\u0662\u0664-02-06 07:00:00 -0800",
    "2024-02-06 07:00:00 -\u0660\u0668\u0660\u0660",
    "2024-02-06 \uff10\uff17:00:00",
    "+2024-02-06",
    "-0001-01-01",
    "12024-02-06",
    "2024-02-06 07:00:00 -0800" + " " * 40,
    "2024-02-06T07:00:00.123456789+00:00" + "0" * 30,
]


@pytest.mark.parametrize("text", MALFORMED)
def test_time_10_malformed(text: str) -> None:
    """TIME-10"""
    with pytest.raises(TimestampError):
        parse_instant(text)


def test_time_10_length_guard() -> None:
    """TIME-10: long text is refused before anything else is examined."""
    with pytest.raises(TimestampError, match="longer than 64"):
        parse_instant(" " * 60 + "2024-02-06")


IMPOSSIBLE = [
    "2024-13-06 07:00:00 -0800",
    "2024-00-06 07:00:00 -0800",
    "2024-02-32 07:00:00 -0800",
    "2024-01-32",
    "2024-02-00",
    "2024-02-30 07:00:00 -0800",
    "2023-02-29",
    "1900-02-29",
    "2024-04-31",
    "2024-02-06 24:00:00 -0800",
    "2024-02-06 07:60:00 -0800",
    "2024-02-06 07:00:61 -0800",
    "2024-02-06 07:00:99 -0800",
    "2024-02-06 0:30:00 am",
    "2024-02-06 00:30:00 pm",
    "2024-02-06 13:00:00 pm",
    "2024-02-06 07:00:00 +1060",
    "2024-02-06 07:00:00 +18:01",
    "2024-02-06 07:00:00 -1801",
    "2024-02-06 07:00:00 +1900",
    "2024-02-06 07:00:00 -99:00",
    "0000-01-01",
    "0000-12-31 23:00:00 -0200",
    "0001-01-01 00:00:00 +0100",
    "0001-01-01T00:30:00+01:00",
    "9999-12-31 23:00:00 -0100",
    "9999-12-31T23:59:59.999999-00:01",
]


@pytest.mark.parametrize("text", IMPOSSIBLE)
def test_time_11_impossible_fields(text: str) -> None:
    """TIME-11"""
    with pytest.raises(TimestampError):
        parse_instant(text)


@pytest.mark.parametrize("text", ["2016-12-31 23:59:60 +0000", "2016-12-31T23:59:60.5Z"])
def test_time_12_leap_second_rejected(text: str) -> None:
    """TIME-12"""
    with pytest.raises(TimestampError, match="leap seconds"):
        parse_instant(text)


# Each rejected text with a twin that breaks the same rule with other values: a message that
# quoted any field of the input, or a value computed from one, would differ between the two.
PRIVATE = [
    ("1987-13-24 07:13:57 -0800", "2001-14-02 11:22:33 +0100"),
    ("1987-02-31 07:13:57 -0800", "2001-04-31 11:22:33 +0100"),
    ("1987-02-24 25:13:57 -0800", "2001-03-02 24:22:33 +0100"),
    ("1987-02-24 07:13:57 -1913", "2001-03-02 11:22:33 +2200"),
    ("1987-02-24 07:13:57 +1873", "2001-03-02 11:22:33 -0261"),
    ("1987-02-24 13:13:57 pm", "2001-03-02 00:22:33 am"),
    ("1987-02-24 07:13:57 heart rate 173", "2001-03-02 11:22:33 blood sugar 99"),
    ("0000-02-24 07:13:57 -0800", "0000-03-02 11:22:33 +0100"),
    ("0001-01-01 00:13:57 +0100", "0001-01-01 00:22:33 +0200"),
    ("secret glucose 187 mg/dL", "private weight 71 kg"),
    (" 1987-13-24 ", " 2001-14-02 "),
    ("1987-02-24 07:13:57 -0800 " * 3, "2001-03-02 11:22:33 +0100 " * 3),
]


@pytest.mark.parametrize(("text", "twin"), PRIVATE)
def test_time_13_error_does_not_echo_input(text: str, twin: str) -> None:
    """TIME-13"""
    with pytest.raises(TimestampError) as caught:
        parse_instant(text)
    error = caught.value
    for shown in (str(error), repr(error), repr(error.args)):
        assert text not in shown
        assert text.strip() not in shown
        for field in re.findall(r"[0-9]{2,}", text):
            assert field not in shown
    assert error.__cause__ is None
    assert error.__context__ is None
    with pytest.raises(TimestampError) as twin_caught:
        parse_instant(twin)
    assert twin_caught.value.args == error.args


def test_time_13_error_for_non_string_names_only_the_type() -> None:
    """TIME-13"""
    with pytest.raises(TimestampError) as caught:
        parse_instant(1_987_022_407)
    assert "1987022407" not in str(caught.value)
    assert "int" in str(caught.value)


@pytest.mark.parametrize(
    ("instant", "text"),
    [
        (0, "1970-01-01T00:00:00Z"),
        (1_500_000, "1970-01-01T00:00:01.5Z"),
        (123_456, "1970-01-01T00:00:00.123456Z"),
        (10, "1970-01-01T00:00:00.00001Z"),
        (-1, "1969-12-31T23:59:59.999999Z"),
        (-HOUR_US, "1969-12-31T23:00:00Z"),
        (1_707_231_600_000_000, "2024-02-06T15:00:00Z"),
        (expected(2024, 2, 29, 23, 59, 59, 120_000), "2024-02-29T23:59:59.12Z"),
        (FIRST_US, "0001-01-01T00:00:00Z"),
        (LAST_US, "9999-12-31T23:59:59.999999Z"),
    ],
)
def test_time_14_format(instant: int, text: str) -> None:
    """TIME-14"""
    assert format_instant(instant) == text


@pytest.mark.parametrize("instant", [FIRST_US - 1, LAST_US + 1, -(10**30), 10**30])
def test_time_14_format_out_of_range(instant: int) -> None:
    """TIME-14"""
    with pytest.raises(TimestampError):
        format_instant(instant)


@given(st.integers(min_value=FIRST_US, max_value=LAST_US))
def test_time_14_format_matches_stdlib(instant: int) -> None:
    """TIME-14"""
    moment = EPOCH + instant * ONE_US
    fraction = f".{moment.microsecond:06d}".rstrip("0") if moment.microsecond else ""
    assert format_instant(instant) == (
        f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment:%H:%M:%S}{fraction}Z"
    )


LOCAL_TIMES = st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 12, 31, 23, 59))
OFFSETS = st.integers(min_value=-14 * 60, max_value=14 * 60)


@given(LOCAL_TIMES, OFFSETS)
def test_time_15_app_and_iso_shapes_agree(local: datetime, offset: int) -> None:
    """TIME-15"""
    local = local.replace(microsecond=0)
    aware = local.replace(tzinfo=timezone(timedelta(minutes=offset)))
    instant = (aware - EPOCH) // ONE_US
    app = f"{local:%Y-%m-%d %H:%M:%S} {offset_text(offset, colon=False)}"
    assert parse_instant(app) == instant
    assert parse_instant(aware.isoformat()) == instant
    iso_basic = f"{local:%Y-%m-%dT%H:%M:%S}{offset_text(offset, colon=False)}"
    assert parse_instant(iso_basic) == instant


@given(LOCAL_TIMES, OFFSETS)
def test_time_15_iso_with_microseconds(local: datetime, offset: int) -> None:
    """TIME-15"""
    aware = local.replace(tzinfo=timezone(timedelta(minutes=offset)))
    assert parse_instant(aware.isoformat(timespec="microseconds")) == (aware - EPOCH) // ONE_US


@given(LOCAL_TIMES, OFFSETS, st.sampled_from(["\u202f", " ", "\u00a0", ""]))
def test_time_2_twelve_hour_equals_twenty_four_hour(local: datetime, offset: int, gap: str) -> None:
    """TIME-2"""
    twelve = local.hour % 12 or 12
    meridiem = "pm" if local.hour >= 12 else "am"
    zone = offset_text(offset, colon=True)
    twelve_text = f"{local:%Y-%m-%d} {twelve}:{local:%M:%S}{gap}{meridiem} {zone}"
    assert parse_instant(twelve_text) == parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")


@given(st.integers(min_value=FIRST_US, max_value=LAST_US))
def test_time_15_format_parse_round_trip(instant: int) -> None:
    """TIME-15"""
    text = format_instant(instant)
    assert parse_instant(text) == instant
    assert format_instant(parse_instant(text)) == text


@pytest.mark.parametrize(
    ("instant", "hour"),
    [
        (0, 0),
        (1, 0),
        (HOUR_US - 1, 0),
        (HOUR_US, HOUR_US),
        (-1, -HOUR_US),
        (-HOUR_US, -HOUR_US),
        (-HOUR_US - 1, -2 * HOUR_US),
        (1_707_233_400_000_000, 1_707_231_600_000_000),
    ],
)
def test_time_16_hour_of(instant: int, hour: int) -> None:
    """TIME-16"""
    assert hour_of(instant) == hour


@given(st.integers(min_value=FIRST_US, max_value=LAST_US))
def test_time_16_hour_of_is_a_floor(instant: int) -> None:
    """TIME-16"""
    start = hour_of(instant)
    assert start % HOUR_US == 0
    assert start <= instant < start + HOUR_US
    assert format_instant(start) == format_instant(instant)[:14] + "00:00Z"


def _both(value: object) -> tuple[str, int | None]:
    """What ``parse_instant`` makes of a point's timestamp once its year is Gregorian (PARSE-41)."""
    try:
        return "ok", parse_instant(gregorian(value) if isinstance(value, str) else value)
    except TimestampError:
        return "refused", None


def _fast(value: object) -> tuple[str, int | None]:
    try:
        return "ok", instant_of(value)
    except TimestampError:
        return "refused", None


@given(
    moment=st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1)),
    offset=st.integers(min_value=-14 * 60, max_value=14 * 60),
    position=st.integers(min_value=0, max_value=24),
    replacement=st.sampled_from(["", "0", "6", "9", ":", " ", "T", "a", "\u0663", "Z", "+"]),
)
def test_time_17_fast_path_agrees_with_parse_instant(
    moment: datetime, offset: int, position: int, replacement: str
) -> None:
    """TIME-17: the hour-cached fast path accepts and refuses exactly what parse_instant does."""
    zone = timezone(timedelta(minutes=offset))
    text = moment.replace(tzinfo=zone).strftime("%Y-%m-%d %H:%M:%S %z")
    mutated = text[:position] + replacement + text[position + 1 :]
    iso = moment.replace(tzinfo=zone).isoformat(timespec="seconds")
    for value in (text, mutated, mutated[:25], iso, text.replace(":", "", 1)):
        assert _fast(value) == _both(value)


@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01 00:45:00 +0030",
        "0001-01-01 00:15:00 +0030",
        "9999-12-31 23:15:00 -0030",
        "9999-12-31 23:45:00 -0030",
        "9999-12-31T23:59:59 +0000",
    ],
)
def test_time_17_fast_path_at_the_ends_of_the_range(value: str) -> None:
    """TIME-17: an hour outside the range with its instant inside, and the reverse, agree too,
    down to the message of the refusal (a year from 2500 read as Buddhist era, PARSE-41; one
    before 1900 or from 3000 on refused, PARSE-44, PARSE-47)."""
    outcomes = []
    for read in (lambda text: parse_instant(gregorian(text)), instant_of):
        try:
            outcomes.append(("ok", read(value)))
        except TimestampError as exc:
            outcomes.append(("refused", str(exc)))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    "value", ["2024-02-06 07:59:60 -0800", "2024-02-06 07:60:00 -0800", 20240206, None]
)
def test_time_17_fast_path_refuses_what_parse_instant_refuses(value: object) -> None:
    """TIME-17: leap seconds, minute 60 and non-strings are refused on the fast path too."""
    assert _fast(value) == _both(value) == ("refused", None)


@pytest.mark.parametrize("formatter", [KeyValueFormatter(), JsonFormatter()])
def test_log_times_are_utc_whatever_the_zone_time_18(
    formatter: logging.Formatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIME-18: a log record's time is UTC with a ``Z``, as every other instant healthlog
    writes, whatever ``TZ`` says: two records an hour apart across the end of daylight saving
    time in New York (05:30Z and 06:30Z, both 01:30 local) keep their order and their hour."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        lines = []
        for created in (1_730_611_800.0, 1_730_615_400.0):
            record = logging.LogRecord("healthlog.test", logging.INFO, __file__, 1, "x", (), None)
            record.created = created
            lines.append(formatter.format(record))
    finally:
        monkeypatch.undo()
        time.tzset()
    stamps = [re.search(r'time"?[=:]"?([0-9T:Z-]+)', line) for line in lines]
    assert [m.group(1) if m else line for m, line in zip(stamps, lines, strict=True)] == [
        "2024-11-03T05:30:00Z",
        "2024-11-03T06:30:00Z",
    ]


class Clock:
    """A language's 12-hour markers as CLDR 42 has them (specs/timestamps.md rule 5), where iOS
    puts them and with what between marker and time, and its first hour (Japanese counts 0..11)."""

    def __init__(self, morning: str, afternoon: str, before: bool, gap: str, first: int = 1):
        self.morning = morning
        self.afternoon = afternoon
        self.before = before
        self.gap = gap
        self.first = first

    def write(
        self, local: datetime, zone: str, before: bool | None = None, gap: str | None = None
    ) -> str:
        """``local`` as a phone set to this language's 12-hour clock writes it."""
        hour = local.hour % 12 or (12 if self.first else 0)
        marker = self.afternoon if local.hour >= 12 else self.morning
        gap = self.gap if gap is None else gap
        time = f"{hour}:{local:%M:%S}"
        shown = (
            f"{marker}{gap}{time}"
            if (self.before if before is None else before)
            else f"{time}{gap}{marker}"
        )
        return f"{local:%Y-%m-%d} {shown} {zone}"


CLOCKS = {
    "en": Clock("am", "pm", before=False, gap="\u202f"),
    "es": Clock("a.\u00a0m.", "p.\u00a0m.", before=False, gap="\u202f"),
    "el": Clock("\u03c0.\u03bc.", "\u03bc.\u03bc.", before=False, gap="\u202f"),
    "ar": Clock("\u0635", "\u0645", before=False, gap=" "),
    "ko": Clock("\uc624\uc804", "\uc624\ud6c4", before=True, gap=" "),
    "ja": Clock("\u5348\u524d", "\u5348\u5f8c", before=True, gap="", first=0),
    "zh": Clock("\u4e0a\u5348", "\u4e0b\u5348", before=True, gap=""),
    "tr": Clock("\u00d6\u00d6", "\u00d6S", before=True, gap="\u202f"),
    "vi": Clock("SA", "CH", before=False, gap="\u202f"),
    "ms": Clock("PG", "PTG", before=False, gap="\u202f"),
    "ta": Clock(
        "\u0bae\u0bc1\u0bb1\u0bcd\u0baa\u0b95\u0bb2\u0bcd",
        "\u0baa\u0bbf\u0bb1\u0bcd\u0baa\u0b95\u0bb2\u0bcd",
        before=True,
        gap=" ",
    ),
}
BEFORE = sorted(name for name, clock in CLOCKS.items() if clock.before)
AFTER = sorted(name for name, clock in CLOCKS.items() if not clock.before)
SEPT_21 = datetime(2024, 9, 21)


@pytest.mark.parametrize("language", AFTER)
def test_markers_after_the_time_time_19(language: str) -> None:
    """TIME-19: English, Spanish, Greek, Arabic, Vietnamese and Malay markers after the time,
    as iOS writes them (``7:57:00\\u202fp.\\u00a0m.``), are read on the 12-hour clock."""
    clock = CLOCKS[language]
    morning = clock.write(SEPT_21.replace(hour=7, minute=57), "+1000")
    evening = clock.write(SEPT_21.replace(hour=19, minute=57), "+1000")
    assert (parse_instant(morning), parse_instant(evening)) == (SEPT_21_0757, SEPT_21_1957)


@pytest.mark.parametrize("language", BEFORE)
def test_markers_before_the_time_time_20(language: str) -> None:
    """TIME-20: Korean, Japanese, Chinese, Turkish and Tamil markers before the time, as iOS
    writes them (``오후 7:57:00``, ``午後7:57:00``, ``下午7:57:00``), are read on the 12-hour
    clock."""
    clock = CLOCKS[language]
    morning = clock.write(SEPT_21.replace(hour=7, minute=57), "+1000")
    evening = clock.write(SEPT_21.replace(hour=19, minute=57), "+1000")
    assert (parse_instant(morning), parse_instant(evening)) == (SEPT_21_0757, SEPT_21_1957)


@pytest.mark.parametrize(
    ("text", "hour"),
    [
        ("2024-09-21 7:57:00\u202fa. m. +1000", 7),
        ("2024-09-21 7:57:00\u202fp.\u202fm. +1000", 19),
        ("2024-09-21 7:57:00 P.M. +1000", 19),
        ("2024-09-21 7:57:00 p.m. +1000", 19),
        ("2024-09-21 7:57:00\u202f\u039c.\u039c. +1000", 19),
        ("2024-09-21 7:57:00\u202fsa +1000", 7),
        ("2024-09-21 7:57:00ptg +1000", 19),
        ("2024-09-21 \u00f6s 7:57:00 +1000", 19),
        ("2024-09-21 \uc624\ud6c47:57:00 +1000", 19),
        ("2024-09-21 \u5348\u5f8c\u00a07:57:00 +1000", 19),
        ("2024-09-21 7:57:00\u202f\u4e0b\u5348 +1000", 19),
        ("2024-09-21 \u0645 7:57:00 +1000", 19),
    ],
)
def test_markers_in_any_case_position_and_spacing_time_19_20(text: str, hour: int) -> None:
    """TIME-19, TIME-20: the same markers in any letter case, before or after the time, with
    nothing, a space, U+00A0 or U+202F around them (and inside the Spanish ones)."""
    assert parse_instant(text) == expected(2024, 9, 21, hour, 57, offset_minutes=600)


@pytest.mark.parametrize("language", sorted(CLOCKS))
def test_noon_and_midnight_hours_time_21(language: str) -> None:
    """TIME-21: ``12`` with the morning marker is 00 and with the afternoon one 12; Japanese
    writes them ``午前0:05:00`` and ``午後0:05:00``."""
    clock = CLOCKS[language]
    texts = [clock.write(SEPT_21.replace(hour=hour, minute=5), "+0000") for hour in (0, 12)]
    twelve = "0" if language == "ja" else "12"
    assert all(f"{twelve}:05:00" in text for text in texts)
    assert [parse_instant(text) for text in texts] == [
        expected(2024, 9, 21, 0, 5),
        expected(2024, 9, 21, 12, 5),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2024-09-21 13:57:00\u202fp.\u00a0m. +1000", "hour is out of range 1..12"),
        ("2024-09-21 \uc624\ud6c4 13:57:00 +1000", "hour is out of range 1..12"),
        ("2024-09-21 \uc624\uc804 0:05:00 +1000", "hour is out of range 1..12"),
        ("2024-09-21 0:05:00\u202f\u03c0.\u03bc. +1000", "hour is out of range 1..12"),
        ("2024-09-21 \u4e0b\u53480:05:00 +1000", "hour is out of range 1..12"),
        ("2024-09-21 \u5348\u524d12:05:00 +1000", "hour is out of range 0..11"),
        ("2024-09-21 \u5348\u5f8c12:05:00 +1000", "hour is out of range 0..11"),
        ("2024-09-21 7:57:00 xm +1000", "supported date/time shape"),
        ("2024-09-21 7:57:00 ip. +1000", "supported date/time shape"),
        ("2024-09-21 7:57:00 a.m +1000", "supported date/time shape"),
        ("2024-09-21 7:57:00 a.  m. +1000", "supported date/time shape"),
        ("2024-09-21 7:57:00 \u03c0. \u03bc. +1000", "supported date/time shape"),
        ("2024-09-21 \u5348\u5f8c 7:57:00 pm +1000", "supported date/time shape"),
        ("2024-09-21 \uc624\ud6c4  7:57:00 +1000", "supported date/time shape"),
        ("2024-09-21T\uc624\ud6c4 7:57:00 +1000", "supported date/time shape"),
        ("2024-09-21\uc624\ud6c4 7:57:00 +1000", "supported date/time shape"),
        ("2024-09-21 7:57:00 +1000 \uc624\ud6c4", "supported date/time shape"),
        ("2024-09-21 \uc624\ud6c4", "supported date/time shape"),
    ],
)
def test_what_stays_refused_time_22(text: str, message: str) -> None:
    """TIME-22: an hour outside the marker's clock, an unknown or half-written marker, two
    markers, or a marker anywhere but next to the time is refused, with a message that says
    which rule was broken."""
    with pytest.raises(TimestampError, match=re.escape(message)):
        parse_instant(text)
    with pytest.raises(TimestampError, match=re.escape(message)):
        instant_of(text)


@given(
    LOCAL_TIMES,
    OFFSETS,
    st.sampled_from(sorted(CLOCKS)),
    st.booleans(),
    st.sampled_from(["\u202f", " ", "\u00a0", ""]),
)
def test_every_clock_equals_the_24_hour_time_time_23(
    local: datetime, offset: int, language: str, before: bool, gap: str
) -> None:
    """TIME-23: any time written on any language's 12-hour clock, before or after the time,
    with any gap, is the instant of its 24-hour spelling, on the fold's path too."""
    zone = offset_text(offset, colon=False)
    twelve = CLOCKS[language].write(local, zone, before, gap)
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    assert parse_instant(twelve) == instant_of(twelve) == instant


# The zero of the numbering systems that CLDR makes the default of locales whose calendar is the
# Gregorian (specs/timestamps.md rule 3), and of every other script Unicode has decimal digits of.
LOCALE_DIGITS = {
    "arab": "\u0660",  # Arabic of Egypt, Iraq, Jordan, Sudan, ...
    "arabext": "\u06f0",  # Persian, Pashto, Urdu of India
    "beng": "\u09e6",  # Bengali, Assamese
    "deva": "\u0966",  # Marathi, Nepali
    "mymr": "\u1040",  # Burmese
}
ZEROS = sorted(
    chr(code) for code in range(0x80, 0x110000) if unicodedata.decimal(chr(code), -1) == 0
)
_ASCII_OFFSET_AT_END = re.compile(r"[+-][0-9]{2}:?[0-9]{2}$")


def written_in(text: str, zero: str, offset_too: bool = False) -> str:
    """``text`` with its ASCII digits in the script whose zero is ``zero``; a UTC offset at the
    end stays in ASCII, as ICU writes `Z` (unless ``offset_too``)."""
    found = None if offset_too else _ASCII_OFFSET_AT_END.search(text)
    end = len(text) if found is None else found.start()
    digits = {ord("0") + d: ord(zero) + d for d in range(10)}
    return text[:end].translate(digits) + text[end:]


@pytest.mark.parametrize("script", sorted(LOCALE_DIGITS))
@pytest.mark.parametrize(
    ("text", "instant"),
    [
        ("2024-09-21 07:57:00 +1000", SEPT_21_0757),
        ("2024-09-21 7:57:00 \u0645 +1000", SEPT_21_1957),
        ("2024-09-21 7:57:00\u202fPM +1000", SEPT_21_1957),
        ("2024-09-21T07:57:00.25+10:00", SEPT_21_0757 + 250_000),
        ("2024-09-21", expected(2024, 9, 21)),
    ],
)
def test_digits_of_the_phones_locale_are_read_time_24(script: str, text: str, instant: int) -> None:
    """TIME-24: a date written in the digits of the phone's locale (Arabic-Indic U+0660..U+0669,
    Persian, Bengali, Devanagari, Burmese), with the offset in ASCII as ICU writes it or in the
    same digits, is the instant of its ASCII spelling, on the fold's path too."""
    for written in (written_in(text, LOCALE_DIGITS[script]), written_in(text, "\u0660", True)):
        assert written != text
        assert parse_instant(written) == instant_of(written) == instant


@pytest.mark.parametrize(
    "text",
    [
        "\u200f\u0662\u0660\u0662\u0664-\u0660\u0669-\u0662\u0661 "
        "\u0660\u0667:\u0665\u0667:\u0660\u0660 \u061c+1000",
        "\u0662\u0660\u0662\u0664\u200f-\u0660\u0669\u200f-\u0662\u0661 "
        "\u0660\u0667:\u0665\u0667:\u0660\u0660 \u200f+\u0661\u0660\u0660\u0660",
        "\u06f2\u06f0\u06f2\u06f4-\u06f0\u06f9-\u06f2\u06f1 "
        "\u06f0\u06f7:\u06f5\u06f7:\u06f0\u06f0 \u200e+\u200e\u06f1\u06f0\u06f0\u06f0",
    ],
)
def test_bidi_marks_around_the_digits_are_dropped_time_25(text: str) -> None:
    """TIME-25: the marks of CLDR's Arabic-script signs, ALM (U+061C), RLM (U+200F) and LRM
    (U+200E), wherever they stand, are dropped."""
    assert parse_instant(text) == instant_of(text) == SEPT_21_0757


@pytest.mark.parametrize(
    "text",
    [
        "\u0662\u0660\u0662\u0664-\u06f0\u06f9-\u06f2\u06f1 07:57:00 +1000",
        "\u0662\u0660\u0662\u0664-\u0660\u0669-\u0662\u0661 07:57:00 +1000",
        "\u0662\u0660\u0662\u0664-09-21 \u0660\u0667:\u0665\u0667:\u0660\u0660 +1000",
        "\u0662\u0660\u0662\u0664-\u0660\u0669-\u0662\u0661 \u0660\u0667:\u0665\u0667:\u0660\u0660 "
        "+\u06f1\u06f0\u06f0\u06f0",
        "\u0662\u0660\u0662\u0664-\u0660\u0669-\u0662\u0661 \u0660\u0667:\u0665\u0667:\u0660\u0660 "
        "+1\u0660\u0660\u0660",
        "2024-09-21 07:57:00 +\u0661\u0660\u0660\u0660",
        "\u0662\u0660\u0662\u0664-\u0966\u096f-\u0662\u0661",
    ],
)
def test_digits_of_two_scripts_are_refused_time_26(text: str) -> None:
    """TIME-26: digits of two scripts in one timestamp, ASCII ones included, but for an offset
    wholly in ASCII, are refused, on the fold's path too."""
    for read in (parse_instant, instant_of):
        with pytest.raises(TimestampError, match="mixes digits of different scripts"):
            read(text)


@given(
    LOCAL_TIMES,
    OFFSETS,
    st.sampled_from(ZEROS),
    st.booleans(),
    st.sampled_from(["app", "iso", "date", *sorted(CLOCKS)]),
)
def test_any_script_gives_the_same_instant_time_27(
    local: datetime, offset: int, zero: str, offset_too: bool, shape: str
) -> None:
    """TIME-27: every accepted ASCII timestamp, its digits written in any script Unicode has
    decimal digits of (the offset in ASCII or in the same script), gives the same instant, on
    the fold's path too."""
    zone = offset_text(offset, colon=False)
    local = local.replace(microsecond=local.microsecond // 1000 * 1000)
    if shape == "app":
        text = f"{local:%Y-%m-%d %H:%M:%S} {zone}"
    elif shape == "iso":
        text = local.replace(tzinfo=timezone(timedelta(minutes=offset))).isoformat()
    elif shape == "date":
        text = f"{local:%Y-%m-%d}"
    else:
        text = CLOCKS[shape].write(local, zone)
    instant = parse_instant(text)
    written = written_in(text, zero, offset_too)
    assert parse_instant(written) == instant_of(written) == instant


@given(LOCAL_TIMES, OFFSETS, st.sampled_from([" ", ""]), st.booleans())
def test_mainland_chinese_offset_written_twice_time_28(
    local: datetime, offset: int, gap: str, colon: bool
) -> None:
    """TIME-28: mainland Chinese on the 12-hour clock writes the offset before the marker as
    well as after the time (``2024-09-21 +1000 上午7:57:00 +1000``); with both the same it is
    the instant of the 24-hour time, on the fold's path too."""
    zone = offset_text(offset, colon=False)
    clock = CLOCKS["zh"].write(local, zone)
    date, rest = clock.split(" ", 1)
    twice = f"{date} {offset_text(offset, colon)}{gap}{rest}"
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    assert parse_instant(twice) == instant_of(twice) == instant


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2024-09-21 +1000 \u4e0a\u53487:57:00 +0900", "offset before the time differs"),
        ("2024-09-21 +1000 \u4e0a\u53487:57:00 -1000", "offset before the time differs"),
        ("2024-09-21 +1000 \u4e0a\u53487:57:00", "offset before the time differs"),
        ("2024-09-21 +0000 \u4e0a\u53487:57:00 Z", "offset before the time differs"),
        ("2024-09-21 +1000 7:57:00 +1000", "supported date/time shape"),
        ("2024-09-21 +1000 7:57:00\u202fpm +1000", "supported date/time shape"),
        ("2024-09-21T+1000 \u4e0a\u53487:57:00 +1000", "supported date/time shape"),
        ("2024-09-21 +1000  \u4e0a\u53487:57:00 +1000", "supported date/time shape"),
        ("2024-09-21 +1000 \u4e0a\u53487:57:00 +1000 +1000", "supported date/time shape"),
    ],
)
def test_two_offsets_that_differ_are_refused_time_29(text: str, message: str) -> None:
    """TIME-29: an offset before the time that differs from the one after it, or stands alone,
    or before a time without a marker before it, is refused, on the fold's path too."""
    for read in (parse_instant, instant_of):
        with pytest.raises(TimestampError, match=re.escape(message)):
            read(text)


@given(
    moment=st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1)),
    offset=st.integers(min_value=-14 * 60, max_value=14 * 60),
    zero=st.sampled_from(sorted(LOCALE_DIGITS.values())),
    position=st.integers(min_value=0, max_value=24),
    replacement=st.sampled_from(["", "0", "9", "\u0663", "\u06f3", "\u200f", ":", " ", "+"]),
)
def test_fast_path_of_locale_digits_agrees_time_30(
    moment: datetime, offset: int, zero: str, position: int, replacement: str
) -> None:
    """TIME-30: the app's shape in the digits of the phone's locale, read by the fold from the
    hour cache of its ASCII spelling, gives what ``parse_instant`` gives, and refuses what it
    refuses (a character replaced by a digit of another script, a mark, a separator)."""
    zone = timezone(timedelta(minutes=offset))
    moment = moment.replace(microsecond=0)
    text = written_in(moment.replace(tzinfo=zone).strftime("%Y-%m-%d %H:%M:%S %z"), zero)
    mutated = text[:position] + replacement + text[position + 1 :]
    for value in (text, mutated, written_in(text, zero, offset_too=True)):
        assert _fast(value) == _both(value)
    assert _fast(text) == ("ok", (moment.replace(tzinfo=zone) - EPOCH) // ONE_US)


class DayPeriods:
    """A language whose 12-hour time is CLDR 42's `B h:mm:ss` (specs/timestamps.md rule 5): its
    abbreviated flexible day periods of the format context, each from the hour its dayPeriods
    rule starts at to the one it stops before, its `noon` (`at 12:00`) if it has one, and what
    stands between period and time."""

    def __init__(self, periods: list[tuple[int, int, str]], noon: str | None, gap: str):
        self.periods = periods
        self.noon = noon
        self.gap = gap

    def period(self, local: datetime) -> str:
        """The period ICU 72 writes for ``local`` (`SimpleDateFormat::subFormat`, field `B`):
        noon only at 12:00:00 exactly, midnight never (suppressed since ICU 57), else the one
        whose rule holds the hour."""
        if self.noon is not None and (local.hour, local.minute, local.second) == (12, 0, 0):
            return self.noon
        return next(name for start, stop, name in self.periods if start <= local.hour < stop)

    def write(self, local: datetime, zone: str) -> str:
        """``local`` as a phone set to this language's 12-hour clock writes it."""
        time = f"{local.hour % 12 or 12}:{local:%M:%S}"
        return f"{local:%Y-%m-%d} {self.period(local)}{self.gap}{time} {zone}"


DAY_PERIODS = {
    "zh_Hant": DayPeriods(
        [
            (0, 5, "\u51cc\u6668"),
            (5, 8, "\u6e05\u6668"),
            (8, 12, "\u4e0a\u5348"),
            (12, 13, "\u4e2d\u5348"),
            (13, 19, "\u4e0b\u5348"),
            (19, 24, "\u665a\u4e0a"),
        ],
        noon=None,
        gap="",
    ),
    "my": DayPeriods(
        [
            (0, 12, "\u1014\u1036\u1014\u1000\u103a"),
            (12, 16, "\u1014\u1031\u1037\u101c\u101a\u103a"),
            (16, 19, "\u100a\u1014\u1031"),
            (19, 24, "\u100a"),
        ],
        noon="\u1019\u103d\u1014\u103a\u1038\u1010\u100a\u1037\u103a",
        gap=" ",
    ),
}


@pytest.mark.parametrize(
    ("text", "hour", "minute"),
    [
        ("2024-09-21 \u51cc\u66681:00:00 +1000", 1, 0),
        ("2024-09-21 \u51cc\u666812:00:00 +1000", 0, 0),
        ("2024-09-21 \u51cc\u66684:59:59 +1000", 4, 59),
        ("2024-09-21 \u6e05\u66685:30:00 +1000", 5, 30),
        ("2024-09-21 \u6e05\u66687:57:00 +1000", 7, 57),
        ("2024-09-21 \u4e0a\u53488:00:00 +1000", 8, 0),
        ("2024-09-21 \u4e2d\u534812:30:00 +1000", 12, 30),
        ("2024-09-21 \u4e0b\u53481:00:00 +1000", 13, 0),
        ("2024-09-21 \u4e0b\u53486:59:00 +1000", 18, 59),
        ("2024-09-21 \u665a\u4e0a7:57:00 +1000", 19, 57),
        ("2024-09-21 \u665a\u4e0a11:59:00 +1000", 23, 59),
        ("2024-09-21 \u1014\u1036\u1014\u1000\u103a 12:05:00 +1000", 0, 5),
        ("2024-09-21 \u1014\u1036\u1014\u1000\u103a 7:57:00 +1000", 7, 57),
        ("2024-09-21 \u1019\u103d\u1014\u103a\u1038\u1010\u100a\u1037\u103a 12:00:00 +1000", 12, 0),
        ("2024-09-21 \u1014\u1031\u1037\u101c\u101a\u103a 12:00:01 +1000", 12, 0),
        ("2024-09-21 \u1014\u1031\u1037\u101c\u101a\u103a 3:57:00 +1000", 15, 57),
        ("2024-09-21 \u100a\u1014\u1031 4:00:00 +1000", 16, 0),
        ("2024-09-21 \u100a\u1014\u1031 6:57:00 +1000", 18, 57),
        ("2024-09-21 \u100a 7:57:00 +1000", 19, 57),
        ("2024-09-21 \u100a 11:00:00 +1000", 23, 0),
    ],
)
def test_day_periods_time_31(text: str, hour: int, minute: int) -> None:
    """TIME-31: Traditional Chinese and Burmese write the time of a 12-hour clock after a day
    period (`B h:mm:ss`); each period names the hours of its CLDR 42 rule (晚上 19..24, 凌晨
    0..5, 中午 12..13), so `晚上7:57` is 19:57, `凌晨12:00` 00:00 and `中午12:30` 12:30, on the
    fold's path too."""
    second = int(text.split(":")[2][:2])
    instant = expected(2024, 9, 21, hour, minute, second, offset_minutes=600)
    assert parse_instant(text) == instant_of(text) == instant


@pytest.mark.parametrize(
    "text",
    [
        "2024-09-21 \u665a\u4e0a1:00:00 +1000",
        "2024-09-21 \u665a\u4e0a6:59:00 +1000",
        "2024-09-21 \u51cc\u66685:00:00 +1000",
        "2024-09-21 \u6e05\u666812:30:00 +1000",
        "2024-09-21 \u6e05\u66688:00:00 +1000",
        "2024-09-21 \u4e2d\u53481:00:00 +1000",
        "2024-09-21 \u1014\u1031\u1037\u101c\u101a\u103a 4:00:00 +1000",
        "2024-09-21 \u100a\u1014\u1031 7:00:00 +1000",
        "2024-09-21 \u100a 6:00:00 +1000",
        "2024-09-21 \u1019\u103d\u1014\u103a\u1038\u1010\u100a\u1037\u103a 1:00:00 +1000",
    ],
)
def test_hour_outside_its_day_period_is_refused_time_32(text: str) -> None:
    """TIME-32: an hour its day period does not hold (`晚上1:00`, `清晨12:30`) is refused, on the
    fold's path too: no phone writes it, and reading it either way would be a guess."""
    for read in (parse_instant, instant_of):
        with pytest.raises(TimestampError, match="hour lies outside its day period"):
            read(text)


@pytest.mark.parametrize(
    "text",
    [
        "2024-09-21 \u5348\u591c12:00:00 +1000",
        "2024-09-21 \u65e9\u4e0a7:57:00 +1000",
        "2024-09-21 \u534a\u591c1:00:00 +1000",
        "2024-09-21 \u101e\u1014\u103a\u1038\u1001\u1031\u102b\u1004\u103a\u101a\u1036"
        " 12:00:00 +1000",
        "2024-09-21 \u51cc\u66680:30:00 +1000",
        "2024-09-21 \u665a\u4e0a13:00:00 +1000",
        "2024-09-21 7:57:00\u665a\u4e0a +1000 \u665a\u4e0a",
    ],
)
def test_what_no_day_period_rule_gives_stays_refused_time_33(text: str) -> None:
    """TIME-33: midnight periods, which ICU 72 never writes (午夜, Burmese သန်းခေါင်ယံ), periods
    of locales whose 12-hour time is not `B h:mm:ss` (早上 of Hong Kong, 半夜), hour 0 or 13 and
    two periods are refused, on the fold's path too."""
    for read in (parse_instant, instant_of):
        with pytest.raises(TimestampError):
            read(text)


@given(
    local=LOCAL_TIMES,
    offset=OFFSETS,
    language=st.sampled_from(sorted(DAY_PERIODS)),
    zero=st.sampled_from(["0", "\u1040"]),
)
def test_every_day_period_equals_the_24_hour_time_time_34(
    local: datetime, offset: int, language: str, zero: str
) -> None:
    """TIME-34: any time written as a Traditional Chinese or Burmese phone on the 12-hour clock
    writes it, in ASCII or Burmese digits, is the instant of its 24-hour spelling, on the
    fold's path too."""
    zone = offset_text(offset, colon=False)
    twelve = written_in(DAY_PERIODS[language].write(local, zone), zero)
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    assert parse_instant(twelve) == instant_of(twelve) == instant


# The 12-hour clocks of rule 5 whose markers an older healthlog refused, as CLDR 42 has them, with
# the digits of their default numbering system (Dzongkha's Tibetan digits are also accepted).
LOCALE_CLOCKS = {
    "fa": (Clock("\u0642.\u0638.", "\u0628.\u0638.", before=False, gap=" "), "\u06f0"),
    "ps": (Clock("\u063a.\u0645.", "\u063a.\u0648.", before=False, gap=" "), "\u06f0"),
    "ne": (
        Clock(
            "\u092a\u0942\u0930\u094d\u0935\u093e\u0939\u094d\u0928",
            "\u0905\u092a\u0930\u093e\u0939\u094d\u0928",
            before=False,
            gap=" ",
        ),
        "\u0966",
    ),
    "as": (
        Clock(
            "\u09aa\u09c2\u09f0\u09cd\u09ac\u09be\u09b9\u09cd\u09a8",
            "\u0985\u09aa\u09f0\u09be\u09b9\u09cd\u09a8",
            before=True,
            gap=" ",
        ),
        "\u09e6",
    ),
    "ckb": (Clock("\u0628.\u0646", "\u062f.\u0646", before=False, gap=" "), "\u0660"),
    "sd": (
        Clock(
            "\u0635\u0628\u062d\u060c\u202f\u0645\u0646\u062c\u0647\u0646\u062f",
            "\u0634\u0627\u0645\u060c\u202f\u0645\u0646\u062c\u0647\u0646\u062f",
            before=False,
            gap=" ",
        ),
        "\u0660",
    ),
    "dz": (
        Clock("\u0f66\u0f94\u0f0b\u0f46\u0f0b", "\u0f55\u0fb1\u0f72\u0f0b\u0f46\u0f0b", False, " "),
        "\u0f20",
    ),
}


@pytest.mark.parametrize("language", sorted(LOCALE_CLOCKS))
@pytest.mark.parametrize(("hour", "minute"), [(7, 57), (19, 57), (0, 5), (12, 5)])
def test_markers_of_more_languages_time_35(language: str, hour: int, minute: int) -> None:
    """TIME-35: Persian `ق.ظ.`/`ب.ظ.`, Pashto, Nepali, Assamese (before the time), Central
    Kurdish, Sindhi (with its U+202F) and Dzongkha markers are read on the 12-hour clock, in
    ASCII digits and in those of the locale, on the fold's path too."""
    clock, zero = LOCALE_CLOCKS[language]
    text = clock.write(SEPT_21.replace(hour=hour, minute=minute), "+1000")
    instant = expected(2024, 9, 21, hour, minute, offset_minutes=600)
    for written in (text, written_in(text, zero)):
        assert parse_instant(written) == instant_of(written) == instant


@given(
    local=LOCAL_TIMES,
    offset=OFFSETS,
    language=st.sampled_from(sorted(LOCALE_CLOCKS)),
    gap=st.sampled_from(["\u202f", " ", "\u00a0", ""]),
    before=st.booleans(),
    locale_digits=st.booleans(),
    mark=st.sampled_from(["", "\u200e", "\u200f", "\u061c"]),
)
def test_every_new_marker_equals_the_24_hour_time_time_36(
    local: datetime,
    offset: int,
    language: str,
    gap: str,
    before: bool,
    locale_digits: bool,
    mark: str,
) -> None:
    """TIME-36: any time written on the 12-hour clock of TIME-35's languages, before or after the
    time, with any gap, in ASCII or the locale's digits, with a bidi mark beside the offset's
    sign, is the instant of its 24-hour spelling, on the fold's path too."""
    clock, zero = LOCALE_CLOCKS[language]
    zone = offset_text(offset, colon=False)
    twelve = clock.write(local, zone, before, gap)
    if locale_digits:
        twelve = written_in(twelve, zero)
    twelve = twelve[:-5] + mark + twelve[-5:]
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    assert parse_instant(twelve) == instant_of(twelve) == instant


# The 12-hour clocks of the other CLDR 42 languages whose time uses `a` (rule 5), one row per
# distinct pair of markers, with the position and gap of the language's `h:mm:ss a` pattern.
LANGUAGE_CLOCKS = [
    ("af", Clock("vm.", "nm.", before=False, gap="\u202f")),
    ("agq", Clock("a.g", "a.k", before=False, gap="\u202f")),
    ("ak", Clock("AN", "EW", before=False, gap=" ")),
    ("am", Clock("\u1325\u12cb\u1275", "\u12a8\u1230\u12d3\u1275", before=False, gap=" ")),
    ("asa", Clock("icheheavo", "ichamthi", before=False, gap=" ")),
    ("az", Clock("\u0410\u041c", "\u041f\u041c", before=False, gap=" ")),
    (
        "bas",
        Clock(
            "I\u202fbik\u025b\u0302gl\xe0", "I\u202f\u0253ugaj\u0254p", before=False, gap="\u202f"
        ),
    ),
    (
        "be",
        Clock(
            "\u0430\u043f\u043e\u045e\u043d\u0430\u0447\u044b",
            "\u0430\u043f\u043e\u045e\u0434\u043d\u0456",
            before=False,
            gap="\u202f",
        ),
    ),
    ("bem", Clock("uluchelo", "akasuba", before=False, gap=" ")),
    ("bez", Clock("pamilau", "pamunyi", before=False, gap=" ")),
    (
        "bo",
        Clock(
            "\u0f66\u0f94\u0f0b\u0f51\u0fb2\u0f7c\u0f0b",
            "\u0f55\u0fb1\u0f72\u0f0b\u0f51\u0fb2\u0f7c\u0f0b",
            before=False,
            gap=" ",
        ),
    ),
    ("br", Clock("A.M.", "G.M.", before=False, gap="\u202f")),
    (
        "brx",
        Clock(
            "\u092b\u0941\u0902", "\u092c\u0947\u0932\u093e\u0938\u0947", before=False, gap="\u202f"
        ),
    ),
    (
        "bs",
        Clock(
            "\u043f\u0440\u0435\u202f\u043f\u043e\u0434\u043d\u0435",
            "\u043f\u043e\u043f\u043e\u0434\u043d\u0435",
            before=False,
            gap=" ",
        ),
    ),
    ("chr", Clock("\u13cc\u13be\u13b4", "\u13d2\u13af\u13f1\u13a2", before=False, gap=" ")),
    ("cs", Clock("dop.", "odp.", before=False, gap="\u202f")),
    ("dav", Clock("Luma\u202flwa\u202fK", "luma\u202flwa\u202fp", before=False, gap=" ")),
    ("dje", Clock("Subbaahi", "Zaarikay\u202fb", before=False, gap="\u202f")),
    ("doi", Clock("\u0938\u0935\u0947\u0930", "\u0938\u2019\u091e", before=False, gap=" ")),
    ("dsb", Clock("dop.", "w\xf3tp.", before=False, gap="\u202f")),
    ("dua", Clock("idi\u0253a", "eby\xe1mu", before=False, gap="\u202f")),
    ("ebu", Clock("KI", "UT", before=False, gap=" ")),
    ("eo", Clock("atm", "ptm", before=False, gap=" ")),
    ("ewo", Clock("k\xedk\xedr\xedg", "ng\u0259g\xf3g\u0259le", before=False, gap="\u202f")),
    ("ff", Clock("subaka", "kikii\u0257e", before=False, gap=" ")),
    ("ff", Clock("\U0001e900\U0001e90e", "\U0001e907\U0001e90e", before=False, gap=" ")),
    ("frr", Clock("i/m", "e/m", before=False, gap="\u202f")),
    ("fur", Clock("a.", "p.", before=False, gap=" ")),
    ("ga", Clock("r.n.", "i.n.", before=False, gap="\u202f")),
    ("gd", Clock("m", "f", before=False, gap="\u202f")),
    ("gsw", Clock("vorm.", "nam.", before=False, gap=" ")),
    ("guz", Clock("Ma", "Mo", before=False, gap=" ")),
    ("ha", Clock("SF", "YM", before=False, gap="\u202f")),
    (
        "he",
        Clock(
            "\u05dc\u05e4\u05e0\u05d4\u05f4\u05e6",
            "\u05d0\u05d7\u05d4\u05f4\u05e6",
            before=False,
            gap=" ",
        ),
    ),
    ("hsb", Clock("dop.", "pop.", before=False, gap="\u202f")),
    ("hu", Clock("de.", "du.", before=True, gap="\u202f")),
    ("ii", Clock("\ua3b8\ua111", "\ua06f\ua2d2", before=False, gap=" ")),
    ("is", Clock("f.h.", "e.h.", before=False, gap="\u202f")),
    (
        "jgo",
        Clock(
            "mba\ua78cmba\ua78c", "\u014bka\u202fmb\u0254\u0301t\u202fnji", before=False, gap=" "
        ),
    ),
    ("jmc", Clock("utuko", "kyiukonyi", before=False, gap=" ")),
    ("jv", Clock("Isuk", "Wengi", before=False, gap="\u202f")),
    ("kab", Clock("n\u202ftufat", "n\u202ftmeddit", before=False, gap="\u202f")),
    ("kam", Clock("\u0128yakwakya", "\u0128yaw\u0129oo", before=False, gap=" ")),
    ("kde", Clock("Muhi", "Chilo", before=False, gap=" ")),
    ("khq", Clock("Adduha", "Aluula", before=False, gap=" ")),
    ("ki", Clock("Kiroko", "Hwa\u0129-in\u0129", before=False, gap=" ")),
    ("kl", Clock("u.t.", "u.k.", before=False, gap="\u202f")),
    ("kln", Clock("krn", "koosk", before=False, gap=" ")),
    (
        "kn",
        Clock(
            "\u0caa\u0cc2\u0cb0\u0ccd\u0cb5\u0cbe\u0cb9\u0ccd\u0ca8",
            "\u0c85\u0caa\u0cb0\u0cbe\u0cb9\u0ccd\u0ca8",
            before=False,
            gap=" ",
        ),
    ),
    ("ksb", Clock("makeo", "nyiaghuo", before=False, gap=" ")),
    ("ksf", Clock("s\xe1r\xfaw\xe1", "c\u025b\u025b\u0301nko", before=False, gap="\u202f")),
    ("ksh", Clock("v.M.", "n.M.", before=False, gap="\u202f")),
    ("ku", Clock("BN", "PN", before=False, gap=" ")),
    ("ky", Clock("\u0442\u04a3", "\u0442\u043a", before=False, gap="\u202f")),
    ("lag", Clock("TOO", "MUU", before=False, gap=" ")),
    ("lb", Clock("moies", "nom\xebttes", before=False, gap="\u202f")),
    ("ln", Clock("nt\u0254\u0301ng\u0254\u0301", "mp\xf3kwa", before=False, gap="\u202f")),
    (
        "lo",
        Clock(
            "\u0e81\u0ec8\u0ead\u0e99\u0e97\u0ec8\u0ebd\u0e87",
            "\u0eab\u0ebc\u0eb1\u0e87\u0e97\u0ec8\u0ebd\u0e87",
            before=False,
            gap=" ",
        ),
    ),
    ("lt", Clock("prie\u0161piet", "popiet", before=False, gap="\u202f")),
    ("lu", Clock("Dinda", "Dilolo", before=False, gap="\u202f")),
    ("luo", Clock("OD", "OT", before=False, gap=" ")),
    ("lv", Clock("priek\u0161p.", "p\u0113cp.", before=False, gap="\u202f")),
    ("mai", Clock("\u092d\u094b\u0930", "\u0938\u093e\u0902\u091d", before=False, gap=" ")),
    ("mas", Clock("\u0190nkak\u025bny\xe1", "\u0190nd\xe1m\xe2", before=False, gap=" ")),
    ("mer", Clock("R\u0168", "\u0168G", before=False, gap=" ")),
    ("mgh", Clock("wichishu", "mchochil\u2019l", before=False, gap="\u202f")),
    (
        "mk",
        Clock(
            "\u043f\u0440\u0435\u0442\u043f\u043b.",
            "\u043f\u043e\u043f\u043b.",
            before=False,
            gap="\u202f",
        ),
    ),
    ("mn", Clock("\u04af.\u04e9.", "\u04af.\u0445.", before=False, gap="\u202f")),
    ("mni", Clock("\u09a8\u09c1\u09ae\u09be\u0982", "PM", before=False, gap=" ")),
    ("mua", Clock("comme", "lilli", before=False, gap="\u202f")),
    ("naq", Clock("\u01c1goagas", "\u01c3uias", before=False, gap=" ")),
    ("nds", Clock("vm", "nm", before=False, gap="\u202f")),
    ("nmg", Clock("man\xe1", "kug\xfa", before=False, gap="\u202f")),
    ("nn", Clock("f.m.", "e.m.", before=False, gap="\u202f")),
    ("nnh", Clock("mba\u02bc\xe1mba\u02bc", "ncw\xf2nz\xe9m", before=False, gap=" ")),
    ("nus", Clock("RW", "T\u014a", before=False, gap="\u202f")),
    ("om", Clock("WD", "WB", before=False, gap="\u202f")),
    (
        "pa",
        Clock("\u0a2a\u0a42.\u0a26\u0a41.", "\u0a2c\u0a3e.\u0a26\u0a41.", before=False, gap=" "),
    ),
    ("pcm", Clock("FM", "FI", before=False, gap="\u202f")),
    ("rn", Clock("Z.MU.", "Z.MW.", before=False, gap="\u202f")),
    ("rof", Clock("kang\u2019ama", "kingoto", before=False, gap=" ")),
    ("rwk", Clock("utuko", "kyiukonyi", before=False, gap=" ")),
    ("sah", Clock("\u042d\u0418", "\u042d\u041a", before=False, gap="\u202f")),
    ("saq", Clock("Tesiran", "Teipa", before=False, gap=" ")),
    ("sbp", Clock("Lwamilawu", "Pashamihe", before=False, gap="\u202f")),
    ("se", Clock("i.b.", "e.b.", before=False, gap="\u202f")),
    ("se", Clock("ib", "eb", before=False, gap="\u202f")),
    ("ses", Clock("Adduha", "Aluula", before=False, gap=" ")),
    ("sg", Clock("ND", "LK", before=False, gap=" ")),
    (
        "shi",
        Clock(
            "\u2d5c\u2d49\u2d3c\u2d30\u2d61\u2d5c",
            "\u2d5c\u2d30\u2d37\u2d33\u2d33\u2d6f\u2d30\u2d5c",
            before=False,
            gap=" ",
        ),
    ),
    ("shi", Clock("tifawt", "tadgg\u02b7at", before=False, gap=" ")),
    ("si", Clock("\u0db4\u0dd9.\u0dc0.", "\u0db4.\u0dc0.", before=True, gap=" ")),
    ("sl", Clock("dop.", "pop.", before=False, gap="\u202f")),
    ("so", Clock("GH", "GD", before=False, gap=" ")),
    ("sq", Clock("p.d.", "m.d.", before=False, gap="\u202f")),
    (
        "sr",
        Clock(
            "\u043f\u0440\u0438\u0458\u0435\u202f\u043f\u043e\u0434\u043d\u0435",
            "\u043f\u043e\u202f\u043f\u043e\u0434\u043d\u0435",
            before=False,
            gap="\u202f",
        ),
    ),
    ("sr", Clock("prije\u202fpodne", "po\u202fpodne", before=False, gap="\u202f")),
    ("sv", Clock("fm", "em", before=False, gap="\u202f")),
    ("teo", Clock("Taparachu", "Ebongi", before=False, gap=" ")),
    ("ti", Clock("\u1245.\u1240.", "\u12f5.\u1240.", before=False, gap=" ")),
    ("tk", Clock("go.\xf6\u0148", "go.so\u0148", before=False, gap="\u202f")),
    ("twq", Clock("Subbaahi", "Zaarikay\u202fb", before=False, gap="\u202f")),
    ("tzm", Clock("Zdat\u202fazal", "\u1e0ceffir\u202faza", before=False, gap=" ")),
    ("ug", Clock("\u0686.\u0628", "\u0686.\u0643", before=False, gap=" ")),
    ("uk", Clock("\u0434\u043f", "\u043f\u043f", before=False, gap="\u202f")),
    ("uz", Clock("TO", "TK", before=False, gap="\u202f")),
    ("uz", Clock("\u0422\u041e", "\u0422\u041a", before=False, gap="\u202f")),
    ("vun", Clock("utuko", "kyiukonyi", before=False, gap=" ")),
    ("wo", Clock("Sub", "Ngo", before=False, gap="\u202f")),
    ("xog", Clock("Munkyo", "Eigulo", before=False, gap=" ")),
    (
        "yav",
        Clock(
            "ki\u025bm\u025b\u0301\u025bm", "kis\u025b\u0301nd\u025b", before=False, gap="\u202f"
        ),
    ),
    (
        "yi",
        Clock(
            "\u05e4\u05bf\u05d0\u05b7\u05e8\u05de\u05d9\u05d8\u05d0\u05b8\u05d2",
            "\u05e0\u05d0\u05b8\u05db\u05de\u05d9\u05d8\u05d0\u05b8\u05d2",
            before=False,
            gap=" ",
        ),
    ),
    ("yo", Clock("\xc0\xe1r\u1ecd\u0300", "\u1ecc\u0300s\xe1n", before=False, gap="\u202f")),
    ("yo", Clock("\xc0\xe1r\u0254\u0300", "\u0186\u0300s\xe1n", before=False, gap="\u202f")),
    (
        "zgh",
        Clock(
            "\u2d5c\u2d49\u2d3c\u2d30\u2d61\u2d5c",
            "\u2d5c\u2d30\u2d37\u2d33\u2d33\u2d6f\u2d30\u2d5c",
            before=False,
            gap=" ",
        ),
    ),
]


@pytest.mark.parametrize(("language", "clock"), LANGUAGE_CLOCKS)
@pytest.mark.parametrize(("hour", "minute"), [(7, 57), (19, 57), (0, 5), (12, 5)])
def test_markers_of_the_other_languages_time_37(
    language: str, clock: Clock, hour: int, minute: int
) -> None:
    """TIME-37: the abbreviated AM/PM of every other CLDR 42 language whose 12-hour time uses
    `a` (Hebrew, Ukrainian `дп`, Czech `dop.`, Swedish `fm`, ...) is read on the 12-hour clock,
    where the language puts it, on the fold's path too."""
    text = clock.write(SEPT_21.replace(hour=hour, minute=minute), "+1000")
    instant = expected(2024, 9, 21, hour, minute, offset_minutes=600)
    assert parse_instant(text) == instant_of(text) == instant, language


@given(
    local=LOCAL_TIMES,
    offset=OFFSETS,
    row=st.sampled_from(LANGUAGE_CLOCKS),
    gap=st.sampled_from(["\u202f", " ", "\u00a0", ""]),
    before=st.booleans(),
)
def test_every_other_marker_equals_the_24_hour_time_time_38(
    local: datetime, offset: int, row: tuple[str, Clock], gap: str, before: bool
) -> None:
    """TIME-38: any time written on the 12-hour clock of TIME-37's languages, before or after the
    time, with any gap, is the instant of its 24-hour spelling, on the fold's path too."""
    zone = offset_text(offset, colon=False)
    twelve = row[1].write(local, zone, before, gap)
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    assert parse_instant(twelve) == instant_of(twelve) == instant


@pytest.mark.parametrize(
    "text",
    [
        "2024-09-21 7:57:00 ip. +1000",
        "2024-09-21 7:57:00\u202fIP. +1000",
        "2024-09-21 7:57:00 ap. +1000",
        "2024-09-21 7:57:00 ep. +1000",
    ],
)
def test_a_marker_that_is_am_and_pm_is_refused_time_39(text: str) -> None:
    """TIME-39: `ip.`, PM in Finnish and AM in Inari Sami, is refused rather than guessed, and so
    are the Finnish and Inari Sami clocks' other markers (`ap.`, `ep.`), which no phone writes
    in the app's dates: the 12-hour remap drops the marker of both languages."""
    with pytest.raises(TimestampError, match="supported date/time shape"):
        parse_instant(text)


EWE = Clock("\u014bdi ga", "\u0263etr\u0254 ga", before=True, gap=" ")


def _ewe(local: datetime, zone: str, *, togo: bool = False, gap: str = " ") -> str:
    """``local`` as an Ewe phone on the 12-hour clock writes it: `ŋdi ga 7:57:00 +1000` (`ee`,
    `ee_GH`), with `le` before the offset in Togo (`ee_TG`); ``gap`` inside the marker."""
    text = EWE.write(local, zone).replace(" ga", f"{gap}ga")
    return text.replace(f" {zone}", f" le {zone}") if togo else text


@pytest.mark.parametrize("togo", [False, True])
@pytest.mark.parametrize("gap", [" ", "\u202f", "\u00a0", ""])
@pytest.mark.parametrize(("hour", "minute"), [(7, 57), (19, 57), (0, 5), (12, 5)])
def test_ewe_markers_are_read_time_42(togo: bool, gap: str, hour: int, minute: int) -> None:
    """TIME-42: Ewe's `ŋdi ga 7:57:00 +1000` and its afternoon marker's, as ICU 72 writes the
    app's dates for `ee` and `ee_GH` on the 12-hour clock, and `ŋdi ga 7:57:00 le +1000` for
    `ee_TG`, in either letter case and with any space inside the marker, are read on the 12-hour
    clock, on the fold's path too."""
    text = _ewe(SEPT_21.replace(hour=hour, minute=minute), "+1000", togo=togo, gap=gap)
    instant = expected(2024, 9, 21, hour, minute, offset_minutes=600)
    assert parse_instant(text) == instant_of(text) == parse_instant(text.upper()) == instant


def test_a_delivery_stamped_by_an_ewe_phone_is_parsed_time_42() -> None:
    """TIME-42: a delivery whose points an Ewe phone stamped is parsed whole, each point at the
    hour it names (before, it was `partial` or `failed`, the points rejected as unparseable)."""
    stamps = [
        "2024-09-21 \u014bdi ga 7:57:00 +1000",
        "2024-09-21 \u0263etr\u0254 ga 7:57:00 le +1000",
    ]
    points = [{"date": stamp, "qty": n} for n, stamp in enumerate(stamps, start=1)]
    body = {"data": {"metrics": [{"name": "step_count", "units": "count", "data": points}]}}
    projection = MemoryProjection()
    _, outcome = fold(json.dumps(body).encode(), projection, aggregation="minutes")
    assert (outcome.status, outcome.counters.points_new) == ("parsed", 2)
    hours = sorted(key.hour for key in projection.objects)
    assert hours == [hour_of(SEPT_21_0757), hour_of(SEPT_21_1957)]


@pytest.mark.parametrize(
    "text",
    [
        "2024-09-21 7:57:00 le +1000",
        "2024-09-21 7:57:00 pm le +1000",
        "2024-09-21 \uc624\ud6c4 7:57:00 le +1000",
        "2024-09-21 \u014bdi 7:57:00 +1000",
        "2024-09-21 ga 7:57:00 +1000",
        "2024-09-21 \u014bdi ga 7:57:00 le le +1000",
        "2024-09-21 \u014bdi ga 7:57:00 ga +1000",
        "2024-09-21 \u014bdi ga 13:57:00 +1000",
    ],
)
def test_what_ewe_phones_do_not_write_is_refused_time_43(text: str) -> None:
    """TIME-43: `le` after a time without an Ewe marker before it, an Ewe marker without `ga`,
    `ga` alone or twice, `le` twice, or an hour past 12 with an Ewe marker is refused."""
    with pytest.raises(TimestampError):
        parse_instant(text)
    with pytest.raises(TimestampError):
        instant_of(text)


@given(local=LOCAL_TIMES, offset=OFFSETS, togo=st.booleans())
def test_every_ewe_time_equals_the_24_hour_time_time_44(
    local: datetime, offset: int, togo: bool
) -> None:
    """TIME-44: any time in years 1900..2200 at any offset within ±14:00, written as an Ewe
    phone writes it (Togo's `le` or not), is the instant of its 24-hour spelling."""
    zone = offset_text(offset, colon=False)
    instant = parse_instant(f"{local:%Y-%m-%d %H:%M:%S} {zone}")
    text = _ewe(local, zone, togo=togo)
    assert parse_instant(text) == instant_of(text) == instant


@pytest.mark.parametrize(
    "text",
    [
        "2024-09-21 7:57:00 k\u0131 +1000",
        "2024-09-21 7:57:00\u202f\u0131chamthi +1000",
        "2024-09-21 7:57:00 \u0131/m +1000",
        "2024-09-21 pop\u0131et 7:57:00 +1000",
        "2024-09-21 07:57:00 weng\u0131 +1000",
        "2024-09-21 7:57:00 \u0130SUK +1000",
    ],
)
def test_a_marker_spelled_with_a_dotless_i_is_refused_time_40(text: str) -> None:
    """TIME-40: Python's `re` matches the dotless i (U+0131) and the dotted capital I (U+0130)
    where a marker has `i` in any letter case, and case folding keeps the one and makes the
    other `i` and U+0307, so the marker named no row of the table: parsing raised KeyError, and
    a delivery holding one such point failed whole as an internal error. It is refused as
    matching no supported shape, on the fold's path too."""
    with pytest.raises(TimestampError, match="supported date/time shape"):
        parse_instant(text)
    with pytest.raises(TimestampError, match="supported date/time shape"):
        instant_of(text)
    points = [{"date": "2024-09-21 7:56:00 am +1000", "qty": 1}, {"date": text, "qty": 2}]
    body = {"data": {"metrics": [{"name": "step_count", "units": "count", "data": points}]}}
    projection = MemoryProjection()
    _, outcome = fold(json.dumps(body).encode(), projection, aggregation="minutes")
    assert (outcome.status, outcome.counters.points, outcome.counters.points_rejected) == (
        PARTIAL,
        1,
        1,
    )
    assert "unparseable date" in (outcome.reason or "")
    assert [obj.count for obj in projection.objects.values()] == [1]


def test_every_spelling_the_pattern_takes_for_a_marker_is_read_as_it_or_refused_time_41() -> None:
    """TIME-41: every marker of rule 5's table with one letter replaced by any character Python's
    `re` matches for it in any letter case (its other case, the dotless i, the long s, the
    Kelvin sign, the micro sign, ...), after the time and before it, is read as that marker
    reads (the same instant) or refused with TimestampError: nothing else is raised."""
    # Every code point but the surrogates, for Python's `re` to say which it takes for a letter.
    every = "".join(chr(c) for c in range(0x30000) if not 0xD800 <= c < 0xE000)
    variants: dict[str, list[str]] = {}
    tried = refused = 0
    for marker, (first, _, _) in timestamps._MARKERS.items():
        hour = 7 if first == 1 else 0
        for where in (f"2024-09-21 {hour}:57:00 {{}} +1000", f"2024-09-21 {{}} {hour}:57:00 +1000"):
            try:
                expected: int | None = parse_instant(where.format(marker))
            except TimestampError:
                expected = None
            for at, letter in enumerate(marker):
                if letter not in variants:
                    variants[letter] = re.findall(f"(?i){re.escape(letter)}", every)
                for other in variants[letter]:
                    text = where.format(marker[:at] + other + marker[at + 1 :])
                    tried += 1
                    try:
                        instant = parse_instant(text)
                    except TimestampError:
                        refused += 1
                        continue
                    assert instant == expected == instant_of(text), text
    assert tried > 4000
    assert refused > 0
