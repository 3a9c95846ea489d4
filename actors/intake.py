"""Intake: gets a delivery journaled, answers its caller, then wakes the folder.

Intake is not a task of its own: the caller's task hands its delivery straight to the journal
actor, waits for its result and then counts it and wakes the folder (JOURNAL-56). A relaying task
cost each delivery a task, a second channel and three more scheduler turns on the event loop
that also serves HTTP, and handed the deliveries of callers that submitted together to the
journal actor one scheduler turn apart, so that its group commit, which takes what is queued
one turn after the first, found them split.

The wake is best effort: a full or closed wake channel is never an error, the delivery
stays pending and the folder's periodic wake finds it.
"""

from __future__ import annotations

import attrs
import trio

from actors.journal import GONE, Request, Result, RuntimeStopped
from healthlog.storage.journal import NewDelivery, Receipt


@attrs.frozen
class IntakeStatistics:
    accepted: int
    replayed: int
    refused: int
    wakes_sent: int
    wakes_dropped: int


class Intake:
    """Submits each delivery to the journal actor in its caller's task, and completes it."""

    def __init__(
        self,
        journal: trio.MemorySendChannel[Request],
        wake: trio.MemorySendChannel[None],
    ) -> None:
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

    def close(self) -> None:
        """Refuse every later submit with :class:`RuntimeStopped` (the runtime stops); a caller
        waiting for room in the journal's queue is refused too. What is queued is answered by
        the journal actor."""
        self._journal.close()

    async def submit(self, delivery: NewDelivery) -> Result:
        """Hand a delivery to the journal actor and wait for its result.

        Once handed over, the wait is shielded: a caller cancelled while its commit is in flight
        still learns whether its delivery was journaled (every queued request is answered, also
        on shutdown), and the delivery is counted and the folder woken either way.
        """
        reply_send, reply_receive = trio.open_memory_channel[Result](1)
        try:
            await self._journal.send((delivery, reply_send))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return RuntimeStopped("healthlog is not running")
        with trio.CancelScope(shield=True):
            result = await reply_receive.receive()
        if not isinstance(result, Receipt):
            self._refused += 1
        elif result.replayed:
            self._replayed += 1
        else:
            self._accepted += 1
            try:
                self._wake.send_nowait(None)
                self._wakes_sent += 1
            except GONE:
                self._wakes_dropped += 1
        return result
