"""``WS /v1/stream``: replay from a cursor, then live, at least once (R2 to R6).

It is served as a plain ASGI websocket endpoint beside the quart-trio app, on the same
hypercorn listener: quart-trio cancels a websocket handler as soon as the client's close
arrives, dropping messages still queued before it (such as a final ACK). Here every frame
is handled in order, the close last.

The sender never keeps more than one page of events per subscriber: it reads the events
after its cursor from the store, with the current objects they name, in one query, sends
them, and when it has caught up waits for the head to move. Replay and live are the same
loop, so there is no switch-over to lose an event in. A subscriber that stops reading is cut
off once a send stalls past ``send_timeout_s``, and resumes from its acknowledged cursor. A send
still waiting inside hypercorn then (for its send lock) is given up and the subscriber closed
with 4408. A send waiting on the socket itself cannot be interrupted: hypercorn's trio server
shields its socket writes. There the kernel ends it: every accepted socket has
``TCP_USER_TIMEOUT`` set to the same time (``transport/serve.py``), so a peer that has taken
nothing for that long is dropped, the write fails, and the handler ends as for a client gone.

At most ``stream_max_subscribers`` connections are served at a time: each held one page of
events with its objects (up to ``PAGE_BYTES``) and hypercorn's buffers for as long as it stalled,
and a token holder could open hundreds. One over the limit is refused before the upgrade, with
an HTTP 503 ``{"error": "TOO_MANY_SUBSCRIBERS"}`` and ``Retry-After``, having read nothing of the
store; its slot is given back however a connection ends (its close, a cut-off, a cancellation).
The token is decided before the limit: a client whose token is not live is refused 4401 whether
or not a slot is free, never told to come back later. While ``serve`` journals beside a store it
found unfit (STORE-142), a live token is refused before the upgrade too, with the 503 the routes
that read the store answer (SERVE-150), holding no slot (STREAM-205).

The token is checked at the handshake, again before each page is sent and before an ACK is
stored, and every ``IDLE_RECHECK_S`` while the stream waits for events (cheap: the token cache
answers without a thread between its reloads), so a token revoked while its stream is open,
busy or idle, ends the stream with the same refusal as at the handshake once the cache has
reloaded.

Store reads: a busy store (:class:`Deferred`) is a normal condition; a read that finds it busy is
tried again, the connection going on meanwhile. Another storage error (a read's or an ACK's) ends
that subscription only: close 1011 without an error frame, which the reference follower takes for
a lost connection and reconnects after its backoff, from its cursor; one WARNING names the
error's type. The event hub runs under the runtime's supervision (``app.py``).

A subscriber may resume with ``tag``, the tag of the event at its cursor as its frame carried
it: where this store's event at that seq has another (the store restored from a backup, or a
copy of the data directory, went on with other changes under the same numbers), the cursor is
not one of this history, and the subscriber is refused as one older than the window, its error
frame saying ``diverged`` (STREAM-111); where it is the same, the replay starts with the event at
the cursor, sent again, so that a subscriber at the head learns that its cursor holds too. An
event at the cursor that is no longer held is checked against the tag the store kept of the last
event it pruned, when the cursor is that one's (the window's start, STREAM-123), and the replay
goes on after it; a cursor further back is older than the window. Without ``tag`` nothing
changes.

Close codes: 4400 bad request (cursor, subscriber name, a repeated query parameter, frame, ACK
beyond what was sent),
4401 unauthorized (at the handshake or once the token is revoked), 4408 too slow, 4410 cursor
older than the online window or, ``diverged``, not of this history (after an error frame with a
signed snapshot reference), 1001
server going away (on shutdown), 1011 the store cannot be read or no snapshot built (no error
frame; for the snapshot, the reason says when to come back), 1009 (by
hypercorn, no error frame) a message from the subscriber over ``MAX_CLIENT_MESSAGE_BYTES``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import orjson
import trio

from actors.runtime import Runtime
from healthlog import faults
from healthlog.documents import AckFrame, ErrorFrame, EventFrame, Manifest, converter, dumps
from healthlog.objects import HourlyObject, to_wire
from healthlog.storage._sqlite import Deferred, StorageError, describe
from healthlog.storage.store import Event, Store
from transport.auth import presented_token
from transport.refusals import STORE_UNFIT_ANSWERS, FaultLog, RefusalLog, client_address

log = logging.getLogger("healthlog.stream")

T = TypeVar("T")

STREAM_PATH = "/v1/stream"

PAGE = 256
PAGE_BYTES = 4 * 2**20
MAX_SUBSCRIBER = 128
# An event's tag as a subscriber may send it back: the store writes 16 hex digits.
MAX_TAG = 64
MAX_CLIENT_MESSAGE_BYTES = 64 * 1024
"""The largest message a subscriber may send (an ACK takes some 30 bytes); a longer one is
closed with 1009 before it is whole. hypercorn's default, 16 MiB, let every subscriber with a
token have the service hold 16 MiB per connection (STREAM-93)."""
CLOSE_BAD_REQUEST = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_TOO_SLOW = 4408
CLOSE_CURSOR_TOO_OLD = 4410
CLOSE_GOING_AWAY = 1001
# RFC 6455's "internal error": the server cannot go on with this connection. Sent without an
# error frame, as 1001 is: a subscriber reconnects after a close without one (an error frame of
# a code it does not know would stop the reference follower for good).
CLOSE_STORE_ERROR = 1011
# The query parameters the stream reads; one of them given twice is refused (STREAM-127).
PARAMETERS = ("after", "subscriber", "tag", "token")
# The name the event hub is supervised (and its crashes counted) under.
HUB_ACTOR = "event-hub"
# How often a stream waiting for events checks that its token is still live: the token
# cache's reload period, so a revocation ends an idle stream within about twice that.
IDLE_RECHECK_S = 2.0
# How long an ACK or a read of the store waits before it is tried again when the store was busy,
# and how long it waits in all before a WARNING says so (a long fold holds the store for a while).
BUSY_RETRY_S = 1.0
BUSY_WARN_S = 5.0
# The refusal of a subscriber over ``stream_max_subscribers``, before the upgrade: a slot frees
# when a subscriber leaves, a stalled one within ``stream_send_timeout_s`` (30 s by default).
TOO_MANY_SUBSCRIBERS = "TOO_MANY_SUBSCRIBERS"
RETRY_AFTER_S = 30
# When to come back after no snapshot could be built (a full disk): ``Retry-After`` of
# ``GET /v1/snapshots``' 503, and the ``retry-after`` parameter of the stream's close reason.
SNAPSHOT_RETRY_AFTER_S = 60
# What a send of a refusal meets when the client closed its side meanwhile: hypercorn's own
# task answering that close on the same socket (busy), or a connection already gone.
CLIENT_CLOSING = (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError)


class EventHub:
    """Follows the store's head sequence and wakes every subscriber waiting past it.

    It reads the head only while some subscriber waits for events: with none (no follower
    connected, or every one busy sending), an idle service does no read at all, where a poll
    every ``poll_s`` kept a core about 2 % busy for nothing (STREAM-80).
    """

    def __init__(self, runtime: Runtime, poll_s: float = 0.1) -> None:
        self._runtime = runtime
        self._poll_s = poll_s
        self.head = 0
        self._moved = trio.Event()
        self._waiting = 0
        self._wanted = trio.Event()

    async def run(self) -> None:
        """Read the head every ``poll_s`` while a subscriber waits, for the life of the service.

        A read that fails is tried again at the next poll: a busy store (:class:`Deferred`)
        is a normal condition, logged at DEBUG only; another storage error is a WARNING naming
        its type, once until a read succeeds again (then an INFO says so), not at every poll.
        Any other exception ends the run: the service runs it under the runtime's supervision
        (``Runtime.supervise``), which logs, counts and restarts it.
        """
        failing = False
        while True:
            if not self._waiting:
                await self._wanted.wait()
            try:
                faults.point("stream.head")
                _, head = await self._runtime.read_store(Store.event_window)
            except Deferred:
                log.debug("stream: the store is busy; the event hub reads its head again")
            except StorageError as exc:
                if not failing:
                    log.warning(
                        "stream: the event hub cannot read the store's head (%s); it retries",
                        type(exc).__name__,
                    )
                    failing = True
            else:
                if failing:
                    log.info("stream: the event hub reads the store's head again")
                    failing = False
                if head > self.head:
                    self.head = head
                    self._moved.set()
                    self._moved = trio.Event()
            await trio.sleep(self._poll_s)

    async def wait_beyond(self, seq: int) -> None:
        self._waiting += 1
        self._wanted.set()
        try:
            while self.head <= seq:
                await self._moved.wait()
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._wanted = trio.Event()


def snapshot_failure(exc: OSError | StorageError) -> str:
    """Why a snapshot could not be built, for a log line: an OSError's type and errno name
    (``OSError: ENOSPC``), a storage error as :func:`describe` gives it; never a path."""
    if isinstance(exc, OSError):
        name = "no errno" if exc.errno is None else errno.errorcode.get(exc.errno, str(exc.errno))
        return f"{type(exc).__name__}: {name}"
    return describe(exc)


@attrs.define
class HandshakeRefusals:
    """Connections this process refused at the handshake, by reason, since it started: the
    counter ``healthlog_stream_refused_total`` of ``/metrics`` (SERVE-65)."""

    too_many_subscribers: int = 0
    """Refused 503 ``TOO_MANY_SUBSCRIBERS``: ``stream_max_subscribers`` were served."""
    unauthorized: int = 0
    """Refused 4401 ``UNAUTHORIZED``: no token, or one that is not live."""
    repeated_parameter: int = 0
    """Refused 4400 ``REPEATED_PARAMETER``: ``after``, ``subscriber``, ``tag`` or ``token``
    given twice (STREAM-127); a repeated ``token`` is checked before any token, so it counted
    under no reason (STREAM-128)."""


class StreamRefused(Exception):
    """A reason to end a subscription with an error frame (unless ``frame`` is False) and a
    close code; ``head``, ``sent``, ``snapshot``, ``diverged`` and ``parameter`` are the
    error frame's fields. The close reason is ``code``, with ``; retry-after=N`` after it when
    ``retry_after_s`` says when to come back (the seconds of an HTTP ``Retry-After``)."""

    def __init__(
        self,
        code: str,
        close: int,
        *,
        head: int | None = None,
        sent: int | None = None,
        snapshot: Manifest | None = None,
        diverged: bool | None = None,
        parameter: str | None = None,
        frame: bool = True,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(code)
        self.code = code
        self.close = close
        self.error = ErrorFrame(
            code, head=head, sent=sent, snapshot=snapshot, diverged=diverged, parameter=parameter
        )
        self.frame = frame
        self.reason = code if retry_after_s is None else f"{code}; retry-after={retry_after_s}"


class ClientGone(Exception):
    """The client closed the connection."""


@attrs.define
class _Subscription:
    token: str = attrs.field(repr=False)
    name: str | None
    cursor: int
    sent: int
    acked: int = 0


SnapshotFor = Callable[[int], Awaitable[Manifest]]
Authenticate = Callable[[str], Awaitable[str | None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@attrs.frozen
class StreamEndpoint:
    """The ASGI websocket endpoint of the replay stream."""

    runtime: Runtime
    hub: EventHub
    authenticate: Authenticate
    snapshot_for: SnapshotFor
    send_timeout_s: float
    closing: trio.Event
    refusals: RefusalLog
    slots: trio.CapacityLimiter
    """One token for each subscriber served (``stream_max_subscribers`` in all)."""
    refused: HandshakeRefusals
    idle_recheck_s: float = IDLE_RECHECK_S
    failed_handshakes: FaultLog = attrs.field(factory=lambda: FaultLog(log, logging.INFO))
    """A peer fails a handshake at will (bytes after its upgrade request): a few lines a minute
    in a flood (SERVE-61)."""

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """Serve one subscription, if its token is live and a slot is free; whatever ends it,
        the handler ends (no stuck connection) and gives its slot back.

        The token is decided first: a client whose token is not valid is refused with 4401
        (for good), never with the 503 that tells it to come back (STREAM-106). That refusal
        holds no slot: it reads nothing of the store and ends within two sends.

        A parameter the stream reads given twice is refused ``REPEATED_PARAMETER`` (4400),
        holding no slot either: the stream took the last of them and the HTTP routes the
        first, so ``after=5&after=0`` replayed from 0 here (STREAM-127). A repeated ``token``
        names no one token to check, and is refused so before any is."""
        if (await receive())["type"] != "websocket.connect":
            return
        values = urllib.parse.parse_qs(scope["query_string"].decode(), keep_blank_values=True)
        query = {name: given[0] for name, given in values.items()}
        repeated = next((name for name in PARAMETERS if len(values.get(name, ())) > 1), None)
        if repeated == "token":
            self.refused.repeated_parameter += 1
            await self._serve(scope, receive, send, query, _repeated(repeated))
            return
        try:
            token = await self._authenticate(scope, query)
        except StorageError:
            # Ended as a subscription whose store failed, which `follow` retries; it escaped
            # the endpoint: an HTTP 500 and hypercorn's traceback at ERROR (SERVE-98). The
            # token cache logs the failure, once while it lasts (SERVE-100).
            store_error = StreamRefused("STORE_ERROR", CLOSE_STORE_ERROR, frame=False)
            await self._serve(scope, receive, send, query, store_error)
            return
        if token is None:
            self.refused.unauthorized += 1
            unauthorized = StreamRefused("UNAUTHORIZED", CLOSE_UNAUTHORIZED)
            await self._serve(scope, receive, send, query, unauthorized)
            return
        if repeated is not None:
            self.refused.repeated_parameter += 1
            await self._serve(scope, receive, send, query, _repeated(repeated))
            return
        unfit = self.runtime.store_unfit()
        if unfit is not None:
            await self._store_unfit(scope, send, unfit)
            return
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            self.refused.too_many_subscribers += 1
            await self._too_many(scope, send)
            return
        try:
            await self._serve(scope, receive, send, query, token)
        finally:
            self.slots.release()

    async def _too_many(self, scope: dict[str, Any], send: Send) -> None:
        """Refuse the upgrade with 503 ``TOO_MANY_SUBSCRIBERS`` and ``Retry-After``."""
        await self._refuse_upgrade(
            scope,
            send,
            f"{self.slots.total_tokens} stream subscribers are served, as many as"
            " stream_max_subscribers allows",
            {"error": TOO_MANY_SUBSCRIBERS},
            ((b"retry-after", str(RETRY_AFTER_S).encode()),),
        )

    async def _store_unfit(self, scope: dict[str, Any], send: Send, unfit: str) -> None:
        """Refuse the upgrade with the 503 the routes that read the store answer while it is
        found unfit (SERVE-150), without ``Retry-After``: it lasts until ``serve`` is started
        again with the store moved away (STREAM-205). Each connection was accepted, then closed
        1011 with a WARNING, which the follower took for a lost connection."""
        code, message = STORE_UNFIT_ANSWERS[unfit]
        await self._refuse_upgrade(
            scope,
            send,
            f"the store was found unfit ({code}): nothing is read from it until serve is started"
            " again with it moved away",
            {"error": code, "message": message},
        )

    async def _refuse_upgrade(
        self,
        scope: dict[str, Any],
        send: Send,
        why: str,
        document: dict[str, str],
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """Refuse the upgrade with 503 and ``document``, as a refusal is logged (``why``);
        within ``send_timeout_s``, and nothing if the client has gone meanwhile."""
        self.refusals.refused(503, "GET", STREAM_PATH, client_address(scope), why)
        body = orjson.dumps(document)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *extra,
            (b"connection", b"close"),
        ]
        with trio.move_on_after(self.send_timeout_s), contextlib.suppress(*CLIENT_CLOSING):
            await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})

    async def _serve(
        self,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
        query: dict[str, str],
        opening: str | StreamRefused,
    ) -> None:
        """Accept the connection and serve it with the token ``opening``, or refuse it with
        ``opening``, the refusal decided at the handshake."""
        try:
            await send({"type": "websocket.accept"})
        except Exception as exc:
            # The handshake cannot be answered: bytes after the upgrade request, say. The
            # peer's doing.
            self.failed_handshakes("stream: the websocket handshake failed: %s", type(exc).__name__)
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1008})
            return
        refused: StreamRefused | None = None
        try:
            async with trio.open_nursery() as nursery:
                # First, so that a shutdown also ends a subscription still opening (its reads
                # wait while the store is busy).
                nursery.start_soon(self._going_away)
                if isinstance(opening, StreamRefused):
                    raise opening
                sub = await self._open(query, opening)
                nursery.start_soon(self._send_loop, sub, send)
                await self._receive_loop(sub, receive)
                nursery.cancel_scope.cancel()
        except* ClientGone:
            pass
        except* StreamRefused as group:
            first = group.exceptions[0]
            assert isinstance(first, StreamRefused)
            refused = first
        except* StorageError as group:
            # A read or an ACK that the store failed (a busy store is waited out before): this
            # subscription ends, the service and the other subscriptions go on.
            log.warning(
                "stream: the store failed (%s); a subscription is closed (%d) and may reconnect",
                _kinds(group),
                CLOSE_STORE_ERROR,
            )
            log.debug("stream: storage error", exc_info=True)
            if refused is None:
                refused = StreamRefused("STORE_ERROR", CLOSE_STORE_ERROR, frame=False)
        if refused is None:
            return
        try:
            if refused.frame:
                with trio.move_on_after(self.send_timeout_s):
                    await send({"type": "websocket.send", "text": dumps(refused.error).decode()})
            with trio.move_on_after(self.send_timeout_s):
                await send(
                    {"type": "websocket.close", "code": refused.close, "reason": refused.reason}
                )
        except CLIENT_CLOSING as exc:
            # The client closed as the refusal went out (on its error frame, say): hypercorn
            # answers that close itself. Left to hypercorn, the error was logged at ERROR.
            log.debug(
                "stream: %s not sent, the client closed: %s", refused.code, type(exc).__name__
            )

    async def _read(
        self,
        fn: Callable[[Store], T],
        *,
        waiting: str = "a subscriber waits",
        shield: bool = False,
    ) -> T:
        """``fn(store)`` in the store's worker thread, tried again every ``BUSY_RETRY_S`` while
        the store is busy (:class:`Deferred`: another connection holds a lock for long), with one
        WARNING (``waiting`` until it is free) once it has waited ``BUSY_WARN_S`` in all; with
        ``shield`` a call under way is not cancelled (the waits between are). Another
        :class:`StorageError` is raised: ``__call__`` ends the subscription with close 1011."""
        since = trio.current_time()
        warned = False
        while True:
            try:
                with trio.CancelScope(shield=shield):
                    return await self.runtime.read_store(fn)
            except Deferred:
                if not warned and trio.current_time() - since >= BUSY_WARN_S:
                    log.warning("stream: the store is busy; %s until it is free", waiting)
                    warned = True
                else:
                    log.debug("stream: the store is busy; a subscriber's read is tried again")
            await trio.sleep(BUSY_RETRY_S)

    async def _going_away(self) -> None:
        await self.closing.wait()
        raise StreamRefused("GOING_AWAY", CLOSE_GOING_AWAY, frame=False)

    async def _authenticate(self, scope: dict[str, Any], query: dict[str, str]) -> str | None:
        """The presented token if it is live, else None, the refusal logged as the HTTP
        routes' are (never the token)."""
        # The first of repeated headers counts, as for the HTTP routes: the last did here, and
        # a request that intake took was refused 4401, or one it refused served (SERVE-83).
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin1").lower(), value.decode("latin1"))
        presented = presented_token(
            headers.get("authorization"), headers.get("api-key")
        ) or query.get("token")
        if presented and await self.authenticate(presented) is not None:
            return presented
        self.refusals.unauthorized(
            "GET", STREAM_PATH, client_address(scope), bool(presented), status=CLOSE_UNAUTHORIZED
        )
        return None

    async def _still_authorized(self, token: str) -> None:
        """Refuse the connection unless ``token`` is live (it may be revoked at any time)."""
        if await self.authenticate(token) is None:
            raise StreamRefused("UNAUTHORIZED", CLOSE_UNAUTHORIZED)

    async def _open(self, query: dict[str, str], token: str) -> _Subscription:
        name = query.get("subscriber")
        if name is not None and not (0 < len(name) <= MAX_SUBSCRIBER and name.isprintable()):
            raise StreamRefused("BAD_SUBSCRIBER", CLOSE_BAD_REQUEST)
        raw_after = query.get("after", "0")
        if not raw_after.isascii() or not raw_after.isdigit() or len(raw_after) > 18:
            raise StreamRefused("BAD_CURSOR", CLOSE_BAD_REQUEST)
        after = int(raw_after)
        tag = query.get("tag")
        if tag is not None and not (0 < len(tag) <= MAX_TAG and tag.isascii() and tag.isalnum()):
            raise StreamRefused("BAD_CURSOR", CLOSE_BAD_REQUEST)
        window_start, head = await self._read(Store.event_window)
        if after > head:
            raise StreamRefused("CURSOR_IN_FUTURE", CLOSE_BAD_REQUEST, head=head)
        if after < window_start:
            await self._too_old(after)
        start = after
        if tag is not None and after > 0:
            held, known, ours = await self._read(functools.partial(Store.event_tag, seq=after))
            if known and ours != tag:
                log.info(
                    "stream: a subscriber's cursor (seq %d) is not in this stream's history (its"
                    " event there is another); it is sent the snapshot",
                    after,
                )
                await self._too_old(after, diverged=True)
            if held:
                # The event at the cursor is sent again, its tag the one the subscriber holds:
                # the proof that its cursor is of this history, also at the head.
                start = after - 1
        return _Subscription(token, name, start, after)

    async def _too_old(self, after: int, *, diverged: bool | None = None) -> None:
        """CURSOR_TOO_OLD with a snapshot (``diverged``: the cursor is not of this history); a
        snapshot that cannot be built (a full disk) closes with 1011 and no frame (an error frame
        of a code it does not know would stop an older ``follow`` for good), the reason saying
        when to try again, as ``GET /v1/snapshots``' ``Retry-After`` does:
        ``SNAPSHOT_UNAVAILABLE; retry-after=60``."""
        try:
            manifest = await self.snapshot_for(after)
        except (OSError, StorageError) as exc:
            log.warning("stream: no snapshot for a cursor too old: %s", snapshot_failure(exc))
            raise StreamRefused(
                "SNAPSHOT_UNAVAILABLE",
                CLOSE_STORE_ERROR,
                frame=False,
                retry_after_s=SNAPSHOT_RETRY_AFTER_S,
            ) from None
        raise StreamRefused(
            "CURSOR_TOO_OLD", CLOSE_CURSOR_TOO_OLD, snapshot=manifest, diverged=diverged
        )

    async def _send_loop(self, sub: _Subscription, send: Send) -> None:
        stream = await self._read(Store.stream_id)
        while True:
            page = await self._read(functools.partial(_page, after=sub.cursor))
            if not page:
                with trio.move_on_after(self.idle_recheck_s) as idle:
                    await self.hub.wait_beyond(sub.cursor)
                if idle.cancelled_caught:
                    await self._still_authorized(sub.token)
                continue
            await self._still_authorized(sub.token)
            # One timer for the page, its deadline moved before each send: cheaper than a
            # cancel scope per frame, and still a limit on each send alone.
            with trio.CancelScope() as timer:
                for event, current in page:
                    if event.seq != sub.cursor + 1:
                        break
                    frame = _frame(stream, event, current)
                    timer.deadline = trio.current_time() + self.send_timeout_s
                    faults.point("stream.send")
                    await send({"type": "websocket.send", "text": frame})
                    sub.cursor = sub.sent = event.seq
            if timer.cancelled_caught:
                raise StreamRefused("TOO_SLOW", CLOSE_TOO_SLOW)
            if sub.cursor != page[-1][0].seq:
                # The event after the cursor is gone (pruned under this replay): never skip it.
                await self._too_old(sub.cursor)

    async def _receive_loop(self, sub: _Subscription, receive: Receive) -> None:
        while True:
            event = await receive()
            if event["type"] == "websocket.disconnect":
                raise ClientGone
            if event.get("text") is None:
                raise StreamRefused("BINARY_FRAME", CLOSE_BAD_REQUEST)
            await self._ack(sub, event["text"])

    async def _ack(self, sub: _Subscription, message: str) -> None:
        try:
            seq = _structure_ack(orjson.loads(message), AckFrame).seq
        except ValueError:  # orjson.JSONDecodeError is one
            raise StreamRefused("BAD_FRAME", CLOSE_BAD_REQUEST) from None
        if seq > sub.sent:
            raise StreamRefused("ACK_BEYOND_SENT", CLOSE_BAD_REQUEST, sent=sub.sent)
        if sub.name is not None and seq > sub.acked:
            await self._still_authorized(sub.token)
            # Another connection may hold the store's write lock (a fold, a reindex's swap): a
            # normal condition. The ACK is stored once the lock is free.
            sub.acked = await self._read(
                functools.partial(_store_ack, subscriber=sub.name, seq=seq),
                waiting="an ACK waits",
                shield=True,
            )


def _repeated(parameter: str) -> StreamRefused:
    return StreamRefused("REPEATED_PARAMETER", CLOSE_BAD_REQUEST, parameter=parameter)


def _kinds(exc: BaseException) -> str:
    """The type names of an exception, or of those in a group however deeply nested."""
    if not isinstance(exc, BaseExceptionGroup):
        return type(exc).__name__
    return ", ".join(sorted({_kinds(inner) for inner in exc.exceptions}))


def _store_ack(store: Store, subscriber: str, seq: int) -> int:
    """Store a subscriber's ACK, in the store's worker thread; the stored cursor."""
    faults.point("stream.ack")
    return store.ack(subscriber, seq)


def _page(store: Store, after: int) -> list[tuple[Event, HourlyObject | None]]:
    """The next page of events after ``after``, read in the store's worker thread."""
    faults.point("stream.page")
    return store.replay_page(after=after, limit=PAGE, max_bytes=PAGE_BYTES)


# The documents' hooks, looked up once: a replay builds a frame for every event.
_structure_ack = converter.get_structure_hook(AckFrame)
_unstructure_event = converter.get_unstructure_hook(EventFrame)


def _frame(stream: str, event: Event, current: HourlyObject | None) -> str:
    state = None if current is None else to_wire(current)
    frame = EventFrame(
        event.seq, f"{stream}:{event.seq}", event.kind, event.payload, state, event.tag
    )
    return orjson.dumps(_unstructure_event(frame)).decode()
