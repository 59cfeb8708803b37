"""The group's consumer on shutdown: what librdkafka does on close (real broker; the rebalance
listener only records what it is told), and a commit under way when shutdown cancels its caller.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Sequence

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from consumer_proxy.committer import shielded
from consumer_proxy.config import KafkaConfig
from consumer_proxy.fetcher import FETCH_QUEUE_BACKOFF_MS, Fetcher, consumer_config
from tests.support.kafka import Broker, admin, committed_offsets, create_topic, produce, unique_name
from tests.support.proxy import FAST_CONSUMER
from tests.support.waiting import async_wait_until


class _Listener:
    def __init__(self) -> None:
        self.assigned: list[TopicPartition] = []
        self.revoked: list[TopicPartition] = []

    async def partitions_assigned(self, committed: Sequence[TopicPartition]) -> None:
        self.assigned += committed

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        self.revoked += partitions
        return []

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        return None


def _members_assigned(client: AdminClient, group: str) -> int:
    """How many partitions the broker has handed to the group's members (SyncGroup done);
    0 while the group's coordinator cannot tell yet (a fresh broker loads its offsets topic)."""
    future = client.describe_consumer_groups([group], request_timeout=5)[group]
    try:
        description = future.result(timeout=10)
    except (KafkaException, TimeoutError):
        return 0
    return sum(len(m.assignment.topic_partitions) for m in description.members)


@pytest.mark.kafka
async def test_a_consumer_closing_with_an_assignment_not_yet_served_closes_at_once(
    kafka: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # librdkafka answers a closing consumer's committed-offset reads with "waiting for the
    # coordinator" until the read's timeout: an assignment served inside close() that reads
    # them held a SIGTERM'd member for 3 x 20 s (seen in the key-order rebalance storm test).
    # The read's timeout is made 120 s here, so close() waiting for one fails the test.
    monkeypatch.setattr("consumer_proxy.fetcher.COMMITTED_TIMEOUT_S", 120.0)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("closeassign"), unique_name("closeassign")
    create_topic(bootstrap, topic, partitions=2)
    conf = consumer_config(KafkaConfig(bootstrap_servers=bootstrap), group)
    conf.update(FAST_CONSUMER)
    listener = _Listener()
    fetcher = Fetcher(conf, [topic], listener, asyncio.get_running_loop())
    client = admin(bootstrap)
    await fetcher.start()
    closing = False
    try:
        # Given a member the group has given its partitions, whose assignment waits in its
        # queue (it has not consumed since subscribing: the join ran on librdkafka's threads)
        await async_wait_until(
            lambda: _members_assigned(client, group) == 2,
            timeout=60,
            message="the group to hand the member its partitions",
        )
        assert listener.assigned == []
        # When it closes
        closing = True
        await asyncio.wait_for(asyncio.shield(fetcher.close()), timeout=60)
        # Then it closes without reading the offsets of partitions it will never consume
        # (a close left waiting on its thread is abandoned: that thread is a daemon)
        assert listener.assigned == [], "a closing member is not handed partitions"
    finally:
        if not closing:
            await fetcher.close()


async def test_a_commit_failing_after_shutdown_cancelled_its_caller_is_not_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    release = asyncio.Event()

    async def commit() -> list[TopicPartition]:  # the consumer thread's answer comes later
        await release.wait()
        raise KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION))

    # Given a committer waiting on a commit under way
    committer = asyncio.create_task(shielded(commit()))
    await asyncio.sleep(0)
    # When shutdown cancels the committer, and the commit then fails (a rebalance began)
    committer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await committer
    release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()  # asyncio reports an exception nobody retrieved when the task is collected
    # Then no error is logged for it (shutdown commits again on its own)
    assert [r.getMessage() for r in caplog.records] == []


def test_a_partition_assigned_again_reports_no_position_of_its_previous_assignment(
    kafka: Broker,
) -> None:
    # librdkafka resets a partition's application position when its fetcher stops (on
    # unassign, rd_kafka_toppar_fetch_stopped) and serves a new assignment only once the old
    # fetcher has stopped; a seek (which is how it handles a log truncation) resets it too.
    # The proxy relies on it as one of two guards (the other: PartitionSet.skip_unfetchable
    # ignores readings older than an assignment), so it is pinned here on the real client.
    # Given a consumer that consumed 100 records of a partition (position 100) and whose
    # group committed 60
    bootstrap = kafka.bootstrap
    topic = unique_name("reassign")
    create_topic(bootstrap, topic, partitions=1)
    produce(bootstrap, topic, [f"m{i}" for i in range(100)])
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("reassign"),
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.incremental_assign([TopicPartition(topic, 0, 0)])
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < 100 and time.monotonic() < deadline:
            seen += [m.offset() or 0 for m in consumer.consume(100, 1.0) if m.error() is None]
        assert len(seen) == 100
        [before] = consumer.position([TopicPartition(topic, 0)])
        assert before.offset == 100
        consumer.commit(offsets=[TopicPartition(topic, 0, 60)], asynchronous=False)
        # When the partition is unassigned and at once assigned again (from its commit)
        consumer.incremental_unassign([TopicPartition(topic, 0)])
        consumer.incremental_assign([TopicPartition(topic, 0)])
        # Then its position is unknown until it consumes again, never the previous 100
        [after] = consumer.position([TopicPartition(topic, 0)])
        assert after.offset < 0, after
        first: list[int] = []
        deadline = time.monotonic() + 30
        while not first and time.monotonic() < deadline:
            first = [m.offset() or 0 for m in consumer.consume(1, 1.0) if m.error() is None]
        assert first == [60]
        [resumed] = consumer.position([TopicPartition(topic, 0)])
        assert resumed.offset == 61
    finally:
        consumer.close()


def test_a_full_prefetch_queue_fetches_again_within_a_tenth_of_a_second_unless_set() -> None:
    # Given a group's consumer settings, by default and with kafka.client setting the backoff
    nowhere = "127.0.0.1:1"  # (never connected to: the consumer is closed at once)
    default = consumer_config(KafkaConfig(bootstrap_servers=nowhere), "g")
    own = consumer_config(
        KafkaConfig(bootstrap_servers=nowhere, client={"fetch.queue.backoff.ms": 1000}), "g"
    )
    # Then a partition whose prefetch queue is full waits 50 ms before it fetches again, not
    # librdkafka's second (on a backlog the proxy waited out most of it: bench_throughput),
    # and an operator's own value wins
    assert default["fetch.queue.backoff.ms"] == FETCH_QUEUE_BACKOFF_MS <= 100
    assert own["fetch.queue.backoff.ms"] == 1000
    # And librdkafka takes the setting
    Consumer(default).close()


@pytest.mark.kafka
async def test_a_sent_commit_is_answered_inside_a_later_consume_and_one_left_at_close_is_settled(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    topic, group = unique_name("sendcommit"), unique_name("sendcommit")
    create_topic(bootstrap, topic, partitions=1)
    produce(bootstrap, topic, [f"m{i}" for i in range(10)])
    conf = consumer_config(KafkaConfig(bootstrap_servers=bootstrap), group)
    conf.update(FAST_CONSUMER)
    listener = _Listener()
    fetcher = Fetcher(conf, [topic], listener, asyncio.get_running_loop())
    await fetcher.start()
    closed = False
    try:
        # Given a member that owns the topic's partition
        async def assigned() -> bool:
            await fetcher.consume(10, 0.2)
            return bool(listener.assigned)

        await async_wait_until(assigned, timeout=60, message="the partition to be assigned")
        # When it sends two commits, one after the other, without waiting for the broker
        first = await fetcher.send_commit(lambda: [TopicPartition(topic, 0, 3, metadata="a")])
        second = await fetcher.send_commit(lambda: [TopicPartition(topic, 0, 5, metadata="b")])
        assert first is not None and second is not None

        # Then each answer comes inside a later consume, telling which commit it answers
        async def answered() -> bool:
            await fetcher.consume(1, 0.1)
            return first.done() and second.done()

        await async_wait_until(answered, timeout=30, message="the broker's answers")
        assert [(tp.offset, tp.metadata) for tp in first.result()] == [(3, "a")]
        assert [(tp.offset, tp.metadata) for tp in second.result()] == [(5, "b")]
        # and the broker applied them in the order they were sent
        assert committed_offsets(bootstrap, group, topic) == {0: (5, "b")}
        # and nothing is sent when nothing is left to commit
        assert await fetcher.send_commit(list) is None
        # When a commit is sent and the member closes before it consumes again
        third = await fetcher.send_commit(lambda: [TopicPartition(topic, 0, 7, metadata="c")])
        assert third is not None
        closed = True
        await asyncio.wait_for(fetcher.close(), timeout=60)
        # Then its answer is settled all the same (served inside close, or failed there):
        # nothing waits for it forever
        await async_wait_until(third.done, timeout=10, message="the third answer")
        if third.exception() is None:
            assert committed_offsets(bootstrap, group, topic) == {0: (7, "c")}
    finally:
        if not closed:
            await fetcher.close()
