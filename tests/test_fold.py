"""One delivery against stored objects, driven like storage drives it (specs/merge.md)."""

from __future__ import annotations

import json
import logging
import random
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
from fixtures import (
    MemoryProjection,
    app_date,
    conflicting,
    dump,
    fold,
    make_body,
    poorer,
    resend,
    richer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthlog import objects
from healthlog.fold import PARSED, DeliveryFold, DeliveryInfo
from healthlog.objects import HourlyObject, ObjectKey
from healthlog.timestamps import format_instant, hour_of, parse_instant

START = datetime(2024, 2, 6, 7, 0, tzinfo=timezone(timedelta(hours=-8)))
HOUR_15Z = parse_instant("2024-02-06 15:00:00 +0000")
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def at(minutes: float) -> str:
    return app_date(START + timedelta(minutes=minutes))


def body(points: list[dict[str, Any]], name: str = "heart_rate", units: str = "count/min") -> bytes:
    return json.dumps(
        {"data": {"metrics": [{"name": name, "units": units, "data": points}]}}
    ).encode()


def snapshot(projection: MemoryProjection) -> dict[ObjectKey, HourlyObject]:
    return dict(projection.objects)


def all_points(projection: MemoryProjection) -> dict[tuple[str, int, int], bytes]:
    """Every stored raw point by metric and coordinates."""
    return {
        (key.metric, *coords): raw
        for key, obj in projection.objects.items()
        for coords, raw in objects.decode(obj.body).items()
    }


def warn_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def loud_text(caplog: pytest.LogCaptureFixture) -> str:
    """Everything logged above DEBUG, messages and exception text alike."""
    return "\n".join(
        f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records if r.levelno > logging.DEBUG
    )


def nonzero(outcome: Any) -> set[str]:
    return {name for name, value in attrs.asdict(outcome.counters).items() if value}


def test_resend_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-6: a re-send with other key order, float noise and offset writes nothing."""
    first = make_body(20, hours=2, richness=2)
    projection = MemoryProjection()
    fold(first, projection)
    before = snapshot(projection)
    caplog.set_level(logging.DEBUG)
    written, outcome = fold(resend(first, 21, offset=timedelta(hours=2)), projection, delivery_id=2)
    assert written == []
    assert outcome.status == PARSED
    assert outcome.counters.points_unchanged == outcome.counters.points == 240
    assert outcome.counters.objects_unchanged == len(before) == 4
    assert snapshot(projection) == before
    assert warn_messages(caplog) == []


def test_more_complete_replaces(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-7: more complete re-sends replace the stored points."""
    first = make_body(22, hours=1, richness=1)
    projection = MemoryProjection()
    fold(first, projection)
    caplog.set_level(logging.DEBUG)
    more = richer(first, 23)
    written, outcome = fold(more, projection, delivery_id=2)
    assert outcome.counters.points_replaced == outcome.counters.overwrites == 120
    assert outcome.counters.objects_written == len(written) == 2
    assert len(warn_messages(caplog)) == 120
    for raw in all_points(projection).values():
        assert b'"metadata"' in raw


def test_less_complete_is_held(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-8: a poorer re-send is held; `context` and `source` survive."""
    first = make_body(24, hours=1, richness=2)
    projection = MemoryProjection()
    fold(first, projection)
    before = snapshot(projection)
    caplog.set_level(logging.DEBUG)
    written, outcome = fold(poorer(first, 25), projection, delivery_id=2)
    assert written == []
    assert outcome.counters.points_held == outcome.counters.overwrites == 120
    assert snapshot(projection) == before
    assert len(warn_messages(caplog)) == 120
    for raw in all_points(projection).values():
        assert b'"context"' in raw
        assert b'"source"' in raw


def test_equal_completeness_later_wins() -> None:
    """MERGE-9: equally complete, different values: the later delivery wins."""
    first = make_body(26, hours=1)
    projection = MemoryProjection()
    fold(first, projection)
    later = conflicting(first, 27)
    written, outcome = fold(later, projection, delivery_id=2)
    assert outcome.counters.points_erased == outcome.counters.overwrites == 120
    assert len(written) == 2
    expected = {
        json.dumps(p, sort_keys=True)
        for m in json.loads(later)["data"]["metrics"]
        for p in m["data"]
    }
    stored = {
        json.dumps(json.loads(raw), sort_keys=True) for raw in all_points(projection).values()
    }
    assert stored == expected


def test_reattributed_source_stays_one_point() -> None:
    """MERGE-1: the same values re-attributed from `A|B` to `A` stay one point each."""
    projection = MemoryProjection()
    fold(make_body(28, source="Watch Ultra 3|iPad (Anna)"), projection)
    _, outcome = fold(make_body(28, source="Watch Ultra 3"), projection, delivery_id=2)
    assert outcome.counters.points_erased == 120
    assert outcome.counters.points_new == 0
    assert sum(obj.count for obj in projection.objects.values()) == 120


def test_reduction_within_a_delivery(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-10: duplicates in one delivery reduce alike in any order, with the same counts and
    one warning per colliding coordinate."""
    rich = {"date": at(0), "qty": 10.125, "source": "Watch", "context": "x"}
    tie_low = {"date": at(1), "qty": 20.25, "source": "Watch"}
    tie_high = {"date": at(1), "qty": 30.5, "source": "Watch"}
    points = [
        rich,
        {"date": at(0), "qty": 11.5},
        {"date": at(0), "qty": 12.75, "source": "Phone"},
        tie_low,
        tie_high,
    ]
    caplog.set_level(logging.DEBUG)
    results = set()
    for seed in range(6):
        order = list(points)
        random.Random(seed).shuffle(order)
        projection = MemoryProjection()
        _, outcome = fold(body(order), projection)
        assert outcome.counters.points == 5
        assert outcome.counters.points_new == 2
        assert outcome.counters.overwrites == 3
        assert len(warn_messages(caplog)) == 2
        results.add(tuple(sorted(all_points(projection).values())))
        caplog.clear()
    [kept] = results
    assert sorted(json.loads(raw)["qty"] for raw in kept) == [10.125, 30.5]


def test_one_warn_per_collision_without_values(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-11: each collision kind adds one overwrite and one WARN naming metric/layer/hour;
    three forms at one coordinate within the delivery add two overwrites and one WARN."""
    source = "Secret Watch of Anna 0xBEEF"
    stored = [
        {"date": at(0), "qty": 123.456},
        {"date": at(1), "qty": 123.456, "source": source, "context": "resting"},
        {"date": at(2), "qty": 123.456},
    ]
    incoming = [
        {"date": at(0), "qty": 123.456, "source": source},
        {"date": at(1), "qty": 654.321},
        {"date": at(2), "qty": 654.321},
        {"date": at(3), "qty": 111.222},
        {"date": at(3), "qty": 333.444},
        {"date": at(3), "qty": 555.666},
    ]
    projection = MemoryProjection()
    fold(body(stored), projection, aggregation="minutes")
    caplog.set_level(logging.DEBUG)
    _, outcome = fold(body(incoming), projection, delivery_id=2, aggregation="minutes")
    counters = outcome.counters
    assert (counters.points_replaced, counters.points_held, counters.points_erased) == (1, 1, 1)
    assert counters.overwrites == 5
    messages = warn_messages(caplog)
    assert len(messages) == 4
    kinds = sorted(m.split("kind=")[1].split()[0] for m in messages)
    assert kinds == ["erased", "held", "replaced", "within_delivery"]
    for message in messages:
        assert "metric=heart_rate" in message
        assert "layer=minutes" in message
        assert f"hour={format_instant(HOUR_15Z)}" in message
        assert "delivery=2" in message
    text = loud_text(caplog)
    for secret in ("123.456", "654.321", "111.222", "333.444", "555.666", source, "resting", at(0)):
        assert secret not in text


def test_units(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-12: the creating metric's units stay; every differing unit is counted."""
    projection = MemoryProjection()
    _, outcome = fold(
        body([{"date": at(0), "qty": 1}], "step_count", "count"), projection, aggregation="minutes"
    )
    assert outcome.counters.unit_mismatches == 0
    [key] = projection.objects
    assert projection.objects[key].units == "count"

    caplog.set_level(logging.DEBUG)
    written, outcome = fold(
        body([{"date": at(1), "qty": 2}], "step_count", "steps"),
        projection,
        delivery_id=2,
        aggregation="minutes",
    )
    assert outcome.counters.unit_mismatches == 1
    assert [obj.units for obj in written] == ["count"]
    [message] = warn_messages(caplog)
    assert "unit mismatch" in message
    assert "metric=step_count" in message

    twice = {
        "data": {
            "metrics": [
                {"name": "flights", "units": "steps", "data": [{"date": at(0), "qty": 1}]},
                {"name": "flights", "units": "count", "data": [{"date": at(1), "qty": 2}]},
                {"name": "flights", "data": [{"date": at(2), "qty": 3}]},
                {"name": "flights", "units": "steps", "data": [{"date": at(3), "qty": 4}]},
            ]
        }
    }
    fresh = MemoryProjection()
    written, outcome = fold(json.dumps(twice).encode(), fresh, aggregation="minutes")
    assert outcome.counters.unit_mismatches == 2
    assert [obj.units for obj in written] == ["count"]
    assert sum(obj.count for obj in written) == 4


def test_units_unchanged_or_missing_are_no_mismatch() -> None:
    """MERGE-12: the same or no incoming units against stored ones count nothing."""
    projection = MemoryProjection()
    fold(
        body([{"date": at(0), "qty": 1}], "step_count", "count"), projection, aggregation="minutes"
    )
    for delivery_id, units in enumerate(["count", ""], start=2):
        _, outcome = fold(
            body([{"date": at(delivery_id), "qty": 1}], "step_count", units),
            projection,
            delivery_id=delivery_id,
            aggregation="minutes",
        )
        assert outcome.counters.unit_mismatches == 0
    assert {obj.units for obj in projection.objects.values()} == {"count"}


def test_units_missing_on_the_stored_object() -> None:
    """MERGE-12: an object created without units takes the units a later metric brings."""
    projection = MemoryProjection()
    fold(body([{"date": at(0), "qty": 1}], "step_count", ""), projection, aggregation="minutes")
    written, outcome = fold(
        body([{"date": at(1), "qty": 2}], "step_count", "count"),
        projection,
        delivery_id=2,
        aggregation="minutes",
    )
    assert outcome.counters.unit_mismatches == 0
    assert [obj.units for obj in written] == ["count"]


def test_units_brought_by_a_resend_of_the_same_points_merge_25() -> None:
    """MERGE-25: an object created without units takes the units a later delivery brings for
    the same points, with no point changed: the object is written with them, and then, sent
    once more, left alone."""
    projection = MemoryProjection()
    points = [{"date": at(0), "qty": 1}]
    fold(body(points, "step_count", ""), projection, aggregation="minutes")
    written, outcome = fold(
        body(points, "step_count", "count"), projection, delivery_id=2, aggregation="minutes"
    )
    assert [obj.units for obj in written] == ["count"]
    assert (outcome.counters.objects_written, outcome.counters.unit_mismatches) == (1, 0)
    assert {obj.units for obj in projection.objects.values()} == {"count"}
    written, outcome = fold(
        body(points, "step_count", "count"), projection, delivery_id=3, aggregation="minutes"
    )
    assert written == []
    assert outcome.counters.objects_unchanged == 1


def test_sealed_object(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-13: a change to a sealed object is written, counted and warned; no change, no write."""
    key = ObjectKey("heart_rate", "minutes", HOUR_15Z)
    first = parse_instant(at(0))
    raw = b'{"date":"%s","qty":1}' % at(0).encode()
    sealed = objects.encode(key, "count/min", {(first, first): raw}, created_by=1, sealed=True)
    projection = MemoryProjection()
    projection.objects[key] = sealed
    caplog.set_level(logging.DEBUG)
    new = body([{"date": at(5), "qty": 2}])
    written, outcome = fold(new, projection, delivery_id=2, aggregation="minutes")
    assert [obj.key for obj in written] == [key]
    assert written[0].sealed
    assert written[0].count == 2
    assert written[0].created_by == 1
    assert outcome.counters.sealed_writes == 1
    [message] = warn_messages(caplog)
    assert "sealed" in message
    caplog.clear()
    written, outcome = fold(new, projection, delivery_id=3, aggregation="minutes")
    assert written == []
    assert outcome.counters.sealed_writes == 0
    assert warn_messages(caplog) == []


def test_nothing_is_deleted() -> None:
    """MERGE-14: a later delivery without some points leaves them stored."""
    projection = MemoryProjection()
    fold(make_body(30, hours=2), projection)
    before = all_points(projection)
    later = json.loads(make_body(31, start=START + timedelta(minutes=90), hours=2))
    for entry in later["data"]["metrics"]:
        entry["data"] = entry["data"][::3]
    fold(json.dumps(later).encode(), projection, delivery_id=2, aggregation="minutes")
    after = all_points(projection)
    assert set(before) <= set(after)
    assert len(after) == len(before) + 2 * 30


def test_hour_of_a_point() -> None:
    """MERGE-18: a point belongs to its start's UTC hour; created_by stays the creator."""
    points = [
        {"date": at(59.5), "qty": 1},
        {"start": at(59), "end": at(70), "qty": 2},
        {"date": at(60), "qty": 3},
    ]
    projection = MemoryProjection()
    written, _ = fold(body(points), projection, delivery_id=5, aggregation="minutes")
    by_hour = {obj.key.hour: obj for obj in written}
    assert sorted(by_hour) == [HOUR_15Z, HOUR_15Z + 3_600_000_000]
    early = by_hour[HOUR_15Z]
    assert early.count == 2
    assert early.first == parse_instant(at(59))
    assert early.last == parse_instant(at(70))
    assert early.created_by == 5
    written, _ = fold(
        body([{"date": at(1), "qty": 4}]), projection, delivery_id=6, aggregation="minutes"
    )
    assert [(obj.key.hour, obj.created_by, obj.count) for obj in written] == [(HOUR_15Z, 5, 3)]
    for obj in projection.objects.values():
        assert all(hour_of(start) == obj.key.hour for start, _ in objects.decode(obj.body))


METRIC_SETS = [("heart_rate",), ("step_count", "blood_pressure"), ("heart_rate", "sleep_analysis")]


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[bytes, str]:
    """A generated delivery and its layer (sent as the aggregation header)."""
    layer = draw(st.sampled_from(["minutes", "hours"]))
    delivery = make_body(
        draw(st.integers(0, 10_000)),
        metrics=draw(st.sampled_from(METRIC_SETS)),
        layer=layer,
        hours=draw(st.integers(1, 3)),
        richness=draw(st.integers(0, 2)),
        noise=draw(st.booleans()),
    )
    return delivery, layer


@PROPERTY
@given(deliveries())
def test_refold_is_idempotent(generated: tuple[bytes, str]) -> None:
    """MERGE-19: folding a delivery twice writes nothing the second time; only unchanged counts."""
    delivery, layer = generated
    projection = MemoryProjection()
    fold(delivery, projection, aggregation=layer)
    before = snapshot(projection)
    written, outcome = fold(delivery, projection, delivery_id=2, aggregation=layer)
    assert written == []
    assert nonzero(outcome) <= {"metrics", "points", "points_unchanged", "objects_unchanged"}
    assert outcome.counters.points_unchanged == outcome.counters.points > 0
    assert outcome.counters.objects_unchanged == len(before)
    assert snapshot(projection) == before


def with_duplicates(delivery: bytes, rng: random.Random) -> dict[str, Any]:
    """The delivery with poorer, richer and conflicting copies of some points mixed in."""
    envelope: dict[str, Any] = json.loads(delivery)
    variants = [json.loads(v) for v in (poorer(delivery, 1), richer(delivery, 2))]
    variants.append(json.loads(conflicting(delivery, 3)))
    for index, entry in enumerate(envelope["data"]["metrics"]):
        for variant in variants:
            copies = variant["data"]["metrics"][index]["data"]
            entry["data"].extend(rng.sample(copies, k=len(copies) // 4))
    return envelope


def shuffle_arrays(envelope: dict[str, Any], rng: random.Random) -> bytes:
    """The same points, bytes for bytes, in another array order."""
    for entry in envelope["data"]["metrics"]:
        rng.shuffle(entry["data"])
    return json.dumps(envelope).encode()


@PROPERTY
@given(deliveries(), st.randoms(use_true_random=False))
def test_array_and_key_order_do_not_matter(
    generated: tuple[bytes, str], rng: random.Random
) -> None:
    """MERGE-20: array order never changes the objects; a key-order re-send changes nothing."""
    delivery, layer = generated
    envelope = with_duplicates(delivery, rng)
    reference = MemoryProjection()
    fold(json.dumps(envelope).encode(), reference, aggregation=layer)
    expected = {key: obj.hash for key, obj in reference.objects.items()}
    assert expected
    shuffled = MemoryProjection()
    fold(shuffle_arrays(envelope, rng), shuffled, aggregation=layer)
    assert {key: obj.hash for key, obj in shuffled.objects.items()} == expected
    written, _ = fold(dump(envelope, rng), shuffled, delivery_id=2, aggregation=layer)
    assert written == []


@PROPERTY
@given(deliveries(), st.randoms(use_true_random=False))
def test_poorer_never_erases_a_field(generated: tuple[bytes, str], rng: random.Random) -> None:
    """MERGE-21: after rich then any strictly poorer version, every rich field is stored."""
    delivery, layer = generated
    rich = json.loads(delivery)
    poor = json.loads(delivery)
    for entry in poor["data"]["metrics"]:
        for point in entry["data"]:
            droppable = [k for k in point if k not in ("date", "startDate", "endDate")]
            for key in rng.sample(droppable, k=rng.randint(1, len(droppable))):
                del point[key]
            for key in point:
                if key not in ("date", "startDate", "endDate") and rng.random() < 0.5:
                    point[key] = 999.125
    projection = MemoryProjection()
    fold(delivery, projection, aggregation=layer)
    fold(json.dumps(poor).encode(), projection, delivery_id=2, aggregation=layer)
    stored = [json.loads(raw) for raw in all_points(projection).values()]
    originals = [p for entry in rich["data"]["metrics"] for p in entry["data"]]
    assert sorted(map(json.dumps, stored)) == sorted(map(json.dumps, originals))


overlapping = st.lists(
    st.tuples(
        st.integers(0, 10_000),
        st.integers(0, 90),
        st.sampled_from(["plain", "poorer", "richer", "conflicting", "resend"]),
    ),
    min_size=1,
    max_size=5,
)


def sequence_bodies(steps: list[tuple[int, int, str]]) -> list[bytes]:
    """Overlapping minute deliveries of heart_rate and step_count, re-sent in various ways."""
    out = []
    for seed, shift, how in steps:
        base = make_body(seed, start=START + timedelta(minutes=shift), hours=1, richness=1)
        if how == "poorer":
            base = poorer(base, seed)
        elif how == "richer":
            base = richer(base, seed)
        elif how == "conflicting":
            base = conflicting(base, seed)
        elif how == "resend":
            base = resend(base, seed, offset=timedelta(hours=seed % 5))
        out.append(base)
    return out


def fold_all(deliveries: list[bytes]) -> tuple[dict[ObjectKey, HourlyObject], list[Any]]:
    projection = MemoryProjection()
    outcomes = []
    for delivery_id, delivery in enumerate(deliveries, start=1):
        outcomes.append(fold(delivery, projection, delivery_id=delivery_id)[1])
    return snapshot(projection), outcomes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overlapping)
def test_folding_is_deterministic(steps: list[tuple[int, int, str]]) -> None:
    """MERGE-20: the same sequence of overlapping deliveries always gives the same objects."""
    deliveries = sequence_bodies(steps)
    first_objects, first_outcomes = fold_all(deliveries)
    second_objects, second_outcomes = fold_all(deliveries)
    assert second_objects == first_objects
    assert second_outcomes == first_outcomes


def test_logs_keep_health_data_private(caplog: pytest.LogCaptureFixture) -> None:
    """MERGE-22: real-shaped deliveries with collisions log WARNs without sources or values."""
    source = "Zelda\u2019s Apple\u00a0Watch \U0001f496|iPad (Zelda)"
    first = make_body(40, metrics=("heart_rate", "step_count", "blood_pressure"), source=source)
    caplog.set_level(logging.DEBUG)
    projection = MemoryProjection()
    deliveries = [first, conflicting(first, 41), poorer(first, 42), richer(first, 43)]
    for delivery_id, delivery in enumerate(deliveries, start=1):
        fold(delivery, projection, delivery_id=delivery_id)
    assert len(warn_messages(caplog)) == 3 * 180
    values = {
        json.dumps(value)
        for delivery in deliveries
        for entry in json.loads(delivery)["data"]["metrics"]
        for point in entry["data"]
        for key, value in point.items()
        if key not in ("date", "source") and isinstance(value, float)
    }
    assert len(values) > 100
    text = loud_text(caplog)
    for secret in (source, "Zelda", *values):
        assert secret not in text


def test_units_differing_within_a_delivery_are_logged_merge_29(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MERGE-29: a delivery carrying one metric under several units counts each other entry
    and logs one WARN for the metric, naming neither the units nor a value; a rebuild says
    it at DEBUG."""
    twice = {
        "data": {
            "metrics": [
                {"name": "flights", "units": "steps", "data": [{"date": at(0), "qty": 11}]},
                {"name": "flights", "units": "count", "data": [{"date": at(1), "qty": 12}]},
                {"name": "flights", "units": "steps", "data": [{"date": at(2), "qty": 13}]},
            ]
        }
    }
    caplog.set_level(logging.DEBUG)
    written, outcome = fold(json.dumps(twice).encode(), MemoryProjection(), aggregation="minutes")
    assert outcome.counters.unit_mismatches == 2
    assert [obj.units for obj in written] == ["count"]
    [message] = warn_messages(caplog)
    assert message == (
        "unit mismatch within the delivery, the first units in string order kept"
        " metric=flights layer=minutes delivery=1"
    )

    caplog.clear()
    rebuild = DeliveryFold(
        json.dumps(twice).encode(),
        DeliveryInfo(1, 1, "minutes"),
        MemoryProjection(),
        warn=False,
    )
    assert len(list(rebuild.writes())) == 1
    assert warn_messages(caplog) == []
    assert any("unit mismatch" in r.getMessage() for r in caplog.records)
