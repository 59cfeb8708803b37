"""A group's writes of messages out of their partition: the DLQ and the retry tiers.

A message the core decided to dead-letter (``Action.DEAD_LETTER``) or to move to its next
retry tier (``Action.TIER``) is written with acks=all and retried until the broker confirms;
only then is its offset done (``PartitionSet.dead_lettered`` / ``tier_written``), so a failed
write holds the partition's commit at that message and nothing is committed past it. A write
cancelled (revocation, shutdown) gives the message back (``dead_letter_abandoned`` /
``tier_abandoned``): the next owner pushes it again.

``Tally`` counts every decided outcome once (the workers' and ``head_block_ms``'s) and starts
the write of a message that leaves its partition (``Parking.start``). The runner cancels a
leaving partition's writes with ``Parking.cancel`` and waits on ``Parking.tasks`` at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .config import GroupConfig
from .core.decision import Action, Decision
from .core.partitions import Delivery, PartitionSet, PartitionState
from .core.records import dlq_headers, retry_headers
from .metrics import ProxyMetrics
from .ports import DeadLetterSink

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[Any]"]


class Parking:
    """Starts and tracks one group's DLQ and retry-tier writes."""

    def __init__(
        self,
        group: GroupConfig,
        partitions: PartitionSet,
        metrics: ProxyMetrics,
        spawn: Spawn,
        settled: asyncio.Event,
        moved: Callable[[], None],
    ) -> None:
        """``spawn`` runs a write as one of the group's tasks; ``settled`` is set when a write
        ends either way (revocation waits on it); ``moved`` is told when a tier write released
        a partition's commit (the committer commits it soon)."""
        self.name = group.name
        self._group = group
        self._partitions = partitions
        self._metrics = metrics
        self._spawn = spawn
        self._settled = settled
        self._moved = moved
        self.sink: DeadLetterSink | None = None  # set once the group's producer is up
        self.tasks: dict[asyncio.Task[Any], PartitionState] = {}
        """The writes under way, each with the partition whose commit it holds."""

    def start(self, delivery: Delivery, decision: Decision, status: str, endpoint: str) -> None:
        """The DLQ or retry tier write of a message; its offset is done once confirmed."""
        if decision.action is Action.TIER:
            coro = self._write_tier(delivery, decision, status, endpoint)
        else:
            coro = self._write_dead_letter(delivery, status, decision.reason, endpoint)
        task = self._spawn(coro, "dlq" if decision.action is Action.DEAD_LETTER else "tier")
        self.tasks[task] = delivery.part
        task.add_done_callback(self.tasks.pop)

    def of(self, parts: set[PartitionState]) -> list[asyncio.Task[Any]]:
        """The writes under way for these partitions."""
        return [task for task, part in self.tasks.items() if part in parts]

    async def cancel(self, parts: set[PartitionState]) -> int:
        """Cancel the writes under way for these partitions (each gives its message back) and
        wait for them to end; returns how many there were."""
        writes = self.of(parts)
        for task in writes:
            task.cancel()
        if writes:
            await asyncio.gather(*writes, return_exceptions=True)
        return len(writes)

    async def _write_dead_letter(
        self, delivery: Delivery, status: str, reason: str, endpoint: str
    ) -> None:
        assert self.sink is not None
        topic = self._group.dlq_topic
        trace = delivery.trace
        span = None if trace is None else trace.write(topic, "dead_letter")
        headers = dlq_headers(
            delivery.headers if trace is None else trace.stamped(delivery.headers),
            delivery.origin,
            attempt=delivery.attempt,
            status=status,
            reason=reason,
            endpoint=endpoint,
            group=self.name,
            ordering=self._partitions.ordering,
        )
        errors = self._metrics.dlq_writes.labels(self.name, "error")
        try:
            await self.sink.write(
                topic, delivery.key, delivery.value, headers, on_failure=lambda _exc: errors.inc()
            )
        except BaseException:
            self._partitions.dead_letter_abandoned(delivery)
            self._settled.set()
            if trace is not None:
                trace.written(span, False)
            raise
        if trace is not None:
            trace.written(span, True)
        self._partitions.dead_lettered(delivery)
        self._settled.set()
        self._metrics.dlq_writes.labels(self.name, "ok").inc()
        log.info(
            "group %s: dead-lettered %s[%d]@%d (%s: %s)",
            self.name,
            delivery.origin.topic,
            delivery.origin.partition,
            delivery.origin.offset,
            status,
            reason[:200],
        )

    async def _write_tier(
        self, delivery: Delivery, decision: Decision, status: str, endpoint: str
    ) -> None:
        """Write a message to its next retry tier (acks=all, retried until confirmed, as a
        DLQ write: a failed write holds the source commit at the message)."""
        assert self.sink is not None
        tier = decision.tier
        topic = self._group.retry_topics[tier - 1]
        trace = delivery.trace
        span = None if trace is None else trace.write(topic, "tier")
        headers = retry_headers(
            delivery.headers if trace is None else trace.stamped(delivery.headers),
            delivery.origin,
            attempt=delivery.attempt,
            status=status,
            reason=decision.reason,
            endpoint=endpoint,
            group=self.name,
            tier=tier,
            due_at_ms=delivery.due_at_ms,
            counted=delivery.counted_here,
        )
        errors = self._metrics.retry_tier_writes.labels(self.name, str(tier), "error")
        try:
            await self.sink.write(
                topic, delivery.key, delivery.value, headers, on_failure=lambda _exc: errors.inc()
            )
        except BaseException:
            self._partitions.tier_abandoned(delivery)
            self._settled.set()
            if trace is not None:
                trace.written(span, False)
            raise
        if trace is not None:
            trace.written(span, True)
        self._partitions.tier_written(delivery)
        self._settled.set()
        if delivery.moved:
            self._moved()  # it held the partition's commit: commit the move soon
        self._metrics.retry_tier_writes.labels(self.name, str(tier), "ok").inc()
        log.debug(
            "group %s: %s[%d]@%d moved to retry tier %d after attempt %d (%s)",
            self.name,
            delivery.origin.topic,
            delivery.origin.partition,
            delivery.origin.offset,
            tier,
            delivery.attempt,
            status,
        )


Park = Callable[[Delivery, Decision, str, str], None]
"""Starts the write of a message out of its partition: (delivery, decision, status, endpoint)."""


class Tally:
    """Counts each decided outcome once (``consumer_proxy_messages_total``) and starts the
    write of a message the core moved out of its partition (dead letter, retry tier)."""

    def __init__(self, name: str, metrics: ProxyMetrics, park: Park) -> None:
        self._counters = {action: metrics.messages.labels(name, action.value) for action in Action}
        self._acks = self._counters[Action.ACK]
        self._park = park

    def settled(self, delivery: Delivery, decision: Decision, status: str, endpoint: str) -> None:
        """One message decided (by a call's answer, or moved aside by head_block_ms)."""
        action = decision.action
        self._counters[action].inc()
        if action is Action.DEAD_LETTER or action is Action.TIER:
            self._park(delivery, decision, status, endpoint)

    def acked(self, count: int) -> None:
        """``count`` messages of one batch acked (counted together: one metric call)."""
        self._acks.inc(count)
