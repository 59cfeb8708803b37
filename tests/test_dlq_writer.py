"""The DLQ writer's decisions with the producer injected: refusals are told with their reason,
a fatal producer error replaces the producer, a cancelled write leaves nothing behind.

The fake producer stands in for the pure recovery decisions only; the real broker's DLQ
outages are in tests/test_faults.py, tests/test_push_path.py and tests/test_health.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumer_proxy.adapters import RealEdges
from consumer_proxy.config import GroupConfig, KafkaConfig
from consumer_proxy.core.decision import Action
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.dlq import (
    DeadLetterWriter,
    SharedProducer,
    SharedProducers,
    failure_reason,
    producer_config,
)
from consumer_proxy.group import GroupRunner
from consumer_proxy.metrics import ProxyMetrics
from tests.support.records import Rec
from tests.support.scrape import parse
from tests.support.waiting import async_wait_until

FATAL = KafkaError(KafkaError._FATAL, "ProduceRequest: sequence out of order", fatal=True)
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)


class FakeProducer:
    """Answers every record with ``fail`` (None = delivered) when polled."""

    def __init__(self, conf: dict[str, Any], fail: KafkaError | None) -> None:
        self.conf = conf
        self.fail = fail
        self.produced = 0
        self.purged = False
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._woken = threading.Event()

    def produce(self, topic: str, **kwargs: Any) -> None:
        with self._lock:
            self.produced += 1
            self._pending.append(kwargs["on_delivery"])
        self._woken.set()

    def poll(self, timeout: float) -> int:
        self._woken.wait(timeout)  # the poller thread idles here, as in librdkafka's poll
        self._woken.clear()
        with self._lock:
            reports, self._pending = self._pending, []
        for report in reports:
            report(self.fail, None)
        return len(reports)

    def flush(self, timeout: float) -> int:
        self.poll(0)
        return 0

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.purged = True


class Factory:
    """Producer n (0-based) answers with ``fails[n]``; the last entry for any later one."""

    def __init__(self, *fails: KafkaError | None) -> None:
        self.fails = fails
        self.made: list[FakeProducer] = []

    def __call__(self, conf: dict[str, Any]) -> FakeProducer:
        fail = self.fails[min(len(self.made), len(self.fails) - 1)]
        self.made.append(FakeProducer(conf, fail))
        return self.made[-1]


def _writer(factory: Factory, metrics: ProxyMetrics | None = None) -> DeadLetterWriter:
    return DeadLetterWriter(
        {"bootstrap.servers": "unused:9092"},
        asyncio.get_running_loop(),
        retry_initial_s=0.01,
        retry_max_s=0.05,
        group="billing",
        metrics=metrics,
        producer_factory=factory,
    )


def _metric(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    return parse(metrics.exposition().decode()).total(name, **labels)


def test_a_fatal_producer_error_replaces_the_producer_and_the_write_goes_through() -> None:
    async def scenario() -> None:
        # Given a producer that hit a fatal error (every record fails with it)
        factory = Factory(FATAL, None)
        writer = _writer(factory)
        try:
            # When a dead letter is written
            failed = await asyncio.wait_for(writer.write("billing.dlq", b"k", b"v", []), 10)
            # Then the writer replaced the producer and the new one confirmed the record
            assert failed == 1
            assert len(factory.made) == 2 and writer.recreated == 1
            await async_wait_until(lambda: factory.made[0].purged, timeout=10)
            assert factory.made[1].produced == 1
            assert writer.refusal() is None
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_many_writes_failing_on_one_fatal_producer_replace_it_once() -> None:
    async def scenario() -> None:
        factory = Factory(FATAL, None)
        writer = _writer(factory)
        try:
            writes = [writer.write("billing.dlq", b"k", str(i).encode(), []) for i in range(20)]
            results = await asyncio.wait_for(asyncio.gather(*writes), 10)
            assert set(results) <= {0, 1}
            assert len(factory.made) == 2 and writer.recreated == 1
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_a_fatal_error_reported_through_error_cb_replaces_an_idle_producer() -> None:
    async def scenario() -> None:
        factory = Factory(None)
        writer = _writer(factory)
        try:
            # When librdkafka reports a fatal error (e.g. a missing IdempotentWrite ACL) with
            # no write under way, from the producer's thread
            thread = threading.Thread(target=factory.made[0].conf["error_cb"], args=(FATAL,))
            thread.start()
            thread.join()
            # Then the producer is replaced before the next dead letter needs it
            await async_wait_until(lambda: len(factory.made) == 2, timeout=10)
            assert await asyncio.wait_for(writer.write("billing.dlq", None, b"v", []), 10) == 0
            assert factory.made[1].produced == 1
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_a_refusing_dlq_is_reported_with_its_reason_until_it_accepts_the_record() -> None:
    async def scenario() -> None:
        # Given a DLQ that refuses records as too large
        factory = Factory(TOO_LARGE)
        metrics = ProxyMetrics()
        writer = _writer(factory, metrics)
        try:
            task = asyncio.create_task(writer.write("billing.dlq", b"k", b"v" * 100, []))
            # Then the writer says so, naming the DLQ and the reason, and counts by reason
            await async_wait_until(lambda: writer.refusal() is not None, timeout=10)
            refusal = writer.refusal()
            assert refusal is not None
            assert refusal.startswith("DLQ billing.dlq refuses records (record_too_large: ")
            assert "1 dead letter waits" in refusal
            assert _metric(metrics, "consumer_proxy_dlq_held_messages", group="billing") == 1
            await async_wait_until(
                lambda: (
                    _metric(
                        metrics,
                        "consumer_proxy_dlq_write_errors_total",
                        group="billing",
                        reason="record_too_large",
                    )
                    >= 2
                ),
                timeout=10,
            )
            # When the topic is fixed, the write goes through and the refusal clears by itself
            factory.made[0].fail = None
            assert await asyncio.wait_for(task, 10) >= 2
            assert writer.refusal() is None
            assert _metric(metrics, "consumer_proxy_dlq_held_messages", group="billing") == 0
            assert writer.recreated == 0  # not a fatal error: the producer stays
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_a_cancelled_dlq_write_stops_retrying_and_leaves_no_state_behind() -> None:
    async def scenario() -> None:
        # Given a write that the DLQ keeps refusing
        factory = Factory(TOO_LARGE)
        metrics = ProxyMetrics()
        writer = _writer(factory, metrics)
        try:
            task = asyncio.create_task(writer.write("billing.dlq", b"k", b"v", []))
            await async_wait_until(lambda: factory.made[0].produced >= 3, timeout=10)
            # When it is cancelled (its partition was revoked)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Then nothing says the DLQ refuses records any more, and no retry is left
            produced = factory.made[0].produced
            assert writer.refusal() is None
            assert _metric(metrics, "consumer_proxy_dlq_held_messages", group="billing") == 0
            assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            deadline = time.monotonic() + 0.3  # ten retry periods: none may come
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert factory.made[0].produced == produced
        finally:
            await writer.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), "record_too_large"),
        (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "topic_authorization"),
        (KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART), "unknown_topic"),
        (KafkaError(KafkaError._MSG_TIMED_OUT), "timed_out"),
        (KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED, fatal=True), "fatal"),
        (FATAL, "fatal"),
        (KafkaError(KafkaError.NOT_ENOUGH_REPLICAS), "other"),
        (None, "other"),
    ],
)
def test_dlq_failure_reasons_are_short_categories(error: KafkaError | None, reason: str) -> None:
    assert failure_reason(error) == reason


def test_a_produce_call_that_raises_fatal_also_replaces_the_producer() -> None:
    class Raising(FakeProducer):
        def produce(self, topic: str, **kwargs: Any) -> None:
            raise KafkaException(FATAL)

    async def scenario() -> None:
        made: list[FakeProducer] = []

        def factory(conf: dict[str, Any]) -> FakeProducer:
            made.append((Raising if not made else FakeProducer)(conf, None))
            return made[-1]

        writer = DeadLetterWriter(
            {}, asyncio.get_running_loop(), 0.01, 0.05, producer_factory=factory
        )
        try:
            assert await asyncio.wait_for(writer.write("t.dlq", None, b"v", []), 10) == 1
            assert len(made) == 2 and made[1].produced == 1
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_a_fatal_error_that_persists_does_not_churn_producers() -> None:
    async def scenario() -> None:
        # Given a fatal error that every new producer hits again (an ACL still missing), and a
        # clock that stands still (less than retry_max_s passes)
        factory = Factory(FATAL)
        writer = DeadLetterWriter(
            {},
            asyncio.get_running_loop(),
            0.01,
            0.05,
            group="billing",
            producer_factory=factory,
            clock=lambda: 100.0,
        )
        try:
            task = asyncio.create_task(writer.write("billing.dlq", None, b"v", []))
            # When the write keeps failing on the replacement too
            await async_wait_until(
                lambda: len(factory.made) == 2 and factory.made[1].produced >= 3, timeout=10
            )
            # Then the producer was replaced once, and the write still waits (never skipped)
            assert len(factory.made) == 2 and writer.recreated == 1
            assert not task.done()
            refusal = writer.refusal()
            assert refusal is not None and "(fatal: _FATAL: " in refusal
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await writer.close()

    asyncio.run(scenario())


def test_writers_sharing_a_producer_keep_their_own_refusals_and_the_last_close_stops_it() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        # Given one producer whose first client hits a fatal error, shared by two groups
        factory = Factory(FATAL, None)
        shared = SharedProducer({}, loop, recreate_every_s=0.05, producer_factory=factory)
        changes: list[str] = []
        billing = DeadLetterWriter(
            {},
            loop,
            0.01,
            0.05,
            group="billing",
            producer=shared,
            on_change=lambda: changes.append("billing"),
        )
        orders = DeadLetterWriter({}, loop, 0.01, 0.05, group="orders", producer=shared)
        assert shared.users == 2
        # When only billing writes, and its first attempt fails on the fatal client
        failed = await asyncio.wait_for(billing.write("billing.dlq", b"k", b"v", []), 10)
        # Then the client is replaced once for both, the refusal was billing's alone (told
        # when it began and when it ended), and orders writes through the new client
        assert failed == 1 and shared.recreated == 1 and len(factory.made) == 2
        assert billing.failures == 1 and orders.failures == 0
        assert changes == ["billing", "billing"]
        assert await asyncio.wait_for(orders.write("orders.dlq", b"k", b"v", []), 10) == 0
        assert factory.made[1].produced == 2
        # When one writer closes the client keeps serving; the last close stops its poller
        await billing.close()
        assert shared.session.poller.is_alive()
        await orders.close()
        assert shared.users == 0
        await async_wait_until(lambda: not shared.session.poller.is_alive(), timeout=10)

    asyncio.run(scenario())


def test_the_process_keeps_one_producer_per_distinct_configuration() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        producers = SharedProducers()
        a = producers.get({"bootstrap.servers": "unused:9092", "message.timeout.ms": 1}, loop)
        b = producers.get({"message.timeout.ms": 1, "bootstrap.servers": "unused:9092"}, loop)
        c = producers.get({"bootstrap.servers": "unused:9092", "message.timeout.ms": 2}, loop)
        assert a is b and a is not c
        writers = [DeadLetterWriter({}, loop, producer=p) for p in (a, b, c)]
        assert producers.active() == 2
        for writer in writers:
            await writer.close()
        assert producers.active() == 0
        # A producer whose writers all closed is not handed out again
        assert (
            producers.get({"bootstrap.servers": "unused:9092", "message.timeout.ms": 1}, loop)
            is not a
        )
        await DeadLetterWriter(
            {},
            loop,
            producer=producers.get(
                {"bootstrap.servers": "unused:9092", "message.timeout.ms": 1}, loop
            ),
        ).close()

    asyncio.run(scenario())


async def test_a_lost_partitions_dlq_write_is_cancelled_and_its_message_given_back() -> None:
    # Given a group whose DLQ write for a poison pill cannot complete (its broker is
    # unreachable, so the real writer keeps retrying)
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:1")
    group = GroupConfig(
        name="lost",
        topics=["t"],
        service={"endpoints": ["127.0.0.1:1"]},
        delivery={"batch": "off"},  # unary: one ready queue
    )
    metrics = ProxyMetrics()
    runner = GroupRunner(group, metrics, RealEdges(kafka, metrics))
    loop = asyncio.get_running_loop()
    writer = DeadLetterWriter(producer_config(kafka, 1000), loop, group="lost", metrics=metrics)
    runner.writer = runner._parking.sink = writer
    core = runner.partitions
    core.assign("t", 0, 0, "")
    core.intake(Rec("t", 0))
    assert isinstance(runner.ready, asyncio.Queue)
    delivery = runner.ready.get_nowait()
    assert core.begin(delivery)
    poison = Classifier().from_status(grpc.StatusCode.INVALID_ARGUMENT, "poison")
    decision = core.finish(delivery, poison, probe=False)
    assert decision is not None and decision.action is Action.DEAD_LETTER
    runner._parking.start(delivery, decision, "INVALID_ARGUMENT", "e")
    [write] = runner._parking.tasks
    try:
        # When the partition is lost (another member owns it now)
        await runner.partitions_lost([TopicPartition("t", 0)])
        # Then the write is cancelled at once (the new owner dead-letters the message; one
        # going on here would add a copy outside the documented bound) and nothing is held
        assert write.cancelled() and not runner._parking.tasks
        assert core.parts == {} and core.bytes == 0
    finally:
        write.cancel()
        await asyncio.gather(write, return_exceptions=True)
        await writer.close(timeout_s=1.0)
