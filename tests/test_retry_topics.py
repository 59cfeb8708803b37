"""Retry tiers against the real broker (delivery.retry_topics): the source commit does not
wait for messages in a tier, a kill -9 while they wait loses nothing, a message that always
fails goes through every tier (each delay kept) to the DLQ, and an unwritable tier holds the
source commit at the message."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from consumer_proxy.config import GroupConfig, KafkaConfig, ProxyConfig
from consumer_proxy.core import records as rec
from consumer_proxy.dlq import DeadLetterWriter, ensure_topics
from consumer_proxy.errors import KafkaUnavailableError
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.status import collect_status, render_status
from tests.support.kafka import (
    Broker,
    admin,
    alter_topic,
    committed_offsets,
    consume_all,
    create_topic,
    partitions_of,
    produce,
    unique_name,
)
from tests.support.ledger import Ledger
from tests.support.proxy import (
    FAST_CONSUMER,
    ProxyProcess,
    caught_up,
    caught_up_now,
    config_dict,
    make_config,
    start_proxy,
    write_config,
)
from tests.support.service import Behaviour, TestService, ThreadedService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

FLAKY = Behaviour(status=grpc.StatusCode.INTERNAL, details="not yet")


def test_the_source_commit_does_not_wait_for_the_tiers_and_a_kill_9_loses_nothing(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given 5,000 messages over 4 partitions, 5% of which fail three times before succeeding
    bootstrap = kafka.bootstrap
    topic, group = unique_name("tiers"), unique_name("tiers")
    partitions, window, n = 4, 200, 5000
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("retry tiers 2 s / 5 s, kill -9 during the waits")
    records = ledger.records(n, partitions=partitions)
    flaky = {Ledger.id_of(r["headers"]) for i, r in enumerate(records) if i % 20 == 3}
    produce(bootstrap, topic, records)

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        ident = Ledger.id_of((h.key, h.value) for h in msg.headers)
        return FLAKY if ident in flaky and k <= 3 else Behaviour()

    with ThreadedService(behaviour) as service:

        def flaky_acked() -> int:
            return sum(
                1
                for d in service.deliveries
                if d.outcome == "ACK" and Ledger.id_of(d.headers) in flaky
            )

        # ... and a proxy with two in-memory attempts, then tiers of 2 s and 5 s
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={
                "concurrency": 40,
                "max_in_flight": window,
                "in_memory_attempts": 2,
                "retry_topics": [{"delay_ms": 2000}, {"delay_ms": 5000}],
            },
            client={"session.timeout.ms": 3000, "heartbeat.interval.ms": 300},
        )
        log = tmp_path / "proxy.log"
        proxy = ProxyProcess(config, log).start()
        try:
            # When the source is delivered, Then its commit reaches the end while the flaky
            # messages still wait in the tiers (at least 7 s of tier delays each)
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=90, interval=0.2)
            waiting = len(flaky) - flaky_acked()
            assert waiting > 0, "every retry was done before the source commit reached the end"
            # When the proxy is killed with SIGKILL while they wait
            proxy.check_alive()
        finally:
            proxy.kill()
        ledger.note(f"killed with {waiting} of {len(flaky)} flaky messages in the tiers")
        # and started again
        proxy = ProxyProcess(config, log).start()
        try:
            wait_until(lambda: flaky_acked() >= len(flaky), timeout=90, interval=0.3)
            tiers = (f"{group}.retry.1", f"{group}.retry.2")

            def tiers_committed() -> bool:
                return all(caught_up_now(bootstrap, group, t) for t in tiers)

            wait_until(tiers_committed, timeout=30, interval=0.3)
        finally:
            code = proxy.stop()
        assert code == 0, proxy.output()[-3000:]
        ledger.observe(service.deliveries)
        deliveries = list(service.deliveries)
    # Then every message is acked, nothing is dead-lettered, and a flaky one's 3rd and 4th
    # attempts came from the tiers with its original coordinates
    ledger.check(
        max_duplicates=(partitions * 3) * window,
        bound="(source + tier partitions) x max_in_flight",
    )
    assert ledger.dead_lettered() == set()
    final = [d for d in deliveries if d.outcome == "ACK" and Ledger.id_of(d.headers) in flaky]
    assert {d.source for d in final} == {"retry"}
    # (4, or 3 when the kill came after a tier-2 write and before the tier-1 commit: the
    # tier-1 record comes again, and by then the service acks it)
    assert {d.attempt for d in final} <= {3, 4}
    assert {d.topic for d in final} == {topic}
    # and the proxy created its tier topics as wide as the source
    for n in (1, 2):
        assert len(partitions_of(bootstrap, f"{group}.retry.{n}")) == partitions


async def test_a_message_that_always_fails_goes_through_every_tier_to_the_dlq(
    kafka: Broker,
) -> None:
    # Given one message the service always fails, and tiers of 2 s and 4 s
    bootstrap = kafka.bootstrap
    topic, group = unique_name("always"), unique_name("always")
    delays = [2000, 4000]
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, ["ok-1", "pill", "ok-2"])

    def behaviour(msg: handler_pb2.Message, _k: int) -> Behaviour:
        return FLAKY if msg.value == b"pill" else Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"retry_topics": [{"delay_ms": d} for d in delays], "max_attempts": 10},
        )
        proxy, task = start_proxy(config)

        async def dead_lettered() -> bool:
            try:
                return bool(await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 2.0))
            except KafkaException:  # not created yet: the proxy is starting
                return False

        # When it runs until the DLQ holds the message
        await async_wait_until(dead_lettered, timeout=60, interval=0.5)
        await proxy.shutdown()
        await task
    # Then it was tried once from the source and once from each tier, in that order
    tries = sorted((d for d in service.deliveries if d.value == b"pill"), key=lambda d: d.attempt)
    assert [(d.attempt, d.source) for d in tries] == [(1, "primary"), (2, "retry"), (3, "retry")]
    assert {d.coordinates for d in tries} == {(topic, 0, 1)}
    # and each tier's delay was kept (measured from the failed attempt's end to the next
    # attempt, on the service's own clock: at least the delay, at most 20% more)
    for earlier, later, delay_ms in zip(tries[:-1], tries[1:], delays, strict=True):
        assert earlier.finished_at is not None
        waited = later.received_at - earlier.finished_at
        print(f"tier delay {delay_ms} ms: next attempt after {waited * 1000:.0f} ms")
        assert delay_ms / 1000 <= waited <= delay_ms / 1000 * 1.2, (delay_ms, waited)
    # and each tier record says its tier, its attempts and when it is due
    for n, delay_ms in enumerate(delays, start=1):
        [record] = await asyncio.to_thread(consume_all, bootstrap, f"{group}.retry.{n}")
        _, ours = rec.split_headers(record.headers())
        assert ours[rec.H_RETRY_TIER] == str(n) and ours[rec.H_ATTEMPT] == str(n)
        assert (ours[rec.H_TOPIC], ours[rec.H_OFFSET]) == (topic, "1")
        written = int(ours[rec.H_DEAD_LETTERED_AT])
        assert abs(int(ours[rec.H_DUE_AT]) - written - delay_ms) < 100
    # and the DLQ record has the attempt count and the original coordinates
    [dlq_record] = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    _, ours = rec.split_headers(dlq_record.headers())
    assert ours[rec.H_ATTEMPT] == "3" and ours[rec.H_STATUS] == "INTERNAL"
    assert (ours[rec.H_TOPIC], ours[rec.H_PARTITION], ours[rec.H_OFFSET]) == (topic, "0", "1")
    assert rec.H_RETRY_TIER not in ours
    assert await caught_up(bootstrap, group, topic)


async def test_tier_records_waiting_ten_minutes_never_hold_the_source_back(kafka: Broker) -> None:
    # Given a retry tier of 10 minutes that holds 200 records written a moment ago (by a
    # burst of failures before a restart), the smallest byte budget (1 KiB), which those
    # records fill many times over, and a source of 2,000 messages of which 200 fail once
    bootstrap = kafka.bootstrap
    topic, group = unique_name("tierbudget"), unique_name("tierbudget")
    tier_topic = f"{group}.retry.1"
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, tier_topic, partitions=1)
    due_at_ms = int(time.time() * 1000) + 600_000
    waiting = [
        {
            "value": f"waiting-{i:05d}-".ljust(60, "x"),
            "headers": rec.retry_headers(
                [],
                rec.Origin(topic, 0, 10_000 + i, 1, 0),
                attempt=1,
                status="INTERNAL",
                reason="not yet",
                endpoint="e",
                group=group,
                tier=1,
                due_at_ms=due_at_ms,
            ),
        }
        for i in range(200)
    ]
    await asyncio.to_thread(produce, bootstrap, tier_topic, waiting)
    values = [f"{'fail' if i % 10 == 5 else 'ok'}-{i:05d}-".ljust(60, "x") for i in range(2000)]
    await asyncio.to_thread(produce, bootstrap, topic, values)

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        return FLAKY if msg.value.startswith(b"fail") and k == 1 else Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"max_in_flight_bytes": 1024, "retry_topics": [{"delay_ms": 600_000}]},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        most = 0

        def last_delivered() -> bool:
            nonlocal most
            most = max(most, sum(p.bytes for p in runner.partitions.parts.values() if p.tier))
            return any((d.value or b"").startswith(b"ok-01999") for d in service.deliveries)

        try:
            # When the proxy delivers the source
            await async_wait_until(last_delivered, timeout=60, interval=0.02)
            acked_at = time.monotonic()
            # Then its commit reaches the end within seconds of the last message (not after
            # the tier's 10 minutes): tier records have a byte budget of their own
            await async_wait_until(
                lambda: caught_up(bootstrap, group, topic), timeout=30, interval=0.05
            )
            lag_s = time.monotonic() - acked_at
            print(f"source committed to its end {lag_s:.2f} s after its last message")
            # while the tier's records filled that budget and wait for their due time
            assert most >= 1024 and runner.partitions.budgets[1].held <= 1024 + 256
            assert [d for d in service.deliveries if d.source == "retry"] == []
            assert sum((d.value or b"").startswith(b"fail") for d in service.deliveries) == 200
        finally:
            await proxy.shutdown()
            await task


async def test_an_unwritable_retry_topic_holds_the_source_commit_and_loses_nothing(
    kafka: Broker,
) -> None:
    # Given a tier topic that rejects the failing message (too large for it)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("tierout"), unique_name("tierout")
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, f"{group}.retry.1", partitions=1, config={"max.message.bytes": "200"})
    values = [f"m{i}" for i in range(100)]
    values[20] = "big " + "x" * 1000
    await asyncio.to_thread(produce, bootstrap, topic, values)

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        return FLAKY if msg.value.startswith(b"big") and k == 1 else Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"retry_topics": [{"delay_ms": 1000}]},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]

        # When the tier write keeps failing
        def failing() -> bool:
            return isinstance(runner.writer, DeadLetterWriter) and runner.writer.failures >= 2

        await async_wait_until(failing, timeout=30)
        await async_wait_until(
            lambda: sum(1 for d in service.deliveries if d.outcome == "ACK") == 99, timeout=30
        )

        # Then the source commit reaches the message and stays there
        async def committed_at_20() -> bool:
            offsets = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
            return 0 in offsets and offsets[0][0] == 20

        await async_wait_until(committed_at_20, timeout=30)
        last = runner.partitions.parts[(topic, 0)].last_commit
        assert last is not None and last[0] == 20
        # When the tier accepts it again
        await asyncio.to_thread(
            alter_topic, bootstrap, f"{group}.retry.1", {"max.message.bytes": "1048588"}
        )
        # Then it is retried from the tier and acked, and the commit reaches the end
        await async_wait_until(lambda: service.count(topic, 0, 20) == 2, timeout=60)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=30)
        await proxy.shutdown()
        await task
    retried = [d for d in service.deliveries if d.offset == 20]
    assert [(d.source, d.outcome) for d in retried] == [("primary", "INTERNAL"), ("retry", "ACK")]
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 2.0) == []


async def test_a_hung_message_is_moved_aside_and_the_commit_passes_it(kafka: Broker) -> None:
    # Given one partition whose 6th message hangs on its first delivery (the call stays open
    # far longer than head_block_ms) while the other 199 are acked
    bootstrap = kafka.bootstrap
    topic, group = unique_name("hung"), unique_name("hung")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(200)])
    release = asyncio.Event()
    head_block_ms, commit_interval_ms = 1500, 1000

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        return Behaviour(hold=release) if msg.offset == 5 and k == 1 else Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            service={"timeout_ms": 60_000},
            delivery={
                "retry_topics": [{"delay_ms": 1000}],
                "head_block_ms": head_block_ms,
                "commit_interval_ms": commit_interval_ms,
            },
        )
        proxy, task = start_proxy(config)
        await async_wait_until(lambda: proxy.runners and proxy.runners[0].assignment(), timeout=30)
        runner = proxy.runners[0]

        def committed_past_it() -> bool:
            part = runner.partitions.parts.get((topic, 0))
            last = part.last_commit if part is not None else None
            return last is not None and last[0] > 5  # a commit the broker confirmed

        # When the handler hangs on it, Then the commit moves past it within head_block_ms
        # plus a commit interval, long before the call's 60 s deadline
        await async_wait_until(committed_past_it, timeout=30, interval=0.01)
        [hung] = [d for d in service.deliveries if d.offset == 5]
        waited = time.monotonic() - hung.received_at
        print(f"commit moved past the hung message {waited * 1000:.0f} ms after it was pushed")
        assert waited <= (head_block_ms + commit_interval_ms) / 1000
        offsets = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
        assert offsets[0][0] > 5
        # and the message is retried later from the tier, and acked
        await async_wait_until(lambda: service.count(topic, 0, 5) == 2, timeout=30)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=30)
        # When the hung call finally answers, Then its late result is ignored
        release.set()
        await async_wait_until(lambda: hung_finished(service), timeout=10)
        assert runner.partitions.counters.unblocks == 1
        await proxy.shutdown()
        await task
    tries = [d for d in service.deliveries if d.offset == 5]
    assert [(d.source, d.attempt) for d in tries] == [("primary", 1), ("retry", 2)]
    assert tries[1].received_at - hung.received_at >= (head_block_ms + 1000) / 1000
    [record] = await asyncio.to_thread(consume_all, bootstrap, f"{group}.retry.1")
    _, ours = rec.split_headers(record.headers())
    assert ours[rec.H_STATUS] == "HEAD_BLOCKED" and ours[rec.H_ATTEMPT] == "1"
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 2.0) == []


def hung_finished(service: TestService) -> bool:
    return all(d.outcome != "PENDING" for d in service.deliveries)


async def test_status_shows_each_tiers_depth_and_oldest_due_time(kafka: Broker) -> None:
    # Given a group with two tiers whose first tier holds two records (due at t and t + 1 s)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("tstatus"), unique_name("tstatus")
    create_topic(bootstrap, topic, partitions=1)
    config = make_config(
        bootstrap,
        group,
        [topic],
        ["127.0.0.1:1"],
        delivery={"retry_topics": [{"delay_ms": 5000}, {"delay_ms": 60000}]},
    )
    create_topic(bootstrap, f"{group}.retry.1", partitions=2)
    due = 1_800_000_000_000
    tier_records = [
        {
            "value": f"v{i}",
            "partition": i,
            "headers": rec.retry_headers(
                [],
                rec.Origin(topic, 0, i, 1, 0),
                attempt=1,
                status="INTERNAL",
                reason="r",
                endpoint="e",
                group=group,
                tier=1,
                due_at_ms=due + 1000 * (1 - i),
            ),
        }
        for i in range(2)
    ]
    await asyncio.to_thread(produce, bootstrap, f"{group}.retry.1", tier_records)

    # When the status is read from Kafka
    async def read() -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(collect_status, config.kafka, config.groups)
        except KafkaUnavailableError:  # a fresh broker's group coordinator is still loading
            return None

    report = await async_wait_until(read, timeout=30, interval=0.5)
    # Then each tier says its depth and the earliest due time of its next records
    tiers = report["groups"][0]["retry_tiers"]
    assert tiers == [
        {
            "tier": 1,
            "topic": f"{group}.retry.1",
            "delay_ms": 5000,
            "depth": 2,
            "oldest_due_at_ms": due,
        },
        {
            "tier": 2,
            "topic": f"{group}.retry.2",
            "delay_ms": 60000,
            "depth": None,
            "oldest_due_at_ms": None,
        },
    ]
    table = render_status(report)
    assert f"retry tier 1 {group}.retry.1 (5000 ms): depth 2, oldest due 2027-01-15" in table
    assert f"retry tier 2 {group}.retry.2 (60000 ms): depth missing" in table


async def test_tier_topics_left_by_a_config_with_more_tiers_are_told_with_what_they_hold(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a group that ran with three tiers: its tier 2 holds 3 records it never consumed,
    # its tier 3 one record it did consume
    bootstrap = kafka.bootstrap
    topic, group = unique_name("fewer"), unique_name("fewer")
    create_topic(bootstrap, topic)
    for n in (1, 2, 3):
        create_topic(bootstrap, f"{group}.retry.{n}")
    await asyncio.to_thread(produce, bootstrap, f"{group}.retry.2", ["a", "b", "c"])
    await asyncio.to_thread(produce, bootstrap, f"{group}.retry.3", ["d"])
    consumed = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        consumed.commit(offsets=[TopicPartition(f"{group}.retry.3", 0, 1)], asynchronous=False)
    finally:
        consumed.close()
    # When it starts with one tier
    caplog.set_level(logging.WARNING, logger="consumer_proxy")
    async with TestService() as service:
        config = make_config(
            bootstrap, group, [topic], [service.address],
            delivery={"retry_topics": [{"delay_ms": 1000}]},
        )  # fmt: skip
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: proxy.runners[0].started.is_set(), timeout=60)
        finally:
            await proxy.shutdown()
            await task
    # Then it says, once, that tier 2 holds 3 records no configured tier consumes, and how to
    # drain them (tier 3 holds nothing unconsumed: not named)
    told = [r.getMessage() for r in caplog.records if "retry tier topics beyond" in r.getMessage()]
    assert len(told) == 1, told
    assert f"{group}.retry.2 (3 records)" in told[0]
    assert f"{group}.retry.3" not in told[0]
    assert "at least 2 tiers" in told[0]


DAY_MS = 24 * 3600 * 1000


def _retention_ms(bootstrap: str, topic: str) -> int:
    from confluent_kafka.admin import ConfigResource, ResourceType  # type: ignore[attr-defined]

    client = admin(bootstrap)
    [future] = client.describe_configs(
        [ConfigResource(ResourceType.TOPIC, topic)], request_timeout=30
    ).values()
    return int(future.result(timeout=30)["retention.ms"].value)


async def test_tier_topics_keep_their_records_well_past_their_delay(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a group whose tier 2 waits 3 days, on a cluster whose default retention is a day
    # (this project's test broker: log.retention.hours=24, a common setting), and whose tier 3
    # topic exists already, made by hand with a retention of an hour
    bootstrap = kafka.bootstrap
    topic, name = unique_name("keep"), unique_name("keep")
    create_topic(bootstrap, topic)
    create_topic(bootstrap, f"{name}.retry.3", config={"retention.ms": str(3600 * 1000)})
    group = GroupConfig.model_validate(
        {
            "name": name,
            "topics": [topic],
            "service": {"endpoints": ["127.0.0.1:1"]},
            "delivery": {
                "retry_topics": [{"delay_ms": 60_000}, {"delay_ms": 3 * DAY_MS}, {"delay_ms": 1000}]
            },
        }
    )
    caplog.set_level(logging.WARNING, logger="consumer_proxy")
    # When the proxy creates its missing topics (at start)
    kafka_config = KafkaConfig(bootstrap_servers=bootstrap)
    created = await asyncio.to_thread(ensure_topics, kafka_config, group)
    # Then the tier topics it created keep a record a week past their delay: a tier record is
    # its message's only copy (the source offset was committed when it was written), and one
    # deleted before it is fetched would be skipped, its message lost
    assert {f"{name}.retry.1", f"{name}.retry.2"} <= set(created)
    assert _retention_ms(bootstrap, f"{name}.retry.1") == 60_000 + 7 * DAY_MS
    assert _retention_ms(bootstrap, f"{name}.retry.2") == 3 * DAY_MS + 7 * DAY_MS
    # ... and the tier topic made by hand with too short a retention is told of, once, with
    # the retention to set
    told = [r.getMessage() for r in caplog.records if "keeps records" in r.getMessage()]
    assert len(told) == 1 and f"{name}.retry.3" in told[0], told
    assert f"at least {1000 + 7 * DAY_MS}" in told[0]


async def test_a_tier_record_before_its_partitions_first_commit_is_delivered_whatever_the_reset(
    kafka: Broker,
) -> None:
    # Given a group whose kafka.client sets auto.offset.reset: latest (kafka.client overrides
    # the consumer's defaults), and a record in its tier 1 that its previous run wrote (the
    # source offset committed) before any commit of that tier partition: a tier write
    # confirmed during a shutdown's drain (the intake stops first), or just before a kill -9
    bootstrap = kafka.bootstrap
    topic, group = unique_name("latest"), unique_name("latest")
    create_topic(bootstrap, topic)
    create_topic(bootstrap, f"{group}.retry.1")
    await asyncio.to_thread(produce, bootstrap, topic, ["m"])
    headers = rec.retry_headers(
        [],
        rec.Origin(topic, 0, 0, 1000, 1),
        attempt=1,
        status="INTERNAL",
        reason="not yet",
        endpoint="e",
        group=group,
        tier=1,
        due_at_ms=0,
    )
    await asyncio.to_thread(
        produce, bootstrap, f"{group}.retry.1", [{"value": b"m", "headers": headers}]
    )
    previous = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        previous.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)
    finally:
        previous.close()
    # When the proxy starts again
    async with TestService() as service:
        config = ProxyConfig(
            **config_dict(
                bootstrap,
                group,
                [topic],
                [service.address],
                client={"auto.offset.reset": "latest"},
                delivery={"retry_topics": [{"delay_ms": 1000}]},
            )
        )
        proxy, task = start_proxy(config, consumer_overrides=FAST_CONSUMER)
        try:
            # Then the message is delivered from its tier (its only copy), at its second
            # attempt, not skipped by the reset meant for the source topics
            await async_wait_until(lambda: len(service.deliveries) >= 1, timeout=60)
            await async_wait_until(lambda: caught_up(bootstrap, group, f"{group}.retry.1"), 60)
            assert [(d.coordinates, d.attempt) for d in service.deliveries] == [((topic, 0, 0), 2)]
        finally:
            await proxy.shutdown()
            await task
