"""The merge table and the reduction within a delivery, as pure functions (specs/merge.md)."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
from _bodies import read_point
from hypothesis import given
from hypothesis import strategies as st

from healthlog.merge import (
    Collision,
    Coordinates,
    Counters,
    Incoming,
    merge_points,
    reduce_delivery,
)
from healthlog.points import (
    Point,
    canonical_form,
    completeness,
    instant_form,
    point_at,
)

DATE = "2024-02-06 07:00:00 -0800"
AT = read_point(b'{"date":"%s"}' % DATE.encode()).start
KEY = (AT, AT)


def point(**fields: Any) -> Point:
    return read_point(json.dumps({"date": DATE, **fields}).encode())


class Recorder:
    """Collects the collisions reported by the merge functions."""

    def __init__(self) -> None:
        self.seen: list[tuple[Coordinates, Collision]] = []

    def __call__(self, coords: Coordinates, kind: Collision) -> None:
        self.seen.append((coords, kind))


def merge(stored_point: Point | None, incoming: Point) -> tuple[bool, bytes, Counters, Recorder]:
    """Merge ``incoming`` as a decoded point and as raw bytes; both must give the same result."""
    results = []
    for decoded in ({KEY: incoming}, {}):
        stored = {} if stored_point is None else {KEY: stored_point.raw}
        counters, recorder = Counters(), Recorder()
        changed = merge_points(stored, Incoming({KEY: incoming.raw}, decoded), counters, recorder)
        results.append((changed, stored[KEY], counters, recorder.seen))
    assert results[0] == results[1]
    changed, kept, counters, _ = results[0]
    return changed, kept, counters, recorder


def test_new_point() -> None:
    """MERGE-7: a point at free coordinates is stored and counted as new."""
    incoming = point(qty=1)
    changed, kept, counters, recorder = merge(None, incoming)
    assert (changed, kept) == (True, incoming.raw)
    assert (counters.points_new, counters.overwrites) == (1, 0)
    assert recorder.seen == []


def test_same_canonical_form_changes_nothing() -> None:
    """MERGE-6: same canonical form: stored bytes kept, no counter but unchanged, no report."""
    stored = point(qty=46, source="A")
    incoming = read_point(
        b'{"source":"A","qty":46.00000000000001,"date":"2024-02-06 15:00:00 +0000","x":""}'
    )
    changed, kept, counters, recorder = merge(stored, incoming)
    assert (changed, kept) == (False, stored.raw)
    assert counters == Counters(points_unchanged=1)
    assert recorder.seen == []


def test_more_complete_replaces() -> None:
    """MERGE-7: a more complete point replaces the stored one."""
    stored = point(qty=46)
    incoming = point(qty=46, source="A")
    changed, kept, counters, recorder = merge(stored, incoming)
    assert (changed, kept) == (True, incoming.raw)
    assert counters == Counters(points_replaced=1, overwrites=1)
    assert recorder.seen == [(KEY, Collision.REPLACED)]


def test_less_complete_is_held() -> None:
    """MERGE-8: a less complete point never erases fields of the stored one."""
    stored = point(qty=46, source="A", context="resting")
    incoming = point(qty=47)
    changed, kept, counters, recorder = merge(stored, incoming)
    assert (changed, kept) == (False, stored.raw)
    assert counters == Counters(points_held=1, overwrites=1)
    assert recorder.seen == [(KEY, Collision.HELD)]


def test_equal_completeness_later_wins() -> None:
    """MERGE-9: equally complete, different content: the incoming (later) point wins."""
    stored = point(qty=46, source="A")
    incoming = point(qty=47, source="A")
    changed, kept, counters, recorder = merge(stored, incoming)
    assert (changed, kept) == (True, incoming.raw)
    assert counters == Counters(points_erased=1, overwrites=1)
    assert recorder.seen == [(KEY, Collision.ERASED)]


def test_reattributed_source_is_one_point() -> None:
    """MERGE-1: a point re-attributed from `A|B` to `A` stays one point at its coordinates."""
    stored = point(qty=46, source="Watch|iPad")
    incoming = point(qty=46, source="Watch")
    changed, kept, counters, _ = merge(stored, incoming)
    assert (changed, kept) == (True, incoming.raw)
    assert counters.points_new == 0


def test_merge_touches_only_incoming_coordinates() -> None:
    """MERGE-14: merging never removes a stored point the delivery does not carry."""
    other = (AT + 1, AT + 1)
    stored = {KEY: point(qty=1).raw, other: b'{"date":"x"}'}
    merge_points(stored, Incoming({KEY: point(qty=2).raw}, {}), Counters(), Recorder())
    assert set(stored) == {KEY, other}
    assert stored[other] == b'{"date":"x"}'


def reduce(points: list[Point]) -> tuple[Incoming, Counters, Recorder]:
    counters, recorder = Counters(), Recorder()
    keys = [(p.start, p.end) for p in points]
    result = reduce_delivery(keys, [p.raw for p in points], counters, recorder)
    return result, counters, recorder


def reduced(points: list[Point]) -> tuple[bytes, Counters, Recorder]:
    """The raw bytes of the one point the reduction keeps."""
    result, counters, recorder = reduce(points)
    assert list(result.raws) == [KEY]
    assert result.points([KEY])[0].raw == result.raws[KEY]
    return result.raws[KEY], counters, recorder


def test_reduction_prefers_completeness() -> None:
    """MERGE-10: within a delivery the more complete point wins."""
    rich = point(qty=1, source="A", context="x")
    for order in itertools.permutations([point(qty=9), rich, point(qty=5, source="B")]):
        winner, counters, recorder = reduced(list(order))
        assert winner == rich.raw
        assert counters.overwrites == 2
        assert recorder.seen == [(KEY, Collision.WITHIN_DELIVERY)]


def test_reduction_tie_takes_greater_canonical_form() -> None:
    """MERGE-10: at equal completeness the greater canonical form wins, in any order."""
    candidates = [point(qty=q, source="A") for q in (1.5, 10, 2, 1.6)]
    greatest = max(candidates, key=lambda p: p.canonical)
    assert json.loads(greatest.raw)["qty"] == 2
    for order in itertools.permutations(candidates):
        winner, _, _ = reduced(list(order))
        assert winner == greatest.raw


def test_reduction_tie_compares_numbers_as_printed_by_percent_12g() -> None:
    """MERGE-10: the greater canonical form is the greater `%.12g` text: `5e-05` beats
    `0.0001`, `1.5e-10` beats `1.5e-07`, whatever the array order and however the numbers
    were spelled in the raw bytes (whose order is the other one here)."""
    for kept, other in [(b"0.00005", b"0.0001"), (b"0.00000000015", b"1.5e-7")]:
        candidates = [
            read_point(b'{"date":"%s","qty":%s,"source":"A"}' % (DATE.encode(), qty))
            for qty in (kept, other)
        ]
        assert candidates[0].raw < candidates[1].raw
        for order in itertools.permutations(candidates):
            winner, counters, _ = reduced(list(order))
            assert winner == candidates[0].raw
            assert counters.overwrites == 1


def test_reduction_same_canonical_form_is_no_collision() -> None:
    """MERGE-10: copies with the same canonical form reduce to the greater raw bytes, in any
    order, with no overwrite."""
    copies = [
        read_point(b'{"date":"%s","qty":46}' % DATE.encode()),
        read_point(b'{"qty":46.0,"date":"%s"}' % DATE.encode()),
        read_point(b'{"qty":46,"date":"2024-02-06T15:00:00Z","source":""}'),
    ]
    for order in itertools.permutations(copies):
        winner, counters, recorder = reduced(list(order))
        assert winner == max(copy.raw for copy in copies)
        assert counters.overwrites == 0
        assert recorder.seen == []


def test_reduction_keeps_distinct_coordinates() -> None:
    """MERGE-10: points at different coordinates are never reduced together."""
    first = point(qty=1)
    later = read_point(b'{"date":"2024-02-06 07:01:00 -0800","qty":1}')
    segment = point(endDate="2024-02-06 08:00:00 -0800")
    result, counters, _ = reduce([first, later, segment])
    assert result.raws == {(p.start, p.end): p.raw for p in (first, later, segment)}
    assert result.decoded == {}
    assert counters.overwrites == 0


@pytest.mark.parametrize(
    ("stored", "incoming", "counter"),
    [
        ({"qty": 1}, {"qty": 1.0}, "points_unchanged"),
        ({"qty": 1}, {"qty": 1, "source": "A"}, "points_replaced"),
        ({"qty": 1, "source": "A"}, {"qty": 2}, "points_held"),
        ({"qty": 1}, {"qty": 2}, "points_erased"),
    ],
)
def test_table_counters(stored: dict[str, Any], incoming: dict[str, Any], counter: str) -> None:
    """MERGE-6, MERGE-7, MERGE-8, MERGE-9: each row of the table moves exactly its counter."""
    _, _, counters, _ = merge(point(**stored), point(**incoming))
    moved = {name for name, value in attrs.asdict(counters).items() if value} - {"overwrites"}
    assert moved == {counter}
    assert counters.overwrites == (0 if counter == "points_unchanged" else 1)


def reordered(raw: bytes) -> bytes:
    """The same JSON object with its keys in reverse order."""
    return json.dumps(dict(reversed(json.loads(raw).items())), separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("changed", "counter"),
    [
        (None, None),
        ({"qty": 5, "source": "A"}, "points_erased"),
        ({"qty": 1, "source": "A", "context": "walk"}, "points_replaced"),
        ({"qty": 1}, "points_held"),
    ],
)
def test_resent_hour_in_another_key_order_merge_24(
    changed: dict[str, Any] | None, counter: str | None
) -> None:
    """MERGE-24: the same points in another key order change nothing; one changed among them
    moves its own counter and the rest are unchanged, whether it kept its length (erased) or
    not."""
    stored = {
        (AT + minute * 60_000_000,) * 2: json.dumps(
            {"date": DATE, "qty": minute, "source": "A"}, separators=(",", ":")
        ).encode()
        for minute in range(1, 6)
    }
    raws = {key: reordered(raw) for key, raw in stored.items()}
    first = next(iter(raws))
    if changed is not None:
        raws[first] = json.dumps({"date": DATE, **changed}, separators=(",", ":")).encode()
    before = dict(stored)
    counters, recorder = Counters(), Recorder()
    wrote = merge_points(stored, Incoming(raws, {}), counters, recorder)
    moved = {name: value for name, value in attrs.asdict(counters).items() if value}
    if counter is None:
        assert (wrote, stored, moved, recorder.seen) == (False, before, {"points_unchanged": 5}, [])
        return
    assert moved == {"points_unchanged": 4, counter: 1, "overwrites": 1}
    assert [kind for _, kind in recorder.seen] == [
        Collision[counter.removeprefix("points_").upper()]
    ]
    assert wrote == (counter != "points_held")
    assert stored[first] == (before[first] if counter == "points_held" else raws[first])
    assert {key: stored[key] for key in raws if key != first} == {
        key: before[key] for key in raws if key != first
    }


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(["", "A", "B", "2024-02-06 07:00:00 -0800"]),
    st.sampled_from([0, 1, 46, 46.0, 46.00000000000001, 0.3, 2**70, 1e20]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(st.sampled_from(["qty", "x"]), inner, max_size=2)
    ),
    max_leaves=4,
)
_FIELDS = st.dictionaries(
    st.sampled_from(["qty", "source", "context", "meta"]), _VALUES, max_size=4
)


def _compact(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@given(
    st.lists(
        st.tuples(_FIELDS, _FIELDS, st.sampled_from(["same", "reordered", "other"])),
        min_size=1,
        max_size=6,
    )
)
def test_meetings_of_decoded_objects_settled_as_point_by_point_merge_26(
    pairs: list[tuple[dict[str, Any], dict[str, Any], str]],
) -> None:
    """MERGE-26: an object's meetings whose points all decode as objects are settled by their
    completeness alone where it differs, with the same stored bytes, counters and collisions,
    in the same order, as point by point (the path of points decoded before), and as the merge
    table decides by canonical forms and completeness."""
    stored, raws, decoded = {}, {}, {}
    for minute, (left, right, how) in enumerate(pairs, start=1):
        key = (AT + minute * 60_000_000,) * 2
        old = {"date": DATE, **left}
        new = {"date": DATE, **right} if how == "other" else dict(old)
        if how == "reordered":
            new = dict(reversed(new.items()))
        stored[key], raws[key] = _compact(old), _compact(new)
        decoded[key] = point_at(raws[key], *key)
    results = []
    for known in ({}, decoded):
        kept, counters, recorder = dict(stored), Counters(), Recorder()
        changed = merge_points(kept, Incoming(dict(raws), known), counters, recorder)
        results.append((changed, kept, counters, recorder.seen))
    assert results[0] == results[1]
    changed, kept, counters, _ = results[0]
    for key, old_raw in stored.items():
        old, new = json.loads(old_raw), json.loads(raws[key])
        if canonical_form(old) == canonical_form(new) or completeness(new) < completeness(old):
            assert kept[key] == old_raw
        else:
            assert kept[key] == raws[key]
    assert changed == (kept != stored)


_BED = datetime(2024, 2, 6, 6, 5, 47, tzinfo=UTC)


def _written(moment: datetime, hours: int) -> str:
    """``moment`` as the app writes it on a phone at UTC+``hours``."""
    return moment.astimezone(timezone(timedelta(hours=hours))).strftime("%Y-%m-%d %H:%M:%S %z")


def _sleep(hours: int, **fields: Any) -> dict[str, Any]:
    """Aggregated sleep at ``DATE``, every date written at UTC+``hours``: the same instants
    whatever ``hours``."""
    wake = _BED + timedelta(hours=7, minutes=25)
    return {
        "date": _written(datetime(2024, 2, 6, 15, tzinfo=UTC), hours),
        "totalSleep": 7.4,
        "sleepStart": _written(_BED, hours),
        "sleepEnd": _written(wake, hours),
        "inBedStart": _written(_BED, hours),
        "inBedEnd": _written(wake, hours),
        **fields,
    }


def _workout(hours: int, *, first: str = "id") -> dict[str, Any]:
    """A workout at ``DATE`` with a route of two points, written at UTC+``hours``, its key
    ``first`` first."""
    start = datetime(2024, 2, 6, 15, tzinfo=UTC)
    fields = {
        "id": "W1",
        "name": "Hiking",
        "start": _written(start, hours),
        "end": _written(start + timedelta(minutes=5), hours),
        "route": [
            {"latitude": 49.2827, "longitude": -123.12, "timestamp": _written(start, hours)},
            {
                "latitude": 49.2828,
                "longitude": -123.12,
                "timestamp": _written(start + timedelta(seconds=1), hours),
            },
        ],
    }
    return {first: fields.pop(first), **fields}


def _encoded(value: dict[str, Any]) -> Point:
    return read_point(json.dumps(value).encode())


@pytest.mark.parametrize(
    ("stored", "incoming"),
    [
        (_sleep(-8), _sleep(9)),
        (_workout(-8), _workout(9)),
        (_workout(9), _workout(0)),
    ],
    ids=["sleep", "route", "route-to-utc"],
)
def test_the_same_instants_in_other_offsets_are_the_same_value_merge_31(
    stored: dict[str, Any], incoming: dict[str, Any]
) -> None:
    """MERGE-31: a re-send after the phone changed time zone, the dates under `sleepStart`,
    `sleepEnd`, `inBedStart`, `inBedEnd` and a route's `timestamp` the same instants in another
    offset, is the same value: no collision, no overwrite, counted unchanged; its bytes replace
    the stored ones, as the erased row did before, so a store folded then rebuilds the same."""
    old, new = _encoded(stored), _encoded(incoming)
    assert (old.start, old.end) == (new.start, new.end)
    changed, kept, counters, recorder = merge(old, new)
    assert (changed, kept) == (True, new.raw)
    assert counters == Counters(points_unchanged=1)
    assert recorder.seen == []


@pytest.mark.parametrize(
    ("stored", "incoming", "same"),
    [
        ("2024-02-05 22:05:47 -0800", "2024-02-06 15:05:48 +0900", False),
        ("yesterday", "Yesterday", False),
        ("yesterday", "yesterday", True),
    ],
)
def test_other_dates_that_differ_or_are_no_dates_compare_as_before_merge_31(
    stored: str, incoming: str, same: bool
) -> None:
    """MERGE-31: another instant under `sleepStart` is another value (erased, with its
    collision), and so is another text where no date is written, compared as text; the same
    text is the same value, the other dates being the same instants in another offset."""
    old = _encoded(_sleep(-8, sleepStart=stored))
    new = _encoded(_sleep(9, sleepStart=incoming))
    _, kept, counters, recorder = merge(old, new)
    assert kept == new.raw
    if same:
        assert (counters, recorder.seen) == (Counters(points_unchanged=1), [])
    else:
        assert counters == Counters(points_erased=1, overwrites=1)
        assert recorder.seen == [(KEY, Collision.ERASED)]


def test_a_delivery_with_the_same_instants_in_two_offsets_keeps_what_it_kept_merge_32() -> None:
    """MERGE-32: one delivery holding a workout twice, its route's dates the same instants in
    two offsets, reduces to one with no collision and no overwrite, in either order; the one
    kept is the one of the greater canonical form, the dates under `timestamp` compared as
    written (`2024-02-07 00:00:00 +0900` is greater than `2024-02-06 07:00:00 -0800`), as
    before, though its raw bytes are the smaller (its keys start `{"end"`)."""
    later = _encoded(_workout(9, first="end"))
    earlier = _encoded(_workout(-8))
    assert later.raw < earlier.raw
    for order in ([later, earlier], [earlier, later]):
        counters, recorder = Counters(), Recorder()
        keys = [(p.start, p.end) for p in order]
        result = reduce_delivery(keys, [p.raw for p in order], counters, recorder)
        assert list(result.raws.values()) == [later.raw]
        assert (counters.overwrites, recorder.seen) == (0, [])


_OTHER_DATE = st.one_of(
    st.tuples(st.integers(0, 1), st.sampled_from([-8, 0, 9])).map(
        lambda shift_zone: _written(_BED + timedelta(seconds=shift_zone[0]), shift_zone[1])
    ),
    st.sampled_from(["", "yesterday", "Yesterday"]),
)
_DATES = ["2024-02-06 07:00:00 -0800", "2024-02-06 15:00:00 +0000", "2024-02-07 00:00:00 +0900"]
_SHAPES = st.fixed_dictionaries(
    {},
    optional={
        "sleepStart": st.none(),
        "inBedEnd": st.none(),
        "qty": st.sampled_from([1, 1.0, 2]),
        "route": st.integers(0, 2),
    },
)


def _dated(data: st.DataObject, shape: dict[str, Any]) -> Point:
    """A point of ``shape`` (its keys, its route's length) at ``KEY``, every other date drawn
    anew: one of two instants in one of three offsets, a text, or nothing."""
    value: dict[str, Any] = {"date": data.draw(st.sampled_from(_DATES))}
    for key, kind in shape.items():
        if key == "route":
            value[key] = [{"timestamp": data.draw(_OTHER_DATE)} for _ in range(kind)]
        else:
            value[key] = data.draw(_OTHER_DATE) if kind is None else kind
    return _encoded(value)


@given(_SHAPES, st.permutations(range(3)), st.data())
def test_any_other_dates_collide_exactly_where_their_instants_differ_merge_34(
    shape: dict[str, Any], order: list[int], data: st.DataObject
) -> None:
    """MERGE-34: for any two points at the same coordinates whose `sleepStart`, `inBedEnd` and
    route `timestamp` hold instants in any offsets, other instants, texts or nothing, a merge
    (decoded or not) keeps the bytes the canonical form and completeness give, as before, and
    reports a collision and an overwrite exactly where their instant forms differ; a delivery
    holding three such points keeps the one of the greatest completeness, canonical form and
    raw bytes, in any order, and counts one overwrite less than it holds instant forms."""
    points = [_dated(data, shape) for _ in range(3)]
    old, new = points[:2]
    _, kept, counters, recorder = merge(old, new)
    held = old.canonical == new.canonical or new.completeness < old.completeness
    assert kept == (old.raw if held else new.raw)
    differ = instant_form(json.loads(old.raw)) != instant_form(json.loads(new.raw))
    assert counters.overwrites == len(recorder.seen) == int(differ)
    result, counters, recorder = reduce([points[n] for n in order])
    best = max(points, key=lambda p: (p.completeness, p.canonical, p.raw))
    assert result.raws == {KEY: best.raw}
    assert counters.overwrites == len({p.instant_form for p in points}) - 1
    assert len(recorder.seen) == (counters.overwrites > 0)


def _escaped(value: dict[str, Any]) -> Point:
    """``value`` with the first letter of each key written as a JSON escape."""
    text = json.dumps(value)
    for key in value:
        text = text.replace(f'"{key}"', f'"\\u{ord(key[0]):04x}{key[1:]}"')
    return read_point(text.encode())


def test_an_other_date_key_spelled_with_an_escape_is_read_too_merge_31() -> None:
    """MERGE-31: a point and its re-send whose keys are spelled with a JSON escape
    (`"\\u0073leepStart"`), their dates the same instants in other offsets, are the same value
    too: what decides is the decoded key, not how the bytes spell it."""
    old, new = _escaped(_sleep(-8)), _escaped(_sleep(9))
    assert b"sleepStart" not in old.raw + new.raw
    changed, kept, counters, recorder = merge(old, new)
    assert (changed, kept, counters, recorder.seen) == (
        True,
        new.raw,
        Counters(points_unchanged=1),
        [],
    )
