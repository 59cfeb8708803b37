"""The push path end to end against the real broker and a real in-process gRPC service."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable

import grpc
import pytest

from consumer_proxy.core import records as dlq_records
from consumer_proxy.core.decision import Decision
from consumer_proxy.core.outcomes import Classification
from consumer_proxy.core.partitions import Delivery, PartitionSet
from consumer_proxy.dlq import DeadLetterWriter
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    alter_topic,
    committed_offsets,
    consume_all,
    create_topic,
    produce,
    unique_name,
    value_of,
)
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

CP_HEADERS = {
    dlq_records.H_TOPIC,
    dlq_records.H_PARTITION,
    dlq_records.H_OFFSET,
    dlq_records.H_TIMESTAMP,
    dlq_records.H_ATTEMPT,
    dlq_records.H_STATUS,
    dlq_records.H_REASON,
    dlq_records.H_ENDPOINT,
    dlq_records.H_GROUP,
    dlq_records.H_DEAD_LETTERED_AT,
}


async def test_every_message_is_acked_or_dead_lettered_and_commits_reach_the_end(
    kafka: Broker,
) -> None:
    await _mixed_run(kafka.bootstrap)


async def _mixed_run(bootstrap: str) -> None:
    # Given 600 messages over 4 partitions, 12 of them poison pills
    topic, group = unique_name("orders"), unique_name("billing")
    create_topic(bootstrap, topic, partitions=4)
    poison = {f"m{i}" for i in range(0, 600, 50)}
    records = [
        {"key": f"k{i}", "value": (f"m{i}" if f"m{i}" not in poison else f"m{i} poison")}
        for i in range(600)
    ]
    await asyncio.to_thread(produce, bootstrap, topic, records)
    rng = random.Random(7)

    # ... and a service with random latencies that fails some first attempts, pushed to with
    # a static concurrency of 8
    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value.endswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad payload")
        if n == 1 and rng.random() < 0.1:
            return Behaviour(status=grpc.StatusCode.INTERNAL, details="flaky")
        return Behaviour(delay_s=rng.random() * 0.02)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap, group, [topic], [service.address], delivery={"concurrency": 8}
        )
        proxy, task = start_proxy(config)
        # When the proxy runs until everything is committed
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        await proxy.shutdown()
        await task

    # Then the service never had more than 8 calls at once, and the limit was used in full
    assert service.peak_in_flight == 8
    # and every message was acked once or dead-lettered, and the DLQ holds the poison pills
    acked = {(d.value or b"").decode() for d in service.deliveries if d.outcome == "ACK"}
    assert acked == {r["value"] for r in records} - {f"{p} poison" for p in poison}
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert sorted(value_of(m).decode() for m in dead) == sorted(f"{p} poison" for p in poison)
    for m in dead:
        _, ours = dlq_records.split_headers(m.headers())
        assert set(ours) == CP_HEADERS
        assert ours[dlq_records.H_STATUS] == "INVALID_ARGUMENT"
        assert ours[dlq_records.H_GROUP] == group
        assert ours[dlq_records.H_TOPIC] == topic
        assert ours[dlq_records.H_REASON] == "bad payload"
        original = (
            ours[dlq_records.H_TOPIC],
            int(ours[dlq_records.H_PARTITION]),
            int(ours[dlq_records.H_OFFSET]),
        )
        assert service.count(*original) == 1  # a poison pill is not retried
    # and no message was delivered more often than its failures explain
    assert all(n <= 2 for n in service.counts.values())


async def test_a_slow_message_does_not_hold_back_the_ones_behind_it(kafka: Broker) -> None:
    await _head_of_line(kafka.bootstrap)


async def _head_of_line(bootstrap: str) -> None:
    # Given one partition whose 5th message takes 3 s and the other 199 are fast
    topic, group = unique_name("hol"), unique_name("hol")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(200)])

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        return Behaviour(delay_s=3.0 if msg.offset == 4 else 0.005)

    async with TestService(behaviour) as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))

        # When all fast messages are acked
        def fast_done() -> bool:
            return sum(1 for d in service.deliveries if d.outcome == "ACK" and d.offset != 4) == 199

        await async_wait_until(fast_done, timeout=30)
        slow = next(d for d in service.deliveries if d.offset == 4)
        last_fast = max(d.finished_at or 0.0 for d in service.deliveries if d.offset != 4)
        # Then they finished while the slow one was still running
        assert slow.outcome == "PENDING"
        assert last_fast - slow.received_at < 2.5
        # and the commit waits for the slow one, then moves to the end
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=30)
        await proxy.shutdown()
        await task


async def test_acked_messages_are_not_redelivered_after_a_restart(kafka: Broker) -> None:
    await _restart(kafka.bootstrap)


async def _restart(bootstrap: str) -> None:
    # Given one partition whose offset 10 hangs on the first delivery and the rest ack
    topic, group = unique_name("restart"), unique_name("restart")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(300)])

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        return Behaviour(delay_s=60.0 if msg.offset == 10 and n == 1 else 0.0)

    async with TestService(behaviour) as service:
        config = make_config(bootstrap, group, [topic], [service.address], shutdown_grace_s=0.5)
        proxy, task = start_proxy(config)

        def acked() -> int:
            return sum(1 for d in service.deliveries if d.outcome == "ACK")

        await async_wait_until(lambda: acked() == 299, timeout=30)
        # When the proxy stops with offset 10 still in flight (its call is cancelled)
        await proxy.shutdown()
        await task
        committed = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
        offset, metadata = committed[0]
        assert offset == 10 and metadata  # the ack state above the hole rides in the metadata
        # and another proxy takes over the group
        proxy, task = start_proxy(config)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=30)
        await proxy.shutdown()
        await task

    # Then only the message that was in flight was delivered twice
    twice = {c: n for c, n in service.counts.items() if n > 1}
    assert twice == {(topic, 0, 10): 2}
    assert len(service.counts) == 300


async def _is(value: Awaitable[int | None], expected: int) -> bool:
    return await value == expected


async def test_a_dlq_outage_holds_the_commit_and_loses_nothing(kafka: Broker) -> None:
    await _dlq_outage(kafka.bootstrap)


async def _dlq_outage(bootstrap: str) -> None:
    # Given a DLQ topic that rejects the poison pill (its records are too large for it)
    topic, group = unique_name("dlqout"), unique_name("dlqout")
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, f"{group}.dlq", partitions=1, config={"max.message.bytes": "200"})
    values = [f"m{i}" for i in range(100)]
    values[20] = "poison " + "x" * 1000
    await asyncio.to_thread(produce, bootstrap, topic, values)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value.startswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.FAILED_PRECONDITION, details="cannot parse")
        return Behaviour()

    async with TestService(behaviour) as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        runner = proxy.runners[0]

        # When the DLQ write keeps failing
        def failing() -> bool:
            return isinstance(runner.writer, DeadLetterWriter) and runner.writer.failures >= 2

        await async_wait_until(failing, timeout=30)

        def acked() -> int:
            return sum(1 for d in service.deliveries if d.outcome == "ACK")

        await async_wait_until(lambda: acked() == 99, timeout=30)

        # Then the commit reaches the poison pill and stays there (a commit past it would
        # never come back to 20: commits never go backwards)
        async def committed() -> int | None:
            offsets = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
            return offsets[0][0] if 0 in offsets else None

        await async_wait_until(lambda: _is(committed(), 20), timeout=30)
        last = runner.partitions.parts[(topic, 0)].last_commit
        assert last is not None and last[0] == 20
        # When the DLQ accepts the record again
        await asyncio.to_thread(
            alter_topic, bootstrap, f"{group}.dlq", {"max.message.bytes": "1048588"}
        )
        # Then the pill is dead-lettered once and the commit reaches the end
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert [m.value() for m in dead] == [values[20].encode()]
    assert service.count(topic, 0, 20) == 1


async def test_a_large_poison_pill_fits_the_dlq_the_proxy_creates(kafka: Broker) -> None:
    await _large_pill(kafka.bootstrap)


async def _large_pill(bootstrap: str) -> None:
    # Given a source topic that takes 3 MiB records and a 2 MiB poison pill in it
    topic, group = unique_name("big"), unique_name("big")
    create_topic(bootstrap, topic, partitions=1, config={"max.message.bytes": str(3 << 20)})
    pill = b"poison" + bytes(range(256)) * (2 << 12)  # ~2 MiB of binary
    await asyncio.to_thread(
        produce, bootstrap, topic, [b"ok-1", pill, b"ok-2"], {"message.max.bytes": 4 << 20}
    )

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value.startswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.DATA_LOSS, details="corrupt")
        return Behaviour()

    async with TestService(behaviour) as service:
        # When the proxy creates the DLQ topic itself and dead-letters the pill
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
    # Then the DLQ holds it byte for byte
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert [m.value() for m in dead] == [pill]


async def test_a_crashed_worker_fails_the_run_instead_of_stopping_quietly(
    kafka: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a proxy whose result handling breaks on one message (a stand-in for any bug)
    original = PartitionSet.finish

    def broken(
        self: PartitionSet, delivery: Delivery, result: Classification, probe: bool
    ) -> Decision | None:
        if delivery.offset == 3:
            raise RuntimeError("injected bug")
        return original(self, delivery, result, probe)

    monkeypatch.setattr(PartitionSet, "finish", broken)

    topic, group = unique_name("crash"), unique_name("crash")
    create_topic(kafka.bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, kafka.bootstrap, topic, [f"m{i}" for i in range(10)])
    async with TestService() as service:
        _, task = start_proxy(make_config(kafka.bootstrap, group, [topic], [service.address]))
        # When the worker crashes, Then the proxy's run ends with that error
        with pytest.raises(RuntimeError, match="injected bug"):
            await asyncio.wait_for(task, timeout=60)
    committed = await asyncio.to_thread(committed_offsets, kafka.bootstrap, group, topic)
    assert committed.get(0, (0,))[0] <= 3  # nothing past the message that was not handled
