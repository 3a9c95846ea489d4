"""The journal actor: the only writer of ``journal.sqlite``, with group commit.

Appends that arrive together share one fsync'd transaction; each caller gets its result
only after the commit that holds its row. A commit in flight is shielded from cancellation,
so a caller is never told "failed" about a row that is in fact journaled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import attrs
import trio

from actors import threads
from healthlog import faults
from healthlog.storage._sqlite import StorageError
from healthlog.storage.journal import IdempotencyCollision, Journal, NewDelivery, Receipt

MAX_GROUP = 64

Result = Receipt | IdempotencyCollision | StorageError
Reply = trio.MemorySendChannel[Result]
Request = tuple[NewDelivery, Reply]

# A reply or wake channel whose other end is gone or full: never an error for the sender.
GONE = (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock)

log = logging.getLogger("healthlog.journal")


class RuntimeStopped(StorageError):
    """The runtime shut down before this delivery could be journaled: nothing was written."""


def refuse_pending(requests: trio.MemoryReceiveChannel[tuple[Any, Reply]]) -> None:
    """Answer every request still queued with :class:`RuntimeStopped` (on shutdown)."""
    while True:
        try:
            _, reply = requests.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        with contextlib.suppress(*GONE):
            reply.send_nowait(RuntimeStopped("healthlog is shutting down"))


@attrs.frozen
class JournalActorStatistics:
    queued: int
    appended: int
    groups: int
    largest_group: int
    errors: int


class JournalActor:
    """Receives ``(delivery, reply)`` requests and answers each with its result."""

    def __init__(
        self,
        journal: Journal,
        requests: trio.MemoryReceiveChannel[Request],
        limiter: trio.CapacityLimiter,
    ) -> None:
        self._journal = journal
        self._requests = requests
        self._limiter = limiter
        self._appended = 0
        self._groups = 0
        self._largest = 0
        self._errors = 0

    def statistics(self) -> JournalActorStatistics:
        return JournalActorStatistics(
            queued=self._requests.statistics().current_buffer_used,
            appended=self._appended,
            groups=self._groups,
            largest_group=self._largest,
            errors=self._errors,
        )

    async def run(self) -> None:
        try:
            await self._serve()
        finally:
            refuse_pending(self._requests)

    async def _serve(self) -> None:
        with contextlib.suppress(trio.EndOfChannel):
            while True:
                await self._commit_group()

    async def _commit_group(self) -> None:
        """Journal the next request and those queued behind it, and answer each. A method of
        its own so that the group's bodies are let go once answered: held by the loop's
        variables until the next delivery came, the last group's kept a 60 MiB upload in the
        service's memory for as long as the phone was quiet (RUN-120)."""
        group = [await self._requests.receive()]
        # One turn of the scheduler first (uncancellable: the group is ours to answer), so
        # that requests arriving together join this group.
        await trio.lowlevel.cancel_shielded_checkpoint()
        while len(group) < MAX_GROUP:
            try:
                group.append(self._requests.receive_nowait())
            except trio.WouldBlock:
                break
        with trio.CancelScope(shield=True):
            results = await self._append([d for d, _ in group])
        for (_, reply), result in zip(group, results, strict=True):
            with contextlib.suppress(*GONE):
                reply.send_nowait(result)

    async def _append(self, deliveries: list[NewDelivery]) -> list[Result]:
        def append() -> list[Receipt | IdempotencyCollision]:
            faults.point("journal.append")
            return self._journal.append_many(deliveries)

        try:
            results: list[Result] = list(await threads.run_sync(append, limiter=self._limiter))
        except StorageError as exc:
            self._errors += 1
            return [exc] * len(deliveries)
        except Exception as exc:
            self._errors += 1
            log.error("journal append failed unexpectedly: %s", type(exc).__name__)
            return [StorageError(f"journal append failed: {type(exc).__name__}")] * len(deliveries)
        self._groups += 1
        self._largest = max(self._largest, len(deliveries))
        self._appended += sum(isinstance(r, Receipt) and not r.replayed for r in results)
        return results
