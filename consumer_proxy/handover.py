"""Partitions arriving and leaving this member: ``Handover`` (an assignment, a graceful revoke,
or a loss, and the shutdown's last steps).

A revoked partition takes no new push; its calls get the revoke grace
(``delivery.revoke_grace_ms``, none while the group shuts down), then the ones still open are
cancelled (the service sees it; never an attempt), its DLQ and retry tier writes are cancelled
(the next owner makes them again), and ``PartitionSet.final_commit`` gives the commit handed
back to the consumer. A lost partition (another member owns it already) is dropped at once,
with its calls and writes cancelled and nothing committed.

The runner's rebalance callbacks (``GroupRunner.partitions_revoked`` / ``partitions_lost``)
call it; it is given what it acts on, so it imports neither the runner nor an adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaException, TopicPartition

from .committer import kafka_commit
from .core.heartbeat import Cancel
from .core.partitions import Delivery, PartitionSet, PartitionState
from .metrics import ProxyMetrics
from .parking import Parking
from .ports import Clock, DeadLetterSink, MessageSource, Pusher
from .readyq import ReadyDeque, take_all

log = logging.getLogger(__name__)

LEAVE_S = 12.0
"""The longest the last commit and leaving the group may take at shutdown (after the drain's
grace): within the chart's 15 s termination margin, with ``CANCEL_WAIT_S`` to cancel calls."""
CANCEL_WAIT_S = 1.0
"""After cancelling calls (revoke, shutdown): how long to wait for their workers to end them."""


class Cancels(Protocol):
    """The push's side of a hand-over (``push.Push.cancel_calls``)."""

    def cancel_calls(self, parts: Sequence[PartitionState] | None, cause: Cancel) -> int: ...


class Handover:
    """Hands a group's leaving partitions back: waits, cancels, commits, forgets."""

    def __init__(
        self,
        name: str,
        partitions: PartitionSet,
        parking: Parking,
        metrics: ProxyMetrics,
        call_ended: asyncio.Event,
        revoke_grace_ms: int,
    ) -> None:
        """``call_ended`` is set after every call (the grace waits on it)."""
        self.name = name
        self._partitions = partitions
        self._parking = parking
        self._metrics = metrics
        self._call_ended = call_ended
        self._grace_s = revoke_grace_ms / 1000.0
        self.push: Cancels | None = None  # set once the group runs
        self.clock: Clock = _loop_time  # the edges' clock once the group runs

    def assigned(self, committed: Sequence[TopicPartition]) -> None:
        """Partitions arriving, with their committed offsets, ack states and leader epochs."""
        for tp in committed:
            offset = tp.offset if tp.offset is not None and tp.offset >= 0 else None
            self._partitions.assign(
                tp.topic, tp.partition, offset, tp.metadata or "", tp.leader_epoch
            )

    async def revoked(
        self, partitions: Sequence[TopicPartition], draining: bool
    ) -> list[TopicPartition]:
        """Wait up to the revoke grace (none when ``draining``) for in-flight calls, then
        cancel what is left and return the final commits. Late push results are ignored: the
        partition is no longer this member's."""
        parts = self._partitions.owned([(tp.topic, tp.partition) for tp in partitions])
        self._partitions.leave(parts)
        clock = self.clock
        started = clock()
        await self.calls_end(parts, started + (0.0 if draining else self._grace_s))
        if self.push is not None and self.push.cancel_calls(parts, Cancel.REVOKE):
            # Cancelled calls end at once (their workers give the messages back, never an
            # attempt): a short wait lets the service hear the cancellations first.
            await self.calls_end(parts, clock() + CANCEL_WAIT_S)
        await self._parking.cancel(set(parts))
        offsets = []
        for part in parts:
            final = self._partitions.final_commit(part)
            if final is not None:
                offsets.append(kafka_commit(final))
            self._forget(part)
        busy = sum(p.calls for p in parts)
        log.info(
            "group %s: revoked %d partitions after %.1fs%s",
            self.name,
            len(parts),
            clock() - started,
            f" ({busy} calls still running: their results will be ignored)" if busy else "",
        )
        return offsets

    async def calls_end(self, parts: Sequence[PartitionState], deadline: float) -> None:
        """Wait until ``parts`` have no call under way, or ``deadline`` (the clock's)."""
        clock = self.clock
        while any(p.calls for p in parts) and clock() < deadline:
            self._call_ended.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - clock()):  # not wait_for (3.11)
                    await self._call_ended.wait()

    async def lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop lost partitions without committing (another member owns them now), and
        cancel their calls and their DLQ and retry tier writes at once: the new owner makes
        them again, and a write that went on retrying here would add a copy outside the
        documented bound."""
        parts = self._partitions.owned([(tp.topic, tp.partition) for tp in partitions])
        if self.push is not None:
            self.push.cancel_calls(parts, Cancel.LOST)  # the new owner delivers them
        writes = await self._parking.cancel(set(parts))
        for part in parts:
            self._forget(part, "lost")
        log.warning(
            "group %s: lost %d partitions (no commit possible; %d DLQ/tier writes cancelled)",
            self.name,
            len(partitions),
            writes,
        )

    async def settle(
        self,
        busy: set[asyncio.Task[Any]],
        grace_s: float,
        writes: Callable[[], Iterable[asyncio.Task[Any]]] = tuple,
    ) -> None:
        """Shutdown: the pushes and DLQ writes under way (``busy``) get ``grace_s``, and so do
        the DLQ and retry-tier writes their answers start meanwhile (``writes``: those under
        way now; cancelled, a decided dead letter would hold the commit and be pushed again
        after the restart). Then the open calls are cancelled first, so the service sees them
        cancelled and the messages are given back (never an attempt); the caller cancels
        whatever is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        pending = set(busy)
        while True:
            pending = {t for t in (*pending, *writes()) if not t.done()}
            left = deadline - loop.time()
            if not pending or left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=left)
        if not pending:
            return
        if self.push is not None and self.push.cancel_calls(None, Cancel.SHUTDOWN):
            _, pending = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        if pending:
            log.warning(
                "group %s: %d pushes/DLQ writes still running after %.1fs; cancelled "
                "(they will be redelivered)",
                self.name,
                len(pending),
                grace_s,
            )

    def stopped(self, ready: asyncio.Queue[Delivery] | ReadyDeque) -> None:
        """Shutdown, once no task runs: no retry timer fires any more, and the messages still
        waiting (on a timer, the guard or in ``ready``) end their traces."""
        partitions = self._partitions
        partitions.cancel_timers()
        if partitions.gone is not None:
            for left in take_all(ready):
                partitions.gone(left, "shutdown")

    def _forget(self, part: PartitionState, why: str = "revoked") -> None:
        self._partitions.forget(part, why)
        self._metrics.forget_partition(self.name, part.topic, part.partition)


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


async def close_edges(
    name: str,
    commit: Callable[[], Awaitable[int]],
    source: MessageSource | None,
    sink: DeadLetterSink | None,
    pusher: Pusher | None,
) -> None:
    """Shutdown, once no task of the group runs: the last commit and leaving the group (for
    at most ``LEAVE_S`` together), then the DLQ writer and the service's channels, whatever
    leaving raised. With the group coordinator out of reach, librdkafka holds a synchronous
    commit up to ``socket.timeout.ms`` (60 s) and a close longer, past the pod's grace. The
    close is asked for even when the commit ran out the time, so the consumer's thread ends
    after the calls it is stuck in; it is a daemon, and the process exits without it."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + LEAVE_S
    late = False
    try:
        if source is not None:
            try:
                async with asyncio.timeout_at(deadline):
                    with contextlib.suppress(KafkaException):
                        await commit()
            except TimeoutError:
                late = True
            try:
                async with asyncio.timeout_at(deadline):
                    await source.close()
            except TimeoutError:
                late = True
    finally:
        if sink is not None:
            await sink.close()
        if pusher is not None:
            await pusher.close()
    if late:
        log.warning(
            "group %s: the last commit and leaving the group took over %.0f s (is Kafka "
            "reachable?); stopped without them: what was acked since the last commit is "
            "delivered again, and the group rebalances once the session times out",
            name,
            loop.time() - started,
        )
