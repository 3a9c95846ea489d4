"""Envelopes, metric entries, points and record sections, folded (specs/parsing.md)."""

from __future__ import annotations

import copy
import json
import random
import re
import tracemalloc
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest
from _bodies import read_point
from fixtures import MemoryProjection, app_date, fold, make_body, resend
from hypothesis import given, settings
from hypothesis import strategies as st

from healthlog import hae, objects
from healthlog.fold import FAILED, PARSED, PARTIAL
from healthlog.objects import ObjectKey
from healthlog.points import MAX_NESTING, TIMESTAMP_KEYS
from healthlog.timestamps import format_instant, hour_of, parse_instant

D0 = "2024-02-06 07:00:00 -0800"
D1 = "2024-02-06 07:01:00 -0800"
D2 = "2024-02-06 07:02:00 -0800"
GOOD = [{"date": D0, "qty": 1}, {"date": D1, "qty": 2}]


def envelope(*entries: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {"data": {"metrics": list(entries), **sections}}


def metric(data: Any, name: str = "step_count", units: str = "count") -> dict[str, Any]:
    return {"name": name, "units": units, "data": data}


def encoded(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


def compact(point: dict[str, Any]) -> bytes:
    return json.dumps(point, ensure_ascii=False, separators=(",", ":")).encode()


def stored(projection: MemoryProjection) -> dict[tuple[str, str], dict[tuple[int, int], bytes]]:
    """Every stored point by metric and layer."""
    out: dict[tuple[str, str], dict[tuple[int, int], bytes]] = {}
    for key, obj in projection.objects.items():
        out.setdefault((key.metric, key.layer), {}).update(objects.decode(obj.body))
    return out


def hashes(projection: MemoryProjection) -> dict[ObjectKey, bytes]:
    return {key: obj.hash for key, obj in projection.objects.items()}


def folded(body: bytes, **kwargs: Any) -> tuple[MemoryProjection, Any]:
    projection = MemoryProjection()
    _, outcome = fold(body, projection, **kwargs)
    return projection, outcome


def test_app_envelope() -> None:
    """PARSE-1: every point of the app's envelope is stored under its metric, verbatim."""
    body = make_body(1, hours=1)
    projection, outcome = folded(body)
    assert outcome.status == PARSED
    assert outcome.reason is None
    assert outcome.counters.metrics == 2
    assert outcome.counters.points == outcome.counters.points_new == 120
    points = stored(projection)
    for entry in json.loads(body)["data"]["metrics"]:
        raws = points[(entry["name"], "minutes")]
        assert sorted(raws.values()) == sorted(compact(p) for p in entry["data"])
    assert {obj.units for obj in projection.objects.values()} == {"count/min", "count"}


def test_sections_beside_data() -> None:
    """PARSE-35: a section next to `data` at the top level is folded with it."""
    workout = {
        "name": "Walk",
        "start": "2024-02-06 07:00:00 -0800",
        "end": "2024-02-06 07:30:00 -0800",
    }
    metrics_only = make_body(1, hours=1)
    body = {**json.loads(metrics_only), "workouts": [workout]}
    projection, outcome = folded(encoded(body))
    assert outcome.status == PARSED
    assert outcome.counters.sections == 1
    assert list(stored(projection)[("workouts", "records")].values()) == [compact(workout)]
    expected, alone = folded(metrics_only)
    assert outcome.counters.metrics == alone.counters.metrics == 2
    metrics = {k: h for k, h in hashes(projection).items() if k.layer != "records"}
    assert metrics == hashes(expected)


def test_no_data_wrapper() -> None:
    """PARSE-2: the inner object alone folds like the wrapped body."""
    body = make_body(2, hours=2)
    inner = json.loads(body)["data"]
    inner["workouts"] = []
    wrapped, _ = folded(body)
    bare, outcome = folded(encoded(inner))
    assert outcome.status == PARSED
    assert hashes(bare) == hashes(wrapped)


def test_array_wrapped_bodies() -> None:
    """PARSE-3: `[{"data":...}]`, `{"data":[...]}` and split envelopes fold alike."""
    body = make_body(3, hours=1)
    whole = json.loads(body)
    heart, steps = whole["data"]["metrics"]
    expected, _ = folded(body)
    for variant in (
        [whole],
        {"data": [whole["data"]]},
        [envelope(heart), envelope(steps)],
        [{"data": {"metrics": [heart]}}, {"metrics": [steps]}],
    ):
        projection, outcome = folded(encoded(variant))
        assert outcome.status == PARSED
        assert hashes(projection) == hashes(expected)


def test_a_list_of_envelopes_in_data_is_read_at_any_wrapping_parse_3() -> None:
    """PARSE-3: ``data`` holding a list of envelopes is read inside an array-wrapped body too,
    as it is at the top; envelopes in envelopes MAX_ENVELOPE_DEPTH deep are read, deeper ones
    are one rejected entry each, not an error."""
    sections = {"metrics": [metric(GOOD)]}
    plain, expected = folded(encoded(envelope(metric(GOOD))))
    for variant in ([{"data": [sections]}], {"data": [{"data": [sections]}]}):
        projection, outcome = folded(encoded(variant))
        assert outcome.status == PARSED
        assert outcome.counters.points == expected.counters.points == 2
        assert hashes(projection) == hashes(plain)
    deepest, expected = folded(encoded(wrapped_in_data(sections, hae.MAX_ENVELOPE_DEPTH - 1)))
    assert (expected.status, expected.counters.points) == (PARSED, 2)
    assert hashes(deepest) == hashes(plain)
    for times in (hae.MAX_ENVELOPE_DEPTH, hae.MAX_ENVELOPE_DEPTH + 1):
        deep = wrapped_in_data(sections, times)
        _, outcome = folded(encoded([deep, envelope(metric(GOOD))]))
        assert outcome.status == PARTIAL
        assert outcome.counters.entries_rejected == 1
        assert "envelope nested too deep" in (outcome.reason or "")


def wrapped_in_data(sections: dict[str, Any], times: int) -> dict[str, Any]:
    """``sections`` as the one envelope of a ``data`` list, ``times`` times over: with the
    sections object itself, ``times + 1`` envelopes deep."""
    deep = sections
    for _ in range(times):
        deep = {"data": [deep]}
    return deep


def test_array_wrapped_bad_elements() -> None:
    """PARSE-3: an element that is not an object, or a nested array, is a rejected entry."""
    body = [envelope(metric(GOOD)), 3, "x", [envelope(metric(GOOD))]]
    projection, outcome = folded(encoded(body))
    assert outcome.status == PARTIAL
    assert outcome.counters.entries_rejected == 3
    assert len(stored(projection)[("step_count", "minutes")]) == 2


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b"[]",
        b'{"data":{}}',
        b'{"data":[]}',
        b'{"data":{"metrics":[]}}',
        b'{"data":{"metrics":[],"workouts":[],"symptoms":[]}}',
        b'[{"data":{}},{}]',
    ],
)
def test_empty_envelopes(body: bytes) -> None:
    """PARSE-4: empty envelopes are parsed, write nothing and need no layer."""
    projection, outcome = folded(body)
    assert (outcome.status, outcome.reason, outcome.layer) == (PARSED, None, None)
    assert projection.objects == {}


@pytest.mark.parametrize(
    ("body", "aggregation"),
    [
        (envelope(metric([])), None),
        (envelope(metric([])), "minutes"),
        (envelope({"name": "step_count", "units": "count"}), None),
        (envelope(metric([]), workouts=[{"start": D0, "end": D2, "name": "Walk"}]), None),
    ],
    ids=["empty data", "empty data with header", "no data key", "beside a section"],
)
def test_empty_metric(body: dict[str, Any], aggregation: str | None) -> None:
    """PARSE-5: a metric without points is an empty metric, not an error."""
    projection, outcome = folded(encoded(body), aggregation=aggregation)
    assert (outcome.status, outcome.reason, outcome.layer) == (PARSED, None, None)
    assert outcome.counters.points == len(body["data"].get("workouts", []))
    assert len(projection.objects) == outcome.counters.points


def test_unknown_sections() -> None:
    """PARSE-6: unknown sections are counted, not an error."""
    body = envelope(metric(GOOD), foo=[{"date": D0}], bar={"x": 1})
    projection, outcome = folded(encoded(body))
    assert outcome.status == PARSED
    assert outcome.counters.unknown_sections == 2
    assert outcome.reason is None
    assert len(stored(projection)[("step_count", "minutes")]) == 2


@pytest.mark.parametrize(
    "body",
    [
        b'"x"',
        b"3",
        b"null",
        b"true",
        b"",
        b"   ",
        make_body(4)[:-7],
        b'{"data":{"metrics":[{"name":"a","data":[{"date":"%s","qty":NaN}]}]}}' % D0.encode(),
        b'{"data":{"metrics":[{"name":"a","data":[{"date":"%s","qty":Infinity}]}]}}' % D0.encode(),
        b'{"data":{"metrics":[{"name":"a","data":[{"date":"%s","source":"\\ud800"}]}]}}'
        % D0.encode(),
        b"\xff\xfe{}",
    ],
    ids=[
        "string",
        "number",
        "null",
        "bool",
        "empty",
        "blank",
        "truncated",
        "NaN",
        "Infinity",
        "lone surrogate",
        "UTF-16 BOM",
    ],
)
def test_undecodable_bodies(body: bytes) -> None:
    """PARSE-7: a body that is not a JSON object or array fails and writes nothing."""
    projection, outcome = folded(body, aggregation="minutes")
    assert outcome.status == FAILED
    assert outcome.reason is not None
    assert outcome.reason.startswith("undecodable body")
    assert projection.objects == {}


def test_byte_order_mark() -> None:
    """PARSE-8: a UTF-8 BOM in front of the body is ignored."""
    body = make_body(5)
    plain, _ = folded(body)
    marked, outcome = folded(b"\xef\xbb\xbf" + body)
    assert outcome.status == PARSED
    assert hashes(marked) == hashes(plain)


@pytest.mark.parametrize(
    "broken",
    [
        {"metrics": [metric(GOOD), {"units": "count", "data": GOOD}]},
        {"metrics": [metric(GOOD), {"name": "", "data": GOOD}]},
        {"metrics": [metric(GOOD), {"name": 7, "data": GOOD}]},
        {"metrics": [metric(GOOD), {"name": None, "data": GOOD}]},
        {"metrics": [metric(GOOD), metric(GOOD, name="step_count\u0000x")]},
        {"metrics": [metric(GOOD), metric({"date": D0}, name="heart_rate")]},
        {"metrics": [metric(GOOD), metric("none", name="heart_rate")]},
        {"metrics": [metric(GOOD), "heart_rate"]},
        {"metrics": [metric(GOOD), ["heart_rate"]]},
        {"metrics": [metric(GOOD)], "workouts": {"start": D0}},
        {"metrics": [metric(GOOD)], "symptoms": "none"},
    ],
    ids=[
        "no name",
        "empty name",
        "numeric name",
        "null name",
        "name with U+0000",
        "data an object",
        "data a string",
        "entry a string",
        "entry an array",
        "workouts an object",
        "symptoms a string",
    ],
)
def test_broken_entries_beside_good_ones(broken: dict[str, Any]) -> None:
    """PARSE-9: a broken entry is rejected and counted; the good metric is stored."""
    projection, outcome = folded(encoded({"data": broken}))
    assert outcome.status == PARTIAL
    assert outcome.counters.entries_rejected == 1
    assert outcome.counters.points == 2
    assert list(stored(projection)) == [("step_count", "minutes")]


def test_metrics_not_an_array() -> None:
    """PARSE-9: a `metrics` value that is not an array is a rejected entry beside good records."""
    body = {"data": {"metrics": {"name": "x"}, "workouts": [{"start": D0, "end": D1}]}}
    projection, outcome = folded(encoded(body))
    assert outcome.status == PARTIAL
    assert outcome.counters.entries_rejected == 1
    assert list(stored(projection)) == [("workouts", "records")]


@pytest.mark.parametrize(
    "body",
    [
        {"data": {"metrics": [{"units": "count", "data": GOOD}]}},
        {"data": "metrics"},
        {"data": {"metrics": "none"}},
        [1, 2],
        {"data": {"metrics": [metric([{"date": "soon", "qty": 1}, {"qty": 2}, 3])]}},
    ],
    ids=["nameless metric", "data a string", "metrics a string", "array of numbers", "bad points"],
)
def test_nothing_readable(body: Any) -> None:
    """PARSE-10: when everything is rejected the delivery fails and writes nothing."""
    projection, outcome = folded(encoded(body), aggregation="minutes")
    assert outcome.status == FAILED
    assert outcome.reason is not None
    assert outcome.reason.startswith("nothing could be read")
    assert projection.objects == {}


def test_point_shapes() -> None:
    """PARSE-11: every point shape is stored verbatim, as an instant at its date."""
    shapes = {
        "step_count": {"date": D0, "qty": 46, "source": "Anna\u2019s iPhone"},
        "heart_rate": {"date": D0, "Min": 48.4, "Avg": 76.04408808920257, "Max": 133},
        "blood_pressure": {"systolic": 121, "date": D0, "diastolic": 79},
        "sexual_activity": {"date": D0, "Unspecified": 0, "Protection Used": 1},
        "blood_glucose": {"date": D0, "qty": 5.4, "mealTime": "Before Meal"},
    }
    body = envelope(*(metric([p], name=n) for n, p in shapes.items()))
    projection, outcome = folded(encoded(body), aggregation="minutes")
    assert outcome.status == PARSED
    instant = parse_instant(D0)
    points = stored(projection)
    for name, point in shapes.items():
        assert points[(name, "minutes")] == {(instant, instant): compact(point)}


def test_pretty_printed_points_are_compacted() -> None:
    """PARSE-11: whitespace between tokens goes; the rest of the point stays as written."""
    body = (
        b'{\n  "data" : {\n    "metrics" : [ {\n      "data" : [ {\n        "qty" : 34 ,\n'
        b'        "date" : "2021-03-14 00:01:00 +0000"\n      } ],\n'
        b'      "name" : "step_count",\n      "units" : "count"\n    } ]\n  }\n}\n'
    )
    projection, _ = folded(body, aggregation="minutes")
    [raw] = stored(projection)[("step_count", "minutes")].values()
    assert raw == b'{"qty":34,"date":"2021-03-14 00:01:00 +0000"}'


def many_points(count: int) -> list[dict[str, Any]]:
    """Minute points over many hours: a metric array larger than one compaction check slice."""
    start = datetime(2024, 2, 6, 7, 0, tzinfo=timezone(timedelta(hours=-8)))
    return [
        {"date": app_date(start + timedelta(minutes=n)), "qty": n, "source": "Watch"}
        for n in range(count)
    ]


def array_body(data: bytes) -> bytes:
    return b'{"data":{"metrics":[{"name":"n","units":"count","data":%s}]}}' % data


@pytest.mark.parametrize(
    "variant",
    [
        "one pretty point far in",
        "spaces between points",
        "out of order",
        "out of order, one rejected",
    ],
)
def test_whitespace_and_order_anywhere_in_a_large_array(variant: str) -> None:
    """PARSE-34: a large array compact but for one point far in, or spaced between its points,
    or out of order with a rejected point among its points, stores the same compact objects."""
    points = many_points(6000)
    reference, outcome = folded(
        array_body(b"[%s]" % b",".join(map(compact, points))), aggregation="minutes"
    )
    assert outcome.status == PARSED
    if variant == "one pretty point far in":
        raws = [compact(p) for p in points]
        raws[-3] = json.dumps(points[-3], indent=1).encode()
        data = b"[%s]" % b",".join(raws)
    elif variant == "spaces between points":
        data = b"[ %s ]" % b" , ".join(map(compact, points))
    elif variant == "out of order":
        data = b"[%s]" % b",".join(map(compact, [*points[3000:], *points[:3000]]))
    else:
        shuffled = [*points[3000:], {"qty": 1}, *points[:3000]]
        data = b"[%s]" % b",".join(map(compact, shuffled))
    projection, outcome = folded(array_body(data), aggregation="minutes")
    assert hashes(projection) == hashes(reference)
    assert outcome.counters.points_rejected == (1 if variant.endswith("rejected") else 0)
    assert outcome.counters.points_new == len(points)


_POINT_BYTES = [
    b'{"date":"%s","qty":1}' % D0.encode(),
    b'{"qty":2.5,"date":"%s","source":"A|B"}' % D1.encode(),
    b'{"date":"%s","qty":3}' % D0.encode(),
    b'{"date":"2024-02-06T15:03:00Z","qty":4}',
    b'{"date":"2024-02-06","qty":5}',
    b'{"date":"yesterday","qty":6}',
    b'{"date":12,"qty":7}',
    b'{"date":null}',
    b'{"qty":8}',
    b'{"start":"%s","end":"%s","qty":9}' % (D0.encode(), D2.encode()),
    b'{"startDate":"%s","endDate":"%s","value":"Core"}' % (D1.encode(), D2.encode()),
    b'{"date":"%s","end":"%s"}' % (D2.encode(), D0.encode()),
    b'{"date":"%s","qty":1E400}' % D2.encode(),
    b'{"date":"%s","source":"Anna\xff Watch"}' % D2.encode(),
    b'{"date":"%s","note":"{[x]}"}' % D1.encode(),
    b'{"date":"%s","meta":{"a":[1]}}' % D0.encode(),
    b'{"date":"%s","meta":{"a":1}}' % D1.encode(),
    b'{"date":"%s","date":"%s"}' % (D0.encode(), D2.encode()),
    b'{"date":"%s","meta":%s1%s}' % (D1.encode(), b"[" * 63, b"]" * 63),
    b'{"date":"%s","meta":%s1%s}' % (D2.encode(), b"[" * 64, b"]" * 64),
    b'"{"',
    b"7",
    b"[]",
]


@given(st.lists(st.sampled_from(_POINT_BYTES), max_size=12))
@settings(max_examples=300)
def test_flat_reading_agrees_with_point_by_point(raws: list[bytes]) -> None:
    """PARSE-36: a compact array read a slice at a time (its points decoded together when
    they nest no deeper than points may) gives exactly what reading each point on its own
    gives."""
    assert_read_alike(raws)


def test_deep_object_among_values_that_are_not_objects_parse_36() -> None:
    """PARSE-36: a slice holding one brace per element and no bracket but its own looks flat,
    but its braces may all be one point's, nested deeper than points may, beside values
    that are not objects: that point is rejected for its depth, as on its own."""
    deep = b'{"date":"%s","m":%s1%s}' % (D0.encode(), b'{"a":' * 64, b"}" * 64)
    assert deep.count(b"{") == 65
    raws = [b"7"] * 32 + [deep] + [b'"x"'] * 32
    assert_read_alike(raws)
    series = hae.read_series([msgspec.Raw(b"[%s]" % b",".join(raws))], spacing=False)
    assert series.rejections == {
        "point is a JSON int, not an object": 32,
        "point is a JSON str, not an object": 32,
        f"point nested deeper than {MAX_NESTING} levels": 1,
    }


def assert_read_alike(raws: list[bytes]) -> None:
    """The points of ``raws`` read from a compact array as from a spaced one (point by point)."""
    fast = b"[%s]" % b",".join(raws)
    slow = b"[ %s]" % b",".join(raws)
    for spacing in (False, True):
        read = [hae.read_series([msgspec.Raw(data)], spacing=spacing) for data in (fast, slow)]
        assert isinstance(read[0].sources[0], msgspec.Raw)
        assert isinstance(read[1].sources[0], list)
        for attribute in ("starts", "ends", "rejected", "rejections", "spacing"):
            assert getattr(read[0], attribute) == getattr(read[1], attribute)
        assert list(read[0].hours()) == list(read[1].hours())


def dense_body(element: bytes, count: int) -> bytes:
    """A body whose one metric array holds ``element`` ``count`` times."""
    return encoded(envelope(metric([0]))).replace(b"[0]", b"[%s]" % b",".join([element] * count))


def folded_traced(body: bytes) -> tuple[MemoryProjection, Any, int]:
    """:func:`folded` under ``minutes``, and the peak of the memory it traced."""
    tracemalloc.start()
    try:
        projection, outcome = folded(body, aggregation="minutes")
        return projection, outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# Elements that cannot be points, and the most a fold of 20,000 of them may trace, as a multiple
# of the body (each rejection kept its own reason: 106 and 21 times).
DENSE_REJECTIONS = [(b"7", 60), (b'{"date":"x"}', 15)]


@pytest.mark.parametrize(("element", "most"), DENSE_REJECTIONS, ids=["ints", "bad dates"])
def test_rejections_cost_an_index_each_parse_38(element: bytes, most: int) -> None:
    """PARSE-38: a metric of nothing but elements that cannot be points fails with one reason
    counted for all of them, in memory a small multiple of the body: a rejected point keeps its
    index, not a reason of its own."""
    count = 20_000
    body = dense_body(element, count)
    projection, outcome, peak = folded_traced(body)
    assert outcome.status == FAILED
    assert outcome.counters.points_rejected == count
    assert outcome.reason.startswith("nothing could be read; point rejected: ")
    assert outcome.reason.endswith(f" (x{count})")
    assert stored(projection) == {}
    assert peak <= most * len(body), peak / len(body)


@pytest.mark.parametrize(
    "element", [b"7", b"123456", b'"abcd"', b"[[[[]]]]"], ids=["1", "6", "str", "nested arrays"]
)
def test_body_too_dense_is_failed_whole_parse_39(element: bytes) -> None:
    """PARSE-39: a body over 1 MiB holding more than one JSON value per 8 bytes is failed as
    undecodable without reading an element, in memory less than twice the body (the fold's
    copy of it): 38 times before."""
    body = dense_body(element, 2 * 2**20 // (len(element) + 1))
    projection, outcome, peak = folded_traced(body)
    assert outcome.status == FAILED
    assert outcome.reason == "undecodable body: body holds more than one JSON value per 8 bytes"
    assert outcome.counters.points_rejected == 0
    assert stored(projection) == {}
    assert peak < 2 * len(body), peak / len(body)


@pytest.mark.parametrize(
    ("element", "size"),
    [(b"12345678", 2 * 2**20), (b"7", 2**20)],
    ids=["8 bytes a value", "1 MiB"],
)
def test_bodies_not_too_dense_are_read_parse_39(element: bytes, size: int) -> None:
    """PARSE-39: one value per 8 bytes, or a dense body of 1 MiB or less, is read element by
    element; the body is padded with trailing spaces to exactly ``size`` bytes."""
    count = (size - len(dense_body(element, 0)) + 1) // (len(element) + 1)
    body = dense_body(element, count)
    body += b" " * (size - len(body))
    assert len(body) == size
    _, outcome = folded(body, aggregation="minutes")
    assert outcome.status == FAILED
    assert (
        outcome.reason
        == f"nothing could be read; point rejected: point is a JSON int, not an object (x{count})"
    )
    assert outcome.counters.points_rejected == count


def test_sleep_segments_sharing_a_start() -> None:
    """PARSE-12: two segments with the same startDate and different endDate are two points."""
    segments = [
        {"startDate": D0, "endDate": "2024-02-06 08:00:00 -0800", "value": "Core", "qty": 1},
        {"startDate": D0, "endDate": "2024-02-06 07:30:00 -0800", "value": "Deep", "qty": 0.5},
    ]
    body = envelope(metric(segments, name="sleep_analysis", units="hr"))
    projection, outcome = folded(encoded(body), aggregation="days")
    assert outcome.counters.points_new == 2
    points = stored(projection)[("sleep_analysis", "days")]
    start = parse_instant(D0)
    assert sorted(points) == [
        (start, parse_instant("2024-02-06 07:30:00 -0800")),
        (start, parse_instant("2024-02-06 08:00:00 -0800")),
    ]


def test_coordinates_in_a_fold() -> None:
    """PARSE-13: start/end win over date, date alone is an instant, sleepStart does not count."""
    hourly = {"date": D0, "start": D1, "end": "2024-02-06 08:00:00 -0800", "qty": 3}
    sleep = {"date": D0, "sleepStart": "2024-02-05 22:00:00 -0800", "totalSleep": 6.4}
    body = envelope(metric([hourly], name="step_count"), metric([sleep], name="sleep_analysis"))
    projection, _ = folded(encoded(body), aggregation="hours")
    points = stored(projection)
    assert list(points[("step_count", "hours")]) == [
        (parse_instant(D1), parse_instant("2024-02-06 08:00:00 -0800"))
    ]
    assert list(points[("sleep_analysis", "hours")]) == [(parse_instant(D0), parse_instant(D0))]


@pytest.mark.parametrize(
    "bad",
    [
        {"start": "2024-02-06 25:00:00 -0800", "date": D2, "qty": 3},
        {"start": None, "date": D2, "qty": 3},
        {"startDate": "", "date": D2, "qty": 3},
    ],
    ids=["start impossible", "start null", "startDate empty"],
)
def test_no_fallback_in_a_fold(bad: dict[str, Any]) -> None:
    """PARSE-14: the point whose first start key does not parse is rejected, the rest stored."""
    projection, outcome = folded(encoded(envelope(metric([*GOOD, bad]))), aggregation="minutes")
    assert outcome.status == PARTIAL
    assert (outcome.counters.points, outcome.counters.points_rejected) == (2, 1)
    assert len(stored(projection)[("step_count", "minutes")]) == 2


@pytest.mark.parametrize(
    "bad",
    [
        3,
        "2024-02-06 07:02:00 -0800",
        [D2],
        None,
        {"date": 1707231720, "qty": 3},
        {"qty": 3},
        {},
        {"start": D2, "end": D0},
    ],
    ids=["number", "string", "array", "null", "date a number", "no start", "empty", "end first"],
)
def test_not_a_point_in_a_fold(bad: Any) -> None:
    """PARSE-15: a point that is no point is rejected and counted; the good ones are stored."""
    projection, outcome = folded(encoded(envelope(metric([*GOOD, bad]))), aggregation="minutes")
    assert outcome.status == PARTIAL
    assert outcome.counters.points_rejected == 1
    assert len(stored(projection)[("step_count", "minutes")]) == 2


def test_qty_as_string_in_a_fold() -> None:
    """PARSE-16: a string quantity is stored as it came."""
    point = {"date": D2, "qty": "12", "source": ""}
    projection, outcome = folded(encoded(envelope(metric([*GOOD, point]))))
    assert outcome.status == PARSED
    assert compact(point) in stored(projection)[("step_count", "minutes")].values()


def test_numbers_verbatim() -> None:
    """PARSE-17: number spellings survive byte for byte; 2**70 keeps its digits."""
    raw = b'{"date":"%s","qty":%d,"f":1E5,"g":46.00000000000001,"h":-0.0}' % (D2.encode(), 2**70)
    body = b'{"data":{"metrics":[{"name":"n","data":[%s]}]}}' % raw
    projection, outcome = folded(body, aggregation="minutes")
    assert outcome.status == PARSED
    [stored_raw] = stored(projection)[("n", "minutes")].values()
    assert stored_raw == raw
    assert b"1180591620717411303424" in read_point(stored_raw).canonical


def nested_body(depth: int) -> bytes:
    """Two good points and one nested ``depth`` levels (its own object is level 1)."""
    deep = b'{"date":"%s","x":%s%s}' % (D2.encode(), b"[" * (depth - 1), b"]" * (depth - 1))
    good = b",".join(compact(p) for p in GOOD)
    return b'{"data":{"metrics":[{"name":"n","data":[%s,%s]}]}}' % (good, deep)


@pytest.mark.parametrize("depth", [65, 500, 10_000])
def test_deep_nesting(depth: int) -> None:
    """PARSE-18: a point nested deeper than 64 levels is rejected (500), or, nested beyond what
    the body decoder takes (10,000), fails the delivery; never an exception."""
    projection, outcome = folded(nested_body(depth), aggregation="minutes")
    if depth > 1000:
        assert outcome.status == FAILED
        assert projection.objects == {}
    else:
        assert outcome.status == PARTIAL
        assert outcome.counters.points_rejected == 1
        assert (
            outcome.reason == f"point rejected: point nested deeper than {MAX_NESTING} levels (x1)"
        )
        assert len(stored(projection)[("n", "minutes")]) == 2


def folded_from_deeper(body: bytes, frames: int) -> tuple[MemoryProjection, Any]:
    """:func:`folded`, called ``frames`` Python frames deeper."""
    if frames:
        return folded_from_deeper(body, frames - 1)
    return folded(body, aggregation="minutes")


@pytest.mark.parametrize("depth", [MAX_NESTING, MAX_NESTING + 1, 300])
def test_nesting_decides_the_same_on_any_stack_parse_37(depth: int) -> None:
    """PARSE-37: a point nested up to 64 levels is taken, a deeper one rejected, the same when
    the fold runs 300 frames deeper (as a worker thread's fold does, against a rebuild's)."""
    outcomes = set()
    for frames in (0, 300):
        projection, outcome = folded_from_deeper(nested_body(depth), frames)
        outcomes.add(
            (
                outcome.status,
                outcome.counters.points_rejected,
                len(stored(projection)["n", "minutes"]),
            )
        )
    assert outcomes == {(PARSED, 0, 3) if depth <= MAX_NESTING else (PARTIAL, 1, 2)}


@pytest.mark.parametrize("depth", [500, 800])
def test_whether_a_body_is_read_does_not_depend_on_the_stack_parse_40(depth: int) -> None:
    """PARSE-40: a body nested deeper than MAX_BODY_NESTING is undecodable on any stack; one
    nested less deep is read, its deep point rejected, on any stack. Before, whether it was read
    hung on how much of the recursion limit the decoder had left: a point nested 800 levels
    deep was rejected on the test's stack and failed the whole delivery 300 frames deeper."""
    outcomes = set()
    for frames in (0, 300):
        projection, outcome = folded_from_deeper(nested_body(depth), frames)
        outcomes.add((outcome.status, outcome.reason, len(projection.objects)))
    if depth + 4 <= hae.MAX_BODY_NESTING:
        reason = f"point rejected: point nested deeper than {MAX_NESTING} levels (x1)"
        assert outcomes == {(PARTIAL, reason, 1)}
    else:
        reason = f"undecodable body: body nests deeper than {hae.MAX_BODY_NESTING} levels"
        assert outcomes == {(FAILED, reason, 0)}


def test_invalid_utf8_in_a_point() -> None:
    """PARSE-19: a point with invalid UTF-8 is rejected, its neighbours stored."""
    bad = b'{"date":"%s","source":"Anna\xff\xfe Watch","qty":3}' % D2.encode()
    good = b",".join(compact(p) for p in GOOD)
    body = b'{"data":{"metrics":[{"name":"n","data":[%s,%s]}]}}' % (good, bad)
    projection, outcome = folded(body, aggregation="minutes")
    assert outcome.status == PARTIAL
    assert outcome.counters.points_rejected == 1
    assert b"\xff" not in b"".join(stored(projection)[("n", "minutes")].values())


def test_strings_verbatim() -> None:
    """PARSE-20: `&<>`, escapes and non-ASCII text are stored byte-identical."""
    raw = (
        b'{"date":"%s","qty":1,"note":"a&b <i>x</i> \\u0026 \\/ \\"q\\"",'
        b'"source":"Anna\xe2\x80\x99s Apple\xc2\xa0Watch \xf0\x9f\x92\x96"}' % D2.encode()
    )
    body = b'{"data":{"metrics":[{"name":"n","data":[%s]}]}}' % raw
    projection, _ = folded(body, aggregation="minutes")
    [obj] = projection.objects.values()
    assert list(objects.decode(obj.body).values()) == [raw]


RECORDS: dict[str, list[dict[str, Any]]] = {
    "workouts": [
        {
            "name": "Walking",
            "start": "2023-05-14 18:12:05 -0500",
            "end": "2023-05-14 18:40:55 -0500",
            "distance": {"qty": 0.59, "units": "mi"},
            "heartRateRecovery": [{"date": "2023-05-14 18:30:01 -0500", "qty": 74}],
        },
        {
            "id": "0F6E2C1A-0000-4000-8000-00000000C0DE",
            "name": "Hiking",
            "start": "2024-02-06 06:45:00 -0700",
            "end": "2024-02-06 08:05:30 -0700",
            "source": {"identifier": "org.test.fixture", "name": "Fixture"},
            "route": [
                {
                    "latitude": 47.0101,
                    "longitude": 8.3045,
                    "timestamp": "2024-02-06 07:00 -0700",
                },
                {
                    "latitude": 47.0104,
                    "longitude": 8.3049,
                    "timestamp": "2024-02-06 07:01 -0700",
                },
            ],
            "heartRateData": [{"date": "2024-02-06 07:00:00 -0700", "Avg": 119.8, "units": "bpm"}],
        },
    ],
    "symptoms": [{"name": "Headache", "severity": "Mild", "start": D0, "end": D2}],
    "ecg": [{"classification": "Sinus Rhythm", "start": D0, "end": D1, "voltageMeasurements": []}],
    "stateOfMind": [{"id": "s1", "kind": "momentaryEmotion", "valence": 0.4, "start": D0}],
    "medications": [{"displayText": "Ibuprofen", "start": D0, "end": D0, "dosage": 1}],
    "cycleTracking": [{"date": "2024-02-06", "flow": "medium"}],
    "heartRateNotifications": [{"start": D0, "end": D2, "threshold": 120}],
}


def test_record_sections() -> None:
    """PARSE-21: every record section becomes a pseudo-metric in layer `records`, units null."""
    body = encoded({"data": {"metrics": [], **RECORDS}})
    projection, outcome = folded(body)
    assert outcome.status == PARSED
    assert outcome.counters.sections == len(RECORDS)
    assert outcome.layer is None
    points = stored(projection)
    assert set(points) == {(name, "records") for name in RECORDS}
    for name, records in RECORDS.items():
        expected = {}
        for record in records:
            start = parse_instant(record.get("start", record.get("date")))
            end = parse_instant(record.get("end", record.get("start", record.get("date"))))
            expected[(start, end)] = compact(record)
        assert points[(name, "records")] == expected
    for key, obj in projection.objects.items():
        assert obj.units is None
        assert key.hour == hour_of(obj.first)


def test_record_without_parseable_start() -> None:
    """PARSE-22: a record without a parseable start is rejected, the others stored."""
    workouts = [
        RECORDS["workouts"][0],
        {"name": "Run", "end": D2},
        {"name": "Swim", "start": "later", "end": D2},
    ]
    projection, outcome = folded(encoded({"workouts": workouts}))
    assert outcome.status == PARTIAL
    assert (outcome.counters.points, outcome.counters.points_rejected) == (1, 2)
    assert len(stored(projection)[("workouts", "records")]) == 1


def test_same_instant_other_offset() -> None:
    """PARSE-23: a re-send in another UTC offset lands on the same coordinates."""
    body = make_body(6, hours=2, metrics=("heart_rate", "sleep_analysis"))
    projection = MemoryProjection()
    fold(body, projection, aggregation="minutes")
    before = hashes(projection)
    for offset_hours in (0, 5.5, -3):
        again = resend(body, 7, offset=timedelta(hours=offset_hours))
        written, outcome = fold(again, projection, delivery_id=2, aggregation="minutes")
        assert written == []
        assert outcome.counters.points_unchanged == outcome.counters.points
    assert hashes(projection) == before


def test_reasons_keep_values_private() -> None:
    """PARSE-33: the reason counts kinds of rejection and quotes nothing from the body."""
    secrets = ["2031-13-45 99:99:99 +9999", "Secret Watch 4711", "987.654"]
    points = [
        *GOOD,
        {"date": secrets[0], "qty": 987.654, "source": secrets[1]},
        {"date": secrets[0], "qty": 987.654},
        {"start": D0, "end": secrets[0]},
        987.654,
    ]
    body = envelope(metric(points), {"name": secrets[1], "data": secrets[1]})
    spaced = encoded(body)
    # The app's bodies are compact, and their points are read a slice at a time (PARSE-36).
    tight = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    for data in (spaced, tight):
        _, outcome = folded(data, aggregation="minutes")
        assert outcome.status == PARTIAL
        assert outcome.counters.points_rejected == 4
        assert outcome.counters.entries_rejected == 1
        assert outcome.reason is not None
        assert "(x2)" in outcome.reason
        for secret in secrets:
            assert secret not in outcome.reason


# Values a field of a point may be swapped for: every JSON type, numbers at the edges of a
# double, integers past 64 bits, and timestamps in every accepted shape and some refused ones.
EDGE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -0.0,
    1e308,
    -1e308,
    5e-324,
    12345678901234567890,
    -123456789012345678901,
    "",
    "x",
    [],
    {},
    [1, "a", None],
    {"qty": 1, "units": "count"},
    "2024-02-29 23:59:59 +1400",
    "2024-12-31 23:59:59 -1200",
    "2025-01-01T00:00:00.000001Z",
    "2024-03-10 02:30:00 -0800",
    "2024-11-03 01:30:00 -0700",
    "2024-11-03 01:30:00 -0800",
    "2567-02-29 07:00:00 +0700",
    "2024-09-21 7:57:00\u202fpm +1000",
    "2024-09-21 \u5348\u524d0:05:00 +0900",
    "\u0662\u0660\u0662\u0664-\u0660\u0662-\u0660\u0666"
    " \u0660\u0667:\u0660\u0660:\u0660\u0660 -0800",
    "2024-09-21 7:57:00 k\u0131 +1000",
    "2024-02-06",
    "1899-12-31 23:00:00 +0000",
    "3000-01-01 00:00:00 +0000",
    "2024-02-30 07:00:00 -0800",
]


def _mutated(document: Any, rng: random.Random, edits: int) -> Any:
    """``document`` with ``edits`` random edits, half of them at a timestamp: a value swapped for
    one of ``EDGE_VALUES``, a field or element removed, an element doubled, an object's keys or
    an array reordered."""
    document = copy.deepcopy(document)
    for _ in range(edits):
        places = list(_places(document, ()))
        if not places:
            break
        stamps = [place for place in places if place[-1] in TIMESTAMP_KEYS]
        place = rng.choice(stamps if stamps and rng.random() < 0.5 else places)
        parent = document
        for step in place[:-1]:
            parent = parent[step]
        last = place[-1]
        edit = rng.randrange(5)
        if edit == 0:
            parent[last] = copy.deepcopy(rng.choice(EDGE_VALUES))
        elif edit == 1:
            del parent[last]
        elif edit == 2 and isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
        elif edit == 3 and isinstance(parent, dict):
            items = list(parent.items())
            rng.shuffle(items)
            parent.clear()
            parent.update(items)
        elif isinstance(parent, list):
            rng.shuffle(parent)
    return document


def _places(value: Any, at: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    """The path of every value below ``value``."""
    steps = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for step, inner in steps:
        yield (*at, step)
        yield from _places(inner, (*at, step))


def _key_doubled(text: str, rng: random.Random) -> str:
    """``text`` with one of its ``"key": value`` members written twice."""
    members = list(
        re.finditer(r'"(date|qty|startDate|endDate|name|units|source)": ("[^"]*"|[-0-9.e]+)', text)
    )
    if not members:
        return text
    member = rng.choice(members)
    return f"{text[: member.end()]}, {member.group(0)}{text[member.end() :]}"


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32),
    st.integers(0, 8),
    st.booleans(),
    st.sampled_from([None, "minutes", "days"]),
)
def test_mutated_app_bodies_fold_without_error_the_same_every_time_parse_51(
    seed: int, edits: int, doubled: bool, aggregation: str | None
) -> None:
    """PARSE-51: an app-shaped body with any of its values swapped for another type, an edge
    number or a timestamp in any shape, fields and elements removed or doubled, keys doubled
    and anything reordered, folds without an error; folded again it writes nothing, folded
    into another empty store it gives the same bytes, and every stored point sits at the
    coordinates its own timestamps give, which format and parse back to themselves."""
    rng = random.Random(seed)
    body = make_body(
        rng.randrange(100), metrics=("heart_rate", "sleep_analysis", "blood_pressure"), hours=1
    )
    text = json.dumps(_mutated(json.loads(body), rng, edits), ensure_ascii=rng.random() < 0.5)
    if doubled:
        text = _key_doubled(text, rng)
    mutated = text.encode()
    projection = MemoryProjection(inherited="minutes")
    _, outcome = fold(mutated, projection, aggregation=aggregation)
    stored = {key: (obj.hash, obj.body) for key, obj in projection.objects.items()}
    again, second = fold(mutated, projection, delivery_id=2, aggregation=aggregation)
    assert second.layer != outcome.layer or again == []
    other = MemoryProjection(inherited="minutes")
    fold(mutated, other, aggregation=aggregation)
    assert {key: (obj.hash, obj.body) for key, obj in other.objects.items()} == stored
    assert sum(obj.count for obj in other.objects.values()) == outcome.counters.points_new
    for obj in other.objects.values():
        for (start, end), raw in objects.decode(obj.body).items():
            assert read_point(raw).start == start
            assert read_point(raw).end == end
            assert parse_instant(format_instant(start)) == start
