"""``POST /v1/deliveries`` as a bare ASGI endpoint: the body is encoded while it streams in.

Intake is the service's hot path, so it skips the web framework. The body is never held whole:
the event loop hashes each chunk as it arrives while a worker thread compresses the previous
batch (a bounded hand-over, so a fast client waits on TCP rather than filling memory), and the
journal gets exactly what it stores. The answer comes only with the journal's receipt.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson
import trio

from actors import threads
from actors.runtime import Runtime
from healthlog import documents
from healthlog.config import ServeConfig
from healthlog.content import content_digest
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.journal import (
    BodyEncoder,
    EncodedBody,
    IdempotencyCollision,
    NewDelivery,
    Receipt,
)
from healthlog.timestamps import format_instant
from transport.auth import TokenCache, presented_token
from transport.refusals import RefusalLog, WrongPathLog, client_address

log = logging.getLogger("healthlog.http")

INTAKE_PATH = "/v1/deliveries"
# The methods of intake, for `Allow`.
ALLOW = b"OPTIONS, POST"
RETRY_AFTER_S = b"5"
BATCH_BYTES = 1 << 20
"""Raw bytes handed to the encoding thread at a time: small bodies never leave the event loop."""
MIN_BODY_RATE = 1024
"""Bytes a second a body must come at on average (after ``body_timeout_s``): a client that
sends a byte now and then is cut off, as one that sends nothing is."""

IDENTITY = frozenset({"", "identity"})
"""The ``Content-Encoding`` values of a body sent as it is.

A body with a content coding (gzip, br, ...) is refused with 415 (RFC 9110, 8.4): the journal
keeps the bytes that came and not the coding, so such a body was journaled and answered 200,
and its fold failed as "not a JSON object or array", for good: nothing kept said how to read
it (SERVE-77). Health Auto Export sends its bodies as they are; none is ever inflated here, so
a gzip bomb costs nothing."""
_ENCODED_WHY = "the body has a content coding (Content-Encoding); send it as it is"
MAX_IDEMPOTENCY_KEY = 255
"""Characters of an ``Idempotency-Key`` taken; a longer one is refused with 400.

The key is journaled with the delivery and kept for good, so a key up to the 64 KiB header
limit cost 64 KiB with every delivery (SERVE-102). Clients send UUIDs (36 characters) or
short run names; the IETF draft (draft-ietf-httpapi-idempotency-key-header) sets no limit, and
255 is Stripe's, the one a client written against a common API already keeps to."""
_KEY_TOO_LONG_WHY = f"the Idempotency-Key is longer than {MAX_IDEMPOTENCY_KEY} characters"
_KEY_TOO_LONG = orjson.dumps(
    {"error": "IDEMPOTENCY_KEY_TOO_LONG", "max_characters": MAX_IDEMPOTENCY_KEY}
)

Headers = Sequence[tuple[bytes, bytes]]
CLOSE: Headers = ((b"connection", b"close"),)
_Answer = tuple[int, bytes, Headers]
"""Status, JSON body and extra headers of a response."""


@attrs.frozen
class DeliveryReceipt:
    """The intake answer: where the delivery is in the journal."""

    delivery_id: int
    received_at: str
    sha256: str
    bytes: int


class _Refused(Exception):
    """The body is not taken: answer ``status`` with ``{"error": code}`` and close."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.status = status
        self.code = code


class _Disconnected(Exception):
    """The client went away before its body was complete."""


def _digest(encoded: EncodedBody) -> bytes:
    return content_digest(encoded.raw(), encoded.sha256)


class _Body:
    """The request's body messages, remembering whether there are more to come."""

    def __init__(self, receive: Any, idle_s: float) -> None:
        self._receive = receive
        self._idle_s = idle_s
        self._started = trio.current_time()
        self.received = 0
        """Bytes of the body that came."""
        self.stalled = False
        """The body was cut off because nothing came for ``idle_s`` (not for its slow pace)."""
        self.unread = True
        """No body message has been asked for: a client waiting for ``100 Continue`` has not
        been told to send its body (``transport.serve``)."""
        self.done = False
        """The body ended, the client left, or it stalled: nothing more will be read."""
        self.gone = False
        """The client left: no answer can reach it."""

    async def next(self) -> dict[str, Any]:
        """The next body message; :class:`_Disconnected`, or 408 after ``idle_s`` without one,
        or once the body has taken ``idle_s`` and a second for every ``MIN_BODY_RATE`` bytes
        received: a byte every few seconds never let ``idle_s`` pass without one, and held
        the connection, its task and its descriptor for as long as the client liked
        (SERVE-74)."""
        owed = self._started + self._idle_s + self.received / MIN_BODY_RATE
        idle_until = trio.current_time() + self._idle_s
        self.unread = False
        with trio.move_on_at(min(owed, idle_until)):
            message: dict[str, Any] = await self._receive()
            if message["type"] == "http.disconnect":
                self.done = self.gone = True
                raise _Disconnected
            self.done = not message.get("more_body", False)
            self.received += len(message.get("body", b""))
            return message
        self.done = True
        self.stalled = idle_until <= owed
        raise _Refused(408, "BODY_TIMEOUT")

    async def drain(self, limit: int) -> None:
        """Read and drop what is left of the body, up to ``limit`` bytes, before an answer
        decided early is sent.

        Most clients write the whole body before they read the answer, and hypercorn closes
        the connection as soon as an answer is complete while the body is not: such a client
        would see a broken pipe instead of its 413 or 401. (Answering without reading is worse:
        with the app's queue full of body messages, hypercorn waits forever for room to hand
        it the disconnect, and the connection never closes.) A client that stalls for
        ``idle_s``, or sends more than ``limit`` (the body limit: an endless chunked body, a
        ``Content-Length`` far beyond it), gets the answer then, with the close: it was read
        for as long as it went on sending, a token or not (SERVE-52).
        """
        dropped = 0
        while not self.done and dropped <= limit:
            try:
                message = await self.next()
            except (_Refused, _Disconnected):
                return
            dropped += len(message.get("body", b""))


@attrs.define
class IntakeRefusals:
    """Uploads this process did not journal, by reason, since it started: the counter
    ``healthlog_intake_refused_total`` of ``/metrics`` (SERVE-78). A client that leaves half-way
    or stalls was logged at DEBUG only, and a refusal at INFO a few times a minute in a flood:
    nothing showed how often a phone's uploads failed."""

    unauthorized: int = 0
    """Refused 401: no token, or one that is not a client's."""
    too_large: int = 0
    """Refused 413: over ``max_body_mib``."""
    content_encoding: int = 0
    """Refused 415: a body with a content coding."""
    idempotency_key: int = 0
    """Refused 400: an ``Idempotency-Key`` over ``MAX_IDEMPOTENCY_KEY`` characters."""
    body_timeout: int = 0
    """Refused 408: the body stalled, or came too slowly."""
    memory: int = 0
    """Refused 503: the bodies in flight held ``intake_memory_mib`` (SERVE-145)."""
    client_left: int = 0
    """The client went away before its body was whole."""


class IntakeEndpoint:
    """Authenticates, streams the body into the journal's encoder, submits, answers."""

    def __init__(
        self,
        runtime: Runtime,
        tokens: TokenCache,
        config: ServeConfig,
        refusals: RefusalLog,
        wrong_paths: WrongPathLog,
    ) -> None:
        self._runtime = runtime
        self._tokens = tokens
        self._refusals = refusals
        self._wrong_paths = wrong_paths
        self._limit = config.max_body_bytes
        mib = config.max_body_mib
        # The limit is configuration, not a secret: the client is told it (256, not 256.0).
        whole = mib.is_integer() and mib < 2**53
        self._too_large = orjson.dumps(
            {"error": "BODY_TOO_LARGE", "max_body_mib": int(mib) if whole else mib}
        )
        self._too_large_why = f"the body is over the limit of {mib:g} MiB (max_body_mib)"
        self._idle_s = config.body_timeout_s
        self._memory = config.intake_memory_bytes
        self._memory_why = (
            f"the bodies in flight hold over {config.intake_memory_mib:g} MiB"
            " (intake_memory_mib); it may be sent again later"
        )
        self._holding: dict[BodyEncoder, None] = {}
        """The encoders of the uploads in flight, from their first byte to their journal's
        answer, oldest first."""
        self._in_flight: set[tuple[str, str]] = set()
        self._uploads: set[trio.CancelScope] = set()
        self._uploads_cut = False
        # One body's content digest at a time: it holds the raw body besides the encoded one.
        self._digests = trio.CapacityLimiter(1)
        self.refused = IntakeRefusals()

    async def cut_uploads(self, closing: trio.Event, grace_s: float) -> None:
        """``grace_s`` after ``closing`` is set (shutdown began), refuse the uploads still
        streaming with 503 ``SHUTTING_DOWN``, and any later one: what the journal was handed
        by then is still committed and answered, within hypercorn's longer graceful timeout,
        so that no delivery is journaled without its client hearing of it."""
        await closing.wait()
        await trio.sleep(grace_s)
        self._uploads_cut = True
        for upload in self._uploads:
            upload.cancel()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = _Body(receive, self._idle_s)
        answer = await self._handle(scope, body)
        if answer is None:
            return
        if not (body.unread and _waits_to_continue(scope)):
            await body.drain(self._limit)
        if body.gone:
            log.debug("intake: the client went away before its answer")
            return
        over_http2 = scope.get("http_version") == "2"
        if body.done and not over_http2:
            # Over HTTP/1.1 a disconnect ends the send by itself, and waiting for one once the
            # request is whole kept hypercorn from ever closing the kept-alive connection:
            # nothing is watched, so no nursery (its scopes were a fifth of the cancel scopes
            # every delivery opened on the event loop).
            with trio.move_on_after(self._idle_s):
                await _send_answer(send, *answer)
            return
        async with trio.open_nursery() as nursery:
            if over_http2:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            else:
                # It first runs once the answer's head is with hypercorn (the send below does
                # not yield before that): its receive no longer asks for a waiting body.
                nursery.start_soon(_drop_until_disconnect, receive)
            with trio.move_on_after(self._idle_s):
                await _send_answer(send, *answer)
            nursery.cancel_scope.cancel()

    async def _handle(self, scope: Any, body: _Body) -> _Answer | None:
        """The answer to give, or None when the client left."""
        if scope["method"] == "OPTIONS":
            # As the read routes answer it, without a token: the methods are no secret. It was
            # 405 here and an empty text/html page there (SERVE-94).
            return _answer(204, b"", ((b"allow", ALLOW),))
        if scope["method"] != "POST":
            # Logged as the read routes' 405 is (SERVE-103): a browser opening the URL the app
            # was given left no line above DEBUG (SERVE-106).
            self._wrong_paths(scope["method"], INTAKE_PATH, client_address(scope))
            return _answer(405, _error("METHOD_NOT_ALLOWED"), ((b"allow", ALLOW),))
        headers = _headers(scope["headers"])
        presented = presented_token(headers.get("authorization"), headers.get("api-key"))
        try:
            name = None if presented is None else await self._tokens.authenticate(presented)
        except StorageError:
            return _tokens_unavailable()
        if presented is None or name is None:
            return self._refuse_unauthorized(scope, presented is not None)
        if int(headers.get("content-length") or 0) > self._limit:
            return self._refuse_too_large(scope)
        if _encoded(scope["headers"]):
            self.refused.content_encoding += 1
            self._refusals.refused(415, "POST", INTAKE_PATH, client_address(scope), _ENCODED_WHY)
            return _answer(
                415,
                _error("UNSUPPORTED_CONTENT_ENCODING"),
                ((b"accept-encoding", b"identity"), *CLOSE),
            )
        if self._holding and self.held() > self._memory:
            return self._refuse_busy(scope)
        key = headers.get("idempotency-key") or None
        if key is not None and len(key) > MAX_IDEMPOTENCY_KEY:
            self.refused.idempotency_key += 1
            self._refusals.refused(
                400, "POST", INTAKE_PATH, client_address(scope), _KEY_TOO_LONG_WHY
            )
            return _answer(400, _KEY_TOO_LONG)
        if key is not None:
            if (name, key) in self._in_flight:
                return _answer(409, _error("IDEMPOTENCY_KEY_IN_FLIGHT"))
            self._in_flight.add((name, key))
        try:
            return await self._take(scope, presented, name, key, headers, body)
        finally:
            if key is not None:
                self._in_flight.discard((name, key))

    def _refuse_unauthorized(self, scope: Any, presented: bool) -> _Answer:
        self.refused.unauthorized += 1
        self._refusals.unauthorized("POST", INTAKE_PATH, client_address(scope), presented)
        return _answer(401, _error("UNAUTHORIZED"), ((b"www-authenticate", b"Bearer"),))

    def _refuse_busy(self, scope: Any) -> _Answer:
        self.refused.memory += 1
        self._refusals.refused(503, "POST", INTAKE_PATH, client_address(scope), self._memory_why)
        return _answer(503, _error("INTAKE_BUSY"), ((b"retry-after", RETRY_AFTER_S), *CLOSE))

    def held(self) -> int:
        """Bytes the uploads in flight hold, what ``intake_memory_mib`` bounds: the gauge
        ``healthlog_intake_held_bytes`` of ``/metrics``."""
        return sum(encoder.held for encoder in self._holding)

    def _over_memory(self, encoder: BodyEncoder) -> bool:
        """The upload of ``encoder`` is to be refused for memory: it and the uploads in flight
        begun before it hold more than ``intake_memory_mib``. The newest are refused first, so
        that those begun first finish (refusing whichever upload read next refused all but
        the oldest of eight 60 MiB bodies, where two fit); the oldest is always taken, so that
        one body up to ``max_body_mib`` gets through however low the bound."""
        if encoder is next(iter(self._holding)):
            return False
        held = 0
        for upload in self._holding:
            held += upload.held
            if upload is encoder:
                break
        return held > self._memory

    def _refuse_too_large(self, scope: Any) -> _Answer:
        self.refused.too_large += 1
        self._refusals.refused(413, "POST", INTAKE_PATH, client_address(scope), self._too_large_why)
        return _answer(413, self._too_large, CLOSE)

    async def _take(
        self,
        scope: Any,
        presented: str,
        name: str,
        key: str | None,
        headers: dict[str, str],
        body: _Body,
    ) -> _Answer | None:
        """:meth:`_journal` the upload, its encoder counted among those holding memory until
        the journal has answered: every upload held its whole encoded body until then, and
        nothing bounded how many did (eight incompressible 60 MiB bodies at once took the
        service to 1,030 MiB, SERVE-145)."""
        encoder = self._runtime.journal.encoder()
        self._holding[encoder] = None
        try:
            return await self._journal(scope, presented, name, key, headers, body, encoder)
        finally:
            del self._holding[encoder]

    async def _journal(
        self,
        scope: Any,
        presented: str,
        name: str,
        key: str | None,
        headers: dict[str, str],
        body: _Body,
        encoder: BodyEncoder,
    ) -> _Answer | None:
        try:
            encoded = await self._read_upload(body, encoder)
        except _Refused as refused:
            if refused.status == 413:
                return self._refuse_too_large(scope)
            if refused.status == 503:
                return self._refuse_busy(scope)
            self.refused.body_timeout += 1
            why = _timeout_why(body, headers.get("content-length"), self._idle_s)
            self._refusals.refused(refused.status, "POST", INTAKE_PATH, client_address(scope), why)
            return _answer(refused.status, _error(refused.code), CLOSE)
        except _Disconnected:
            self.refused.client_left += 1
            log.debug("intake: the client went away before its body was complete")
            return None
        if encoded is None:
            body.done = True
            return _answer(503, _error("SHUTTING_DOWN"), ((b"retry-after", RETRY_AFTER_S), *CLOSE))
        # Checked again once the body is whole: a token revoked while it came (a lost phone's,
        # its upload begun before) is refused as at the headers, and nothing is journaled under
        # it (SERVE-89), as its open streams are ended (STREAM-28).
        try:
            still = await self._tokens.authenticate(presented)
        except StorageError:
            return _tokens_unavailable()
        if still != name:
            return self._refuse_unauthorized(scope, True)
        digest = None
        try:
            if key is not None:
                # Here rather than in the journal's thread, which journals every delivery.
                digest = await threads.run_sync(_digest, encoded, limiter=self._digests)
            receipt = await self._runtime.submit(delivery_of(headers, encoded, name, key, digest))
        except IdempotencyCollision:
            return _answer(422, _error("ACTION_ID_COLLISION"))
        except StorageError as exc:
            # No thread to journal in is said once for the process (RUN-71), not per delivery.
            level = logging.DEBUG if isinstance(exc, threads.NoThread) else logging.WARNING
            log.log(level, "intake: journal could not commit: %s", describe(exc))
            return _answer(503, _error("JOURNAL_UNAVAILABLE"), ((b"retry-after", RETRY_AFTER_S),))
        return _answer(200, _receipt(receipt), _replayed(receipt))

    async def _read_upload(self, body: _Body, encoder: BodyEncoder) -> EncodedBody | None:
        """:meth:`_read_body`, or None when the upload is cut at shutdown (:meth:`cut_uploads`)."""
        with trio.CancelScope() as upload:
            if self._uploads_cut:
                upload.cancel()
            self._uploads.add(upload)
            try:
                return await self._read_body(body, encoder)
            finally:
                self._uploads.discard(upload)
        return None

    async def _read_body(self, body: _Body, encoder: BodyEncoder) -> EncodedBody:
        """The whole body, encoded; large bodies are encoded in a thread while they arrive.

        A small body that comes in one message (a small delivery usually does) is encoded at
        once, without the hand-over's nursery and channel. An upload that takes the memory of
        the uploads in flight over ``intake_memory_mib`` is refused (:meth:`_over_memory`).
        """
        message = await body.next()
        chunk: bytes = message.get("body", b"")
        whole = not message.get("more_body", False)
        if whole and len(chunk) < BATCH_BYTES and len(chunk) <= self._limit:
            encoder.feed(chunk)
            if self._over_memory(encoder):
                raise _Refused(503, "INTAKE_BUSY")
            return encoder.finish()
        batches, to_encode = trio.open_memory_channel[list[bytes]](1)
        batch: list[bytes] = []
        batched = received = 0
        threaded = False
        failure: _Refused | _Disconnected | None = None
        async with trio.open_nursery() as nursery, batches:
            more = True
            while more:
                chunk = message.get("body", b"")
                more = bool(message.get("more_body", False))
                received += len(chunk)
                if received > self._limit:
                    failure = _Refused(413, "BODY_TOO_LARGE")
                    break
                if chunk:
                    encoder.hash(chunk)
                    batch.append(chunk)
                    batched += len(chunk)
                    if self._over_memory(encoder):
                        failure = _Refused(503, "INTAKE_BUSY")
                        break
                if batched >= BATCH_BYTES or (threaded and not more):
                    if not threaded:
                        nursery.start_soon(_encode_batches, to_encode, encoder)
                        threaded = True
                    await batches.send(batch)
                    batch, batched = [], 0
                if more:
                    try:
                        message = await body.next()
                    except (_Refused, _Disconnected) as exc:
                        failure = exc
                        break
        # Raised here, not in the nursery, so that it is not wrapped in an exception group.
        if failure is not None:
            raise failure
        if not threaded:
            encoder.encode(batch)
            return encoder.finish()
        return await trio.to_thread.run_sync(encoder.finish)


async def _encode_batches(
    to_encode: trio.MemoryReceiveChannel[list[bytes]], encoder: BodyEncoder
) -> None:
    async with to_encode:
        async for batch in to_encode:
            await trio.to_thread.run_sync(encoder.encode, batch)


def delivery_of(
    headers: Mapping[str, str],
    body: bytes | EncodedBody,
    client: str,
    key: str | None,
    digest: bytes | None = None,
) -> NewDelivery:
    """The delivery an upload is journaled as: its body, the name of the token that sent it,
    its idempotency key and the headers the journal keeps, each as it came."""
    return NewDelivery(
        body=body,
        client=client,
        content_type=headers.get("content-type"),
        idempotency_key=key,
        automation_name=headers.get("automation-name"),
        automation_id=headers.get("automation-id"),
        automation_aggregation=headers.get("automation-aggregation"),
        automation_period=headers.get("automation-period"),
        session_id=headers.get("session-id"),
        content_digest=digest,
    )


def _headers(raw: Headers) -> dict[str, str]:
    """Request headers by lower-case name; the first of repeated ones counts."""
    headers: dict[str, str] = {}
    for name, value in raw:
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


def _encoded(raw: Headers) -> bool:
    """A content coding other than ``identity`` is named, in any ``Content-Encoding`` header
    (the headers of one name are one list, RFC 9110, 5.3: intake's own reading takes the
    first, and a second header naming gzip after one naming identity went through)."""
    return any(
        coding.strip().lower() not in IDENTITY
        for name, value in raw
        if name.lower() == b"content-encoding"
        for coding in value.decode("latin-1").split(",")
    )


def _timeout_why(body: _Body, announced: str | None, idle_s: float) -> str:
    """Why a body was cut off (408), in words, with how much of it came and the setting to
    raise: a phone whose upload a slow link or a long pause cut off left nothing in the log
    (SERVE-135), where a 413 or a 401 says why."""
    came = f"{body.received:,}" + ("" if announced is None else f" of {int(announced):,}")
    if body.stalled:
        return (
            f"the body stalled: nothing came for {idle_s:g} s (body_timeout_s), after {came} bytes"
        )
    return (
        f"the body came slower than {MIN_BODY_RATE // 1024} KiB/s on average after"
        f" body_timeout_s ({idle_s:g} s): {came} bytes"
    )


def _waits_to_continue(scope: Any) -> bool:
    """The request asked for ``Expect: 100-continue``: its client sends the body only when
    told to, and an answer decided from the head alone (401, 413) is sent to it at once, and
    its connection closed, rather than read out of it first, which took the whole body (up to
    ``max_body_mib`` more) over the phone's link for nothing (SERVE-75)."""
    return any(
        name.lower() == b"expect" and value.strip().lower() == b"100-continue"
        for name, value in scope["headers"]
    )


def _tokens_unavailable() -> _Answer:
    """503 with ``Retry-After`` when the token store cannot be read (busy, or failing while
    the token cache reloads): the app sends the delivery again, and nothing is journaled. It
    was 500, logged by hypercorn at ERROR with its traceback (SERVE-96); the token cache logs
    the failure, once while it lasts (SERVE-100)."""
    return _answer(503, _error("TOKENS_UNAVAILABLE"), ((b"retry-after", RETRY_AFTER_S),))


def _error(code: str) -> bytes:
    return orjson.dumps({"error": code})


def _receipt(receipt: Receipt) -> bytes:
    return documents.dumps(
        DeliveryReceipt(
            receipt.delivery_id,
            format_instant(receipt.received_at),
            receipt.sha256,
            receipt.bytes,
        )
    )


def _replayed(receipt: Receipt) -> Headers:
    return ((b"idempotent-replayed", b"true"),) if receipt.replayed else ()


async def _drop_until_disconnect(receive: Any) -> None:
    """Read and drop the request's messages until the disconnect, while an answer given
    before the body's end (HTTP/1.1) goes out.

    That answer ends the connection, and hypercorn hands the app the disconnect from within
    the answer's last send, into the app's queue: with the queue full of the body's messages
    that the drain left, that send waited for good, and the connection stayed open (the
    client gone, the socket in CLOSE_WAIT) until the service stopped (SERVE-58)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(receive: Any, scope: trio.CancelScope) -> None:
    """Cancel the answer once the stream ends: the body is all read, so the next message is
    the disconnect. Over HTTP/2, hypercorn stops sending when the connection closes, and an
    answer sent after that would wait forever, holding its connection open. hypercorn also
    hands the disconnect, from within the answer's last send, once the answer is whole; the
    cancel then ends nothing but that send (SERVE-47)."""
    await _drop_until_disconnect(receive)
    log.debug("intake: the stream ended (the answer is whole, or the client went away)")
    scope.cancel()


async def _send_answer(send: Any, status: int, content: bytes, headers: Headers) -> None:
    # A 204 has no content, so neither its type nor its length (RFC 9110, 8.3 and 8.6).
    framing = (
        []
        if status == 204
        else [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    )
    try:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*framing, *headers],
            }
        )
        await send({"type": "http.response.body", "body": content})
    except trio.BusyResourceError:
        # hypercorn's trio server half-closes a connection whose client went away without
        # taking its send lock, so an answer sent at that moment collides with it.
        log.debug("intake: the client went away before its answer")


def _answer(status: int, body: bytes, headers: Headers = ()) -> _Answer:
    return status, body, headers
