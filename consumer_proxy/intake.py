"""A group's intake: the ``Intake`` loop from the consumer into the core.

It owns the polls: each ``consume()`` of the ``ports.MessageSource`` hands its records to the
core (``PartitionSet.intake_batch``, up to each error), a log truncation to
``PartitionSet.truncated``, the consumer's positions to ``skip_unfetchable``, moves aside the
messages that block their partition's commit (``PartitionSet.unblock``, with
``head_block_ms``), and executes the core's pause plan (``pause_plan`` -> ``set_paused``). How
long the next poll may wait is
``core.cadence.poll_wait``'s choice, from the workers' supply and the ``Committer``'s
schedule; while every partition is paused, one for room, and the workers run dry, it waits
for a call to end instead of polling (``core.cadence.room_wait``). After a poll that was not
full it lets the call slots its records woke send before it queues the next consume
(``core.cadence.turns_before_poll``). The first poll says the consumer is up (``on_started``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from .committer import Committer
from .config import DeliveryConfig
from .core.cadence import (
    FETCH_WAIT_S,
    gives_way,
    poll_wait,
    quiet_polls,
    room_wait,
    turns_before_poll,
)
from .core.decision import HEAD_BLOCKED, Action
from .core.partitions import Record
from .ports import Clock, MessageSource
from .push import PushParts

log = logging.getLogger(__name__)


class Intake:
    """Polls one group's consumer until ``stopping`` is set."""

    def __init__(
        self,
        parts: PushParts,
        delivery: DeliveryConfig,
        committer: Committer,
        ready_low: Callable[[], bool],
        on_started: Callable[[], None],
    ) -> None:
        """``parts``: the group's core, edges (the consumer, the clock), breaker, tally and
        metrics, as the push has them; ``committer``: its schedule shapes the polls, and
        traffic after a quiet spell wakes it; ``ready_low``: the workers are about to run dry;
        ``on_started`` is told after the first poll."""
        self.name = parts.name
        self._fetch_batch = delivery.fetch_batch
        self._unblocking = delivery.head_block_ms is not None
        self._partitions = parts.partitions
        self._source: MessageSource = parts.edges.source
        self._breaker = parts.breaker
        self._tally = parts.tally
        self._metrics = parts.metrics
        self._clock: Clock = parts.edges.clock
        self._room = parts.call_ended  # set after every call and DLQ or tier write
        self._committer = committer
        self._ready_low = ready_low
        self._on_started = on_started

    async def run(self, stopping: asyncio.Event) -> None:
        """Poll until ``stopping`` is set; a fatal consumer error raises."""
        source = self._source
        partitions = self._partitions
        batch = self._fetch_batch
        paused = self._metrics.partitions_paused.labels(self.name)
        timeout_s = FETCH_WAIT_S
        give_way = False  # the consume gives way to room freed meanwhile
        room_s: float | None = None  # wait for room this long instead of a consume
        polled = 0.0  # when the last consume returned
        quiet = 0  # polls in a row that found the group holding nothing
        committer = self._committer
        started = False
        while not stopping.is_set():
            messages: list[Any] = []
            if room_s is None:
                if give_way:
                    messages = await self._consume_giving_way(batch, timeout_s)
                else:
                    messages = await source.consume(batch, timeout_s)
                polled = self._clock()
            else:
                await self._await_room(room_s)
            if not started:
                started = True
                self._on_started()  # the consumer is up (joined, or joining, the group)
            good: list[Record] = []  # taken in together, up to the next error
            mixed = messages  # read one by one: some are errors
            if not [message for message in messages if message.error() is not None]:
                good, mixed = messages, []  # (the common case: no error, found in one pass)
            for message in mixed:
                error = message.error()
                if error is None:
                    good.append(message)
                    continue
                if good:
                    partitions.intake_batch(good)
                    good = []
                # A consumed error is never flagged fatal() by confluent-kafka: librdkafka
                # hands its consumer's fatal error over as a _FATAL event (a fenced static
                # member, say), after which the consumer can neither fetch nor commit.
                if error.fatal() or error.code() == KafkaError._FATAL:
                    raise KafkaException(error)
                elif error.code() == KafkaError._LOG_TRUNCATION:
                    log.warning("group %s: %s", self.name, error.str())
                    tp = (message.topic() or "", message.partition() or 0)
                    partitions.truncated(tp, await source.position(tp))
                elif error.code() != KafkaError._PARTITION_EOF:
                    log.warning("group %s: consumer error: %s", self.name, error)
            if good:
                partitions.intake_batch(good)
            partitions.skip_unfetchable(source.positions, source.positions_read)
            if self._unblocking:
                self._unblock()
            plan = partitions.pause_plan()
            if plan.pause or plan.resume:
                await source.set_paused(plan.pause, plan.resume)
            paused.set(plan.paused)
            if messages and committer.quiet:
                committer.wake()  # traffic after a quiet spell: the committer's usual cadence
            busy = bool(messages) or bool(plan.paused) or partitions.holding()
            quiet = quiet_polls(quiet, busy)
            # (a partition waiting only for a due time, the guard or the breaker: no poll
            # brings it sooner, and polling every 5 ms for an hour-long tier delay is waste)
            waiting = bool(plan.waiting) and not self._breaker.is_open
            ready_low = waiting and self._ready_low()
            fetching = plan.paused < len(partitions.parts)
            room_s = room_wait(
                waiting=waiting,
                ready_low=ready_low,
                fetching=fetching,
                since_poll_s=self._clock() - polled,
            )
            give_way = gives_way(waiting=waiting, ready_low=ready_low, fetching=fetching)
            timeout_s = poll_wait(
                waiting=waiting,
                ready_low=ready_low,
                fetching=fetching,
                commit_due=not waiting and committer.due,
                quiet=quiet,
                commits_failing=partitions.commits_failing,
                commit_answering=committer.answering,
            )
            for _ in range(turns_before_poll(taken=len(messages), batch=batch)):
                await asyncio.sleep(0)  # the call slots these records woke send first

    async def _consume_giving_way(self, batch: int, timeout_s: float) -> list[Any]:
        """A consume that gives way to room freed while it waits (``cadence.gives_way``):
        after each call or write that ends meanwhile, the pause plan; a change of it is
        queued on the consumer thread at once, which ends the consume's wait after its slice,
        and is applied right after it (as after any consume: only then are the records of a
        partition it pauses handed over no more)."""
        source = self._source
        room = self._room
        consume = asyncio.ensure_future(source.consume(batch, timeout_s))
        change: asyncio.Future[None] | None = None
        try:
            while change is None and not consume.done():
                room.clear()
                woken = asyncio.ensure_future(room.wait())
                try:
                    await asyncio.wait((consume, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if consume.done() or not room.is_set():
                    break
                plan = self._partitions.pause_plan()
                if plan.pause or plan.resume:
                    change = asyncio.ensure_future(source.set_paused(plan.pause, plan.resume))
            messages: list[Any] = await consume
        except BaseException:  # cancelled (shutdown), or the consume failed
            consume.cancel()  # (the calls themselves run on: the consumer thread's)
            if change is not None:
                change.cancel()
            raise
        if change is not None:
            await change
        return messages

    async def _await_room(self, cap_s: float) -> None:
        """Wait until a call or a DLQ or tier write ends, at most ``cap_s``. Its result is in
        the core when this returns (the event is set right before the answer is handed over,
        with no await in between), so the next pause plan sees what it freed."""
        room = self._room
        room.clear()  # (revocation waits on it too: a clear never loses a waiter's wake-up)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cap_s):
                await room.wait()

    def _unblock(self) -> None:
        """Move aside the messages that block their partition's commit (head_block_ms)."""
        for delivery, decision in self._partitions.unblock(self._clock()):
            tier = str(decision.tier) if decision.action is Action.TIER else "dlq"
            self._metrics.head_unblocks.labels(self.name, tier).inc()
            log.warning(
                "group %s: %s[%d]@%d %s; moving it to %s",
                self.name,
                delivery.origin.topic,
                delivery.origin.partition,
                delivery.origin.offset,
                decision.reason,
                f"retry tier {tier}" if decision.action is Action.TIER else "the DLQ",
            )
            self._tally.settled(delivery, decision, HEAD_BLOCKED, "")
