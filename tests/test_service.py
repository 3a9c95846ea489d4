"""``healthlog serve`` over real HTTP (specs/service.md).

Every test talks to :func:`transport.serve.serve` listening on a free port, started in the
test's own trio run (``tests/_service_helpers.py``), through ``httpx`` or a raw socket.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import json
import logging
import os
import random
import re
import resource
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h11
import hpack
import httpx
import pytest
import trio
from _cli_bodies import body, compact, metric, point
from _disk import DISK_ERROR, files_limited_to
from _service_helpers import (
    CLIENT_TIMEOUT_S,
    FOLD_LIMIT_S,
    POLL_S,
    TOKEN_NAME,
    Drip,
    Service,
    post_stream,
    serving,
    write_minute_body,
)
from _stream_helpers import acked, bearer, connect, receive, send_ack, subscribe
from conftest import PROCESS_TIMEOUT_S
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import ConnectionClosed
from wsproto import ConnectionType, WSConnection
from wsproto.events import CloseConnection, Request, TextMessage

from actors.runtime import configured
from healthlog import clock, faults
from healthlog.config import ConfigError, ServeConfig, load_serve_config
from healthlog.logs import Throttle
from healthlog.seals import SEAL_CLIENT, SEAL_CONTENT_TYPE, Seal
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, Deferred
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery
from healthlog.timestamps import format_instant, parse_instant
from transport import app as app_module
from transport import serve as serve_module
from transport.intake import INTAKE_PATH as INTAKE
from transport.refusals import Bucket, RefusalLog, WrongPathLog

MiB = 2**20
HEART_RATE = body(
    metric(
        "heart_rate",
        "count/min",
        point("2024-03-01 10:00:00 +0000", qty=61, source="Watch"),
        point("2024-03-01 10:01:00 +0000", qty=62),
    )
)
AUTOMATION = {
    "automation-name": "Vitals every hour",
    "automation-id": "A-7F3C",
    "automation-aggregation": "minutes",
    "automation-period": "Since Last Sync",
    "session-id": "S-0042",
}
RECEIPT_KEYS = ["delivery_id", "received_at", "sha256", "bytes"]
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z")
REVOKE_LIMIT_S = 6.0
NEXT_REQUEST_S = 2.0
HEAD_START_S = 0.5
SETTLE_S = 0.5
READY_LIMIT_S = 15.0
STALL_LIMIT_S = 10.0
CLOSE = {"Connection": "close"}
MINUTES = {"automation-aggregation": "minutes"}
SHORT_RESPONSE_TIMEOUT_S = 0.5
SMALL_RECEIVE_BUFFER = 16 * 1024


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def small(n: int) -> bytes:
    """A distinct small delivery: one step count point at minute ``n``."""
    day, minute = divmod(n, 24 * 60)
    date = f"2024-04-{1 + day:02d} {minute // 60:02d}:{minute % 60:02d}:00 +0000"
    return body(metric("step_count", "count", point(date, qty=n)))


def journaled_body(service: Service, delivery_id: int) -> bytes:
    """The body the journal holds for ``delivery_id``, checked against its sha256."""
    with service.data.open_journal() as journal:
        return journal.read_body(delivery_id)


async def journaled(service: Service) -> list[str]:
    """The sha256 of every journaled delivery, in journal order."""
    return [meta.sha256 for meta in await service.journal()]


async def metric_samples(client: httpx.AsyncClient) -> dict[tuple[str, frozenset[Any]], float]:
    """``/metrics`` parsed: (sample name, labels) -> value."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def labelled(**labels: str) -> frozenset[Any]:
    return frozenset(labels.items())


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    async with serving(tmp_path / "data") as running:
        yield running


@pytest.fixture(scope="session")
def big_body(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 62 MiB body: 20 metrics of 30,000 minute points each, written once per session."""
    path = tmp_path_factory.mktemp("big") / "minutes.json"
    write_minute_body(path, metrics=20, points=30_000)
    return path


# -- authentication -------------------------------------------------------------------------


async def test_no_or_unknown_token_is_401_and_journals_nothing(service: Service) -> None:
    """SERVE-1: no token, unknown tokens, and the token under another scheme get 401."""
    anonymous = await service.client.post("/v1/deliveries", content=HEART_RATE)
    wrong_bearer = await service.post(HEART_RATE, {"Authorization": "Bearer hl_not-a-token"})
    wrong_key = await service.client.post(
        "/v1/deliveries", content=HEART_RATE, headers={"api-key": "hl_not-a-token"}
    )
    other_scheme = await service.post(HEART_RATE, {"Authorization": f"Basic {service.token}"})
    for response in (anonymous, wrong_bearer, wrong_key, other_scheme):
        assert response.status_code == 401
        assert response.json() == {"error": "UNAUTHORIZED"}
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert await service.journal() == []


async def test_bearer_and_api_key_are_both_accepted(tmp_path: Path) -> None:
    """SERVE-2: the same token as `Authorization: Bearer T` and as `api-key: T`, for two
    clients, each journaled under its own name."""
    data = DataDir(tmp_path / "data")
    with data.open_tokens() as tokens:
        watch = tokens.add("watch")
    async with serving(data.path) as service:
        expected = []
        for token, name in ((service.token, TOKEN_NAME), (watch, "watch")):
            for form in ({"Authorization": f"Bearer {token}"}, {"api-key": token}):
                content = small(len(expected))
                response = await service.client.post(
                    "/v1/deliveries", content=content, headers=form
                )
                assert response.status_code == 200, (name, list(form))
                expected.append((sha256(content), name))
        metas = await service.journal()
    assert [(m.sha256, m.client) for m in metas] == expected


async def test_a_bearer_token_is_read_before_an_api_key_serve_79(tmp_path: Path) -> None:
    """SERVE-79: GIVEN clients `phone` and `watch` WHEN a delivery carries `Authorization:
    Bearer` with phone's token and `api-key` with watch's, or with a token that is no client's
    THEN it is journaled under `phone`; WHEN the bearer token is no client's and the api-key is
    phone's THEN 401 for the delivery (nothing journaled) and for `/v1/status`; WHEN
    `Authorization` has another scheme (`Basic`) and the api-key is phone's THEN it is
    journaled under `phone`."""
    data = DataDir(tmp_path / "data")
    with data.open_tokens() as tokens:
        watch = tokens.add("watch")
    async with serving(data.path) as service:
        bearer = f"Bearer {service.token}"
        accepted = [
            {"Authorization": bearer, "api-key": watch},
            {"Authorization": bearer, "api-key": "hl_not-a-token"},
            {"Authorization": "Basic cGhvbmU6cGhvbmU=", "api-key": service.token},
        ]
        refused = {"Authorization": "Bearer hl_not-a-token", "api-key": service.token}
        contents = [small(n) for n in range(len(accepted) + 1)]
        answers = [
            await service.client.post("/v1/deliveries", content=content, headers=headers)
            for content, headers in zip(contents, [*accepted, refused], strict=True)
        ]
        status = await service.client.get("/v1/status", headers=refused)
        metas = await service.journal()
    assert [answer.status_code for answer in answers] == [200, 200, 200, 401]
    assert status.status_code == 401
    assert [(m.sha256, m.client) for m in metas] == [
        (sha256(content), TOKEN_NAME) for content in contents[:-1]
    ]


async def test_a_repeated_token_header_is_read_alike_by_every_route_serve_83(
    tmp_path: Path,
) -> None:
    """SERVE-83: a request with two `Authorization` or two `api-key` headers presents the
    first of them to intake, to `/v1/status` and to the stream alike: taken when the first is a
    client's token, refused when only the second is."""
    async with serving(tmp_path / "data") as service:
        assert (await service.post(small(0))).status_code == 200
        await service.wait_folded()
        good, bad = service.token, "hl_not-a-token"
        for name, form in (("authorization", "Bearer {}"), ("api-key", "{}")):
            for first, second in ((good, bad), (bad, good)):
                headers = [(name, form.format(first)), (name, form.format(second))]
                expected = 200 if first == good else 401
                status = await service.client.get("/v1/status", headers=headers)
                assert status.status_code == expected, headers
                post = await service.client.post(
                    "/v1/deliveries", content=small(len(headers)), headers=headers
                )
                assert post.status_code == expected, headers
                raw = [(key.encode(), value.encode()) for key, value in headers]
                async with connect(service.port, "/v1/stream", raw) as ws:
                    [frame] = await receive(ws, 1)
                expected_frame = "event" if first == good else "error"
                assert frame["type"] == expected_frame, (headers, frame)


async def test_revoked_token_stops_working_while_serving(service: Service) -> None:
    """SERVE-3: a token revoked in the token table is refused within a few seconds."""
    assert (await service.get("/v1/status")).status_code == 200

    def revoke() -> None:
        with service.data.open_tokens() as tokens:
            tokens.revoke(TOKEN_NAME)

    await trio.to_thread.run_sync(revoke)
    revoked_at = trio.current_time()
    with trio.fail_after(REVOKE_LIMIT_S):
        while (await service.get("/v1/status")).status_code != 401:
            await trio.sleep(POLL_S)
    print(f"revoked token refused after {trio.current_time() - revoked_at:.2f} s")
    assert (await service.post(small(1))).status_code == 401
    assert await service.journal() == []


async def test_a_token_revoked_while_its_body_comes_journals_nothing_serve_89(
    service: Service,
) -> None:
    """SERVE-89: an upload whose token is revoked after its headers and first bytes came, and
    before the rest of its body (as a lost phone's upload begun before its owner revoked it),
    is answered 401 `UNAUTHORIZED` once its body is whole, and nothing is journaled; a token
    that stays valid over a body that comes the same way is answered 200."""
    content = small(7)
    half = len(content) // 2
    kept = trio.Event()
    drip = Drip([content[:half], content[half:]], gate=kept)
    async with trio.open_nursery() as nursery:
        answers: list[httpx.Response] = []

        async def upload() -> None:
            answers.append(await post_stream(service.client, drip, service.auth))

        nursery.start_soon(upload)
        await drip.held.wait()

        def revoke() -> None:
            with service.data.open_tokens() as tokens:
                tokens.revoke(TOKEN_NAME)

        await trio.to_thread.run_sync(revoke)
        with trio.fail_after(REVOKE_LIMIT_S):
            while (await service.get("/v1/status")).status_code != 401:
                await trio.sleep(POLL_S)
        kept.set()
    [answer] = answers
    assert answer.status_code == 401
    assert answer.json() == {"error": "UNAUTHORIZED"}
    assert await service.journal() == []

    def add() -> str:
        with service.data.open_tokens() as tokens:
            return tokens.add("tablet")

    token = await trio.to_thread.run_sync(add)
    again = Drip([content[:half], content[half:]])
    with trio.fail_after(REVOKE_LIMIT_S):
        while (await service.client.get("/v1/status", headers=_bearer(token))).status_code != 200:
            await trio.sleep(POLL_S)
    accepted = await post_stream(service.client, again, _bearer(token))
    assert accepted.status_code == 200
    assert [m.client for m in await service.journal()] == ["tablet"]


async def test_a_token_store_that_cannot_be_read_is_503_serve_96(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-96: while the token store cannot be read (a busy `tokens.sqlite`, forced at the
    fault point `tokens.read`), an upload checked at its headers, and one whose headers were
    checked before and whose body ends meanwhile (SERVE-89's second check), are each answered
    503 `TOKENS_UNAVAILABLE` with `Retry-After`, nothing is journaled, and each is one WARNING
    naming the error's type and no token; once it can be read again the next upload is 200.
    (Before, each was 500 with an empty body, and hypercorn logged the exception at ERROR.)"""
    content = small(7)
    half = len(content) // 2
    failing = [True]

    def busy(name: str) -> None:
        if failing[0]:
            raise Deferred(f"injected busy at {name}")

    async def until_busy() -> None:
        # Until the token cache reloads, and fails: a token that is no client's asks for it.
        wrong = _bearer("hl_no")
        with trio.fail_after(REVOKE_LIMIT_S):
            while (
                await service.client.post(INTAKE, content=b"{}", headers=wrong)
            ).status_code != 503:
                await trio.sleep(POLL_S)

    plan = faults.Plan(actions={"tokens.read": faults.Action(frozenset(range(1, 10**6)), busy)})
    with faults.loaded(plan), caplog.at_level(logging.INFO):
        await until_busy()
        at_headers = await service.post(content)
        failing[0] = False
        kept = trio.Event()
        drip = Drip([content[:half], content[half:]], gate=kept)
        answers: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def upload() -> None:
                answers.append(await post_stream(service.client, drip, service.auth))

            nursery.start_soon(upload)
            await drip.held.wait()
            failing[0] = True
            await until_busy()
            kept.set()
        failing[0] = False
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    [after_body] = answers
    for answer in (at_headers, after_body):
        assert answer.status_code == 503, answer.text
        assert answer.json() == {"error": "TOKENS_UNAVAILABLE"}
        assert answer.headers["Retry-After"] == "5"
    assert await service.journal() == []
    # One WARNING while the store stays unreadable (SERVE-100): once, or twice when the upload's
    # read at its headers found it readable between the two spells.
    assert {r.getMessage() for r in warnings} == {"the token store could not be read: Deferred"}
    assert len(warnings) <= 2
    assert all(service.token not in r.getMessage() for r in caplog.records)
    assert (await service.post(content)).status_code == 200
    assert len(await service.journal()) == 1


async def test_a_token_store_that_cannot_be_read_is_no_error_of_the_read_routes_serve_98(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-98: while the token store cannot be read (the fault point `tokens.read`),
    `/v1/status`, `/v1/points` and `/v1/snapshots` with a token are 503 `TOKENS_UNAVAILABLE` with
    `Retry-After`, and a stream handshake with it is accepted and closed 1011 `STORE_ERROR` (which
    `follow` retries), each with one WARNING naming the error's type and no record at ERROR;
    once it can be read again they are served. (Before, the read routes answered 500 `INTERNAL`
    with an ERROR `unhandled Deferred`, and the handshake an HTTP 500 with hypercorn's
    `Error in ASGI Framework` and its traceback at ERROR.)"""
    failing = [True]

    def busy(name: str) -> None:
        if failing[0]:
            raise Deferred(f"injected busy at {name}")

    plan = faults.Plan(actions={"tokens.read": faults.Action(frozenset(range(1, 10**6)), busy)})
    with faults.loaded(plan), caplog.at_level(logging.INFO):
        with trio.fail_after(REVOKE_LIMIT_S):
            while (await service.get("/v1/status")).status_code == 200:
                await trio.sleep(POLL_S)
        for path in ("/v1/status", "/v1/points", "/v1/snapshots"):
            answer = await service.get(path)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json() == {"error": "TOKENS_UNAVAILABLE"}, path
            assert answer.headers["Retry-After"] == "5", path
        async with connect(service.port, "/v1/stream?after=0", bearer(service.token)) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert (closed.value.reason.code, closed.value.reason.reason) == (1011, "STORE_ERROR")
        failing[0] = False
        records = list(caplog.records)
    assert [r for r in records if r.levelno >= logging.ERROR] == []
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["the token store could not be read: Deferred"]
    assert all(service.token not in r.getMessage() for r in records)
    assert (await service.get("/v1/status")).status_code == 200


async def test_a_token_store_that_cannot_be_read_is_logged_once_while_it_lasts_serve_100(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-100: while the token store cannot be read (the fault point `tokens.read`), the
    uploads, read requests and stream handshakes it refuses are one WARNING `the token store
    could not be read: Deferred` in all, the others at DEBUG, and the first read that succeeds
    again is one INFO with their count. (Before, every request was a WARNING of its own: anyone
    reaching the port could flood the log with them.)"""
    failing = [True]

    def busy(name: str) -> None:
        if failing[0]:
            raise Deferred(f"injected busy at {name}")

    refused = 0
    plan = faults.Plan(actions={"tokens.read": faults.Action(frozenset(range(1, 10**6)), busy)})
    with faults.loaded(plan), caplog.at_level(logging.DEBUG, logger="healthlog.http"):
        with trio.fail_after(REVOKE_LIMIT_S):
            while (await service.get("/v1/status")).status_code == 200:
                await trio.sleep(POLL_S)
        refused += 1
        for _ in range(3):
            for answer in (await service.post(small(7)), await service.get("/v1/points")):
                assert answer.status_code == 503, answer.text
                refused += 1
            async with connect(service.port, "/v1/stream?after=0", bearer(service.token)) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
            assert closed.value.reason.code == 1011
            refused += 1
        failing[0] = False
        assert (await service.get("/v1/status")).status_code == 200
        records = [r for r in caplog.records if "token store" in r.getMessage()]
    logged = [(r.levelno, r.getMessage()) for r in records]
    unreadable = "the token store could not be read: Deferred"
    assert logged == [
        (logging.WARNING, unreadable),
        *[(logging.DEBUG, unreadable)] * (refused - 1),
        (logging.INFO, f"the token store is read again, after {refused} failed reads"),
    ]
    assert await service.journal() == []


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_read_routes_need_a_token_probes_do_not(service: Service) -> None:
    """SERVE-4: status, one delivery and points need a token; health, readiness, metrics not."""
    assert (await service.post(small(1))).status_code == 200
    for path in ("/v1/status", "/v1/deliveries/1", "/v1/points"):
        refused = await service.client.get(path)
        assert refused.status_code == 401, path
        assert refused.json() == {"error": "UNAUTHORIZED"}, path
        assert refused.headers["WWW-Authenticate"] == "Bearer", path
        assert (await service.get(path)).status_code == 200, path
    await service.wait_folded()
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await service.client.get(path)).status_code == 200, path


async def test_no_answer_may_be_stored_by_a_cache_serve_86(service: Service) -> None:
    """SERVE-86: every answer of the read routes (status, a delivery, points in both formats, the
    snapshot reference and file), their refusals, and the probes say `Cache-Control: no-store`:
    a caching front (nginx's `proxy_cache_valid` looks at no `Authorization` header) must not
    keep health data and give it to the next request for the same URL, with a token or none."""
    assert (await service.post(small(1))).status_code == 200
    await service.wait_folded()
    manifest = (await service.get("/v1/snapshots")).json()
    paths = [
        "/v1/status",
        "/v1/deliveries/1",
        "/v1/points",
        "/v1/points?format=csv",
        "/v1/snapshots",
        f"/v1/snapshots/{manifest['seq']}",
    ]
    for path in paths:
        answered = await service.get(path)
        assert answered.status_code == 200, path
        assert answered.headers.get("Cache-Control") == "no-store", path
        refused = await service.client.get(path)
        assert refused.status_code == 401, path
        assert refused.headers.get("Cache-Control") == "no-store", path
    for path in ("/v1/deliveries/999", "/healthz", "/readyz", "/metrics"):
        answered = await service.get(path)
        assert answered.headers.get("Cache-Control") == "no-store", path


# -- intake ---------------------------------------------------------------------------------


async def test_receipt_names_the_journal_row(service: Service) -> None:
    """SERVE-5: the receipt has exactly its four keys, the sha256 of the raw body."""
    response = await service.post(HEART_RATE, AUTOMATION)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert "Idempotent-Replayed" not in response.headers
    receipt = response.json()
    assert list(receipt) == RECEIPT_KEYS
    assert receipt["sha256"] == sha256(HEART_RATE)
    assert receipt["bytes"] == len(HEART_RATE)
    assert ISO_UTC.fullmatch(receipt["received_at"])
    [meta] = await service.journal()
    assert (meta.id, format_instant(meta.received_at), meta.sha256, meta.bytes) == (
        receipt["delivery_id"],
        receipt["received_at"],
        receipt["sha256"],
        receipt["bytes"],
    )
    await service.wait_folded()
    outcome = (await service.get(f"/v1/deliveries/{meta.id}")).json()
    assert list(outcome) == ["delivery_id", "received_at", "status", "reason", "counters"]
    assert outcome["delivery_id"] == meta.id
    assert outcome["received_at"] == receipt["received_at"]
    assert outcome["status"] == "parsed"
    assert outcome["counters"]["points"] == 2


async def test_automation_headers_and_content_type_are_journaled(service: Service) -> None:
    """SERVE-6: the HAE headers are kept; any or no Content-Type is accepted as sent."""
    sent = [
        (small(1), {**AUTOMATION, "Content-Type": "application/json"}),
        (small(2), {}),
        (small(3), {"Content-Type": "text/plain; charset=latin-1"}),
    ]
    for content, headers in sent:
        assert (await service.post(content, headers)).status_code == 200
    first, bare, odd = await service.journal()
    assert (
        first.automation_name,
        first.automation_id,
        first.automation_aggregation,
        first.automation_period,
        first.session_id,
        first.content_type,
    ) == (*AUTOMATION.values(), "application/json")
    assert bare.content_type is None
    assert bare.automation_id is None
    assert bare.session_id is None
    assert odd.content_type == "text/plain; charset=latin-1"


async def test_body_that_is_not_json_is_journaled_and_failed(service: Service) -> None:
    """SERVE-7: a non-JSON body is answered 200; its `failed` outcome shows everywhere."""
    garbage = b"this is <not> json {"
    response = await service.post(garbage, {"Content-Type": "application/json"})
    assert response.status_code == 200
    delivery_id = response.json()["delivery_id"]
    assert await journaled(service) == [sha256(garbage)]
    status = await service.wait_folded()
    assert status["deliveries"] == {"pending": 0, "parsed": 0, "partial": 0, "failed": 1}
    outcome = (await service.get(f"/v1/deliveries/{delivery_id}")).json()
    assert outcome["status"] == "failed"
    assert outcome["reason"]
    assert "not>" not in outcome["reason"]
    samples = await metric_samples(service.client)
    assert samples["healthlog_deliveries", labelled(status="failed")] == 1


async def test_empty_body_is_journaled_with_an_outcome(service: Service) -> None:
    """SERVE-8: an empty body is answered 200, journaled with 0 bytes and folded: the receipt
    and the journal's own row (read through a connection of our own) both say so."""
    response = await service.post(b"")
    assert response.status_code == 200
    receipt = response.json()
    assert (receipt["bytes"], receipt["sha256"]) == (0, sha256(b""))
    [row] = await service.journal()
    assert (row.id, row.bytes, row.sha256) == (receipt["delivery_id"], 0, sha256(b""))
    assert await trio.to_thread.run_sync(journaled_body, service, row.id) == b""
    await service.wait_folded()
    outcome = (await service.get(f"/v1/deliveries/{receipt['delivery_id']}")).json()
    assert outcome["status"] == "failed"
    assert outcome["reason"]


async def test_unknown_delivery_is_404(service: Service) -> None:
    """SERVE-9"""
    response = await service.get("/v1/deliveries/4711")
    assert response.status_code == 404
    assert response.json() == {"error": "NOT_FOUND"}


# -- size limit -----------------------------------------------------------------------------


async def test_content_length_over_the_limit_is_413(tmp_path: Path) -> None:
    """SERVE-10: 2 MiB and limit + 1 bytes get 413 and journal nothing; the limit itself is 200.

    Over-limit requests ask for `Connection: close` (see SERVE-12 for a reused connection) and
    go as a :class:`Drip`, which the client may abandon when the server closes early.
    """
    async with serving(tmp_path / "data", max_body_mib=1, body_timeout_s=1) as service:
        for size in (2 * MiB, MiB + 1):
            headers = {**service.auth, **CLOSE, "Content-Length": str(size)}
            response = await post_stream(service.client, Drip([b"x" * size]), headers)
            assert response.status_code == 413, size
            assert response.json() == {"error": "BODY_TOO_LARGE", "max_body_mib": 1}
        # Refused on its Content-Length, not on what arrives: a client that announces limit + 1
        # bytes, sends 10 and stalls gets the 413 once it has stalled (`body_timeout_s`), where
        # a body read up to the stall would be 408.
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as announced:
            await announced.send_all(
                b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
                b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n0123456789"
                % (service.token.encode(), MiB + 1)
            )
            with trio.fail_after(STALL_LIMIT_S):
                answer = await announced.receive_some()
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
        assert await service.journal() == []
        at_limit = b"y" * MiB
        assert (await service.post(at_limit)).status_code == 200
        assert await journaled(service) == [sha256(at_limit)]


async def test_chunked_body_over_the_limit_is_413(tmp_path: Path) -> None:
    """SERVE-11: a chunked upload is cut off at the limit; exactly the limit is 200."""
    chunk = 64 * 1024
    async with serving(tmp_path / "data", max_body_mib=1) as service:
        for last in (b"z" * chunk, b"z"):
            over = Drip([*[b"z" * chunk] * (MiB // chunk), last])
            response = await post_stream(service.client, over, {**service.auth, **CLOSE})
            assert response.status_code == 413, len(over.body)
            assert response.json() == {"error": "BODY_TOO_LARGE", "max_body_mib": 1}
        assert await service.journal() == []
        at_limit = Drip([b"w" * chunk] * (MiB // chunk))
        response = await post_stream(service.client, at_limit, service.auth)
        assert response.status_code == 200
        assert response.json()["bytes"] == MiB
        assert await journaled(service) == [sha256(at_limit.body)]


async def test_connection_after_an_early_413_still_serves(tmp_path: Path) -> None:
    """SERVE-12: 2 MiB announced, the body paused after 64 KiB; then a small post."""
    async with serving(tmp_path / "data", max_body_mib=1, graceful_timeout_s=1) as service:
        content = b"x" * (2 * MiB)
        slow = Drip([content[: 64 * 1024], content[64 * 1024 :]], pause_s=0.1)
        headers = {**service.auth, "Content-Length": str(len(content))}
        assert (await post_stream(service.client, slow, headers)).status_code == 413
        response = await service.client.post(
            "/v1/deliveries", content=small(1), headers=service.auth, timeout=NEXT_REQUEST_S
        )
        assert response.status_code == 200


# -- idempotency ----------------------------------------------------------------------------


async def test_same_key_same_content_replays_the_receipt(service: Service) -> None:
    """SERVE-13: identical bytes, or the same JSON reordered and reformatted, replay."""
    key = {"Idempotency-Key": "run-2024-03-01T10"}
    first = await service.post(HEART_RATE, key)
    assert first.status_code == 200
    assert "Idempotent-Replayed" not in first.headers
    document = json.loads(HEART_RATE)
    [entry] = document["data"]["metrics"]
    reordered = {"data": {"metrics": [dict(reversed(entry.items()))]}}
    reordered["data"]["metrics"][0]["data"] = [dict(reversed(p.items())) for p in entry["data"]]
    equivalent = json.dumps(reordered, indent=3).encode()
    assert equivalent != HEART_RATE
    for content in (HEART_RATE, equivalent):
        again = await service.post(content, key)
        assert again.status_code == 200
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
    assert await journaled(service) == [sha256(HEART_RATE)]


async def test_same_key_other_content_is_a_collision(tmp_path: Path) -> None:
    """SERVE-14: other content under a used key is 422; another client's key is its own."""
    data = DataDir(tmp_path / "data")
    with data.open_tokens() as tokens:
        watch = tokens.add("watch")
    async with serving(data.path) as service:
        key = {"Idempotency-Key": "k-1"}
        first = await service.post(small(1), key)
        assert first.status_code == 200
        collision = await service.post(small(2), key)
        assert collision.status_code == 422
        assert collision.json() == {"error": "ACTION_ID_COLLISION"}
        other_client = await service.post(small(2), {**key, "Authorization": f"Bearer {watch}"})
        assert other_client.status_code == 200
        assert "Idempotent-Replayed" not in other_client.headers
        assert other_client.json()["delivery_id"] != first.json()["delivery_id"]
        metas = await service.journal()
    assert [(m.sha256, m.client) for m in metas] == [
        (sha256(small(1)), TOKEN_NAME),
        (sha256(small(2)), "watch"),
    ]


async def test_same_key_while_the_first_waits_for_the_journal_is_409(service: Service) -> None:
    """SERVE-15: two requests with one key while the journal is write-locked elsewhere."""
    key = {"Idempotency-Key": "k-busy"}
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await service.post(HEART_RATE, key))

    with closing(sqlite3.connect(service.data.journal_path, isolation_level=None)) as lock:
        lock.execute("BEGIN IMMEDIATE")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(send)
            with trio.fail_after(3):
                while not answers:
                    await trio.sleep(POLL_S)
            lock.execute("ROLLBACK")
    in_flight, accepted = answers
    assert in_flight.status_code == 409
    assert in_flight.json() == {"error": "IDEMPOTENCY_KEY_IN_FLIGHT"}
    assert accepted.status_code == 200
    assert await journaled(service) == [sha256(HEART_RATE)]


async def test_same_key_while_the_first_body_uploads_is_409(service: Service) -> None:
    """SERVE-16: the first request holds its body after 10 bytes while the second arrives."""
    key = {"Idempotency-Key": "k-slow"}
    gate = trio.Event()
    slow = Drip([HEART_RATE[:10], HEART_RATE[10:]], gate=gate)
    answers: dict[str, httpx.Response] = {}

    async def first() -> None:
        answers["first"] = await post_stream(service.client, slow, {**service.auth, **key})

    # A request loads the token cache, so that neither request waits for a thread in its
    # check; the second is sent once the first's headers and first bytes are out.
    assert (await service.get("/v1/status")).status_code == 200
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await slow.held.wait()
        await trio.sleep(HEAD_START_S)
        try:
            answers["second"] = await service.post(HEART_RATE, key)
        finally:
            gate.set()
    assert answers["second"].status_code == 409
    assert answers["second"].json() == {"error": "IDEMPOTENCY_KEY_IN_FLIGHT"}
    assert answers["first"].status_code == 200
    assert "Idempotent-Replayed" not in answers["first"].headers
    assert await journaled(service) == [sha256(HEART_RATE)]


async def test_an_idempotency_key_over_255_characters_is_refused_serve_102(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-102: a delivery whose `Idempotency-Key` is longer than 255 characters (256, or
    60,000 under the 64 KiB header limit) is 400 `IDEMPOTENCY_KEY_TOO_LONG` with the limit,
    nothing is journaled, one INFO line says why without the key, and
    `healthlog_intake_refused_total{reason="idempotency_key"}` counts each; a key of 255
    characters is taken and replays. (Before, any key under the header limit was journaled
    with the delivery, 64 KiB of it with every one.)"""
    refused_before = await intake_refused(service)
    long_keys = ["k" * 256, "Z" * 60_000]
    with caplog.at_level(logging.DEBUG, "healthlog"):
        answers = [await service.post(small(1), {"Idempotency-Key": key}) for key in long_keys]
    for answer in answers:
        assert answer.status_code == 400
        assert answer.json() == {"error": "IDEMPOTENCY_KEY_TOO_LONG", "max_characters": 255}
    assert await journaled(service) == []
    # The lease actor's first INFO line may land meanwhile on a loaded machine: the HTTP
    # lines are compared, every line is searched for the keys.
    said = [(r.name, r.getMessage()) for r in caplog.records if r.levelno > logging.DEBUG]
    why = "the Idempotency-Key is longer than 255 characters"
    http = [line for name, line in said if name == "healthlog.http"]
    assert http == [f"refused 400 POST /v1/deliveries from 127.0.0.1: {why}"] * 2
    assert all("kkk" not in line and "ZZZ" not in line for _, line in said)
    refused_after = await intake_refused(service)
    assert (refused_before["idempotency_key"], refused_after["idempotency_key"]) == (0, 2)
    longest = {"Idempotency-Key": "k" * 255}
    first = await service.post(small(1), longest)
    again = await service.post(small(1), longest)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await journaled(service) == [sha256(small(1))]


# -- a large upload ---------------------------------------------------------------------------


async def test_62_mib_upload_while_small_posts_go_on(tmp_path: Path, big_body: Path) -> None:
    """SERVE-17: a 62 MiB body is accepted and folded; small posts during its fold succeed."""
    content = big_body.read_bytes()
    assert 62 * MiB <= len(content) < 63 * MiB
    async with serving(tmp_path / "data") as service:
        started = trio.current_time()
        response = await service.post(content, MINUTES)
        upload_s = trio.current_time() - started
        assert response.status_code == 200
        assert response.json()["sha256"] == sha256(content)
        big_id = response.json()["delivery_id"]
        latencies = []
        while (await service.get(f"/v1/deliveries/{big_id}")).json()["status"] == "pending":
            sent = trio.current_time()
            small_post = await service.post(small(len(latencies)), MINUTES)
            latencies.append(trio.current_time() - sent)
            assert small_post.status_code == 200
            await trio.sleep(POLL_S)
        status = await service.wait_folded()
        outcome = (await service.get(f"/v1/deliveries/{big_id}")).json()
    print(
        f"62 MiB upload answered in {upload_s:.2f} s; {len(latencies)} small posts during its"
        f" fold, max latency {max(latencies, default=0.0):.3f} s"
    )
    assert latencies
    assert outcome["status"] == "parsed"
    assert outcome["counters"]["points"] == 20 * 30_000
    assert status["deliveries"]["parsed"] == 1 + len(latencies)


# -- readiness ------------------------------------------------------------------------------


async def test_readyz_waits_for_the_first_pass(tmp_path: Path) -> None:
    """SERVE-18: a write-locked store keeps the service unready until the lock goes."""
    data = DataDir(tmp_path / "data")
    data.open_store().close()
    with closing(sqlite3.connect(data.store_path, isolation_level=None)) as lock:
        lock.execute("BEGIN EXCLUSIVE")
        async with serving(data.path, lease_ttl_s=2, lease_renew_s=0.5) as service:
            assert (await service.client.get("/healthz")).status_code == 200
            unready = await service.client.get("/readyz")
            assert unready.status_code == 503
            assert unready.json() == {"ready": False}
            lock.execute("ROLLBACK")
            with trio.fail_after(READY_LIMIT_S):
                while (ready := await service.client.get("/readyz")).status_code != 200:
                    await trio.sleep(POLL_S)
            assert ready.json() == {"ready": True}


# -- metrics --------------------------------------------------------------------------------


async def test_lag_of_a_backfill_counts_from_when_it_was_journaled_cli_95(tmp_path: Path) -> None:
    """CLI-95: with the fold lease held elsewhere, a delivery journaled with a `received_at`
    two years back reads, in `healthlog_lag_seconds` and the status's `waited_s`, how long it
    has waited since it was journaled: at most the seconds since before it was journaled."""
    data = DataDir(tmp_path / "data")
    with data.open_store() as store:
        held = store.acquire_lease("elsewhere", now=time.time_ns() // 1000, ttl=3600 * 10**6)
        assert held is not None
    async with serving(data.path) as service:
        before = time.time_ns() // 1000

        def backfill() -> int:
            with data.open_journal() as journal:
                old = parse_instant("2024-12-01T00:00:00Z")
                return journal.append(
                    NewDelivery(HEART_RATE, "import", received_at=old)
                ).delivery_id

        delivery_id = await trio.to_thread.run_sync(backfill)
        samples = await metric_samples(service.client)
        status = await service.status()
        waited_at_most = (time.time_ns() // 1000 - before) / 1e6

    assert status["lag"]["oldest_pending_id"] == delivery_id
    assert status["deliveries"]["pending"] == 1
    assert 0 <= status["lag"]["waited_s"] <= waited_at_most
    assert 0 <= samples["healthlog_lag_seconds", labelled()] <= waited_at_most


async def test_metrics_after_holding_erasing_and_failing(service: Service) -> None:
    """SERVE-19: one point held (poorer), one erased (equal, different), one body failed; two
    named subscribers have acknowledged an event."""
    richer = body(
        metric(
            "heart_rate",
            "count/min",
            point("2024-03-01 10:00:00 +0000", qty=60, source="Watch"),
            point("2024-03-01 10:01:00 +0000", qty=61),
        )
    )
    poorer_and_different = body(
        metric(
            "heart_rate",
            "count/min",
            point("2024-03-01 10:00:00 +0000", qty=60),
            point("2024-03-01 10:01:00 +0000", qty=62),
        )
    )
    sent = (richer, poorer_and_different, b"\x00 not json")
    for content in sent:
        assert (await service.post(content, AUTOMATION)).status_code == 200
    await service.wait_folded()
    subscribers = ("nas", "laptop")
    for name in subscribers:
        async with subscribe(service, 0, subscriber=name) as ws:
            [event] = await receive(ws, 1)
            await send_ack(ws, event["seq"])
            await acked(service, name, event["seq"])
    # The store has the outcomes once a fold commits; this process counts the fold when the
    # worker's report comes back, a moment later.
    with trio.fail_after(FOLD_LIMIT_S):
        while (samples := await metric_samples(service.client))[
            "healthlog_fold_duration_seconds_count", labelled()
        ] < 3:
            await trio.sleep(POLL_S)

    status = await service.status()

    def value(name: str, **labels: str) -> float:
        return samples[name, labelled(**labels)]

    statuses = ("pending", "parsed", "partial", "failed")
    by_status = {status: value("healthlog_deliveries", status=status) for status in statuses}
    assert by_status == {"pending": 0, "parsed": 2, "partial": 0, "failed": 1}
    assert value("healthlog_journal_bytes") == sum(map(len, sent))
    assert value("healthlog_pending_deliveries") == 0
    assert value("healthlog_lag_seconds") == 0
    assert value("healthlog_points_total", counter="points_held") == 1
    assert value("healthlog_points_total", counter="points_erased") == 1
    assert value("healthlog_points_total", counter="overwrites") == 2
    assert value("healthlog_points_total", counter="points_rejected") == 0
    assert value("healthlog_lease_epoch") == status["lease"]["epoch"] >= 1
    assert value("healthlog_first_pass_completed") == 1
    assert sorted(status["subscribers"]) == sorted(subscribers)
    assert value("healthlog_websocket_subscribers") == len(subscribers)
    assert value("healthlog_intake_accepted_total") == 3
    assert value("healthlog_actor_crashes_total") == 0
    assert value("healthlog_actors_down") == 0
    assert value("healthlog_fold_duration_seconds_count") == 3
    assert value("healthlog_fold_duration_seconds_sum") > 0
    buckets = sorted(
        (float(dict(labels)["le"]), count)
        for (name, labels), count in samples.items()
        if name == "healthlog_fold_duration_seconds_bucket"
    )
    counts = [count for _, count in buckets]
    assert counts == sorted(counts)
    assert buckets[-1] == (float("inf"), 3)
    # Both parsed deliveries changed the 10:00 hour of 2024, long over: later than a month.
    assert value("healthlog_late_change_seconds_count") == 2
    assert value("healthlog_late_change_seconds_bucket", le="2592000.0") == 0
    assert value("healthlog_late_change_seconds_bucket", le="+Inf") == 2


async def test_first_pass_gauge_and_status_are_this_process_s_as_readyz_is_serve_118(
    tmp_path: Path,
) -> None:
    """SERVE-118: a data directory a service had folded (its store marked: a pass reached the
    end of the queue) served again while another process holds the fold lease for an hour:
    `/readyz` is 503, and `healthlog_first_pass_completed` of `/metrics` is 0 and
    `first_pass_completed` of `GET /v1/status` false, as this process has folded nothing; once
    the holder releases the lease and the service folds, all three say so. (Before, both said 1
    and true from the store's mark of the earlier process while `/readyz` said 503.)"""
    data = tmp_path / "data"
    async with serving(data) as service:
        await service.wait_folded()
    with DataDir(data).open_store() as store:
        assert store.acquire_lease("other:1:x", now=clock.now_us(), ttl=3_600_000_000) == 2
    with DataDir(data).open_tokens() as tokens:
        tokens.revoke(TOKEN_NAME)

    async with serving(data) as service:
        assert (await service.client.get("/readyz")).status_code == 503
        samples = await metric_samples(service.client)
        assert samples["healthlog_first_pass_completed", labelled()] == 0
        assert (await service.status())["first_pass_completed"] is False

        with DataDir(data).open_store() as store:
            store.release_lease("other:1:x", 2)
        await service.wait_folded()
        assert (await service.client.get("/readyz")).status_code == 200
        samples = await metric_samples(service.client)
        assert samples["healthlog_first_pass_completed", labelled()] == 1


async def test_metrics_say_how_far_the_furthest_subscriber_is_behind_serve_119(
    service: Service,
) -> None:
    """SERVE-119: `/metrics` has the stream's head (`healthlog_stream_head`, the newest event's
    seq, as `status` says it) and how many events the subscriber furthest behind has not
    acknowledged (`healthlog_subscriber_lag_events`, 0 without a subscriber), whose name is no
    label: a follower (a backup replica) that stopped shows as a lag that grows with each
    delivery of changes. (Before, only how many subscribers there were and how many were
    connected: a replica that stopped, 6 events behind, looked like one that synced by cron.)"""
    first = body(metric("heart_rate", "count/min", point("2024-03-01 10:00:00 +0000", qty=60)))
    assert (await service.post(first, AUTOMATION)).status_code == 200
    await service.wait_folded()
    samples = await metric_samples(service.client)
    assert samples["healthlog_subscriber_lag_events", labelled()] == 0
    async with subscribe(service, 0, subscriber="nas") as ws:
        [event] = await receive(ws, 1)
        await send_ack(ws, event["seq"])
        await acked(service, "nas", event["seq"])
    later = body(
        metric("heart_rate", "count/min", point("2024-03-01 11:00:00 +0000", qty=61)),
        metric("step_count", "count", point("2024-03-01 12:00:00 +0000", qty=9)),
    )
    assert (await service.post(later, AUTOMATION)).status_code == 200
    status = await service.wait_folded()
    samples = await metric_samples(service.client)

    assert samples["healthlog_stream_head", labelled()] == status["stream"]["head"]
    behind = status["stream"]["head"] - event["seq"]
    assert behind >= 2
    assert samples["healthlog_subscriber_lag_events", labelled()] == behind
    assert not any("nas" in str(labels) for _, labels in samples)


async def test_metrics_give_the_databases_sizes_a_held_wal_included_serve_120(
    service: Service,
) -> None:
    """SERVE-120: `healthlog_database_bytes{file}` of `/metrics` gives the size of
    `journal.sqlite`, `store.sqlite` and the `-wal` of each, as the file system says, and
    nothing else: while another program keeps a read transaction open on `store.sqlite`,
    the store's `-wal` grows with each delivery folded and the gauge says so. (Before, only
    the raw bytes journaled: a `-wal` a database browser held from 49 KB to 1.6 MB in 40
    deliveries was not in `/metrics`.)"""

    def sizes(samples: dict[tuple[str, frozenset[Any]], float]) -> dict[str, float]:
        return {
            dict(labels)["file"]: value
            for (name, labels), value in samples.items()
            if name == "healthlog_database_bytes"
        }

    files = ("journal.sqlite", "journal.sqlite-wal", "store.sqlite", "store.sqlite-wal")
    first = body(metric("heart_rate", "count/min", point("2024-03-01 10:00:00 +0000", qty=60)))
    assert (await service.post(first, AUTOMATION)).status_code == 200
    await service.wait_folded()
    before = sizes(await metric_samples(service.client))
    assert sorted(before) == sorted(files)
    assert before["journal.sqlite"] == (service.data.path / "journal.sqlite").stat().st_size > 0

    with closing(sqlite3.connect(service.data.path / "store.sqlite", isolation_level=None)) as held:
        held.execute("BEGIN")
        held.execute("SELECT count(*) FROM sqlite_master").fetchone()
        for hour in range(11, 21):
            later = body(
                metric("heart_rate", "count/min", point(f"2024-03-01 {hour}:00:00 +0000", qty=61))
            )
            assert (await service.post(later, AUTOMATION)).status_code == 200
        await service.wait_folded()
        after = sizes(await metric_samples(service.client))
        wal = (service.data.path / "store.sqlite-wal").stat().st_size

    # Held, the -wal only grows (a lease renewal may add to it after the scrape).
    assert before["store.sqlite-wal"] < after["store.sqlite-wal"] <= wal


async def test_metrics_count_writes_to_sealed_objects_and_unit_mismatches_serve_121(
    service: Service,
) -> None:
    """SERVE-121: after a seal of 1 March 2024, a delivery that changes a sealed hour of it in
    other units than the stored ones counts 1 in `healthlog_points_total{counter=
    "sealed_writes"}` and 1 in `{counter="unit_mismatches"}`, as the store's totals do. (Before,
    neither was in `/metrics`: a nightly seal's late writes and a phone's changed units showed
    as WARNING lines alone, though the store kept their totals.)"""
    first = body(metric("heart_rate", "count/min", point("2024-03-01 10:00:00 +0000", qty=60)))
    assert (await service.post(first, AUTOMATION)).status_code == 200
    await service.wait_folded()
    samples = await metric_samples(service.client)
    assert samples["healthlog_points_total", labelled(counter="sealed_writes")] == 0
    assert samples["healthlog_points_total", labelled(counter="unit_mismatches")] == 0
    seal = Seal(parse_instant("2024-03-02T00:00:00Z"))
    with service.data.open_journal() as journal:
        journal.append(NewDelivery(seal.encode(), SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))
    await service.wait_folded()
    late = body(metric("heart_rate", "bpm", point("2024-03-01 10:05:00 +0000", qty=61)))
    assert (await service.post(late, AUTOMATION)).status_code == 200
    await service.wait_folded()

    samples = await metric_samples(service.client)
    assert samples["healthlog_points_total", labelled(counter="sealed_writes")] == 1
    assert samples["healthlog_points_total", labelled(counter="unit_mismatches")] == 1


# -- read side ------------------------------------------------------------------------------

POINTS_FILTERS: list[dict[str, str]] = [
    {},
    {"metric": "heart_rate"},
    {"metric": "heart_rate", "layer": "hours"},
    {"layer": "records"},
    {"from": "2024-02-06T15:30:00Z", "to": "2024-02-06T17:00:00Z"},
]


async def export(data: DataDir, filters: dict[str, str], fmt: str) -> bytes:
    """``healthlog export`` with the same filters, as a process of its own."""
    flags = [part for name, value in filters.items() for part in (f"--{name}", value)]
    args = ["export", "--data", data.path, *flags, "--format", fmt]
    done = await trio.run_process(
        [sys.executable, "-m", "healthlog.cli", *args], capture_stdout=True, capture_stderr=True
    )
    return bytes(done.stdout)


async def test_points_equal_the_export(service: Service) -> None:
    """SERVE-20: `/v1/points` gives the bytes `healthlog export` prints, filter by filter."""
    minutes = body(
        metric(
            "heart_rate",
            "count/min",
            *(
                point(f"2024-02-06 {stamp} +0000", qty=60 + i, source="Anna\u2019s Watch")
                for i, stamp in enumerate(("15:00:00", "15:30:00", "16:10:00", "17:45:00"))
            ),
        ),
        metric("step_count", "count", point("2024-02-06 16:00:00 +0000", qty=1200)),
        workouts=[
            compact(
                {
                    "name": "Walk",
                    "start": "2024-02-06 16:00:00 +0000",
                    "end": "2024-02-06 16:30:00 +0000",
                }
            )
        ],
    )
    hours = body(
        metric(
            "heart_rate",
            "count/min",
            *(point(f"2024-02-06 {h}:00:00 +0000", Avg=70 + h) for h in (15, 16, 17)),
        )
    )
    for content, layer in ((minutes, "minutes"), (hours, "hours")):
        response = await service.post(content, {"automation-aggregation": layer})
        assert response.status_code == 200
    await service.wait_folded()
    for filters in POINTS_FILTERS:
        for fmt in ("jsonl", "csv"):
            response = await service.get("/v1/points", **filters, format=fmt)
            assert response.status_code == 200
            expected = await export(service.data, filters, fmt)
            assert response.content == expected, (filters, fmt)
            assert len(expected.splitlines()) > (fmt == "csv"), (filters, fmt)
    bad_format = await service.get("/v1/points", format="xml")
    assert (bad_format.status_code, bad_format.json()["error"]) == (400, "BAD_FORMAT")
    bad_time = await service.get("/v1/points", **{"from": "yesterday"})
    assert (bad_time.status_code, bad_time.json()["error"]) == (400, "BAD_TIMESTAMP")


async def test_points_name_their_charset_serve_81(service: Service) -> None:
    """SERVE-81: `/v1/points` says its bytes are UTF-8, as jsonl and as csv, so a client that
    decodes by the header reads a source name with a character beyond ASCII as it was sent."""
    watch = "Anna\u2019s Apple Watch"
    content = body(
        metric("heart_rate", "count/min", point("2024-02-06 15:00:00 +0000", qty=61, source=watch))
    )
    assert (await service.post(content, MINUTES)).status_code == 200
    await service.wait_folded()
    for fmt, media_type in (("jsonl", "application/x-ndjson"), ("csv", "text/csv")):
        response = await service.get("/v1/points", format=fmt)
        assert response.status_code == 200
        assert response.headers["content-type"] == f"{media_type}; charset=utf-8", fmt
        assert response.charset_encoding == "utf-8", fmt
        text = response.content.decode(response.charset_encoding)
        assert watch in text, fmt
        assert response.content == await export(service.data, {}, fmt), fmt


async def chunks_of(service: Service, target: str) -> list[bytes]:
    """The body of a GET of ``target`` over HTTP/1.1, chunk by chunk as the server framed it."""
    client = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", service.port)
    async with stream:
        headers = [("Host", "127.0.0.1"), *service.auth.items(), *CLOSE.items()]
        asked = h11.Request(method="GET", target=target, headers=headers)
        await stream.send_all(client.send(asked))
        await stream.send_all(client.send(h11.EndOfMessage()))
        chunks: list[bytes] = []
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some())
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                if event.chunk_start or not chunks:
                    chunks.append(b"")
                chunks[-1] += event.data
            elif isinstance(event, h11.EndOfMessage):
                return chunks


async def test_points_come_a_chunk_per_object_serve_54(service: Service) -> None:
    """SERVE-54: 120 minute points in two hourly objects come in at most two chunks, not one
    per point, and hold the bytes `healthlog export` prints."""
    minutes = body(
        metric(
            "heart_rate",
            "count/min",
            *(
                point(f"2024-02-06 {15 + m // 60}:{m % 60:02d}:00 +0000", qty=60 + m % 7)
                for m in range(120)
            ),
        )
    )
    assert (await service.post(minutes, MINUTES)).status_code == 200
    await service.wait_folded()
    chunks = await chunks_of(service, "/v1/points?metric=heart_rate")
    assert b"".join(chunks) == await export(service.data, {"metric": "heart_rate"}, "jsonl")
    assert sum(chunk.count(b"\n") for chunk in chunks) == 120
    assert len(chunks) <= 2, len(chunks)


async def test_points_come_in_chunks_of_many_objects_serve_55(service: Service) -> None:
    """SERVE-55: 600 hourly objects of one point each come in two chunks of at most 64 KiB
    and a line, not one per object, and hold the bytes `healthlog export` prints."""
    first = datetime(2024, 2, 1, tzinfo=UTC)
    stamps = [(first + timedelta(hours=h)).strftime("%Y-%m-%d %H:%M:%S +0000") for h in range(600)]
    hourly = body(metric("step_count", "count", *(point(stamp, qty=7) for stamp in stamps)))
    assert (await service.post(hourly, MINUTES)).status_code == 200
    await service.wait_folded()
    chunks = await chunks_of(service, "/v1/points?metric=step_count")
    assert b"".join(chunks) == await export(service.data, {"metric": "step_count"}, "jsonl")
    assert sum(chunk.count(b"\n") for chunk in chunks) == 600
    assert len(chunks) == 2, len(chunks)
    longest_line = max(map(len, b"".join(chunks).splitlines(keepends=True)))
    assert max(map(len, chunks)) < app_module.POINTS_CHUNK_BYTES + longest_line


async def test_points_are_of_one_state_while_a_fold_commits_serve_140(service: Service) -> None:
    """SERVE-140: a `/v1/points` answer of 60,000 points (some 11 MB, more than the sockets
    buffer) read slowly while a re-send of every point with another value folds: every line of
    it holds the first delivery's value, as the store was when the answer began, and one asked
    after it the second's. Before, each page of 64 objects was read on its own, and the pages
    read after the fold's commit held the new values: a state the store never held (CLI-215
    for `healthlog export`)."""
    hours = 1000

    def resend(qty: int) -> bytes:
        first = datetime(2024, 2, 1, tzinfo=UTC)
        return body(
            metric(
                "heart_rate",
                "count/min",
                *(
                    point(
                        (first + timedelta(minutes=m)).strftime("%Y-%m-%d %H:%M:%S +0000"), qty=qty
                    )
                    for m in range(hours * 60)
                ),
            )
        )

    assert (await service.post(resend(1), MINUTES)).status_code == 200
    await service.wait_folded()
    client = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", service.port)
    async with stream:
        headers = [("Host", "127.0.0.1"), *service.auth.items(), *CLOSE.items()]
        asked = h11.Request(method="GET", target="/v1/points?metric=heart_rate", headers=headers)
        await stream.send_all(client.send(asked))
        await stream.send_all(client.send(h11.EndOfMessage()))
        received = b""
        folded = False
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some())
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                received += event.data
                if not folded:
                    # The answer has begun: the rest waits in the service for this reader.
                    folded = True
                    assert (await service.post(resend(2), MINUTES)).status_code == 200
                    await service.wait_folded()
            elif isinstance(event, h11.EndOfMessage):
                break
    values = Counter(json.loads(line)["point"]["qty"] for line in received.splitlines())
    assert values == {1: hours * 60}
    after = await service.get("/v1/points", metric="heart_rate")
    assert Counter(json.loads(line)["point"]["qty"] for line in after.content.splitlines()) == {
        2: hours * 60
    }


async def _points_read(service: Service, **params: str) -> tuple[int, bytes, bool]:
    """The status of a `/v1/points` answer, the bytes received, and whether it was cut short
    (the connection closed before the body's end)."""
    async with service.client.stream(
        "GET", "/v1/points", params=params, headers=service.auth
    ) as answer:
        received = b""
        try:
            async for chunk in answer.aiter_raw():
                received += chunk
        except httpx.RemoteProtocolError:
            return answer.status_code, received, True
        return answer.status_code, received, False


async def test_points_reaching_a_damaged_object_name_it_serve_108(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-108: `/v1/points` reaching an object whose body does not decode logs one ERROR
    naming the object and the remedy, as `healthlog export` says it (CLI-34): asked for that
    object alone it answers 500 `OBJECT_CORRUPT`; asked for more than a chunk of lines before
    it, the answer (200, already under way) holds every line before the object and is cut
    short there, so that no client takes it for whole. (Before, both were 200 and cut, and the
    service's only record was hypercorn's `Error in ASGI Framework`, naming nothing.)"""
    first = datetime(2024, 2, 1, tzinfo=UTC)
    stamps = [(first + timedelta(hours=h)).strftime("%Y-%m-%d %H:%M:%S +0000") for h in range(600)]
    sent = body(
        metric("heart_rate", "count/min", *(point(stamp, qty=61) for stamp in stamps)),
        metric("step_count", "count", point(stamps[0], qty=7)),
    )
    assert (await service.post(sent, MINUTES)).status_code == 200
    await service.wait_folded()
    before = await export(service.data, {"metric": "heart_rate"}, "jsonl")
    assert len(before) > app_module.POINTS_CHUNK_BYTES
    with closing(sqlite3.connect(service.data.store_path)) as conn, conn:
        conn.execute("UPDATE objects SET body = x'00112233' WHERE metric = 'step_count'")
    with caplog.at_level(logging.INFO):
        alone = await _points_read(service, metric="step_count")
        whole = await _points_read(service)
    assert alone == (500, b'{"error":"OBJECT_CORRUPT"}', False)
    assert whole == (200, before, True)
    named = (
        "GET /v1/points stopped: object body cannot be decoded: BadGzipFile (step_count minutes"
        " 2024-02-01T00:00:00Z); `healthlog verify` lists such objects, `healthlog reindex`"
        " rebuilds them"
    )
    errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [("healthlog.http", named)] * 2


# -- bad input ------------------------------------------------------------------------------


async def test_thousand_concurrent_posts_are_each_journaled_once(service: Service) -> None:
    """SERVE-21: 1,000 posts at once over at most 50 connections; each answer is the receipt of
    its own delivery's journal row, though the journal commits them in groups."""
    contents = [small(n) for n in range(1000)]
    statuses: list[int] = []
    receipts: dict[int, str] = {}
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)

    async def post(client: httpx.AsyncClient, content: bytes) -> None:
        response = await client.post("/v1/deliveries", content=content, headers=service.auth)
        statuses.append(response.status_code)
        receipt = response.json()
        assert receipt["sha256"] == sha256(content)
        receipts[receipt["delivery_id"]] = receipt["sha256"]

    started = trio.current_time()
    async with (
        # Waiting for one of the 50 connections is not a request timing out.
        httpx.AsyncClient(
            base_url=service.url,
            limits=limits,
            timeout=httpx.Timeout(CLIENT_TIMEOUT_S, pool=None),
        ) as client,
        trio.open_nursery() as nursery,
    ):
        for content in contents:
            nursery.start_soon(post, client, content)
    print(f"1,000 concurrent posts answered in {trio.current_time() - started:.2f} s")
    assert statuses == [200] * 1000
    assert len(receipts) == 1000
    assert sorted(await journaled(service)) == sorted(map(sha256, contents))
    assert {meta.id: meta.sha256 for meta in await service.journal()} == receipts


@pytest.mark.parametrize(
    "size",
    [
        pytest.param(
            100 * 1024,
            id="100KiB",
        ),
        pytest.param(MiB, id="1MiB"),
    ],
)
async def test_oversized_header_is_refused(service: Service, size: int) -> None:
    """SERVE-22: a huge header is refused (431 or closed) and the next request is served."""
    try:
        response = await service.post(small(1), {"X-Padding": "a" * size})
    except httpx.TransportError:
        refused = True
    else:
        refused = 400 <= response.status_code < 500
    assert refused
    assert await service.journal() == []
    assert (await service.post(small(2))).status_code == 200


async def test_stalled_body_is_dropped_and_others_are_served(tmp_path: Path) -> None:
    """SERVE-23: 10 of 1,000 announced bytes, then silence, with `body_timeout_s = 1`: others
    are served meanwhile; the stalled client gets 408 `{"error": "BODY_TIMEOUT"}` and the
    connection is closed."""
    async with serving(tmp_path / "data", body_timeout_s=1) as service:
        stalled = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with stalled:
            await stalled.send_all(
                b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
                b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"data":{"' % service.token.encode()
            )
            others = [small(n) for n in range(3)]
            for content in others:
                assert (await service.post(content)).status_code == 200
            answer = b""
            with trio.fail_after(STALL_LIMIT_S):
                while chunk := await stalled.receive_some():
                    answer += chunk
        head, _, refusal = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert b"\r\ncontent-type: application/json" in head.lower(), head
        assert json.loads(refusal) == {"error": "BODY_TIMEOUT"}
        assert await journaled(service) == [sha256(content) for content in others]


DRIP_PAUSE_S = 0.2
DRIP_MAX_BYTES = 100
"""A drip of a byte every ``DRIP_PAUSE_S`` gives up after this many bytes (20 s)."""


async def drip_until_answered(stream: trio.SocketStream) -> tuple[bytes, int]:
    """Send a byte every ``DRIP_PAUSE_S`` until the server answers and closes (or
    ``DRIP_MAX_BYTES`` are sent); the answer and the bytes dripped."""
    answer = b""
    dripped = 0
    async with trio.open_nursery() as nursery:

        async def drip() -> None:
            nonlocal dripped
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while dripped < DRIP_MAX_BYTES:
                    await stream.send_all(b" ")
                    dripped += 1
                    await trio.sleep(DRIP_PAUSE_S)

        nursery.start_soon(drip)
        with trio.move_on_after(DRIP_MAX_BYTES * DRIP_PAUSE_S + STALL_LIMIT_S):
            with contextlib.suppress(trio.BrokenResourceError):
                while chunk := await stream.receive_some():
                    answer += chunk
        nursery.cancel_scope.cancel()
    return answer, dripped


async def test_a_body_dripping_a_byte_at_a_time_is_cut_off_serve_74(tmp_path: Path) -> None:
    """SERVE-74: GIVEN `body_timeout_s = 2` WHEN a client announces 1,000 bytes and sends one
    every 0.2 s THEN it gets 408 `BODY_TIMEOUT` and its connection is closed before it has sent
    100, and nothing of it is journaled; WHEN another sends 24 KiB in pieces of 4 KiB every
    0.5 s (2.5 s in all, longer than `body_timeout_s`) THEN it is answered 200."""
    async with serving(tmp_path / "data", body_timeout_s=2) as service:
        slow = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with slow:
            await slow.send_all(
                b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
                b"Authorization: Bearer %s\r\nContent-Length: 1000\r\n\r\n" % service.token.encode()
            )
            answer, dripped = await drip_until_answered(slow)
        content = small(1) + b" " * (24 * 1024 - len(small(1)))
        pieces = [content[i : i + 4096] for i in range(0, len(content), 4096)]
        steady = await post_stream(service.client, Drip(pieces, pause_s=0.5), service.auth)
        head, _, refusal = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), (dripped, answer[:100])
        assert json.loads(refusal) == {"error": "BODY_TIMEOUT"}
        assert dripped < DRIP_MAX_BYTES
        assert steady.status_code == 200, steady.text
        assert await journaled(service) == [sha256(content)]


async def test_a_body_cut_off_by_its_timeout_is_logged_with_why_serve_135(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-135: GIVEN `body_timeout_s = 1` WHEN a client announces 1,000 bytes, sends 10 and
    stalls, and another drips a byte every 0.2 s THEN each gets 408 `BODY_TIMEOUT` and one INFO
    line says so, with the address, what came of the announced bytes and why: the first that
    nothing came for 1 s (`body_timeout_s`), the second that its body came slower than 1 KiB/s;
    no line holds the token or a byte of the body. (Before, a phone whose upload a slow link or
    a pause cut off left nothing in the log, at any level.)"""
    async with serving(tmp_path / "data", body_timeout_s=1) as service:
        head = (
            b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: 1000\r\n\r\n" % service.token.encode()
        )
        with caplog.at_level(logging.INFO, logger="healthlog.http"):
            stalled = await trio.open_tcp_stream("127.0.0.1", service.port)
            async with stalled:
                await stalled.send_all(head + b'{"data":{"')
                stalled_answer = await read_until_closed(stalled)
            slow = await trio.open_tcp_stream("127.0.0.1", service.port)
            async with slow:
                await slow.send_all(head)
                slow_answer, dripped = await drip_until_answered(slow)
        assert stalled_answer.startswith(b"HTTP/1.1 408 "), stalled_answer[:100]
        assert slow_answer.startswith(b"HTTP/1.1 408 "), slow_answer[:100]
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert lines[0] == (
            "refused 408 POST /v1/deliveries from 127.0.0.1: the body stalled: nothing came for "
            "1 s (body_timeout_s), after 10 of 1,000 bytes"
        ), lines
        # The drip's last byte may be sent as the server cuts it off, and never read.
        slow_line = re.fullmatch(
            r"refused 408 POST /v1/deliveries from 127\.0\.0\.1: the body came slower than "
            r"1 KiB/s on average after body_timeout_s \(1 s\): ([0-9]+) of 1,000 bytes",
            lines[1],
        )
        assert slow_line is not None, lines
        assert dripped - 1 <= int(slow_line[1]) <= dripped
        assert len(lines) == 2, lines
        assert not any(service.token in line or '{"data"' in line for line in lines)
        assert await service.journal() == []


KEEP_ALIVE_S = 0.1
IDLE_EDGE_TRIES = 80
"""Connections whose second request is sent as their keep-alive timeout runs out."""


async def answer_of(stream: trio.SocketStream) -> bytes | None:
    """One whole answer read from ``stream`` (its head and a body of ``content-length``), or
    None when the connection closed or was reset first."""
    got = b""
    with trio.fail_after(STALL_LIMIT_S):
        while True:
            head, crlf, rest = got.partition(b"\r\n\r\n")
            length = re.search(rb"\r\ncontent-length: *([0-9]+)", head, re.IGNORECASE)
            if crlf and length and len(rest) >= int(length[1]):
                return got
            try:
                chunk = await stream.receive_some()
            except trio.BrokenResourceError:
                return None
            if not chunk:
                return None
            got += chunk


async def test_a_request_meeting_the_keep_alive_timeout_is_answered_or_not_journaled_serve_136(
    tmp_path: Path,
) -> None:
    """SERVE-136: GIVEN `keep_alive_timeout_s = 0.1` WHEN 80 clients each send a delivery, and a
    second on the same connection as its keep-alive timeout runs out (from 6 ms before it to
    6 ms after), as a reverse proxy reuses a pooled connection THEN every second delivery
    journaled was answered 200 on its connection, and those sent before the timer's end were.
    (Before, the timer's close went ahead once it had begun, though the request had come and
    was journaled meanwhile: through Caddy, with `keep_alive_timeout_s = 1` and deliveries every
    0.97 to 1.01 s, 9 of 200 were answered 502, 5 of those 9 journaled all the same.)"""
    async with serving(tmp_path / "data", keep_alive_timeout_s=KEEP_ALIVE_S) as service:
        answered: list[str] = []
        unanswered: list[str] = []
        for n in range(IDLE_EDGE_TRIES):
            first, second = small(2 * n), small(2 * n + 1)
            stream = await trio.open_tcp_stream("127.0.0.1", service.port)
            async with stream:
                for content in (first, second):
                    await stream.send_all(
                        b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
                        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                        % (service.token.encode(), len(content), content)
                    )
                    answer = await answer_of(stream)
                    if content is first:
                        assert answer is not None
                        assert answer.startswith(b"HTTP/1.1 200 ")
                        offset = 0.006 * (2 * n / (IDLE_EDGE_TRIES - 1) - 1)
                        await trio.sleep(KEEP_ALIVE_S + offset)
                    elif answer is not None and answer.startswith(b"HTTP/1.1 200 "):
                        answered.append(sha256(content))
                    else:
                        unanswered.append(sha256(content))
        journal = set(await journaled(service))
        assert journal.isdisjoint(unanswered), (
            len(answered),
            len(unanswered),
            len(journal.intersection(unanswered)),
        )
        # The tries reach from before the timer's end, where every delivery is answered.
        assert answered, len(unanswered)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    """What the server sends until it closes, or what came within ``STALL_LIMIT_S``."""
    answer = b""
    with trio.move_on_after(STALL_LIMIT_S):
        while chunk := await stream.receive_some():
            answer += chunk
    return answer


async def test_a_refusal_reaches_a_client_waiting_to_continue_first_serve_75(
    tmp_path: Path,
) -> None:
    """SERVE-75: GIVEN `max_body_mib = 1` WHEN a client with `Expect: 100-continue` announces
    2 MiB, with the token or without one, and waits THEN it gets 413 or 401 and no `100
    Continue`, and the connection is closed, before it has sent any of the body; WHEN it
    announces a small delivery THEN it gets `100 Continue`, sends the body and gets 200."""
    content = small(1)
    async with serving(tmp_path / "data", max_body_mib=1, body_timeout_s=30) as service:
        answers = []
        for authorization in (b"Authorization: Bearer %s\r\n" % service.token.encode(), b""):
            waiting = await trio.open_tcp_stream("127.0.0.1", service.port)
            async with waiting:
                await waiting.send_all(
                    b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n%s"
                    b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (authorization, 2 * MiB)
                )
                answers.append(await read_until_closed(waiting))
        small_one = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with small_one:
            await small_one.send_all(
                b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\nConnection: close\r\n"
                b"Authorization: Bearer %s\r\nExpect: 100-continue\r\nContent-Length: %d\r\n"
                b"\r\n" % (service.token.encode(), len(content))
            )
            told = b""
            with trio.fail_after(STALL_LIMIT_S):
                while b"\r\n\r\n" not in told:
                    told += await small_one.receive_some()
            await small_one.send_all(content)
            answered = told + await read_until_closed(small_one)
        too_large, unauthorized = answers
        assert too_large.startswith(b"HTTP/1.1 413 "), too_large[:100]
        assert too_large.endswith(b'{"error":"BODY_TOO_LARGE","max_body_mib":1}'), too_large
        assert unauthorized.startswith(b"HTTP/1.1 401 "), unauthorized[:100]
        assert b" 100 " not in too_large + unauthorized
        assert answered.startswith(b"HTTP/1.1 100 "), answered[:100]
        assert b"\r\n\r\nHTTP/1.1 200 " in answered, answered
        assert await journaled(service) == [sha256(content)]


def gzip_bomb(inflated: int) -> bytes:
    """gzip of ``inflated`` zero bytes, made a MiB at a time."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(MiB)
    return b"".join(deflate.compress(block) for _ in range(inflated // MiB)) + deflate.flush()


async def test_a_body_with_a_content_coding_is_refused_serve_77(tmp_path: Path) -> None:
    """SERVE-77: WHEN a delivery is posted with `Content-Encoding: gzip` or `br`, or a gzip
    bomb (256 KiB inflating to 256 MiB), or with two `Content-Encoding` headers, `identity`
    then `gzip` THEN each is answered 415
    `UNSUPPORTED_CONTENT_ENCODING` with `Accept-Encoding: identity`, and nothing is journaled;
    WHEN one is posted with `Content-Encoding: identity` THEN it is answered 200."""
    bomb = gzip_bomb(256 * MiB)
    async with serving(tmp_path / "data") as service:
        refused = [
            await service.post(gzip.compress(HEART_RATE), {"Content-Encoding": "gzip"}),
            await service.post(HEART_RATE, {"Content-Encoding": "br"}),
            await service.post(bomb, {"Content-Encoding": "GZIP"}),
            await service.client.post(
                "/v1/deliveries",
                content=gzip.compress(HEART_RATE),
                headers=[
                    *service.auth.items(),
                    ("Content-Encoding", "identity"),
                    ("Content-Encoding", "gzip"),
                ],
            ),
        ]
        plain = await service.post(HEART_RATE, {"Content-Encoding": "identity"})
        for response in refused:
            assert response.status_code == 415, response.text
            assert response.json() == {"error": "UNSUPPORTED_CONTENT_ENCODING"}
            assert response.headers["accept-encoding"] == "identity"
        assert plain.status_code == 200, plain.text
        assert await journaled(service) == [sha256(HEART_RATE)]


async def intake_refused(service: Service) -> dict[str, float]:
    """``healthlog_intake_refused_total`` of ``/metrics``, by reason (its only label)."""
    samples = await metric_samples(service.client)
    refused = {}
    for (name, labels), value in samples.items():
        if name == "healthlog_intake_refused_total":
            [(label, reason)] = labels
            assert label == "reason"
            refused[reason] = value
    return refused


async def test_uploads_that_were_not_journaled_are_counted_serve_78(tmp_path: Path) -> None:
    """SERVE-78: GIVEN `max_body_mib = 1` and `body_timeout_s = 1` WHEN a delivery is refused
    401, 413, 415 and 400 (an `Idempotency-Key` too long, SERVE-102), one stalls (408), one is
    left half-way by its client, and one is answered 200 THEN
    `healthlog_intake_refused_total` counts one of each reason (`unauthorized`, `too_large`,
    `content_encoding`, `idempotency_key`, `body_timeout`, `client_left`), from 0
    before, and `healthlog_intake_accepted_total` the one journaled."""
    head = b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\nAuthorization: Bearer %s\r\n"
    async with serving(tmp_path / "data", max_body_mib=1, body_timeout_s=1) as service:
        before = await intake_refused(service)
        answers = [
            await service.client.post("/v1/deliveries", content=small(1)),
            await post_stream(
                service.client,
                Drip([bytes(2 * MiB)]),
                {**service.auth, **CLOSE, "Content-Length": str(2 * MiB)},
            ),
            await service.post(gzip.compress(small(2)), {"Content-Encoding": "gzip"}),
            await service.post(small(4), {"Idempotency-Key": "k" * 256}),
            await service.post(small(3)),
        ]
        stalled = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with stalled:
            await stalled.send_all(head % service.token.encode() + b"Content-Length: 100\r\n\r\n{")
            stalled_answer = await read_until_closed(stalled)
        left = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with left:
            await left.send_all(head % service.token.encode() + b"Content-Length: 100\r\n\r\n{")
            await trio.sleep(SETTLE_S)
        with trio.fail_after(STALL_LIMIT_S):
            while (after := await intake_refused(service))["client_left"] == 0:
                await trio.sleep(POLL_S)
        accepted = (await metric_samples(service.client))[
            ("healthlog_intake_accepted_total", frozenset())
        ]
    assert [answer.status_code for answer in answers] == [401, 413, 415, 400, 200]
    assert stalled_answer.startswith(b"HTTP/1.1 408 "), stalled_answer[:100]
    reasons = {
        "unauthorized",
        "too_large",
        "content_encoding",
        "idempotency_key",
        "body_timeout",
        "client_left",
    }
    assert before == dict.fromkeys([*reasons, "memory"], 0)
    assert after == {**dict.fromkeys(reasons, 1), "memory": 0}
    assert accepted == 1


async def intake_held(service: Service) -> float:
    """``healthlog_intake_held_bytes`` of ``/metrics``."""
    return (await metric_samples(service.client))[("healthlog_intake_held_bytes", frozenset())]


@pytest.mark.parametrize("first_mib", [1.5, 0.75])
async def test_uploads_in_flight_are_bounded_in_memory_serve_145(
    tmp_path: Path, first_mib: float
) -> None:
    """SERVE-145: GIVEN `intake_memory_mib = 1` and an upload of incompressible bytes holding
    1.5 MiB (or 0.75 MiB) in flight WHEN a second upload of 1 MiB comes THEN it is answered 503
    `INTAKE_BUSY` with `Retry-After` (at its headers, or once it takes the bound over: on its
    way), nothing of it journaled, counted `memory` in `healthlog_intake_refused_total`; the
    first, the oldest upload, is answered 200 though over the bound alone; the second sent
    again then is answered 200, and `healthlog_intake_held_bytes` is back to 0. (Before,
    nothing bounded the uploads in flight: eight incompressible 60 MiB bodies at once took the
    service to 1,030 MiB.)"""
    noise = random.Random(145).randbytes(4 * MiB)
    split = int(first_mib * MiB)
    gate = trio.Event()
    first = Drip([noise[:split], noise[split : 3 * MiB]], gate=gate)
    second = noise[3 * MiB :]
    answers: dict[str, httpx.Response] = {}
    async with serving(tmp_path / "data", intake_memory_mib=1) as service:

        async def send_first() -> None:
            answers["first"] = await post_stream(service.client, first, service.auth)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_first)
            with trio.fail_after(STALL_LIMIT_S):
                # zlib keeps a few KiB of what it was given until it has more.
                while await intake_held(service) < split * 0.9:
                    await trio.sleep(POLL_S)
            answers["refused"] = await service.post(second)
            gate.set()
        answers["again"] = await service.post(second)
        held = await intake_held(service)
        refused = await intake_refused(service)
    assert answers["refused"].status_code == 503, answers["refused"].text
    assert answers["refused"].json() == {"error": "INTAKE_BUSY"}
    assert int(answers["refused"].headers["retry-after"]) > 0
    assert answers["first"].status_code == 200, answers["first"].text
    assert answers["again"].status_code == 200, answers["again"].text
    assert await journaled(service) == [sha256(noise[: 3 * MiB]), sha256(second)]
    assert refused["memory"] == 1
    assert held == 0


async def test_a_journal_the_disk_cannot_hold_says_why_serve_41(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-41: a delivery the journal's disk cannot hold is answered 503 JOURNAL_UNAVAILABLE,
    with one WARNING naming SQLite's error and the journal's file; once there is room, the next
    is answered 200."""
    async with serving(tmp_path / "data") as service:
        with caplog.at_level(logging.WARNING), files_limited_to(4096):
            refused = await service.post(HEART_RATE)
        answered = await service.post(HEART_RATE)
    assert refused.status_code == 503
    assert refused.json() == {"error": "JOURNAL_UNAVAILABLE"}
    assert int(refused.headers["retry-after"]) > 0
    assert answered.status_code == 200
    [record] = [
        r for r in caplog.records if r.getMessage().startswith("intake: journal could not commit")
    ]
    assert record.levelno == logging.WARNING
    expected = rf"intake: journal could not commit: StorageError: {DISK_ERROR} \(journal\.sqlite\)"
    assert re.fullmatch(expected, record.getMessage()), record.getMessage()


async def test_a_journal_moved_away_under_the_service_is_not_written_journal_34(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """JOURNAL-34: with the data directory moved away (or deleted, or its disk unmounted) under
    the running service, a delivery is answered 503 JOURNAL_UNAVAILABLE with a WARNING saying
    why, not 200 for a commit into a file no later start finds; with the directory back, the
    next is answered 200 and both accepted deliveries are in the journal."""
    data, moved = tmp_path / "data", tmp_path / "moved"
    async with serving(data) as service:
        first = await service.post(HEART_RATE)
        data.rename(moved)
        with caplog.at_level(logging.WARNING):
            refused = await service.post(small(1))
        moved.rename(data)
        answered = await service.post(small(1))
        assert (first.status_code, refused.status_code, answered.status_code) == (200, 503, 200)
        assert refused.json() == {"error": "JOURNAL_UNAVAILABLE"}
        assert await journaled(service) == [sha256(HEART_RATE), sha256(small(1))]
    assert any(
        "StorageError: not at its path: moved away, deleted or unmounted" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )


async def test_metrics_count_failed_journal_commits_and_show_the_process_serve_42(
    tmp_path: Path,
) -> None:
    """SERVE-42: a journal commit the disk refuses is counted in `/metrics`, which also shows the
    serving process's resident memory, open files and CPU time; /readyz stays 200."""
    async with serving(tmp_path / "data") as service:
        await service.wait_folded()
        before = await metric_samples(service.client)
        with files_limited_to(4096):
            refused = await service.post(HEART_RATE)
        after = await metric_samples(service.client)
        ready = await service.client.get("/readyz")
    assert refused.status_code == 503
    assert ready.status_code == 200
    failures = ("healthlog_journal_commit_failures_total", frozenset())
    assert (before[failures], after[failures]) == (0, 1)
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total"):
        assert after[(name, frozenset())] > 0, name
    assert any(name == "python_info" for name, _ in after)


RETENTION_PERIOD_S = 0.05


async def test_metrics_say_a_wal_a_reader_keeps_from_being_checkpointed_run_86(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RUN-86: ``/metrics`` gives the size of each database's -wal and whether a reader keeps it
    from being checkpointed: while another program holds a read transaction open on
    journal.sqlite and deliveries take its -wal past WAL_SIZE_LIMIT, the journal's is held
    back (1) and over the limit, the store's not (0); once the reader ends it is 0 again. Only
    a log line said so: a Prometheus user saw nothing of a -wal growing without bound."""
    monkeypatch.setattr(
        serve_module,
        "configured",
        lambda *args, **kwargs: attrs.evolve(
            configured(*args, **kwargs), retention_period_s=RETENTION_PERIOD_S
        ),
    )
    noise = random.Random(86)

    def held(samples: dict[tuple[str, frozenset[Any]], float], database: str) -> float | None:
        return samples.get(("healthlog_wal_held_back", labelled(database=database)))

    async with serving(tmp_path / "data") as service:
        path = service.data.journal_path
        assert (await service.post(b"{}")).status_code == 200
        samples = await metric_samples(service.client)
        assert (held(samples, "journal.sqlite"), held(samples, "store.sqlite")) == (0, 0)
        with closing(sqlite3.connect(path, isolation_level=None)) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM deliveries").fetchone()
            while os.stat(f"{path}-wal").st_size <= WAL_SIZE_LIMIT:
                # Incompressible: each adds its size to the -wal.
                body = base64.b64encode(noise.randbytes(2**20))
                assert (await service.post(body)).status_code == 200
            with trio.fail_after(FOLD_LIMIT_S):
                while held(samples := await metric_samples(service.client), "journal.sqlite") != 1:
                    await trio.sleep(POLL_S)
            wal = samples[("healthlog_database_bytes", labelled(file="journal.sqlite-wal"))]
            assert wal > WAL_SIZE_LIMIT
            assert held(samples, "store.sqlite") == 0
            reader.execute("COMMIT")
        with trio.fail_after(FOLD_LIMIT_S):
            while held(await metric_samples(service.client), "journal.sqlite") != 0:
                await trio.sleep(POLL_S)


async def test_a_pass_whose_mark_the_disk_refuses_is_still_said_store_66(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-66: on a disk that takes no write, a pass that could not write a delivery's
    outcome nor its lag mark is said in `/v1/status`: `stopped_because` is `unwritten`, with
    the delivery pending, while the store's mark still says `empty`, from the pass before.

    (The fold workers started under the file size limit keep it, so this service does not
    fold again once the test lifts it; the folding actor's test of STORE-66 does.)"""
    async with serving(tmp_path / "data") as service:
        await service.wait_folded()
        assert (await service.status())["lag"]["stopped_because"] == "empty"
        # Journaled without yielding to the event loop, so no pass folds it before the disk
        # takes no write.
        with service.data.open_journal() as journal:
            journal.append(NewDelivery(HEART_RATE, "phone", automation_aggregation="minutes"))
        with (
            caplog.at_level(logging.WARNING),
            files_limited_to(4096),
            trio.fail_after(FOLD_LIMIT_S),
        ):
            while (full := await service.status())["lag"]["stopped_because"] != "unwritten":
                await trio.sleep(POLL_S)
        with service.data.open_store() as store:
            marked = store.mark("lag")

    assert full["deliveries"]["pending"] == 1
    assert full["lag"]["oldest_pending_id"] == 1
    assert marked["stopped_because"] == "empty"
    passes = [r.getMessage() for r in caplog.records if r.name == "healthlog.pass"]
    assert passes
    assert all(
        re.fullmatch(
            rf"folding pass: lag mark not written: StorageError: {DISK_ERROR} \(store\.sqlite\)", m
        )
        for m in passes
    ), passes


async def test_slow_journal_commit_is_still_answered(tmp_path: Path) -> None:
    """SERVE-24: the journal is write-locked for 2 s with `body_timeout_s = 1`."""
    async with serving(tmp_path / "data", body_timeout_s=1) as service:
        with closing(sqlite3.connect(service.data.journal_path, isolation_level=None)) as lock:
            lock.execute("BEGIN IMMEDIATE")

            async def release() -> None:
                await trio.sleep(2)
                lock.execute("ROLLBACK")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(release)
                response = await service.post(HEART_RATE)
        assert response.status_code == 200
        assert await journaled(service) == [sha256(HEART_RATE)]


@pytest.mark.parametrize("sent", [10_000, 3 * MiB], ids=["in the event loop", "in batches"])
async def test_client_gone_mid_upload_journals_nothing_and_logs_no_error(
    service: Service, caplog: pytest.LogCaptureFixture, sent: int
) -> None:
    """SERVE-29: 10 KB or 3 MiB of 8 MiB announced, then the client disconnects."""
    upload = await trio.open_tcp_stream("127.0.0.1", service.port)
    async with upload:
        await upload.send_all(
            b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
            % (service.token.encode(), 8 * MiB)
        )
        await upload.send_all(b"x" * sent)
    assert (await service.post(small(1))).status_code == 200
    await trio.sleep(SETTLE_S)
    assert await journaled(service) == [sha256(small(1))]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_other_methods_on_the_intake_route_are_405(service: Service) -> None:
    """SERVE-30: another method than POST (or OPTIONS) on `/v1/deliveries`, with a token and a
    delivery's body, is 405 with `Allow: OPTIONS, POST` and journals nothing."""
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        response = await service.client.request(
            method, "/v1/deliveries", content=small(1), headers=service.auth
        )
        assert response.status_code == 405, method
        assert response.headers["Allow"] == "OPTIONS, POST", method
        assert response.json() == {"error": "METHOD_NOT_ALLOWED"}, method
    assert await service.journal() == []


READ_ROUTES = ("/healthz", "/readyz", "/metrics", "/v1/status", "/v1/deliveries/1", "/v1/points")


async def test_head_options_a_trailing_slash_and_a_query_string_serve_84(
    service: Service,
) -> None:
    """SERVE-84: HEAD on each read route answers GET's status and headers without a body, and
    on `/v1/deliveries` 405 with `Allow: OPTIONS, POST` (OPTIONS: SERVE-94); each route with a
    trailing slash is 404 `NOT_FOUND` as JSON; a query
    string on `/v1/deliveries` is no part of the route: the delivery is journaled. Only the
    delivery posted with a query string is journaled."""
    with_query = await service.client.post(
        "/v1/deliveries?source=phone&x=1", content=small(1), headers=service.auth
    )
    assert with_query.status_code == 200, with_query.text
    await service.wait_folded()
    for path in READ_ROUTES:
        get = await service.get(path)
        head = await service.client.head(path, headers=service.auth)
        assert (head.status_code, head.content) == (get.status_code, b""), path
        assert head.headers["content-type"] == get.headers["content-type"], path
    refused = await service.client.head("/v1/deliveries", headers=service.auth)
    assert (refused.status_code, refused.headers["allow"]) == (405, "OPTIONS, POST")
    for path in (*READ_ROUTES, "/v1/deliveries"):
        slashed = (
            await service.client.post(f"{path}/", content=small(2), headers=service.auth)
            if path == "/v1/deliveries"
            else await service.get(f"{path}/")
        )
        assert slashed.status_code == 404, path
        assert slashed.headers["content-type"] == "application/json", path
        assert slashed.json() == {"error": "NOT_FOUND"}, path
    assert await journaled(service) == [sha256(small(1))]


async def test_options_is_answered_alike_by_every_route_serve_94(service: Service) -> None:
    """SERVE-94: OPTIONS on every route, intake and the stream's plain route among them, with
    or without a token, is 204 with `Allow` listing the route's methods, the `Allow` of its 405,
    with neither body nor `Content-Type` nor `Content-Length`, and the connection serves the
    next request. The read routes answered 200 with an empty `text/html` page, and intake
    405 `METHOD_NOT_ALLOWED`."""
    routes = {
        **dict.fromkeys(
            (
                *READ_ROUTES,
                "/v1/snapshots",
                "/v1/snapshots/key",
                "/v1/snapshots/1",
                "/v1/stream",
            ),
            "GET, HEAD, OPTIONS",
        ),
        "/v1/deliveries": "OPTIONS, POST",
    }
    for path, allow in routes.items():
        for headers in ({}, service.auth):
            options = await service.client.options(path, headers=headers)
            assert (options.status_code, options.headers.get("allow")) == (204, allow), path
            assert options.content == b"", path
            assert "content-type" not in options.headers, path
            assert "content-length" not in options.headers, path
        refused = await service.client.delete(path, headers=service.auth)
        assert (refused.status_code, refused.headers["allow"]) == (405, allow), path
        assert refused.json() == {"error": "METHOD_NOT_ALLOWED"}, path
    async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
        answer = b""
        for path in ("/v1/deliveries", "/v1/status"):
            await conn.send_all(b"OPTIONS %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
            with trio.fail_after(CLIENT_TIMEOUT_S):
                while b"\r\n\r\n" not in answer:
                    chunk = await conn.receive_some()
                    assert chunk, answer
                    answer += chunk
            head, _, answer = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 204 "), head
        await conn.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while chunk := await conn.receive_some():
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert answer.endswith(b'{"ok":true}'), answer
    assert await service.journal() == []


async def status_of(port: int, request: bytes) -> int:
    """The status of the answer to ``request``, sent as raw bytes on a connection of its own."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
        await conn.send_all(request)
        answer = b""
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while b"\r\n" not in answer:
                chunk = await conn.receive_some()
                assert chunk, answer
                answer += chunk
    return int(answer.split(b" ", 2)[1])


async def test_a_token_is_read_through_whitespace_and_scheme_case_serve_84(
    service: Service,
) -> None:
    """SERVE-84: a token with spaces or tabs around it, after `Bearer` (in any case) or as
    `api-key`, is taken by `/v1/status`, by intake and (spaces after `Bearer`) by the stream; a
    `token` query parameter is the stream's alone: `/v1/status` and intake refuse it 401."""
    token = service.token.encode()
    forms = [
        b"Authorization: Bearer   " + token + b"   ",
        b"Authorization:bEaReR " + token,
        b"Authorization: BEARER " + token + b"\t",
        b"api-key: \t " + token + b" \t",
    ]
    for n, form in enumerate(forms):
        status = b"GET /v1/status HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n" % form
        assert await status_of(service.port, status) == 200, n
        content = small(n)
        post = b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n\r\n%s" % (
            len(content),
            form,
            content,
        )
        assert await status_of(service.port, post) == 200, n
    in_query = urllib.parse.urlencode({"token": service.token})
    assert (await service.client.get(f"/v1/status?{in_query}")).status_code == 401
    refused = await service.client.post(f"/v1/deliveries?{in_query}", content=small(99))
    assert refused.status_code == 401
    assert await journaled(service) == [sha256(small(n)) for n in range(len(forms))]
    await service.wait_folded()
    spaced = [(b"authorization", b"Bearer    " + token)]
    async with connect(service.port, "/v1/stream", spaced) as ws:
        [frame] = await receive(ws, 1)
    assert (frame["type"], frame["seq"]) == ("event", 1)


async def test_a_path_with_repeated_slashes_reaches_every_route_serve_85(
    service: Service,
) -> None:
    """SERVE-85: `//v1/deliveries`, `///v1/deliveries` and `/v1//deliveries` journal their
    delivery, `//v1/status` and `/v1//status` answer the status (not a redirect as an HTML
    page), and a stream handshake to `//v1/stream` or `/v1//stream` opens the stream: the paths
    a base URL ending in a slash makes, or a doubled slash in a script."""
    token = service.token.encode()
    posted = (b"//v1/deliveries", b"///v1/deliveries", b"/v1//deliveries")
    for n, path in enumerate(posted):
        content = small(n)
        post = (
            b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"automation-aggregation: minutes\r\nContent-Length: %d\r\n\r\n%s"
            % (path, token, len(content), content)
        )
        assert await status_of(service.port, post) == 200, path
    for path in (b"//v1/status", b"/v1//status"):
        status = b"GET %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n" % (
            path,
            token,
        )
        assert await status_of(service.port, status) == 200, path
    assert await journaled(service) == [sha256(small(n)) for n in range(len(posted))]
    await service.wait_folded()
    for path in ("//v1/stream", "/v1//stream"):
        async with connect(service.port, path, [(b"authorization", b"Bearer " + token)]) as ws:
            [frame] = await receive(ws, 1)
        assert (frame["type"], frame["seq"]) == ("event", 1), path


# -- configuration --------------------------------------------------------------------------


def test_configuration_layers(tmp_path: Path) -> None:
    """SERVE-25: flag > HEALTHLOG_* > healthlog.toml [serve] > default."""
    file = tmp_path / "healthlog.toml"
    file.write_text(
        '[serve]\nport = 9001\nmax_body_mib = 8\nlog_format = "json"\nwake_period_s = 5\n'
    )
    environ = {"HEALTHLOG_PORT": "9002", "HEALTHLOG_MAX_BODY_MIB": "16", "HOME": "/root"}
    flags = {"port": 9003, "host": None, "max_body_mib": None}
    assert load_serve_config(file, flags, environ) == ServeConfig(
        port=9003, max_body_mib=16, log_format="json", wake_period_s=5
    )
    assert load_serve_config(tmp_path / "absent.toml", {}, {}) == ServeConfig()
    file.write_text("[serve]\nmax_body_bytes = 1\n")
    with pytest.raises(ConfigError, match="max_body_bytes"):
        load_serve_config(file, {}, {})
    with pytest.raises(ConfigError, match="port"):
        load_serve_config(tmp_path / "absent.toml", {}, {"HEALTHLOG_PORT": "eighty"})


def test_configuration_error_names_a_refused_choice(tmp_path: Path) -> None:
    """SERVE-26: `HEALTHLOG_LOG_FORMAT=xml` is an error naming `log_format`."""
    with pytest.raises(ConfigError, match="log_format"):
        load_serve_config(tmp_path / "absent.toml", {}, {"HEALTHLOG_LOG_FORMAT": "xml"})


# -- errors and slow readers ------------------------------------------------------------------


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.ERROR]


async def test_unknown_things_are_json_not_found_serve_31(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-31: an id beyond SQLite's integers, a negative or non-numeric id, and an unknown
    route are 404 `NOT_FOUND` in JSON; nothing is logged at ERROR."""
    paths = (
        "/v1/deliveries/99999999999999999999",
        "/v1/deliveries/9223372036854775808",
        "/v1/deliveries/-1",
        "/v1/deliveries/abc",
        "/v1/snapshots/99999999999999999999",
        "/v1/nothing-here",
    )
    for path in paths:
        response = await service.get(path)
        assert response.status_code == 404, path
        assert response.headers["content-type"] == "application/json", path
        assert response.json() == {"error": "NOT_FOUND"}, path
    assert errors_logged(caplog) == []
    assert (await service.get("/v1/status")).status_code == 200


async def test_other_methods_on_read_routes_are_json_405_serve_32(service: Service) -> None:
    """SERVE-32: POST on `/v1/status` and DELETE on `/v1/points` are 405 `METHOD_NOT_ALLOWED` in
    JSON, with an `Allow` header naming GET."""
    for method, path in (("POST", "/v1/status"), ("DELETE", "/v1/points")):
        response = await service.client.request(method, path, headers=service.auth)
        assert response.status_code == 405, path
        assert response.json() == {"error": "METHOD_NOT_ALLOWED"}, path
        assert "GET" in response.headers["Allow"].split(", "), path
    assert await service.journal() == []


async def test_unhandled_exception_is_json_500_logged_by_type_serve_33(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-33: a snapshot file that is a directory makes its route fail unhandled: the answer
    is 500 `INTERNAL` in JSON, one ERROR record names the exception type without its message,
    path or traceback, and the service goes on serving."""
    stream = (await service.status())["stream"]["id"]
    seq = 7
    (service.data.snapshot_dir / f"snapshot-{stream}-{seq}.snap").mkdir(parents=True)
    response = await service.get(f"/v1/snapshots/{seq}")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": "INTERNAL"}
    [record] = errors_logged(caplog)
    message = record.getMessage()
    # The route's pattern, never the path's values (the sequence asked for).
    assert message == "unhandled IsADirectoryError in GET /v1/snapshots/<int:seq>"
    assert stream not in message
    assert "snapshot-" not in message
    assert (record.exc_info, record.exc_text) == (None, None)
    assert (await service.get("/v1/status")).status_code == 200


async def test_slowly_read_export_is_not_cut_by_the_response_timeout_serve_34(
    tmp_path: Path,
) -> None:
    """SERVE-34: with a 0.5 s response timeout, an export of over 8 MiB (more than the socket
    buffers hold) that a client with a small receive buffer starts reading only after 2 s
    arrives whole, ending as a complete chunked body."""
    content = tmp_path / "minutes.json"
    write_minute_body(content, metrics=2, points=25_000)
    async with serving(tmp_path / "data", response_timeout_s=SHORT_RESPONSE_TIMEOUT_S) as service:
        assert (await service.post(content.read_bytes(), MINUTES)).status_code == 200
        await service.wait_folded()
        whole = (await service.get("/v1/points")).content
        assert len(whole) > 8 * MiB
        small_buffer = (socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RECEIVE_BUFFER)
        transport = httpx.AsyncHTTPTransport(socket_options=[small_buffer])
        async with (
            httpx.AsyncClient(
                base_url=service.url, transport=transport, timeout=CLIENT_TIMEOUT_S
            ) as slow,
            slow.stream("GET", "/v1/points", headers=service.auth) as response,
        ):
            assert response.status_code == 200
            await trio.sleep(4 * SHORT_RESPONSE_TIMEOUT_S)
            received = await response.aread()
    assert received == whole


async def h2c_post_then_leave(port: int, token: str, content: bytes, *, end: bool) -> None:
    """Over HTTP/2 without TLS (h2c): POST a delivery, its body whole (``end``) or not, and
    close the connection without reading the answer."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":path", "/v1/deliveries"),
                (":scheme", "http"),
                (":authority", "healthlog"),
                ("authorization", f"Bearer {token}"),
            ],
        )
        connection.send_data(stream_id, content, end_stream=end)
        await stream.send_all(connection.data_to_send())
        await trio.sleep(H2_LINGER_S)


H2_LINGER_S = 0.1
"""How long an h2c client that leaves stays connected after its request."""
H2_GRACE_S = 10.0


def open_sockets() -> int:
    """The sockets this process (the service and the test) has open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


async def test_http2_clients_gone_before_their_answer_leave_nothing_open_serve_35(
    tmp_path: Path,
) -> None:
    """SERVE-35: over h2c, clients that leave before their answer (a refused token with half a
    body, or a whole delivery whose journal commit waits on a lock) leave no connection open
    behind them; the deliveries are journaled once each, and the service stops promptly."""
    leavers = 20
    async with serving(tmp_path / "data", graceful_timeout_s=H2_GRACE_S) as service:
        assert (await service.post(small(0))).status_code == 200
        before = open_sockets()
        for _ in range(leavers):
            await h2c_post_then_leave(service.port, "wrong", b'{"partial":', end=False)
        with closing(sqlite3.connect(service.data.journal_path, isolation_level=None)) as lock:
            lock.execute("BEGIN IMMEDIATE")
            for n in range(1, 4):
                await h2c_post_then_leave(service.port, service.token, small(n), end=True)
            lock.execute("ROLLBACK")
        with trio.fail_after(H2_GRACE_S):
            while open_sockets() > before:
                await trio.sleep(POLL_S)
            while len(await journaled(service)) < 4:
                await trio.sleep(POLL_S)
        assert sorted(await journaled(service)) == sorted(sha256(small(n)) for n in range(4))
        stopping = trio.current_time()
    assert trio.current_time() - stopping < H2_GRACE_S / 2


UPGRADE_WITH_TRAILING_BYTES = (
    b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n\r\nx\n"
)
# Refused subscribers closing as the service closes them: spaced out past the token cache's
# reload period, which is when the race between the two closes showed.
REFUSED_CLOSERS = 4
REFUSED_SPACING_S = 2.1


async def refused_then_closed(port: int) -> bytes:
    """A subscriber with a wrong token that closes its side as soon as it is refused; what the
    service sent it."""
    ws = WSConnection(ConnectionType.CLIENT)
    async with await trio.open_tcp_stream("127.0.0.1", port) as tcp:
        request = Request(
            host="127.0.0.1",
            target="/v1/stream?after=0",
            extra_headers=[(b"authorization", b"Bearer hl_wrong")],
        )
        await tcp.send_all(ws.send(request))
        received = b""
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while data := await tcp.receive_some(2**16):
                received += data
                ws.receive_data(data)
                if any(isinstance(event, TextMessage) for event in ws.events()):
                    await tcp.send_all(ws.send(CloseConnection(code=1000)))
        return received


CONTAINED = "http: a connection failed inside hypercorn and was closed: "
CONTAINED_LINE = re.compile(re.escape(CONTAINED) + r"\w+(, \w+)*")
"""The exceptions' types alone, never what they say."""


def contained(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(CONTAINED)]


async def test_a_connection_failing_inside_hypercorn_stays_with_it_serve_37(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-37: an upgrade request followed by trailing bytes, and refused subscribers that
    close their side as the service closes it, each end their own connection only: the service
    answers deliveries after them, and says so at WARNING naming the exception's type alone,
    once for the connection with trailing bytes."""
    async with serving(tmp_path / "data") as service:
        with caplog.at_level(logging.WARNING, "healthlog.http"):
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as tcp:
                await tcp.send_all(UPGRADE_WITH_TRAILING_BYTES)
                with trio.fail_after(CLIENT_TIMEOUT_S):
                    answer = await tcp.receive_some(2**16)
            assert answer.startswith(b"HTTP/1.1 400")
            for n in range(REFUSED_CLOSERS):
                await trio.sleep(REFUSED_SPACING_S)
                if n == 0:
                    assert [r.getMessage() for r in contained(caplog)] == [
                        f"{CONTAINED}LocalProtocolError"
                    ]
                assert b'"UNAUTHORIZED"' in await refused_then_closed(service.port)
            assert (await service.post(small(1))).status_code == 200
    records = contained(caplog)
    assert [r.getMessage() for r in records] == [f"{CONTAINED}LocalProtocolError"]
    assert {r.levelno for r in records} == {logging.WARNING}
    for record in records:
        assert CONTAINED_LINE.fullmatch(record.getMessage()), record.getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.WARNING] == []


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big")
    return head + payload


ZERO_WINDOW_LEAVERS = 20
CHURNED = 100


async def test_an_idle_connection_is_closed_after_a_delivery_serve_46(tmp_path: Path) -> None:
    """SERVE-46: a kept-alive HTTP/1.1 connection that posted a delivery (200) or was refused
    one (401) and then sends nothing is closed after ``keep_alive_timeout_s``, as one that
    asked a read route is; it was held open until the client left."""
    async with serving(tmp_path / "data", keep_alive_timeout_s=1) as service:
        requests = {
            "delivery": b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Authorization: Bearer %s\r\n\r\n{}" % service.token.encode(),
            "refused": b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Authorization: Bearer hl_wrong\r\n\r\n{}",
            "read route": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        }
        for name, request in requests.items():
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
                await conn.send_all(request)
                started = trio.current_time()
                answer = b""
                with trio.fail_after(10):
                    while chunk := await conn.receive_some():
                        answer += chunk
                closed_after = trio.current_time() - started
            assert answer.startswith(b"HTTP/1.1 401" if name == "refused" else b"HTTP/1.1 200"), (
                name
            )
            assert 0.5 < closed_after < 5, (name, closed_after)


async def h2c_idle_after_answer(
    port: int, headers: list[tuple[str, str]], content: bytes
) -> tuple[int, float]:
    """Over h2c, one request (a body ``content`` if any), then nothing: the answer's status and
    how long after the answer ended the service closed the connection (inf if not in 10 s)."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    request = [(":scheme", "http"), (":authority", "x"), *headers]
    connection.send_headers(1, request, end_stream=not content)
    if content:
        connection.send_data(1, content, end_stream=True)
    status, ended = 0, float("inf")
    async with await trio.open_tcp_stream("127.0.0.1", port) as tcp:
        await tcp.send_all(connection.data_to_send())
        with trio.move_on_after(IDLE_CLOSE_LIMIT_S):
            while data := await tcp.receive_some(2**16):
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = int(dict(event.headers)[b":status"])
                    elif isinstance(event, h2.events.StreamEnded):
                        ended = trio.current_time()
                await tcp.send_all(connection.data_to_send())
            return status, trio.current_time() - ended
    return status, float("inf")


IDLE_CLOSE_LIMIT_S = 10.0


async def test_an_idle_h2c_connection_is_closed_after_a_delivery_serve_47(tmp_path: Path) -> None:
    """SERVE-47: over h2c, a connection that posted a delivery (200) or was refused one (401)
    and then sends nothing is closed after ``keep_alive_timeout_s``, as one that asked a read
    route is; the intake's answer, cancelled as its own end brought the disconnect, cancelled
    the keep-alive timer with it, and the connection stayed open until the client left."""
    post = [(":method", "POST"), (":path", "/v1/deliveries")]
    async with serving(tmp_path / "data", keep_alive_timeout_s=1) as service:
        requests = {
            "delivery": ([*post, ("authorization", f"Bearer {service.token}")], b"{}", 200),
            "refused": ([*post, ("authorization", "Bearer hl_wrong")], b"{}", 401),
            "read route": ([(":method", "GET"), (":path", "/healthz")], b"", 200),
        }
        for name, (headers, content, expected) in requests.items():
            status, closed_after = await h2c_idle_after_answer(service.port, headers, content)
            assert status == expected, name
            assert 0.5 < closed_after < 5, (name, closed_after)
        assert await journaled(service) == [sha256(b"{}")]


async def test_an_h2c_connection_that_asks_nothing_is_closed_stream_151(tmp_path: Path) -> None:
    """STREAM-151: an h2c connection that sends the preface (with its SETTINGS, as a client
    opening a connection ahead of its requests does) and then nothing is closed after
    ``keep_alive_timeout_s``, as an HTTP/1.1 connection that sends nothing is. hypercorn
    stopped the keep-alive timer when it read the preface as a request and never started it
    again for a connection that had no stream yet: each such connection held its socket, a
    file descriptor, until its client left, for good with one that vanished without a FIN."""
    async with serving(tmp_path / "data", keep_alive_timeout_s=1) as service:
        silent = await trio.open_tcp_stream("127.0.0.1", service.port)
        preface = await trio.open_tcp_stream("127.0.0.1", service.port)
        await preface.send_all(H2_PREFACE + h2_frame(4, 0, 0, b""))
        closed = []
        for name, tcp in (("HTTP/1.1", silent), ("h2c", preface)):
            async with tcp:
                with trio.move_on_after(IDLE_CLOSE_LIMIT_S):
                    while await tcp.receive_some(2**16):
                        pass
                    closed.append(name)
        assert closed == ["HTTP/1.1", "h2c"]


def served_sockets(port: int) -> list[socket.socket]:
    """Copies of the sockets this process accepted on ``port`` (its connections' server ends)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
            try:
                tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
                if tcp and sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port:
                    sock.getpeername()
                    found.append(sock)
                    continue
            except OSError:
                pass
            sock.close()
    return found


async def test_a_connection_whose_peer_vanished_is_probed_stream_152(tmp_path: Path) -> None:
    """STREAM-152: every accepted connection, a subscriber waiting for events as an idle
    HTTP one, probes its peer with TCP keepalive after ``stream_send_timeout_s`` of silence and
    as often after, so that ``TCP_USER_TIMEOUT`` drops one whose peer vanished without a FIN: a
    subscriber waiting on a quiet service sends nothing, and such a ghost held its slot until
    the next event (measured in a network namespace, its loopback down for 100 s: the third
    subscriber of `stream_max_subscribers = 2` was still refused 503)."""
    async with serving(tmp_path / "data", stream_send_timeout_s=7) as service:
        idle = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with subscribe(service), idle:
            served = served_sockets(service.port)
            probes = [
                (
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0,
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                )
                for sock in served
            ]
            for sock in served:
                sock.close()
    # The subscriber's, the idle one's, and any the test's client keeps alive.
    assert len(probes) >= 2
    assert set(probes) == {(True, 7, 7, 7000)}


async def test_connections_a_peer_left_are_let_go_serve_38(tmp_path: Path) -> None:
    """SERVE-38: h2c peers that set their flow control window to zero, ask for /healthz and
    leave, and HTTP/1.1 peers that connect and close (half of them after a request), hold no
    socket once they left, well before the keep-alive timeout (30 s); one that stays, its
    window still zero, holds the shutdown no longer than the send limit
    (`stream_send_timeout_s`, 1 s here)."""
    request = hpack.Encoder().encode(
        [(":method", "GET"), (":scheme", "http"), (":path", "/healthz"), (":authority", "x")]
    )
    zero_window = h2_frame(4, 0, 0, (4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
    asking = H2_PREFACE + zero_window + h2_frame(1, 5, 1, request)
    async with serving(tmp_path / "data", stream_send_timeout_s=1) as service:
        assert (await service.client.get("/healthz")).status_code == 200
        before = open_sockets()
        for _ in range(ZERO_WINDOW_LEAVERS):
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as tcp:
                await tcp.send_all(asking)
                await trio.sleep(H2_LINGER_S)
        for n in range(CHURNED):
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as tcp:
                if n % 2:
                    await tcp.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert (await tcp.receive_some(2**16)).startswith(b"HTTP/1.1 200")
        with trio.fail_after(H2_GRACE_S):
            while open_sockets() > before:
                await trio.sleep(POLL_S)
        staying = await trio.open_tcp_stream("127.0.0.1", service.port)
        await staying.send_all(asking)
        await trio.sleep(H2_LINGER_S)
        stopping = trio.current_time()
    await staying.aclose()
    assert trio.current_time() - stopping < H2_GRACE_S / 2


async def h2c_request(port: int, headers: list[tuple[bytes, bytes]]) -> int:
    """The status of one request over h2c, its headers sent as given (no validation)."""
    connection = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
        )
    )
    connection.initiate_connection()
    async with await trio.open_tcp_stream("127.0.0.1", port) as tcp:
        await tcp.send_all(connection.data_to_send())
        connection.send_headers(1, headers, end_stream=headers[0][1] != b"CONNECT")
        await tcp.send_all(connection.data_to_send())
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while True:
                data = await tcp.receive_some(2**16)
                assert data, "the service closed the connection without an answer"
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        return int(dict(event.headers)[b":status"])
                await tcp.send_all(connection.data_to_send())


async def test_what_a_peer_sends_wrong_is_never_an_error_serve_39(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-39: a query string that is not UTF-8 over h2c (400 `BAD_QUERY`, or a refused
    websocket handshake), and a websocket upgrade with a malformed permessage-deflate offer
    (declined, SERVE-51), are answered without any record above WARNING."""
    async with serving(tmp_path / "data") as service:
        with caplog.at_level(logging.INFO):
            get = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x")]
            assert await h2c_request(service.port, [*get, (b":path", b"/healthz?\xff")]) == 400
            connect = [
                (b":method", b"CONNECT"),
                (b":protocol", b"websocket"),
                (b":scheme", b"http"),
                (b":path", b"/v1/stream?after=\xff"),
                (b":authority", b"x"),
                (b"sec-websocket-version", b"13"),
            ]
            assert await h2c_request(service.port, connect) == 403
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as tcp:
                await tcp.send_all(
                    b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: permessage-deflate;"
                    b" server_max_window_bits=99; client_max_window_bits=zz\r\n\r\n"
                )
                answer = b""
                with trio.fail_after(CLIENT_TIMEOUT_S):
                    while b"\r\n\r\n" not in answer:
                        answer += await tcp.receive_some(2**16)
                head = answer.partition(b"\r\n\r\n")[0]
                assert head.startswith(b"HTTP/1.1 101 "), head
                assert b"sec-websocket-extensions" not in head.lower(), head
            assert (await service.post(small(1))).status_code == 200
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.WARNING] == []


# -- what a refused client is told, and what the log says -------------------------------------


LONG_VALUE = "2024-02-06T15:00:00Z" + "x" * 2000


@pytest.mark.parametrize(
    ("params", "code", "parameter", "accepted"),
    [
        ({"format": "xml"}, "BAD_FORMAT", "format", "jsonl or csv"),
        ({"format": LONG_VALUE}, "BAD_FORMAT", "format", "jsonl or csv"),
        (
            {"layer": "minuets"},
            "BAD_LAYER",
            "layer",
            "seconds, minutes, hours, days, weeks, months, years, default, records",
        ),
        (
            {"from": "garbage"},
            "BAD_TIMESTAMP",
            "from",
            "an ISO 8601 instant such as 2024-02-06T15:00:00Z",
        ),
        (
            {"from": "2024-02-06T15:00:00Z", "to": LONG_VALUE},
            "BAD_TIMESTAMP",
            "to",
            "an ISO 8601 instant such as 2024-02-06T15:00:00Z",
        ),
    ],
    ids=["format", "long-format", "layer", "from", "long-to"],
)
async def test_points_with_a_bad_parameter_names_it_and_what_it_accepts_serve_43(
    service: Service, params: dict[str, str], code: str, parameter: str, accepted: str
) -> None:
    """SERVE-43: `/v1/points` with an unknown `format`, a `layer` that names no layer, or a
    `from` or `to` that is no timestamp answers 400 naming the parameter and what it accepts,
    without echoing what was sent."""
    response = await service.get("/v1/points", **params)
    assert response.status_code == 400
    assert response.json() == {"error": code, "parameter": parameter, "accepted": accepted}
    for value in params.values():
        assert value not in response.text or value == "2024-02-06T15:00:00Z"
    assert "xxxx" not in response.text


async def test_points_layer_in_any_case_is_that_layer_serve_43(service: Service) -> None:
    """SERVE-43: `layer=MINUTES` is the layer `minutes`, as for `healthlog export`."""
    assert (await service.post(HEART_RATE, MINUTES)).status_code == 200
    await service.wait_folded()
    lower = await service.get("/v1/points", layer="minutes")
    assert len(lower.content.splitlines()) == 2
    assert (await service.get("/v1/points", layer="MINUTES")).content == lower.content


async def test_an_offset_sent_with_a_bare_plus_is_that_offset_serve_92(service: Service) -> None:
    """SERVE-92: a `from` or `to` whose offset's `+` came unencoded in the query string (a
    browser, or curl without --data-urlencode) reaches the service as a space, and is read as
    the `+` it was: the same lines as with `%2B`. A space where no offset can stand is still
    400 `BAD_TIMESTAMP`."""
    assert (await service.post(HEART_RATE, MINUTES)).status_code == 200
    await service.wait_folded()
    sent: list[bytes] = []

    async def record(request: httpx.Request) -> None:
        sent.append(request.url.query)

    service.client.event_hooks["request"].append(record)
    cases = {
        "from=2024-03-01T11:01:00+01:00": {"from": "2024-03-01T11:01:00+01:00"},
        "to=2024-03-01T11:01:00+0100": {"to": "2024-03-01T11:01:00+0100"},
        "from=2024-03-01+11:01:00++0100": {"from": "2024-03-01 11:01:00 +0100"},
        "from=2024-03-01T10:01:00-00:00": {"from": "2024-03-01T10:01:00-00:00"},
    }
    for raw, params in cases.items():
        bare = await service.client.get(f"/v1/points?{raw}", headers=service.auth)
        assert sent[-1] == raw.encode(), raw
        encoded = await service.get("/v1/points", **params)
        assert b"%2B" in sent[-1] or b"-00" in sent[-1], sent[-1]
        assert (bare.status_code, encoded.status_code) == (200, 200), raw
        assert bare.content == encoded.content, raw
        assert len(bare.content.splitlines()) == 1, raw
    for raw in ("from=2024-03-01T11:01:00+25:00", "from=garbage+01:00", "to=11:01:00+01:00"):
        refused = await service.client.get(f"/v1/points?{raw}", headers=service.auth)
        assert refused.status_code == 400, raw
        assert refused.json()["error"] == "BAD_TIMESTAMP", raw


@pytest.mark.parametrize("parameter", ["metric", "layer", "from", "to", "format"])
async def test_points_with_a_repeated_parameter_names_it_serve_93(
    service: Service, parameter: str
) -> None:
    """SERVE-93: `/v1/points` with one of its parameters given twice, each value good alone,
    answers 400 `REPEATED_PARAMETER` naming it; another parameter given twice is ignored. The
    HTTP routes took the first of them and the stream the last."""
    good = {
        "metric": ("heart_rate", "step_count"),
        "layer": ("minutes", "hours"),
        "from": ("2024-03-01T10:01:00Z", "2024-03-01T10:00:00Z"),
        "to": ("2024-03-01T10:01:00Z", "2024-03-01T11:00:00Z"),
        "format": ("jsonl", "csv"),
    }[parameter]
    assert (await service.post(HEART_RATE, MINUTES)).status_code == 200
    await service.wait_folded()
    query = urllib.parse.urlencode([(parameter, value) for value in good])
    refused = await service.client.get(f"/v1/points?{query}", headers=service.auth)
    assert refused.status_code == 400
    assert refused.json() == {
        "error": "REPEATED_PARAMETER",
        "parameter": parameter,
        "accepted": "one value",
    }
    ignored = await service.client.get("/v1/points?x=1&x=2", headers=service.auth)
    assert ignored.status_code == 200
    assert len(ignored.content.splitlines()) == 2


async def test_points_with_from_not_before_to_is_refused_serve_101(service: Service) -> None:
    """SERVE-101: `/v1/points` with `from` later than `to` (the two swapped), or the same
    instant (written alike, or with other offsets), answers 400 `BAD_RANGE` naming `to` and
    what it accepts, as `healthlog export` exits 2 (CLI-137); `from` before `to` gives the
    points. (Before, each was 200 with an empty body, as if the range held no points.)"""
    assert (await service.post(HEART_RATE, MINUTES)).status_code == 200
    await service.wait_folded()
    refused = {
        "error": "BAD_RANGE",
        "parameter": "to",
        "accepted": "an instant later than from: the points that start in [from, to)",
    }
    for start, end in [
        ("2024-03-02T00:00:00Z", "2024-03-01T00:00:00Z"),
        ("2024-03-01T10:00:00Z", "2024-03-01T10:00:00Z"),
        ("2024-03-01T11:00:00+01:00", "2024-03-01T10:00:00Z"),
    ]:
        for fmt in ("jsonl", "csv"):
            answer = await service.get("/v1/points", **{"from": start, "to": end, "format": fmt})
            assert (answer.status_code, answer.json()) == (400, refused), (start, end, fmt)
    kept = await service.get("/v1/points", **{"from": "2024-03-01", "to": "2024-03-02"})
    assert (kept.status_code, len(kept.content.splitlines())) == (200, 2)


def refusals_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The refusal lines logged, each checked to be an INFO of ``healthlog.http``."""
    records = [r for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [(r.name, r.levelno) for r in records] == [("healthlog.http", logging.INFO)] * len(
        records
    )
    return [record.getMessage() for record in records]


async def test_413_states_the_limit_and_refusals_are_logged_without_secrets_serve_44(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-44: a 413 names the body limit in MiB (`max_body_mib`); each 401 and 413 is logged
    once at INFO with the route and the client's address and why, never the token, a header's
    value or the body."""
    secret = "hl_not-a-client-token-0123456789"
    async with serving(tmp_path / "data", max_body_mib=0.5) as service:
        with caplog.at_level(logging.INFO, "healthlog.http"):
            headers = {**service.auth, **CLOSE, "Content-Length": str(MiB)}
            announced = await post_stream(service.client, Drip([b"x" * MiB]), headers)
            assert announced.status_code == 413
            assert announced.json() == {"error": "BODY_TOO_LARGE", "max_body_mib": 0.5}
            chunked = Drip([b"y" * (64 * 1024)] * 9)
            streamed = await post_stream(service.client, chunked, {**service.auth, **CLOSE})
            assert streamed.json() == {"error": "BODY_TOO_LARGE", "max_body_mib": 0.5}
            wrong = {"Authorization": f"Bearer {secret}", "automation-name": "Anna's iPhone"}
            assert (await service.client.post("/v1/deliveries", headers=wrong)).status_code == 401
            assert (await service.client.post("/v1/deliveries", content=b"{}")).status_code == 401
            assert (await service.client.get("/v1/deliveries/7", headers=wrong)).status_code == 401
        assert await service.journal() == []
    over = "the body is over the limit of 0.5 MiB (max_body_mib)"
    assert refusals_logged(caplog) == [
        f"refused 413 POST /v1/deliveries from 127.0.0.1: {over}",
        f"refused 413 POST /v1/deliveries from 127.0.0.1: {over}",
        "refused 401 POST /v1/deliveries from 127.0.0.1: the token is not a client's"
        " (mistyped, or revoked)",
        "refused 401 POST /v1/deliveries from 127.0.0.1: no token (send Authorization: Bearer"
        " TOKEN, or api-key: TOKEN)",
        "refused 401 GET /v1/deliveries/<int:delivery_id> from 127.0.0.1: the token is not a"
        " client's (mistyped, or revoked)",
    ]
    logged = "\n".join(caplog.messages)
    for never in (secret, service.token, "Anna", "xxxx", "yyyy", TOKEN_NAME):
        assert never not in logged


async def test_a_flood_of_401s_logs_a_few_lines_and_counts_the_rest_serve_44(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-44: 300 requests with a wrong token in a burst are logged as at most a handful
    of lines (a token bucket: 5, then one per 12 s); the lines after the first five, and the
    line of the next refusal after a quiet minute, say how many were not logged before each,
    which adds up to every refusal held back.

    The service's refusal log reads trio's clock plus ``quiet``, so that the quiet minute
    passes without being waited out."""
    quiet = [0.0]
    monkeypatch.setattr(
        app_module,
        "RefusalLog",
        lambda: RefusalLog(Bucket(clock=lambda: trio.current_time() + quiet[0])),
    )
    wrong = {"Authorization": "Bearer hl_wrong"}
    async with serving(tmp_path / "data") as service:
        with caplog.at_level(logging.INFO, "healthlog.http"):
            for _ in range(300):
                assert (await service.client.get("/v1/status", headers=wrong)).status_code == 401
            flood = refusals_logged(caplog)
            quiet[0] += 60.0
            assert (await service.client.get("/v1/status", headers=wrong)).status_code == 401
    lines = refusals_logged(caplog)
    assert lines[:-1] == flood
    assert 5 <= len(flood) <= 7, flood
    assert not any("not logged" in line for line in lines[:5])
    held_back = [
        re.search(r"; (\d+) more refused requests were not logged before this one$", line)
        for line in lines[5:]
    ]
    assert all(held_back), lines[5:]
    assert sum(int(m.group(1)) for m in held_back if m) == 301 - len(lines)


async def test_a_post_to_a_wrong_path_is_logged_serve_97(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-97: a delivery posted to a path no route serves (`/`, `/v1/delivery`,
    `/v1/deliveries/`, `/api/v1/deliveries` with a query string) is 404 `NOT_FOUND`, nothing
    is journaled, and each path is one INFO line naming the method and the path, never the
    query string, a header's value or the body; a control character in the path is escaped;
    the same path again within the minute adds no line. (Before, the service
    logged nothing above DEBUG: a phone app set to a wrong URL reached the service and the user
    reading its log saw no sign of it.)"""
    wrong = ["/", "/v1/delivery", "/v1/deliveries/", "/api/v1/deliveries?token=hl_planted"]
    headers = {**service.auth, "automation-name": "Planted ZQX"}
    with caplog.at_level(logging.DEBUG, "healthlog"):
        for path in [*wrong, "/v1/delivery", "/v1/delivery", "/a%0Ab%1B"]:
            answer = await service.client.post(path, content=b'{"planted": 61}', headers=headers)
            assert answer.status_code == 404, path
            assert answer.json() == {"error": "NOT_FOUND"}, path
    http = [r for r in caplog.records if r.name == "healthlog.http"]
    lines = [r.getMessage() for r in http if r.levelno > logging.DEBUG]
    hint = "from 127.0.0.1: deliveries go to POST /v1/deliveries"
    assert lines == [
        f"no route for POST / {hint}",
        f"no route for POST /v1/delivery {hint}",
        f"no route for POST /v1/deliveries/ {hint}",
        f"no route for POST /api/v1/deliveries {hint}",
        f"no route for POST /a\\nb\\x1b {hint}",
    ]
    above_debug = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    for planted in (service.token, "hl_planted", "Planted", "61"):
        assert all(planted not in line for line in above_debug), planted
    assert await service.journal() == []


async def test_a_token_typed_into_a_wrong_path_is_not_logged_serve_99(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-99: a token typed into the URL's path (its `?` typed as `&` or `;`, or sent
    percent-encoded as `%3F` by an app that encodes what it was given, or as a path segment) is
    404 `NOT_FOUND` and logged as SERVE-97's line with the token masked (`hl_...`), nothing
    journaled. (Before, the INFO line held the token: whoever reads the log could post as that
    client.)"""
    token = service.token
    paths = [
        f"/v1/deliveries&api-key={token}",
        f"/v1/deliveries;token={token}",
        f"/v1/deliveries%3Ftoken={token}",
        f"/hooks/{token}/v1/deliveries",
    ]
    with caplog.at_level(logging.DEBUG, "healthlog"):
        for path in paths:
            answer = await service.client.post(path, content=b"{}", headers=service.auth)
            assert answer.status_code == 404, path
    lines = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    hint = "from 127.0.0.1: deliveries go to POST /v1/deliveries"
    assert [line for line in lines if line.startswith("no route for")] == [
        f"no route for POST /v1/deliveries&api-key=hl_... {hint}",
        f"no route for POST /v1/deliveries;token=hl_... {hint}",
        f"no route for POST /v1/deliveries?token=hl_... {hint}",
        f"no route for POST /hooks/hl_.../v1/deliveries {hint}",
    ]
    assert all(token[3:] not in line for line in lines)
    assert await service.journal() == []


async def websocket_handshake(service: Service, path: str) -> bytes:
    """The answer to a websocket handshake for ``path`` with the token, up to its JSON body."""
    handshake = (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {service.token}\r\n\r\n"
    )
    answer = b""
    async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
        await conn.send_all(handshake.encode())
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = await conn.receive_some()
                if not chunk:
                    break
                answer += chunk
    return answer


async def test_a_handshake_or_a_post_without_a_route_is_logged_serve_103(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-103: a websocket handshake to a path without a websocket route (`/v1/strem`, a
    route of the HTTP API, a token typed into the path or the query string), and a delivery
    posted to a read route (a phone set to `/v1/status`), are each one INFO line as a GET to a
    wrong path is (SERVE-97): the method (`WS` for a handshake), the path with a token masked,
    the client's address and where to go; no token, query string, header value or body above
    DEBUG; the answers are as before, 404 and 405. (Before, neither was logged above DEBUG.)"""
    token = service.token
    handshakes = ["/v1/strem?token=hl_planted", "/v1/status", f"/hooks/{token}/v1/stream"]
    headers = {**service.auth, "automation-name": "Planted ZQX"}
    with caplog.at_level(logging.DEBUG, "healthlog"):
        for path in handshakes:
            answer = await websocket_handshake(service, path)
            assert answer.startswith(b"HTTP/1.1 404 "), (path, answer)
        for path in ("/v1/status", "/v1/points", "/v1/status"):
            posted = await service.client.post(path, content=b'{"planted": 61}', headers=headers)
            assert posted.status_code == 405, path
            assert posted.json() == {"error": "METHOD_NOT_ALLOWED"}, path
    above_debug = [r for r in caplog.records if r.levelno > logging.DEBUG]
    lines = [r.getMessage() for r in above_debug if r.name == "healthlog.http"]
    stream = "from 127.0.0.1: the replay stream is WS /v1/stream"
    deliveries = "from 127.0.0.1: deliveries go to POST /v1/deliveries"
    assert lines == [
        f"no route for WS /v1/strem {stream}",
        f"no route for WS /v1/status {stream}",
        f"no route for WS /hooks/hl_.../v1/stream {stream}",
        f"no route for POST /v1/status {deliveries}",
        f"no route for POST /v1/points {deliveries}",
    ]
    for planted in (token[3:], "hl_planted", "Planted", "61"):
        assert all(planted not in r.getMessage() for r in above_debug), planted
    assert await service.journal() == []


async def test_another_method_on_intake_is_logged_serve_106(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-106: a request to `/v1/deliveries` with another method than POST (a browser
    opening the URL the app was given, a client sending PUT) is 405 as before, nothing is
    journaled, and it is one INFO line as a 405 of a read route is (SERVE-103), with no token,
    header value or body above DEBUG; OPTIONS is answered 204 and not logged. (Before, intake's
    405 left no line above DEBUG.)"""
    headers = {**service.auth, "automation-name": "Planted ZQX"}
    with caplog.at_level(logging.DEBUG, "healthlog"):
        browsed = await service.client.get("/v1/deliveries?token=hl_planted", headers=headers)
        put = await service.client.put(
            "/v1/deliveries", content=b'{"planted": 61}', headers=headers
        )
        options = await service.client.options("/v1/deliveries", headers=headers)
    assert [browsed.status_code, put.status_code, options.status_code] == [405, 405, 204]
    assert put.json() == {"error": "METHOD_NOT_ALLOWED"}
    above_debug = [r for r in caplog.records if r.levelno > logging.DEBUG]
    deliveries = "from 127.0.0.1: deliveries go to POST /v1/deliveries"
    assert [r.getMessage() for r in above_debug if r.name == "healthlog.http"] == [
        f"no route for GET /v1/deliveries {deliveries}",
        f"no route for PUT /v1/deliveries {deliveries}",
    ]
    for planted in (service.token[3:], "hl_planted", "Planted", "61"):
        assert all(planted not in r.getMessage() for r in above_debug), planted
    assert await service.journal() == []


def test_wrong_paths_are_logged_once_a_minute_and_within_a_bucket_serve_97(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SERVE-97: a path asked for again is logged once a minute, the next line saying how many
    requests for it were not; 1,000 distinct paths at once (a scanner) are 5 lines, and the line
    after them says how many were held back; a path of 501 characters is cut at 120."""
    now = [0.0]
    wrong = WrongPathLog(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "healthlog.http"):
        for _ in range(4):
            wrong("POST", "/v1/delivery", "192.0.2.1")
        now[0] += 60.0
        wrong("POST", "/v1/delivery", "192.0.2.1")
        now[0] += 60.0
        for n in range(1000):
            wrong("GET", f"/scan/{n}", "198.51.100.7")
        now[0] += 60.0
        wrong("POST", "/v1/delivery", "192.0.2.1")
        wrong("POST", "/" + "x" * 500, None)
    lines = [r.getMessage() for r in caplog.records]
    line = "no route for POST /v1/delivery from 192.0.2.1: deliveries go to POST /v1/deliveries"
    assert lines[:2] == [line, f"{line}; 3 more requests for it were not logged before this one"]
    assert len(lines) == 2 + 5 + 2
    assert lines[-2] == (
        f"{line}; 995 more requests for paths without a route were not logged before this one"
    )
    assert lines[-1] == (
        f"no route for POST /{'x' * 119}... (501 characters) from an unknown address:"
        " deliveries go to POST /v1/deliveries"
    )


def test_refusal_log_counts_what_it_holds_back_serve_44(caplog: pytest.LogCaptureFixture) -> None:
    """SERVE-44: the refusal log's bucket: 5 lines at once, then one per 12 s; the line after
    a held-back run says exactly how many were held back, one as well as 95, and a quiet
    minute refills it."""
    now = [0.0]
    refusals = RefusalLog(Bucket(clock=lambda: now[0]))
    with caplog.at_level(logging.INFO, "healthlog.http"):
        for _ in range(100):
            refusals.unauthorized("POST", "/v1/deliveries", "192.0.2.1", presented=True)
        now[0] += 12.0
        refusals.unauthorized("POST", "/v1/deliveries", "192.0.2.1", presented=False)
        now[0] += 60.0
        for _ in range(5):
            refusals.refused(413, "POST", "/v1/deliveries", None, "too large")
        now[0] += 60.0
        for _ in range(6):
            refusals.refused(413, "POST", "/v1/deliveries", None, "too large")
        now[0] += 12.0
        refusals.refused(413, "POST", "/v1/deliveries", None, "too large")
    lines = refusals_logged(caplog)
    assert len(lines) == 17
    assert lines[5].endswith("TOKEN); 95 more refused requests were not logged before this one")
    too_large = "refused 413 POST /v1/deliveries from an unknown address: too large"
    assert lines[6:16] == [too_large] * 10
    assert lines[16] == f"{too_large}; 1 more refused requests were not logged before this one"


async def test_bytes_after_a_closing_request_do_not_replace_its_answer_serve_48(
    tmp_path: Path,
) -> None:
    """SERVE-48: a request that closes its connection (``Connection: close``, or HTTP/1.0)
    followed by more bytes (a stray CRLF after the body, as some clients send) gets its own
    answer: the delivery its 200 with the receipt of the one journal row, a read route its
    document. hypercorn took those bytes for a malformed next request and answered 400 in
    place of the first request's answer, while the delivery was journaled all the same: a
    client that retries it journals it twice."""
    async with serving(tmp_path / "data") as service:
        auth = b"Authorization: Bearer %s\r\n" % service.token.encode()
        requests = {
            "delivery, Connection: close": b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\nContent-Length: 2\r\n" + auth + b"\r\n{}\r\n",
            "delivery, HTTP/1.0": b"POST /v1/deliveries HTTP/1.0\r\nContent-Length: 2\r\n"
            + auth
            + b"\r\n{}\r\n",
            "delivery, HTTP/1.0, half-closed": b"POST /v1/deliveries HTTP/1.0\r\n"
            b"Content-Length: 2\r\n" + auth + b"\r\n{}\r\n",
            "status, Connection: close": b"GET /v1/status HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\n" + auth + b"\r\n\r\n",
        }
        answers: dict[str, bytes] = {}
        for name, request in requests.items():
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
                await conn.send_all(request)
                if name.endswith("half-closed"):
                    await conn.send_eof()
                answer = b""
                with trio.fail_after(10):
                    while chunk := await conn.receive_some():
                        answer += chunk
            answers[name] = answer
        for name, answer in answers.items():
            assert answer.startswith(b"HTTP/1.1 200 "), (name, answer)
            assert answer.count(b"HTTP/1.1 ") == 1, (name, answer)
        receipts = [
            json.loads(answers[name].split(b"\r\n\r\n", 1)[1])
            for name in requests
            if name.startswith("delivery")
        ]
        journal = await service.journal()
        assert [meta.id for meta in journal] == [r["delivery_id"] for r in receipts]
        assert json.loads(answers["status, Connection: close"].split(b"\r\n\r\n", 1)[1])["journal"][
            "deliveries"
        ] == len(journal)


async def test_a_websocket_handshake_to_an_http_route_is_404_as_json_serve_49(
    tmp_path: Path,
) -> None:
    """SERVE-49: a websocket handshake to a route of the HTTP API (``/healthz``, ``/metrics``,
    ``/v1/status``, ``/v1/deliveries/1``), as to ``/v1/deliveries`` or a route that does not
    exist, is answered 404 ``NOT_FOUND`` as JSON: the routes of the HTTP API answered a
    werkzeug HTML page with 400."""
    async with serving(tmp_path / "data") as service:
        for path in ("/healthz", "/metrics", "/v1/status", "/v1/deliveries/1", "/v1/nope"):
            handshake = (
                f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                f"Authorization: Bearer {service.token}\r\n\r\n"
            )
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
                await conn.send_all(handshake.encode())
                answer = b""
                with trio.fail_after(10):
                    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                        chunk = await conn.receive_some()
                        if not chunk:
                            break
                        answer += chunk
            head, _, content = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404 "), (path, answer)
            assert b"content-type: application/json" in head.lower(), (path, answer)
            assert json.loads(content) == {"error": "NOT_FOUND"}, (path, answer)


UPGRADE = "Connection: Upgrade\r\nUpgrade: websocket\r\n"
WEBSOCKET_KEY = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


@pytest.mark.parametrize(
    ("handshake", "status", "code"),
    [
        (UPGRADE, 400, "BAD_HANDSHAKE"),
        (
            f"{UPGRADE}Sec-WebSocket-Version: 8\r\n{WEBSOCKET_KEY}",
            400,
            "BAD_HANDSHAKE",
        ),
        (
            f"{UPGRADE}Sec-WebSocket-Version: 13\r\n{WEBSOCKET_KEY}X-Padding: {'a' * 66_000}\r\n",
            403,
            "HANDSHAKE_REFUSED",
        ),
    ],
    ids=["without-key", "version-8", "headers-too-large"],
)
async def test_a_handshake_hypercorn_refuses_is_answered_as_json_and_closed_serve_105(
    tmp_path: Path, handshake: str, status: int, code: str
) -> None:
    """SERVE-105: a websocket handshake that is not one (no `Sec-WebSocket-Key`, or version 8)
    is answered 400 with a JSON error and its connection closed, with the keep-alive timeout
    far away; one the service refuses with a close before accepting it (headers over 64 KiB) is
    403 with a JSON error; a delivery posted next is journaled. (Before, hypercorn answered
    with the status alone, and after a 400 held the connection open until the client left.)"""
    async with serving(tmp_path / "data", keep_alive_timeout_s=3600) as service:
        request = f"GET /v1/stream HTTP/1.1\r\nHost: x\r\n{handshake}\r\n"
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(request.encode())
            answer = b""
            with trio.fail_after(CLIENT_TIMEOUT_S):
                while chunk := await conn.receive_some():
                    answer += chunk
        head, _, content = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status), answer
        assert b"content-type: application/json" in head.lower(), answer
        assert b"content-length: %d" % len(content) in head.lower(), answer
        assert json.loads(content) == {"error": code}, answer
        assert (await service.post(small(1))).status_code == 200
        assert len(await service.journal()) == 1


async def test_a_plain_request_for_the_stream_is_told_to_upgrade_serve_82(
    tmp_path: Path,
) -> None:
    """SERVE-82: a request for ``/v1/stream`` without the websocket upgrade (curl, or a reverse
    proxy that does not pass Upgrade and Connection on) is 426 ``UPGRADE_REQUIRED`` as JSON with
    ``Upgrade: websocket``, with or without a token, and over h2c 426 without it; other methods
    are 405; the connection serves on, and the websocket handshake still opens the stream."""
    async with serving(tmp_path / "data") as service:
        for headers in ({}, service.auth, {"Upgrade": "websocket"}):
            answer = await service.client.get("/v1/stream", headers=headers)
            assert answer.status_code == 426, (headers, answer.text)
            assert answer.headers["content-type"] == "application/json"
            assert answer.headers["upgrade"] == "websocket"
            assert "upgrade" in answer.headers["connection"].lower()
            assert answer.json() == {"error": "UPGRADE_REQUIRED"}
        head = await service.client.head("/v1/stream")
        assert (head.status_code, head.content) == (426, b"")
        post = await service.client.post("/v1/stream", headers=service.auth, content=b"{}")
        assert (post.status_code, post.json()) == (405, {"error": "METHOD_NOT_ALLOWED"})
        assert "GET" in post.headers["allow"]
        assert (await service.client.get("/healthz")).status_code == 200
        get = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x")]
        assert await h2c_request(service.port, [*get, (b":path", b"/v1/stream")]) == 426
        assert (await service.post(small(1))).status_code == 200
        async with subscribe(service) as ws:
            [frame] = await receive(ws, 1)
            assert (frame["type"], frame["seq"]) == ("event", 1)


STALLED_STREAM_LIMIT_S = 10.0
"""How long SERVE-64 waits for the reset of a stream its peer stalls (the limit is 1 s)."""


async def test_an_h2_stream_its_peer_stalls_is_reset_serve_64(tmp_path: Path) -> None:
    """SERVE-64: GIVEN ``stream_send_timeout_s = 1`` and 330 KB of `/v1/points` lines WHEN an
    h2c peer with its flow control window at zero asks for them THEN the stream is reset
    (``CANCEL``) once its response has waited that long, and the connection serves a request
    after it. (Before, the response waited for good, holding its task and a page of points:
    the kernel drops a stalled HTTP/1.1 connection, but an HTTP/2 peer keeps its connection
    alive while one stream takes nothing.)"""
    body = tmp_path / "body.json"
    write_minute_body(body, metrics=1, points=24 * 60)
    async with serving(tmp_path / "data", stream_send_timeout_s=1) as service:
        assert (await service.post(body.read_bytes())).status_code == 200
        await service.wait_folded()
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        request = [(":method", "GET"), (":scheme", "http"), (":authority", "127.0.0.1")]
        auth = [("authorization", f"Bearer {service.token}")]
        peer.send_headers(1, [*request, (":path", "/v1/points"), *auth], end_stream=True)
        events: list[h2.events.Event] = []
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(peer.data_to_send())
            with trio.fail_after(STALLED_STREAM_LIMIT_S):
                while not any(isinstance(e, h2.events.StreamReset) for e in events):
                    events += peer.receive_data(await conn.receive_some())
                    await conn.send_all(peer.data_to_send())
                (reset,) = [e for e in events if isinstance(e, h2.events.StreamReset)]
                assert (reset.stream_id, reset.error_code) == (1, h2.errors.ErrorCodes.CANCEL)
                peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535})
                peer.send_headers(3, [*request, (":path", "/healthz")], end_stream=True)
                await conn.send_all(peer.data_to_send())
                while not any(isinstance(e, h2.events.StreamEnded) for e in events):
                    events += peer.receive_data(await conn.receive_some())
                    await conn.send_all(peer.data_to_send())
        answers = {
            e.stream_id: dict(e.headers)[b":status"]
            for e in events
            if isinstance(e, h2.events.ResponseReceived)
        }
        assert answers[3] == b"200", answers


async def test_a_request_framed_twice_is_refused_and_closed_serve_62(tmp_path: Path) -> None:
    """SERVE-62: a request with both ``Transfer-Encoding: chunked`` and ``Content-Length`` (a
    delivery, ``/healthz``), followed at once by another request, is answered 400 and its
    connection closed: the request after it is not served and nothing is journaled. h11 read
    the body as chunked and served the bytes after it as a request of their own, which a proxy
    going by ``Content-Length`` takes for body (request smuggling)."""
    async with serving(tmp_path / "data") as service:
        for head in (
            b"POST /v1/deliveries HTTP/1.1\r\nAuthorization: Bearer %s\r\n"
            % service.token.encode(),
            b"GET /healthz HTTP/1.1\r\n",
        ):
            request = (
                head + b"Host: x\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"2\r\n[]\r\n0\r\n\r\nGET /v1/snapshots/key HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
                await conn.send_all(request)
                answer = b""
                with trio.fail_after(CLIENT_TIMEOUT_S):
                    while chunk := await conn.receive_some():
                        answer += chunk
            assert answer.startswith(b"HTTP/1.1 400 "), (head, answer)
            assert answer.count(b"HTTP/1.1 ") == 1, (head, answer)
        assert await service.journal() == []


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, "MALFORMED_REQUEST"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "MALFORMED_REQUEST"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400, "MALFORMED_REQUEST"),
        (
            b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
            "UNSUPPORTED_TRANSFER_ENCODING",
        ),
        (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 70_000,
            431,
            "HEADERS_TOO_LARGE",
        ),
        (
            b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n\r\n",
            400,
            "MALFORMED_REQUEST",
        ),
    ],
    ids=[
        "request-line",
        "header-line",
        "header-name",
        "transfer-encoding",
        "too-large",
        "framed-twice",
    ],
)
async def test_a_request_hypercorn_cannot_read_is_answered_as_json_serve_104(
    service: Service, request_head: bytes, status: int, code: str
) -> None:
    """SERVE-104: a request h11 cannot read (a malformed request line or header line, a header
    name with a space, a transfer coding other than chunked, headers still coming past 64 KiB,
    both framings, SERVE-62) is answered with h11's status and a JSON error, as every other error
    is, its `Content-Length` that of the body, and the connection closed; the service goes on
    serving. (Before, hypercorn answered with the status alone and no body.)"""
    async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
        await conn.send_all(request_head)
        answer = b""
        with trio.fail_after(CLIENT_TIMEOUT_S):
            while chunk := await conn.receive_some():
                answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    assert status_line.startswith(f"HTTP/1.1 {status} "), answer
    assert headers["content-type"] == "application/json", answer
    assert headers["connection"] == "close", answer
    assert int(headers["content-length"]) == len(content), answer
    assert json.loads(content) == {"error": code}, answer
    assert (await service.post(small(1))).status_code == 200
    assert len(await service.journal()) == 1


async def test_a_head_request_hypercorn_cannot_read_is_answered_without_a_body_serve_107(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-107: a HEAD request h11 cannot read (both framings, SERVE-62) is answered 400 with
    SERVE-104's headers and no body, as HEAD is, the connection closed, and nothing is logged
    above INFO. (Before, SERVE-104's answer sent its body after HEAD's head, which h11 refused:
    each such request logged a WARNING that a connection failed inside hypercorn.)"""
    with caplog.at_level(logging.INFO):
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(
                b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            answer = b""
            with trio.fail_after(CLIENT_TIMEOUT_S):
                while chunk := await conn.receive_some():
                    answer += chunk
        assert (await service.post(small(1))).status_code == 200
    head, _, content = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    assert status_line.startswith("HTTP/1.1 400 "), answer
    assert headers["content-type"] == "application/json", answer
    assert headers["connection"] == "close", answer
    assert int(headers["content-length"]) == len(b'{"error":"MALFORMED_REQUEST"}'), answer
    assert content == b"", answer
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.INFO] == []


async def test_blank_lines_before_a_request_are_ignored_serve_50(tmp_path: Path) -> None:
    """SERVE-50: on a kept-alive connection, a delivery whose body is followed by a CRLF (as
    some clients send), then a second delivery, sent after the first answer or with the CRLF
    at once: both are answered 200 and journaled, RFC 9112 (2.2) has a server ignore such
    blank lines. h11 took one for a request without a request line: hypercorn answered it 400
    and closed the connection, and a client reading that 400 as its next delivery's answer,
    or sending that delivery into the closed connection, lost it."""
    async with serving(tmp_path / "data") as service:
        auth = b"Authorization: Bearer %s\r\n" % service.token.encode()

        def post(content: bytes) -> bytes:
            head = b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            return head % len(content) + auth + b"\r\n" + content + b"\r\n"

        async def answer(conn: trio.SocketStream) -> bytes:
            received = b""
            with trio.fail_after(10):
                while not received.endswith(b"}"):
                    chunk = await conn.receive_some()
                    assert chunk, received
                    received += chunk
            return received

        answers = []
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(post(b"[1]"))
            answers.append(await answer(conn))
            await conn.send_all(post(b"[2]"))
            answers.append(await answer(conn))
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(post(b"[3]") + post(b"[4]"))
            both = await answer(conn)
            if both.count(b"HTTP/1.1 ") < 2:
                both += await answer(conn)
            first, _, second = both.partition(b"}")
            answers += [first + b"}", second]
        for received in answers:
            assert received.startswith(b"HTTP/1.1 200 "), answers
        journal = await service.journal()
        assert [meta.bytes for meta in journal] == [3, 3, 3, 3]
        assert [meta.sha256 for meta in journal] == [
            hashlib.sha256(b"[%d]" % n).hexdigest() for n in (1, 2, 3, 4)
        ]


async def test_a_websocket_deflate_offer_is_declined_serve_51(tmp_path: Path) -> None:
    """SERVE-51: a websocket handshake offering permessage-deflate (as browsers do) is answered
    without it, and a peer that sends a compressed frame regardless, 0.5 MiB that would inflate
    to 512 MiB, is closed without the service inflating it: its memory grows by far less than
    that. (wsproto inflated every frame whole, and hypercorn checked the 16 MiB limit on the
    inflated message only, then sent close 1009 and held the connection until the peer closed
    it; a peer needed no valid token, since frames are read before the token is checked.)"""
    inflated_mib = 512
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunks = [deflate.compress(b" " * MiB) for _ in range(inflated_mib)]
    payload = b"".join(chunks) + deflate.flush(zlib.Z_SYNC_FLUSH)[:-4]
    # FIN, RSV1 (compressed), text; masked with the key 0, which leaves the payload as it is.
    frame = bytes([0xC1, 0x80 | 127]) + len(payload).to_bytes(8, "big") + bytes(4) + payload
    async with serving(tmp_path / "data") as service:
        handshake = (
            "GET /v1/stream HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Extensions: permessage-deflate\r\nApi-Key: {service.token}\r\n\r\n"
        )
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        async with await trio.open_tcp_stream("127.0.0.1", service.port) as conn:
            await conn.send_all(handshake.encode())
            received = b""
            with trio.fail_after(CLIENT_TIMEOUT_S):
                while b"\r\n\r\n" not in received:
                    received += await conn.receive_some()
                head = received.partition(b"\r\n\r\n")[0]
                assert head.startswith(b"HTTP/1.1 101 "), head
                assert b"sec-websocket-extensions" not in head.lower(), head
                with contextlib.suppress(trio.BrokenResourceError):
                    await conn.send_all(frame)
            with trio.move_on_after(STALL_LIMIT_S) as waiting:
                with contextlib.suppress(trio.BrokenResourceError):
                    while await conn.receive_some():
                        pass
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert not waiting.cancelled_caught, "the connection stayed open"
    assert grown_mib < inflated_mib / 4, grown_mib


DRAIN_GIVE_UP_BYTES = 32 * MiB


async def answer_while_sending(port: int, head: bytes, chunk: bytes) -> tuple[bytes, int]:
    """Send ``head``, then ``chunk`` again and again until an answer comes, the connection
    breaks or ``DRAIN_GIVE_UP_BYTES`` are sent; what was answered and how many bytes went."""
    sent = 0
    answer = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as conn:
        await conn.send_all(head)

        async def read(cancel: trio.CancelScope) -> None:
            nonlocal answer
            with contextlib.suppress(trio.BrokenResourceError):
                while data := await conn.receive_some():
                    answer += data
            cancel.cancel()

        with trio.fail_after(CLIENT_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, nursery.cancel_scope)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while not answer and sent < DRAIN_GIVE_UP_BYTES:
                        await conn.send_all(chunk)
                        sent += len(chunk)
                with trio.move_on_after(NEXT_REQUEST_S):
                    await trio.sleep_forever()
                nursery.cancel_scope.cancel()
    return answer, sent


async def test_a_refused_upload_is_drained_up_to_the_body_limit_serve_52(tmp_path: Path) -> None:
    """SERVE-52: GIVEN ``max_body_mib = 1``, an upload refused before its end (a wrong token
    with an endless chunked body, a ``Content-Length`` of 1 TiB with the right one) is read
    and dropped up to about the body limit, then answered (401, 413) and closed; it was read
    for as long as the client went on sending, without an answer, by a client that needed no
    token."""
    async with serving(tmp_path / "data", max_body_mib=1) as service:
        data = b"x" * 65536
        chunked = b"%x\r\n%s\r\n" % (len(data), data)
        cases = {
            401: (
                b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer hl_wrong\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n",
                chunked,
            ),
            413: (
                b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                b"Authorization: Bearer %s\r\n\r\n" % (2**40, service.token.encode()),
                data,
            ),
        }
        for status, (head, chunk) in cases.items():
            answer, sent = await answer_while_sending(service.port, head, chunk)
            assert answer.startswith(b"HTTP/1.1 %d " % status), (status, sent, answer)
            assert sent < 8 * MiB, (status, sent)
        assert await service.journal() == []


def server_side_connections(port: int) -> int:
    """How many TCP connections (IPv4) with ``port`` as their local port the server holds open
    (ESTABLISHED, or CLOSE_WAIT: closed by the client, not yet by the server)."""
    held = {"01", "08"}
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in held:
                count += 1
    return count


async def answer_to_a_buffered_upload(port: int, request: bytes) -> bytes:
    """Hand the kernel as much of ``request`` as it takes at once, before the server can read
    any of it, then read the answer until the server closes, and close."""
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        while sent < len(request):
            sent += raw.send(request[sent : sent + 65536])
    answer = b""
    async with trio.SocketStream(trio.socket.from_stdlib_socket(raw)) as stream:
        with trio.move_on_after(NEXT_REQUEST_S), contextlib.suppress(trio.BrokenResourceError):
            while data := await stream.receive_some():
                answer += data
    return answer


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
async def test_a_refused_upload_read_ahead_has_its_connection_closed_serve_58(
    tmp_path: Path,
) -> None:
    """SERVE-58: GIVEN ``max_body_mib = 0.05`` WHEN a client hands over an upload with the
    token and a chunked body of 200 KiB in 1 KiB chunks at once (so that hypercorn has read
    ahead of the app), reads its 413 and closes, three times THEN the server closes each
    connection too. (Before, the answer's end waited for good on hypercorn handing the app a
    disconnect into the app's queue, full of the chunks the drain had left, and each
    connection stayed open, CLOSE_WAIT, until the service stopped, which then waited out its
    graceful timeout.)"""
    piece = b"z" * 1024
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(200))
    async with serving(tmp_path / "data", max_body_mib=0.05) as service:
        head = (
            b"POST /v1/deliveries HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer %s\r\n\r\n" % service.token.encode()
        )
        for _ in range(3):
            answer = await answer_to_a_buffered_upload(service.port, head + chunked)
            assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]
        with trio.fail_after(CLOSE_LIMIT_S):
            while server_side_connections(service.port):
                await trio.sleep(POLL_S)
        assert await service.journal() == []


CLOSE_LIMIT_S = 10.0
"""How long SERVE-58 gives the server to close the connections its clients closed."""


def _announced_port(process: subprocess.Popen[bytes]) -> int:
    """The port a ``healthlog serve --port 0`` process says it serves on, in its first line."""
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    found = re.search(r"healthlog serving on http://127\.0\.0\.1:(\d+) ", line)
    assert found, line
    return int(found.group(1))


def _few_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FEW_FILES, FEW_FILES))


FEW_FILES = 64
"""The serve process's open file limit in SERVE-53: a few dozen connections use it up."""


def test_connections_beyond_the_open_file_limit_log_one_error_a_minute_serve_53(
    tmp_path: Path,
) -> None:
    """SERVE-53: a `healthlog serve` process limited to 64 open files, and 120 connections
    held open for 3 s: trio retries the failed accept every 0.1 s, and its ERROR is logged
    once in the minute, not thirty times; once the connections close the service answers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0"]
    with subprocess.Popen(
        [*command, "--data", str(tmp_path / "data")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_few_files,
    ) as process:
        try:
            port = _announced_port(process)
            held = []
            with contextlib.ExitStack() as stack:
                for _ in range(120):
                    held.append(stack.enter_context(socket.create_connection(("127.0.0.1", port))))
                time.sleep(3.0)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                assert client.get("/healthz").status_code == 200
        finally:
            process.terminate()
            _, stderr = process.communicate(timeout=60)
    failed = [line for line in stderr.decode().splitlines() if "EMFILE" in line]
    assert len(failed) == 1, failed
    assert "level=ERROR logger=trio.serve_listeners" in failed[0]


SENTINELS = (
    "ZQXDEV",  # device and source names
    "ZQXHDR",  # header values
    "ZQXTOK",  # tokens presented that are not a client's
    "ZQXBODY",  # a body that is not JSON
    "ZQXQUERY",  # query parameters
    "4242.4242",
    "5151.5151",
    "6363.6363",
)
"""SERVE-87: what a run plants, none of which may reach a log record above DEBUG."""


def _refused_handshake(port: int, target: str) -> bytes:
    """The first bytes of the answer to a websocket handshake for ``target`` (the stream, with
    its query), the connection then closed by this side."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as conn:
        conn.sendall(
            f"GET {target} HTTP/1.1\r\nHost: healthlog\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        return conn.recv(4096)


def test_no_log_record_of_a_real_run_holds_what_a_client_sent_serve_87(
    tmp_path: Path,
) -> None:
    """SERVE-87: a `healthlog serve` process at its default level, `follow` and the CLI
    (`import`, `status --failed --partial`, `verify`, `reindex`, `export`) given bodies with
    planted device names and values (colliding points, units that differ, a body that is not
    JSON), header values, wrong tokens (bearer, api-key, the stream's query), query parameters
    and a client token named like a device: no line above DEBUG of any of them holds a planted
    value, the client's token or its name."""
    data = tmp_path / "data"
    with DataDir(data).open_tokens() as tokens:
        token = tokens.add("Kim's ZQXDEV phone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    log = tmp_path / "serve.log"
    planted = body(
        metric(
            "heart_rate",
            "count/min",
            point("2024-03-01 10:00:00 +0000", qty=4242.4242, source="ZQXDEV Watch"),
            point("2024-03-01 10:00:00 +0000", qty=5151.5151, source="ZQXDEV Ring"),
            point("ZQXDEV-not-a-date", qty=6363.6363),
        ),
        metric("step_count", "count", point("2024-03-01 10:00:00 +0000", qty=4242.4242)),
        metric("step_count", "km", point("2024-03-01 10:00:00 +0000", qty=5151.5151)),
    )
    headers = {
        "Authorization": f"Bearer {token}",
        "automation-name": "ZQXHDR name",
        "automation-id": "ZQXHDR-id",
        "automation-aggregation": "minutes",
        "session-id": "ZQXHDR-session",
        "Idempotency-Key": "ZQXHDR-key",
    }
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(data)]
    outputs: list[str] = []
    with (
        log.open("wb") as stderr,
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr) as process,
    ):
        try:
            port = _announced_port(process)
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
                assert client.post("/v1/deliveries", content=planted, headers=headers).is_success
                garbage = b'{"data": ZQXBODY 4242.4242'
                auth = {"Authorization": f"Bearer {token}"}
                assert client.post("/v1/deliveries", content=garbage, headers=auth).is_success
                for wrong in ({"Authorization": "Bearer hl_ZQXTOK"}, {"api-key": "hl_ZQXTOK"}):
                    refused = client.post("/v1/deliveries", content=planted, headers=wrong)
                    assert refused.status_code == 401
                    assert client.get("/v1/status", headers=wrong).status_code == 401
                query = {"metric": "ZQXQUERY", "from": "ZQXQUERY", "layer": "ZQXQUERY"}
                assert client.get("/v1/points", params=query, headers=auth).status_code == 400
            for presented in ("hl_ZQXTOK", token):
                answer = _refused_handshake(
                    port, f"/v1/stream?after=ZQXQUERY&subscriber=ZQXQUERY&token={presented}"
                )
                assert answer.startswith(b"HTTP/1.1 "), answer
            following = [sys.executable, "-m", "healthlog.cli", "follow", "--url", url]
            for presented in ("hl_ZQXTOK", token):
                followed = subprocess.run(
                    [*following, "--replica", str(tmp_path / "replica"), "--until-caught-up"],
                    env={**env, "HEALTHLOG_TOKEN": presented},
                    capture_output=True,
                    text=True,
                    timeout=PROCESS_TIMEOUT_S,
                    check=False,
                )
                assert followed.returncode == (2 if presented == "hl_ZQXTOK" else 0)
                outputs.append(followed.stderr)
        finally:
            process.terminate()
            process.communicate(timeout=PROCESS_TIMEOUT_S)
    assert process.returncode == 0
    planted_file = tmp_path / "planted.json"
    planted_file.write_bytes(planted)
    commands = [
        ("import", "--aggregation", "minutes", str(planted_file)),
        ("status", "--failed", "--partial"),
        ("verify",),
        ("reindex",),
        ("export",),
    ]
    for args in commands:
        done = subprocess.run(
            [sys.executable, "-m", "healthlog.cli", *args, "--data", str(data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROCESS_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stderr)
    served = log.read_text()
    assert "delivery 1 folded: status=partial" in served
    records = [
        line
        for text in (served, *outputs)
        for line in text.splitlines()
        if "level=DEBUG" not in line
    ]
    assert any("refused 401" in line for line in records)
    leaked = [
        line
        for line in records
        if any(mark in line for mark in SENTINELS) or token[3:] in line or "Kim" in line
    ]
    assert leaked == []


FOLD_AFTER_CRASH_LIMIT_S = 15.0
"""SERVE-76: how soon a delivery is folded once the files are back (the wake period is 60 s)."""


def test_a_delivery_answered_while_files_ran_out_is_folded_once_they_are_back_serve_76(
    tmp_path: Path,
) -> None:
    """SERVE-76: GIVEN a `healthlog serve` process limited to 64 open files, with a wake period
    of 60 s WHEN a delivery is answered 200 while 120 connections hold every file (its fold
    worker cannot be made: one ERROR says so, RUN-68) THEN once they close it is folded within
    15 s, not at the next period."""
    data = tmp_path / "data"
    with DataDir(data).open_tokens() as tokens:
        token = tokens.add(TOKEN_NAME)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    env["HEALTHLOG_WAKE_PERIOD_S"] = "60"
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(data)]
    log = tmp_path / "serve.log"
    auth = {"Authorization": f"Bearer {token}"}
    with (
        log.open("wb") as stderr,
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=stderr, preexec_fn=_few_files
        ) as process,
    ):
        try:
            port = _announced_port(process)
            with socket.create_connection(("127.0.0.1", port)) as upload:
                upload.sendall(
                    b"POST /v1/deliveries HTTP/1.1\r\nHost: healthlog\r\nConnection: close\r\n"
                    b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                    % (token.encode(), len(HEART_RATE), HEART_RATE[:-1])
                )
                with contextlib.ExitStack() as stack:
                    for _ in range(120):
                        stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                    time.sleep(1.0)
                    upload.sendall(HEART_RATE[-1:])
                    upload.settimeout(30)
                    answer = upload.recv(4096)
                    time.sleep(1.0)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]
            deadline = time.monotonic() + FOLD_AFTER_CRASH_LIMIT_S
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                while (status := client.get("/v1/deliveries/1", headers=auth).json())[
                    "status"
                ] == "pending" and time.monotonic() < deadline:
                    time.sleep(POLL_S)
        finally:
            process.terminate()
            process.wait(timeout=60)
    said = log.read_text()
    assert "fold workers cannot start: a new worker process could not be made: EMFILE" in said
    assert "actor folding crashed" not in said
    assert status["status"] == "parsed", status


SOFT_FILES = 256
HARD_FILES = 4096
HELD_CONNECTIONS = 300


def _soft_limit_below_hard() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_FILES, HARD_FILES))


def test_connections_beyond_the_soft_open_file_limit_still_let_a_delivery_in_serve_80(
    tmp_path: Path,
) -> None:
    """SERVE-80: GIVEN a `healthlog serve` process started with a soft open file limit of 256
    and a hard one of 4,096 (as a shell started without systemd's `LimitNOFILE` has 1,024 and
    more) WHEN 300 connections from one address are held open THEN a delivery from another
    client is answered 200 meanwhile, and `process_max_fds` of `/metrics` is 4,096."""
    data = tmp_path / "data"
    with DataDir(data).open_tokens() as tokens:
        token = tokens.add(TOKEN_NAME)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(data)]
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=_soft_limit_below_hard,
    ) as process:
        try:
            port = _announced_port(process)
            with contextlib.ExitStack() as stack:
                for _ in range(HELD_CONNECTIONS):
                    stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                    try:
                        answer = client.post(
                            "/v1/deliveries",
                            content=HEART_RATE,
                            headers={"Authorization": f"Bearer {token}"},
                        ).status_code
                    except httpx.TimeoutException as exc:
                        answer = type(exc).__name__
                    metrics = client.get("/metrics").text if answer == 200 else ""
        finally:
            process.terminate()
            process.wait(timeout=60)
    assert answer == 200
    assert f"process_max_fds {float(HARD_FILES)}" in metrics


def test_a_throttled_record_says_how_many_were_held_back_serve_53() -> None:
    """SERVE-53: of records within one period only the first passes; the first after it says
    how many were held back meanwhile."""
    throttle = Throttle(0.2)

    def record(n: int) -> logging.LogRecord:
        return logging.LogRecord(
            "trio.serve_listeners", logging.ERROR, "", 0, "retry %d", (n,), None
        )

    assert [throttle.filter(record(n)) for n in range(5)] == [True, False, False, False, False]
    time.sleep(0.25)
    later = record(5)
    assert throttle.filter(later)
    assert later.getMessage() == "retry 5 (4 more like it not logged since the last one)"
