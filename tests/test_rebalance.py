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

from consumer_proxy.config import ProxyConfig
from tests.support.kafka import Broker, create_topic, produce, unique_name
from tests.support.proxy import caught_up, caught_up_now, start_proxy
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
