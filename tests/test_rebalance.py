"""Rebalances and worker processes: partitions move, acked messages are not redelivered."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from consumer_proxy.config import ProxyConfig
from consumer_proxy.proxy import Proxy
from tests.support.kafka import Broker, create_topic, produce, unique_name
from tests.support.proxy import Members, caught_up, caught_up_now, start_proxy
from tests.support.proxy import make_config as _make_config
from tests.support.service import Behaviour, ThreadedService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka


def make_config(*args: Any, **kwargs: Any) -> ProxyConfig:
    kwargs.setdefault("delivery", {"concurrency": 20})
    return _make_config(*args, **kwargs)


async def test_a_member_joining_and_leaving_moves_partitions_without_redelivering_acks(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given 4 partitions of 2000 messages and a handler taking 2 ms
    topic, group = unique_name("rebal"), unique_name("rebal")
    create_topic(bootstrap, topic, partitions=4)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(2000)])
    with ThreadedService(lambda m, n: Behaviour(delay_s=0.002)) as service:
        config = make_config(bootstrap, group, [topic], [service.address])
        first, first_task = start_proxy(config)

        def acked() -> int:
            return sum(1 for d in service.deliveries if d.outcome == "ACK")

        await async_wait_until(lambda: acked() >= 300, timeout=60)
        # When a second member joins, then the first one leaves
        second, second_task = start_proxy(config)
        await async_wait_until(lambda: second.runners[0].assignment(), timeout=60)
        await async_wait_until(lambda: acked() >= 1200, timeout=60)
        assert first.runners[0].assignment(), "the first member kept some partitions"
        await first.shutdown()
        await first_task
        # Then the second member finishes the topic
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await second.shutdown()
        await second_task
        counts = service.counts
    # and only messages in flight at a hand-over were delivered twice
    assert len(counts) == 2000
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nrebalance ledger: 2000 messages, {duplicates} duplicate deliveries")
    assert duplicates <= 2 * 20  # at most the in-flight calls at the two hand-overs


def test_workers_share_the_partitions_of_a_group(kafka: Broker, tmp_path: Path) -> None:
    # Given 6 partitions and the CLI running two worker processes
    bootstrap = kafka.bootstrap
    topic, group = unique_name("workers"), unique_name("workers")
    create_topic(bootstrap, topic, partitions=6)
    assigned = re.compile(r"\[(\d+)\] consumer_proxy\.\S+: group \S+: assigned")
    with ThreadedService(lambda m, n: Behaviour(delay_s=0.001)) as service:
        config = tmp_path / "proxy.yaml"
        config.write_text(
            f"kafka: {{bootstrap_servers: '{bootstrap}'}}\n"
            "metrics: {enabled: false}\n"
            "shutdown_grace_s: 5\n"
            f"groups:\n  - name: {group}\n    topics: [{topic}]\n"
            f"    service: {{endpoints: ['{service.address}']}}\n"
            "    delivery: {commit_interval_ms: 200}\n"
        )
        log = tmp_path / "proxy.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "consumer_proxy",
                    "run",
                    "--config",
                    str(config),
                    "--workers",
                    "2",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                # When both workers hold partitions and 3000 messages arrive
                wait_until(
                    lambda: len(set(assigned.findall(log.read_text()))) == 2,
                    timeout=90,
                    interval=0.2,
                    message="both workers to get partitions",
                )
                produce(bootstrap, topic, [f"m{i}" for i in range(3000)])
                wait_until(
                    lambda: caught_up_now(bootstrap, group, topic),
                    timeout=120,
                    interval=0.5,
                )
            finally:
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=60)
        # Then they shut down cleanly, and both are separate worker processes
        text = log.read_text()
        assert code == 0, text[-3000:]
        pids = set(assigned.findall(text))
        assert len(pids) == 2 and str(proc.pid) not in pids and str(os.getpid()) not in pids
        assert len(service.counts) == 3000


async def test_a_partition_paused_by_load_and_reassigned_to_the_same_member_drains(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given a member whose partitions are paused by load: windows of 5 messages held by calls
    # that hang until the gate opens, and a backlog far larger than the windows
    topic, group = unique_name("repause"), unique_name("repause")
    create_topic(bootstrap, topic, partitions=4)
    records = [{"value": f"m{i}", "partition": i % 4} for i in range(1500)]  # every one holds
    await asyncio.to_thread(produce, bootstrap, topic, records)
    gate = threading.Event()
    behaviour = lambda m, n: Behaviour(delay_s=0.002 if gate.is_set() else 30)  # noqa: E731
    with ThreadedService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            service={"timeout_ms": 1000},
            delivery={"concurrency": 20, "max_in_flight": 5, "revoke_grace_ms": 200},
            breaker={"failure_threshold": 10_000},
        )
        first, first_task = start_proxy(config)
        runner = first.runners[0]

        def own() -> list[tuple[str, int]]:
            return [tp for tp in runner.assignment() if tp[0] == topic]

        await async_wait_until(lambda: len(own()) == 4, timeout=60)
        parts = runner.partitions.parts
        await async_wait_until(
            lambda: all(parts[tp].paused for tp in own()), timeout=60, message="windows to fill"
        )
        # When a second member joins and takes two of the five partitions (so at least one
        # source partition, revoked from the first member while paused), then leaves, so that
        # they come back to the first member
        second, second_task = start_proxy(config)
        await async_wait_until(
            lambda: len(runner.assignment()) == 3 and len(own()) < 4,
            timeout=60,
            message="a source partition to move",
        )
        gate.set()
        await second.shutdown()
        await second_task
        await async_wait_until(lambda: len(own()) == 4, timeout=60, message="the hand-back")
        # Then every partition drains (librdkafka kept the pause: the proxy must resume it)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=120)
        await first.shutdown()
        await first_task
    assert len(service.counts) == 1500


def _produce_until(bootstrap: str, topic: str, stop: threading.Event, partitions: int) -> int:
    """Produce records round-robin over ``partitions``, about 1,000 a second (50 every 50 ms),
    until ``stop`` is set; returns how many were written (all acknowledged, acks=all)."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    sent = 0
    while not stop.is_set():
        for _ in range(50):
            producer.produce(topic, value=f"m{sent}", partition=sent % partitions)
            sent += 1
        producer.poll(0)
        stop.wait(0.05)  # the pace of the flow, not a synchronisation
    assert producer.flush(30) == 0, "records left undelivered"
    return sent


def _commits_ok(proxy: Proxy, group: str) -> float:
    value = proxy.metrics.registry.get_sample_value(
        "consumer_proxy_commits_total", {"group": group, "result": "ok"}
    )
    return value or 0.0


async def test_rebalances_with_commits_in_flight_neither_hang_nor_redeliver_acks(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given 4 partitions fed about 1,000 records a second, and members that commit every
    # 10 ms (a commit is nearly always on its way to the broker)
    topic, group = unique_name("inflight"), unique_name("inflight")
    create_topic(bootstrap, topic, partitions=4)
    stop = threading.Event()
    producing = asyncio.ensure_future(asyncio.to_thread(_produce_until, bootstrap, topic, stop, 4))
    try:
        with ThreadedService(lambda m, n: Behaviour(delay_s=0.001)) as service:
            config = make_config(
                bootstrap,
                group,
                [topic],
                [service.address],
                delivery={"concurrency": 20, "commit_interval_ms": 10},
            )

            def acked() -> int:
                return sum(1 for d in service.deliveries if d.outcome == "ACK")

            async def progress(more: int) -> None:
                target = acked() + more
                await async_wait_until(lambda: acked() >= target, timeout=60)

            async def leave(proxy: Proxy, task: asyncio.Task[None]) -> None:
                # A deadlocked consumer thread (a commit and a rebalance callback waiting for
                # each other) fails here instead of hanging the suite.
                async with asyncio.timeout(60):
                    await proxy.shutdown()
                    await task

            first, first_task = start_proxy(config)
            await progress(300)
            before = _commits_ok(first, group)
            # When a second member joins (the first revokes partitions with a commit in
            # flight), a third joins, and the second and then the first leave (the leavers
            # revoke everything, the others take it over), all while records flow
            second, second_task = start_proxy(config)
            await Members.owned(second, topic)
            await progress(300)
            third, third_task = start_proxy(config)
            await Members.owned(third, topic)
            await progress(300)
            await leave(second, second_task)
            await progress(300)
            assert _commits_ok(first, group) > before + 10, "the first member committed on"
            await leave(first, first_task)
            await progress(300)
            stop.set()
            async with asyncio.timeout(60):
                total = await producing
            # Then the last member finishes the topic, and shuts down in time
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=120)
            await leave(third, third_task)
            counts = service.counts
    finally:
        stop.set()
    # and nothing was lost; only messages in flight at the hand-overs came twice
    assert len(counts) == total
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nrebalances with commits in flight: {total} messages, {duplicates} duplicates")
    assert duplicates <= 4 * 20  # four hand-overs, at most the in-flight calls at each
