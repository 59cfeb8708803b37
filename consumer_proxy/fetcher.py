"""The Kafka side of a group: one confluent-kafka consumer, driven from a thread of its own.

Every blocking client call (consume, commit, pause, committed, close) runs on one dedicated
thread, never on the event loop. Running them all on the same thread also orders them: the
rebalance callbacks fire inside ``consume()`` on that thread, so a commit queued after a
revocation sees the revocation (see ``commit``).

The group's running commits are sent asynchronously (``send_commit``): a synchronous commit
is a broker round trip (median 8.5 ms, up to 84 ms on the bench) that the next consume waited
for, the proxy's latency tail at 1,000 msg/s. librdkafka hands the broker's answer to the
``on_commit`` callback, served inside a later ``consume()`` on the same thread. Sent commits
and the revoke callback's synchronous commit go through one queue to the group coordinator
in order, and the answer never needs the application (librdkafka counts a commit as done
when the broker answered, not when the callback ran), so nothing here waits on a lock that
a rebalance callback holds: the commit thread tried before deadlocked on exactly that.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from .config import KafkaConfig
from .kafka_log import KafkaLogGate
from .ports import RebalanceListener

log = logging.getLogger(__name__)

TP = tuple[str, int]
POSITIONS_INTERVAL_S = 0.2  # reading positions costs ~6 us per partition: not on every batch
COMMITTED_TIMEOUT_S = 20.0
"""How long one read of assigned partitions' committed offsets (their ack state) may take."""
CONSUME_CHUNK_S = 2.0
"""The longest single wait inside ``consume()``: a longer wait is served in chunks of this on
the consumer thread, and ends after the chunk in which another call was queued (a commit, a
pause, ``close``) or a rebalance callback ran, so no call waits longer than this for its turn."""
SLICED_WAIT_S = 1.0
"""A wait of at most this (the intake's waits while its group is busy: ``core.cadence``) is
served in slices of ``CONSUME_SLICE_S`` instead of chunks."""
CONSUME_SLICE_S = 0.02
"""... so a call queued behind a busy group's wait (the commit after its last ack) waits at
most this for its turn, not the whole wait (measured: a group's last commit 30-250 ms after
its last ack, where a bare loop commits in 8-20 ms). An idle group's long wait stays in
chunks: its slices would cost CPU for every second it idles."""


def wait_chunk(timeout_s: float) -> float:
    """The longest single wait inside ``consume()`` for a wait of ``timeout_s``: after each,
    the wait ends if a call was queued or a rebalance callback ran."""
    return min(timeout_s, CONSUME_SLICE_S if timeout_s <= SLICED_WAIT_S else CONSUME_CHUNK_S)


UNANSWERED_MAX = 64
"""The most sent commits whose answer is awaited (the committer awaits one at a time; one
that gave up on its answer leaves its entry until the next send prunes it)."""

CommitKey = tuple[tuple[str, int, int, str], ...]


def commit_key(partitions: Sequence[TopicPartition]) -> CommitKey:
    """What tells a commit's answer from another's: its partitions, offsets and metadata (the
    answer carries the list that was sent)."""
    return tuple(
        sorted((tp.topic, tp.partition, tp.offset, tp.metadata or "") for tp in partitions)
    )


FETCH_QUEUE_BACKOFF_MS = 50
"""librdkafka's ``fetch.queue.backoff.ms`` for the proxy's consumers (``kafka.client`` may set
it): how long a partition whose prefetch queue is full waits before it fetches again."""


def consumer_config(
    kafka: KafkaConfig, group: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """librdkafka settings of a group consumer: user passthrough first, the proxy's own last."""
    conf: dict[str, Any] = {
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "session.timeout.ms": 45000,
        "queued.max.messages.kbytes": 16384,
        # Once the prefetch queue holds queued.min.messages (100,000), librdkafka fetches
        # again only after this backoff (its default: 1 s): on a backlog the proxy drained the
        # queue and then waited out most of that second (bench_throughput: half of each run;
        # at 50 ms the proxy's rate is about a fifth higher). It applies only to a full queue:
        # an idle or slow group never waits on it.
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        "enable.partition.eof": False,
    }
    conf.update(kafka.client)
    conf.update(extra or {})
    conf.update(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "partition.assignment.strategy": "cooperative-sticky",
        }
    )
    return conf


class _CallThread:
    """One thread that runs the calls submitted to it, in order, for the event loop.

    What ``run_in_executor`` on a one-thread pool does, for less: every call of an idle group
    is such a hop, and the pool's futures were a tenth of an idle proxy's CPU. The thread is a
    daemon, so a stopping process never waits for a call blocked in the client.
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue ``fn``; the future resolves on the loop with its result or exception."""
        future: asyncio.Future[Any] = self._loop.create_future()
        self._queue.put((fn, future))
        return future

    def waiting(self) -> bool:
        """Whether a call is queued behind the one running."""
        return not self._queue.empty()

    def stop(self) -> None:
        """End the thread after the calls already queued."""
        self._queue.put(None)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                result, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 (handed over to the awaiting task)
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(_settle, future, result, error)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled (shutdown), or gave up: nobody waits
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Fetcher:
    """Async facade over one consumer; all calls are serialised on one thread."""

    def __init__(
        self,
        conf: dict[str, Any],
        topics: Sequence[str],
        listener: RebalanceListener,
        loop: asyncio.AbstractEventLoop,
        callback_timeout_s: float = 60.0,
        from_start: Sequence[str] = (),
    ) -> None:
        """``from_start``: topics of the proxy's own (the redrive topic, the retry tiers) whose
        partitions without a committed offset are read from their start, whatever
        ``auto.offset.reset`` says: each record there is its message's only copy."""
        self._conf = conf
        self._topics = list(topics)
        reset = str(conf.get("auto.offset.reset", "earliest")).lower()
        self._from_start = (
            frozenset(from_start) if reset not in {"earliest", "smallest", "beginning"} else None
        )
        self._listener = listener
        self._loop = loop
        self._callback_timeout_s = callback_timeout_s
        self._calls = _CallThread(f"kafka-{conf['group.id']}", loop)
        self._consumer: Consumer | None = None
        self.log_gate = KafkaLogGate(log, f"group {conf['group.id']} consumer")
        """librdkafka's lines and errors for this consumer, told as state changes."""
        self.closed = False
        self.last_error: str | None = None
        self.positions: dict[TP, int] = {}
        """Each assigned partition's position after a recent ``consume()`` batch (re-read at
        least every POSITIONS_INTERVAL_S, and at the end of any batch with a rebalance)."""
        self.positions_read = 0
        """The number of the reading in ``positions`` (see ``PartitionSet.skip_unfetchable``:
        a reading older than a partition's assignment or last log cut is not used for it)."""
        self._positions_due = 0.0
        self._rebalanced = False  # a rebalance callback ran during the current consume
        self.on_reached: Callable[[], None] = lambda: None
        """Called on the consumer thread when a call that needs a broker succeeded (a
        rebalance callback, a commit): Kafka is reachable, whatever the statistics said last."""
        self._unanswered: dict[CommitKey, collections.deque[asyncio.Future[Any]]] = {}
        """Sent commits by what they sent, each with the futures awaiting its answer (the
        consumer thread's alone)."""

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await self._calls.submit(fn)

    async def start(self) -> None:
        """Create the consumer and subscribe (the group join happens in the first consume)."""

        def create() -> None:
            conf = self.log_gate.attach(dict(self._conf))
            conf["on_commit"] = self._on_commit  # the answers to ``send_commit``
            consumer = Consumer(conf, logger=self.log_gate)
            consumer.subscribe(
                self._topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._consumer = consumer

        await self._run(create)

    # -- rebalance callbacks: consumer thread, inside consume() ---------------------------

    def _call_listener(self, coro: Awaitable[Any]) -> Any:
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
            coro,  # type: ignore[arg-type]
            self._loop,
        )
        return future.result(timeout=self._callback_timeout_s)

    def _reached(self) -> None:
        self.log_gate.reachable()
        self.on_reached()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._positions_due = 0.0  # positions of a previous assignment must not outlive it
        self._rebalanced = True
        self._reached()  # the group coordinator answered
        if not partitions:
            return
        if self.closed:
            # Served inside close() (or the last consume before it): nothing will be consumed
            # from these partitions, and a closing consumer's committed-offset reads wait out
            # their whole timeout (librdkafka answers them "waiting for the coordinator").
            # The client assigns them after this returns and revokes them as it leaves.
            log.info(
                "group %s: %d partitions assigned while closing; not taken",
                self._conf["group.id"],
                len(partitions),
            )
            return
        # librdkafka keeps an application's pause on a partition across revoke or loss and
        # re-assignment (librdkafka issue 1849), while the runner starts every assigned
        # partition unpaused: a partition lost while paused would never be fetched again.
        try:
            consumer.resume(partitions)
        except KafkaException as exc:
            log.warning("resuming %d assigned partitions failed: %s", len(partitions), exc)
        committed = None
        for attempt in range(1, 4):
            try:
                committed = consumer.committed(partitions, timeout=COMMITTED_TIMEOUT_S)
                break
            except KafkaException as exc:
                log.warning("reading committed offsets failed (attempt %d of 3): %s", attempt, exc)
        if committed is None:
            # Without the ack state, messages acked above the committed offset would be
            # delivered again; that is safe (at-least-once) and better than not consuming.
            log.error(
                "could not read the ack state of %d assigned partitions; acked messages above "
                "their committed offsets may be delivered again",
                len(partitions),
            )
            committed = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        elif self._from_start is not None:
            self._assign_from_start(consumer, committed)
        self._call_listener(self._listener.partitions_assigned(committed))

    def _assign_from_start(self, consumer: Consumer, committed: list[TopicPartition]) -> None:
        """Assign the partitions (in place of the client's own assignment after this callback),
        those of ``from_start`` topics without a committed offset at their start: with
        ``auto.offset.reset`` latest, a tier record written before its partition's first
        commit (a tier write confirmed during a shutdown's drain) would be skipped, lost."""
        from_start = self._from_start
        assert from_start is not None
        starts = [
            TopicPartition(
                tp.topic,
                tp.partition,
                OFFSET_BEGINNING if tp.topic in from_start and tp.offset < 0 else OFFSET_INVALID,
            )
            for tp in committed
        ]
        if any(tp.offset == OFFSET_BEGINNING for tp in starts):
            consumer.incremental_assign(starts)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._positions_due = 0.0
        self._rebalanced = True
        if not partitions:
            return
        offsets = self._call_listener(self._listener.partitions_revoked(partitions))
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("commit on revoke failed (acked messages may be redelivered): %s", exc)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._positions_due = 0.0
        self._rebalanced = True
        if partitions:
            self._call_listener(self._listener.partitions_lost(partitions))

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """The broker's answer to a commit sent by ``send_commit`` (consumer thread, inside a
        consume or close; confluent-kafka calls ``on_commit`` for asynchronous commits only).
        An answer nobody awaits any more (its waiter gave up) is dropped."""
        key = commit_key(partitions)
        waiting = self._unanswered.get(key)
        if not waiting:
            return
        future = waiting.popleft()
        if not waiting:
            del self._unanswered[key]
        if error is None:
            self._reached()
        failure = None if error is None else KafkaException(error)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(_settle, future, partitions, failure)

    def _prune_unanswered(self) -> None:
        """Forget sent commits whose waiters gave up, and the oldest beyond UNANSWERED_MAX."""
        for key in list(self._unanswered):
            waiting = self._unanswered[key]
            while waiting and waiting[0].done():
                waiting.popleft()
            if not waiting:
                del self._unanswered[key]
        while sum(len(w) for w in self._unanswered.values()) >= UNANSWERED_MAX:
            key = next(iter(self._unanswered))
            self._fail_unanswered(self._unanswered[key], "too many commits unanswered")
            del self._unanswered[key]

    def _fail_unanswered(self, futures: collections.deque[asyncio.Future[Any]], why: str) -> None:
        error = KafkaException(KafkaError(KafkaError._FAIL, why))
        for future in futures:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(_settle, future, None, error)

    # -- calls ---------------------------------------------------------------------------

    async def consume(self, max_messages: int, timeout_s: float) -> list[Any]:
        """Up to ``max_messages`` messages (rebalance callbacks run in here).

        Waits up to ``timeout_s`` for the first, in chunks (``wait_chunk``: slices of a busy
        group's short wait, chunks of an idle one's long wait); the wait ends after the chunk
        in which another call was queued or a rebalance callback ran (an idle group's intake
        wakes seldom, and nothing else waits for it).
        """

        def consume() -> list[Any]:
            consumer = self._consumer
            assert consumer is not None
            # librdkafka's consume(n, timeout) waits for n messages or the whole timeout, which
            # adds up to `timeout` of latency at low traffic. Wait for the first message only,
            # then take what is already there.
            self._rebalanced = False
            deadline = time.monotonic() + timeout_s
            chunk = wait_chunk(timeout_s)
            messages: list[Any] = consumer.consume(1, chunk)
            while not messages and not self._rebalanced and not self._calls.waiting():
                left = deadline - time.monotonic()
                if left < chunk / 2:  # the rest of a wait is not worth a call
                    break
                messages = consumer.consume(1, min(left, chunk))
            if messages and max_messages > 1:
                messages += consumer.consume(max_messages - 1, 0)
            # Read on this thread right after a batch: a position then counts only messages
            # handed over in this batch or before, plus what the consumer skipped without
            # handing it over (transaction markers, aborted records), which nobody will fetch.
            # An older reading stays true until the assignment changes (that forces a new one).
            now = time.monotonic()
            if now >= self._positions_due:
                self._positions_due = now + POSITIONS_INTERVAL_S
                self.positions = {
                    (tp.topic, tp.partition): tp.offset
                    for tp in consumer.position(consumer.assignment())
                }
                self.positions_read += 1
            return messages

        result: list[Any] = await self._run(consume)
        return result

    async def set_paused(self, pause: Sequence[TP], resume: Sequence[TP]) -> None:
        """Pause and resume partitions (only those still assigned)."""

        def apply() -> None:
            assert self._consumer is not None
            assigned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
            to_pause = [TopicPartition(t, p) for t, p in pause if (t, p) in assigned]
            to_resume = [TopicPartition(t, p) for t, p in resume if (t, p) in assigned]
            if to_pause:
                self._consumer.pause(to_pause)
            if to_resume:
                self._consumer.resume(to_resume)

        await self._run(apply)

    async def commit(self, offsets: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        """Commit synchronously the offsets ``offsets()`` returns when the call gets its turn.

        ``offsets`` is evaluated on the consumer thread after any rebalance callback that was
        queued before it, so it can leave out partitions revoked in between: a stale commit
        could otherwise move a partition that another member now owns backwards.
        """

        def commit() -> list[TopicPartition]:
            assert self._consumer is not None
            chosen = offsets()
            if not chosen:
                return []
            result: list[TopicPartition] = self._consumer.commit(offsets=chosen, asynchronous=False)
            self._reached()
            return result

        result: list[TopicPartition] = await self._run(commit)
        return result

    async def send_commit(
        self, offsets: Callable[[], list[TopicPartition]]
    ) -> asyncio.Future[list[TopicPartition]] | None:
        """Send the offsets ``offsets()`` returns when the call gets its turn on the consumer
        thread (as ``commit``), without waiting for the broker. Returns the answer to await
        (it comes inside a later consume: the committed list, or KafkaException), or None
        when nothing was left to commit. The caller caps its wait: an answer may never come
        (the consumer closed first)."""
        answer: asyncio.Future[list[TopicPartition]] = self._loop.create_future()
        # A failure nobody awaits any more (shutdown cancelled the sender while the send
        # waited for its turn) is not an error to log: the shutdown commit covers it.
        answer.add_done_callback(_retrieved)

        def send() -> bool:
            assert self._consumer is not None
            chosen = offsets()
            if not chosen:
                return False
            self._prune_unanswered()
            self._consumer.commit(offsets=chosen, asynchronous=True)
            self._unanswered.setdefault(commit_key(chosen), collections.deque()).append(answer)
            return True

        sent: bool = await self._run(send)
        return answer if sent else None

    async def position(self, tp: TP) -> int | None:
        """The consumer's current position on ``tp`` (None when not assigned or unknown);
        read after a log truncation, which moves it back."""

        def read() -> int | None:
            assert self._consumer is not None
            try:
                (found,) = self._consumer.position([TopicPartition(*tp)])
            except KafkaException:
                return None
            offset = found.offset
            return offset if offset is not None and offset >= 0 else None

        result: int | None = await self._run(read)
        return result

    async def watermarks(self, partitions: Sequence[TP]) -> dict[TP, int]:
        """High watermarks from the consumer's cached fetch state (no broker round trip)."""

        def read() -> dict[TP, int]:
            assert self._consumer is not None
            result: dict[TP, int] = {}
            for topic, partition in partitions:
                try:
                    _, high = self._consumer.get_watermark_offsets(
                        TopicPartition(topic, partition), cached=True
                    )
                except KafkaException:
                    continue
                if high is not None and high >= 0:
                    result[(topic, partition)] = high
            return result

        result: dict[TP, int] = await self._run(read)
        return result

    async def close(self) -> None:
        """Leave the group (the revoke callback commits what is done) and release the thread."""
        if self.closed:
            return
        self.closed = True

        def close() -> None:
            if self._consumer is not None:
                self._consumer.close()
            for waiting in self._unanswered.values():  # (close served the answers it got)
                self._fail_unanswered(waiting, "the consumer closed before the answer")
            self._unanswered.clear()

        try:
            await self._run(close)
        finally:
            self._calls.stop()
