"""Seals (specs/seal.md): journaled, folded in journal order, reproduced by every rebuild."""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _bodies import BASE_US, NOW, TTL, append, body, delivery, point, rows
from _sqlite_steps import counted_steps
from _summaries import summaries
from hypothesis import given, settings
from hypothesis import strategies as st

from healthlog.folding import OutcomeClass
from healthlog.objects import ObjectKey
from healthlog.seals import (
    SEAL_CLIENT,
    SEAL_CONTENT_TYPE,
    Seal,
    SealError,
    covered,
    decode,
    folded_into,
)
from healthlog.storage import _partition
from healthlog.storage.journal import DeliveryMeta, Journal, NewDelivery
from healthlog.storage.passes import run_pass
from healthlog.storage.rebuild import rebuild_into, reindex, verify
from healthlog.storage.store import MARK_SEALED, MIGRATIONS, UNSEALED_INDEX, Store
from healthlog.storage.tokens import TokenError, Tokens, authenticate
from healthlog.timestamps import US_PER_HOUR

if TYPE_CHECKING:
    from conftest import RunCli

HOUR = US_PER_HOUR
# Points at minutes 1 and 61: hours 0 and 1 after BASE_US.
TWO_HOURS = body({"hr": [point(1, 60), point(61, 61)], "steps": [point(2, 5)]})


def sealing(seal: Seal) -> NewDelivery:
    return NewDelivery(seal.encode(), SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE)


def flags(store: Store) -> dict[tuple[str, int], bool]:
    """(metric, hour offset from BASE_US in hours) -> sealed."""
    return {
        (s.key.metric, (s.key.hour - BASE_US) // HOUR): s.sealed for s in summaries(store).values()
    }


def outcome_of(store: Store, meta: DeliveryMeta | int) -> tuple[str, str | None, dict[str, int]]:
    outcome = store.outcome(meta if isinstance(meta, int) else meta.id)
    assert outcome is not None
    return outcome.status, outcome.reason, outcome.counters


def test_a_seal_marks_the_stored_objects_it_covers_seal_1(
    journal: Journal, store: Store, epoch: int
) -> None:
    """SEAL-1: the hours that end by `before`, of the metric and layer given, are marked, each
    with an `object.changed` event that keeps its hash; the seal's counters stay zero."""
    append(journal, delivery(TWO_HOURS))
    run_pass(journal, store, epoch)
    hashes = {s.key: s.hash for s in summaries(store).values()}
    seal = append(journal, sealing(Seal(BASE_US + HOUR, "hr", "minutes")))
    last = store.events_after(0, 1000)[-1].seq

    run_pass(journal, store, epoch)

    assert flags(store) == {("hr", 0): True, ("hr", 1): False, ("steps", 0): False}
    status, reason, counters = outcome_of(store, seal)
    assert (status, reason) == ("parsed", None)
    assert not any(counters.values())
    changed = [e.payload for e in store.events_after(last, 1000) if e.kind == "object.changed"]
    assert changed == [
        {
            "metric": "hr",
            "layer": "minutes",
            "hour": "2024-03-01T00:00:00Z",
            "hash": hashes[ObjectKey("hr", "minutes", BASE_US)].hex(),
            "points": 1,
            "delivery_id": seal.id,
        }
    ]
    unfiltered = append(journal, sealing(Seal(BASE_US + 2 * HOUR, layer="hours")))
    run_pass(journal, store, epoch)
    assert outcome_of(store, unfiltered)[0] == "parsed"
    assert flags(store) == {("hr", 0): True, ("hr", 1): False, ("steps", 0): False}


def test_a_later_write_to_a_sealed_hour_is_saved_and_counted_seal_2(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """SEAL-2: after a seal, a write to a covered hour (a stored object, or a new one) is saved,
    sealed, counted in `sealed_writes` and logged at WARNING; other hours are not."""
    append(journal, delivery(TWO_HOURS))
    append(journal, sealing(Seal(BASE_US + 2 * HOUR)))
    run_pass(journal, store, epoch)
    late = body({"hr": [point(3, 62), point(121, 63)], "weight": [point(4, 80)]})
    meta = append(journal, delivery(late))

    with caplog.at_level(logging.WARNING, logger="healthlog.fold"):
        run_pass(journal, store, epoch)

    assert flags(store) == {
        ("hr", 0): True,
        ("hr", 1): True,
        ("hr", 2): False,
        ("steps", 0): True,
        ("weight", 0): True,
    }
    status, _, counters = outcome_of(store, meta)
    assert status == "parsed"
    assert counters["sealed_writes"] == 2
    assert counters["points_new"] == 3
    warned = [r.getMessage() for r in caplog.records if "sealed" in r.getMessage()]
    assert len(warned) == 2
    assert all("62" not in message and "80" not in message for message in warned)


def seal_journal(journal: Journal) -> None:
    """Deliveries, seals between them, late writes, and a seal that cannot be read."""
    append(journal, delivery(TWO_HOURS))
    append(journal, delivery(body({"hr": [point(m, m % 9) for m in range(120, 300, 2)]})))
    append(journal, sealing(Seal(BASE_US + 2 * HOUR, "hr")))
    append(journal, delivery(body({"hr": [point(5, 70), point(200, 71)], "steps": [point(7, 1)]})))
    append(journal, NewDelivery(b'{"seal": 1}', SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))
    append(journal, sealing(Seal(BASE_US + 4 * HOUR)))
    append(journal, delivery(body({"steps": [point(9, 2), point(400, 3)]})))


@pytest.mark.parametrize("workers", [2, 3])
def test_rebuilds_reproduce_the_seals_seal_3(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, workers: int
) -> None:
    """SEAL-3: verify is clean after seals; a reindex changes nothing; a partitioned rebuild
    equals the one-process rebuild (objects with their flags, outcomes with their counters)."""
    seal_journal(journal)
    run_pass(journal, store, epoch)
    store.release_lease("folder", epoch)

    assert verify(journal, store) == []
    live = rows(store.path)
    assert reindex(journal, store, "reindex") == 0
    reindexed = rows(store.path)

    rebuild_into(journal, tmp_path / "one.sqlite", workers=1)
    rebuild_into(journal, tmp_path / "many.sqlite", workers=workers)
    one, many = rows(tmp_path / "one.sqlite"), rows(tmp_path / "many.sqlite")
    for table in ("objects", "outcomes", "seals", "checkpoint"):
        assert one[table] == many[table]
    # The reindex swapped in what the rebuild has, which is what the live folder had: the
    # same objects and seals, the same outcomes but for the epoch that recorded them.
    assert reindexed["objects"] == live["objects"] == one["objects"]
    assert reindexed["seals"] == live["seals"] == one["seals"] != []
    assert [row[:-1] for row in reindexed["outcomes"]] == [row[:-1] for row in live["outcomes"]]
    assert sorted(sealed for *_, sealed, _ in one["objects"]) == [0, 0, 1, 1, 1, 1, 1]
    assert sum(json.loads(counters)["sealed_writes"] for *_, counters, _ in one["outcomes"]) == 2


def test_a_seal_cannot_be_forged_seal_4(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """SEAL-4: no token may be named `cli:...`, and one so named before that authenticates
    nothing; a seal body sent by a client is folded as a delivery and seals nothing."""
    with Tokens(tmp_path / "tokens.sqlite") as tokens:
        with pytest.raises(TokenError, match="reserved"):
            tokens.add(SEAL_CLIENT)
        legacy = tokens.add("phone")
        with closing(sqlite3.connect(tokens.path)) as conn, conn:
            conn.execute("UPDATE tokens SET name = ? WHERE name = 'phone'", (SEAL_CLIENT,))
        assert authenticate(legacy, tokens.hashes()) is None
    append(journal, delivery(TWO_HOURS))
    forged = Seal(BASE_US + 10 * HOUR).encode()
    append(journal, NewDelivery(forged, "phone", content_type=SEAL_CONTENT_TYPE))

    run_pass(journal, store, epoch)

    assert not any(flags(store).values())
    assert summaries(store)
    assert rows(store.path)["seals"] == []


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"seal": 1}',
        b'{"seal": {"before": "soon"}}',
        b'{"seal": {"before": "2024-03-01T00:00:00Z", "metric": ""}}',
        b'{"seal": {"before": "2024-03-01T00:00:00Z", "colour": "red"}}',
        b'{"seal": {"before": "2024-03-01T00:00:00Z"}, "more": 1}',
        b'{"seal": {"before": "2024-03-02T00:00:00Z"}, "more": {"before": "2024-03-02"}}',
    ],
)
def test_an_unreadable_seal_fails_and_seals_nothing_seal_5(
    journal: Journal, store: Store, epoch: int, payload: bytes
) -> None:
    """SEAL-5: a journaled seal that cannot be read is `failed` with a reason quoting nothing
    of it, and seals nothing."""
    with pytest.raises(SealError):
        decode(payload)
    append(journal, delivery(TWO_HOURS))
    meta = append(journal, NewDelivery(payload, SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))

    report = run_pass(journal, store, epoch)

    assert report.reached_end
    status, reason, _ = outcome_of(store, meta)
    assert status == "failed"
    assert reason is not None
    assert reason.startswith("seal body")
    assert not any(flags(store).values())


def test_verify_finds_a_flag_the_journal_does_not_give_seal_7(
    journal: Journal, store: Store, epoch: int
) -> None:
    """SEAL-7: an object sealed in the store without a journaled seal differs from the
    rebuild, though its content is the same; a reindex swaps in the rebuild's flag and
    announces the object as changed."""
    append(journal, delivery(TWO_HOURS))
    run_pass(journal, store, epoch)
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("UPDATE objects SET sealed = 1 WHERE metric = 'steps'")

    differences = verify(journal, store)

    assert [(d.key.metric, d.live == d.rebuilt) for d in differences] == [("steps", True)]
    last = store.events_after(0, 1000)[-1].seq
    store.release_lease("folder", epoch)
    assert reindex(journal, store, "reindex") == 1
    assert not any(flags(store).values())
    announced = [e.payload["metric"] for e in store.events_after(last, 1000)]
    assert announced == ["steps"]
    assert verify(journal, store) == []


def test_a_sealed_object_never_loses_its_flag_seal_11(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """SEAL-11: every later write keeps the flag an object has (a re-send that changes nothing,
    units it lacked, changed and added points), and so do a reindex and a partitioned rebuild;
    a write keeps even a flag no seal gives, counting as a sealed write."""
    heart = ("hr", 0)
    append(journal, delivery(body({"hr": [point(1, 60)], "steps": [point(2, 5)]}, units="")))
    append(journal, sealing(Seal(BASE_US + HOUR, "hr")))
    run_pass(journal, store, epoch)
    assert flags(store) == {heart: True, ("steps", 0): False}
    later = [
        body({"hr": [point(1, 60)]}, units=""),
        body({"hr": [point(1, 60)]}),
        body({"hr": [point(1, 61), point(3, 62)]}),
    ]
    sealed_writes = []
    for payload in later:
        meta = append(journal, delivery(payload))
        run_pass(journal, store, epoch)
        assert flags(store)[heart]
        sealed_writes.append(outcome_of(store, meta)[2]["sealed_writes"])
    assert sealed_writes == [0, 1, 1]
    summary = summaries(store)[ObjectKey("hr", "minutes", BASE_US)]
    assert (summary.units, summary.points) == ("count", 2)

    store.release_lease("folder", epoch)
    assert reindex(journal, store, "reindex") == 0
    assert flags(store)[heart]
    rebuild_into(journal, tmp_path / "two.sqlite", workers=2)
    rebuilt = rows(tmp_path / "two.sqlite")["objects"]
    assert [(metric, sealed) for metric, *_, sealed, _ in rebuilt] == [("hr", 1), ("steps", 0)]

    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("UPDATE objects SET sealed = 1 WHERE metric = 'steps'")
    meta = append(journal, delivery(body({"steps": [point(4, 6)]})))
    epoch = store.acquire_lease("folder", now=BASE_US, ttl=HOUR)
    assert epoch is not None
    run_pass(journal, store, epoch)
    assert flags(store) == {heart: True, ("steps", 0): True}
    assert outcome_of(store, meta)[2]["sealed_writes"] == 1


def test_seal_from_the_command_line_seal_6(run_cli: RunCli, tmp_path: Path) -> None:
    """SEAL-6: `healthlog seal` journals a seal and waits until it is folded; `--layer
    records` names the section layer; an unreadable `--before` is a usage error."""
    data = tmp_path / "data"
    payload = tmp_path / "day.json"
    payload.write_bytes(TWO_HOURS)
    assert run_cli("import", "--data", data, "--aggregation", "minutes", payload).code == 0

    sealed = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z", "--metric", "hr")
    records = run_cli("seal", "--data", data, "--before", "2024-03-02", "--layer", "records")
    wrong = run_cli("seal", "--data", data, "--before", "soon")
    empty = run_cli("seal", "--data", data, "--before", "2024-03-02", "--metric", "")

    assert sealed.code == 0, sealed.err
    assert "as delivery 2" in sealed.err
    assert records.code == 0, records.err
    assert wrong.code == 2
    assert "not a timestamp" in wrong.err
    assert empty.code == 2
    assert "--metric" in empty.err
    with Store(data / "store.sqlite") as store:
        assert flags(store) == {("hr", 0): True, ("hr", 1): False, ("steps", 0): False}
        assert [outcome_of(store, n)[0] for n in (2, 3)] == ["parsed", "parsed"]
    with Journal(data / "journal.sqlite") as journal:
        assert len(journal.iter_order()) == 3
    assert run_cli("verify", "--data", data).code == 0


def test_seal_says_its_outcome_once_folded_seal_17(run_cli: RunCli, tmp_path: Path) -> None:
    """SEAL-17: `healthlog seal`, once its seal is folded, says the outcome on stderr as
    `import` does (`delivery 2: parsed`); with `--no-wait` it says only what it journaled."""
    data = tmp_path / "data"
    payload = tmp_path / "day.json"
    payload.write_bytes(TWO_HOURS)
    assert run_cli("import", "--data", data, "--aggregation", "minutes", payload).code == 0

    sealed = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z")
    unwaited = run_cli("seal", "--data", data, "--before", "2024-03-01T02:00:00Z", "--no-wait")

    assert sealed.code == 0, sealed.err
    assert sealed.err.splitlines() == [
        "journaled the seal of what ends by 2024-03-01T01:00:00Z as delivery 2",
        "delivery 2: parsed",
    ]
    assert unwaited.code == 0, unwaited.err
    assert unwaited.err.splitlines() == [
        "journaled the seal of what ends by 2024-03-01T02:00:00Z as delivery 3"
    ]


def test_a_seal_of_hours_not_over_is_refused_seal_20(run_cli: RunCli, tmp_path: Path) -> None:
    """SEAL-20: `healthlog seal --before` a later instant than now (a year mistyped) exits 2
    saying so and journals nothing, so no later write to those hours counts as sealed; a seal
    before now is taken as ever."""
    data = tmp_path / "data"
    payload = tmp_path / "day.json"
    payload.write_bytes(TWO_HOURS)
    assert run_cli("import", "--data", data, "--aggregation", "minutes", payload).code == 0

    future = run_cli("seal", "--data", data, "--before", "2999-01-01T00:00:00Z")
    past = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z", "--no-wait")

    assert future.code == 2
    assert "2999-01-01T00:00:00Z is later than now" in future.err
    assert past.code == 0, past.err
    with Journal(data / "journal.sqlite") as journal:
        assert len(journal.iter_order()) == 2


def test_a_seal_of_a_metric_never_stored_says_so_seal_21(run_cli: RunCli, tmp_path: Path) -> None:
    """SEAL-21: `healthlog seal --metric` naming a metric no object has (a name mistyped) says
    on stderr that it marks none, after its outcome, with `--no-wait` too; a seal of a stored
    metric, or of every metric, says no such line."""
    data = tmp_path / "data"
    payload = tmp_path / "day.json"
    payload.write_bytes(TWO_HOURS)
    assert run_cli("import", "--data", data, "--aggregation", "minutes", payload).code == 0

    typo = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z", "--metric", "HR")
    unwaited = run_cli(
        "seal",
        "--data",
        data,
        "--before",
        "2024-03-01T01:00:00Z",
        "--metric",
        "hr",
        "--layer",
        "records",
        "--no-wait",
    )
    stored = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z", "--metric", "hr")
    every = run_cli("seal", "--data", data, "--before", "2024-03-01T01:00:00Z")

    assert typo.code == 0, typo.err
    assert typo.err.splitlines() == [
        "journaled the seal of what ends by 2024-03-01T01:00:00Z of metric HR as delivery 2",
        "delivery 2: parsed",
        "seal: no object of metric HR is stored, so the seal marks none: names are as"
        " `healthlog export` prints them (heart_rate, minutes)",
    ]
    assert unwaited.code == 0, unwaited.err
    assert unwaited.err.splitlines()[-1].startswith(
        "seal: no object of metric hr layer records is stored"
    )
    assert [len(run.err.splitlines()) for run in (stored, every)] == [2, 2]
    with Store(data / "store.sqlite") as store:
        assert flags(store) == {("hr", 0): True, ("hr", 1): False, ("steps", 0): True}


def test_the_stream_carries_the_flag_seal_8(journal: Journal, store: Store, epoch: int) -> None:
    """SEAL-8: the replay stream's page shows a sealed object's state with its flag set."""
    append(journal, delivery(TWO_HOURS))
    append(journal, sealing(Seal(BASE_US + HOUR, "steps")))
    run_pass(journal, store, epoch)

    states = [
        (event.payload["delivery_id"], state.sealed)
        for event, state in store.replay_page(0, 100, 1 << 20)
        if event.kind == "object.changed" and state is not None and state.key.metric == "steps"
    ]

    assert states == [(1, True), (2, True)]


def test_how_late_hours_still_change_seal_9(journal: Journal, store: Store, epoch: int) -> None:
    """SEAL-9: a fold reports, for each object it changed whose hour had ended when the
    delivery was received, how long after; an hour not yet over, or an unchanged object, is
    not reported."""
    received = BASE_US + HOUR + 20 * 60 * 1_000_000
    meta = append(journal, delivery(TWO_HOURS, received_at=received))
    again = append(journal, delivery(TWO_HOURS, received_at=received + 1))

    reports = [store.fold(journal, m, epoch) for m in (meta, again)]

    assert [r.outcome_class for r in reports] == [OutcomeClass.DONE, OutcomeClass.DONE]
    assert reports[0].late_s == (1200.0, 1200.0)
    assert reports[1].late_s == ()


_SEALS = st.tuples(
    st.sampled_from([1, 2, 3]),
    st.sampled_from([None, "hr", "steps"]),
    st.sampled_from([None, "minutes", "hours"]),
)
_POINTS = st.lists(
    st.tuples(st.sampled_from(["hr", "steps"]), st.sampled_from([0, 1, 60, 130]), st.booleans()),
    min_size=1,
    max_size=5,
)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.one_of(_SEALS, _POINTS), min_size=2, max_size=7))
def test_any_seals_among_any_deliveries_rebuild_the_same_seal_10(
    steps: list[tuple[int, str | None, str | None] | list[tuple[str, int, bool]]],
) -> None:
    """SEAL-10 (property): random deliveries with random seals among them fold live to what
    `verify` rebuilds, and rebuild the same in one process and partitioned."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Journal(Path(tmp) / "journal.sqlite") as journal,
        Store(Path(tmp) / "store.sqlite") as store,
    ):
        for step in steps:
            if isinstance(step, tuple):
                hours, metric, layer = step
                append(journal, sealing(Seal(BASE_US + hours * HOUR, metric, layer)))
            else:
                metrics: dict[str, list[dict[str, object]]] = {}
                for name, minute, rich in step:
                    extra = {"source": "Watch"} if rich else {}
                    metrics.setdefault(name, []).append(point(minute, minute % 7, **extra))
                append(journal, delivery(body(metrics)))
        epoch = store.acquire_lease("folder", now=BASE_US, ttl=HOUR)
        assert epoch is not None
        assert run_pass(journal, store, epoch).reached_end
        store.release_lease("folder", epoch)

        _rebuilds_agree(journal, store, Path(tmp))


def _rebuilds_agree(
    journal: Journal, store: Store, scratch: Path
) -> dict[str, list[tuple[Any, ...]]]:
    """Assert that ``verify`` finds the live store equal to a rebuild and that rebuilds into
    ``scratch`` by one worker and by two agree table by table; the rows of the first."""
    assert verify(journal, store) == []
    rebuild_into(journal, scratch / "one.sqlite", workers=1)
    rebuild_into(journal, scratch / "two.sqlite", workers=2)
    one, two = rows(scratch / "one.sqlite"), rows(scratch / "two.sqlite")
    for table in ("objects", "outcomes", "seals", "checkpoint"):
        assert one[table] == two[table]
    return one


def test_a_fold_reads_one_seal_per_metric_and_layer_seal_18(
    journal: Journal, store: Store, epoch: int
) -> None:
    """SEAL-18: a nightly seal for a year (365 seals of all metrics, each a day later, and one
    of `hr` alone) leaves one row per metric and layer in `seals`, a seal ending earlier than
    one kept adds none; a fold after them takes the SQLite steps it took after the first seal,
    and seals what those seals seal."""
    day = 24 * HOUR
    minutes_a_day = 24 * 60
    base = datetime.fromtimestamp(BASE_US / 1e6, UTC)
    append(journal, sealing(Seal(BASE_US + day)))
    run_pass(journal, store, epoch)

    def folded_steps(offset: int) -> tuple[int, dict[str, int]]:
        # Three metrics of 48 hours: the first day of each sealed, the second day not.
        minutes = range(0, 48 * 60, 60)
        stamps = [base + timedelta(minutes=offset + i) for i in minutes]
        points = {
            m: [{"date": f"{t:%Y-%m-%d %H:%M:%S} +0000", "qty": 1} for t in stamps] for m in "abc"
        }
        meta = append(journal, delivery(body(points)))
        report, steps = counted_steps(
            store._conn, lambda: store.fold(journal, meta, epoch), every=10
        )
        assert report.outcome_class is OutcomeClass.DONE
        return steps, outcome_of(store, meta)[2]

    first, counters = folded_steps(400 * minutes_a_day)
    assert counters["sealed_writes"] == 0
    for n in range(2, 366):
        append(journal, sealing(Seal(BASE_US + n * day)))
    append(journal, sealing(Seal(BASE_US + 10 * day)))
    append(journal, sealing(Seal(BASE_US + 3 * day, "hr")))
    run_pass(journal, store, epoch)

    after, _ = folded_steps(402 * minutes_a_day)
    # A second row (the seal of `hr`): a few steps more (14,710 against 14,660; 16,540 when
    # every seal was kept and read).
    assert after <= first + 10, (first, after)
    with closing(sqlite3.connect(store.path)) as conn:
        kept = conn.execute("SELECT before, metric, layer FROM seals ORDER BY before").fetchall()
    assert kept == [(BASE_US + 3 * day, "hr", None), (BASE_US + 365 * day, None, None)]
    _, counters = folded_steps(364 * minutes_a_day)
    assert counters["sealed_writes"] == 3 * 24
    assert verify(journal, store) == []


def test_a_partitioned_rebuild_hands_its_workers_one_seal_per_metric_and_layer_seal_19(
    tmp_path: Path,
) -> None:
    """SEAL-19: the seals a partitioned rebuild hands its workers with each share are the
    latest of each metric and layer (365 nightly seals of every metric, with one of `hr` and
    one ending earlier among them: two), which cover exactly what all of them cover; and a
    journal of such seals among deliveries rebuilds in two workers as in one process."""
    day = 24 * HOUR
    nightly = [Seal(BASE_US + n * day) for n in range(1, 366)]
    every = [*nightly[:100], Seal(BASE_US + 3 * day, "hr"), Seal(BASE_US + 50 * day)]
    every += nightly[100:]
    kept: tuple[Seal, ...] = ()
    for n, seal in enumerate(every, start=1):
        kept = folded_into(kept, seal)
        for metric in ("hr", "steps"):
            for hour in range(0, 400 * 24, 61):
                key = ObjectKey(metric, "minutes", BASE_US + hour * HOUR)
                assert covered(kept, key) == covered(every[:n], key)
    assert sorted(kept, key=lambda seal: seal.before) == [
        Seal(BASE_US + 3 * day, "hr"),
        Seal(BASE_US + 365 * day),
    ]

    with Journal(tmp_path / "journal.sqlite") as journal:
        for n, seal in enumerate(every):
            append(journal, sealing(seal))
            if n % 30 == 0:
                minute = (n % 28) * 24 * 60
                append(journal, delivery(body({"hr": [point(minute, n), point(minute + 61, n)]})))
        rebuild_into(journal, tmp_path / "one.sqlite", workers=1)
        rebuild_into(journal, tmp_path / "two.sqlite", workers=2)
    one, two = rows(tmp_path / "one.sqlite"), rows(tmp_path / "two.sqlite")
    for table in ("objects", "outcomes", "seals", "checkpoint"):
        assert one[table] == two[table]
    assert sum(json.loads(row[-2])["sealed_writes"] for row in one["outcomes"]) > 0


def instant(text: str) -> int:
    """The app's ``yyyy-MM-dd HH:mm:ss Z`` stamp as UTC microseconds."""
    return int(datetime.strptime(text, "%Y-%m-%d %H:%M:%S %z").timestamp()) * 1_000_000


def totals(dates: list[str], offset: str, qty: float) -> bytes:
    """A body of one `step_count` total per date (`yyyy-MM-dd`), stamped at its local midnight
    at ``offset`` (`+0100`), as the app stamps its `days`, `weeks`, `months` and `years`."""
    return body({"step_count": [{"date": f"{d} 00:00:00 {offset}", "qty": qty} for d in dates]})


def sealed_totals(store: Store, dates: list[str], offset: str) -> dict[str, bool]:
    """Which of the totals of ``dates`` (stamped at ``offset``) are sealed."""
    by_hour = {s.key.hour: s.sealed for s in summaries(store).values()}
    return {d: by_hour[instant(f"{d} 00:00:00 {offset}")] for d in dates}


FEBRUARY = ["2024-02-05", "2024-02-06", "2024-02-07"]
# The schema version before the store's migration to the seals' rule (STORE-104).
BEFORE_SEALS_RULE = next(v for v, script in enumerate(MIGRATIONS) if "temp.unsealed" in script)


@pytest.mark.parametrize(
    ("offset", "sealed"),
    [("+0100", ["2024-02-05", "2024-02-06"]), ("-0500", ["2024-02-05"]), ("+1000", FEBRUARY[:2])],
)
def test_a_seal_covers_a_daily_total_once_its_day_has_ended_seal_22(
    journal: Journal,
    store: Store,
    epoch: int,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    offset: str,
    sealed: list[str],
) -> None:
    """SEAL-22: daily totals stamped at local midnight (+01:00, -05:00, +10:00) and a seal
    before 2024-02-07T00:00:00Z: it covers a day once the day has ended wherever the user
    is, its stamp's hour plus 25 h (a DST day) at or before the instant; a recount of every
    day then counts a sealed write, and a WARNING, for each day covered alone; verify finds
    nothing, and the rebuilds in one process and in two workers hold the live objects."""
    append(journal, delivery(totals(FEBRUARY, offset, 100), aggregation="days"))
    append(journal, sealing(Seal(instant("2024-02-07 00:00:00 +0000"))))
    run_pass(journal, store, epoch)
    assert sealed_totals(store, FEBRUARY, offset) == {d: d in sealed for d in FEBRUARY}

    recount = append(journal, delivery(totals(FEBRUARY, offset, 200), aggregation="days"))
    with caplog.at_level(logging.WARNING, logger="healthlog.fold"):
        run_pass(journal, store, epoch)

    assert outcome_of(store, recount)[2]["sealed_writes"] == len(sealed)
    warned = [r for r in caplog.records if "sealed" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING] * len(sealed)
    assert sealed_totals(store, FEBRUARY, offset) == {d: d in sealed for d in FEBRUARY}
    store.release_lease("folder", epoch)
    assert verify(journal, store) == []
    rebuild_into(journal, tmp_path / "one.sqlite", workers=1)
    rebuild_into(journal, tmp_path / "two.sqlite", workers=2)
    one, two = rows(tmp_path / "one.sqlite"), rows(tmp_path / "two.sqlite")
    for table in ("objects", "outcomes", "seals", "checkpoint"):
        assert one[table] == two[table]
    assert one["objects"] == rows(store.path)["objects"]


@pytest.mark.parametrize("offset", ["+0100", "-0500", "+1000"])
def test_a_seal_covers_a_week_or_month_once_it_has_ended_seal_23(
    journal: Journal, store: Store, epoch: int, offset: str
) -> None:
    """SEAL-23: weekly totals (stamped at Monday's local midnight) and monthly ones (the 1st's)
    are covered once their stamp's hour plus 7 days and 1 h, or 31 days and 1 h, is at or before
    the seal's instant: a seal before 2024-03-01T00:00:00Z covers the weeks of 29 January and
    12 February and January, not the week of 26 February nor February (29 days, but a month
    can have 31); one before 2024-03-03T06:00:00Z covers February too, whatever the offset."""
    weeks = ["2024-01-29", "2024-02-12", "2024-02-26"]
    months = ["2024-01-01", "2024-02-01", "2024-03-01"]
    append(journal, delivery(totals(weeks, offset, 70_000), aggregation="weeks"))
    append(journal, delivery(totals(months, offset, 300_000), aggregation="months"))
    march = instant("2024-03-01 00:00:00 +0000")
    append(journal, sealing(Seal(march, "step_count")))
    run_pass(journal, store, epoch)

    by_key = {(s.key.layer, s.key.hour): s.sealed for s in summaries(store).values()}

    def flags_of(layer: str, dates: list[str]) -> list[bool]:
        return [by_key[(layer, instant(f"{d} 00:00:00 {offset}"))] for d in dates]

    assert flags_of("weeks", weeks) == [True, True, False]
    assert flags_of("months", months) == [True, False, False]

    append(journal, sealing(Seal(instant("2024-03-03 01:00:00 +0000") + 5 * HOUR)))
    run_pass(journal, store, epoch)
    by_key = {(s.key.layer, s.key.hour): s.sealed for s in summaries(store).values()}
    assert flags_of("months", months) == [True, True, False]
    store.release_lease("folder", epoch)
    assert verify(journal, store) == []


@pytest.mark.parametrize(
    ("layer", "span"),
    [
        ("seconds", HOUR),
        ("minutes", HOUR),
        ("hours", HOUR),
        ("default", HOUR),
        ("records", HOUR),
        ("days", 25 * HOUR),
        ("weeks", (7 * 24 + 1) * HOUR),
        ("months", (31 * 24 + 1) * HOUR),
        ("years", (366 * 24 + 1) * HOUR),
    ],
)
def test_a_seal_covers_each_layer_once_its_longest_period_has_ended_seal_24(
    layer: str, span: int
) -> None:
    """SEAL-24: an object of each layer is covered once its hour plus the longest period of
    its layer has ended (1 h; days 25 h; weeks 7 days 1 h; months 31 days 1 h; years 366 days
    1 h): at that instant, not a microsecond before; the metric and layer still have to
    match."""
    key = ObjectKey("step_count", layer, BASE_US)
    assert Seal(BASE_US + span).covers(key)
    assert not Seal(BASE_US + span - 1).covers(key)
    assert Seal(BASE_US + span, "step_count", layer).covers(key)
    assert not Seal(BASE_US + span, "hr").covers(key)
    assert not Seal(BASE_US + span, layer="other").covers(key)


def test_a_store_sealed_by_the_hour_alone_is_upgraded_store_104(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-104: a store folded by the rule before SEAL-22 (a seal covering any object whose
    hour had ended, and a recount of the day after counted a sealed write), at +01:00, with
    an object flagged without any seal (SEAL-7): opened, it takes the flag off the total of 7
    February alone and announces it with one `object.changed` event; verify then finds only
    the flag no seal gave, and a reindex changes that one object; the sealed write recorded
    for the recount stays in its outcome until the reindex records the rebuild's counters."""
    append(journal, delivery(totals(FEBRUARY, "+0100", 100), aggregation="days"))
    append(journal, delivery(TWO_HOURS))
    append(journal, sealing(Seal(instant("2024-02-07 00:00:00 +0000"))))
    recount = append(journal, delivery(totals(FEBRUARY, "+0100", 200), aggregation="days"))
    run_pass(journal, store, epoch)
    store.release_lease("folder", epoch)
    seventh = instant("2024-02-07 00:00:00 +0100")
    store.close()
    # What the older healthlog left: every total whose hour had ended sealed, the recount's
    # write to 7 February counted, and a flag no seal gave; its schema the one before that rule.
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("UPDATE objects SET sealed = 1 WHERE layer = 'days' OR metric = 'steps'")
        conn.execute(
            "UPDATE outcomes SET counters = json_set(counters, '$.sealed_writes', 3)"
            " WHERE delivery_id = ?",
            (recount.id,),
        )
        conn.execute(f"PRAGMA user_version = {BEFORE_SEALS_RULE}")
    older = rows(store.path)

    with Store(store.path) as upgraded:
        assert sealed_totals(upgraded, FEBRUARY, "+0100") == {
            "2024-02-05": True,
            "2024-02-06": True,
            "2024-02-07": False,
        }
        events = upgraded.events_after(0, 1000)
        announced = [e.payload for e in events if e.id.startswith("upgrade.")]
        hashes = {s.key.hour: s.hash for s in summaries(upgraded).values()}
        assert announced == [
            {
                "metric": "step_count",
                "layer": "days",
                "hour": "2024-02-06T23:00:00Z",
                "hash": hashes[seventh].hex(),
                "points": 1,
                "delivery_id": None,
            }
        ]
        assert events[-1].tag is not None
        assert outcome_of(upgraded, recount)[2]["sealed_writes"] == 3
        differences = verify(journal, upgraded)
        assert [(d.key.metric, d.live == d.rebuilt) for d in differences] == [("steps", True)]
        assert reindex(journal, upgraded, "reindex") == 1
        assert outcome_of(upgraded, recount)[2]["sealed_writes"] == 2
        assert verify(journal, upgraded) == []
    assert older["seals"] == rows(store.path)["seals"]


README = Path(__file__).resolve().parent.parent / "README.md"
# The command of the README's nightly seal, as the service's user on the README's paths.
NIGHTLY = "sudo -u healthlog /opt/healthlog/.venv/bin/healthlog seal --data /srv/healthlog "


def test_the_readme_s_nightly_seal_seals_yesterday_s_total_not_today_s_seal_25(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """SEAL-25: the README's nightly seal, run as it is written (its command and paths put
    in place of this test's), on daily totals of the last four days stamped at +01:00: it
    says what it journaled, `journaled the seal of what ends by` the last midnight UTC, and
    seals every day before that midnight, yesterday's included, and not today's; `verify`
    exits 0."""
    (line,) = [line for line in README.read_text().splitlines() if line.startswith(NIGHTLY)]
    data = tmp_path / "data"
    today = datetime.now(UTC).date()
    dates = [(today - timedelta(days=n)).isoformat() for n in (3, 2, 1, 0)]
    payload = tmp_path / "days.json"
    payload.write_bytes(totals(dates, "+0100", 4_000))
    assert run_cli("import", "--data", data, "--aggregation", "days", payload).code == 0
    command = line.replace(NIGHTLY.split(" seal ")[0], f"{sys.executable} -m healthlog.cli")
    command = command.replace("/srv/healthlog", os.fspath(data))
    env = {name: value for name, value in os.environ.items() if name != "HEALTHLOG_DATA"}

    nightly = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120, check=False
    )

    assert nightly.returncode == 0, nightly.stderr
    found = re.search(
        r"^journaled the seal of what ends by (\S+)T00:00:00Z as delivery 2$",
        nightly.stderr,
        re.MULTILINE,
    )
    assert found is not None, nightly.stderr
    midnight = date.fromisoformat(found[1])
    assert midnight in (today, today + timedelta(days=1))
    with Store(data / "store.sqlite") as store:
        assert sealed_totals(store, dates, "+0100") == {
            d: date.fromisoformat(d) < midnight for d in dates
        }
    assert run_cli("verify", "--data", data).code == 0


def test_a_total_changes_late_only_once_its_period_has_ended_seal_26(
    journal: Journal, store: Store, epoch: int
) -> None:
    """SEAL-26: a recount of a daily total (stamped at +01:00) received while its day may
    still be counting is not reported late; one received 26 h after the hour of its stamp is
    reported 1 h late (a day is counted as 25 h, as a seal counts it); so a monthly total 1 h
    after 31 days and 1 h."""
    stamped = instant("2024-02-07 00:00:00 +0100")
    month = instant("2024-02-01 00:00:00 +0100")
    during = [
        append(
            journal,
            delivery(
                totals(["2024-02-07"], "+0100", q), aggregation="days", received_at=stamped + h
            ),
        )
        for q, h in ((100, 2 * HOUR), (200, 24 * HOUR))
    ]
    after = append(
        journal,
        delivery(
            totals(["2024-02-07"], "+0100", 300),
            aggregation="days",
            received_at=stamped + 26 * HOUR,
        ),
    )
    monthly = append(
        journal,
        delivery(
            totals(["2024-02-01"], "+0100", 9),
            aggregation="months",
            received_at=month + (31 * 24 + 2) * HOUR,
        ),
    )

    reports = [store.fold(journal, m, epoch) for m in (*during, after, monthly)]

    assert [r.late_s for r in reports] == [(), (), (3600.0,), (3600.0,)]


_DAYS = [f"2024-03-{day:02d}" for day in range(25, 32)]
_TOTAL_SEALS = st.tuples(
    st.integers(0, len(_DAYS) + 8),
    st.sampled_from([0, 1, 5, 23]),
    st.sampled_from([None, "step_count"]),
    st.sampled_from([None, "days", "weeks"]),
)
_TOTALS = st.tuples(
    st.sampled_from(["days", "weeks"]),
    st.sampled_from(["+0100", "-0500", "+1000"]),
    st.lists(st.sampled_from(_DAYS), min_size=1, max_size=3, unique=True),
    st.integers(1, 3),
)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.one_of(_TOTAL_SEALS, _TOTALS), min_size=2, max_size=7))
def test_any_seals_among_any_totals_rebuild_the_same_seal_27(
    steps: list[tuple[int, int, str | None, str | None] | tuple[str, str, list[str], int]],
) -> None:
    """SEAL-27 (property): random daily and weekly totals at +01:00, -05:00 and +10:00, and
    random seals among them (at or after midnight UTC, of the metric or all, of a layer or
    all): live, each object is sealed exactly when a journaled seal covers it by its layer's
    longest period, and none before its day or week is over; `verify` finds nothing; a
    rebuild in two workers equals one in one, and the live objects."""
    journaled: list[Seal] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Journal(Path(tmp) / "journal.sqlite") as journal,
        Store(Path(tmp) / "store.sqlite") as store,
    ):
        for step in steps:
            if isinstance(step[0], int):
                days, hours, metric, layer = step
                start = instant(f"{_DAYS[0]} 00:00:00 +0000")
                seal = Seal(start + days * 24 * HOUR + int(hours) * HOUR, metric, layer)
                journaled.append(seal)
                append(journal, sealing(seal))
            else:
                aggregation, offset, dates, qty = step
                payload = totals(list(dates), str(offset), int(qty))
                append(journal, delivery(payload, aggregation=str(aggregation)))
        epoch = store.acquire_lease("folder", now=BASE_US, ttl=HOUR)
        assert epoch is not None
        assert run_pass(journal, store, epoch).reached_end
        store.release_lease("folder", epoch)

        objects = summaries(store).values()
        assert [s.sealed for s in objects] == [covered(journaled, s.key) for s in objects]
        # No total is sealed before its period is over (a day of 24 h, a week of 7 days, at
        # these fixed offsets), whatever the rule's spans.
        length = {"days": 24 * HOUR, "weeks": 7 * 24 * HOUR}
        for s in objects:
            assert not s.sealed or any(
                seal.before >= s.key.hour + length[s.key.layer]
                and seal.metric in (None, s.key.metric)
                and seal.layer in (None, s.key.layer)
                for seal in journaled
            ), s.key
        one = _rebuilds_agree(journal, store, Path(tmp))
        assert one["objects"] == rows(store.path)["objects"]


def test_a_seal_searches_the_objects_no_seal_covers_yet_seal_30(
    journal: Journal, store: Store, epoch: int
) -> None:
    """SEAL-30: a store of the schema before the index of the objects no seal covers yet,
    holding 72 hours of points and a seal of the first 24 folded: opened, it has the index
    (`objects_unsealed`, 48 entries), and the seal's statement searches it (SQLite's plan),
    where it read every object of the store, bodies and all (0.12 to 0.84 s at 4 years); a
    second seal then marks the next 24 hours alone, and verify finds nothing."""
    hours = [point(60 * h + 1, h) for h in range(72)]
    append(journal, delivery(body({"hr": hours})))
    append(journal, sealing(Seal(BASE_US + 24 * US_PER_HOUR)))
    run_pass(journal, store, epoch)
    store.release_lease("folder", epoch)
    store.close()
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("DROP INDEX objects_unsealed")
        conn.execute(f"PRAGMA user_version = {MIGRATIONS.index(UNSEALED_INDEX)}")

    with Store(store.path) as upgraded:
        with closing(sqlite3.connect(store.path)) as conn:
            (indexed,) = conn.execute(
                "SELECT count(*) FROM objects INDEXED BY objects_unsealed WHERE sealed = 0"
            ).fetchone()
            plan = conn.execute(
                f"EXPLAIN QUERY PLAN {MARK_SEALED}", {"before": 0, "metric": None, "layer": None}
            ).fetchall()
        assert indexed == 48
        assert [row[3] for row in plan] == ["SEARCH objects USING INDEX objects_unsealed (hour<?)"]
        held = upgraded.acquire_lease("folder", now=NOW, ttl=TTL)
        assert held is not None
        append(journal, sealing(Seal(BASE_US + 48 * US_PER_HOUR)))
        run_pass(journal, upgraded, held)
        upgraded.release_lease("folder", held)
        assert {hour: sealed for (_, hour), sealed in flags(upgraded).items()} == {
            h: h < 48 for h in range(72)
        }
        assert verify(journal, upgraded) == []


def _unsealed_index(path: str | Path) -> tuple[int, list[str]]:
    """How many objects ``objects_unsealed`` holds in the file at ``path`` (none without it),
    and its index names."""
    with closing(sqlite3.connect(path)) as conn:
        names = [
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        ]
        if "objects_unsealed" not in names:
            return 0, names
        (held,) = conn.execute(
            "SELECT count(*) FROM objects INDEXED BY objects_unsealed WHERE sealed = 0"
        ).fetchone()
        return held, names


def test_a_rebuild_s_scratch_files_are_made_without_the_index_of_unsealed_objects_seal_31(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """SEAL-31: a rebuild partition's scratch file is made with the store's indexes but
    `objects_unsealed`, which
    held every object it wrote (all unsealed) and was written with each rewrite, and no seal
    reads there; a rebuild in two workers of 72 hours of three metrics and a seal of the first
    24 ends with the index in the rebuilt store (its 144 unsealed objects, intact), a reindex
    in two workers leaves the live store's index in place, the next seal's statement searches
    it (SQLite's plan) and marks the next 24 hours alone, and verify finds nothing."""
    _partition.fold_chunk(str(tmp_path / "scratch.sqlite"), [])
    _, names = _unsealed_index(tmp_path / "scratch.sqlite")
    assert set(names) == set(_unsealed_index(store.path)[1]) - {"objects_unsealed"}

    hours = [point(60 * h + 1, h) for h in range(72)]
    append(journal, delivery(body({"hr": hours, "steps": hours, "energy": hours})))
    append(journal, sealing(Seal(BASE_US + 24 * US_PER_HOUR)))
    run_pass(journal, store, epoch)
    store.release_lease("folder", epoch)
    rebuild_into(journal, tmp_path / "two.sqlite", workers=2)
    assert _unsealed_index(tmp_path / "two.sqlite")[0] == 3 * 48
    with closing(sqlite3.connect(tmp_path / "two.sqlite")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]

    assert reindex(journal, store, "reindex", workers=2) == 0
    assert _unsealed_index(store.path)[0] == 3 * 48
    with closing(sqlite3.connect(store.path)) as conn:
        plan = conn.execute(
            f"EXPLAIN QUERY PLAN {MARK_SEALED}", {"before": 0, "metric": None, "layer": None}
        ).fetchall()
    assert [row[3] for row in plan] == ["SEARCH objects USING INDEX objects_unsealed (hour<?)"]
    held = store.acquire_lease("folder", now=NOW, ttl=TTL)
    assert held is not None
    append(journal, sealing(Seal(BASE_US + 48 * US_PER_HOUR)))
    run_pass(journal, store, held)
    store.release_lease("folder", held)
    assert flags(store) == {
        (metric, h): h < 48 for metric in ("hr", "steps", "energy") for h in range(72)
    }
    assert _unsealed_index(store.path)[0] == 3 * 24
    assert verify(journal, store) == []
