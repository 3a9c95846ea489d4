"""Snapshots on demand for subscribers whose cursor fell out of the online window."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from quart.wrappers.response import ResponseBody

from actors.runtime import Runtime
from healthlog import snapshots
from healthlog.documents import Manifest
from healthlog.storage import snapshot_files
from healthlog.storage.store import Store

URL_PATH = "/v1/snapshots"
# How much of a snapshot file a response holds in memory at a time.
CHUNK_BYTES = 64 * 1024


class SnapshotService:
    """Builds (one at a time) and serves the signed snapshot files of the data directory."""

    def __init__(self, runtime: Runtime, directory: Path, key: Ed25519PrivateKey) -> None:
        self._runtime = runtime
        self._directory = directory
        self._key = key
        self.public_key = snapshots.public_key_text(key)
        self._latest: Manifest | None = None
        self._lock = trio.Lock()

    async def covering(self, after: int) -> Manifest:
        """A snapshot a subscriber at cursor ``after`` can restore and resume from."""
        async with self._lock:
            window_start, _ = await self._runtime.read_store(Store.event_window)
            stream = await self._runtime.read_store(Store.stream_id)
            latest = self._latest
            if (
                latest is None
                or latest.stream != stream
                or latest.seq < max(after, window_start)
                or snapshot_files.find(self._directory, stream, latest.seq) is None
            ):
                latest = await trio.to_thread.run_sync(self._build)
                self._latest = latest
            return latest

    def _build(self) -> Manifest:
        return snapshot_files.build(
            self._directory, self._runtime.journal, self._runtime.store, self._key, URL_PATH
        )

    async def open(self, seq: int) -> SnapshotBody | None:
        """The snapshot file at ``seq`` of the current stream, opened, or None if it is not
        kept (a build running meanwhile may remove it)."""
        stream = await self._runtime.read_store(Store.stream_id)
        file = await trio.to_thread.run_sync(snapshot_files.open_file, self._directory, stream, seq)
        return None if file is None else SnapshotBody(file)


class SnapshotBody(ResponseBody):
    """The body of a snapshot file's response, read ``CHUNK_BYTES`` at a time in a worker
    thread; the file is closed when the response ends, however it ends."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.size = os.fstat(file.fileno()).st_size
        # A client gone before the body is entered (quart cancels the request between the
        # handler and the send) leaves it unentered: the file then closes when it is collected.
        weakref.finalize(self, file.close)

    async def __aenter__(self) -> SnapshotBody:
        return self

    async def __aexit__(
        self, exc_type: type | None, exc_value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._file.close()

    def __aiter__(self) -> SnapshotBody:
        return self

    async def __anext__(self) -> bytes:
        chunk = await trio.to_thread.run_sync(self._file.read, CHUNK_BYTES)
        if not chunk:
            raise StopAsyncIteration
        return chunk
