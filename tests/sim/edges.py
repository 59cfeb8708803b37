"""The simulated edges the shell simulation gives ``GroupRunner`` (``ports``): ``SimSource``
(the consumer, with ``Fetcher``'s timing and librdkafka's quirks), ``SimPusher`` (the service:
unary, batch and streaming calls) and ``SimSink`` (the DLQ and the retry tiers' topics). They
act on the world and report to the ``ShellSim`` that made them (``tests/sim/shell.py``)."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumer_proxy.core.batching import BatchOutcome
from consumer_proxy.core.cadence import FETCH_WAIT_S
from consumer_proxy.core.heartbeat import CallWatch
from consumer_proxy.core.outcomes import Classification
from consumer_proxy.core.records import CP_PREFIX
from consumer_proxy.dispatcher import read_stream
from consumer_proxy.fetcher import CONSUME_CHUNK_S, CONSUME_SLICE_S, POSITIONS_INTERVAL_S
from consumer_proxy.ports import RebalanceListener
from consumer_proxy.proto.v1 import handler_pb2
from tests.sim.truth import InvariantViolation
from tests.sim.world import (
    TP,
    Consumer,
    Msg,
    Record,
    ident_of,
)

if TYPE_CHECKING:
    from tests.sim.shell import ShellSim

GROUP = "g"
TIER_PREFIX = f"{GROUP}.retry."
DLQ_RETRY_S = 0.2
"""How often the DLQ's producer tries a write again while the DLQ is down."""
CUT_FOUND_S = 1.0
"""The longest the error of a cut the consumer found waits for other partitions' records to
be handed over with (``SimSource.told``)."""


Call = tuple[str, Callable[[], Awaitable[Any]], "asyncio.Future[Any]", float]
"""A call queued for the consumer thread: (what, the call, its caller's future, when queued)."""


class _Thread:
    """The consumer's one thread: calls run one at a time in the order they were queued; a
    caller that goes away (cancelled) does not stop its call."""

    def __init__(self, sim: ShellSim) -> None:
        self._sim = sim
        self._queue: deque[Call] = deque()
        self._more = asyncio.Event()
        self._stopped = False
        self.task = asyncio.get_running_loop().create_task(self._serve(), name="sim:consumer")

    def waiting(self) -> bool:
        return bool(self._queue)

    async def submit(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((what, fn, future, loop.time()))
        self._more.set()
        return await future

    def stop(self) -> None:
        self._stopped = True
        self._more.set()

    async def _serve(self) -> None:
        while True:
            while not self._queue:
                if self._stopped:
                    return
                self._more.clear()
                await self._more.wait()
            what, fn, future, queued = self._queue.popleft()
            self._sim.turn(what, queued)
            if self._sim.kafka_hangs and what in ("commit", "close"):
                await asyncio.Event().wait()  # the coordinator is out of reach: no answer
            try:
                result = await fn()
            except (KafkaException, InvariantViolation) as exc:
                if not future.cancelled():
                    future.set_exception(exc)
                continue
            if not future.cancelled():
                future.set_result(result)


class _Arrivals:
    """What a waiting ``consume`` hears of: a record produced, a rebalance, an error (an
    ``asyncio.Event`` with a timeout, for a fraction of its cost: one wait per poll)."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[bool] | None = None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``set``; False when the time ran out."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, _time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class SimSource:
    """``ports.MessageSource`` over the world's consumer, with ``Fetcher``'s timing."""

    def __init__(self, sim: ShellSim, listener: RebalanceListener) -> None:
        self.sim = sim
        self.consumer = Consumer(
            sim.logs, sim.commits, sim.commit_epochs
        )  # a new process: no pause flags
        self.listener = listener
        self.positions: dict[TP, int] = {}
        self.positions_read = 0
        self._positions_due = 0.0
        self._rebalanced = False
        # (partitions, lost); None: join (assign everything)
        self.pending: list[tuple[list[TP], bool] | None] = [None]
        self.errors: list[ErrorRecord] = []  # handed over by a consume (``told``)
        self._errors_due = math.inf  # ... at the latest by then
        self.rebalancing = False  # the consumer thread is serving a rebalance
        self.arrived = _Arrivals()
        self.thread: _Thread | None = None
        self.crashed = False
        self.idle = False  # a consume is waiting longer than a normal poll
        self.idle_while_due = False  # ... and it began while a commit was due or answered
        self._consuming_since: float | None = None  # when the running consume began
        self._give_way_at = math.inf  # ... when it gives way to a pause call queued
        self._unanswered: dict[asyncio.Future[Any], asyncio.TimerHandle] = {}
        """Sent commits, each with the timer of its answer."""
        self.answers_lost = False
        """Commits sent now reach no broker and are never answered (a scenario's fault)."""

    def _run(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        assert self.thread is not None
        return self.thread.submit(what, fn)

    async def start(self) -> None:
        self.thread = _Thread(self.sim)

    async def consume(self, max_messages: int, timeout_s: float) -> list[Any]:
        runner = self.sim.runner
        # (as the intake chose the wait: a commit due, or a sent one's answer awaited, after
        # which the committer's next commit may be due at once)
        due = runner is not None and (runner.committer.due or runner.committer.answering)
        result: list[Any] = await self._run(
            "consume", lambda: self._consume(max_messages, timeout_s, due)
        )
        return result

    async def _consume(self, max_messages: int, timeout_s: float, due: bool) -> list[Any]:
        loop = asyncio.get_running_loop()
        self._rebalanced = False
        deadline = loop.time() + timeout_s
        self.idle = timeout_s > FETCH_WAIT_S
        self.idle_while_due = self.idle and due
        self.sim.stats.idle_polls += self.idle
        self._consuming_since, self._give_way_at = loop.time(), math.inf
        try:
            # Short waits are served whole here, where ``Fetcher`` serves them in slices
            # (``fetcher.wait_chunk``): a call queued behind one waits longer here than there,
            # and the intake meets the same empty returns either way. (Modelled as slices, the
            # schedules found one of the reverted fixes only after 198 batch seeds: re-tune
            # them before following the fetcher.) But for a pause call queued while the
            # consume runs (the intake's consume gave way to room freed): the consume ends
            # at the end of the slice it was queued in (``set_paused``), as ``Fetcher``'s.
            messages = await self._take(max_messages, min(timeout_s, CONSUME_CHUNK_S))
            assert self.thread is not None
            while not messages and not self._rebalanced and not self.thread.waiting():
                left = deadline - loop.time()
                if left < CONSUME_CHUNK_S / 2:
                    break
                messages = await self._take(max_messages, min(left, CONSUME_CHUNK_S))
        finally:
            self.idle = False
            self._consuming_since = None
        now = loop.time()
        if now >= self._positions_due:
            self._positions_due = now + POSITIONS_INTERVAL_S
            self.positions = dict(self.consumer.position)
            self.positions_read += 1
        return messages

    async def _take(self, max_messages: int, wait_s: float) -> list[Record]:
        """librdkafka's consume: serves rebalances, else returns what is fetchable, waiting
        up to ``wait_s`` for a first record."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while True:
            if self.pending:
                await self._rebalance()
                return []
            if self.errors:
                handed = self._around_cuts(max_messages)
                if handed:
                    return handed
                left = min(end, self._give_way_at) - loop.time()
                if left <= 0:
                    return []
                await self.arrived.wait(min(left, self._errors_due - loop.time()))
                continue
            records = self.consumer.fetch(self.sim.rng, max_messages)
            if records:
                return records
            left = min(end, self._give_way_at) - loop.time()
            if left <= 0:
                return []
            if not await self.arrived.wait(left):
                return []

    def told(self, tp: TP) -> None:
        """The consumer found a cut of ``tp``'s log below what it handed over: the error is
        handed over once other partitions' records come, at most ``CUT_FOUND_S`` later
        (librdkafka finds a cut with a request to the new leader, and queues the error
        where it found it, among the records of partitions fetched meanwhile)."""
        if not self.errors:
            delay = self.sim.mixing.uniform(0.0, CUT_FOUND_S)
            self._errors_due = asyncio.get_running_loop().time() + delay
        self.errors.append(ErrorRecord(tp, KafkaError._LOG_TRUNCATION))
        self.arrived.set()

    def _around_cuts(self, max_messages: int) -> list[Any]:
        """The errors of the cuts found, with the records around them, or nothing yet.

        Until their errors are handed over the cut partitions are not fetched (their
        position has gone back, and librdkafka queues what it fetches from there behind
        the error); other partitions' records come before or after the errors in any
        order. Half the times the cut partitions' records fetched anew come too, after the
        errors: the position the intake then reads for a cut is past them."""
        sim = self.sim
        rng = sim.mixing
        cut = {(error.topic(), error.partition()) for error in self.errors}
        room = max(0, max_messages - len(self.errors))
        out: list[Any] = self.consumer.fetch(rng, room, among=self.consumer.assigned - cut)
        if not out and asyncio.get_running_loop().time() < self._errors_due:
            return []
        sim.stats.errors_among_records += bool(out)
        errors, self.errors = self.errors, []
        for error in errors:
            out.insert(rng.randint(0, len(out)), error)
        if rng.random() < 0.5 and len(out) < max_messages:
            after = self.consumer.fetch(rng, max_messages - len(out), among=cut)
            sim.stats.records_after_a_cut += bool(after)
            out += after
        return out

    async def _rebalance(self) -> None:
        try:
            await self._serve_rebalances()
        finally:
            self.sim.rebalanced_at = asyncio.get_running_loop().time()

    async def _serve_rebalances(self) -> None:
        self.rebalancing = True
        try:
            await self._serve_rebalances_now()
        finally:
            self.rebalancing = False

    async def _serve_rebalances_now(self) -> None:
        self._rebalanced = True
        self._positions_due = 0.0
        while self.pending:
            pending = self.pending.pop(0)
            if pending is None:
                tps = list(self.sim.all_tps)
            else:
                tps = [tp for tp in pending[0] if tp in self.consumer.assigned]
                await (self._lose(tps) if pending[1] else self._revoke(tps))
            self.sim.cut_at_handover(tps)
            self.sim.trace(f"assign {tps}")
            committed = self.consumer.assign(tps)
            self.sim.assigned(committed)
            await self.listener.partitions_assigned(
                [
                    TopicPartition(
                        t,
                        p,
                        -1001 if off is None else off,
                        metadata=meta,
                        leader_epoch=-1 if epoch is None else epoch,
                    )
                    for (t, p), off, meta, epoch in committed
                ]
            )

    async def _revoke(self, tps: list[TP]) -> None:
        sim = self.sim
        sim.trace(f"revoke {tps}")
        sim.stats.paused_at_revoke += sum(tp in self.consumer.paused for tp in tps)
        runner = sim.runner
        assert runner is not None
        parts = runner.partitions.owned(tps)
        offsets = await self.listener.partitions_revoked([TopicPartition(*tp) for tp in tps])
        if not self.crashed:
            for tp in offsets:
                commit = ((tp.topic, tp.partition), tp.offset, tp.metadata or "", tp.leader_epoch)
                sim.committed(*commit)
                self.consumer.commit(*commit)
            for part in parts:
                # Acked messages beyond what the ack state could encode are redelivered.
                if part.tracker is not None and not part.tracker.metadata(sim.budget)[1]:
                    sim.allow_dups(part.tp)
        self._forget(tps)

    async def _lose(self, tps: list[TP]) -> None:
        """The session expired: another member may own ``tps`` now; nothing is committed, so
        what was acked since the last commit may be delivered again."""
        sim = self.sim
        sim.trace(f"lose {tps}")
        for tp in tps:
            sim.allow_dups(tp)
        await self.listener.partitions_lost([TopicPartition(*tp) for tp in tps])
        self._forget(tps)

    def _forget(self, tps: list[TP]) -> None:
        """Give ``tps`` up: librdkafka drops what their queues held, a cut's error too."""
        self.consumer.revoke(tps)
        gone = set(tps)
        self.errors = [e for e in self.errors if (e.topic(), e.partition()) not in gone]
        self.sim.unnoticed -= gone

    async def set_paused(self, pause: Sequence[TP], resume: Sequence[TP]) -> None:
        since = self._consuming_since
        if since is not None:
            # Queued while a consume waits (the intake's consume gives way to room freed):
            # ``Fetcher`` serves a short wait in slices and ends it after the slice in which
            # a call was queued. (Other calls still wait out a short wait here: see
            # ``_consume``.)
            slices = max(
                1, math.ceil((asyncio.get_running_loop().time() - since) / CONSUME_SLICE_S)
            )
            self._give_way_at = since + slices * CONSUME_SLICE_S
            self.arrived.set()

        async def apply() -> None:
            self.consumer.set_paused(list(pause), list(resume))
            self.sim.stats.pauses += len(pause)

        await self._run("pause", apply)

    async def commit(self, offsets: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        async def commit() -> list[TopicPartition]:
            chosen = offsets()
            if not chosen:
                return []
            await asyncio.sleep(self.sim.rng.uniform(0.001, 0.01))  # the broker's answer
            if self.crashed or self.sim.commits_down:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT, "commits down"))
            for tp in chosen:
                commit = ((tp.topic, tp.partition), tp.offset, tp.metadata or "", tp.leader_epoch)
                self.sim.committed(*commit)
                self.consumer.commit(*commit)
            return chosen

        result: list[TopicPartition] = await self._run("commit", commit)
        return result

    async def send_commit(
        self, offsets: Callable[[], list[TopicPartition]]
    ) -> asyncio.Future[list[TopicPartition]] | None:
        """As ``Fetcher.send_commit``: the commit reaches the broker in the order it was sent
        (before a revoke's commit queued after it), and its answer comes later, 1-10 ms on,
        after the consumer thread went on (a failure: the broker or the client said so)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[list[TopicPartition]] = loop.create_future()

        async def send() -> bool:
            chosen = offsets()
            if not chosen:
                return False
            if self.answers_lost:
                return True
            error: KafkaException | None = None
            if self.crashed or self.sim.commits_down:
                error = KafkaException(KafkaError(KafkaError._TRANSPORT, "commits down"))
            else:
                for tp in chosen:
                    commit = (
                        (tp.topic, tp.partition),
                        tp.offset,
                        tp.metadata or "",
                        tp.leader_epoch,
                    )
                    self.sim.committed(*commit)
                    self.consumer.commit(*commit)
            delay = self.sim.rng.uniform(0.001, 0.01)
            self._unanswered[answer] = loop.call_later(delay, _answer, answer, chosen, error)
            # Answered, or its waiter gave up (a committer cancelled mid-commit): the timer
            # goes too (the check after stop() finds a timer left behind).
            answer.add_done_callback(self._forget_answer)
            return True

        sent: bool = await self._run("commit", send)
        return answer if sent else None

    def _forget_answer(self, answer: asyncio.Future[Any]) -> None:
        self._unanswered.pop(answer).cancel()

    async def position(self, tp: TP) -> int | None:
        async def read() -> int | None:
            return self.consumer.position.get(tp)

        result: int | None = await self._run("position", read)
        return result

    async def watermarks(self, partitions: Sequence[TP]) -> dict[TP, int]:
        async def read() -> dict[TP, int]:
            return {tp: self.sim.logs[tp].end for tp in partitions}

        result: dict[TP, int] = await self._run("watermarks", read)
        return result

    async def close(self) -> None:
        async def close() -> None:
            owned = sorted(self.consumer.assigned)
            if owned and not self.crashed:
                await self._revoke(owned)  # leaving the group revokes everything

        assert self.thread is not None
        try:
            await self._run("close", close)
        except asyncio.CancelledError:
            # Given up on (the runner's LEAVE_S) while the thread is stuck in a call: the real
            # consumer's thread is a daemon, gone with the process
            self.thread.task.cancel()
            raise
        finally:
            for answer, timer in list(self._unanswered.items()):  # as ``Fetcher.close``
                timer.cancel()
                answer.cancel()
            self.thread.stop()
            await asyncio.gather(self.thread.task, return_exceptions=True)


class ErrorRecord:
    """A consumer error as ``consume`` hands it over (a log truncation)."""

    def __init__(self, tp: TP, code: int) -> None:
        self._tp = tp
        self._error = KafkaError(code, "log truncation detected")

    def error(self) -> KafkaError:
        return self._error

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]


@dataclass
class _Endpoint:
    target: str = "sim"
    ejected: bool = False


class SimPusher:
    """``ports.Pusher``: the service, answering on virtual time."""

    def __init__(self, sim: ShellSim) -> None:
        self.sim = sim
        self._endpoint = _Endpoint()

    def start(self) -> None:
        pass

    def pick(self) -> Any:
        return self._endpoint

    async def push(self, request: Any, endpoint: Any, metadata: Any = None) -> Classification:
        sim = self.sim
        ident = _ident(request.message)
        result, latency = sim.answer(ident)
        await asyncio.sleep(latency)
        return result

    async def push_batch(
        self, payload: bytes, count: int, endpoint: Any, metadata: Any = None
    ) -> BatchOutcome:
        sim = self.sim
        request = handler_pb2.HandleMessageBatchRequest.FromString(payload)
        idents = [_ident(m) for m in request.messages]
        outcome, latency = sim.answer_batch(idents)
        sim.stats.batch_calls += 1
        sim.stats.batched_messages += count
        await asyncio.sleep(latency)
        return outcome

    def batches(self, endpoint: Any) -> bool:
        return True  # the schedules configure batch mode always, or off

    def batch_support(self) -> str:
        return ""

    def instances(self) -> list[dict[str, Any]]:
        return []

    async def push_stream(
        self,
        request: handler_pb2.HandleMessageStreamRequest,
        endpoint: Any,
        watch: CallWatch,
        on_heartbeat: Callable[[float], None],
        metadata: Any = None,
    ) -> Classification:
        sim = self.sim
        ident = _ident(request.message)
        stream = sim.stream(ident, request.heartbeat_interval_ms / 1000.0)
        try:
            return await read_stream(stream.read, watch, on_heartbeat, sim.classifier)
        except _Failed as failed:
            return sim.classifier.from_status(failed.code, failed.code.name)

    async def close(self) -> None:
        pass


class _Failed(Exception):
    """A streaming call the service failed with a status (an ``AioRpcError`` in gRPC)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self.code = code


BEAT = handler_pb2.HandleMessageStreamEvent(heartbeat=handler_pb2.Heartbeat(progress="sim"))


class Stream:
    """One ``HandleMessageStream`` call as the service plays it: ``steps`` (wait, then an
    event, or a status that fails the call), then silence, or heartbeats for ever."""

    def __init__(
        self, steps: list[tuple[float, Any]], interval_s: float, endless: bool = False
    ) -> None:
        self._steps = deque(steps)
        self._interval_s = interval_s
        self._endless = endless

    async def read(self) -> Any:
        if not self._steps:
            if not self._endless:
                await asyncio.Event().wait()  # silent: only the proxy's watch ends the call
            self._steps.append((self._interval_s, BEAT))
        wait, event = self._steps.popleft()
        await asyncio.sleep(wait)
        if isinstance(event, grpc.StatusCode):
            raise _Failed(event)
        return event


class SimSink:
    """``ports.DeadLetterSink``: the DLQ; a write returns once it is confirmed."""

    def __init__(self, sim: ShellSim) -> None:
        self.sim = sim

    async def write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Any,
        on_failure: Any = None,
    ) -> int:
        sim = self.sim
        fields = dict(headers)
        ident = ident_of(headers, value)  # (a record produced without headers: its value)
        loop = asyncio.get_running_loop()
        # The DLQ and the tiers share the producer: tier writes fail too. The producer tries
        # every DLQ_RETRY_S; each failed try is told. (Waited out in one wait for the DLQ to
        # come back, then up to the first try after that: polling every try was a tenth of
        # the simulation's cost.)
        while sim.dlq_down:
            failed_at = loop.time()
            if on_failure is not None:  # the try at failed_at, told as it fails
                on_failure(KafkaException(KafkaError(KafkaError._TRANSPORT, "dlq down")))
            await sim.dlq_back()
            tries = max(1, math.ceil((loop.time() - failed_at) / DLQ_RETRY_S))
            if on_failure is not None:
                for _ in range(tries - 1):  # those after it, before the DLQ was back
                    on_failure(KafkaException(KafkaError(KafkaError._TRANSPORT, "dlq down")))
            await asyncio.sleep(failed_at + tries * DLQ_RETRY_S - loop.time())
        await asyncio.sleep(sim.rng.uniform(0.001, 0.02))
        if topic.startswith(TIER_PREFIX):
            extra = tuple(
                (k, v) for k, v in headers if k.startswith(CP_PREFIX) and isinstance(v, bytes)
            )
            tp = (topic, int(fields["cp-original-partition"]))
            sim.tier_written(ident, tp, Msg(0, "", key=key, value=value, extra=extra))
        else:
            sim.dead_lettered(ident, fields["cp-status"].decode())
        return 0

    async def close(self, timeout_s: float = 10.0) -> None:
        pass

    def refusal(self) -> str | None:
        return None


def _ident(message: handler_pb2.Message) -> int:
    """A pushed message's id (``world.ident_of``)."""
    headers = [(header.key, header.value) for header in message.headers]
    return ident_of(headers, message.value if message.has_value else None)


def _answer(
    future: asyncio.Future[list[TopicPartition]],
    chosen: list[TopicPartition],
    error: KafkaException | None,
) -> None:
    if future.done():  # its waiter gave up or was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(chosen)
