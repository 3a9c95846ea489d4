"""The intake actor: gets a delivery journaled, answers its caller, then wakes the folder.

The wake is best effort: a full or closed wake channel is never an error, the delivery
stays pending and the folder's periodic wake finds it.
"""

from __future__ import annotations

import contextlib

import attrs
import trio

from actors.journal import GONE, Reply, Request, Result, RuntimeStopped, refuse_pending
from healthlog.storage.journal import NewDelivery, Receipt

Submission = tuple[NewDelivery, Reply]


@attrs.frozen
class IntakeStatistics:
    accepted: int
    replayed: int
    refused: int
    wakes_sent: int
    wakes_dropped: int


class IntakeActor:
    """Forwards each submission to the journal actor and completes it."""

    def __init__(
        self,
        submissions: trio.MemoryReceiveChannel[Submission],
        journal: trio.MemorySendChannel[Request],
        wake: trio.MemorySendChannel[None],
    ) -> None:
        self._submissions = submissions
        self._journal = journal
        self._wake = wake
        self._accepted = 0
        self._replayed = 0
        self._refused = 0
        self._wakes_sent = 0
        self._wakes_dropped = 0

    def statistics(self) -> IntakeStatistics:
        return IntakeStatistics(
            self._accepted, self._replayed, self._refused, self._wakes_sent, self._wakes_dropped
        )

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                # No loop variable holds a submission: one held the last delivery, its body
                # with it, until the next came (RUN-120).
                with contextlib.suppress(trio.EndOfChannel):
                    while True:
                        nursery.start_soon(self._handle, *await self._submissions.receive())
        finally:
            refuse_pending(self._submissions)

    async def _handle(self, delivery: NewDelivery, caller: Reply) -> None:
        reply_send, reply_receive = trio.open_memory_channel[Result](1)
        try:
            await self._journal.send((delivery, reply_send))
        except BaseException:
            with contextlib.suppress(*GONE):
                caller.send_nowait(RuntimeStopped("healthlog is shutting down"))
            raise
        with trio.CancelScope(shield=True):
            result = await reply_receive.receive()
        if not isinstance(result, Receipt):
            self._refused += 1
        elif result.replayed:
            self._replayed += 1
        else:
            self._accepted += 1
        with contextlib.suppress(*GONE):
            caller.send_nowait(result)
        if isinstance(result, Receipt) and not result.replayed:
            try:
                self._wake.send_nowait(None)
                self._wakes_sent += 1
            except GONE:
                self._wakes_dropped += 1


async def submit(submissions: trio.MemorySendChannel[Submission], delivery: NewDelivery) -> Result:
    """Hand a delivery to the intake actor and wait for its result.

    Once handed over, the wait is shielded: a caller cancelled while its commit is in flight
    still learns whether its delivery was journaled (every queued request is answered, also
    on shutdown).
    """
    reply_send, reply_receive = trio.open_memory_channel[Result](1)
    try:
        await submissions.send((delivery, reply_send))
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        return RuntimeStopped("healthlog is not running")
    with trio.CancelScope(shield=True):
        result = await reply_receive.receive()
    return result
