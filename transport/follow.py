"""``healthlog follow``: the reference replay subscriber (R7).

It keeps a local replica equal to the server's objects. Frames are read and decoded ahead
while the previous batch of events is applied and the cursor advanced in one replica
transaction; the ACK sent is the highest contiguous durable sequence, and a follower stopped
(cancelled) sends one last ACK before it closes the stream. On ``CURSOR_TOO_OLD``
(or when the server's stream changed) it downloads the signed snapshot into a temporary file
beside the replica and reads it back through the same descriptor, never by name (STREAM-129,
STREAM-130): it checks schema, sha256, signature, instance and stream binding and
sequence, restores it a line at a time in one replica transaction, and resumes strictly after
the snapshot. A stream connection is used only once the status, read again after it opened,
still names the stream the session started with. It reconnects with backoff after a broken or
refused connection, a close for being too slow, an HTTP 5xx, and a snapshot reference gone
stale (404) before its fetch; a connection silent past its keepalive time and the ping's, a
request not answered within its timeout, a snapshot download that falls below its pace (stalled
or trickled), a snapshot at its cursor, and a service whose store went
back behind its cursor (restored from a backup: it then restores the snapshot) are retried
alike. The replica keeps the tag of the event at its cursor and resumes with it: a service
whose event at that seq is another (its store went back and then on with other changes, or a
copy of its data directory) refuses it ``diverged``, and the snapshot is restored. A token
that cannot be sent as a header value is refused before connecting, and a request of its own
that is not valid HTTP stops it: no retry could send either. What it logs of an error never
quotes a request (a header value, the token's included). One follower at a time writes a
replica: a second is refused. A replica ``-wal`` that another program's read transaction keeps
from being checkpointed, growing with every batch, is said once while it lasts (STREAM-124).

For ``https://`` and ``wss://`` URLs both the HTTP calls and the websocket go over TLS, verified
with one ``ssl.SSLContext`` (by default the system's trust store, checking the host name), and
the websocket's TLS handshake completes before the upgrade request (with the token) is sent.
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import functools
import hashlib
import logging
import math
import os
import shlex
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, BinaryIO, TypeVar

import attrs
import cattrs
import httpx
import orjson
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from healthlog import faults, snapshots
from healthlog.acks import AckTracker
from healthlog.documents import AckFrame, Manifest, ObjectChanged, StreamInfo, converter, dumps
from healthlog.objects import ObjectKey, from_wire
from healthlog.snapshots import SnapshotError
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, StorageError, describe
from healthlog.storage.replica import (
    REPLICA_FILE,
    Change,
    Replica,
    ReplicaInUse,
    ReplicaMismatch,
)
from healthlog.timestamps import parse_instant

log = logging.getLogger("healthlog.follow")
_T = TypeVar("_T")

MAX_MESSAGE_BYTES = 256 * 2**20
RECEIVE_BYTES = 256 * 2**10
CLOSE_TIMEOUT_S = 5.0
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
# The longest wait a refusal's ``Retry-After`` gets (the service asks 30 s for a full stream and
# 60 s for a snapshot it cannot build; a front may ask for hours, or a date a clock gone wrong
# puts far ahead).
RETRY_AFTER_MAX_S = 300.0
ACK_EVERY = 64
ACK_IDLE_S = 0.2
# How long a follower stopped (SIGINT, SIGTERM: cancelled) may take to send its last ACK and
# close the stream, so that the server knows where a named subscriber stands; it never delays
# the stop by more.
LAST_ACK_S = 1.0
BATCH = 512
# Frames decoded ahead while a batch is applied: READ_AHEAD pieces of at most READ_SIZE.
READ_AHEAD = 8
READ_SIZE = 64
CONNECT_TIMEOUT_S = 30.0
# A stream connection silent this long is pinged, and one silent as long again (no pong, no
# frame) is lost: a server gone without a word (a power cut, a NAT or a proxy that dropped the
# connection) sends no FIN, and an idle follower sends nothing that could meet a reset. A ping
# also keeps a reverse proxy's read timeout (nginx: 60 s) from closing an idle stream.
KEEPALIVE_S = 30.0
# How long a status, key or snapshot reference request may take in all, and how large its
# answer may be: a server or a front that trickles or never ends its answer cannot hold
# ``follow`` up or fill its memory.
REQUEST_TIMEOUT_S = 30.0
MAX_JSON_BYTES = 16 * 2**20
# A snapshot download must bring SNAPSHOT_PACE_BYTES within SNAPSHOT_WINDOW_S of its request,
# and each further SNAPSHOT_PACE_BYTES within as long again: a server or a front that stalls or
# trickles the body is a lost connection, retried after the backoff. No overall time limit: a
# large snapshot from a NAS is legitimately slow. 256 KiB a minute (about 4.4 KB/s, 35 kbit/s)
# is far below any link a follower runs over, and a real download only falls below it stalled.
SNAPSHOT_WINDOW_S = 60.0
SNAPSHOT_PACE_BYTES = 256 * 2**10
# Free space a snapshot download leaves on the replica's filesystem: the restore then writes the
# objects into the replica, and the disk is shared. A body larger than the rest (a server's
# endless or hostile answer) stops the follower instead of filling the disk at every retry.
SNAPSHOT_RESERVE_BYTES = 64 * 2**20
# Error frames after which reconnecting, with backoff, from the acknowledged cursor is the remedy.
# CURSOR_IN_FUTURE: the service's store went back (restored from a backup) since its status
# was read; the next session sees its head behind the cursor and restores its snapshot.
RETRYABLE = frozenset({"TOO_SLOW", "GOING_AWAY", "CURSOR_IN_FUTURE"})
STREAM_PATH = "/v1/stream"
# The longest subscriber name the service takes (``transport.stream.MAX_SUBSCRIBER``).
MAX_SUBSCRIBER = 128
# The longest event tag kept and sent back (the service's are 16 hex digits).
MAX_TAG = 64
# The stream's close code for a missing, unknown or revoked token (interfaces.md).
CLOSE_UNAUTHORIZED = 4401
# What a refused token stops ``follow`` with, whenever it is refused: a 401 to a request or to
# the websocket upgrade, or the stream's ``UNAUTHORIZED`` (a token revoked while it follows) or
# close 4401 alone.
TOKEN_REFUSED = (
    "the server refused the token: it was revoked, or is not one of this service's"
    " (healthlog token add NAME, run on the service, makes a new one)"
)


UPGRADE_LOST = (
    "the server refused the stream (426): the request reached it without its websocket upgrade;"
    " a reverse proxy in front of it must pass the Upgrade and Connection headers on"
)
"""What a 426 means (SERVE-82): the service answers so a stream request that came as a plain
HTTP request, as one does through a proxy not set up for websockets (CLI-125)."""

LASTING_REFUSALS = {
    "STORE_DAMAGED": "its store.sqlite is damaged",
    "STORE_FROM_ANOTHER_JOURNAL": "its store.sqlite was folded from another journal",
}
"""The service's 503s that last until its owner acts, by their error code (SERVE-150,
STREAM-205), in this module's words (never the server's): said at WARNING at the first, where a
lost connection is said only once the backoff has grown to its longest (STREAM-206)."""
LASTING_AFTER = (
    ": it journals deliveries and folds none until it is started again with the store moved away"
    " (its log says how)"
)
REFUSAL_BYTES = 4096
"""The most of a refusal's body read for its error code: healthlog's are some 250 bytes."""


class FollowError(Exception):
    """A reason to stop following for good (a wrong token, another instance, a bad snapshot)."""


class ConnectionLost(Exception):
    """The stream connection was refused, broken or closed: reconnecting is the remedy, after
    ``retry_after_s`` at least when the refusal said so (its ``Retry-After``). ``lasting`` says
    why a refusal lasts until the service's owner acts (``LASTING_REFUSALS``)."""

    def __init__(
        self, reason: str, retry_after_s: float | None = None, *, lasting: str | None = None
    ) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.lasting = lasting


def lasting_refusal(body: bytes) -> str | None:
    """Why a refusal whose body is ``body`` lasts until the service's owner acts, in this
    module's words; None for any other refusal, or a body that is not healthlog's."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    code = document.get("error") if isinstance(document, dict) else None
    return LASTING_REFUSALS.get(code) if isinstance(code, str) else None


def retry_after_s(value: str | None, now: datetime) -> float | None:
    """The seconds a ``Retry-After`` value asks to wait (RFC 9110: a number of seconds, or an
    HTTP date, counted from ``now``; one past is 0); None without one, or for anything else."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - now).total_seconds())


def _retried(status: int) -> bool:
    """Whether an answer of ``status`` is a lost connection, retried after the backoff or its
    ``Retry-After``: a 5xx (a server restarting, a proxy in front of one), or 429 Too Many
    Requests, a front's rate limit (Traefik's RateLimit, Caddy's rate_limit), which a burst of
    reconnects meets. Any other refusal stops ``follow`` for good; a 429 did (STREAM-139)."""
    return status >= 500 or status == HTTPStatus.TOO_MANY_REQUESTS


def _asked_wait(headers: httpx.Headers) -> float | None:
    """What the ``Retry-After`` of a 5xx or 429 answer asks (a full stream, a snapshot the
    service cannot build, a front's own 503 or rate limit)."""
    return retry_after_s(headers.get("retry-after"), datetime.now(UTC))


def close_retry_after_s(reason: str) -> float | None:
    """What a stream close's reason asks to wait: its ``retry-after=`` parameter after the code
    (``SNAPSHOT_UNAVAILABLE; retry-after=60``), read as a ``Retry-After``; None without one."""
    for parameter in reason.split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "retry-after":
            return retry_after_s(value, datetime.now(UTC))
    return None


def check_token(token: str) -> None:
    """Refuse (FollowError) a token that cannot be sent as an HTTP header value: one is visible
    ASCII without spaces (``hl_`` and URL-safe base64). The message never holds the token."""
    if not token or not all("!" <= char <= "~" for char in token):
        raise FollowError(
            "the token cannot be sent in an HTTP header: it is empty or holds a space, a control "
            "character (a newline copied with it?) or a character that is not ASCII"
        )


def check_subscriber(name: str | None) -> None:
    """Refuse (FollowError) a subscriber name the service refuses (``BAD_SUBSCRIBER``): one is
    1 to ``MAX_SUBSCRIBER`` printable characters, as ``transport.stream`` checks it. Checked
    before anything connects: the service's refusal came after the replica was made, as the
    code ``BAD_SUBSCRIBER`` alone (CLI-126)."""
    if name is not None and not (0 < len(name) <= MAX_SUBSCRIBER and name.isprintable()):
        raise FollowError(
            f"a subscriber name is 1 to {MAX_SUBSCRIBER} printable characters (no control"
            " character, a newline copied with it?)"
        )


@attrs.frozen
class Endpoints:
    http: str
    ws_host: str
    ws_port: int
    ws_path: str
    tls: bool

    @property
    def authority(self) -> str:
        """The websocket request's ``Host``: the host, and the port unless it is the scheme's."""
        host = f"[{self.ws_host}]" if ":" in self.ws_host else self.ws_host
        return host if self.ws_port == (443 if self.tls else 80) else f"{host}:{self.ws_port}"

    @classmethod
    def parse(cls, url: str) -> Endpoints:
        """From the service's base URL (``http://host:8787``, or ``https://nas/healthlog`` behind
        a proxy) or its stream URL (``ws://host:8787/v1/stream``)."""
        try:
            parts = urllib.parse.urlsplit(url)
            given_port = parts.port
        except ValueError:
            raise FollowError(f"not a service or stream URL: {url}") from None
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
            raise FollowError(f"not a service or stream URL: {url}")
        try:
            # As the look-up asks for it: a name with an empty label (a typo's ``..``, a leading
            # dot) or one over 63 characters ended ``follow`` with a traceback (CLI-273).
            parts.hostname.encode("idna")
        except UnicodeError:
            raise FollowError(f"not a service or stream URL: {url}") from None
        tls = parts.scheme in ("https", "wss")
        port = given_port or (443 if tls else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        # A path is where a reverse proxy serves the service: every request goes under it.
        prefix = parts.path.rstrip("/").removesuffix(STREAM_PATH)
        http = f"{'https' if tls else 'http'}://{host}:{port}{prefix}"
        return cls(http, parts.hostname, port, prefix + STREAM_PATH, tls)


@attrs.define
class Follower:
    """One follower of one service into one replica."""

    endpoints: Endpoints
    token: str
    replica: Replica
    subscriber: str | None = None
    until_caught_up: bool = False
    on_event: Callable[[int], None] | None = None
    _target: int | None = None
    # Trust for https:// and wss:// (None: the system's trust store, host names checked).
    ssl_context: ssl.SSLContext | None = attrs.field(default=None, kw_only=True)
    # How long connecting, the TLS handshake and the websocket handshake may take together.
    connect_timeout_s: float = attrs.field(default=CONNECT_TIMEOUT_S, kw_only=True)
    # How long a stream connection may stay silent before a ping, and after it.
    keepalive_s: float = attrs.field(default=KEEPALIVE_S, kw_only=True)
    # How long one status, key or snapshot reference request may take in all.
    request_timeout_s: float = attrs.field(default=REQUEST_TIMEOUT_S, kw_only=True)
    # The snapshot key the server must have, pinned in place of another one (--accept-key).
    accept_key: str | None = attrs.field(default=None, kw_only=True)
    # Free space a snapshot download must leave on the replica's filesystem.
    snapshot_reserve_bytes: int = attrs.field(default=SNAPSHOT_RESERVE_BYTES, kw_only=True)
    # How long a snapshot download may take to bring each SNAPSHOT_PACE_BYTES.
    snapshot_window_s: float = attrs.field(default=SNAPSHOT_WINDOW_S, kw_only=True)
    # The wait before the next reconnect; back to the start once a connection made progress.
    _backoff: float = attrs.field(default=BACKOFF_START_S, init=False)
    # Whether the WARNING that reconnecting gets nowhere was logged since the last progress.
    _warned: bool = attrs.field(default=False, init=False)
    # The lasting refusal said at WARNING since the last progress (STREAM-206).
    _said: str | None = attrs.field(default=None, init=False)
    # The replica's cursor and the service's head last said to have gone back behind it.
    _went_back: tuple[int, int] | None = attrs.field(default=None, init=False)
    # Whether the replica has met its service (bound to it), in this run or an earlier one.
    _met: bool = attrs.field(default=False, init=False)
    # The sequence of the snapshot this run restored last: the tag it gave the replica is the
    # service's own, and needs no check before ``until_caught_up`` ends at it.
    _restored: int | None = attrs.field(default=None, init=False)
    # Whether the WARNING that a reader keeps the replica's -wal from being checkpointed was
    # logged, and not yet the INFO that it is checkpointed again (STREAM-124).
    _wal_held: bool = attrs.field(default=False, init=False)

    async def run(self) -> None:
        """Follow until caught up (with ``until_caught_up``) or cancelled; reconnect on breaks.
        A replica directory every user may write in is said in one WARNING, with the ``chmod``
        that mends it (STREAM-132), as the service says of its data directory (STORE-97), the
        directory quoted as a shell reads it (STREAM-190)."""
        mode = self.replica.open_mode()
        if mode is not None:
            directory = os.path.dirname(self.replica.path)
            log.warning(
                "follow: the replica directory %s (mode %04o) is one every user of the machine"
                " may write in: any of them may remove or replace %s there between runs;"
                " `chmod go-w %s` makes it writable by its owner alone",
                directory,
                mode,
                REPLICA_FILE,
                shlex.quote(directory),
            )
        with self.replica.following():
            await self._run()

    async def _run(self) -> None:
        context = ssl.create_default_context() if self.ssl_context is None else self.ssl_context
        self._met = (await trio.to_thread.run_sync(self.replica.binding)).instance is not None
        # No timeout of the HTTP client's own (5 s without a byte by default): every request
        # is bounded by ours, ``request_timeout_s`` in all or the snapshot download's pace,
        # which a disk spinning up or a link's handover pausing an answer for 5 s keeps.
        async with httpx.AsyncClient(
            base_url=self.endpoints.http,
            headers={"Authorization": f"Bearer {self.token}"},
            verify=context,
            timeout=None,
        ) as http:
            while True:
                done = False
                lost: BaseException | None = None
                unsendable: str | None = None
                try:
                    done = await self._session(http, context)
                except* httpx.LocalProtocolError as group:
                    # Our own request is not valid HTTP (a header value): no retry can send it.
                    unsendable = _reason(group)
                except* (OSError, httpx.TransportError, ConnectionLost) as group:
                    lost = _first(group)
                    reason = _reason(group)
                    log.info("follow: connection lost (%s)", reason)
                    lasting = lost.lasting if isinstance(lost, ConnectionLost) else None
                    self._warn(reason, self._asked(lost), lasting)
                if unsendable is not None:
                    raise FollowError(
                        f"a request of ours is not valid HTTP ({unsendable}): retrying cannot "
                        "send it"
                    )
                if done:
                    return
                if lost is not None:
                    await trio.sleep(self._wait(lost))
                    self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _warn(self, reason: str, asked: float | None, lasting: str | None = None) -> None:
        """The one WARNING of a run of failures, when it is due, saying the wait before the
        next try: ``asked`` when a refusal's ``Retry-After`` asks for longer than the backoff
        (STREAM-117), else the backoff's cadence. A refusal that lasts until the service's owner
        acts (``lasting``: its store found damaged) is said at once, once while it lasts: the
        WARNING came a minute later and said only `the stream ended` (STREAM-206)."""
        if lasting is not None and lasting != self._said:
            self._said = lasting
            self._warned = True
            log.warning(
                "follow: the service cannot be followed: %s%s; retrying, at most every %.0f s",
                lasting,
                LASTING_AFTER,
                BACKOFF_MAX_S,
            )
            return
        if self._warned or (self._met and self._backoff < BACKOFF_MAX_S):
            return
        self._warned = True
        if asked is not None:
            retrying = f"retrying in {asked:g} s, as the server asks"
        elif not self._met:
            retrying = f"retrying, at most every {BACKOFF_MAX_S:.0f} s"
        else:
            retrying = f"retrying every {BACKOFF_MAX_S:.0f} s"
        if not self._met:
            # A replica that never met its service: a mistyped URL, or a service not running,
            # said at once rather than after a minute of retries.
            log.warning("follow: the service cannot be reached (%s); %s", reason, retrying)
        else:
            # Quiet retries at INFO are invisible at a command's default level.
            log.warning(
                "follow: no progress for a while, the last connection lost (%s); %s",
                reason,
                retrying,
            )

    def _asked(self, lost: BaseException) -> float | None:
        """The wait a refusal's ``Retry-After`` asks for when it is longer than the backoff
        (else None), up to ``RETRY_AFTER_MAX_S``."""
        asked = lost.retry_after_s if isinstance(lost, ConnectionLost) else None
        if asked is None or asked <= self._backoff:
            return None
        return min(asked, RETRY_AFTER_MAX_S)

    def _wait(self, lost: BaseException) -> float:
        """How long to wait before reconnecting after ``lost``, said in one line: the backoff,
        or what a refusal's ``Retry-After`` asked for when that is longer, up to
        ``RETRY_AFTER_MAX_S`` (a full stream, STREAM-107; a snapshot the service cannot build,
        asked by ``GET /v1/snapshots`` or the stream's close, STREAM-118)."""
        asked = lost.retry_after_s if isinstance(lost, ConnectionLost) else None
        wait = self._asked(lost)
        if asked is None or wait is None:
            log.info("follow: retrying in %.1f s", self._backoff)
            return self._backoff
        log.info(
            "follow: retrying in %.1f s, as the server asks (Retry-After: %g s%s)",
            wait,
            asked,
            f", {RETRY_AFTER_MAX_S:g} s at most" if asked > RETRY_AFTER_MAX_S else "",
        )
        return wait

    def _progressed(self) -> None:
        """A connection made progress: the next reconnect waits the first backoff again, and
        a new run of failures may be warned about again."""
        self._backoff = BACKOFF_START_S
        self._warned = False
        self._said = None

    async def _session(self, http: httpx.AsyncClient, context: ssl.SSLContext) -> bool:
        """One connection; True when done (caught up)."""
        stream = await self._server_stream(http)
        key = _structured(await self._get_json(http, "/v1/snapshots/key"), _Key, "the snapshot key")
        replaced = await trio.to_thread.run_sync(
            self.replica.bind, stream.instance, key.public_key, self.accept_key
        )
        if replaced:
            log.warning(
                "follow: pinned the server's new snapshot key %s, as --accept-key says",
                key.public_key,
            )
        self._met = True
        binding = await trio.to_thread.run_sync(self.replica.binding)
        if binding.stream is None and stream.oldest_cursor == 0:
            await trio.to_thread.run_sync(self.replica.restore, stream.id, 0, [])
            binding = await trio.to_thread.run_sync(self.replica.binding)
        elif binding.stream != stream.id or binding.cursor > stream.head:
            went_back = (binding.cursor, stream.head)
            if binding.stream == stream.id and went_back != self._went_back:
                # The service's store went back (restored from a backup): the events the
                # replica has past its head are gone from it, and their numbers will be given
                # to other changes. Only its snapshot makes the replica equal to it again. Said
                # once while the same: a snapshot the service refuses (its store found damaged)
                # is asked for again at each retry, and so was this said (STREAM-207).
                self._went_back = went_back
                log.warning(
                    "follow: the service's stream went back from seq %d to %d (its store"
                    " restored from a backup?); restoring its snapshot",
                    binding.cursor,
                    stream.head,
                )
            document = await self._get_json(http, "/v1/snapshots")
            manifest = _structured(document, Manifest, "the snapshot reference")
            await self._restore(http, manifest, after=0, stream=None)
            binding = await trio.to_thread.run_sync(self.replica.binding)
            # Caught up is with the head of the stream now followed, not of one before it.
            self._target = stream.head
        if self._target is None:
            self._target = stream.head
        if (
            self.until_caught_up
            and self.subscriber is None
            and binding.cursor >= self._target
            and (binding.tag is None or binding.cursor == self._restored)
        ):
            # With the tag of the event at its cursor (not from a snapshot this run just
            # restored), the stream connection checks that the service still holds that
            # event (STREAM-112), also at the head.
            return True
        return await self._stream(http, context, binding.cursor, stream.id, binding.tag)

    async def _stream(
        self,
        http: httpx.AsyncClient,
        context: ssl.SSLContext,
        after: int,
        stream: str,
        tag: str | None = None,
    ) -> bool:
        query = {"after": str(after)}
        if tag is not None:
            # The service refuses a cursor whose event it holds as another (STREAM-111).
            query["tag"] = tag
        if self.subscriber is not None:
            query["subscriber"] = self.subscriber
        resource = f"{self.endpoints.ws_path}?{urllib.parse.urlencode(query)}"
        # A server (or a proxy) that takes the connection and never answers is a lost one.
        deadline = trio.current_time() + self.connect_timeout_s
        with trio.move_on_at(deadline) as connecting:
            tcp: trio.abc.Stream = await trio.open_tcp_stream(
                self.endpoints.ws_host, self.endpoints.ws_port
            )
        if connecting.cancelled_caught:
            raise ConnectionLost(f"no connection within {self.connect_timeout_s} s")
        try:
            with trio.move_on_at(deadline) as opening:
                if self.endpoints.tls:
                    tcp = trio.SSLStream(
                        tcp, context, server_hostname=self.endpoints.ws_host, https_compatible=True
                    )
                    try:
                        await tcp.do_handshake()
                    except trio.BrokenResourceError as exc:
                        raise ConnectionLost(f"TLS handshake failed: {exc.__cause__}") from None
                ws = StreamSocket(tcp)
                await ws.open(
                    self.endpoints.authority,
                    resource,
                    [(b"authorization", f"Bearer {self.token}".encode())],
                )
            if opening.cancelled_caught:
                raise ConnectionLost(f"no websocket handshake within {self.connect_timeout_s} s")
            # The service may have restarted on another stream (a new store) since its status
            # was read, and the frames would then be that stream's, past a cursor of another:
            # the status is read again once this connection is open (a restart after that
            # breaks it), and a changed stream starts the session over.
            now = await self._server_stream(http)
            if now.id != stream:
                raise ConnectionLost("the service's stream changed while connecting")
            if now.head < after:
                # Its store restored from a backup meanwhile: the next session restores.
                raise ConnectionLost("the service's stream went back while connecting")
            return await self._receive(http, ws, after, stream, checked=tag is None)
        finally:
            await tcp.aclose()

    async def _receive(
        self,
        http: httpx.AsyncClient,
        ws: StreamSocket,
        after: int,
        stream: str,
        *,
        checked: bool = True,
    ) -> bool:
        """Apply frames in batches while the next ones are read and decoded; unless
        ``checked``, the cursor's tag was sent, and it is caught up only once an event came."""
        batches_in, batches = trio.open_memory_channel[_Batch](READ_AHEAD)
        refused: FollowError | StorageError | None = None
        acks = _Acks(AckTracker(after), after)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_ahead, ws, batches_in)
                try:
                    done = await self._apply(http, ws, batches, acks, stream, checked=checked)
                except (FollowError, StorageError) as exc:
                    # Raised again below, outside the nursery: callers catch these by type.
                    refused, done = exc, False
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if _stopped(exc):
                await _last_ack(ws, acks)
            raise
        if refused is not None:
            raise refused
        if done:
            await ws.aclose()
        return done

    async def _apply(
        self,
        http: httpx.AsyncClient,
        ws: StreamSocket,
        batches: trio.MemoryReceiveChannel[_Batch],
        sent: _Acks,
        stream: str,
        *,
        checked: bool = True,
    ) -> bool:
        """Apply each batch in one replica transaction and acknowledge; True once caught up,
        and, unless ``checked`` (the cursor's tag was sent), an event came: the one at the
        cursor, sent again, says that the service holds it (STREAM-112), or, where it can no
        longer tell (pruned to the cursor), one after it."""
        acks = sent.tracker
        while True:
            if checked and self._caught_up(acks.contiguous):
                await ws.send(_ack_frame(acks.contiguous))
                return True
            if acks.contiguous - sent.acked >= ACK_EVERY:
                await sent.send(ws)
            with trio.move_on_after(ACK_IDLE_S) as idle:
                try:
                    batch = await batches.receive()
                except trio.EndOfChannel:
                    raise ws.ended("the stream ended") from None
            if idle.cancelled_caught:
                if acks.contiguous > sent.acked:
                    await sent.send(ws)
                await self._keep_alive(ws)
                continue
            while (
                len(batch.seqs) <= BATCH - READ_SIZE
                and not batch.errors
                and batch.malformed is None
            ):
                try:
                    batch = batch.joined(batches.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            skipped = batch.gap(acks.contiguous)
            if skipped is not None:
                batch = batch.before(skipped)
            checked = checked or bool(batch.seqs)
            if batch.seqs:
                await trio.to_thread.run_sync(
                    self.replica.apply,
                    stream,
                    batch.changes,
                    batch.seqs[-1],
                    _tag(batch.tags[-1]),
                )
                self._progressed()
                for seq in batch.seqs:
                    acks.durable(seq)
                    if self.on_event is not None:
                        self.on_event(seq)
                await self._watch_wal()
            if skipped is not None:
                # Never past a gap (R3): from the cursor, the server sends the event or a
                # snapshot.
                raise ConnectionLost(f"the stream skipped from seq {acks.contiguous} to {skipped}")
            if batch.malformed is not None:
                raise FollowError(
                    f"the server sent a frame that is not healthlog's: {batch.malformed}"
                )
            for error in batch.errors:
                if error.get("code") == "CURSOR_TOO_OLD":
                    manifest = _structured(
                        error.get("snapshot"), Manifest, "the snapshot reference"
                    )
                    if error.get("diverged") is True:
                        # The service's event at the cursor is another than the one applied:
                        # its store went back (restored from a backup, or another copy of its
                        # data directory) and then on with other changes under the same
                        # numbers. Only its snapshot, even one at the cursor, makes the
                        # replica equal to it again.
                        log.warning(
                            "follow: the service's stream holds other changes than the"
                            " replica's at seq %d (its store restored from a backup, or a"
                            " copy of its data directory?); restoring its snapshot",
                            acks.contiguous,
                        )
                    elif manifest.seq == acks.contiguous:
                        # Nothing to restore, and reconnecting at once would get the same
                        # answer: a lost connection, retried after the backoff.
                        raise ConnectionLost("the server's snapshot is at the cursor, not past it")
                    await self._restore(http, manifest, after=acks.contiguous, stream=stream)
                    return False
                if error.get("code") in RETRYABLE:
                    raise ConnectionLost(f"the server closed the stream: {error.get('code')}")
                if error.get("code") == "UNAUTHORIZED":
                    raise FollowError(TOKEN_REFUSED)
                raise FollowError(f"the server refused the stream: {error.get('code')}")

    async def _server_stream(self, http: httpx.AsyncClient) -> StreamInfo:
        """The replay stream the service's status names."""
        status = await self._get_json(http, "/v1/status")
        return _structured(
            status.get("stream") if isinstance(status, dict) else None,
            StreamInfo,
            "the server's status",
        )

    async def _get_json(self, http: httpx.AsyncClient, path: str) -> Any:
        """The JSON answer of ``path``; a 5xx (a restarting server, or a proxy in front of one)
        and a front's 429 are a lost connection, 401, any other refusal and a 200 that is not
        JSON (a front's page) are for good. An answer that takes longer than
        ``request_timeout_s`` in all is a lost connection; one larger than ``MAX_JSON_BYTES`` is
        not healthlog's."""
        with trio.move_on_after(self.request_timeout_s) as timer:
            async with http.stream("GET", path) as response:
                if response.status_code == 401:
                    raise FollowError(TOKEN_REFUSED)
                if _retried(response.status_code):
                    raise ConnectionLost(
                        f"{path} answered {response.status_code}",
                        _asked_wait(response.headers),
                        lasting=lasting_refusal(await _refusal_body(response)),
                    )
                if response.status_code != 200:
                    raise FollowError(f"{path} answered {response.status_code}")
                content = bytearray()
                chunks = response.aiter_bytes()
                async for chunk in chunks:
                    content += chunk
                    if len(content) > MAX_JSON_BYTES:
                        await _abandon(response, chunks)
                        raise FollowError(
                            f"{path} answered more than {MAX_JSON_BYTES // 2**20} MiB, not"
                            " healthlog's"
                        )
        if timer.cancelled_caught:
            raise ConnectionLost(f"{path} was not answered within {self.request_timeout_s:g} s")
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            raise FollowError(
                f"{path} answered something that is not JSON, not healthlog's"
            ) from None

    async def _keep_alive(self, ws: StreamSocket) -> None:
        """Between frames: ping a connection silent for ``keepalive_s``; one that reads nothing
        for as long after its ping (not even the pong) is lost. Nothing is waiting to be applied
        here, so the reading task is reading: silence since the ping is the server's. (Silence
        before it can be this side's: frames queued while a slow apply held the reading task
        back came without a read; a ping then only costs a pong.)"""
        now = trio.current_time()
        if ws.pinged > ws.heard:
            if now - ws.pinged >= self.keepalive_s:
                raise ConnectionLost(f"no answer to a ping within {self.keepalive_s:g} s")
        elif now - ws.heard >= self.keepalive_s:
            # A send stalled behind a dead peer's full window is as silent.
            with trio.move_on_after(self.keepalive_s) as sending:
                await ws.ping()
            if sending.cancelled_caught:
                raise ConnectionLost(f"a ping could not be sent within {self.keepalive_s:g} s")

    async def _watch_wal(self) -> None:
        """After a batch applied: say once, while it lasts, that a reader keeps the replica's
        ``-wal`` from being checkpointed, and when it is checkpointed again (STREAM-124), as the
        service says of its own files (RUN-63). Only a ``-wal`` past ``WAL_SIZE_LIMIT`` is looked
        into (a passive checkpoint): SQLite checkpoints it every 1,000 pages and cuts it back to
        that size once no reader holds it, so one that stays past it grows with every batch."""
        size = await trio.to_thread.run_sync(_size, f"{self.replica.path}-wal")
        if size <= WAL_SIZE_LIMIT:
            if self._wal_held:
                self._wal_held = False
                log.info("follow: %s-wal is checkpointed again", self.replica.path)
            return
        if self._wal_held:
            return
        try:
            held = await trio.to_thread.run_sync(self.replica.wal_held_back)
        except StorageError as exc:
            log.debug("follow: checkpoint of the replica not tried: %s", describe(exc))
            return
        if held:
            self._wal_held = True
            log.warning(
                "follow: %s-wal is %d bytes and cannot be checkpointed: a read transaction is"
                " kept open on %s (by another program, such as a database browser, a script or"
                " a backup through SQLite), and every event applied is added to the -wal until"
                " it ends",
                self.replica.path,
                held,
                self.replica.path,
            )

    def _caught_up(self, cursor: int) -> bool:
        return self.until_caught_up and self._target is not None and cursor >= self._target

    async def _restore(
        self, http: httpx.AsyncClient, manifest: Manifest, *, after: int, stream: str | None
    ) -> None:
        """Download the snapshot into a temporary file beside the replica, hashing it; check it
        whole before anything is applied; then apply its objects as they are read, in the
        replica's one transaction, which a bad line or count undoes."""
        binding = await trio.to_thread.run_sync(self.replica.binding)
        assert binding.instance is not None
        assert binding.public_key is not None
        with contextlib.ExitStack() as held:
            with _download_disk(os.path.dirname(self.replica.path)):
                file = held.enter_context(self.replica.snapshot_file())
                faults.point("follow.download")
                room = await trio.to_thread.run_sync(self.replica.room, self.snapshot_reserve_bytes)
                digest = await _download(http, manifest.url, file, room, self.snapshot_window_s)
            try:
                snapshots.check(
                    manifest,
                    digest,
                    public_key=binding.public_key,
                    instance=binding.instance,
                    stream=stream,
                    after=after,
                )
                faults.point("follow.restore")
                count = await trio.to_thread.run_sync(self._restore_file, file, manifest)
            except SnapshotError as exc:
                raise FollowError(f"snapshot refused: {exc}") from None
        self._progressed()
        self._restored = manifest.seq
        log.info("follow: restored snapshot at seq %d (%d objects)", manifest.seq, count)

    def _restore_file(self, file: BinaryIO, manifest: Manifest) -> int:
        """Restore from the download ``file`` read again from its start through the same
        descriptor: the bytes restored are those hashed and checked (STREAM-129)."""
        # The tag of the event at the snapshot's sequence: the next connection checks with it
        # that the service still holds that event (STREAM-116).
        file.seek(0)
        tag = _tag(snapshots.header_tag(file))
        file.seek(0)
        return self.replica.restore(
            manifest.stream, manifest.seq, _stoppable(snapshots.read(file, manifest)), tag
        )


def _stoppable(objects: Iterator[_T]) -> Iterator[_T]:
    """``objects``, read by a restore in a worker thread, which a stop (SIGINT, SIGTERM: the
    follower cancelled) ends at the next object (``trio.Cancelled``, raised in the thread and
    rolling the restore's transaction back) instead of after the last: a snapshot of years of
    objects takes minutes to restore on a NAS, past a service manager's stop timeout
    (STREAM-137)."""
    for obj in objects:
        faults.point("follow.restore_object")
        trio.from_thread.check_cancelled()
        yield obj


@contextlib.contextmanager
def _download_disk(directory: str) -> Iterator[None]:
    """Where the snapshot's download file is made and written: an OSError there is the replica's
    disk refusing it (full, a quota, a file size limit), which no reconnect mends, so it stops
    ``follow`` as the replica's StorageError (exit 3), naming the directory. Taken for a lost
    connection, it had the whole snapshot fetched again after each backoff, for good
    (STREAM-138)."""
    try:
        yield
    except OSError as exc:
        raise StorageError(
            f"the snapshot cannot be downloaded into {directory}: {exc.strerror or exc}"
        ) from None


async def _download(
    http: httpx.AsyncClient,
    url: str,
    file: BinaryIO,
    room: int,
    window_s: float = SNAPSHOT_WINDOW_S,
) -> str:
    """Stream the answer of ``url`` into the open ``file`` a chunk at a time (never a file
    opened by name: STREAM-130); the sha256 of its bytes. An answer of more than ``room``
    bytes, announced or sent, is a FollowError; one that brings less than
    ``SNAPSHOT_PACE_BYTES`` within ``window_s`` of the request or of the last such stretch
    (stalled, or trickled) is a lost connection."""
    with trio.move_on_after(window_s) as window:
        digest = await _download_paced(http, url, file, room, window, window_s)
    if window.cancelled_caught:
        raise ConnectionLost(
            f"the snapshot download brought less than {SNAPSHOT_PACE_BYTES // 2**10} KiB"
            f" within {window_s:g} s"
        )
    return digest


async def _download_paced(
    http: httpx.AsyncClient,
    url: str,
    file: BinaryIO,
    room: int,
    window: trio.CancelScope,
    window_s: float,
) -> str:
    """:func:`_download`'s body: every ``SNAPSHOT_PACE_BYTES`` read move the deadline of
    ``window`` to ``window_s`` from then."""
    digest = hashlib.sha256()
    async with http.stream("GET", url) as response:
        # A fresh reference, from a new connection, cures these: the server removed the file
        # this one named (404), or it is restarting, possibly behind a proxy (5xx), or a front's
        # rate limit (429).
        if response.status_code == 404 or _retried(response.status_code):
            raise ConnectionLost(
                f"snapshot fetch answered {response.status_code}", _asked_wait(response.headers)
            )
        if response.status_code == 401:
            raise FollowError(TOKEN_REFUSED)
        if response.status_code != 200:
            raise FollowError(f"snapshot fetch answered {response.status_code}")
        too_large = (
            f"the snapshot is larger than the {room / 2**20:.1f} MiB the replica's disk has room"
            " for (its free space less a reserve)"
        )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > room:
            raise FollowError(too_large)
        written = paced = 0
        chunks = response.aiter_bytes()
        out = trio.wrap_file(file)
        async for chunk in chunks:
            written += len(chunk)
            if written > room:
                await _abandon(response, chunks)
                raise FollowError(too_large)
            digest.update(chunk)
            try:
                await out.write(chunk)
            except OSError:
                await _abandon(response, chunks)
                raise
            if written - paced >= SNAPSHOT_PACE_BYTES:
                paced = written
                window.deadline = trio.current_time() + window_s
    return digest.hexdigest()


async def _refusal_body(response: httpx.Response) -> bytes:
    """The first ``REFUSAL_BYTES`` of a refusal's body, the rest left unread."""
    body = bytearray()
    chunks = response.aiter_bytes()
    async for chunk in chunks:
        body += chunk
        if len(body) >= REFUSAL_BYTES:
            await _abandon(response, chunks)
            break
    return bytes(body[:REFUSAL_BYTES])


async def _abandon(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Stop reading a body part way: its connection is closed, and the reading, ended by
    that, runs out through every layer of the HTTP client (left suspended, each would only be
    closed when collected)."""
    await response.aclose()
    with contextlib.suppress(httpx.HTTPError):
        async for _ in chunks:
            pass


class StreamSocket:
    """The client side of one stream connection, on wsproto over a trio TCP (or TLS) stream.

    A read of up to ``RECEIVE_BYTES`` hands over every message it completes at once. A
    general client (trio-websocket) reads 4 KiB at a time and passes messages on one per
    scheduling round through a one-slot channel, which held a follower to a few thousand
    frames per second.
    """

    def __init__(self, tcp: trio.abc.Stream) -> None:
        self._tcp = tcp
        self._ws = WSConnection(ConnectionType.CLIENT)
        # Whole messages; None stands for a binary one (healthlog sends text only).
        self._ready: collections.deque[str | None] = collections.deque()
        self._parts: list[str] = []
        self._size = 0
        self._outgoing = bytearray()
        self._accepted = False
        # A refusal of the upgrade whose body is still coming, and the body so far.
        self._rejected: RejectConnection | None = None
        self._rejection = bytearray()
        self._sending = trio.Lock()
        # When bytes last came from the server, and when a ping was last sent.
        self.heard = trio.current_time()
        self.pinged = -math.inf
        # The code and reason of the server's close, once it came.
        self.close_code: int | None = None
        self.close_reason = ""

    async def open(self, host: str, resource: str, headers: list[tuple[bytes, bytes]]) -> None:
        """The opening handshake; messages that arrive with its answer are kept."""
        await self._send_all(
            self._ws.send(Request(host=host, target=resource, extra_headers=headers))
        )
        while not self._accepted:
            await self._read()

    async def receive(self, limit: int) -> list[str | None]:
        """At least one message, and every other one already read, up to ``limit``."""
        while not self._ready:
            await self._read()
        count = min(limit, len(self._ready))
        return [self._ready.popleft() for _ in range(count)]

    async def send(self, message: str) -> None:
        if self._ws.state is not ConnectionState.OPEN:
            raise self.ended("the stream is closing")
        await self._send_all(self._ws.send(TextMessage(data=message)))

    def ended(self, reason: str) -> Exception:
        """Why the stream can no longer be used: a close 4401 is a refused token, for good
        (``TOKEN_REFUSED``), whether an ``UNAUTHORIZED`` frame came before it or not; anything
        else
        is a lost connection (``reason``), retried no sooner than the close's reason asks
        (``SNAPSHOT_UNAVAILABLE; retry-after=60``)."""
        if self.close_code == CLOSE_UNAUTHORIZED:
            return FollowError(TOKEN_REFUSED)
        return ConnectionLost(reason, close_retry_after_s(self.close_reason))

    async def ping(self) -> None:
        """A ping, whose pong (or any frame) the server sends back moves ``heard`` on."""
        if self._ws.state is ConnectionState.OPEN:
            self.pinged = trio.current_time()
            await self._send_all(self._ws.send(Ping()))

    async def aclose(self) -> None:
        """Close, then read until the server's close: a message sent just before (the final
        ACK) must not be lost to a reset of a socket closed with unread data."""
        if self._ws.state is ConnectionState.OPEN:
            await self._send_all(self._ws.send(CloseConnection(code=1000)))
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            while self._ws.state is not ConnectionState.CLOSED:
                await self._read()
                self._ready.clear()

    async def _read(self) -> None:
        """One read of the socket, its events handled (pings and a close answered)."""
        if self._ws.state is ConnectionState.CLOSED:
            raise ConnectionLost("the server closed the stream")
        try:
            data = await self._tcp.receive_some(RECEIVE_BYTES)
        except trio.BrokenResourceError as exc:
            raise ConnectionLost(str(exc)) from None
        if data:
            self.heard = trio.current_time()
        if not data and not self._accepted:
            raise ConnectionLost("the server closed the connection during the handshake")
        try:
            self._ws.receive_data(bytes(data) if data else None)
            self._handle_events()
        except RemoteProtocolError as exc:
            raise ConnectionLost(f"not a websocket answer: {exc}") from None
        if self._outgoing:
            outgoing, self._outgoing = bytes(self._outgoing), bytearray()
            await self._send_all(outgoing)

    async def _send_all(self, data: bytes) -> None:
        # ACKs are sent by the applying task while the reading task may answer a ping.
        async with self._sending:
            try:
                await self._tcp.send_all(data)
            except trio.BrokenResourceError as exc:
                raise ConnectionLost(str(exc)) from None

    def _handle_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, TextMessage):
                self._parts.append(event.data)
                self._size += len(event.data)
                if self._size > MAX_MESSAGE_BYTES:
                    raise ConnectionLost("a message beyond the size limit")
                if event.message_finished:
                    self._ready.append("".join(self._parts))
                    self._parts.clear()
                    self._size = 0
            elif isinstance(event, BytesMessage):
                if event.message_finished:
                    self._ready.append(None)
            elif isinstance(event, Ping):
                self._outgoing += self._ws.send(event.response())
            elif isinstance(event, CloseConnection):
                self.close_code = event.code
                self.close_reason = event.reason or ""
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    self._outgoing += self._ws.send(event.response())
            elif isinstance(event, AcceptConnection):
                self._accepted = True
            elif isinstance(event, RejectConnection):
                if not event.has_body:
                    raise _refused(event, b"")
                self._rejected = event
            elif isinstance(event, RejectData) and self._rejected is not None:
                # Its body says whether it lasts (a store found damaged, STREAM-206).
                self._rejection += event.data[: REFUSAL_BYTES - len(self._rejection)]
                if event.body_finished:
                    raise _refused(self._rejected, bytes(self._rejection))


def _refused(event: RejectConnection, body: bytes) -> Exception:
    """What a refused upgrade means, as for the HTTP requests: a 5xx (a restarting server, or
    a proxy in front of one) and a front's 429 are a lost connection; 401 and any other refusal
    are for good."""
    if event.status_code == 401:
        return FollowError(TOKEN_REFUSED)
    if event.status_code == 426:
        return FollowError(UPGRADE_LOST)
    if not _retried(event.status_code):
        return FollowError(f"the server refused the stream ({event.status_code})")
    return ConnectionLost(
        f"the server refused the stream ({event.status_code})",
        _asked_wait(httpx.Headers(event.headers)),
        lasting=lasting_refusal(body),
    )


@attrs.frozen
class _Batch:
    """Decoded frames: the events' sequences and object changes, then any error frames; with
    ``malformed``, the reason the next frame could not be read (nothing after it is)."""

    seqs: list[int]
    changes: list[Change]
    errors: list[dict[str, Any]]
    malformed: str | None = None
    # The ``tag`` of each event's frame as sent, by its place in ``seqs`` (None without one):
    # only the last one applied is kept (:func:`_tag`), so only that one is checked.
    tags: list[object] = attrs.field(factory=list)

    @classmethod
    def decode(cls, messages: list[str | None]) -> _Batch:
        seqs: list[int] = []
        changes: list[Change] = []
        errors: list[dict[str, Any]] = []
        tags: list[object] = []
        for message in messages:
            if message is None:
                return cls(seqs, changes, errors, "a binary frame", tags)
            try:
                frame = orjson.loads(message)
                kind = frame.get("type")
                if kind == "event":
                    seq = frame["seq"]
                    if type(seq) is not int:
                        raise TypeError("a sequence that is not an integer")
                    change = _change(frame) if frame.get("kind") == ObjectChanged.KIND else None
                    seqs.append(seq)
                    tags.append(frame.get("tag"))
                    if change is not None:
                        changes.append(change)
                elif kind == "error":
                    errors.append(frame)
            except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
                return cls(seqs, changes, errors, type(exc).__name__, tags)
        return cls(seqs, changes, errors, tags=tags)

    def gap(self, cursor: int) -> int | None:
        """The first sequence that does not follow the ones before it from ``cursor`` (a
        repeated one does), or None."""
        for seq in self.seqs:
            if seq > cursor + 1:
                return seq
            cursor = max(cursor, seq)
        return None

    def before(self, seq: int) -> _Batch:
        """The events before ``seq``, the first of a gap, without the error frames after it."""
        end = self.seqs.index(seq)
        return _Batch(
            self.seqs[:end], [c for c in self.changes if c.seq < seq], [], tags=self.tags[:end]
        )

    def joined(self, other: _Batch) -> _Batch:
        return _Batch(
            self.seqs + other.seqs,
            self.changes + other.changes,
            self.errors + other.errors,
            other.malformed,
            self.tags + other.tags,
        )


def _size(path: str) -> int:
    """The size of the file at ``path``, 0 when there is none."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _tag(value: object) -> str | None:
    """An event frame's ``tag`` as the follower keeps and sends it back: the service writes 16
    hex digits; anything else (none, a server of another version) is no tag."""
    if isinstance(value, str) and 0 < len(value) <= MAX_TAG and value.isascii() and value.isalnum():
        return value
    return None


@attrs.define
class _Acks:
    """A stream connection's acknowledgements: what the replica made durable (``tracker``)
    and the highest ACK sent for it (``acked``)."""

    tracker: AckTracker
    acked: int

    async def send(self, ws: StreamSocket) -> None:
        """Acknowledge everything durable."""
        seq = self.tracker.contiguous
        await ws.send(_ack_frame(seq))
        self.acked = seq


def _stopped(exc: BaseException) -> bool:
    """Whether ``exc`` is a stop from outside (SIGINT, SIGTERM: a cancellation, alone or in a
    group of them), not a crash."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_stopped(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


async def _last_ack(ws: StreamSocket, acks: _Acks) -> None:
    """On a stop, once the last replica transaction is durable: acknowledge what the replica
    holds beyond the last ACK, and close the stream, so that the ACK is read before the socket
    closes (a socket closed with unread data is reset, and the server may lose what it had not
    read yet). Shielded from the stop, for ``LAST_ACK_S`` at most; a connection that cannot
    take it is left as it is."""
    if acks.tracker.contiguous <= acks.acked:
        return
    with (
        trio.CancelScope(shield=True),
        trio.move_on_after(LAST_ACK_S),
        contextlib.suppress(ConnectionLost, FollowError),
    ):
        await acks.send(ws)
        await ws.aclose()


async def _read_ahead(ws: StreamSocket, batches: trio.MemorySendChannel[_Batch]) -> None:
    """Read and decode the next frames while the last batch is applied. The end of the
    connection closes the channel, after every batch that came before it."""
    async with batches:
        with contextlib.suppress(ConnectionLost):
            while True:
                await batches.send(_Batch.decode(await ws.receive(READ_SIZE)))


def _ack_frame(seq: int) -> str:
    return dumps(AckFrame(seq)).decode()


# The metrics of one hour arrive side by side: their shared hour is parsed once.
_hour = functools.lru_cache(maxsize=1024)(parse_instant)


def _change(frame: dict[str, Any]) -> Change:
    key = ObjectKey(str(frame["metric"]), str(frame["layer"]), _hour(frame["hour"]))
    state = frame.get("object")
    if state is None:
        return Change(int(frame["seq"]), key, None)
    if not isinstance(state, dict):
        raise TypeError("an object state that is not a JSON object")
    return Change(int(frame["seq"]), key, from_wire(key, state))


@attrs.frozen
class _Key:
    public_key: str


def _structured(document: Any, kind: type[_T], what: str) -> _T:
    """``document`` as ``kind``; :class:`FollowError` when the server's answer is not of that
    shape (a proxy answering for it, another program on the port)."""
    try:
        return converter.structure(document, kind)
    except (cattrs.BaseValidationError, KeyError, TypeError, ValueError, AttributeError):
        raise FollowError(f"{what} is not healthlog's") from None


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first of the errors in ``group``, however deeply nested."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


def _reason(group: BaseExceptionGroup[BaseException]) -> str:
    """The first of the errors that ended a connection, for the log and a FollowError (never a
    token or data): its type, with the message of a ConnectionLost (this module's words) or of
    the system's OSError it comes from. Other messages are left out: an HTTP library's may quote
    the request, and with it a header value, the token's included."""
    first = _first(group)
    seen: list[BaseException] = []
    cause: BaseException | None = first
    while cause is not None and cause not in seen:
        if isinstance(cause, ConnectionLost | OSError):
            message = f"{type(cause).__name__}: {cause}"
            return message if cause is first else f"{type(first).__name__} ({message})"
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return type(first).__name__


async def follow(
    url: str,
    token: str,
    replica: Replica,
    *,
    subscriber: str | None = None,
    until_caught_up: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    accept_key: str | None = None,
) -> None:
    """Run a follower; raises FollowError for conditions that retrying cannot fix, and the
    replica's own StorageError (a full disk, a damaged or removed file) as it is.
    ``ssl_context`` is the trust for https:// and wss:// URLs (default: the system's);
    ``accept_key`` the snapshot key the server must have, pinned in place of another."""
    check_token(token)
    check_subscriber(subscriber)
    try:
        await Follower(
            Endpoints.parse(url),
            token,
            replica,
            subscriber,
            until_caught_up,
            ssl_context=ssl_context,
            accept_key=accept_key,
        ).run()
    except (ReplicaMismatch, ReplicaInUse) as exc:
        raise FollowError(str(exc)) from None
