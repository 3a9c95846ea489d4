"""Rebuild, verify and reindex against real SQLite files (specs/storage.md, STORE-n)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import orjson
from _bodies import BASE_US, NOW, TTL, append, body, delivery, point, rows
from hypothesis import given, settings
from hypothesis import strategies as st

from healthlog import objects
from healthlog.folding import OutcomeClass
from healthlog.objects import ObjectKey
from healthlog.storage.journal import Journal
from healthlog.storage.passes import run_pass
from healthlog.storage.rebuild import rebuild_into, reindex, verify
from healthlog.storage.store import Store

HR = ObjectKey("hr", "minutes", BASE_US)


def collide(journal: Journal, store: Store, epoch: int) -> None:
    """A live delivery folded, then a backfill before it with equally complete other values."""
    append(journal, delivery(body({"hr": [point(1, 60)], "steps": [point(2, 10)]})))
    run_pass(journal, store, epoch)
    append(journal, delivery(body({"hr": [point(1, 99)]}), received_at=BASE_US))
    run_pass(journal, store, epoch)


def test_verify_finds_nothing_after_folding_in_journal_order_store_12(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-12: overlapping deliveries folded in journal order equal their rebuild."""
    rich = {"source": "Watch", "context": "walk"}
    for stamp, points in [
        (BASE_US + 3, [point(1, 60), point(2, 61)]),
        (BASE_US + 1, [point(1, 60.0000000000001, **rich), point(61, 70)]),
        (BASE_US + 2, [point(1, 59), point(2, 62, **rich)]),
        (None, [point(2, 63), point(62, 71, **rich)]),
    ]:
        append(journal, delivery(body({"hr": points}), received_at=stamp))

    run_pass(journal, store, epoch)

    assert verify(journal, store) == []


def test_backfill_collision_is_found_and_reindex_repairs_it_store_13(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STORE-13: a backfill that collides with folded content makes verify report the object;
    reindex makes the live objects equal a fresh rebuild."""
    collide(journal, store, epoch)
    live_hash = store.summaries()[HR].hash

    differences = verify(journal, store)

    assert [d.key for d in differences] == [HR]
    assert differences[0].live == live_hash
    assert differences[0].rebuilt not in (None, live_hash)

    assert reindex(journal, store, "reindex") == 1
    assert verify(journal, store) == []
    rebuild_into(journal, tmp_path / "fresh.sqlite")
    with Store(tmp_path / "fresh.sqlite") as fresh:
        assert list(store.iter_objects()) == list(fresh.iter_objects())
    (hr,) = store.iter_objects(metric="hr")
    assert [orjson.loads(raw)["qty"] for raw in objects.decode(hr.body).values()] == [60]


def test_reindex_takes_a_higher_epoch_and_fences_the_folder_store_14(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-14: reindex folds under a higher epoch and releases the lease; the live folder
    holding the old epoch is fenced until it takes the lease again."""
    collide(journal, store, epoch)

    reindex(journal, store, "reindex")
    meta = append(journal, delivery(body({"hr": [point(5, 1)]})))

    lease = store.lease()
    assert (lease.holder, lease.epoch) == (None, epoch + 1)
    assert store.checkpoint()[2] == epoch + 1
    assert store.fold(journal, meta, epoch).outcome_class is OutcomeClass.FENCED
    assert store.outcome(meta.id) is None
    again = store.acquire_lease("folder", now=NOW, ttl=TTL)
    assert again == epoch + 2
    assert store.fold(journal, meta, again).outcome_class is OutcomeClass.DONE


def test_swap_in_announces_only_changed_objects_and_keeps_history_store_15(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-15: reindex appends object.changed only for objects whose hash changed (a vanished
    one with zero points), after the existing events, with no gap; a second reindex adds none."""
    append(
        journal,
        delivery(body({"hr": [point(1, 60)]}), received_at=BASE_US + 1, aggregation="hours"),
    )
    sparse = body({"weight": [point(30, 80.5)]})
    append(journal, delivery(sparse, received_at=BASE_US + 3, aggregation=None))
    run_pass(journal, store, epoch)
    late = body({"steps": [point(2, 10), point(3, 11)]})
    append(journal, delivery(late, received_at=BASE_US + 2, aggregation="minutes"))
    run_pass(journal, store, epoch)
    before = sorted(rows(store.path)["events"])
    unchanged = {k: s.hash for k, s in store.summaries().items() if k.metric != "weight"}

    assert reindex(journal, store, "reindex") == 2

    after = sorted(rows(store.path)["events"])
    assert after[: len(before)] == before
    assert [seq for seq, *_ in after] == list(range(1, len(after) + 1))
    added = [e.payload for e in store.events_after(before[-1][0], 1000)]
    summaries = store.summaries()
    weight = ObjectKey("weight", "minutes", BASE_US)
    assert sorted(added, key=lambda p: p["layer"]) == [
        {
            "metric": "weight",
            "layer": "hours",
            "hour": "2024-03-01T00:00:00Z",
            "hash": None,
            "points": 0,
            "delivery_id": None,
        },
        {
            "metric": "weight",
            "layer": "minutes",
            "hour": "2024-03-01T00:00:00Z",
            "hash": summaries[weight].hash.hex(),
            "points": 1,
            "delivery_id": None,
        },
    ]
    assert {k: summaries[k].hash for k in unchanged} == unchanged

    assert reindex(journal, store, "reindex") == 0
    assert sorted(rows(store.path)["events"]) == after


spec_point = st.tuples(
    st.sampled_from(["hr", "steps"]),
    st.sampled_from([0, 1, 60]),
    st.sampled_from([1, 2, 2.0000000000001]),
    st.booleans(),
)
spec_delivery = st.tuples(
    st.none() | st.integers(0, 4),
    st.sampled_from(["minutes", None]),
    st.sampled_from(["A", "B"]),
    st.lists(spec_point, min_size=1, max_size=6),
)


@settings(max_examples=30, deadline=None)
@given(st.lists(spec_delivery, min_size=2, max_size=6))
def test_any_deliveries_folded_in_journal_order_verify_clean_store_16(
    specs: list[tuple[int | None, str | None, str, list[tuple[str, int, float, bool]]]],
) -> None:
    """STORE-16: random overlapping deliveries folded in journal order verify clean."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Journal(Path(tmp) / "journal.sqlite") as journal,
        Store(Path(tmp) / "store.sqlite") as store,
    ):
        for offset, aggregation, automation, points in specs:
            metrics: dict[str, list[dict[str, Any]]] = {}
            for metric, minute, qty, rich in points:
                extra = {"source": "Watch", "context": "run"} if rich else {}
                metrics.setdefault(metric, []).append(point(minute, qty, **extra))
            stamp = None if offset is None else BASE_US + offset
            append(
                journal,
                delivery(
                    body(metrics), received_at=stamp, aggregation=aggregation, automation=automation
                ),
            )
        held = store.acquire_lease("folder", now=NOW, ttl=TTL)
        assert held is not None
        assert run_pass(journal, store, held).stopped_because == "empty"

        assert verify(journal, store) == []
