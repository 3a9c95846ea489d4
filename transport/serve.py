"""``healthlog serve``: the runtime and the HTTP app on hypercorn's trio worker.

SIGINT or SIGTERM (or the ``shutdown`` event, for tests) stops accepting connections,
lets requests in flight finish within the graceful timeout, then stops the runtime. Uploads
still streaming at the graceful timeout are refused (503); a delivery handed to the journal by
then has ``COMMIT_GRACE_S`` more to be committed and answered, so an upload either gets its 200
after the journal commit or fails before it, never journaled unanswered. Idle keep-alive
connections close at once (``transport.app``), and a connection whose peer stopped reading is
dropped by the kernel after ``stream_send_timeout_s`` (``_HypercornConfig._open_sockets``).
The address is bound before anything else starts, so a ``serve`` that cannot listen opens
nothing.

A fault inside hypercorn's handling of one connection stays with that connection
(``_ContainedTCPServer``): hypercorn lets such an exception end the whole server, and a peer can
cause one on purpose (closing a websocket while the server closes it, trailing bytes after an
upgrade request).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h2.errors
import h2.exceptions
import h11
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.protocol.ws_stream
import hypercorn.trio.run
import hypercorn.trio.task_group
import hypercorn.trio.tcp_server
import orjson
import trio
import wsproto.events
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.events import Event, Updated
from hypercorn.protocol.events import Body, Data, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)
from wsproto.extensions import PerMessageDeflate

from actors.runtime import Runtime, configured, open_runtime
from healthlog.config import ServeConfig
from healthlog.hangup import REPEATED_SIGNAL_S, stopping_signals
from healthlog.storage import faultplan
from healthlog.storage.datadir import DataDir
from healthlog.storage.status import reindex_advice
from healthlog.storage.store import Store
from transport.app import MAX_HEADER_BYTES, RESPONSE_TIMEOUT_S, create_app
from transport.auth import TokenCache
from transport.refusals import FaultLog
from transport.snapshots import SnapshotService
from transport.stream import MAX_CLIENT_MESSAGE_BYTES

log = logging.getLogger("healthlog.http")

KEEPALIVE_MAX_S = 32_767
"""The longest ``TCP_KEEPIDLE`` and ``TCP_KEEPINTVL`` Linux takes (``MAX_TCP_KEEPIDLE``)."""

COMMIT_GRACE_S = 10.0
"""After the graceful timeout, the time a delivery already handed to the journal has to be
committed and answered: the journal's busy timeout (5 s) and as much again."""


class _ContainedTCPServer(TCPServer):
    """hypercorn's handler of one connection, which lets a connection go as soon as its peer
    has closed it, and closes the connection (as it does anyway) when the handling fails, and
    ends there. Left to hypercorn, such a failure ends the whole
    server: two of its tasks writing to one socket when a websocket client closes as the
    server does (``trio.BusyResourceError``), or an upgrade request followed by trailing bytes
    (h11's ``LocalProtocolError``) took ``healthlog serve`` down, without a token. It also
    half-closes a socket holding hypercorn's send lock, so that the first of those no longer
    happens (SERVE-73)."""

    _peer_closed = False
    _busy = False
    """A request (or, over HTTP/2, a stream) is in progress: hypercorn said the connection is
    not idle."""

    async def _read_data(self) -> None:
        await super()._read_data()
        # The peer closed its side: nothing is left to keep alive. hypercorn would hold the
        # connection (its socket, a file descriptor) until the keep-alive timeout anyway, and
        # start that wait again when a request in flight ends, so that a peer opening and
        # closing connections quickly could use up every descriptor.
        self._peer_closed = True
        await self.idle_task.stop()
        # Over HTTP/2, hypercorn closes the connection's streams but not their send buffers:
        # a response's last send, waiting for the buffer to drain, would wait for good.
        for buffer in list(getattr(self.protocol.protocol, "stream_buffers", {}).values()):
            await buffer.close()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Updated):
            self._busy = not event.idle
        if not isinstance(event, Updated):
            await super().protocol_send(event)
        elif not self._peer_closed:
            # Over HTTP/2 the keep-alive timer is restarted by the app's send that ends the
            # connection's last stream, and its task is started inside that send's cancel
            # scopes: the intake, which cancels its answer once the client's disconnect comes
            # (and over HTTP/2 it comes from within that very send), cancelled the timer with
            # it, and the idle connection was never closed (SERVE-47). Restarting or stopping
            # the timer does not wait on the peer.
            with trio.CancelScope(shield=True):
                await super().protocol_send(event)

    async def _initiate_server_close(self) -> None:
        """hypercorn's close of a connection idle for ``keep_alive_timeout`` (or at shutdown),
        put off when a request came as the timer ran out.

        Once the timer had run out hypercorn closed the connection whatever came meanwhile: a
        request read as the close began was handed to the app, journaled, and its answer met
        the closed socket; one whose bytes were still unread was reset. A reverse proxy reuses
        its pooled connection to the service just then now and again (through Caddy, with
        ``keep_alive_timeout_s = 1`` and deliveries 0.97 to 1.01 s apart, 9 of 200 were
        answered 502, 5 of those 9 journaled all the same, SERVE-136). A request under way is
        answered, and the timer starts again as it ends; bytes waiting to be read start it
        again now, so that they are read first (at shutdown they are not waited for)."""
        if self._busy:
            return
        socket = getattr(self.stream, "socket", None)
        if (
            socket is not None
            and not self.context.terminated.is_set()
            and not self._peer_closed
            and socket.is_readable()
        ):
            await self.idle_task.restart(self._task_group, self._idle_timeout)
            return
        await super()._initiate_server_close()

    async def _close(self) -> None:
        # hypercorn half-closes the socket (``send_eof``) without its send lock, and a send
        # that takes the lock meanwhile (its answer to the client's websocket close, as a
        # refused subscriber closes at once) met the half-close on the socket: a
        # BusyResourceError that ended the connection's handling, logged at WARNING as a
        # failure for 23 of 160 such connections (SERVE-73). The half-close now holds the lock;
        # while a send holds it, the connection is closed whole, as hypercorn does when its
        # half-close meets a send.
        try:
            self.send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self.stream.aclose()
            return
        try:
            await super()._close()
        finally:
            self.send_lock.release()

    async def run(self) -> None:
        try:
            await super().run()
        except* Exception as group:
            kinds = ", ".join(sorted({type(exc).__name__ for exc in _leaves(group)}))
            assert isinstance(self.config, _HypercornConfig)
            self.config.contained(
                "http: a connection failed inside hypercorn and was closed: %s", kinds
            )


def _leaves(group: BaseExceptionGroup[Exception]) -> list[Exception]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


# hypercorn's trio worker hands each connection to the ``TCPServer`` its module imported (a name
# it does not export, hence the ignore).
hypercorn.trio.run.TCPServer = _ContainedTCPServer  # type: ignore[attr-defined]


class _ClosingTaskGroup(hypercorn.trio.task_group.TaskGroup):
    """hypercorn's task group of one connection, whose app's queue of events is closed when the
    app ends, and whose puts into a closed queue are dropped.

    hypercorn queues at most ``max_app_queue_size`` (10) events for the app and, once the app
    has ended, goes on putting what the peer sends: a subscriber refused while frames of its
    were on the way (ACKs in flight) filled the queue, and hypercorn's reader of that
    connection, and the close it makes after the app, waited on it for good. The connection, its
    tasks and its descriptor were never let go (STREAM-98).

    The app's first wait for a request message is when an HTTP/1.1 client that asked for
    ``Expect: 100-continue`` gets its ``100 Continue`` (``body_wanted``, set by
    :class:`_ClosingH11Protocol`): an answer given before that (401, 413) reaches the client
    before it sends its body (SERVE-75)."""

    body_wanted: Callable[[], Awaitable[None]] | None = None

    async def spawn_app(
        self,
        app: AppWrapper,
        config: HypercornConfig,
        scope: Scope,
        send: Callable[[ASGISendEvent | None], Awaitable[None]],
    ) -> Callable[[ASGIReceiveEvent], Awaitable[None]]:
        sending, receiving = trio.open_memory_channel[ASGIReceiveEvent](config.max_app_queue_size)

        async def closing_after(
            scope: Scope,
            receive: ASGIReceiveCallable,
            send: ASGISendCallable,
            sync_spawn: Callable[..., Any],
            call_soon: Callable[..., Any],
        ) -> None:
            with receiving:
                await app(scope, receive, send, sync_spawn, call_soon)

        async def dropping_when_closed(event: ASGIReceiveEvent) -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                await sending.send(event)

        async def receive() -> ASGIReceiveEvent:
            if self.body_wanted is not None:
                await self.body_wanted()
            return await receiving.receive()

        assert self._nursery is not None
        # As hypercorn's own spawn_app, but for the app run, the queue and its receive.
        self._nursery.start_soon(
            hypercorn.trio.task_group._handle,
            closing_after,
            config,
            scope,
            receive,
            send,
            trio.to_thread.run_sync,
            trio.from_thread.run,
        )
        return dropping_when_closed


# hypercorn's handler of a connection makes its task group from the name its module imported (a
# name it does not export, hence the ignore).
hypercorn.trio.tcp_server.TaskGroup = _ClosingTaskGroup  # type: ignore[attr-defined]


_FRAMINGS = frozenset({b"transfer-encoding", b"content-length"})
"""The two headers that each say where a request's body ends."""
_PROTOCOL_ERRORS = {
    431: "HEADERS_TOO_LARGE",
    501: "UNSUPPORTED_TRANSFER_ENCODING",
}
"""The error codes of the statuses h11 gives a request it cannot read (its
``error_status_hint``), other than 400, ``MALFORMED_REQUEST``; 431 is the app's own code for
headers over the limit."""


class _ClosingConnection(h11.Connection):
    """An h11 server connection that skips blank lines before a request, and takes nothing
    more from a client once its request has closed the connection (``Connection: close``, or
    HTTP/1.0 without keep-alive).

    Some clients send a CRLF after a body. RFC 9112 has a server ignore blank lines before a
    request line (2.2), and process no further request on a connection its request closed
    (9.6). h11 took such a line for a protocol error, and hypercorn then answered 400 and
    closed the connection: in place of the request's own answer when that request closed the
    connection, while the app went on with it (a delivery journaled, its client told 400, a
    retry journaled it twice, SERVE-48); after the answer on a kept-alive connection, where the
    client read that 400 as its next delivery's answer, or sent that delivery into the closed
    connection (SERVE-50). Here blank lines before a request are dropped (h11 keeps its buffer
    of a connection waiting for a request free of them), and so is whatever follows a request
    that closed the connection: what arrived with its end is never parsed, later bytes are not
    kept.

    A request with both ``Transfer-Encoding`` and ``Content-Length`` is refused with 400 and its
    connection closed (RFC 9112, 6.1, allows the refusal, and asks for the close at least). h11
    read its body as chunked and kept the connection: behind a proxy that goes by
    ``Content-Length``, the bytes after the chunked body's end were served as a request of
    their own that the proxy never saw (request smuggling, SERVE-62).

    hypercorn is never told that a client waits for ``100 Continue``: it sent one as soon as
    a request's head had come, before the app had looked at it, so that a client that asked
    in order to learn of a 413 or a 401 first sent its whole body anyway. The app asks for
    the body instead (:meth:`_ClosingH11Protocol.want_body`).
    """

    they_are_waiting_for_100_continue = False

    def receive_data(self, data: bytes) -> None:
        if data and self.their_state is h11.MUST_CLOSE:
            return
        starting = self.their_state is h11.IDLE and not self._receive_buffer
        super().receive_data(data)
        if starting:
            self._skip_blank_lines()

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._skip_blank_lines()

    def next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        if self.their_state is h11.MUST_CLOSE:
            # The end of the stream, too: hypercorn learns it from the socket (``Closed``).
            return h11.NEED_DATA
        event = super().next_event()
        if isinstance(event, h11.Request) and {name for name, _ in event.headers} >= _FRAMINGS:
            # hypercorn answers 400 and closes the connection.
            raise h11.RemoteProtocolError(
                "Transfer-Encoding and Content-Length", error_status_hint=400
            )
        return event

    def _skip_blank_lines(self) -> None:
        """Drop the CRs and LFs the buffer starts with, where a request is to start. Done only
        when one may start (the buffer was empty, or a new cycle began), so that a client
        sending its request line a byte at a time does not have the buffer copied each time."""
        pending = self.trailing_data[0]
        blank = len(pending) - len(pending.lstrip(b"\r\n"))
        if blank:
            self._receive_buffer.maybe_extract_at_most(blank)


class _ClosingH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol over a :class:`_ClosingConnection`, which sends
    ``100 Continue`` once the app wants the request's body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _ClosingConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )
        if isinstance(self.task_group, _ClosingTaskGroup):
            self.task_group.body_wanted = self.want_body

    async def _send_error_response(self, status_code: int) -> None:
        """hypercorn's answer to a request h11 cannot read (a malformed request line or header,
        SERVE-62's two framings), with a JSON error as every other answer: it had the status
        alone, without a body or a type, where a client looks for ``error`` (SERVE-104)."""
        body = orjson.dumps({"error": _PROTOCOL_ERRORS.get(status_code, "MALFORMED_REQUEST")})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        # An answer to HEAD has no body, and h11 refuses one: the connection then failed
        # inside hypercorn, a WARNING for each such request (SERVE-107). The method is h11's
        # note of the request it read, kept where the request line was read.
        if getattr(self.connection, "_request_method", None) != b"HEAD":
            await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    async def _check_protocol(self, event: h11.Request) -> None:
        """hypercorn's switch to HTTP/2, which starts the keep-alive timer again when the
        client opened with HTTP/2's preface (prior knowledge): hypercorn stopped the timer as
        it read that preface as a request, and HTTP/2 starts it only when a stream ends, so a
        connection that sent the preface and no request was never closed, its socket held
        until the client left (STREAM-151). Its first request stops the timer again."""
        try:
            await super()._check_protocol(event)
        except hypercorn.protocol.h11.H2ProtocolAssumedError:
            await self.send(Updated(idle=True))
            raise

    async def want_body(self) -> None:
        """``100 Continue``, if the client waits for one and has no answer yet (h11 forgets
        the wait once an answer starts, or the body does)."""
        connection = self.connection
        if isinstance(connection, h11.Connection) and connection.client_is_waiting_for_100_continue:
            await self._send_h11_event(
                h11.InformationalResponse(
                    status_code=100, headers=self.config.response_headers("h11")
                )
            )


# hypercorn's protocol wrapper makes each HTTP/1.1 connection's protocol from the name its
# module imported (a name it does not export, hence the ignore).
hypercorn.protocol.H11Protocol = _ClosingH11Protocol  # type: ignore[attr-defined]


class _DeclinedDeflate(PerMessageDeflate):
    """permessage-deflate, declined whenever a websocket handshake offers it.

    wsproto inflates what a compressed frame brings whole, and hypercorn checks its message
    limit on the inflated message only: 0.5 MiB of a peer's deflate took 512 MiB of the
    service's memory, from a peer whose token was not checked yet (frames are read before the
    stream checks it; SERVE-51). The stream's frames are small JSON and its peers are on the
    home network; its reference subscriber (``follow``) never asks for compression. A declined
    offer leaves the extension disabled, so a peer that sends a compressed frame regardless
    breaks the protocol and is closed.
    """

    def accept(self, offer: str) -> None:
        return None


# hypercorn offers the extensions of a websocket handshake from the name its module imported.
hypercorn.protocol.ws_stream.PerMessageDeflate = _DeclinedDeflate  # type: ignore[attr-defined]


_HANDSHAKE_ERRORS = {400: "BAD_HANDSHAKE", 500: "INTERNAL"}
"""The error codes of hypercorn's own answers to a websocket handshake: 400 for one that is not
a websocket handshake (no ``Sec-WebSocket-Key``, a version other than 13), 500 for an app that
ended without answering; another (403, the app's close before accepting) is
``HANDSHAKE_REFUSED``."""


class _AnsweringWSStream(hypercorn.protocol.ws_stream.WSStream):
    """hypercorn's websocket stream, whose own answer to a handshake has a JSON error, as every
    other answer has, and whose refusal of a handshake ends the connection.

    hypercorn answered a handshake it could not take (no ``Sec-WebSocket-Key``, version 8)
    with the status alone, and said ``connection: close`` without ending the stream, so the
    connection stayed open, past the keep-alive timeout, until the client left: a peer without
    a token could hold as many file descriptors as it opened connections (SERVE-105)."""

    async def handle(self, event: StreamEvent) -> None:
        await super().handle(event)
        if isinstance(event, Request) and self.closed:
            # Refused before the app was started: nothing else ends the stream.
            await self.send(StreamClosed(stream_id=self.stream_id))

    async def _send_error_response(self, status_code: int) -> None:
        body = orjson.dumps({"error": _HANDSHAKE_ERRORS.get(status_code, "HANDSHAKE_REFUSED")})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await self.send(
            Response(stream_id=self.stream_id, status_code=status_code, headers=headers)
        )
        await self.send(Body(stream_id=self.stream_id, data=body))
        await self.send(EndBody(stream_id=self.stream_id))
        await self.config.log.access(
            self.scope, {"status": status_code, "headers": []}, time.time() - self.start_time
        )


# hypercorn's HTTP/1.1 and HTTP/2 protocols make a websocket's stream from the name their
# modules imported.
hypercorn.protocol.h11.WSStream = _AnsweringWSStream  # type: ignore[attr-defined]
hypercorn.protocol.h2.WSStream = _AnsweringWSStream  # type: ignore[attr-defined]


class _CappedWebsocketBuffer(hypercorn.protocol.ws_stream.WebsocketBuffer):
    """hypercorn's buffer of a websocket message coming in, which keeps nothing beyond its
    limit (``MAX_CLIENT_MESSAGE_BYTES``).

    hypercorn wrote each piece of a message into the buffer before it checked the limit, and
    kept the buffer: past the limit it sent close 1009 and went on writing whatever the peer
    sent after it, into a buffer no one would read. A subscriber that did not answer the close
    grew the service's memory for as long as it went on sending (STREAM-94).
    """

    def extend(self, event: wsproto.events.Message[Any]) -> None:
        if self.length + len(event.data) > self.max_length:
            raise hypercorn.protocol.ws_stream.FrameTooLargeError
        super().extend(event)


# hypercorn makes each websocket's message buffer from the name its module defines.
hypercorn.protocol.ws_stream.WebsocketBuffer = _CappedWebsocketBuffer  # type: ignore[misc]


class _BoundedStreamBuffer(hypercorn.protocol.h2.StreamBuffer):
    """hypercorn's buffer of one HTTP/2 stream's response, which lets the app send more only
    once what it holds has gone below the low water mark.

    hypercorn let the app go on as soon as it took less than the low water mark out of the
    buffer, and with the peer's flow control window shut it takes nothing, again and again: a
    peer that set its window to zero and asked for ``/v1/points`` had the whole export built
    and held in the service's memory, on each of a connection's 100 streams (SERVE-63).
    """

    async def pop(self, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < hypercorn.protocol.h2.BUFFER_LOW_WATER:
            await self._paused.set()
        if not self.buffer:
            await self._is_empty.set()
        return data


# hypercorn's HTTP/2 protocol makes each stream's buffer from the name its module defines.
hypercorn.protocol.h2.StreamBuffer = _BoundedStreamBuffer  # type: ignore[misc]


class _StalledStreamsH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 protocol, which resets a stream whose response has waited
    ``stalled_send_s`` for its peer to take any of it, as the kernel drops an HTTP/1.1
    connection that stalls as long (``TCP_USER_TIMEOUT``, :meth:`_HypercornConfig._open_sockets`).

    An HTTP/2 peer can shut one stream's flow control window and keep the connection alive:
    the kernel sees nothing stalled, and the response waited for good, holding its task and
    what it had read (a page of `/v1/points`, 0.35 MiB), on each of a connection's 100 streams
    (SERVE-64). The stream is reset (``CANCEL``) and closed as when the peer resets it: its
    request is told the client went away.
    """

    async def stream_send(self, event: StreamEvent) -> None:
        if not isinstance(event, Body | Data):
            await super().stream_send(event)
            return
        assert isinstance(self.config, _HypercornConfig)
        with trio.move_on_after(self.config.stalled_send_s) as waiting:
            await super().stream_send(event)
        if waiting.cancelled_caught:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
                await self._flush()
            await self._close_stream(event.stream_id)
            await self._window_updated(event.stream_id)


# hypercorn's protocol wrapper makes each HTTP/2 connection's protocol from the name its module
# imported (a name it does not export, hence the ignore).
hypercorn.protocol.H2Protocol = _StalledStreamsH2Protocol  # type: ignore[attr-defined]


class CannotListen(OSError):
    """The listening sockets could not be made: the address it names is in use, does not
    resolve, or may not be listened on by this user."""


class _HypercornConfig(HypercornConfig):
    """hypercorn's configuration, whose TCP listeners bound how long a send may stall."""

    stalled_send_s: float
    contained: FaultLog
    """Logs a connection failure that ``_ContainedTCPServer`` contained, in a flood a few a
    minute: a peer causes one at will (SERVE-61)."""
    _bound: Sockets | None = None

    def bind_now(self) -> None:
        """Bind the listening sockets now, for :meth:`create_sockets` to hand to hypercorn
        later: ``serve`` on an address it cannot listen on stops before it opens the data
        directory, rather than after its runtime has taken the fold lease."""
        self._bound = self._open_sockets()

    def close_unused(self) -> None:
        """Close the sockets of :meth:`bind_now` if hypercorn never took them."""
        bound = self._take_bound()
        if bound is not None:
            for sock in (*bound.secure_sockets, *bound.insecure_sockets, *bound.quic_sockets):
                sock.close()

    def create_sockets(self) -> Sockets:
        """The sockets of :meth:`bind_now`, else sockets bound now (see :meth:`_open_sockets`)."""
        bound = self._take_bound()
        return self._open_sockets() if bound is None else bound

    def _take_bound(self) -> Sockets | None:
        """The sockets of :meth:`bind_now` not handed over yet, handed over now (once)."""
        bound, self._bound = self._bound, None
        return bound

    def _open_sockets(self) -> Sockets:
        """The listening sockets, with a ``TCP_USER_TIMEOUT`` that accepted sockets inherit.

        hypercorn's trio server writes to the socket inside a shielded cancel scope
        (``TCPServer.protocol_send`` in ``hypercorn/trio/tcp_server.py``): a peer that stops
        reading (its receive window at zero) holds that write, and the ASGI ``send`` that made
        it, until the peer goes away. No deadline of ours can end it, and neither can the
        graceful timeout: the connection's task waits for the shielded write, so a shutdown
        would wait for it too. On Linux the kernel can end it: with ``TCP_USER_TIMEOUT`` it
        drops a connection whose data has stayed unacknowledged, or unsent behind a zero
        window, for ``stalled_send_s``. The write then fails, hypercorn handles the connection
        as closed, and the app is told the client disconnected (STREAM-13). The timeout counts
        only while data waits for the peer: an idle connection, a slow reader that keeps
        taking data, or a client sending an upload are not affected.

        So that a peer gone without a word (a laptop asleep, a phone off the network: its FIN
        or RST never comes) does not hold an idle connection for good, accepted sockets also
        inherit TCP keepalive, its first probe after ``stalled_send_s`` of silence and the
        next as far apart: a probe is data waiting for the peer, so the same
        ``TCP_USER_TIMEOUT`` drops the connection once it goes unanswered. A replay stream
        subscriber waiting for events sends nothing, and one whose peer had vanished held its
        slot (of ``stream_max_subscribers``) until the next event: on a quiet night, followers
        that reconnected after their network came back were refused 503 for good (STREAM-152).
        A peer that is there answers the probes in its kernel, unseen by the app.
        """
        try:
            sockets = super().create_sockets()
        except OSError as exc:
            # Said as the system says it (exit 3), naming the address that was asked for: a
            # port in use, or a host that does not resolve, would otherwise not say which.
            raise CannotListen(
                exc.errno, f"cannot listen on {', '.join(self.bind)}: {exc.strerror or exc}"
            ) from None
        if sys.platform == "linux":
            user_timeout_ms = max(1, round(self.stalled_send_s * 1000))
            # Whole seconds, at least one; the kernel takes at most 32,767.
            probe_s = min(KEEPALIVE_MAX_S, max(1, round(self.stalled_send_s)))
            for sock in sockets.insecure_sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe_s)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe_s)
        return sockets


def hypercorn_config(config: ServeConfig) -> _HypercornConfig:
    host = f"[{config.host}]" if ":" in config.host and "[" not in config.host else config.host
    hc = _HypercornConfig()
    hc.stalled_send_s = config.stream_send_timeout_s
    hc.contained = FaultLog(log, logging.WARNING)
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = config.graceful_timeout_s + COMMIT_GRACE_S
    hc.keep_alive_timeout = config.keep_alive_timeout_s
    hc.h11_max_incomplete_size = MAX_HEADER_BYTES
    hc.websocket_max_message_size = MAX_CLIENT_MESSAGE_BYTES
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def serve(
    data: DataDir,
    config: ServeConfig,
    *,
    shutdown: trio.Event | None = None,
    response_timeout_s: float = RESPONSE_TIMEOUT_S,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until a signal or ``shutdown``; report the base URL once listening.

    ``response_timeout_s`` bounds sending a response whose body is whole (``create_app``).
    """
    stop = shutdown if shutdown is not None else trio.Event()
    _raise_open_file_limit()
    if faultplan.load_environment() is not None:
        os.environ[faultplan.SERVE_PID_ENV] = str(os.getpid())
    # The signals are watched until the runtime has stopped too, not only while HTTP is served.
    async with trio.open_nursery() as watching:
        watching.start_soon(_on_signals, stop, config.graceful_timeout_s)
        listening = trio.Event()
        with trio.CancelScope() as starting:
            watching.start_soon(_stop_starting, stop, starting, listening)
            await _serve(data, config, stop, listening, response_timeout_s, task_status)
        watching.cancel_scope.cancel()
    if starting.cancelled_caught:
        raise StoppedBeforeListening


class StoppedBeforeListening(Exception):
    """A signal (or ``shutdown``) stopped ``serve`` before it listened (RUN-163)."""


async def _stop_starting(
    stop: trio.Event, starting: trio.CancelScope, listening: trio.Event
) -> None:
    """Cancel ``starting`` at a stop that comes before ``serve`` listens: its journal check, 2.9 s
    at 4 years read from the disk, is interrupted (RUN-163), where it ran to its end, then
    listened and stopped. A stop once it listens is hypercorn's graceful shutdown."""
    await stop.wait()
    if not listening.is_set():
        starting.cancel()


def _raise_open_file_limit() -> None:
    """Raise the soft limit of open files to the hard one, as far as the system lets.

    Every connection holds a file descriptor while it lasts. Started from a shell or a
    container rather than with systemd's ``LimitNOFILE``, the service had the soft limit of
    1,024 (its hard limit often 4,096 to 524,288): a thousand connections from one client, idle
    ones kept for the 30 s keep-alive timeout, used them all up, and a phone's delivery waited
    unaccepted meanwhile (SERVE-80). The hard limit is the administrator's; the soft one is a
    default meant for programs that do not expect many files.
    """
    if sys.platform == "win32":
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _serve(
    data: DataDir,
    config: ServeConfig,
    stop: trio.Event,
    started: trio.Event,
    response_timeout_s: float,
    task_status: trio.TaskStatus[str],
) -> None:
    listening = hypercorn_config(config)
    listening.bind_now()
    try:
        with data.open_tokens() as tokens:
            async with (
                open_runtime(configured(data.path, config, serve=True)) as runtime,
                trio.open_nursery() as nursery,
            ):
                snapshots = SnapshotService(runtime, data.snapshot_dir, data.signing_key())
                app = create_app(
                    runtime,
                    TokenCache(tokens),
                    config,
                    snapshots,
                    stop,
                    response_timeout_s=response_timeout_s,
                )

                async def http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                    await hypercorn_serve(
                        app,
                        listening,
                        shutdown_trigger=stop.wait,
                        task_status=_Reporting(task_status, started),
                    )
                    nursery.cancel_scope.cancel()

                nursery.start_soon(app.intake.cut_uploads, stop, config.graceful_timeout_s)
                nursery.start_soon(_advise_reindex, runtime, data)
                binds = await nursery.start(http)
                task_status.started(binds[0])
    finally:
        listening.close_unused()


class _Reporting(trio.TaskStatus[list[str]]):
    """hypercorn's report that it listens, passed on once ``listening`` is set, in the same step:
    a stop from then on is hypercorn's graceful shutdown (RUN-179). Set after the report had
    reached ``serve``, a scheduling round later, a stop that came in between (a signal as it
    began to listen) was taken for one before it listened by ``_stop_starting``, which ran first
    in about half such starts: ``serve`` was cancelled, its URL reported all the same, and
    ``StoppedBeforeListening`` escaped after it."""

    def __init__(self, task_status: trio.TaskStatus[list[str]], listening: trio.Event) -> None:
        self._task_status = task_status
        self._listening = listening

    def started(self, value: list[str] | None = None) -> None:
        assert value is not None, "hypercorn reports the addresses it listens on"
        self._listening.set()
        self._task_status.started(value)


async def _advise_reindex(runtime: Runtime, data: DataDir) -> None:
    """After an upgrade whose migration found objects folded otherwise, say to reindex: the
    README's upgrade section alone said so, and a store missing records served on without a
    word (CLI-182). Once the store is checked, which ``serve`` does while it listens (RUN-162)."""
    if not await runtime.store_checked():
        return
    advised = await runtime.read_store(Store.reindex_advised)
    if advised:
        log.warning("%s", reindex_advice(advised, data.path))


async def _on_signals(stop: trio.Event, graceful_timeout_s: float) -> None:
    """Stop at the first SIGINT (unless ignored as the service started: a script's ``&`` job,
    RUN-175), SIGTERM or SIGHUP (a hangup: the terminal or SSH session the service was started
    from closed, unless it runs under ``nohup``; RUN-76), saying so. One
    more within ``REPEATED_SIGNAL_S`` is the same stop delivered twice (``timeout`` signals the
    service and then its process group; a kill of the group reaches it beside its parent's; a
    shell hanging up signals its jobs as the terminal does) and changes nothing; a later one is
    someone insisting, and stops at once, as a second Ctrl-C does (``healthlog: interrupted``,
    130).

    Once a signal has stopped the service, they all stay ignored when the watch ends: the
    process is on its way out, and the same stop once more (queued in the receiver as it closed,
    which delivers it again, or just after) raised KeyboardInterrupt (130) through trio's
    handler, or with the default one killed the process (-15), after a clean stop (RUN-58). So
    the receiver is opened with them ignored, which it puts back as it closes; stopped otherwise
    (the ``shutdown`` event), the handlers from before are put back."""
    stopping = stopping_signals()
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in stopping}
    first: float | None = None
    try:
        with trio.open_signal_receiver(*stopping) as signals:
            async for signum in signals:
                now = trio.current_time()
                if first is None:
                    first = now
                    _say_stopping(signal.Signals(signum), graceful_timeout_s)
                    stop.set()
                elif now - first > REPEATED_SIGNAL_S:
                    raise KeyboardInterrupt
    finally:
        if first is None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _say_stopping(signum: signal.Signals, graceful_timeout_s: float) -> None:
    """The line that says why the service stops: without it a log ended the same whether the
    service was stopped or killed. A hangup is said at WARNING with what keeps the service
    running past its terminal: an SSH logout stopped it, which its user seldom means (RUN-76)."""
    if signum == signal.SIGHUP:
        log.warning(
            "stopping on SIGHUP: the terminal or SSH session it was started from has closed;"
            " uploads in flight may finish within %g s. To keep it serving after a logout, run"
            " it under systemd or with nohup (README)",
            graceful_timeout_s,
        )
    else:
        log.info(
            "stopping on %s: uploads in flight may finish within %g s",
            signum.name,
            graceful_timeout_s,
        )
