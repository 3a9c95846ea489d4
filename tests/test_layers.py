"""Layer resolution: header, spacing, inheritance (specs/parsing.md, PARSE-24 to PARSE-32)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from fixtures import MemoryProjection, app_date, fold, make_body

from healthlog import hae, layers
from healthlog.fold import FAILED, NO_LAYER, PARSED, PARTIAL, UNKNOWN_HEADER

START = datetime(2024, 2, 6, 7, 0, tzinfo=timezone(timedelta(hours=-8)))
SECOND = 1_000_000


def series(name: str, stamps: list[str], key: str = "date") -> dict[str, Any]:
    """A metric entry with one point per stamp."""
    data = [{key: stamp, "qty": index + 0.5} for index, stamp in enumerate(stamps)]
    return {"name": name, "units": "count", "data": data}


def spaced(step: timedelta, count: int = 3, start: datetime = START) -> list[str]:
    return [app_date(start + index * step) for index in range(count)]


def body(*entries: dict[str, Any], **sections: Any) -> bytes:
    return json.dumps({"data": {"metrics": list(entries), **sections}}).encode()


def layer_of(
    delivery: bytes, aggregation: str | None = None, inherited: str | None = None
) -> str | None:
    """The layer a fold resolves; every written object must carry it."""
    projection = MemoryProjection(inherited=inherited)
    written, outcome = fold(delivery, projection, aggregation=aggregation)
    assert outcome.status == PARSED
    assert {obj.key.layer for obj in written} == {outcome.layer}
    return outcome.layer


@pytest.mark.parametrize(
    ("header", "layer"),
    [
        ("Minutes", "minutes"),
        (" HOURS ", "hours"),
        ("days", "days"),
        ("Weeks", "weeks"),
        ("months", "months"),
        ("YEARS", "years"),
        ("seconds", "seconds"),
        ("default", "default"),
        ("Default", "default"),
    ],
)
def test_header_wins(header: str, layer: str) -> None:
    """PARSE-24: the aggregation header decides, case-insensitively, whatever the spacing."""
    assert layers.layer_from_header(header) == layer
    assert layer_of(body(series("n", spaced(timedelta(seconds=1)))), aggregation=header) == layer


@pytest.mark.parametrize("header", ["fortnight", "records", "", "minute", "min"])
def test_unknown_header_is_ignored(header: str) -> None:
    """PARSE-25: an unknown header value is ignored; the spacing decides."""
    assert layers.layer_from_header(header) is None
    assert (
        layer_of(body(series("n", spaced(timedelta(minutes=1)))), aggregation=header) == "minutes"
    )


def test_an_unknown_header_is_named_when_no_layer_is_found_parse_25() -> None:
    """PARSE-25: when an unknown header leaves a delivery without a layer, its reason says that
    the header names no layer (it did not come without one)."""
    lone = body(series("vo2_max", spaced(timedelta(days=1), count=1)))
    _, outcome = fold(lone, MemoryProjection(), aggregation="fortnights")
    assert outcome.status == FAILED
    assert outcome.reason == f"{NO_LAYER}; {UNKNOWN_HEADER}"
    _, without = fold(lone, MemoryProjection())
    assert without.reason == NO_LAYER


@pytest.mark.parametrize(
    ("stamps", "layer"),
    [
        (spaced(timedelta(seconds=1)), "seconds"),
        (spaced(timedelta(seconds=60)), "minutes"),
        (spaced(timedelta(hours=1)), "hours"),
        (spaced(timedelta(days=1), start=datetime(2024, 2, 6, tzinfo=UTC)), "days"),
        (spaced(timedelta(weeks=1), start=datetime(2024, 2, 5, tzinfo=UTC)), "weeks"),
        (["2024-01-01 00:00:00 -0800", "2024-02-01 00:00:00 -0800"], "months"),
        (["2024-02-01 00:00:00 -0800", "2024-03-01 00:00:00 -0800"], "months"),
        (["2022-01-01 00:00:00 +0100", "2023-01-01 00:00:00 +0100"], "years"),
        (["2023-01-01", "2024-01-01", "2025-01-01"], "years"),
    ],
    ids=[
        "1 s",
        "60 s",
        "1 h",
        "1 day",
        "1 week",
        "31 days",
        "29 days",
        "1 year",
        "date-only years",
    ],
)
def test_layer_from_spacing(stamps: list[str], layer: str) -> None:
    """PARSE-26: without a header the smallest spacing of the points gives the layer."""
    assert layer_of(body(series("n", stamps))) == layer


@pytest.mark.parametrize(
    ("gap", "layer"),
    [
        (29 * SECOND, "seconds"),
        (30 * SECOND, "minutes"),
        (30 * 60 * SECOND - 1, "minutes"),
        (30 * 60 * SECOND, "hours"),
        (12 * 3600 * SECOND, "days"),
        (4 * 86_400 * SECOND, "weeks"),
        (20 * 86_400 * SECOND, "months"),
        (200 * 86_400 * SECOND, "years"),
        (None, None),
    ],
)
def test_spacing_bounds(gap: int | None, layer: str | None) -> None:
    """PARSE-26: the bounds of the spacing table."""
    assert layers.layer_from_spacing(gap) == layer


def test_smallest_gap_over_all_metrics() -> None:
    """PARSE-26: the smallest gap of any metric decides the layer of the whole delivery."""
    hourly = series("a", spaced(timedelta(hours=1)))
    minutely = series("b", spaced(timedelta(minutes=1)))
    assert layer_of(body(hourly, minutely)) == "minutes"


@pytest.mark.parametrize(
    ("starts", "gap"),
    [
        ([0, 60, 120], 60),
        ([120, 0, 60, 60, 200], 60),
        ([5, 5, 5], None),
        ([7], None),
        ([], None),
    ],
    ids=["in order", "out of order with a repeat", "one instant", "one point", "none"],
)
def test_smallest_spacing_of_starts(starts: list[int], gap: int | None) -> None:
    """PARSE-26: the smallest positive gap between starts, whatever their order."""
    assert layers.smallest_spacing(starts) == gap


def test_start_key_counts_for_spacing() -> None:
    """PARSE-26: hourly points that carry `start` next to `date` are spaced by their start."""
    data = [
        {"date": "2024-02-06 00:00:00 +0000", "start": app_date(START + timedelta(hours=i))}
        for i in range(3)
    ]
    assert layer_of(body({"name": "n", "units": "count", "data": data})) == "hours"


def test_sparse_minute_data() -> None:
    """PARSE-27: gaps of 50 min, 22 min, then 1 min still mean minutes."""
    stamps = [app_date(START + timedelta(minutes=m)) for m in (0, 50, 72, 73)]
    assert layer_of(body(series("step_count", stamps))) == "minutes"


@pytest.mark.parametrize(
    "stamps",
    [
        ["2024-03-09 00:00:00 -0500", "2024-03-10 00:00:00 -0500", "2024-03-11 00:00:00 -0400"],
        ["2024-11-02 00:00:00 -0400", "2024-11-03 00:00:00 -0400", "2024-11-04 00:00:00 -0500"],
        ["2024-03-10 00:00:00 -0500", "2024-03-11 00:00:00 -0400"],
        ["2024-11-03 00:00:00 -0400", "2024-11-04 00:00:00 -0500"],
    ],
    ids=["spring", "autumn", "only the 23 h day", "only the 25 h day"],
)
def test_days_across_dst(stamps: list[str]) -> None:
    """PARSE-28: local midnights across DST changes (23 h and 25 h days) are days."""
    assert layer_of(body(series("step_count", stamps))) == "days"


def test_segments_do_not_count_for_spacing() -> None:
    """PARSE-29: startDate-stamped segments, one minute apart, leave the layer to inheritance."""
    segments = [
        {"startDate": stamp, "endDate": app_date(START + timedelta(hours=2)), "value": "Core"}
        for stamp in spaced(timedelta(minutes=1))
    ]
    sleep = {"name": "sleep_analysis", "units": "hr", "data": segments}
    arrays = [msgspec.Raw(json.dumps(segments).encode())]
    assert hae.read_series(arrays, spacing=True).spacing is None
    # A segment rejected (here for ending before its start) brings no start either.
    ended_early = [
        {**segment, "endDate": app_date(START - timedelta(hours=1))} for segment in segments
    ]
    arrays = [msgspec.Raw(json.dumps(ended_early).encode())]
    assert len(hae.read_series(arrays, spacing=True).rejected) == len(ended_early)
    assert hae.read_series(arrays, spacing=True).spacing is None
    assert layer_of(body(sleep), inherited="days") == "days"


@pytest.mark.parametrize(
    "entries",
    [
        [series("vo2_max", spaced(timedelta(days=1), count=1))],
        [
            series("a", spaced(timedelta(days=1), count=1)),
            series("b", spaced(timedelta(days=2), 1)),
        ],
        [series("a", [app_date(START)] * 2)],
    ],
    ids=["one point", "one point per metric", "one start twice"],
)
def test_inherited_layer(entries: list[dict[str, Any]]) -> None:
    """PARSE-30: no header and no dense metric: the preceding delivery's layer is used."""
    assert layer_of(body(*entries), inherited="hours") == "hours"


def test_layer_not_derivable() -> None:
    """PARSE-31: no header, no dense metric, no history: failed, nothing written."""
    delivery = body(
        series("vo2_max", spaced(timedelta(days=1), count=1)),
        workouts=[{"start": app_date(START), "end": app_date(START + timedelta(hours=1))}],
    )
    projection = MemoryProjection()
    written, outcome = fold(delivery, projection)
    assert outcome.status == FAILED
    assert outcome.reason is not None
    assert "layer not derivable" in outcome.reason
    assert written == []
    assert projection.objects == {}


def test_sections_only_need_no_layer() -> None:
    """PARSE-32: a delivery with only record sections never fails for want of a layer."""
    workouts = [{"start": app_date(START), "end": app_date(START + timedelta(hours=1))}]
    symptoms = [{"start": app_date(START), "name": "Headache"}]
    projection = MemoryProjection()
    written, outcome = fold(body(workouts=workouts, symptoms=symptoms), projection)
    assert outcome.status == PARSED
    assert {obj.key.layer for obj in written} == {"records"}
    assert len(written) == 2


def test_metrics_without_a_readable_point_need_no_layer() -> None:
    """PARSE-32: a metric whose every element is rejected does not make a delivery need a
    layer: its sections are stored, the rejected points counted, the outcome `partial`."""
    workouts = [{"start": app_date(START), "end": app_date(START + timedelta(hours=1))}]
    junk = {"name": "sleep_analysis", "units": "hr", "data": [{}, {"qty": 1}]}
    projection = MemoryProjection()
    written, outcome = fold(body(junk, workouts=workouts), projection)
    assert (outcome.status, outcome.layer) == (PARTIAL, None)
    assert outcome.counters.points_rejected == 2
    assert [(obj.key.metric, obj.key.layer) for obj in written] == [("workouts", "records")]


def test_generated_layers() -> None:
    """PARSE-26: the generator's own spacing gives back the layer it was asked for."""
    for layer, hours in (("seconds", 1), ("minutes", 1), ("hours", 3), ("days", 72)):
        assert layer_of(make_body(11, layer=layer, hours=hours)) == layer
