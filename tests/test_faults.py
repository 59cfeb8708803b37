"""Faults under load, each with a delivery ledger: nothing is lost, duplicates stay bounded.

Every scenario produces ledger-tagged messages, injects its fault while the proxy is working
through them, lets the proxy finish, and then checks with tests/support/ledger.py that:

- every message was acked (or dead-lettered where the scenario makes poison pills): missing 0;
- duplicates stay within what was in flight at the faults. The bound each test states is the
  proxy's own definition of "in flight": a partition's tracker window (``max_in_flight``
  offsets fetched and not committed) is all a crash can make it deliver again, so a fault that
  loses the proxy's memory costs at most ``partitions x max_in_flight``; a fault it survives
  (a service or DLQ outage) costs nothing;
- the group's committed offsets reach the end of every partition.

The ledgers are printed in pytest's terminal summary (see tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from pathlib import Path

import grpc
import pytest
from confluent_kafka import Consumer, KafkaException

from consumer_proxy.dlq import DeadLetterWriter
from consumer_proxy.fetcher import Fetcher
from consumer_proxy.kafka_log import KafkaLogGate
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    alter_topic,
    committed,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    start_broker,
    stop_broker,
    unique_name,
)
from tests.support.ledger import Ledger
from tests.support.proxy import (
    FAST_CONSUMER,
    ProxyProcess,
    caught_up,
    caught_up_now,
    make_config,
    start_proxy,
    write_config,
)
from tests.support.scrape import parse
from tests.support.service import Behaviour, TestService, ThreadedService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka


def _acks(service: ThreadedService | TestService) -> int:
    return sum(1 for d in service.deliveries if d.outcome == "ACK")


def _distinct_acked(ledger: Ledger, *services: ThreadedService | TestService) -> int:
    seen = set()
    for service in services:
        for d in service.deliveries:
            if d.outcome == "ACK":
                seen.add(Ledger.id_of(d.headers))
    return len(seen & set(ledger.ids))


def _assert_committed_to_end(bootstrap: str, group: str, topic: str) -> None:
    ends = end_offsets(bootstrap, topic)
    committed = committed_offsets(bootstrap, group, topic)
    assert {p: c[0] for p, c in committed.items()} == ends


# --------------------------------------------------------------------------- kill -9 the proxy

KILLS = 5


def test_kill_9_the_proxy_repeatedly_loses_nothing(kafka: Broker, tmp_path: Path) -> None:
    # Given 4 partitions of 3000 ledger messages and a service taking 5 ms per message
    bootstrap = kafka.bootstrap
    topic, group = unique_name("kill9"), unique_name("kill9")
    partitions, window, n = 4, 100, 3000
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger(f"kill -9 the proxy x{KILLS}")
    produce(bootstrap, topic, ledger.records(n, partitions=partitions))
    with ThreadedService(lambda m, k: Behaviour(delay_s=0.005)) as service:
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 20, "max_in_flight": window},
            # A killed member holds its partitions until its session expires: keep it short.
            client={"session.timeout.ms": 3000, "heartbeat.interval.ms": 300},
        )
        log = tmp_path / "proxy.log"
        # When the proxy process is killed with SIGKILL five times while it delivers
        for _ in range(KILLS):
            target = _acks(service) + 300
            proxy = ProxyProcess(config, log).start()
            try:

                def delivered_or_died(t: int = target, p: ProxyProcess = proxy) -> bool:
                    return _acks(service) >= t or not p.alive()

                wait_until(delivered_or_died, timeout=90)
                assert proxy.alive(), proxy.output()[-3000:]
            finally:
                proxy.kill()
            # (mid-run: the topic is not done yet)
            assert _distinct_acked(ledger, service) < n
        # and started once more to finish
        proxy = ProxyProcess(config, log).start()
        try:
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=120, interval=0.3)
        finally:
            code = proxy.stop()
        assert code == 0, proxy.output()[-3000:]
        ledger.observe(service.deliveries)
    # Then nothing is lost, and at most the tracker windows at the kills came again
    ledger.note(f"{KILLS} SIGKILLs")
    ledger.check(
        max_duplicates=KILLS * partitions * window,
        bound=f"{KILLS} kills x {partitions} partitions x max_in_flight {window}",
    )
    _assert_committed_to_end(bootstrap, group, topic)


def test_a_kill_9_after_a_partition_went_idle_redelivers_nothing(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given 4 partitions of 400 ledger messages, a periodic commit far away (60 s), and a
    # proxy that acks them all and then has nothing more to do
    bootstrap = kafka.bootstrap
    topic, group = unique_name("idle"), unique_name("idle")
    create_topic(bootstrap, topic, partitions=4)
    ledger = Ledger("kill -9 after the partitions went idle")
    produce(bootstrap, topic, ledger.records(400, partitions=4))
    with ThreadedService(lambda m, k: Behaviour(delay_s=0.001)) as service:
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 40, "commit_interval_ms": 60_000},
            client={"session.timeout.ms": 3000, "heartbeat.interval.ms": 300},
        )
        log = tmp_path / "proxy.log"
        proxy = ProxyProcess(config, log).start()
        try:
            wait_until(lambda: _distinct_acked(ledger, service) == 400, timeout=90)
            # When the partitions go idle, their progress is committed soon (not in 60 s)
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=20, interval=0.2)
        finally:
            proxy.kill()
        # and the proxy, killed with SIGKILL, is started again and takes one more message
        produce(bootstrap, topic, ledger.records(1, partitions=4))
        proxy = ProxyProcess(config, log).start()
        try:
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=90, interval=0.3)
        finally:
            code = proxy.stop()
        assert code == 0, proxy.output()[-3000:]
        ledger.observe(service.deliveries)
    # Then nothing acked before the kill was delivered again
    ledger.check(max_duplicates=0, bound="idle partitions are committed within 0.1 s")


# --------------------------------------------------------------------------- service outages


async def test_service_instances_dying_and_a_full_outage_lose_nothing_and_dead_letter_nothing(
    kafka: Broker,
) -> None:
    await _service_outages(kafka.bootstrap)


async def _service_outages(bootstrap: str) -> None:
    # Given 2400 ledger messages and two instances taking 10 ms per message
    topic, group = unique_name("svcdown"), unique_name("svcdown")
    partitions, n = 4, 2400
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("service instance crash + full outage")
    await asyncio.to_thread(produce, bootstrap, topic, ledger.records(n, partitions=partitions))

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        return Behaviour(delay_s=0.01)

    async with TestService(behaviour) as a, TestService(behaviour) as b:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [a.address, b.address],
            delivery={"concurrency": 20, "max_in_flight": 200},
            breaker={"failure_threshold": 5, "reset_timeout_s": 0.5},
        )
        proxy, task = start_proxy(config)

        def acked() -> int:
            return _acks(a) + _acks(b)

        def opened() -> float:
            text = proxy.metrics.exposition().decode()
            return parse(text).total("consumer_proxy_circuit_transitions_total", state="open")

        # When one instance crashes mid-run and comes back
        await async_wait_until(lambda: acked() >= 400, timeout=60)
        await a.crash()
        await async_wait_until(lambda: _acks(b) >= 800, timeout=60)
        a_before = _acks(a)
        await a.restart()
        await async_wait_until(lambda: _acks(a) >= a_before + 100, timeout=60)  # back in use
        # and then every instance is down for a while: the breaker opens and probes, in vain
        await async_wait_until(lambda: acked() >= 1400, timeout=60)
        await a.crash()
        await b.crash()
        await async_wait_until(lambda: proxy.runners[0].breaker.is_open, timeout=30)
        opened_before = opened()
        await async_wait_until(lambda: opened() >= opened_before + 3, timeout=30)
        assert _distinct_acked(ledger, a, b) < n  # the outage is mid-run
        await a.restart()
        await b.restart()
        # Then delivery resumes and the group finishes the topic
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=120)
        await proxy.shutdown()
        await task
    # and no message went to the DLQ for the outage
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert dead == []
    ledger.observe(a.deliveries)
    ledger.observe(b.deliveries)
    ledger.note(f"3 instance crashes, breaker opened {int(opened())}x, DLQ records {len(dead)}")
    # The proxy keeps its state throughout; only a call whose ACK was lost in the crash (the
    # service answered, the connection died first) can be delivered again.
    ledger.check(max_duplicates=3 * 20, bound="3 crashes x concurrency 20")
    assert ledger.summary().dead_lettered == 0


# --------------------------------------------------------------------------- broker restart


async def test_a_broker_restart_during_a_run_loses_nothing(tmp_path: Path) -> None:
    # A broker of its own (same log dir across the restart), not the session broker.
    directory = tmp_path / "kafka"
    try:
        broker = await asyncio.to_thread(start_broker, directory, watch_pid=os.getpid())
        await _broker_restart(broker.bootstrap, directory)
        # The proxy's clients are freed with it (reference cycles): before the broker goes,
        # or they would log connection failures until the session ends.
        gc.collect()
    finally:
        await asyncio.to_thread(stop_broker, directory)


async def _broker_restart(bootstrap: str, directory: Path) -> None:
    # Given 2000 ledger messages on 4 partitions and a service taking 5 ms per message
    topic, group = unique_name("brokerrestart"), unique_name("brokerrestart")
    partitions, window = 4, 200
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("Kafka broker restart")
    await asyncio.to_thread(produce, bootstrap, topic, ledger.records(2000, partitions=partitions))
    # The service answers the first 500 deliveries, then holds every call until the broker
    # is down: the stop is mid-run by construction, however fast the run.
    broker_down = asyncio.Event()
    seen = 0

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        nonlocal seen
        seen += 1
        return Behaviour(delay_s=0.005, hold=None if seen <= 500 else broker_down)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 10, "max_in_flight": window},
            # Held calls must outlast the broker's stop without a deadline.
            service={"timeout_ms": 120_000},
        )
        # The group session outlives the outage by construction: this is the restart the
        # proxy rides out with its memory (a session that expires is the next test's case).
        proxy, task = start_proxy(
            config, consumer_overrides={"session.timeout.ms": 60_000, "heartbeat.interval.ms": 1000}
        )
        # When the broker stops mid-run and starts again on the same port and log dir
        await async_wait_until(lambda: seen > 500, timeout=60)
        await asyncio.to_thread(stop_broker, directory)
        broker_down.set()
        assert _distinct_acked(ledger, service) < 2000
        assert not task.done()
        restarted = await asyncio.to_thread(start_broker, directory, None, watch_pid=os.getpid())
        assert restarted.bootstrap == bootstrap
        # and more messages arrive after the restart
        await asyncio.to_thread(
            produce, bootstrap, topic, ledger.records(1000, partitions=partitions)
        )
        # Then the proxy rides it out and finishes the topic
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=180)
        assert not task.done()
        await proxy.shutdown()
        await task
    ledger.observe(service.deliveries)
    ledger.note("1 broker stop/start")
    ledger.check(
        max_duplicates=partitions * window,
        bound=f"1 restart x {partitions} partitions x max_in_flight {window}",
    )
    await asyncio.to_thread(_assert_committed_to_end, bootstrap, group, topic)
    # and each commit carries the leader epoch of the record before it (KIP-320: a next owner's
    # client then finds a log cut below the commit and seeks back instead of skipping), the
    # epoch the restart moved to, not the one the run began in
    records = await asyncio.to_thread(consume_all, bootstrap, topic)
    first = {m.partition(): m.leader_epoch() for m in reversed(records)}
    last = {m.partition(): m.leader_epoch() for m in records}
    commits = await asyncio.to_thread(committed, bootstrap, group, topic)
    assert {tp.partition: tp.leader_epoch for tp in commits} == last
    assert all(last[p] is not None and last[p] != first[p] for p in last), (first, last)


async def test_a_partition_paused_when_it_was_lost_drains_after_it_is_assigned_again(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "kafka"
    try:
        broker = await asyncio.to_thread(start_broker, directory, watch_pid=os.getpid())
        await _paused_and_lost(broker.bootstrap, directory)
        gc.collect()  # free the proxy's clients before the broker goes (see above)
    finally:
        await asyncio.to_thread(stop_broker, directory)


async def _paused_and_lost(bootstrap: str, directory: Path) -> None:
    # Given partitions whose windows are full (the service holds every call after the 40th)
    # and whose backlogs are at their bound (ten windows), so the proxy has paused them
    topic, group = unique_name("pausedlost"), unique_name("pausedlost")
    partitions, n = 2, 600
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("partitions lost while paused")
    await asyncio.to_thread(produce, bootstrap, topic, ledger.records(n, partitions=partitions))
    released = asyncio.Event()
    seen = 0

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        nonlocal seen
        seen += 1
        return Behaviour(hold=None if seen <= 40 else released)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            # No periodic commit: a synchronous commit to a stopped broker would hold the
            # consumer thread, and the session expiry would only be seen after the restart.
            delivery={"concurrency": 4, "max_in_flight": 20, "commit_interval_ms": 600_000},
            service={"timeout_ms": 120_000},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]

        def paused() -> float:
            text = proxy.metrics.exposition().decode()
            return parse(text).total("consumer_proxy_partitions_paused", group=group)

        await async_wait_until(lambda: paused() == partitions, timeout=60)
        # When the broker is down long enough for the group session to expire (the partitions
        # are lost, librdkafka keeps their pause), then comes back
        await asyncio.to_thread(stop_broker, directory)
        await async_wait_until(lambda: runner.assignment() == [], timeout=60)
        released.set()
        await asyncio.to_thread(start_broker, directory, None, watch_pid=os.getpid())
        # Then the partitions, assigned again, are resumed and every message is delivered
        await async_wait_until(lambda: _distinct_acked(ledger, service) == n, timeout=120)
        await proxy.shutdown()
        await task
    await asyncio.to_thread(_assert_committed_to_end, bootstrap, group, topic)
    ledger.observe(service.deliveries)
    ledger.note("partitions lost while paused, then assigned again")
    # Nothing was committed before the loss: the 40 acked and the 4 held calls come again.
    ledger.check(max_duplicates=40 + 4, bound="40 acks + concurrency 4, none committed")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.INFO) -> list[str]:
        return [r.getMessage() for r in list(self.records) if r.levelno >= level]


async def test_a_broker_outage_is_logged_as_state_changes_not_a_flood(tmp_path: Path) -> None:
    directory = tmp_path / "kafka"
    try:
        broker = await asyncio.to_thread(start_broker, directory, watch_pid=os.getpid())
        await _outage_logs(broker.bootstrap, directory)
        gc.collect()  # free the proxy's clients before the broker goes (see above)
    finally:
        await asyncio.to_thread(stop_broker, directory)


async def _outage_logs(bootstrap: str, directory: Path) -> None:
    # Given a running proxy, its consumer and its DLQ producer connected to the broker
    topic, group = unique_name("outagelogs"), unique_name("outagelogs")
    create_topic(bootstrap, topic, partitions=2)
    lines = _Lines()
    logger = logging.getLogger("consumer_proxy")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        async with TestService() as service:
            config = make_config(bootstrap, group, [topic], [service.address])
            proxy, task = start_proxy(config)
            runner = proxy.runners[0]
            await async_wait_until(lambda: proxy.ready()[0], timeout=60)
            assert isinstance(runner.fetcher, Fetcher)
            assert isinstance(runner.writer, DeadLetterWriter)
            gates = [runner.fetcher.log_gate, runner.writer.log_gate]
            # When the broker is down long enough for repeated connection errors per client
            # (how many librdkafka reports, and how many it suppresses itself, varies)
            lines.records.clear()
            await asyncio.to_thread(stop_broker, directory)
            await async_wait_until(
                lambda: all(g.suppressed_total >= 5 for g in gates),
                timeout=120,
                message="each client to report 5 more connection errors",
            )
            during = lines.messages(logging.WARNING)
            suppressed = sum(g.suppressed_total for g in gates)
            # Then each client said once that Kafka is unreachable, and nothing flooded
            for gate in gates:
                said = [m for m in during if m.startswith(f"{gate.client}: Kafka unreachable")]
                assert len(said) == 1, during
            assert len(during) <= 6, during
            # When the broker is back
            await asyncio.to_thread(start_broker, directory, None, watch_pid=os.getpid())
            # Then each client says once that Kafka is reachable again, and after how long
            for gate in gates:

                def said_reachable(g: KafkaLogGate = gate) -> bool:
                    return any(
                        m.startswith(f"{g.client}: Kafka reachable again after ")
                        for m in lines.messages()
                    )

                await async_wait_until(
                    said_reachable,
                    timeout=60,
                    message=f"{gate.client} to say Kafka is reachable again",
                )
            await asyncio.to_thread(produce, bootstrap, topic, ["after"])
            await async_wait_until(lambda: len(service.counts) == 1, timeout=60)
            await proxy.shutdown()
            await task
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    again = [m for m in lines.messages() if "reachable again" in m]
    assert len(again) == 2, again
    print(f"warning+ lines during the outage: {len(during)}, suppressed: {suppressed}")


# --------------------------------------------------------------------------- DLQ outage


async def test_an_unwritable_dlq_under_load_holds_commits_and_loses_nothing(
    kafka: Broker,
) -> None:
    await _dlq_outage(kafka.bootstrap)


async def _dlq_outage(bootstrap: str) -> None:
    # Given 2000 ledger messages on 4 partitions, every 25th a poison pill too large for the
    # DLQ topic (its max.message.bytes is tiny for now)
    topic, group = unique_name("dlqload"), unique_name("dlqload")
    partitions, n, window = 4, 2000, 40  # 500 a partition: a window and a full backlog
    create_topic(bootstrap, topic, partitions=partitions)
    dlq_topic = create_topic(
        bootstrap, f"{group}.dlq", partitions=1, config={"max.message.bytes": "200"}
    )
    ledger = Ledger("DLQ unwritable under load")
    poison_every = 25

    def value(i: int, ident: str) -> bytes:
        return (b"poison:" + b"x" * 400) if i % poison_every == 7 else ident.encode()

    records = ledger.records(n, partitions=partitions, value=value)
    poison = {Ledger.id_of(r["headers"]) for i, r in enumerate(records) if i % poison_every == 7}
    await asyncio.to_thread(produce, bootstrap, topic, records)

    def behaviour(msg: handler_pb2.Message, k: int) -> Behaviour:
        if msg.value.startswith(b"poison:"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="unparseable")
        return Behaviour(delay_s=0.002)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 20, "max_in_flight": window},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        # When the DLQ writes keep failing while the load goes on

        def dlq_failing() -> bool:
            return isinstance(runner.writer, DeadLetterWriter) and runner.writer.failures >= 10

        await async_wait_until(dlq_failing, timeout=60)

        def paused() -> float:
            text = proxy.metrics.exposition().decode()
            return parse(text).total("consumer_proxy_partitions_paused", group=group)

        # (each partition fills its window behind its first pill, then its backlog, and
        # stops taking messages)
        await async_wait_until(lambda: paused() == partitions, timeout=60)
        # Then no commit passes a pill that is not confirmed in the DLQ (the first pill of
        # each partition sits at its offset 1 or so: index 7 is partition 3's offset 1)
        committed = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
        firsts: dict[int, int] = {}
        for i in range(n):
            if i % poison_every == 7:
                firsts.setdefault(i % partitions, i // partitions)
        for partition, (offset, _meta) in committed.items():
            assert offset <= firsts[partition]
        assert _distinct_acked(ledger, service) < n - len(poison)
        # When the DLQ accepts records again
        await asyncio.to_thread(alter_topic, bootstrap, dlq_topic, {"max.message.bytes": "1048588"})
        # Then every pill is dead-lettered and the commit reaches the end
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=120)
        assert isinstance(runner.writer, DeadLetterWriter)
        failures = runner.writer.failures
        await proxy.shutdown()
        await task
    dead = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    ledger.observe(service.deliveries)
    ledger.observe_dlq(dead)
    assert ledger.dead_lettered() == poison
    ledger.note(f"{failures} failed DLQ writes, {len(dead)} DLQ records")
    ledger.check(max_duplicates=0, bound="the proxy survives a DLQ outage: none")
    await asyncio.to_thread(_assert_committed_to_end, bootstrap, group, topic)


# --------------------------------------------------------------------------- rebalance storm

STORM_EVENTS = 8


def test_a_rebalance_storm_of_worker_processes_loses_nothing(kafka: Broker, tmp_path: Path) -> None:
    # Given 6 partitions of 4000 ledger messages
    bootstrap = kafka.bootstrap
    topic, group = unique_name("storm"), unique_name("storm")
    partitions, n, concurrency, window = 6, 4000, 8, 200
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger(f"rebalance storm ({STORM_EVENTS} joins/leaves of worker processes)")
    produce(bootstrap, topic, ledger.records(n, partitions=partitions))
    with ThreadedService(lambda m, k: Behaviour(delay_s=0.005)) as service:
        # Storm members are throttled so that the topic outlasts the storm; a last, unthrottled
        # member finishes it.
        delivery = {"concurrency": concurrency, "max_in_flight": window}
        storm_config = write_config(
            tmp_path / "storm.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={**delivery, "rate_limit_per_s": 25},
        )
        final_config = write_config(
            tmp_path / "final.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery=delivery,
        )
        members: list[ProxyProcess] = []
        logs = iter(tmp_path / f"worker-{i}.log" for i in range(100))
        max_members = 0

        def join(config: Path) -> ProxyProcess:
            member = ProxyProcess(config, next(logs)).start()
            members.append(member)
            # Joined once it logs an assignment (cooperative: the others keep theirs meanwhile).
            wait_until(
                lambda: ": assigned " in member.output() or not member.alive(),
                timeout=90,
                message="the new member to be assigned partitions",
            )
            assert member.alive(), member.output()[-3000:]
            return member

        def leave() -> None:
            member = members.pop(0)
            code = member.stop()
            assert code == 0, member.output()[-3000:]

        try:
            join(storm_config)
            join(storm_config)
            # When members join and leave, one after the other, while the topic is consumed
            for event in range(STORM_EVENTS):
                if event % 2 == 0:
                    join(storm_config)
                else:
                    leave()
                max_members = max(max_members, len(members))
                assert _distinct_acked(ledger, service) < n, "the storm must happen mid-run"
            join(final_config)
            while len(members) > 1:
                leave()
            # Then the last member finishes the topic
            wait_until(lambda: caught_up_now(bootstrap, group, topic), timeout=120, interval=0.3)
        finally:
            for member in members:
                member.stop()
        ledger.observe(service.deliveries)
    events = STORM_EVENTS + 2 + (max_members - 1)  # the storm plus the final hand-over
    ledger.note(f"{events} membership changes, up to {max_members} members")
    ledger.check(
        max_duplicates=events * max_members * concurrency,
        bound=f"{events} changes x {max_members} members x concurrency {concurrency}",
    )
    _assert_committed_to_end(bootstrap, group, topic)


async def test_a_fenced_static_member_fails_its_group_with_the_fatal_error(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a proxy whose group runs as a static member (group.instance.id in kafka.client),
    # caught up on 10 messages
    bootstrap = kafka.bootstrap
    topic, group = unique_name("fenced"), unique_name("fenced")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(10)])
    member = {**FAST_CONSUMER, "group.instance.id": "member-1"}
    async with TestService() as service:
        proxy, task = start_proxy(
            make_config(bootstrap, group, [topic], [service.address]), consumer_overrides=member
        )
        try:
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
            # When another consumer joins the group as the same static member, fencing it
            # (librdkafka raises a fatal error: the consumer can do nothing more)
            intruder = Consumer(
                {"bootstrap.servers": bootstrap, "group.id": group, **member,
                 "partition.assignment.strategy": "cooperative-sticky"}
            )  # fmt: skip
            intruder.subscribe([topic])
            stop = asyncio.Event()

            def poll() -> None:
                while not stop.is_set():
                    intruder.poll(0.2)

            polling = asyncio.create_task(asyncio.to_thread(poll))
            try:
                # Then the proxy does not run on with a dead consumer: its run ends with the
                # fatal error (the process exits 1, and is restarted), logged once
                with pytest.raises(KafkaException, match=r"(?i)fenced|fatal"):
                    await asyncio.wait_for(asyncio.shield(task), timeout=45)
            finally:
                stop.set()
                await polling
                await asyncio.to_thread(intruder.close)
        finally:
            await proxy.shutdown()
            await asyncio.gather(task, return_exceptions=True)
    assert sorted(d.offset for d in service.deliveries) == list(range(10))


async def test_a_dead_letter_decided_during_the_shutdown_drain_is_written_and_committed(
    kafka: Broker,
) -> None:
    # Given a poison pill whose call is open (the service answers INVALID_ARGUMENT after 2 s)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("drainpill"), unique_name("drainpill")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, ["poison"])
    poison = Behaviour(delay_s=2.0, status=grpc.StatusCode.INVALID_ARGUMENT, details="bad")
    with ThreadedService(lambda m, n: poison) as service:
        config = make_config(bootstrap, group, [topic], [service.address], shutdown_grace_s=20)
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: len(service.deliveries) == 1, timeout=60)
        finally:
            # When the proxy is stopped while that call is open
            await proxy.shutdown()
            await task
    # Then the dead letter the answer decided was written within the grace, not cancelled,
    # and the commit went past it: the next start does not push the pill again
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert [m.value() for m in dead] == [b"poison"]
    assert committed_offsets(bootstrap, group, topic)[0][0] == 1
    assert len(service.deliveries) == 1
