"""The group's consumer on shutdown: what librdkafka does on close (real broker; the rebalance
listener only records what it is told), and a commit under way when shutdown cancels its caller.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Sequence

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from consumer_proxy.config import KafkaConfig
from consumer_proxy.fetcher import Fetcher, consumer_config
from consumer_proxy.group import shielded
from tests.support.kafka import Broker, admin, create_topic, unique_name
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
