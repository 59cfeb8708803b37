"""A group's commits: the ``Committer``.

It owns the commit lock (a commit is sent to the consumer thread by one caller at a time),
the wake-ups (a partition went idle, a retry tier write released a commit, traffic after a
quiet spell: ``wake()``), the commit itself (``PartitionSet.commit_plan`` -> the consumer ->
``PartitionSet.committed``, shielded from cancellation), the lag gauges, and its schedule:
every ``commit_interval_ms``, soon after a wake-up, and slowly while the group is quiet
(``core.cadence.CommitCadence``). The runner also commits on revoke (``final_commit``) and
once more at shutdown (``commit()``).

Its running commits are sent without waiting on the consumer thread (``MessageSource.
send_commit``): the broker's answer comes inside a later consume, and the committer awaits it
(at most ``ANSWER_TIMEOUT_S``) still holding its lock, so commits stay one at a time and in
order. The intake's polls hurry only until the commit is sent (``due``). The shutdown commit
waits on the consumer thread (``commit()``): nothing consumes after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from .config import DeliveryConfig
from .core.cadence import CommitCadence
from .core.partitions import Commit, PartitionSet
from .metrics import ProxyMetrics
from .ports import Clock, MessageSource

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 30.0
"""The longest the committer awaits the broker's answer to a commit it sent; then the commit
counts as failed and the next one sends its offsets again. (librdkafka's own request timeout
is 60 s by default, with retries: a coordinator that moved answers within seconds.)"""


def kafka_commit(commit: Commit) -> TopicPartition:
    """``commit`` as the client sends it (with the leader epoch when known, else -1)."""
    part = commit.part
    epoch = -1 if commit.epoch is None else commit.epoch
    return TopicPartition(
        part.topic, part.partition, commit.offset, metadata=commit.metadata, leader_epoch=epoch
    )


T = TypeVar("T")


async def shielded(call: Awaitable[T]) -> T:
    """``call`` shielded from the caller's cancellation (a commit under way on the consumer
    thread finishes either way). A failure after the caller went is retrieved here: shutdown
    cancels the committer mid-commit, and asyncio would otherwise log that commit's failure
    (a routine ILLEGAL_GENERATION during a rebalance) as an error with a traceback."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


COMMITS_FAILING_S = 60.0
"""Commits failing in a row this long make the group not ready (a coordinator moving fails
a commit or two; an error that lasts needs an operator)."""


class Committer:
    """Commits one group's done prefixes and ack state, and reads its lag."""

    def __init__(
        self,
        name: str,
        delivery: DeliveryConfig,
        partitions: PartitionSet,
        metrics: ProxyMetrics,
    ) -> None:
        """``source`` (the group's consumer) and ``clock`` are set when the group runs."""
        self.name = name
        self._interval_s = delivery.commit_interval_ms / 1000.0
        self._budget_bytes = delivery.metadata_budget_bytes
        self._partitions = partitions
        self._metrics = metrics
        self.source: MessageSource | None = None
        self.clock: Clock | None = None
        self.lock = asyncio.Lock()
        """Held while a commit is planned and sent; the intake polls briefly while it is."""
        self._wake = asyncio.Event()  # commit soon (a partition went idle, a tier write ended)
        self._woken = asyncio.Event()  # ... said again during the gap after a commit
        self.quiet = False
        """The committer ticks slowly (the group held nothing): traffic must wake it."""
        self._answering = False  # the commit under the lock was sent; its answer is awaited
        self._failures = 0  # commits failed in a row (told once, when the first fails)
        self._failing_since: float | None = None  # the clock when the first of them failed
        self._failing_with = ""  # the error of the last, told again when it changes kind

    def attach(self, source: MessageSource, clock: Clock) -> None:
        """The group's consumer and clock, once the group runs."""
        self.source = source
        self.clock = clock

    def wake(self) -> None:
        """Commit soon (a partition went idle, or its commit was released)."""
        self._wake.set()
        self._woken.set()

    @property
    def answering(self) -> bool:
        """A commit was sent and its answer is awaited (the committer holds its lock)."""
        return self._answering

    @property
    def due(self) -> bool:
        """A commit is due or on its way to the consumer thread; not while a commit that was
        sent awaits its answer (served inside any consume, however long it waits; a wake-up
        meanwhile is acted on only after it)."""
        return not self._answering and (self._wake.is_set() or self.lock.locked())

    async def run(self) -> None:
        """Commit every interval and soon after each wake-up, until cancelled."""
        clock = self.clock
        assert clock is not None
        cadence = CommitCadence.starting(clock(), self._interval_s)
        gap = cadence.gap_s
        wake = self._wake
        while True:
            # A partition that went idle is committed soon (fewer duplicates after a crash);
            # otherwise every interval; a gap after each commit (``_gap``).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cadence.wait_s(clock())):
                    await wake.wait()
            wake.clear()
            self._woken.clear()
            committed = 0
            try:
                committed = await self.commit(wait=False)
            except KafkaException as exc:
                self._failed(exc)
            else:
                self._succeeded()
            # A failed commit is work left: it is tried again every interval, not at a quiet
            # group's slow ticks (the group may hold nothing, all of it acked but uncommitted).
            busy = self._failures > 0 or self._partitions.holding()
            if cadence.committed(clock(), committed, busy):
                await self._update_lag()
            self.quiet = cadence.slow
            await self._gap(cadence, clock() + gap)

    async def _gap(self, cadence: CommitCadence, end: float) -> None:
        """Wait until ``end`` before the next commit, or less: a wake-up (since the commit
        began) that finds the group idle ends it (``CommitCadence.gap_ends_early``); one
        that finds it busy lets it go on."""
        clock = self.clock
        assert clock is not None
        woken = self._woken
        while True:
            if woken.is_set():
                woken.clear()
                if cadence.gap_ends_early(not self._partitions.holding()):
                    cadence.gap_ended(early=True)
                    return
            left = end - clock()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await woken.wait()
        cadence.gap_ended(early=False)

    def _failed(self, exc: KafkaException) -> None:
        self._failures += 1
        error = exc.args[0] if exc.args else None
        kind = error.name() if isinstance(error, KafkaError) else type(exc).__name__
        if self._failures == 1:
            assert self.clock is not None
            self._failing_since = self.clock()
            log.warning(
                "group %s: commit failed, will retry (until one succeeds, failures are only "
                'counted: consumer_proxy_commits_total{result="error"}, or told when their '
                "error changes): %s",
                self.name,
                exc,
            )
        elif kind != self._failing_with:
            log.warning(
                "group %s: commits still failing (%d in a row), now with another error: %s",
                self.name,
                self._failures,
                exc,
            )
        else:
            log.debug("group %s: commit failed again: %s", self.name, exc)
        self._failing_with = kind

    def _succeeded(self) -> None:
        if self._failures:
            log.info("group %s: commits succeed again after %d failed", self.name, self._failures)
            self._failures = 0
            self._failing_since = None
            self._failing_with = ""

    def problem(self) -> str:
        """What /readyz says of commits that have failed for ``COMMITS_FAILING_S`` or more in a
        row ('' otherwise): the group goes on taking messages in, but nothing it does is
        kept, and after a window past its last commit it stops."""
        since, now = self._failing_since, self.clock() if self.clock is not None else 0.0
        if since is None or now - since < COMMITS_FAILING_S:
            return ""
        return (
            f"commits to Kafka failing for {now - since:.0f} s ({self._failures} in a row, "
            f"the last with {self._failing_with})"
        )

    async def commit(self, *, wait: bool = True) -> int:
        """Commit every partition's done prefix and ack state; returns partitions committed.

        ``wait``: on the consumer thread, which waits for the broker (the shutdown commit);
        else sent from it, and the broker's answer awaited here (the running commits).
        """
        source = self.source
        assert source is not None
        partitions = self._partitions
        async with self.lock:
            plan, over = partitions.commit_plan()
            for part in over:
                self._metrics.metadata_over_budget.labels(self.name).inc()
                log.warning(
                    "group %s: %s[%d]: ack state above offset %d exceeds the %d-byte "
                    "metadata budget; pausing the partition until it fits (done messages "
                    "beyond the encoded range would be redelivered after a crash)",
                    self.name,
                    part.topic,
                    part.partition,
                    part.tracker.committable() if part.tracker is not None else -1,
                    self._budget_bytes,
                )
            if not plan:
                return 0

            def still_owned() -> list[TopicPartition]:
                # Runs on the consumer thread after any queued rebalance callback.
                return [kafka_commit(c) for c in plan if not c.part.revoked]

            try:
                if wait:
                    await shielded(source.commit(still_owned))
                else:
                    await self._send(source, still_owned)
            except KafkaException:
                self._metrics.commits.labels(self.name, "error").inc()
                partitions.commit_confirmed(False)
                raise
            partitions.commit_confirmed(True)
            self._metrics.commits.labels(self.name, "ok").inc()
            kept: list[Commit] = partitions.committed(plan)
            for c in kept:
                labels = (self.name, c.part.topic, str(c.part.partition))
                self._metrics.committed_offset.labels(*labels).set(c.offset)
            return len(plan)

    async def _send(
        self, source: MessageSource, offsets: Callable[[], list[TopicPartition]]
    ) -> None:
        """Send a commit and await the broker's answer (at most ANSWER_TIMEOUT_S): raises
        KafkaException when it failed or did not come."""
        answer = await shielded(source.send_commit(offsets))
        if answer is None:  # every partition of the plan was revoked meanwhile
            return
        self._answering = True
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                await answer  # (cancelled with its waiter: a late answer is dropped)
        except TimeoutError:
            why = f"no answer to the commit within {ANSWER_TIMEOUT_S:g} s"
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, why)) from None
        finally:
            self._answering = False

    async def _update_lag(self) -> None:
        source = self.source
        assert source is not None
        metrics = self._metrics
        parts = list(self._partitions.parts.values())
        highs = await source.watermarks([p.tp for p in parts])
        for part in parts:
            if part.revoked:
                continue
            labels = (self.name, part.topic, str(part.partition))
            if part.tracker is not None:
                metrics.uncommitted.labels(*labels).set(part.tracker.in_flight)
            high = highs.get(part.tp)
            if high is not None and part.last_commit is not None:
                metrics.lag.labels(*labels).set(max(0, high - part.last_commit[0]))
        metrics.key_backlog(self.name, self._partitions.key_backlog())
