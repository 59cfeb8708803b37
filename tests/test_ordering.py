"""delivery.ordering on the real broker: key order at the service, through members, faults
and a poison message.

What the service sees is the proof. For every key (per partition) the check
(``_assert_key_order``) takes every delivery in arrival order and requires that the key's
previous message (the next lower offset of that key) had been acked, and the ack had ended,
before the delivery arrived. That one rule gives all the claims at once: a key's messages are
delivered in offset order, never two different ones of a key at the same time, and a
redelivery (after a kill -9 or a rebalance) only ever repeats a message whose predecessor is
done, so the first successful deliveries of a key are in offset order too.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import pytest

from consumer_proxy.core.records import H_OFFSET, H_ORDERING
from consumer_proxy.dlq import DeadLetterWriter
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    alter_topic,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    unique_name,
)
from tests.support.ledger import Ledger
from tests.support.proxy import (
    STEADY_CONSUMER,
    ProxyProcess,
    caught_up,
    caught_up_now,
    make_config,
    start_proxy,
    write_config,
)
from tests.support.scrape import parse
from tests.support.service import RETRY, Behaviour, Delivery, TestService, ThreadedService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

KEYS = 200


def _key(i: int, _ident: str) -> bytes:
    return b"k%03d" % (i % KEYS)


def _jittery(
    retry_share: float, max_delay_s: float
) -> Callable[[handler_pb2.Message, int], Behaviour]:
    """Random latency up to ``max_delay_s``; ``retry_share`` of the messages answer RETRY on
    their first delivery. Seeded per (partition, offset), so a redelivery behaves the same."""

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        rnd = random.Random(msg.partition * 1_000_003 + msg.offset)
        delay = rnd.uniform(0.0, max_delay_s)
        if n == 1 and rnd.random() < retry_share:
            return Behaviour(delay_s=delay, action=RETRY, retry_after_ms=5)
        return Behaviour(delay_s=delay)

    return behaviour


def _assert_key_order(deliveries: Iterable[Delivery], lane: Callable[[Delivery], object]) -> int:
    """Every delivery arrived after the ack of its lane's previous message had ended.

    ``lane`` maps a delivery to its ordering lane (the key; the partition). Returns how many
    deliveries were checked.
    """
    lanes: dict[tuple[str, int, object], list[Delivery]] = defaultdict(list)
    for d in deliveries:
        lanes[(d.topic, d.partition, lane(d))].append(d)
    checked = 0
    for name, ds in lanes.items():
        first_ack: dict[int, float] = {}
        for d in ds:
            if d.outcome == "ACK" and d.finished_at is not None:
                first_ack[d.offset] = min(first_ack.get(d.offset, d.finished_at), d.finished_at)
        offsets = sorted({d.offset for d in ds})
        previous = dict(zip(offsets[1:], offsets, strict=False))
        for d in sorted(ds, key=lambda d: d.received_at):
            before = previous.get(d.offset)
            if before is None:
                continue
            acked_at = first_ack.get(before)
            assert acked_at is not None and acked_at <= d.received_at, (
                f"lane {name}: offset {d.offset} (attempt {d.attempt}) arrived at "
                f"{d.received_at:.4f} before offset {before} of its lane was acked "
                f"({acked_at})"
            )
            checked += 1
    return checked


def _by_key(d: Delivery) -> object:
    return d.key


def _by_partition(_d: Delivery) -> object:
    return None


def _assert_committed_to_end(bootstrap: str, group: str, topic: str) -> None:
    ends = end_offsets(bootstrap, topic)
    committed = committed_offsets(bootstrap, group, topic)
    assert {p: c[0] for p, c in committed.items()} == ends


def _membership_lines(members: Iterable[ProxyProcess]) -> int:
    return sum(m.output().count(": assigned ") + m.output().count(": revoked ") for m in members)


def _settle(members: list[ProxyProcess], quiet_s: float = 2.0) -> None:
    """Wait until every member holds partitions and no assignment moved for ``quiet_s``."""
    last = [-1, time.monotonic()]

    def settled() -> bool:
        for m in members:
            assert m.alive(), m.output()[-3000:]
        lines = _membership_lines(members)
        if lines != last[0]:
            last[:] = [lines, time.monotonic()]
        return all(": assigned " in m.output() for m in members) and (
            time.monotonic() - last[1] >= quiet_s
        )

    wait_until(settled, timeout=90, interval=0.2, message="the group to settle")


# --------------------------------------------------------------------------- 3 members


def test_key_order_holds_for_20000_messages_over_200_keys_through_three_members(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given 20,000 messages over 200 keys on 4 partitions, a service with random latency that
    # asks for a retry of 5% of them, and three proxy members in key mode
    bootstrap = kafka.bootstrap
    topic, group = unique_name("keyorder"), unique_name("keyorder")
    partitions, n = 4, 20_000
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("key order: 20k messages, 200 keys, 3 members, 5% retries")
    with ThreadedService(_jittery(0.05, 0.003)) as service:
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"ordering": "key", "concurrency": 100, "max_in_flight": 2000},
            client=STEADY_CONSUMER,  # no member dies here
        )
        members = [ProxyProcess(config, tmp_path / f"member-{i}.log").start() for i in range(3)]
        try:
            _settle(members)
            # When the messages arrive once the group has settled
            produce(bootstrap, topic, ledger.records(n, partitions=partitions, key=_key))
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=180, interval=0.3)
        finally:
            codes = [m.stop() for m in members]
        assert codes == [0, 0, 0], [m.output()[-2000:] for m in members]
        # (the redrive topic's partition is spread too: one member may hold only that one)
        working = sum(1 for m in members if f"assigned {topic}[" in m.output())
        assert working >= 2
        deliveries = service.deliveries
    # Then every key's deliveries are in offset order, one at a time
    assert _assert_key_order(deliveries, _by_key) > n - KEYS
    retried = sum(1 for d in deliveries if d.outcome == "RETRY")
    assert retried > n * 0.03
    # and nothing is lost, nothing acked twice
    ledger.observe(deliveries)
    ledger.note(f"{retried} retries, 3 members, {working} of them owning source partitions")
    ledger.check(max_duplicates=0, bound="no fault: none")
    _assert_committed_to_end(bootstrap, group, topic)


# --------------------------------------------------------------------------- storm + kill -9


def test_key_order_holds_through_a_rebalance_storm_and_a_kill_9(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given 6000 messages over 200 keys on 4 partitions, a service with random latency and
    # 5% retries, and members in key mode throttled so that the topic outlasts the storm
    bootstrap = kafka.bootstrap
    topic, group = unique_name("keystorm"), unique_name("keystorm")
    partitions, n, window = 4, 6000, 500
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("key order: rebalance storm + kill -9")
    produce(bootstrap, topic, ledger.records(n, partitions=partitions, key=_key))
    delivery = {"ordering": "key", "concurrency": 50, "max_in_flight": window}
    client = {"session.timeout.ms": 3000, "heartbeat.interval.ms": 300}
    with ThreadedService(_jittery(0.05, 0.003)) as service:
        storm = write_config(
            tmp_path / "storm.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={**delivery, "rate_limit_per_s": 100},
            client=client,
        )
        final = write_config(
            tmp_path / "final.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery=delivery,
            client=client,
        )
        logs = iter(tmp_path / f"member-{i}.log" for i in range(20))
        members: list[ProxyProcess] = []

        def join(config: Path) -> ProxyProcess:
            member = ProxyProcess(config, next(logs)).start()
            members.append(member)
            wait_until(
                lambda: ": assigned " in member.output() or not member.alive(),
                timeout=90,
                message="the new member to be assigned partitions",
            )
            assert member.alive(), member.output()[-3000:]
            return member

        def acked() -> int:
            return sum(1 for d in service.deliveries if d.outcome == "ACK")

        try:
            a = join(storm)
            join(storm)
            # When members join, one is killed with SIGKILL mid-run, one leaves gracefully
            join(storm)
            wait_until(lambda: acked() >= 1000, timeout=60)
            a.kill()
            members.remove(a)
            join(storm)
            assert members[0].stop() == 0, members[0].output()[-3000:]
            members.pop(0)
            assert acked() < n, "the storm must happen mid-run"
            # and a last, unthrottled member joins and the others leave
            join(final)
            while len(members) > 1:
                assert members[0].stop() == 0, members[0].output()[-3000:]
                members.pop(0)
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=120, interval=0.3)
        finally:
            for member in members:
                member.stop()
        deliveries = service.deliveries
    # Then per key, every delivery (first ones and redeliveries) came after the previous
    # message of its key was acked: the first successful deliveries are in offset order
    assert _assert_key_order(deliveries, _by_key) > n - KEYS
    ledger.observe(deliveries)
    ledger.note("1 SIGKILL, 5 joins, 3 graceful leaves")
    ledger.check(
        max_duplicates=partitions * window,
        bound=f"1 kill x {partitions} partitions x max_in_flight {window}",
    )
    _assert_committed_to_end(bootstrap, group, topic)


# --------------------------------------------------------------------------- a poison message


def test_a_poison_message_holds_back_only_its_own_key_until_its_dlq_write_is_confirmed(
    kafka: Broker,
) -> None:
    asyncio.run(_poison(kafka.bootstrap))


async def _poison(bootstrap: str) -> None:
    # Given 1000 messages over 10 keys on one partition; the 106th (key k5) is a poison pill
    # too large for the DLQ topic for now, so its DLQ write keeps failing
    topic, group = unique_name("keypoison"), unique_name("keypoison")
    n, keys, poison_at = 1000, 10, 105
    create_topic(bootstrap, topic, partitions=1)
    dlq_topic = create_topic(
        bootstrap, f"{group}.dlq", partitions=1, config={"max.message.bytes": "200"}
    )
    ledger = Ledger("key order: a poison message, its DLQ write held")

    def value(i: int, ident: str) -> bytes:
        return b"poison:" + b"x" * 400 if i == poison_at else ident.encode()

    records = ledger.records(n, value=value, key=lambda i, _: b"k%d" % (i % keys))
    await asyncio.to_thread(produce, bootstrap, topic, records)
    poison_key = b"k%d" % (poison_at % keys)

    def behaviour(msg: handler_pb2.Message, _n: int) -> Behaviour:
        if msg.value.startswith(b"poison:"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="unparseable")
        return Behaviour(delay_s=0.001)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"ordering": "key", "concurrency": 20, "max_in_flight": 2000},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]

        def acked_of(predicate: Callable[[Delivery], bool]) -> set[int]:
            return {d.offset for d in service.deliveries if d.outcome == "ACK" and predicate(d)}

        def gauges() -> tuple[float, float]:
            metrics = parse(proxy.metrics.exposition().decode())
            return (
                metrics.total("consumer_proxy_ordering_keys_backlogged", group=group),
                metrics.total("consumer_proxy_ordering_longest_key_backlog", group=group),
            )

        # When the poison pill's DLQ write fails again and again
        def refused() -> bool:
            return isinstance(runner.writer, DeadLetterWriter) and runner.writer.failures >= 3

        await async_wait_until(refused, timeout=60)
        # Then every other key's messages are delivered meanwhile, all of them
        others = n - n // keys
        await async_wait_until(
            lambda: len(acked_of(lambda d: d.key != poison_key)) == others, timeout=60
        )
        # while its own key waits: nothing of k5 after the pill was delivered
        held = n // keys - poison_at // keys - 1
        assert acked_of(lambda d: d.key == poison_key) == set(
            range(poison_at % keys, poison_at, keys)
        )
        assert not [d for d in service.deliveries if d.key == poison_key and d.offset > poison_at]
        # and the metrics say one key waits, with all of k5's later messages behind it
        await async_wait_until(lambda: gauges() == (1.0, float(held)), timeout=30)
        # When the DLQ accepts the record
        released_at = time.monotonic()
        await asyncio.to_thread(alter_topic, bootstrap, dlq_topic, {"max.message.bytes": "1048588"})
        # Then k5's later messages follow, in order, and the group finishes the topic
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await async_wait_until(lambda: gauges() == (0.0, 0.0), timeout=30)
        await proxy.shutdown()
        await task
        deliveries = service.deliveries
    later = sorted(
        (d.received_at, d.offset)
        for d in deliveries
        if d.key == poison_key and d.offset > poison_at
    )
    assert later and later[0][0] > released_at
    assert [o for _, o in later] == list(range(poison_at + keys, n, keys))
    dead = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    assert len(dead) == 1
    headers = dict(dead[0].headers() or [])
    assert headers[H_ORDERING] == b"key" and headers[H_OFFSET] == str(poison_at).encode()
    ledger.observe(deliveries)
    ledger.observe_dlq(dead)
    writer = runner.writer
    ledger.note(
        f"{writer.failures if isinstance(writer, DeadLetterWriter) else 0} failed DLQ writes"
    )
    ledger.check(max_duplicates=0, bound="no fault: none")


# --------------------------------------------------------------------------- partition mode


def test_partition_mode_delivers_one_message_per_partition_at_a_time_in_offset_order(
    kafka: Broker,
) -> None:
    asyncio.run(_partition_mode(kafka.bootstrap))


async def _partition_mode(bootstrap: str) -> None:
    # Given 400 messages on 2 partitions, random latency and 5% retries, concurrency 20
    topic, group = unique_name("partorder"), unique_name("partorder")
    n, partitions = 400, 2
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("partition order: 400 messages, 2 partitions, 5% retries")
    records = ledger.records(n, partitions=partitions, key=_key)
    await asyncio.to_thread(produce, bootstrap, topic, records)
    async with TestService(_jittery(0.05, 0.002)) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"ordering": "partition", "concurrency": 20},
        )
        proxy, task = start_proxy(config)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
        # Then the service never had more calls at once than partitions
        assert service.peak_in_flight <= partitions
        deliveries = service.deliveries
    # and each partition's messages came one after the other in offset order
    assert _assert_key_order(deliveries, _by_partition) >= n - partitions
    ledger.observe(deliveries)
    ledger.check(max_duplicates=0, bound="no fault: none")
