"""The hostile corpus through a real server (specs/proof.md, PROOF-4 to PROOF-7).

Over a folded baseline, every body of ``tests/_hostile_corpus.py`` is posted (a few at a time)
to :func:`transport.serve.serve` on a free port. Each must be journaled with a 200 and get the
outcome its case names; the server must keep answering and log no ERROR; the baseline must
export byte for byte as before, and every case may add only the points it is expected to.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio
from _baseline import BASELINE, BASELINE_LINES, errors, severe_lines
from _cli_bodies import raw_point
from _hostile_corpus import Case, Oversized, corpus
from _service_helpers import Service, serving

from healthlog.storage.rebuild import verify

MiB = 2**20
CONCURRENCY = 8
MINUTES = {"automation-aggregation": "minutes"}
# Metrics whose points are not compared: the hand-written files' and the workout records'.
UNCHECKED = ("file.", "workouts")


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


async def export(service: Service) -> dict[tuple[str, str, str, str], bytes]:
    """``/v1/points`` as coordinates (metric, layer, start, end) -> line."""
    response = await service.get("/v1/points")
    assert response.status_code == 200
    lines = {}
    for line in response.content.splitlines(keepends=True):
        doc = json.loads(line)
        lines[doc["metric"], doc["layer"], doc["start"], doc["end"]] = line
    return lines


async def healthy(service: Service) -> None:
    response = await service.client.get("/healthz")
    assert response.status_code == 200


async def with_baseline(service: Service) -> dict[tuple[str, str, str, str], bytes]:
    """Fold the baseline; return its export."""
    assert (await service.post(BASELINE, MINUTES)).status_code == 200
    await service.wait_folded()
    before = await export(service)
    assert len(before) == BASELINE_LINES
    return before


async def post_case(
    service: Service, limiter: trio.CapacityLimiter, case: Case, receipts: dict[str, Any]
) -> None:
    async with limiter:
        response = await service.post(case.body, MINUTES)
        assert response.status_code == 200, (case.name, response.text)
        receipts[case.name] = response.json()
        await healthy(service)


async def outcome_of(
    service: Service,
    limiter: trio.CapacityLimiter,
    name: str,
    delivery_id: int,
    into: dict[str, Any],
) -> None:
    async with limiter:
        response = await service.get(f"/v1/deliveries/{delivery_id}")
        assert response.status_code == 200
        into[name] = response.json()


async def test_hostile_corpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """PROOF-4, PROOF-5, PROOF-6: every hostile body is journaled (200, its sha256) and gets
    the outcome its case names, with a reason unless parsed; the server keeps answering and logs
    no ERROR, in its own process or in the fold workers (whose records go to their stderr); the
    baseline exports byte for byte as before, each case adds exactly the points it
    sent that are valid (HTML characters included, byte for byte) with the units its case names,
    and ``verify`` finds nothing."""
    cases = corpus()
    assert len(cases) >= 200
    limiter = trio.CapacityLimiter(CONCURRENCY)
    async with serving(tmp_path / "data") as service:
        before = await with_baseline(service)
        receipts: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            for case in cases:
                nursery.start_soon(post_case, service, limiter, case, receipts)
        status = await service.wait_folded()
        outcomes: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            for name, receipt in receipts.items():
                nursery.start_soon(
                    outcome_of, service, limiter, name, receipt["delivery_id"], outcomes
                )
        after = await export(service)
        journal = {meta.id: meta.sha256 for meta in await service.journal()}
        await healthy(service)
    assert status["journal"]["deliveries"] == len(cases) + 1
    mismatched = {
        case.name: (case.status, outcomes[case.name]["status"], outcomes[case.name]["reason"])
        for case in cases
        if outcomes[case.name]["status"] != case.status
    }
    assert mismatched == {}
    for case in cases:
        receipt, outcome = receipts[case.name], outcomes[case.name]
        assert receipt["sha256"] == sha256(case.body) == journal[receipt["delivery_id"]]
        assert receipt["bytes"] == len(case.body)
        assert (outcome["reason"] is None) is (case.status == "parsed"), case.name
        assert "internal error" not in (outcome["reason"] or ""), case.name
    assert errors(caplog) == []
    workers_said = capfd.readouterr().err
    assert severe_lines(workers_said) == []
    assert {key: after[key] for key in before} == before
    added: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    for key, line in after.items():
        if key not in before:
            added[key[0]].append((key[2], raw_point(line)))
    expected = {
        case.metric: list(case.kept)
        for case in cases
        if case.metric is not None and case.kept is not None
    }
    assert {m: (added[m], kept) for m, kept in expected.items() if added[m] != kept} == {}
    units: dict[str, set[str | None]] = defaultdict(set)
    for key, line in after.items():
        if key not in before:
            units[key[0]].add(json.loads(line)["units"])
    assert {
        case.name: units[case.metric]
        for case in cases
        if case.metric is not None and case.kept and units[case.metric] != {case.units}
    } == {}
    assert {m for m in added if m not in expected and not m.startswith(UNCHECKED)} == set()
    with service.data.open_journal() as journal_file, service.data.open_store() as store:
        assert await trio.to_thread.run_sync(verify, journal_file, store) == []


async def test_300_mib_body_is_413(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """PROOF-7: 300 MiB streamed without a length, and announced with one, both get 413 under
    the default 256 MiB limit; nothing is journaled, the server keeps answering, the baseline is
    unchanged."""
    async with serving(tmp_path / "data") as service:
        before = await with_baseline(service)
        for headers in ({}, {"Content-Length": str(300 * MiB)}):
            stream = Oversized(300 * MiB)
            request = service.client.build_request(
                "POST",
                "/v1/deliveries",
                headers={**service.auth, **MINUTES, **headers, "Connection": "close"},
                content=stream,
            )
            request.stream = stream
            response = await service.client.send(request)
            assert response.status_code == 413
            assert response.json() == {"error": "BODY_TOO_LARGE", "max_body_mib": 256}
            await healthy(service)
        assert len(await service.journal()) == 1
        assert await export(service) == before
    assert errors(caplog) == []
