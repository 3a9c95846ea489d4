"""A real ``healthlog serve`` for the service tests (specs/service.md), and what they send it.

``serving(path, **settings)`` creates a client token in a data directory, starts
:func:`transport.serve.serve` on a free port in the caller's trio task, yields a
:class:`Service` with an ``httpx`` client, and on exit closes the client, sets the shutdown
event and waits (bounded) for the server and its runtime to stop.

``Drip`` is a request body sent chunk by chunk, slowly or held at a gate after its first
chunk. It is an iterator class rather than an async generator, and :func:`post_stream` hands
it to httpx as the request stream itself, so an upload that fails half-way leaves no
unfinished async generator behind (trio reports those as a ResourceWarning).

``write_minute_body`` writes a large Health Auto Export body of minute-level points.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from healthlog.config import ServeConfig
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import DeliveryMeta
from transport.app import RESPONSE_TIMEOUT_S
from transport.serve import serve

TOKEN_NAME = "phone"
WAKE_PERIOD_S = 0.2
CLIENT_TIMEOUT_S = 60.0
STOP_LIMIT_S = 30.0
FOLD_LIMIT_S = 60.0
POLL_S = 0.05


@attrs.frozen
class Service:
    """A running service: its base URL, data directory, client token and an HTTP client."""

    url: str
    data: DataDir
    token: str
    client: httpx.AsyncClient
    stop: trio.Event

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def post(self, body: bytes, headers: Mapping[str, str] | None = None) -> httpx.Response:
        """POST one delivery with the token (plus ``headers``)."""
        return await self.client.post(
            "/v1/deliveries", content=body, headers={**self.auth, **(headers or {})}
        )

    async def get(self, path: str, **params: str) -> httpx.Response:
        """GET ``path`` with the token."""
        return await self.client.get(path, params=params, headers=self.auth)

    async def status(self) -> dict[str, Any]:
        response = await self.get("/v1/status")
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document

    async def wait_folded(self) -> dict[str, Any]:
        """Poll ``/v1/status`` until nothing is pending and a pass has completed; return it."""
        with trio.fail_after(FOLD_LIMIT_S):
            while True:
                status = await self.status()
                if status["deliveries"]["pending"] == 0 and status["first_pass_completed"]:
                    return status
                await trio.sleep(POLL_S)

    async def journal(self) -> list[DeliveryMeta]:
        """Every journaled delivery, in journal order, read through a connection of our own."""
        return await trio.to_thread.run_sync(read_journal, self.data)


def read_journal(data: DataDir) -> list[DeliveryMeta]:
    with data.open_journal() as journal:
        return journal.iter_order()


@asynccontextmanager
async def serving(
    path: Path, *, response_timeout_s: float = RESPONSE_TIMEOUT_S, **settings: Any
) -> AsyncIterator[Service]:
    """Serve ``path`` with ``ServeConfig(port=0, wake_period_s=0.2, **settings)`` and quart's
    response timeout ``response_timeout_s``."""
    data = DataDir(path)
    with data.open_tokens() as tokens:
        token = tokens.add(TOKEN_NAME)
    config = ServeConfig(**{"port": 0, "wake_period_s": WAKE_PERIOD_S, **settings})
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            functools.partial(
                serve, data, config, shutdown=stop, response_timeout_s=response_timeout_s
            )
        )
        try:
            async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
                yield Service(url, data, token, client, stop)
        finally:
            stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + STOP_LIMIT_S
    assert not nursery.cancel_scope.cancelled_caught, "the service did not stop in time"


class Drip(httpx.AsyncByteStream):
    """A request body sent as ``chunks``: ``pause_s`` before each chunk after the first, and,
    when a ``gate`` is given, only once it is set after the first chunk."""

    def __init__(
        self, chunks: Sequence[bytes], *, pause_s: float = 0.0, gate: trio.Event | None = None
    ) -> None:
        self.body = b"".join(chunks)
        self._chunks = list(chunks)
        self._pause_s = pause_s
        self._gate = gate
        self._sent = 0
        self.held = trio.Event()
        """Set once the first chunk is out and the rest waits for the gate."""

    # httpx declares an AsyncIterator return; this stream is its own iterator.
    def __aiter__(self) -> Drip:  # type: ignore[override]
        return self

    async def __anext__(self) -> bytes:
        if self._sent == len(self._chunks):
            raise StopAsyncIteration
        if self._sent:
            if self._gate is not None:
                self.held.set()
                await self._gate.wait()
            await trio.sleep(self._pause_s)
        chunk = self._chunks[self._sent]
        self._sent += 1
        return chunk


async def post_stream(
    client: httpx.AsyncClient, body: Drip, headers: Mapping[str, str]
) -> httpx.Response:
    """POST a :class:`Drip` body chunked (no Content-Length)."""
    request = client.build_request("POST", "/v1/deliveries", headers=headers, content=body)
    request.stream = body
    return await client.send(request)


def write_minute_body(path: Path, *, metrics: int, points: int, first_day: int = 0) -> None:
    """A ``{"data": {"metrics": [...]}}`` body of ``metrics`` metrics, each with ``points``
    minute points from 2024-03-01 00:00 UTC (``first_day`` days later), written piece by
    piece."""
    with path.open("wb") as out:
        out.write(b'{"data":{"metrics":[')
        for m in range(metrics):
            if m:
                out.write(b",")
            out.write(b'{"name":"metric_%02d","units":"count/min","data":[' % m)
            first = first_day * 24 * 60
            out.write(b",".join(_minute_point(m, first + n) for n in range(points)))
            out.write(b"]}")
        out.write(b"]}}")


def _minute_point(metric: int, minute: int) -> bytes:
    day, rest = divmod(minute, 24 * 60)
    low = 50 + (minute * 7 + metric) % 40
    return (
        b'{"date":"2024-03-%02d %02d:%02d:00 +0000","Min":%d,"Avg":%d.25,"Max":%d,'
        b'"source":"Anna\xe2\x80\x99s Apple Watch Series 10"}'
        % (1 + day, rest // 60, rest % 60, low, low + 3, low + 9)
    )
