"""The ASGI application: intake (``transport.intake``), the replay stream, and the quart-trio
app for status, the read API, health, readiness and metrics.

Only HTTP lives here: every decision is made by the runtime and the storage behind it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Any

import attrs
import orjson
import trio
from quart import Response, has_request_context, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import InternalServerError, MethodNotAllowed, NotFound
from werkzeug.routing import WebsocketMismatch

from actors.runtime import Runtime
from healthlog import documents, layers
from healthlog.config import ServeConfig
from healthlog.export import FORMATS, header, object_lines
from healthlog.objects import HourlyObject, ObjectCorrupt
from healthlog.storage._sqlite import StorageError
from healthlog.storage.status import collect_status
from healthlog.storage.store import OBJECTS_PAGE, Store
from healthlog.timestamps import (
    TIMESTAMP_EXAMPLE,
    TimestampError,
    format_instant,
    hour_of,
    parse_instant,
)
from transport.auth import TokenCache, presented_token
from transport.intake import INTAKE_PATH, RETRY_AFTER_S, IntakeEndpoint
from transport.metrics import render_metrics
from transport.refusals import STORE_UNFIT_ANSWERS, RefusalLog, WrongPathLog
from transport.snapshots import SnapshotService
from transport.stream import (
    HUB_ACTOR,
    SNAPSHOT_RETRY_AFTER_S,
    STREAM_PATH,
    EventHub,
    HandshakeRefusals,
    StreamEndpoint,
    snapshot_failure,
)

# The media types of `/v1/points`, naming the charset of its lines: without one a client may
# decode `text/csv` as ISO-8859-1 (Python's requests does, as RFC 2616 had it) and read the
# curly apostrophe (U+2019) of a source such as "Anna's Apple Watch" as three other characters
# (SERVE-81).
POINTS_TYPES = {
    "jsonl": "application/x-ndjson; charset=utf-8",
    "csv": "text/csv; charset=utf-8",
}
MAX_HEADER_BYTES = 64 * 1024
# The query parameters of `/v1/points`; one of them given twice is refused (SERVE-93).
POINTS_PARAMETERS = ("metric", "layer", "from", "to", "format")
_SLASHES = re.compile("/{2,}")
# The space a query string's unencoded `+` becomes, where only a UTC offset's sign can stand:
# before its HH:MM (or HHMM) at the end of a timestamp (SERVE-92).
_SPACE_FOR_PLUS = re.compile(r" (?=[0-9]{2}:?[0-9]{2}\Z)")
# How many bytes of lines `/v1/points` gathers into one chunk of its body (at least a line).
POINTS_CHUNK_BYTES = 64 * 1024
SQLITE_MAX_INTEGER = 2**63 - 1
RESPONSE_TIMEOUT_S = 60.0
# As intake's: the token store is busy for moments (a token added or revoked).
TOKENS_RETRY_AFTER_S = RETRY_AFTER_S.decode()

log = logging.getLogger("healthlog.http")


def _json(document: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = documents.dumps(document) if attrs.has(type(document)) else orjson.dumps(document)
    return Response(body, status=status, content_type="application/json", headers=headers)


def _error(code: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return _json({"error": code}, status, headers)


def _bad_parameter(code: str, parameter: str, accepted: str) -> Response:
    """400 naming the query parameter and what it accepts, never echoing what was sent."""
    return _json({"error": code, "parameter": parameter, "accepted": accepted}, 400)


def _streamed(response: Response) -> Response:
    """``response`` sent however long its reader takes: quart-trio otherwise cancels sending a
    body after ``RESPONSE_TIMEOUT`` and the reader gets it cut short, without its end. A reader
    that stops taking data is dropped by the kernel after ``stream_send_timeout_s``
    (``transport.serve``)."""
    response.timeout = None
    return response


class _Damaged(Exception):
    """`/v1/points` reached an object whose body does not decode (``cause``, naming it);
    ``gathered`` holds the lines of the objects before it not sent yet."""

    def __init__(self, cause: ObjectCorrupt, gathered: bytes) -> None:
        super().__init__(str(cause))
        self.gathered = gathered


class _PointsCut(Exception):
    """A `/v1/points` answer under way ended at a damaged object, its cause logged: the
    connection closes without the body's last chunk, so that no client takes what it received
    for the whole answer (as a plain end would let it)."""


class _TokensUnavailable(Exception):
    """The token store could not be read to check a request's token: 503 with
    ``Retry-After``, as intake answers it; it was 500 ``INTERNAL`` and an ERROR (SERVE-98).
    The token cache logs the failure (once while it lasts, SERVE-100)."""


class _Http(QuartTrio):
    """The quart-trio app, logging an unhandled exception as one line naming its type only: its
    message and traceback may hold values."""

    def log_exception(
        self,
        exception_info: tuple[type, BaseException, TracebackType] | tuple[None, None, None],
    ) -> None:
        kind = exception_info[0]
        name = "exception" if kind is None else kind.__name__
        if has_request_context() and request.url_rule is not None:
            log.error("unhandled %s in %s %s", name, request.method, request.url_rule.rule)
        else:
            log.error("unhandled %s", name)

    async def make_default_options_response(self) -> Response:
        """OPTIONS on a route: 204 with ``Allow`` and neither body nor ``Content-Type``, as
        intake answers it; quart's own answer was an empty ``text/html`` page (SERVE-94)."""
        response = await super().make_default_options_response()
        allowed = sorted(response.headers["Allow"].split(", "))
        answer = Response(b"", status=204, headers={"Allow": ", ".join(allowed)})
        # RFC 9110 (8.3, 8.6): a 204 has no content, so neither its type nor its length.
        answer.headers.remove("Content-Type")
        answer.headers.remove("Content-Length")
        return answer


class HealthlogApp:
    """The ASGI application: intake and the replay stream endpoint beside the quart-trio app.

    ``finish_limit_s`` bounds the send that ends a response (see :func:`_finishing`).
    """

    def __init__(
        self,
        http: QuartTrio,
        intake: IntakeEndpoint,
        stream: StreamEndpoint,
        finish_limit_s: float,
    ) -> None:
        self.http = http
        self.intake = intake
        self.stream = stream
        self.finish_limit_s = finish_limit_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = _route_path(scope)
        if scope["type"] in ("http", "websocket") and _header_bytes(scope) > MAX_HEADER_BYTES:
            await _refuse(scope, send, 431, "HEADERS_TOO_LARGE")
        elif scope["type"] in ("http", "websocket") and not _utf8(scope["query_string"]):
            # Over HTTP/2 a query string may hold any byte; quart would fail decoding it.
            await _refuse(scope, send, 400, "BAD_QUERY")
        elif scope["type"] == "http" and scope["path"] == INTAKE_PATH:
            await self.intake(scope, receive, send)
        elif scope["type"] == "websocket" and scope["path"] == STREAM_PATH:
            await self.stream(scope, receive, send)
        elif scope["type"] == "http":
            try:
                await self.http(scope, receive, _finishing(send, self.finish_limit_s))
            except* _PointsCut:
                # Logged where it was cut; hypercorn closes the connection mid-body, where
                # letting it through was its ERROR `Error in ASGI Framework`, naming nothing.
                pass
        else:
            await self.http(scope, receive, send)


def _route_path(scope: Any) -> Any:
    """``scope`` with every run of slashes in its path made one, for every route alike.

    werkzeug matched the quart app's routes after any leading slashes, and answered a run of
    them inside the path with a 308 redirect as an HTML page; intake and the stream took their
    path exactly: a base URL ending in a slash (``http://nas:8787/`` + ``/v1/deliveries``)
    reached every read route, and a delivery posted there was 404, not journaled (SERVE-85)."""
    path = _SLASHES.sub("/", scope["path"])
    return scope if path == scope["path"] else {**scope, "path": path}


def _query_instant(value: str) -> int:
    """The instant of a query parameter, its offset's `+` restored where it came unencoded.

    A `+` in a query string means a space: `from=2024-09-21T07:00:00+01:00` as a browser or
    curl without ``--data-urlencode`` sends it reached the service as `...07:00:00 01:00`, and
    was 400 ``BAD_TIMESTAMP`` with no hint why. A value that is a timestamp as it came keeps
    its meaning (`2024-09-21+07:00`, a space between date and time); only one that is none is
    read again with the space before a final HH:MM as the `+` it can only have been. Raises
    :class:`TimestampError` when neither is a timestamp."""
    try:
        return parse_instant(value)
    except TimestampError:
        restored = _SPACE_FOR_PLUS.sub("+", value)
        if restored == value:
            raise
        return parse_instant(restored)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _finishing(send: Any, limit_s: float) -> Any:
    """``send`` for a quart-trio HTTP request, with the response's last body message shielded,
    for ``limit_s`` at most.

    hypercorn 0.18 ends an HTTP/1.1 response inside the app's last ``http.response.body``
    send: it puts ``http.disconnect`` on the app's queue (``HTTPStream.handle`` in
    ``protocol/http_stream.py``), then marks a kept-alive connection idle (``Updated(idle=True)``
    in ``H11Protocol._maybe_recycle``, ``protocol/h11.py``), which starts the connection's idle
    task (``trio/tcp_server.py``): the keep-alive timer, and the close on shutdown. quart-trio
    cancels the request as soon as its reader takes that ``http.disconnect``, so the send was
    cancelled in between, at the lock of ``TrioSingleTask.restart``, and the idle task never
    started: the connection outlived ``keep_alive_timeout_s`` and held a shutdown for
    ``graceful_timeout_s`` (PROOF-8). Over HTTP/1.1 the shield adds no wait: the socket write
    in that send is shielded by hypercorn already, quart-trio's reader keeps the queue from
    filling, and the rest only starts a task. Over HTTP/2 the send waits for the peer's flow
    control window, which a peer that sets it to zero and leaves never opens: hence the limit
    (SERVE-38), after which the send is given up as for a peer that stopped reading.
    """

    async def send_finishing(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(deadline=trio.current_time() + limit_s, shield=True):
                await send(message)
        else:
            await send(message)

    return send_finishing


def _header_bytes(scope: Any) -> int:
    return sum(len(name) + len(value) for name, value in scope["headers"])


async def _refuse(scope: Any, send: Any, status: int, code: str) -> None:
    """``status`` with the error ``code`` for an HTTP request, a refused handshake for a
    websocket."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = orjson.dumps({"error": code})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def create_app(
    runtime: Runtime,
    tokens: TokenCache,
    config: ServeConfig,
    snapshots: SnapshotService,
    closing: trio.Event,
    *,
    response_timeout_s: float = RESPONSE_TIMEOUT_S,
) -> HealthlogApp:
    """The application bound to a running runtime; ``closing`` is set when shutdown begins.

    ``response_timeout_s`` is quart's ``RESPONSE_TIMEOUT``, the time allowed to send a response
    whose body is whole; streamed bodies (``/v1/points``, snapshot files) have no such limit.
    """
    app = _Http("healthlog")
    app.config["RESPONSE_TIMEOUT"] = response_timeout_s
    # No route of this app reads a request body (intake has its own endpoint), yet quart keeps
    # every body it is sent, up to this limit (16 MiB by default), for as long as its response
    # lasts: a client sending one with each `/v1/points` request it reads slowly held 16 MiB of
    # the service's memory per request (SERVE-60). At 0 quart keeps at most the first chunk.
    app.config["MAX_CONTENT_LENGTH"] = 0
    hub = EventHub(runtime)
    slots = trio.CapacityLimiter(config.stream_max_subscribers)
    handshake_refusals = HandshakeRefusals()
    refusals = RefusalLog()
    wrong_paths = WrongPathLog()
    intake = IntakeEndpoint(runtime, tokens, config, refusals, wrong_paths)

    def wrong_handshake() -> None:
        # A handshake is logged as one for a wrong path is: a follower set to a wrong URL
        # otherwise left no line above DEBUG (SERVE-103).
        wrong_paths("WS", websocket.path, websocket.remote_addr, WrongPathLog.STREAM)

    @app.errorhandler(NotFound)
    async def not_found(_exc: NotFound) -> Response:
        # Only a path no route serves: a route's own 404 (an id not kept) is answered directly.
        if has_request_context():
            wrong_paths(request.method, request.path, request.remote_addr)
        elif has_websocket_context():
            wrong_handshake()
        return _error("NOT_FOUND", 404)

    @app.errorhandler(WebsocketMismatch)
    async def websocket_mismatch(_exc: WebsocketMismatch) -> Response:
        # A websocket handshake to a route of the HTTP API: there is no such websocket route
        # (werkzeug's answer was an HTML page with 400).
        wrong_handshake()
        return _error("NOT_FOUND", 404)

    @app.errorhandler(MethodNotAllowed)
    async def method_not_allowed(error: MethodNotAllowed) -> Response:
        # Logged as a wrong path is: a phone set to post to a read route (`/v1/status`) left
        # no line above DEBUG (SERVE-103).
        wrong_paths(request.method, request.path, request.remote_addr)
        # Sorted, as OPTIONS lists them: werkzeug's order was a set's.
        allowed = ", ".join(sorted(error.valid_methods or ()))
        return _error("METHOD_NOT_ALLOWED", 405, {"Allow": allowed})

    @app.errorhandler(InternalServerError)
    async def internal(_exc: InternalServerError) -> Response:
        return _error("INTERNAL", 500)

    @app.after_request
    async def not_stored(response: Response) -> Response:
        # Health data, and answers that change by the second: a caching front (nginx's
        # proxy_cache_valid, which looks at no Authorization header) otherwise kept a
        # /v1/points answer and gave it to the next request for that URL, token or none
        # (SERVE-86).
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.before_serving
    async def start_hub() -> None:
        # Supervised like the runtime's actors (specs/runtime.md, supervision): a crash is one
        # ERROR, counted, the hub is down (/readyz 503) until it has run well again, and it is
        # started again after a backoff instead of ending for the life of the process.
        app.nursery.start_soon(runtime.supervise, HUB_ACTOR, hub.run)

    @app.errorhandler(_TokensUnavailable)
    async def tokens_unavailable(error: _TokensUnavailable) -> Response:
        return _error("TOKENS_UNAVAILABLE", 503, {"Retry-After": TOKENS_RETRY_AFTER_S})

    async def client() -> str | None:
        presented = presented_token(
            request.headers.get("Authorization"), request.headers.get("api-key")
        )
        try:
            return None if presented is None else await tokens.authenticate(presented)
        except StorageError:
            raise _TokensUnavailable from None

    def unauthorized() -> Response:
        # The route's pattern, never the path: that holds what the client sent.
        route = request.url_rule.rule if request.url_rule is not None else "?"
        presented = presented_token(
            request.headers.get("Authorization"), request.headers.get("api-key")
        )
        refusals.unauthorized(request.method, route, request.remote_addr, presented is not None)
        return _error("UNAUTHORIZED", 401, {"WWW-Authenticate": "Bearer"})

    def store_unfit() -> Response | None:
        """The 503 of a route that reads the store, while it was found unfit (SERVE-150)."""
        unfit = runtime.store_unfit()
        if unfit is None:
            return None
        code, message = STORE_UNFIT_ANSWERS[unfit]
        return _json({"error": code, "message": message}, 503)

    async def unfit_once_checked() -> Response | None:
        """After a read of the store failed: SERVE-150's 503 once the store's check has found it
        unfit, else None (the failure is another). ``serve`` answers while it checks the store
        (RUN-162), and its reads meanwhile read it unchecked: one that fails waits for the
        check's verdict (SERVE-163). On a torn store, `/v1/points` was 500 ``INTERNAL`` with an
        ERROR naming only StorageError, and `/v1/snapshots` 503 ``SNAPSHOT_UNAVAILABLE``, come
        back in 60 s, with a WARNING, until the check ended. A stop ends the wait (the check
        is interrupted once hypercorn has stopped, which waits for this request)."""
        async with trio.open_nursery() as waiting:

            async def until_closing() -> None:
                await closing.wait()
                waiting.cancel_scope.cancel()

            waiting.start_soon(until_closing)
            await runtime.store_checked()
            waiting.cancel_scope.cancel()
        return store_unfit()

    @app.get("/v1/status")
    async def get_status() -> Response:
        if await client() is None:
            return unauthorized()
        folding = runtime.statistics().folding
        # Why nothing folds: the store found unfit, where the store's mark said `empty`, the
        # last pass of a process before (SERVE-150).
        unfit = runtime.store_unfit()
        try:
            status = await runtime.read_store(
                functools.partial(
                    collect_status,
                    runtime.journal,
                    public_key=snapshots.public_key,
                    stopped_because=unfit or folding.unrecorded_stop,
                    first_pass_completed=folding.first_pass_completed,
                )
            )
        except StorageError:
            if (refused := await unfit_once_checked()) is not None:
                return refused
            raise
        return _json(status)

    @app.get("/v1/deliveries/<int:delivery_id>")
    async def get_delivery(delivery_id: int) -> Response:
        if await client() is None:
            return unauthorized()
        if delivery_id > SQLITE_MAX_INTEGER:
            return _error("NOT_FOUND", 404)
        if (refused := store_unfit()) is not None:
            return refused
        try:
            outcome = await runtime.read_store(
                functools.partial(Store.outcome, delivery_id=delivery_id)
            )
        except StorageError:
            if (refused := await unfit_once_checked()) is not None:
                return refused
            raise
        meta = await runtime.read_journal(lambda j: j.get_meta(delivery_id))
        if meta is None:
            return _error("NOT_FOUND", 404)
        return _json(
            documents.DeliveryStatus(
                delivery_id=delivery_id,
                received_at=format_instant(meta.received_at),
                status=outcome.status if outcome else "pending",
                reason=outcome.reason if outcome else None,
                counters=outcome.counters if outcome else {},
            )
        )

    @app.get("/v1/points")
    async def get_points() -> Response:
        if await client() is None:
            return unauthorized()
        args = request.args
        # werkzeug gives the first of a repeated parameter, the stream took the last:
        # `from=A&from=B` meant A here and `after=5&after=0` 0 there (SERVE-93, STREAM-127).
        for name in POINTS_PARAMETERS:
            if len(args.getlist(name)) > 1:
                return _bad_parameter("REPEATED_PARAMETER", name, "one value")
        fmt = args.get("format", "jsonl")
        if fmt not in FORMATS:
            return _bad_parameter("BAD_FORMAT", "format", " or ".join(FORMATS))
        layer = None
        if args.get("layer"):
            layer = layers.stored_layer(args["layer"])
            if layer is None:
                return _bad_parameter("BAD_LAYER", "layer", layers.STORED_LAYERS_TEXT)
        instants: dict[str, int | None] = {}
        for name in ("from", "to"):
            try:
                instants[name] = _query_instant(args[name]) if args.get(name) else None
            except TimestampError:
                return _bad_parameter(
                    "BAD_TIMESTAMP", name, f"an ISO 8601 instant such as {TIMESTAMP_EXAMPLE}"
                )
        start_from, start_to = instants["from"], instants["to"]
        if start_from is not None and start_to is not None and start_from >= start_to:
            # Swapped or equal: nothing starts in [from, to), and it was 200 with an empty body
            # as if the range held no points, where `healthlog export` exits 2 (SERVE-101).
            return _bad_parameter(
                "BAD_RANGE", "to", "an instant later than from: the points that start in [from, to)"
            )
        if (refused := store_unfit()) is not None:
            return refused
        pages = _object_pages(
            runtime,
            metric=args.get("metric") or None,
            layer=layer,
            hour_from=None if start_from is None else hour_of(start_from),
            hour_to=None if start_to is None else hour_of(start_to),
        )
        chunks = _point_chunks(pages, fmt=fmt, start_from=start_from, start_to=start_to)
        # The first chunk is made before the status is sent: a damaged object in it (every
        # object of a small answer) is a 500 the client reads as such, not a 200 cut short.
        try:
            first = await anext(chunks, b"")
        except _Damaged as exc:
            log.error("GET /v1/points stopped: %s", exc)
            return _error("OBJECT_CORRUPT", 500)
        except StorageError:
            if (refused := await unfit_once_checked()) is not None:
                return refused
            raise

        async def lines() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(chunks):
                if first:
                    yield first
                try:
                    async for chunk in chunks:
                        yield chunk
                except _Damaged as exc:
                    # The lines before the object, then the cut (as `export` writes them and
                    # exits 3, CLI-34).
                    if exc.gathered:
                        yield exc.gathered
                    log.error("GET /v1/points stopped: %s", exc)
                    raise _PointsCut from None

        return _streamed(Response(lines(), content_type=POINTS_TYPES[fmt]))

    @app.get("/v1/snapshots/key")
    async def snapshot_key() -> Response:
        return _json({"public_key": snapshots.public_key, "algorithm": "Ed25519"})

    @app.get("/v1/snapshots")
    async def snapshot_latest() -> Response:
        if await client() is None:
            return unauthorized()
        if (refused := store_unfit()) is not None:
            return refused
        try:
            manifest = await snapshots.covering(0)
        except (OSError, StorageError) as exc:
            if isinstance(exc, StorageError) and (refused := await unfit_once_checked()):
                return refused
            log.warning("snapshot not built: %s", snapshot_failure(exc))
            return _error("SNAPSHOT_UNAVAILABLE", 503, {"Retry-After": str(SNAPSHOT_RETRY_AFTER_S)})
        return _json(manifest)

    @app.get("/v1/snapshots/<int:seq>")
    async def snapshot_file(seq: int) -> Response:
        if await client() is None:
            return unauthorized()
        body = None if seq > SQLITE_MAX_INTEGER else await snapshots.open(seq)
        if body is None:
            return _error("NOT_FOUND", 404)
        response = Response(body, content_type="application/octet-stream")
        response.content_length = body.size
        return _streamed(response)

    @app.get(STREAM_PATH)
    async def stream_without_upgrade() -> Response:
        # The stream is a websocket only. A plain request for it (curl, or a reverse proxy that
        # does not pass the Upgrade and Connection headers on) was 404 NOT_FOUND, and the user
        # looked for a wrong path (SERVE-82). Over HTTP/2 the h2 library drops both headers.
        return _error("UPGRADE_REQUIRED", 426, {"Upgrade": "websocket", "Connection": "Upgrade"})

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"ok": True})

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = runtime.ready()
        return _json({"ready": ready}, 200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await render_metrics(
            runtime, slots.borrowed_tokens, handshake_refusals, intake.refused, intake.held()
        )
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    stream = StreamEndpoint(
        runtime,
        hub,
        tokens.authenticate,
        snapshots.covering,
        config.stream_send_timeout_s,
        closing,
        refusals,
        slots,
        handshake_refusals,
    )
    return HealthlogApp(
        app,
        intake,
        stream,
        config.stream_send_timeout_s,
    )


async def _point_chunks(
    pages: AsyncGenerator[list[HourlyObject], None],
    *,
    fmt: str,
    start_from: int | None,
    start_to: int | None,
) -> AsyncGenerator[bytes, None]:
    """The lines of `/v1/points` (the CSV header first) gathered into chunks of
    ``POINTS_CHUNK_BYTES``: hypercorn sends each chunk as a write of its own, and a line at a
    time a wide range took eight times the CLI's export (272 s against 33 s for 2.5 years). An
    object whose body does not decode raises :class:`_Damaged` with the lines gathered before
    it."""
    chunk = list(header(fmt))
    size = sum(map(len, chunk))
    # Closed here however the response ends: a client gone half-way (or a stream reset,
    # SERVE-64) left it to the garbage collector, unfinished.
    async with contextlib.aclosing(pages):
        async for page in pages:
            for obj in page:
                try:
                    for line in object_lines(
                        obj, start_from=start_from, start_to=start_to, fmt=fmt
                    ):
                        chunk.append(line)
                        size += len(line)
                        if size >= POINTS_CHUNK_BYTES:
                            yield b"".join(chunk)
                            chunk, size = [], 0
                except ObjectCorrupt as exc:
                    raise _Damaged(exc, b"".join(chunk)) from None
    if chunk:
        yield b"".join(chunk)


async def _object_pages(runtime: Runtime, **where: Any) -> AsyncGenerator[list[HourlyObject], None]:
    """Objects read a page at a time (the store's own, ``OBJECTS_PAGE``) in the store's worker
    thread, one trip each, all of one state of the store (SERVE-140). The read transaction
    ends with the generator, however the answer ends (closed by ``_point_chunks``)."""
    with contextlib.ExitStack() as reading:
        iterator = await runtime.read_store(
            lambda s: reading.enter_context(s.objects_of_one_state(**where))
        )
        while True:
            page = await runtime.read_store(
                lambda _s: list(itertools.islice(iterator, OBJECTS_PAGE))
            )
            if not page:
                return
            yield page
