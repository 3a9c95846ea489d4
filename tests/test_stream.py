"""``WS /v1/stream`` against a real ``healthlog serve`` (specs/stream.md, STREAM-1 to STREAM-15,
STREAM-28 and later ones, among them gone subscribers: STREAM-63, STREAM-64, STREAM-66), and
the page of events the endpoint reads from a real store file (STREAM-25).

Every service test starts :func:`transport.serve.serve` on a free port in its own trio run and
talks to it through real websocket clients: trio-websocket on a TCP stream the test owns, a raw
socket that never reads, one that reads a little at a time (wsproto), and the independent
``websockets`` library in a thread.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import itertools
import logging
import os
import random
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio
from _baseline import severe_lines
from _bodies import append, delivery, point, rows
from _bodies import body as storage_body
from _disk import files_limited_to
from _service_helpers import POLL_S, TOKEN_NAME, Service, serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    MINUTES,
    SECONDS,
    TINY_RECEIVE_BUFFER,
    acked,
    bearer,
    connect,
    consecutive,
    head,
    hourly,
    noisy,
    post,
    post_small,
    prune,
    receive,
    receive_through,
    refusal,
    resource,
    send_ack,
    server_export,
    small,
    stalled,
    stream_handlers,
    subscribe,
    text_frame,
    validate,
)
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import ConnectionClosed, WebSocketConnection
from websockets.sync.client import connect as websockets_connect
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from actors.runtime import configured
from healthlog import clock, faults
from healthlog.documents import Manifest, converter
from healthlog.export import export_lines
from healthlog.objects import ObjectKey, to_wire
from healthlog.storage._sqlite import Deferred, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal
from healthlog.storage.store import Store
from healthlog.timestamps import parse_instant
from transport import app as app_module
from transport import serve as serve_module
from transport.stream import StreamEndpoint

SNAPSHOT_KEYS = {"url", "seq", "sha256", "schema", "instance", "stream", "signature"}
FRAME_KEYS = {"type", "seq", "id", "tag", "kind"}
CHANGED_KEYS = FRAME_KEYS | {"metric", "layer", "hour", "hash", "points", "delivery_id", "object"}
FOLDED_KEYS = FRAME_KEYS | {"delivery_id", "status", "counters"}
SEND_TIMEOUT_S = 1.0
# The wait between two reads of a busy store (a second), as the log records' stamps show it.
BUSY_RETRY_MIN_S = 0.95
BUSY_RETRY_MAX_S = 1.6
NOISY_POINTS = 2000
NOISY_ADDITIONS = 36
GRACE_S = 3.0
REFUSAL_LIMIT_S = 3.0
REVOKE_LIMIT_S = 10.0
# Longer than the service's store busy timeout (5 s).
BUSY_HOLD_S = 7.5
# The longest a status read may wait behind an ACK waiting for the write lock (its brief wait is
# 250 ms at a time).
ACK_HOLDS_READS_MAX_S = 1.0
UNAUTHORIZED = {"type": "error", "code": "UNAUTHORIZED"}


async def refused_beside_witness(
    service: Service,
    path: str,
    headers: list[tuple[bytes, bytes]],
    frame: str | bytes | None = None,
) -> tuple[dict[str, Any], int]:
    """Open ``path`` (then send ``frame``) while a named witness subscriber is connected; return
    the error frame and close code, after proving the witness still gets live events and has
    its ACK stored. These refusals come at once, so the wait for them is short."""
    start = await head(service)
    async with subscribe(service, after=start, subscriber="witness") as witness:
        async with connect(service.port, path, headers) as ws:
            if frame is not None:
                await ws.send_message(frame)
            refused = await refusal(ws, REFUSAL_LIMIT_S)
        await post(service, small(start))
        frames = await receive(witness, 2)
        assert consecutive(frames, start)
        await send_ack(witness, start + 2)
        await acked(service, "witness", start + 2)
    return refused


async def test_replay_then_live(tmp_path: Path) -> None:
    """STREAM-1: replay from ``after``, then live events, with the documented frame fields."""
    async with serving(tmp_path) as service:
        status_head = await post_small(service, 0, 1)
        assert status_head == 4
        stream = (await service.status())["stream"]["id"]
        async with subscribe(service, after=0) as ws:
            replay = await receive(ws, 4)
            await post(service, small(120))
            live = await receive(ws, 2)
        async with subscribe(service, after=3) as ws:
            later = await receive(ws, 3)
        exported = [orjson.loads(line) for line in (await server_export(service)).splitlines()]

    frames = replay + live
    assert consecutive(frames, 0)
    assert later == frames[3:]
    assert all(f["type"] == "event" and f["id"] == f"{stream}:{f['seq']}" for f in frames)
    assert [f["kind"] for f in frames] == ["object.changed", "delivery.folded"] * 3
    assert all(set(f) == CHANGED_KEYS for f in frames[::2])
    assert all(set(f) == FOLDED_KEYS for f in frames[1::2])
    first, first_folded, second, _, third, _ = frames
    first_hour = parse_instant(first["hour"])
    assert {k: first[k] for k in ("metric", "layer", "hour", "points", "delivery_id")} == {
        "metric": "step_count",
        "layer": "minutes",
        "hour": "2024-04-01T00:00:00Z",
        "points": 1,
        "delivery_id": 1,
    }
    assert (second["hour"], second["points"], second["delivery_id"]) == (first["hour"], 2, 2)
    assert (third["hour"], third["points"]) == ("2024-04-01T02:00:00Z", 1)
    assert first["hash"] != second["hash"]
    # The object is the one current when the frame was sent: both frames of that hour carry it.
    assert first["object"] == second["object"]
    current = second["object"]
    assert (current["hash"], current["points"], current["units"]) == (second["hash"], 2, "count")
    assert current == stored_state(service.data, ObjectKey("step_count", "minutes", first_hour))
    assert third["object"] == stored_state(
        service.data, ObjectKey("step_count", "minutes", parse_instant(third["hour"]))
    )
    plain = gzip.decompress(base64.b64decode(current["body"]))
    stored = [line.split(b"\t") for line in plain.splitlines()]
    points = [e["point"] for e in exported if e["start"].startswith("2024-04-01T00:")]
    assert [orjson.loads(raw) for _, _, raw in stored] == points
    assert {k: first_folded[k] for k in ("delivery_id", "status")} == {
        "delivery_id": 1,
        "status": "parsed",
    }
    assert first_folded["counters"]["points_new"] == 1
    assert first_folded["counters"]["objects_written"] == 1


def stored_state(data: DataDir, key: ObjectKey) -> dict[str, Any]:
    """The object's state in the store, as a frame carries it (every field of ``to_wire``)."""
    with data.open_store() as store:
        stored = store.object(key)
    assert stored is not None
    return to_wire(stored)


async def test_switch_over_under_continuous_deliveries(tmp_path: Path) -> None:
    """STREAM-2: replay and live meet without a gap while deliveries keep arriving."""
    rng = random.Random(2)
    deliveries = 60
    posted = trio.Event()
    async with serving(tmp_path) as service, trio.open_nursery() as nursery:

        async def post_all() -> None:
            for n in range(deliveries):
                await post(service, small(n))
                await trio.sleep(rng.uniform(0, 0.03))
            posted.set()

        nursery.start_soon(post_all)
        with trio.fail_after(FRAME_LIMIT_S):
            while await head(service) < 10:
                await trio.sleep(POLL_S)
        first = after = 5
        connections = []
        for _ in range(3):
            async with subscribe(service, after=after) as ws:
                frames = await receive(ws, rng.randint(5, 25))
            connections.append((after, frames))
            after = frames[-1]["seq"] - rng.randint(0, 3)
        async with subscribe(service, after=after) as ws:
            await posted.wait()
            final = int((await service.wait_folded())["stream"]["head"])
            connections.append((after, await receive_through(ws, final)))

    assert final == 2 * deliveries
    seen: dict[int, str] = {}
    duplicates = 0
    for after, frames in connections:
        assert consecutive(frames, after), f"gap or disorder after {after}"
        for frame in frames:
            duplicates += frame["seq"] in seen
            assert seen.setdefault(frame["seq"], frame["id"]) == frame["id"]
    assert sorted(seen) == list(range(first + 1, final + 1))
    overlaps = [
        prev[-1]["seq"] - after for (_, prev), (after, _) in itertools.pairwise(connections)
    ]
    assert duplicates == sum(overlaps)


async def test_acks_stored_per_subscriber_and_never_back(tmp_path: Path) -> None:
    """STREAM-3: ACKs per named subscriber in /v1/status, only ever moving forward."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60, 120)
        async with (
            subscribe(service, subscriber="nas") as nas,
            subscribe(service, subscriber="desk") as desk,
            subscribe(service) as anonymous,
        ):
            for ws in (nas, desk, anonymous):
                assert consecutive(await receive(ws, total), 0)
            await send_ack(nas, 4)
            await send_ack(desk, total)
            await send_ack(anonymous, total)
            await acked(service, "nas", 4)
            await acked(service, "desk", total)
            # The unnamed subscriber's ACK was handled (not stored) and its connection goes on.
            await post(service, small(180))
            for ws in (nas, desk, anonymous):
                assert consecutive(await receive(ws, 2), total)
            await send_ack(anonymous, total + 2)
            await send_ack(nas, 2)
            # An error right after it proves the server has handled the lower ACK.
            await nas.send_message("not json")
            assert (await refusal(nas))[0]["code"] == "BAD_FRAME"
            await anonymous.send_message("not json")
            assert (await refusal(anonymous))[0]["code"] == "BAD_FRAME"
        async with subscribe(service, after=1, subscriber="desk") as desk:
            assert consecutive(await receive(desk, 2), 1)
            await send_ack(desk, 3)
            await desk.send_message("not json")
            assert (await refusal(desk))[0]["code"] == "BAD_FRAME"
        assert (await service.status())["subscribers"] == {"nas": 4, "desk": total}


async def test_ack_beyond_sent(tmp_path: Path) -> None:
    """STREAM-4: an ACK beyond what was sent is refused and stores nothing."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60)
        async with subscribe(service, after=2, subscriber="nas") as ws:
            assert consecutive(await receive(ws, total - 2), 2)
            await send_ack(ws, total)
            await acked(service, "nas", total)
            await send_ack(ws, total + 1)
            frame, code = await refusal(ws)
        assert frame == {"type": "error", "code": "ACK_BEYOND_SENT", "sent": total}
        assert code == 4400
        async with subscribe(service, after=total, subscriber="late") as ws:
            await send_ack(ws, total + 1)
            frame, code = await refusal(ws)
        assert (frame["code"], frame["sent"], code) == ("ACK_BEYOND_SENT", total, 4400)
        assert (await service.status())["subscribers"] == {"nas": total}


async def test_a_frame_over_64_kib_from_a_subscriber_is_refused_stream_93(tmp_path: Path) -> None:
    """STREAM-93: a subscriber's text frame over 64 KiB (an ACK after 1 MiB of blanks) closes
    the connection with 1009 before it is taken whole, and stores nothing; hypercorn took
    messages of up to 16 MiB, held whole in memory, from any subscriber with a token."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60)
        async with subscribe(service, subscriber="nas") as ws:
            assert consecutive(await receive(ws, total), 0)
            await send_ack(ws, 1)
            await acked(service, "nas", 1)
            padded = " " * 2**20 + orjson.dumps({"type": "ack", "seq": total}).decode()
            with contextlib.suppress(ConnectionClosed):
                await ws.send_message(padded)
            with trio.fail_after(FRAME_LIMIT_S), contextlib.suppress(ConnectionClosed):
                while True:
                    await ws.get_message()
            assert ws.closed is not None
            assert ws.closed.code == 1009
        assert (await service.status())["subscribers"] == {"nas": 1}


async def test_a_refused_subscriber_with_frames_in_flight_is_let_go_stream_98(
    tmp_path: Path,
) -> None:
    """STREAM-98: a subscriber that sends a frame the service refuses and, in the same write,
    30 more (its ACKs on their way) gets its BAD_FRAME frame and close 4400, answers the close,
    and sees the service let the connection go. (Before, hypercorn queued 10 of them for the
    stream that had ended and its reader of the connection waited on the next for good: the
    connection, its tasks and its descriptor stayed until the service stopped.)"""
    async with serving(tmp_path) as service:
        client = WSConnection(ConnectionType.CLIENT)
        request = Request(host="127.0.0.1", target=resource(0), extra_headers=bearer(service.token))
        tcp = await trio.open_tcp_stream("127.0.0.1", service.port)
        async with tcp:
            await tcp.send_all(client.send(request))
            with trio.fail_after(REFUSAL_LIMIT_S):
                while not any(isinstance(event, AcceptConnection) for event in client.events()):
                    client.receive_data(await tcp.receive_some())
            ack = orjson.dumps({"type": "ack", "seq": 0}).decode()
            frames = [client.send(TextMessage(data="{nope"))]
            frames += [client.send(TextMessage(data=ack)) for _ in range(30)]
            await tcp.send_all(b"".join(frames))
            texts: list[str] = []
            codes: list[int] = []
            with trio.fail_after(REFUSAL_LIMIT_S):
                while data := await tcp.receive_some():
                    client.receive_data(data)
                    for event in client.events():
                        if isinstance(event, TextMessage):
                            texts.append(event.data)
                        elif isinstance(event, CloseConnection):
                            codes.append(event.code)
                            with contextlib.suppress(trio.BrokenResourceError):
                                await tcp.send_all(client.send(event.response()))
        assert [orjson.loads(text)["code"] for text in texts] == ["BAD_FRAME"]
        assert codes == [4400]


@pytest.mark.parametrize("ending", ["close handshake", "connection dropped"])
async def test_final_ack_before_close_is_stored(tmp_path: Path, ending: str) -> None:
    """STREAM-5: the last ACK, sent right before the client goes, is stored."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60, 120)
        async with subscribe(service, subscriber="nas") as ws:
            await receive(ws, total)
            for seq in range(1, total + 1):
                await send_ack(ws, seq)
            if ending == "close handshake":
                await ws.aclose()
        await acked(service, "nas", total)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        pytest.param("{nope", "BAD_FRAME", id="not-json"),
        pytest.param('{"type": "hello", "seq": 1}', "BAD_FRAME", id="not-an-ack"),
        pytest.param('["ack", 1]', "BAD_FRAME", id="not-an-object"),
        pytest.param('{"type": "ack", "seq": -1}', "BAD_FRAME", id="negative-seq"),
        pytest.param('{"type": "ack", "seq": true}', "BAD_FRAME", id="boolean-seq"),
        pytest.param('{"type": "ack", "seq": "1"}', "BAD_FRAME", id="string-seq"),
        pytest.param('{"type": "ack"}', "BAD_FRAME", id="missing-seq"),
        pytest.param(b'{"type": "ack", "seq": 0}', "BINARY_FRAME", id="binary"),
    ],
)
async def test_bad_frames(tmp_path: Path, frame: str | bytes, code: str) -> None:
    """STREAM-6: a bad frame closes that subscriber (4400) and no other."""
    async with serving(tmp_path) as service:
        await post_small(service, 0)
        refused = await refused_beside_witness(
            service, resource(0, subscriber="bad"), bearer(service.token), frame
        )
        assert refused == ({"type": "error", "code": code}, 4400)
        assert "bad" not in (await service.status())["subscribers"]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("n" * 129, id="129-chars"),
        pytest.param("n" * 10240, id="10KB"),
        pytest.param("nas\x00", id="control-char"),
    ],
)
async def test_bad_subscriber_names(tmp_path: Path, name: str) -> None:
    """STREAM-7: a bad subscriber name is refused with BAD_SUBSCRIBER (4400)."""
    async with serving(tmp_path) as service:
        await post_small(service, 0)
        refused = await refused_beside_witness(
            service, resource(0, subscriber=name), bearer(service.token)
        )
        assert refused == ({"type": "error", "code": "BAD_SUBSCRIBER"}, 4400)


async def test_longest_subscriber_name_accepted(tmp_path: Path) -> None:
    """STREAM-7: a 128-character name is accepted and its ACK stored under it."""
    name = "n" * 128
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        async with subscribe(service, subscriber=name) as ws:
            await receive(ws, total)
            await send_ack(ws, total)
            await acked(service, name, total)


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        pytest.param(
            lambda _: [],
            "no token (send Authorization: Bearer TOKEN, or api-key: TOKEN)",
            id="missing",
        ),
        pytest.param(bearer, "the token is not a client's (mistyped, or revoked)", id="wrong"),
    ],
)
async def test_unauthorized(
    tmp_path: Path,
    headers: Callable[[str], list[tuple[bytes, bytes]]],
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """STREAM-8: no token or a wrong one: UNAUTHORIZED and close 4401, logged once at INFO
    through the HTTP routes' refusal log (``healthlog.http``), saying why, never with the token
    presented."""
    async with serving(tmp_path) as service:
        await post_small(service, 0)
        with caplog.at_level(logging.INFO, "healthlog.http"):
            refused = await refused_beside_witness(service, resource(0), headers("hl_wrong_a1b2c3"))
        assert refused == ({"type": "error", "code": "UNAUTHORIZED"}, 4401)
        logged = [
            (r.name, r.levelno, r.getMessage())
            for r in caplog.records
            if r.getMessage().startswith("refused ")
        ]
        assert logged == [
            ("healthlog.http", logging.INFO, f"refused 4401 GET /v1/stream from 127.0.0.1: {why}")
        ]
        assert "a1b2c3" not in caplog.text


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        pytest.param(lambda t: resource(0, token=t), lambda _: [], id="query-parameter"),
        pytest.param(lambda _: resource(0), lambda t: [(b"api-key", t.encode())], id="api-key"),
        pytest.param(lambda _: resource(0), bearer, id="bearer"),
    ],
)
async def test_token_forms_accepted(
    tmp_path: Path,
    path: Callable[[str], str],
    headers: Callable[[str], list[tuple[bytes, bytes]]],
) -> None:
    """STREAM-8: the token as a bearer header, an api-key header or a query parameter."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        async with connect(service.port, path(service.token), headers(service.token)) as ws:
            assert consecutive(await receive(ws, total), 0)


@pytest.mark.parametrize(
    "cursor",
    [
        "-1",
        "x",
        "1.5",
        "\uff11",
        "9" * 19,
        "",
    ],
    ids=["negative", "word", "fraction", "fullwidth-digit", "19-digits", "empty"],
)
async def test_bad_cursor(tmp_path: Path, cursor: str) -> None:
    """STREAM-9: a cursor that is not a non-negative integer: BAD_CURSOR, close 4400."""
    async with serving(tmp_path) as service:
        await post_small(service, 0)
        refused = await refused_beside_witness(service, resource(cursor), bearer(service.token))
        assert refused == ({"type": "error", "code": "BAD_CURSOR"}, 4400)


async def test_cursor_in_future(tmp_path: Path) -> None:
    """STREAM-9: a cursor beyond the head: CURSOR_IN_FUTURE with the head, close 4400."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        refused = await refused_beside_witness(service, resource(total + 1), bearer(service.token))
        assert refused == ({"type": "error", "code": "CURSOR_IN_FUTURE", "head": total}, 4400)


async def test_a_repeated_parameter_is_refused_naming_it_stream_127(tmp_path: Path) -> None:
    """STREAM-127: `after`, `subscriber`, `tag` or `token` given twice is refused
    `REPEATED_PARAMETER` naming it, close 4400, holding no slot (with the one slot taken by a
    witness), a repeated `token` before any is checked; another parameter given twice is no
    part of the stream's and is ignored. The stream took the last of a repeated parameter, the
    HTTP routes the first: `after=1&after=0` replayed from 0."""
    async with serving(tmp_path, stream_max_subscribers=1) as service:
        await post_small(service, 0, 1)
        token = service.token
        for query, parameter, headers in (
            ("after=1&after=0", "after", bearer(token)),
            ("after=0&subscriber=a&subscriber=b", "subscriber", bearer(token)),
            ("after=1&tag=0a&tag=0b", "tag", bearer(token)),
            (f"after=0&token={token}&token={token}", "token", []),
            ("after=0&token=no&token=no", "token", []),
        ):
            path = f"/v1/stream?{query}"
            refused = await refused_beside_witness(service, path, headers)
            expected = {"type": "error", "code": "REPEATED_PARAMETER", "parameter": parameter}
            assert refused == (expected, 4400), query
        async with connect(service.port, "/v1/stream?after=0&x=1&x=2", bearer(token)) as ws:
            [frame] = await receive(ws, 1)
        assert (frame["type"], frame["seq"]) == ("event", 1)


CLOSING_SUBSCRIBERS = 40
SERVE_START_LIMIT_S = 30.0
SERVE_STOP_LIMIT_S = 60.0
SERVING_LINE = re.compile(r"healthlog serving on http://127\.0\.0\.1:(\d+) ")


async def test_refused_subscriber_closing_at_once_logs_no_error(tmp_path: Path) -> None:
    """STREAM-100: subscribers of a `healthlog serve` process that close their side as soon as
    the error frame of a refusal arrives (as a browser's ``onmessage`` calling ``close()``
    does) each get the frame, and the service logs no ERROR. Its close met the one hypercorn
    sends in answer to the client's, on the same socket (``trio.BusyResourceError``), and
    hypercorn logged ``Error in ASGI Framework`` at ERROR for about one in four of them."""
    data, out, err = tmp_path / "data", tmp_path / "serve.out", tmp_path / "serve.err"
    cli = [sys.executable, "-m", "healthlog.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    made = await trio.run_process(
        [*cli, "token", "add", TOKEN_NAME, "--data", data], env=env, capture_stdout=True
    )
    token = made.stdout.decode().strip()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [*cli, "serve", "--data", data, "--port", "0"], env=env, stdout=stdout, stderr=stderr
        )
    try:
        with trio.fail_after(SERVE_START_LIMIT_S):
            while (found := SERVING_LINE.search(out.read_text())) is None:
                assert process.poll() is None, err.read_text()
                await trio.sleep(POLL_S)
        port = int(found.group(1))
        for _ in range(CLOSING_SUBSCRIBERS):
            async with connect(port, resource("x"), bearer(token)) as ws:
                frame = text_frame(await ws.get_message())
                await ws.aclose()
            assert frame == {"type": "error", "code": "BAD_CURSOR"}
    finally:
        process.terminate()
        with trio.fail_after(SERVE_STOP_LIMIT_S):
            await process.wait()
    assert process.returncode == 0, err.read_text()
    assert severe_lines(err.read_text()) == []


async def test_a_cursor_whose_event_is_another_is_refused_stream_114(tmp_path: Path) -> None:
    """STREAM-114: every event frame carries a tag of 16 hex digits, each event its own; a
    subscriber resuming with the tag of the event at its cursor is sent that event again, then
    those after it (at the head, that one event); with another tag it gets CURSOR_TOO_OLD with
    ``diverged`` true and a snapshot, close 4410; without one, the events after its cursor as
    before; a tag that is not one is BAD_CURSOR; and a cursor whose event was the last pruned
    is checked against the tag the store kept of it (STREAM-123): with that tag the events after
    it come, with another ``diverged``."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60, 120)
        async with subscribe(service, after=0) as ws:
            frames = await receive(ws, total)
        tags = [frame["tag"] for frame in frames]
        assert all(re.fullmatch("[0-9a-f]{16}", tag) for tag in tags), tags
        assert len(set(tags)) == total

        async with subscribe(service, after=4, tag=tags[3]) as ws:
            assert await receive(ws, 3) == frames[3:]
        async with subscribe(service, after=total, tag=tags[-1]) as ws:
            assert await receive(ws, 1) == frames[-1:]
        async with subscribe(service, after=4, tag=tags[2]) as ws:
            frame, code = await refusal(ws)
        assert code == 4410
        assert set(frame) == {"type", "code", "snapshot", "diverged"}
        assert (frame["code"], frame["diverged"], frame["snapshot"]["seq"]) == (
            "CURSOR_TOO_OLD",
            True,
            total,
        )
        async with subscribe(service, after=4) as ws:
            assert await receive(ws, 2) == frames[4:]
        for bad in ("", "not hex!", "a" * 65, "\u0661" * 16):
            async with subscribe(service, after=4, tag=bad) as ws:
                assert await refusal(ws) == ({"type": "error", "code": "BAD_CURSOR"}, 4400)

        await prune(service.data, keep=2)
        async with subscribe(service, after=total - 2, tag=tags[total - 3]) as ws:
            assert await receive(ws, 2) == frames[4:]
        async with subscribe(service, after=total - 2, tag="0" * 16) as ws:
            frame, code = await refusal(ws)
        assert (frame["code"], frame["diverged"], code) == ("CURSOR_TOO_OLD", True, 4410)


async def test_cursor_older_than_window(tmp_path: Path) -> None:
    """STREAM-10, STREAM-11: CURSOR_TOO_OLD with a signed snapshot reference; pruning leaves
    the journal untouched."""
    async with serving(tmp_path) as service:
        total = await post_small(service, *range(0, 360, 60))
        journal_before = rows(service.data.journal_path)
        assert await prune(service.data, keep=4) == total - 4
        assert rows(service.data.journal_path) == journal_before
        status = await service.status()
        oldest = total - 4
        assert (status["stream"]["oldest_cursor"], status["stream"]["head"]) == (oldest, total)

        async with subscribe(service, after=oldest) as ws:
            assert consecutive(await receive(ws, 4), oldest)
        async with subscribe(service, after=oldest - 1) as ws:
            frame, code = await refusal(ws)
        assert code == 4410
        assert set(frame) == {"type", "code", "snapshot"}
        assert (frame["type"], frame["code"], set(frame["snapshot"])) == (
            "error",
            "CURSOR_TOO_OLD",
            SNAPSHOT_KEYS,
        )
        manifest = converter.structure(frame["snapshot"], Manifest)
        assert manifest.seq == total
        assert (manifest.instance, manifest.stream) == (
            status["stream"]["instance"],
            status["stream"]["id"],
        )
        assert (await service.client.get(manifest.url)).status_code == 401
        fetched = await service.get(manifest.url)
        assert fetched.status_code == 200
        key = (await service.client.get("/v1/snapshots/key")).json()
        assert key == {"public_key": status["stream"]["public_key"], "algorithm": "Ed25519"}
        objects = validate(
            manifest,
            fetched.content,
            public_key=key["public_key"],
            instance=manifest.instance,
            stream=manifest.stream,
            after=oldest - 1,
        )
        assert b"".join(export_lines(objects)) == await server_export(service)

        async with subscribe(service, after=manifest.seq) as ws:
            await post(service, small(400))
            assert consecutive(await receive(ws, 2), manifest.seq)
        assert rows(service.data.journal_path)["deliveries"] != journal_before["deliveries"]


RETENTION_PERIOD_S = 0.05
MONTH_S = 31 * 86400.0


async def test_gone_subscribers_are_removed_and_listed_again_after_an_ack_stream_63_64_66(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-63, STREAM-64, STREAM-66: the retention actor of a serving instance, run every
    50 ms, removes a subscriber whose last ACK and cursor fell out of the window once the
    clock has moved a month on (healthlog.clock, as an NTP step would): /v1/status and the
    subscriber gauge no longer list it, one INFO line says how many (never which); one with a
    recent ACK and one at the head stay. Reconnecting with its name, it gets CURSOR_TOO_OLD
    and is not listed; resuming at the snapshot, its next ACK lists it again."""
    monkeypatch.setattr(
        serve_module,
        "configured",
        lambda *args, **kwargs: attrs.evolve(
            configured(*args, **kwargs), retention_period_s=RETENTION_PERIOD_S
        ),
    )
    names = ("laptop-3", "desk-5", "nas-7")
    jumped = 0.0
    try:
        with caplog.at_level(logging.INFO):
            async with serving(tmp_path, stream_window_events=4) as service:
                total = await post_small(service, *range(0, 360, 60))
                async with subscribe(service, subscriber="laptop-3") as ws:
                    assert consecutive(await receive(ws, total), 0)
                    await send_ack(ws, 2)
                    await acked(service, "laptop-3", 2)
                async with subscribe(service, subscriber="nas-7") as ws:
                    assert consecutive(await receive(ws, total), 0)
                    await send_ack(ws, total)
                    await acked(service, "nas-7", total)
                async with subscribe(service, subscriber="desk-5") as desk:
                    assert consecutive(await receive(desk, total), 0)
                    clock.jump(MONTH_S)
                    jumped = MONTH_S
                    await send_ack(desk, 2)
                    await acked(service, "desk-5", 2)
                    with trio.fail_after(FRAME_LIMIT_S):
                        while "laptop-3" in (await service.status())["subscribers"]:
                            await trio.sleep(POLL_S)
                    await trio.sleep(10 * RETENTION_PERIOD_S)
                    status = await service.status()
                    assert status["stream"]["oldest_cursor"] == total - 4
                    assert status["subscribers"] == {"nas-7": total, "desk-5": 2}
                    assert await metric(service, "healthlog_websocket_subscribers") == 2

                async with subscribe(service, after=2, subscriber="laptop-3") as ws:
                    frame, code = await refusal(ws)
                assert (frame["code"], code, frame["snapshot"]["seq"]) == (
                    "CURSOR_TOO_OLD",
                    4410,
                    total,
                )
                assert "laptop-3" not in (await service.status())["subscribers"]
                async with subscribe(service, after=total, subscriber="laptop-3") as ws:
                    await post(service, small(400))
                    assert consecutive(await receive(ws, 2), total)
                    await send_ack(ws, total + 2)
                    await acked(service, "laptop-3", total + 2)
                assert await metric(service, "healthlog_websocket_subscribers") == 3
    finally:
        clock.jump(-jumped)
    removals = [r for r in caplog.records if r.name == "healthlog.retention"]
    assert [(r.levelno, r.getMessage()) for r in removals] == [
        (
            logging.INFO,
            "removed 1 gone subscriber(s) (last ACK and cursor older than the window)",
        )
    ]
    healthlog_lines = [r.getMessage() for r in caplog.records if r.name.startswith("healthlog")]
    assert not [line for line in healthlog_lines for name in names if name in line]


async def test_a_snapshot_the_disk_cannot_hold_is_refused_cleanly_stream_58(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-58: while snapshot files cannot be written (a real EFBIG), a subscriber whose
    cursor is too old is closed with 1011 and no frame, and `GET /v1/snapshots` answers 503
    SNAPSHOT_UNAVAILABLE with Retry-After; each logs one WARNING naming the errno, nothing is
    logged at ERROR; once there is room, both get their snapshot."""
    async with serving(tmp_path) as service:
        total = await post_small(service, *range(0, 360, 60))
        await prune(service.data, keep=4)
        with caplog.at_level(logging.WARNING), files_limited_to(64):
            async with subscribe(service, after=0) as ws:
                frames: list[str | bytes] = []
                with trio.fail_after(10), contextlib.suppress(ConnectionClosed):
                    frames.append(await ws.get_message())
                assert ws.closed is not None
                closed = ws.closed.code
            latest = await service.get("/v1/snapshots")
        async with subscribe(service, after=0) as ws:
            frame, code = await refusal(ws)
        built = await service.get("/v1/snapshots")
    assert (frames, closed) == ([], 1011)
    assert latest.status_code == 503
    assert latest.json() == {"error": "SNAPSHOT_UNAVAILABLE"}
    assert latest.headers["retry-after"] == "60"
    assert [r.getMessage() for r in caplog.records if "snapshot" in r.getMessage()] == [
        "stream: no snapshot for a cursor too old: OSError: EFBIG",
        "snapshot not built: OSError: EFBIG",
    ]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert (frame["code"], code, frame["snapshot"]["seq"]) == ("CURSOR_TOO_OLD", 4410, total)
    assert built.status_code == 200


async def test_a_hole_in_the_events_is_never_skipped_stream_40(tmp_path: Path) -> None:
    """STREAM-40: in a store whose events have a hole in the middle (pruned so by an earlier
    version after a clock step), a subscriber gets the events before the hole and then
    CURSOR_TOO_OLD with a snapshot, never the events after it as if they followed."""
    async with serving(tmp_path) as service:
        total = await post_small(service, *range(0, 360, 60))
        assert total == 12

        def punch() -> None:
            with contextlib.closing(sqlite3.connect(service.data.store_path)) as conn, conn:
                conn.execute("DELETE FROM events WHERE seq BETWEEN 7 AND 10")

        await trio.to_thread.run_sync(punch)
        async with subscribe(service, after=0) as ws:
            sent = await receive(ws, 6)
            frame, code = await refusal(ws)
        assert consecutive(sent, 0)
        assert (frame["code"], code, frame["snapshot"]["seq"]) == ("CURSOR_TOO_OLD", 4410, 12)
        async with subscribe(service, after=10) as ws:
            assert consecutive(await receive(ws, 2), 10)


async def test_an_ack_waits_for_a_busy_store_stream_41(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-41: a named subscriber's ACK sent while another connection holds the store's
    write lock longer than the busy timeout (5 s) is stored once the lock is free, the stream
    goes on, one WARNING says the ACK waits, and nothing is logged above WARNING; meanwhile
    the store's reads (status) are never held longer than one of the ACK's brief waits (nor
    of the lease renewal's, RUN-44)."""
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60)
        async with subscribe(service, after=0, subscriber="nas") as ws:
            await receive_through(ws, total)
            other = sqlite3.connect(service.data.store_path, check_same_thread=False)
            with contextlib.closing(other), caplog.at_level(logging.WARNING):
                await trio.to_thread.run_sync(other.execute, "BEGIN IMMEDIATE")
                await send_ack(ws, total)
                # Meanwhile the ACK holds the store's reads for no more than one brief wait
                # (250 ms) at a time: status answers promptly all along.
                slowest = 0.0
                held_until = trio.current_time() + BUSY_HOLD_S
                while trio.current_time() < held_until:
                    asked = trio.current_time()
                    assert (await service.status())["subscribers"].get("nas") is None
                    slowest = max(slowest, trio.current_time() - asked)
                    await trio.sleep(POLL_S)
                assert slowest < ACK_HOLDS_READS_MAX_S
                other.execute("COMMIT")
                await acked(service, "nas", total)
                await post(service, small(400))
                assert consecutive(await receive(ws, 2), total)
    waits = [r for r in caplog.records if "an ACK waits" in r.getMessage()]
    assert [r.levelno for r in waits] == [logging.WARNING]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def head_reads_failing(*errors: Exception) -> None:
    """The event hub's next reads of the store's head raise ``errors``, one each, through the
    fault point ``stream.head``; returns once all were raised."""
    pending = list(errors)

    def next_error(_name: str) -> None:
        raise pending.pop(0)

    hits = frozenset(range(1, len(errors) + 1))
    with faults.loaded(faults.Plan({"stream.head": faults.Action(hits, next_error)})):
        with trio.fail_after(FRAME_LIMIT_S):
            while pending:
                await trio.sleep(POLL_S)


async def test_live_events_outlive_a_failed_head_read_stream_45(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-45: the event hub's reads of the store's head fail (busy twice, then a storage
    error twice) while a subscriber waits at the head; the hub reads again at its next polls
    and live events keep waking the subscriber, one WARNING names the error's type only, and
    nothing is logged above WARNING.

    A read in WAL mode is never busy and SQLite cannot be made to fail one on demand, so the
    fault point ``stream.head`` raises; the subscribers' idle recheck is set to an hour, so
    only the hub can wake the subscriber before the frame limit."""
    monkeypatch.setattr(
        app_module, "StreamEndpoint", functools.partial(StreamEndpoint, idle_recheck_s=3600.0)
    )
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        async with subscribe(service, after=total) as ws:
            await post(service, small(60))
            assert consecutive(await receive(ws, 2), total)
            with caplog.at_level(logging.DEBUG, logger="healthlog.stream"):
                await head_reads_failing(
                    Deferred("database busy"),
                    Deferred("database busy"),
                    StorageError("database error: disk I/O error"),
                    StorageError("database error: disk I/O error"),
                )
                for n, minute in enumerate((120, 180)):
                    await post(service, small(minute))
                    assert consecutive(await receive(ws, 2), total + 2 + 2 * n)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.name for r in warnings] == ["healthlog.stream"]
    assert "StorageError" in warnings[0].getMessage()
    assert not any("disk I/O" in r.getMessage() or "busy" in r.getMessage() for r in warnings)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# How long the service is left without a waiting subscriber while the event hub's reads are
# counted: ten of its polls.
HUB_IDLE_S = 1.0


async def test_the_event_hub_reads_nothing_while_no_subscriber_waits_stream_80(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STREAM-80: a service with no subscriber waiting (none connected, then one that came and
    went) reads the store's head not once, where it read it ten times a second for nothing
    (about 2 % of a core on an idle service); a subscriber waiting at the head is still woken
    by the hub for each live event, and once it is gone the reads stop again.

    The reads are counted at the fault point ``stream.head`` (a plan with no action). The
    subscribers' idle recheck is an hour, so only the hub can wake the subscriber."""
    monkeypatch.setattr(
        app_module, "StreamEndpoint", functools.partial(StreamEndpoint, idle_recheck_s=3600.0)
    )
    with faults.loaded(faults.Plan()) as plan:
        async with serving(tmp_path) as service:
            total = await post_small(service, 0)
            await trio.sleep(HUB_IDLE_S)
            assert plan.hits["stream.head"] == 0
            async with subscribe(service, after=total) as ws:
                for n, minute in enumerate((60, 120)):
                    await post(service, small(minute))
                    assert consecutive(await receive(ws, 2), total + 2 * n)
            assert plan.hits["stream.head"] > 0
            with trio.fail_after(FRAME_LIMIT_S):
                while stream_handlers():
                    await trio.sleep(POLL_S)
            await trio.sleep(HUB_IDLE_S)
            reads = plan.hits["stream.head"]
            await trio.sleep(HUB_IDLE_S)
            assert plan.hits["stream.head"] == reads


# How much earlier than its backoff and ``healthy_s`` a restarted task may count as up in these
# measurements (the wall clock of a log record against trio's clock).
DOWN_SLACK_S = 0.1


async def metric(service: Service, name: str) -> float:
    """The value of the unlabelled sample ``name`` in ``/metrics``."""
    response = await service.client.get("/metrics")
    assert response.status_code == 200
    return next(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name
    )


async def test_a_crashed_event_hub_is_restarted_stream_54(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-54: the event hub crashes twice with an unexpected exception (not a storage
    error) while a subscriber waits at the head; it is supervised like the runtime's actors:
    each crash is one ERROR from ``healthlog.supervisor`` naming the hub and the type only,
    counted in ``healthlog_actor_crashes_total``; the hub is down (``healthlog_actors_down``,
    ``/readyz`` 503) until it has run well for ``healthy_s`` (here 2 s) after its restart, which
    comes after its backoff (0.5 s, then 1 s), and live events keep waking the subscriber.

    As in STREAM-45 the fault point ``stream.head`` raises, and the subscribers' idle recheck
    is an hour, so only a running hub can wake the subscriber before the frame limit."""
    monkeypatch.setattr(
        app_module, "StreamEndpoint", functools.partial(StreamEndpoint, idle_recheck_s=3600.0)
    )
    monkeypatch.setattr(
        serve_module,
        "configured",
        lambda *args, **kwargs: attrs.evolve(configured(*args, **kwargs), healthy_s=2.0),
    )
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        async with subscribe(service, after=total) as ws:
            await post(service, small(60))
            assert consecutive(await receive(ws, 2), total)
            with caplog.at_level(logging.DEBUG):
                await head_reads_failing(RuntimeError("secret 42"), RuntimeError("secret 43"))
                assert (await service.client.get("/readyz")).status_code == 503
                assert await metric(service, "healthlog_actors_down") == 1
                for n, minute in enumerate((120, 180)):
                    await post(service, small(minute))
                    assert consecutive(await receive(ws, 2), total + 2 + 2 * n)
                # The hub runs again (it woke the subscriber), but has not yet run well for 2 s.
                assert (await service.client.get("/readyz")).status_code == 503
            assert await metric(service, "healthlog_actor_crashes_total") == 2
            with trio.fail_after(FRAME_LIMIT_S):
                while (await service.client.get("/readyz")).status_code != 200:
                    await trio.sleep(POLL_S)
            ready_at = time.time()
            assert await metric(service, "healthlog_actors_down") == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Down from the second crash through its backoff (1 s) and 2 s of running well after it.
    assert len(errors) == 2
    assert ready_at - errors[1].created >= 1.0 + 2.0 - DOWN_SLACK_S
    assert [(r.name, r.getMessage(), r.exc_info) for r in errors] == [
        (
            "healthlog.supervisor",
            f"actor event-hub crashed (RuntimeError); restarting in {delay}",
            None,
        )
        for delay in ("0.5 s", "1.0 s")
    ]
    assert not any("secret" in r.getMessage() for r in caplog.records)


async def test_a_busy_store_delays_a_page_stream_55(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-55: a subscriber's page reads find the store busy (``Deferred``) for more than
    5 s; each is tried again a second later on the same connection, which gets the events that
    came meanwhile once a read succeeds; one WARNING says the subscriber waits, nothing is
    logged above WARNING, and the connection is not closed."""
    busy = faults.raise_fault(lambda _: Deferred("database busy: database is locked"))
    async with serving(tmp_path) as service:
        total = await post_small(service, 0)
        async with subscribe(service, after=0) as ws:
            assert consecutive(await receive(ws, total), 0)
            plan = faults.Plan(actions={"stream.page": faults.Action(frozenset(range(1, 8)), busy)})
            with faults.loaded(plan), caplog.at_level(logging.DEBUG, logger="healthlog.stream"):
                await post(service, small(60))
                frames = await receive(ws, 2)
                assert plan.fired["stream.page"] == 7
            assert consecutive(frames, total)
            await post(service, small(120))
            assert consecutive(await receive(ws, 2), total + 2)
            assert ws.closed is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "stream: the store is busy; a subscriber waits until it is free"
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    # Each busy read logs once (the one past 5 s as the WARNING), a second after the one before.
    busy_reads = [
        r.created
        for r in caplog.records
        if r.getMessage()
        in (
            "stream: the store is busy; a subscriber's read is tried again",
            "stream: the store is busy; a subscriber waits until it is free",
        )
    ]
    assert len(busy_reads) == 7
    gaps = [later - earlier for earlier, later in itertools.pairwise(busy_reads)]
    assert all(BUSY_RETRY_MIN_S <= gap < BUSY_RETRY_MAX_S for gap in gaps), gaps


async def closed_after(ws: WebSocketConnection) -> tuple[list[dict[str, Any]], int, str | None]:
    """Read until the server closes (within the frame limit): the frames before the close, its
    code and its reason."""
    frames: list[dict[str, Any]] = []
    with trio.fail_after(FRAME_LIMIT_S), contextlib.suppress(ConnectionClosed):
        while True:
            frames.append(orjson.loads(await ws.get_message()))
    assert ws.closed is not None
    return frames, ws.closed.code, ws.closed.reason


@pytest.mark.parametrize("where", ["page", "ack"])
async def test_a_storage_error_ends_only_its_subscription_stream_56(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """STREAM-56: a subscriber's page read, or the storing of its ACK, fails with a storage
    error (not busy): that subscription alone is closed with 1011 (reason ``STORE_ERROR``, no
    error frame) and its handler ends; one WARNING names the error's type (not its text) and
    nothing is logged above WARNING; a witness subscriber goes on, and the subscriber reconnects
    from its cursor, gets the events it had not, and has its ACK stored.

    The page read fails at the fault point ``stream.page``, the ACK at ``stream.ack``: the
    witness waits at the head with an idle recheck of an hour, so after its first two reads (its
    page, then an empty one) only the subscriber reads pages until the next delivery."""
    monkeypatch.setattr(
        app_module, "StreamEndpoint", functools.partial(StreamEndpoint, idle_recheck_s=3600.0)
    )
    failure = StorageError("database error: disk I/O error")
    plan = faults.Plan()
    async with serving(tmp_path) as service:
        total = await post_small(service, 0, 60)
        with faults.loaded(plan), caplog.at_level(logging.DEBUG, logger="healthlog.stream"):
            async with subscribe(service, after=total - 2, subscriber="witness") as witness:
                assert consecutive(await receive(witness, 2), total - 2)
                with trio.fail_after(FRAME_LIMIT_S):
                    while plan.hits["stream.page"] < 2:
                        await trio.sleep(POLL_S)
                # The subscriber's first page read (its replay) succeeds, the next one fails.
                plan.actions["stream.page"] = faults.Action(
                    frozenset({4}) if where == "page" else frozenset(),
                    faults.raise_fault(lambda _: failure),
                )
                async with subscribe(service, after=0, subscriber="nas") as ws:
                    assert consecutive(await receive(ws, total), 0)
                    if where == "ack":
                        plan.actions["stream.ack"] = faults.Action(
                            frozenset({1}), faults.raise_fault(lambda _: failure)
                        )
                        await send_ack(ws, total)
                    frames, code, reason = await closed_after(ws)
                with trio.fail_after(FRAME_LIMIT_S):
                    while stream_handlers() > 1:
                        await trio.sleep(POLL_S)
                assert (frames, code, reason) == ([], 1011, "STORE_ERROR")
                assert "nas" not in (await service.status())["subscribers"]
                await post(service, small(120))
                assert consecutive(await receive(witness, 2), total)
                async with subscribe(service, after=total, subscriber="nas") as ws:
                    assert consecutive(await receive(ws, 2), total)
                    await send_ack(ws, total + 2)
                    await acked(service, "nas", total + 2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.name for r in warnings] == ["healthlog.stream"]
    assert "(StorageError)" in warnings[0].getMessage()
    assert "disk I/O" not in warnings[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def fill(service: Service) -> int:
    """One big, badly compressible object, then deliveries that each change it: every one of
    their events carries the whole object, some 10 MB of frames in all. The head after them."""
    await post(service, noisy(0, NOISY_POINTS), SECONDS)
    for n in range(NOISY_ADDITIONS):
        await post(service, noisy(NOISY_POINTS + n, 1), SECONDS)
    return int((await service.wait_folded())["stream"]["head"])


async def test_slow_subscriber_does_not_hold_others(tmp_path: Path) -> None:
    """STREAM-12: a subscriber that never reads holds up no one, and its handler ends once it
    goes. The send timeout is the default one, so the stalled subscriber stays connected until
    it goes (STREAM-13 is the one cut off)."""
    async with serving(tmp_path) as service:
        total = await fill(service)
        async with (
            stalled(service),
            subscribe(service, subscriber="witness") as witness,
        ):
            assert consecutive(await receive_through(witness, total), 0)
            await post(service, small(0))
            assert consecutive(await receive(witness, 2), total)
            await send_ack(witness, total + 2)
            await acked(service, "witness", total + 2)
            assert (await service.client.get("/healthz")).status_code == 200
            assert stream_handlers() == 2
        with trio.fail_after(FRAME_LIMIT_S):
            while stream_handlers():
                await trio.sleep(POLL_S)


async def test_never_reading_subscriber_is_closed(tmp_path: Path) -> None:
    """STREAM-13: a subscriber that stops reading is closed once a send stalls past the
    timeout, while it is still connected."""
    async with serving(tmp_path, stream_send_timeout_s=SEND_TIMEOUT_S) as service:
        await fill(service)
        async with stalled(service) as tcp:
            with trio.fail_after(SEND_TIMEOUT_S + 4):
                while not stream_handlers():
                    await trio.sleep(POLL_S)
            with trio.move_on_after(SEND_TIMEOUT_S + 4):
                while stream_handlers():
                    await trio.sleep(POLL_S)
            assert stream_handlers() == 0, "the stalled subscriber is still being served"
            with trio.fail_after(FRAME_LIMIT_S), contextlib.suppress(trio.BrokenResourceError):
                while await tcp.receive_some(2**20):
                    pass


async def test_independent_client_library(tmp_path: Path) -> None:
    """STREAM-14: the ``websockets`` library gets the replay of a few thousand events and
    acknowledges them."""
    async with serving(tmp_path) as service:
        await post(service, hourly(2000))
        total = int((await service.wait_folded())["stream"]["head"])
        url = f"ws://127.0.0.1:{service.port}{resource(0, subscriber='ext')}"

        def replay() -> list[dict[str, Any]]:
            with websockets_connect(url, additional_headers=service.auth, max_size=None) as ws:
                frames = [text_frame(ws.recv(timeout=FRAME_LIMIT_S)) for _ in range(total)]
                ws.send(orjson.dumps({"type": "ack", "seq": total}).decode())
            return frames

        frames = await trio.to_thread.run_sync(replay)
        await acked(service, "ext", total)
    assert total == 2001
    assert consecutive(frames, 0)
    assert [f["kind"] for f in frames] == ["object.changed"] * 2000 + ["delivery.folded"]
    assert frames[-1]["counters"]["objects_written"] == 2000


def add_token(data: DataDir, name: str) -> str:
    with data.open_tokens() as tokens:
        return tokens.add(name)


def revoke_token(data: DataDir, name: str) -> None:
    with data.open_tokens() as tokens:
        tokens.revoke(name)


async def until_closed(
    ws: WebSocketConnection, limit_s: float = REFUSAL_LIMIT_S
) -> tuple[list[dict[str, Any]], int]:
    """Every frame the server sends until it closes, within ``limit_s``, and the close code."""
    frames: list[dict[str, Any]] = []
    with trio.fail_after(limit_s), contextlib.suppress(ConnectionClosed):
        while True:
            frames.append(orjson.loads(await ws.get_message()))
    assert ws.closed is not None
    return frames, ws.closed.code


async def test_revoked_token_ends_its_stream_stream_28(tmp_path: Path) -> None:
    """STREAM-28: a token revoked while its streams are open: once a request with it is
    refused, an ACK on its stream is refused (UNAUTHORIZED, 4401) and not stored, and the next
    events end its other stream the same way, with no event past the head at revocation;
    a stream with another token gets those events."""
    async with serving(tmp_path) as service:
        other = await trio.to_thread.run_sync(add_token, service.data, "other")
        other_auth = {"Authorization": f"Bearer {other}"}
        start = await post_small(service, 0)
        async with (
            subscribe(service, subscriber="idle") as idle,
            subscribe(service, subscriber="live") as live,
            connect(service.port, resource(0), bearer(other)) as witness,
        ):
            for ws in (idle, live, witness):
                assert consecutive(await receive(ws, start), 0)
            await send_ack(idle, 1)
            await send_ack(live, start)
            await acked(service, "idle", 1)
            await acked(service, "live", start)

            await trio.to_thread.run_sync(revoke_token, service.data, TOKEN_NAME)
            # The HTTP API and the stream share one token cache: once a request with the token
            # is refused, every later check on its streams refuses it too.
            with trio.fail_after(REVOKE_LIMIT_S):
                while (await service.get("/v1/status")).status_code != 401:
                    await trio.sleep(POLL_S)

            await send_ack(idle, start)
            assert await until_closed(idle) == ([UNAUTHORIZED], 4401)

            response = await service.client.post(
                "/v1/deliveries", content=small(60), headers={**other_auth, **MINUTES}
            )
            assert response.status_code == 200, response.text
            # Events beyond the head at revocation exist and are being sent: the witness,
            # woken with the revoked stream, gets them.
            assert consecutive(await receive(witness, 2), start)
            assert await until_closed(live) == ([UNAUTHORIZED], 4401)
        status = await service.client.get("/v1/status", headers=other_auth)
        assert status.json()["subscribers"] == {"idle": 1, "live": start}


async def test_revoked_token_ends_its_idle_stream_stream_36(tmp_path: Path) -> None:
    """STREAM-36: a token revoked while its stream waits at the head, with no event to send and
    no ACK from the client: the stream is closed with UNAUTHORIZED and 4401 all the same,
    within a few seconds; a stream with another token stays open."""
    async with serving(tmp_path) as service:
        other = await trio.to_thread.run_sync(add_token, service.data, "other")
        start = await post_small(service, 0)
        async with (
            subscribe(service, subscriber="idle") as idle,
            connect(service.port, resource(0), bearer(other)) as witness,
        ):
            for ws in (idle, witness):
                assert consecutive(await receive(ws, start), 0)
            await trio.to_thread.run_sync(revoke_token, service.data, TOKEN_NAME)
            assert await until_closed(idle, REVOKE_LIMIT_S) == ([UNAUTHORIZED], 4401)
            assert witness.closed is None


async def test_shutdown_closes_subscribers_with_1001(tmp_path: Path) -> None:
    """STREAM-15: on shutdown a connected subscriber is closed with 1001, promptly."""
    async with serving(tmp_path, graceful_timeout_s=GRACE_S) as service:
        total = await post_small(service, 0)
        async with subscribe(service) as ws:
            await receive(ws, total)
            service.stop.set()
            with trio.move_on_after(GRACE_S / 2), contextlib.suppress(ConnectionClosed):
                await ws.get_message()
            assert ws.closed is not None, "still open"
            assert ws.closed.code == 1001


def test_replay_page_carries_current_objects_and_stays_bounded(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STREAM-25: a page joins each object.changed event with its object's current state (null
    once gone, and for delivery.folded); it ends after the event whose body reaches the byte
    limit, never empty, and the next page resumes right after it."""
    first = append(
        journal,
        delivery(storage_body({"hr": [point(1, 60), point(61, 61)], "steps": [point(5, 1)]})),
    )
    later = append(journal, delivery(storage_body({"hr": [point(2, 62)]})))
    store.fold(journal, first, epoch)
    store.fold(journal, later, epoch)

    page = store.replay_page(0, 256, max_bytes=2**30)
    assert [event.seq for event, _ in page] == list(range(1, 7))
    for event, current in page:
        if event.kind == "delivery.folded":
            assert current is None
            continue
        payload = event.payload
        key = ObjectKey(payload["metric"], payload["layer"], parse_instant(payload["hour"]))
        assert current is not None
        assert current == store.object(key)
    # The first hour of hr was written by both deliveries: both events carry its newest state.
    first_hour = [
        (event, current)
        for event, current in page
        if event.kind == "object.changed"
        and (event.payload["metric"], event.payload["hour"]) == ("hr", "2024-03-01T00:00:00Z")
    ]
    assert [event.payload["delivery_id"] for event, _ in first_hour] == [first.id, later.id]
    (older, older_state), (newer, newer_state) = first_hour
    assert older.payload["hash"] != newer.payload["hash"]
    assert older_state == newer_state
    assert newer_state is not None
    assert newer_state.hash.hex() == newer.payload["hash"]

    sizes = [0 if current is None else len(current.body) for _, current in page]
    limited = store.replay_page(0, 256, max_bytes=sizes[0] + sizes[1])
    assert [event.seq for event, _ in limited] == [1, 2]
    assert [event.seq for event, _ in store.replay_page(2, 256, max_bytes=1)] == [3]
    assert [event.seq for event, _ in store.replay_page(3, 256, max_bytes=1)] == [4, 5]
    assert [event.seq for event, _ in store.replay_page(5, 256, max_bytes=1)] == [6]
    assert [event.seq for event, _ in store.replay_page(2, 2, max_bytes=2**30)] == [3, 4]

    with Store(tmp_path / "rebuilt.sqlite"):
        pass
    assert store.swap_in(tmp_path / "rebuilt.sqlite", epoch) == 3
    gone = store.replay_page(0, 256, max_bytes=2**30)
    assert [event.seq for event, _ in gone] == list(range(1, 10))
    assert [current for _, current in gone] == [None] * 9
    assert [event.payload["hash"] for event, _ in gone[6:]] == [None] * 3


TRICKLE_S = 0.05


async def trickle(service: Service) -> tuple[list[dict[str, Any]], int, float]:
    """A subscriber from 0 that reads one small piece every ``TRICKLE_S``, through a tiny
    receive buffer, until the server closes: the frames it got (events, then any error frame),
    the close code, and how long after the last event the close came."""
    ws = WSConnection(ConnectionType.CLIENT)
    sock = trio.socket.socket()
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RECEIVE_BUFFER)
        await sock.connect(("127.0.0.1", service.port))
        tcp = trio.SocketStream(sock)
        request = Request(host="127.0.0.1", target=resource(0), extra_headers=bearer(service.token))
        await tcp.send_all(ws.send(request))
        frames: list[dict[str, Any]] = []
        parts: list[str] = []
        last = trio.current_time()
        while True:
            await trio.sleep(TRICKLE_S)
            data = await tcp.receive_some(TINY_RECEIVE_BUFFER)
            assert data, "the connection ended without a close frame"
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        frames.append(text_frame("".join(parts)))
                        parts.clear()
                        if frames[-1]["type"] == "event":
                            last = trio.current_time()
                elif isinstance(event, CloseConnection):
                    return frames, event.code, trio.current_time() - last


async def test_a_subscriber_reading_too_slowly_is_closed_4408_stream_69(tmp_path: Path) -> None:
    """STREAM-69: a subscriber that keeps reading, but so slowly that one frame takes longer
    than ``stream_send_timeout_s`` to send, is not dropped by the kernel (it takes data all
    the while): once that send is through it gets ``TOO_SLOW`` and close 4408 at once, after
    the events before it in order and no event after."""
    async with serving(tmp_path, stream_send_timeout_s=SEND_TIMEOUT_S) as service:
        total = await fill(service)
        with trio.fail_after(FRAME_LIMIT_S):
            frames, code, after_s = await trickle(service)
    events, error = frames[:-1], frames[-1]
    assert (code, error) == (4408, {"type": "error", "code": "TOO_SLOW"})
    assert consecutive(events, 0)
    assert 0 < len(events) < total
    assert after_s < SEND_TIMEOUT_S
