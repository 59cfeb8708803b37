"""Long-running handlers (delivery.long_running): heartbeats instead of a fixed deadline,
against the real broker and real gRPC services.

Scaled down from the issue's figures where the promise is the same: handlers of LONG_S (12 s)
with a 1.5 s heartbeat timeout stand for 60 s handlers with 6 s (eight timeouts long, and
well past the unary service.timeout_ms of 5 s, which would fail them); the service process is
killed 3 s into such a handler instead of 10 s into a 60 s one. Service processes are the
SDK (``consumer_proxy.handler``) in a child process, so kill -9 is a real kill.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException

from consumer_proxy.config import ProxyConfig
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    headers_of,
    produce,
    unique_name,
    value_of,
)
from tests.support.proxy import (
    Members,
    ProxyProcess,
    caught_up,
    config_dict,
    revoke_took,
    start_proxy,
    write_config,
)
from tests.support.scrape import parse as parse_metrics
from tests.support.service import Behaviour, ThreadedService, raw_stream_service
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

LONG_S = 12.0
HEARTBEAT_TIMEOUT_MS = 1500
LONG_RUNNING = {"heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "max_processing_ms": 60_000}


def _config(
    bootstrap: str,
    group: str,
    topic: str,
    endpoints: list[str],
    delivery: dict[str, Any] | None = None,
    **extra: Any,
) -> ProxyConfig:
    return ProxyConfig(
        **config_dict(
            bootstrap,
            group,
            [topic],
            endpoints,
            delivery={"long_running": LONG_RUNNING, "concurrency": 100, **(delivery or {})},
            service={"timeout_ms": 30_000},  # a unary group's calls outlive LONG_S too
            **extra,
        )
    )


def _dlq(bootstrap: str, group: str) -> list[Any]:
    """The group's DLQ records (none while its topic is empty)."""
    topic = f"{group}.dlq"
    try:
        if not any(end_offsets(bootstrap, topic).values()):
            return []
    except KafkaException:  # not created yet
        return []
    return consume_all(bootstrap, topic, timeout=30)


async def test_long_handlers_stay_open_on_heartbeats_while_short_ones_flow_and_commit(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given one partition: 10 short messages, 50 long ones (LONG_S each), 200 short ones
    topic, group = unique_name("long"), unique_name("long")
    create_topic(bootstrap, topic, partitions=1)
    values = ["s"] * 10 + ["long"] * 50 + ["s"] * 200
    await asyncio.to_thread(produce, bootstrap, topic, values)

    def behaviour(msg: Any, n: int) -> Behaviour:
        return Behaviour(delay_s=LONG_S if msg.value == b"long" else 0.005)

    with ThreadedService(behaviour) as service:
        proxy, task = start_proxy(_config(bootstrap, group, topic, [service.address]))
        try:
            began = time.monotonic()

            def shorts_acked() -> int:
                return sum(1 for d in service.deliveries if d.value == b"s" and d.outcome == "ACK")

            # When the 50 long calls are open at once
            await async_wait_until(lambda: shorts_acked() == 210, timeout=LONG_S - 2)
            longs = [d for d in service.deliveries if d.value == b"long"]
            # Then the short messages above them were all handled meanwhile, and the commit
            # went as far as it may: to the first long message
            assert len(longs) == 50 and all(d.outcome == "PENDING" for d in longs)
            assert service.peak_in_flight >= 50

            async def committed() -> int | None:
                found = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
                return found.get(0, (None, None))[0]

            await async_wait_until(lambda: _eq(committed(), 10), timeout=LONG_S - 2)
            assert time.monotonic() - began < LONG_S, "the long calls ended before the check"
            scrape = parse_metrics(proxy.metrics.exposition().decode())
            assert scrape.value("consumer_proxy_long_calls_open", group=group) == 50
            oldest = scrape.value("consumer_proxy_oldest_open_call_seconds", group=group)
            assert oldest is not None and 0 < oldest < LONG_S
            # When they end, the commit passes them
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=LONG_S + 30)
        finally:
            await proxy.shutdown()
            await task
        # Each message was delivered once, the long ones acked after LONG_S
        assert sorted(service.counts.values()) == [1] * 260
        longs = [d for d in service.deliveries if d.value == b"long"]
        assert all(d.outcome == "ACK" for d in longs)
        assert all((d.finished_at or 0) - d.received_at >= LONG_S - 0.1 for d in longs)
        scrape = parse_metrics(proxy.metrics.exposition().decode())
        # heartbeats every 0.5 s over LONG_S, for each of the 50 calls
        assert scrape.total("consumer_proxy_heartbeat_gap_seconds_count", group=group) > 50 * 15
        assert scrape.total("consumer_proxy_calls_cancelled_total", group=group) == 0


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_a_hung_service_dead_letters_nothing_and_the_cap_is_a_counted_failure(
    kafka: Broker,
) -> None:
    # Two groups at once (independent long waits run concurrently):
    # - "hung": every instance accepts calls and then says nothing, forever;
    # - "capped": the service heartbeats but never finishes: max_processing_ms ends it.
    bootstrap = kafka.bootstrap
    hung_topic, hung_group = unique_name("hung"), unique_name("hung")
    cap_topic, cap_group = unique_name("cap"), unique_name("cap")
    create_topic(bootstrap, hung_topic, partitions=1)
    create_topic(bootstrap, cap_topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, hung_topic, ["h0", "h1", "h2"])
    await asyncio.to_thread(produce, bootstrap, cap_topic, ["c0"])
    silent = Behaviour(delay_s=3600, silent=True)
    busy = Behaviour(delay_s=3600)
    with (
        ThreadedService(lambda m, n: silent) as hung_a,
        ThreadedService(lambda m, n: silent) as hung_b,
        ThreadedService(lambda m, n: busy) as capped,
    ):
        fast = {"heartbeat_timeout_ms": 400, "max_processing_ms": 2000}
        hung_proxy, hung_task = start_proxy(
            _config(
                bootstrap,
                hung_group,
                hung_topic,
                [hung_a.address, hung_b.address],
                {"long_running": fast, "max_attempts": 2, "revoke_grace_ms": 500},
            )
        )
        cap_proxy, cap_task = start_proxy(
            _config(
                bootstrap,
                cap_group,
                cap_topic,
                [capped.address],
                {"long_running": fast, "max_attempts": 2, "revoke_grace_ms": 500},
            )
        )
        try:

            def hung_tries() -> int:
                return len(hung_a.deliveries) + len(hung_b.deliveries)

            # When the hung service has been tried well past max_attempts per message
            # and the capped message has used its two attempts
            await asyncio.gather(
                async_wait_until(lambda: hung_tries() >= 3 * 4, timeout=60),
                async_wait_until(lambda: bool(_dlq(bootstrap, cap_group)), timeout=60),
            )
        finally:
            for proxy in (hung_proxy, cap_proxy):
                await proxy.shutdown()
            await asyncio.gather(hung_task, cap_task)
        # Then the hung service dead-lettered nothing (silences are not charged in an outage)
        assert _dlq(bootstrap, hung_group) == []
        hung = parse_metrics(hung_proxy.metrics.exposition().decode())
        silences = hung.value(
            "consumer_proxy_calls_cancelled_total", group=hung_group, cause="heartbeat"
        )
        assert silences is not None and silences >= 4
        # and the capped message was cancelled twice (the service saw it) and dead-lettered
        (record,) = _dlq(bootstrap, cap_group)
        headers = headers_of(record)
        assert value_of(record) == b"c0"
        assert headers["cp-status"] == b"MAX_PROCESSING_EXCEEDED"
        assert headers["cp-attempt"] == b"2"
        # (each call the service saw cancelled; two by the cap, both counted; on a loaded
        # machine a heartbeat may also come late: a silence, never an attempt here, where the
        # service answers no one else, so the message goes once more)
        assert {d.outcome for d in capped.deliveries} == {"CANCELLED"}
        cap = parse_metrics(cap_proxy.metrics.exposition().decode())
        capped_calls = cap.value(
            "consumer_proxy_calls_cancelled_total", group=cap_group, cause="max_processing"
        )
        assert capped_calls == 2
        late = cap.value("consumer_proxy_calls_cancelled_total", group=cap_group, cause="heartbeat")
        assert len(capped.deliveries) == 2 + (late or 0)


async def test_a_long_call_answering_events_that_do_not_decode_is_retried_and_the_proxy_runs_on(
    kafka: Broker,
) -> None:
    # Given 20 messages, and a service whose long call answers each one's first two attempts
    # with an event that does not decode (a note cut in the middle of a character), then acks
    bootstrap = kafka.bootstrap
    topic, group = unique_name("garbled"), unique_name("garbled")
    create_topic(bootstrap, topic, partitions=2)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(20)])
    attempts: dict[tuple[int, int], int] = {}
    ack = handler_pb2.HandleMessageStreamEvent(result=handler_pb2.HandleMessageResponse())
    garbled = (
        handler_pb2.HandleMessageStreamEvent(
            heartbeat=handler_pb2.Heartbeat(progress="x")
        ).SerializeToString()[:-1]
        + b"\xff"
    )

    async def stream(data: bytes, context: Any) -> AsyncIterator[bytes]:
        message = handler_pb2.HandleMessageStreamRequest.FromString(data).message
        key = (message.partition, message.offset)
        attempts[key] = attempts.get(key, 0) + 1
        if attempts[key] <= 2:
            yield garbled
            await asyncio.sleep(60)  # the proxy ends the call
        yield ack.SerializeToString()

    async with raw_stream_service(stream) as address:
        config = _config(
            bootstrap,
            group,
            topic,
            [address],
            {"max_attempts": 5, "backoff": {"initial_ms": 20, "max_ms": 100}},
        )
        proxy, task = start_proxy(config)

        # When the proxy works through them
        async def finished() -> bool:
            return task.done() or await caught_up(bootstrap, group, topic)

        try:
            await async_wait_until(finished, timeout=60)
            # Then it is still running (it ran no group down on the answer), every message
            # was acked at its third attempt, and none was dead-lettered
            assert not task.done(), task
        finally:
            await proxy.shutdown()
            await task
    assert sorted(attempts.values()) == [3] * 20
    assert _dlq(bootstrap, group) == []
    scrape = parse_metrics(proxy.metrics.exposition().decode())
    assert scrape.total("consumer_proxy_messages_total", group=group, outcome="retry") == 40
    assert scrape.total("consumer_proxy_messages_total", group=group, outcome="dead_letter") == 0


# -- the service as a child process (the SDK), so it can be killed -----------------------------

_SERVICE = """
import asyncio, sys, time
from consumer_proxy import handler as cp

LONG_S, BLOCK_S = float(sys.argv[1]), float(sys.argv[2])

def say(*words):
    print(*words, flush=True)

async def handle(message):
    say("got", message.offset, message.attempt, time.time())
    if message.value == b"block":
        time.sleep(BLOCK_S)  # blocks the event loop: no heartbeats meanwhile
    elif message.value == b"long":
        await asyncio.sleep(LONG_S)
    say("done", message.offset, time.time())
    return None

async def main():
    server = await cp.serve(handle, port=0, grace_s=0)
    say("port", server.port)
    await server.wait_for_termination()

asyncio.run(main())
"""


class ServiceProcess:
    """The SDK service in a child process; its stdout lines are collected by a thread."""

    def __init__(self, long_s: float = LONG_S, block_s: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVICE, str(long_s), str(block_s)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[tuple[float, list[str]]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.split()))

    def seen(self, word: str) -> list[tuple[float, list[str]]]:
        return [(t, words) for t, words in list(self.lines) if words and words[0] == word]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.seen('port')[0][1][1]}"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def test_a_killed_service_process_gets_its_long_call_redelivered_within_the_timeout(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given two SDK service processes and one long message
    topic, group = unique_name("kill"), unique_name("kill")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, ["long"])
    services = [ServiceProcess(), ServiceProcess()]
    try:
        await async_wait_until(lambda: all(s.seen("port") for s in services), timeout=30)
        proxy, task = start_proxy(_config(bootstrap, group, topic, [s.address for s in services]))
        try:
            await async_wait_until(lambda: any(s.seen("got") for s in services), timeout=30)
            victim, other = services if services[0].seen("got") else services[::-1]
            got_at = victim.seen("got")[0][0]
            # When the one running it is killed (kill -9) 3 s into the LONG_S handler
            await async_wait_until(lambda: time.monotonic() - got_at >= 3.0, timeout=10)
            killed_at = time.monotonic()
            victim.kill()
            # Then the other instance gets it within the heartbeat timeout plus one backoff
            await async_wait_until(lambda: other.seen("got"), timeout=LONG_S)
            redelivered_after = other.seen("got")[0][0] - killed_at
            assert redelivered_after < HEARTBEAT_TIMEOUT_MS / 1000 + 0.2 + 1.0
            # and finishes it: nothing lost
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=LONG_S + 30)
        finally:
            await proxy.shutdown()
            await task
        assert len(other.seen("done")) == 1 and not victim.seen("done")
    finally:
        for s in services:
            s.close()


async def test_a_handler_blocking_its_event_loop_fails_is_retried_and_dead_lettered(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given an SDK service whose handler blocks its event loop for 2.5 s on "block", short
    # messages flowing meanwhile, a 1 s heartbeat timeout and max_attempts 2
    topic, group = unique_name("block"), unique_name("block")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, ["block"])
    service = ServiceProcess(block_s=2.5)
    stop = asyncio.Event()

    async def feed() -> None:
        while not stop.is_set():
            await asyncio.to_thread(produce, bootstrap, topic, ["s"] * 5)
            await asyncio.sleep(0.1)

    try:
        await async_wait_until(lambda: service.seen("port"), timeout=30)
        proxy, task = start_proxy(
            _config(
                bootstrap,
                group,
                topic,
                [service.address],
                {
                    "long_running": {"heartbeat_timeout_ms": 1000, "max_processing_ms": 60_000},
                    "max_attempts": 2,
                },
                circuit_breaker={"failure_threshold": 1000},
            )
        )
        feeding = asyncio.create_task(feed())
        try:
            # When it keeps blocking; then it is dead-lettered for its silences
            await async_wait_until(lambda: bool(_dlq(bootstrap, group)), timeout=60)
        finally:
            stop.set()
            await feeding
            await proxy.shutdown()
            await task
    finally:
        service.close()
    blocked = [r for r in _dlq(bootstrap, group) if value_of(r) == b"block"]
    assert blocked, "the blocking message is in the DLQ"
    headers = headers_of(blocked[0])
    assert headers["cp-status"] == b"DEADLINE_EXCEEDED"
    assert headers["cp-attempt"] == b"2"
    assert b"no heartbeat" in headers["cp-reason"]
    tries = [w for _, w in service.seen("got") if w[1] == "0"]
    assert len(tries) >= 2, "retried before it was dead-lettered"


# -- rebalance and shutdown ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "unary"])
async def test_a_rebalance_cancels_the_moving_long_calls_and_the_new_owner_delivers_them(
    kafka: Broker, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    bootstrap = kafka.bootstrap
    # Given two partitions with 20 long messages each (40 long calls open: streaming, or
    # unary with a long deadline) and a 1 s revoke grace
    delivery: dict[str, Any] = {"revoke_grace_ms": 1000}
    if mode == "unary":
        delivery["long_running"] = None
    caplog.set_level(logging.INFO, logger="consumer_proxy")
    topic, group = await _two_partitions(bootstrap, "rebal", 20)
    with ThreadedService(lambda m, n: Behaviour(delay_s=LONG_S if n == 1 else 0.01)) as service:
        async with Members() as members:
            members.start(_config(bootstrap, group, topic, [service.address], delivery))
            await async_wait_until(lambda: len(service.deliveries) == 40, timeout=30)
            # When a second member joins and takes one partition of the topic
            [moved_partition] = await _join(members, bootstrap, group, topic, service, delivery)

            # Then the service saw the moving partition's 20 calls cancelled, at once
            def cancellations() -> list[Any]:
                return [d for d in service.deliveries if d.outcome == "CANCELLED"]

            await async_wait_until(lambda: len(cancellations()) >= 20, timeout=10)
            cancelled = cancellations()
            assert len(cancelled) == 20
            assert {d.partition for d in cancelled} == {moved_partition}
            ends = [d.finished_at or 0 for d in cancelled]
            assert max(ends) - min(ends) < 1.0
            # within the revoke grace of the revoke (the first member's log says how long)
            assert revoke_took(caplog.records, group)[1] < 2.0
            # and the new owner delivers those 20, and everything is committed
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=LONG_S + 30)
        counts = service.counts
        twice = {k for k, n in counts.items() if n == 2}
        assert len(counts) == 40
        assert twice == {(d.topic, d.partition, d.offset) for d in cancelled}
        assert all(n in (1, 2) for n in counts.values())


async def _two_partitions(bootstrap: str, name: str, each: int) -> tuple[str, str]:
    """A new topic of two partitions with ``each`` "long" messages on each; a new group."""
    topic, group = unique_name(name), unique_name(name)
    create_topic(bootstrap, topic, partitions=2)
    records = [{"value": "long", "partition": p} for p in (0, 1) for _ in range(each)]
    await asyncio.to_thread(produce, bootstrap, topic, records)
    return topic, group


async def _join(
    members: Members,
    bootstrap: str,
    group: str,
    topic: str,
    service: ThreadedService,
    delivery: dict[str, Any],
) -> list[int]:
    """A second member joins; returns the partitions of ``topic`` it took. (It names a
    redrive topic of its own, so the assignor balances the two source partitions between the
    members and the moving partition is never the redrive one.)"""
    second = members.start(
        _config(
            bootstrap,
            group,
            topic,
            [service.address],
            delivery,
            dlq={"redrive_topic": f"{group}.redrive-second"},
        )
    )
    return await members.owned(second, topic)


async def test_a_rebalance_cancels_the_batch_calls_holding_a_moving_partitions_messages(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    bootstrap = kafka.bootstrap
    # Given batch mode (10 a call, a linger that lets both partitions' messages meet in one
    # call), 15 long messages on each of two partitions, and a 1 s revoke grace
    delivery: dict[str, Any] = {
        "revoke_grace_ms": 1000,
        "long_running": None,
        "batch": {"mode": "always", "max_messages": 10, "linger_ms": 1500},
    }
    caplog.set_level(logging.INFO, logger="consumer_proxy")
    topic, group = await _two_partitions(bootstrap, "rebatch", 15)
    with ThreadedService(lambda m, n: Behaviour(delay_s=LONG_S if n == 1 else 0.01)) as service:
        async with Members() as members:
            first = members.start(_config(bootstrap, group, topic, [service.address], delivery))
            await async_wait_until(lambda: len(service.deliveries) == 30, timeout=30)
            calls: dict[int, set[int]] = {}
            for d in service.deliveries:
                calls.setdefault(d.call, set()).add(d.partition)
            assert -1 not in calls and {0, 1} in calls.values(), "a call spans both partitions"
            # When a second member joins and takes one partition
            [moved_partition] = await _join(members, bootstrap, group, topic, service, delivery)
            # Then every call holding one of its messages is cancelled as a whole, at once
            # (the still-owned messages of a mixed call with it); the others run on
            hit = {call for call, held in calls.items() if moved_partition in held}
            firsts = [d for d in service.deliveries if d.n == 1]
            expected = {d.coordinates for d in firsts if d.call in hit}

            def cancelled() -> list[Any]:
                return [d for d in firsts if d.outcome == "CANCELLED"]

            await async_wait_until(lambda: len(cancelled()) >= len(expected), timeout=10)
            assert {d.coordinates for d in cancelled()} == expected
            assert all(d.outcome == "PENDING" for d in firsts if d.call not in hit)
            ends = [d.finished_at or 0 for d in cancelled()]
            assert max(ends) - min(ends) < 1.0
            assert revoke_took(caplog.records, group)[1] < 2.0
            # and each of those is delivered again, none counted as an attempt (the moving
            # ones by the new owner, the others by the first member); nothing is lost
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=LONG_S + 30)
        counts = service.counts
        assert len(counts) == 30
        assert {k for k, n in counts.items() if n == 2} == expected
        assert all(n in (1, 2) for n in counts.values())
        assert all(d.attempt == 1 for d in service.deliveries)
        scrape = parse_metrics(first.metrics.exposition().decode())
        assert scrape.value("consumer_proxy_calls_cancelled_total", group=group, cause="revoke")


def test_sigterm_cancels_open_long_calls_within_the_grace_and_exits_0(
    kafka: Broker, tmp_path: Path
) -> None:
    bootstrap = kafka.bootstrap
    # Given a proxy process with 10 long calls open and a 1 s shutdown grace
    topic, group = unique_name("term"), unique_name("term")
    create_topic(bootstrap, topic, partitions=1)
    produce(bootstrap, topic, ["long"] * 10)
    with ThreadedService(lambda m, n: Behaviour(delay_s=LONG_S)) as service:
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"long_running": LONG_RUNNING, "concurrency": 20},
            shutdown_grace_s=1.0,
        )
        with ProxyProcess(config, tmp_path / "proxy.log") as proxy:
            wait_until(lambda: len(service.deliveries) == 10, timeout=60)
            # When it is sent SIGTERM
            began = time.monotonic()
            code = proxy.stop(timeout_s=30)
            took = time.monotonic() - began
        # Then it exits 0 within its grace (plus the commit and leaving the group)
        assert code == 0, proxy.log_tail()
        assert took < 1.0 + 5.0
        # and the service saw every open call cancelled
        wait_until(lambda: [d.outcome for d in service.deliveries] == ["CANCELLED"] * 10, 10)
