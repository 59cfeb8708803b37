"""Flow control against the real broker and real gRPC services: breaker, ejection, limits."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer_proxy.config import ServiceConfig
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.dispatcher import Dispatcher
from consumer_proxy.group import GroupRunner
from consumer_proxy.proxy import Proxy
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService, always
from tests.support.waiting import async_wait_until

OUTAGE_S = 10.0
RESET_S = 1.0


def metric(proxy: Proxy, name: str, **labels: str) -> float:
    """One sample of the proxy's exposition text (0.0 when absent)."""
    text = proxy.metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def acked(service: TestService) -> set[tuple[int, int]]:
    return {(d.partition, d.offset) for d in service.deliveries if d.outcome == "ACK"}


class PushSpy:
    """Wraps the runner's real Dispatcher.push to note the breaker state as each call starts."""

    def __init__(self, runner: GroupRunner) -> None:
        assert runner.dispatcher is not None
        self.calls: list[tuple[float, str]] = []
        real = runner.dispatcher.push

        async def push(request, endpoint, metadata=None):  # type: ignore[no-untyped-def]
            self.calls.append((time.monotonic(), runner.breaker.state))
            return await real(request, endpoint, metadata)

        runner.dispatcher.push = push  # type: ignore[method-assign]

    def between(self, start: float, end: float) -> list[str]:
        return [state for t, state in self.calls if start <= t <= end]


# -- the circuit breaker ---------------------------------------------------------------------


@pytest.mark.kafka
async def test_a_stopped_service_opens_the_breaker_and_dead_letters_nothing(kafka: Broker) -> None:
    await _outage(kafka.bootstrap, "stop")


@pytest.mark.kafka
async def test_a_service_answering_unavailable_pauses_delivery_and_costs_no_attempts(
    kafka: Broker,
) -> None:
    await _outage(kafka.bootstrap, "unavailable")


async def _outage(bootstrap: str, mode: str) -> None:
    # Given 600 messages and a service that takes 50 ms a call, 10 at a time (~200/s)
    topic, group = unique_name("outage"), unique_name("outage")
    create_topic(bootstrap, topic, partitions=2)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(600)])
    working = always(Behaviour(delay_s=0.05))
    async with TestService(working) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 10},
            breaker={"failure_threshold": 5, "reset_timeout_s": RESET_S},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        await async_wait_until(lambda: runner.dispatcher is not None, timeout=30)
        spy = PushSpy(runner)
        await async_wait_until(lambda: len(acked(service)) >= 150, timeout=60)

        # When the service goes down in the middle of the run
        if mode == "stop":
            await service.stop()
        else:
            service.behaviour = always(Behaviour(status=grpc.StatusCode.UNAVAILABLE))
        await async_wait_until(lambda: runner.breaker.state == "open", timeout=20)
        opened_at, cpu_before = time.monotonic(), time.process_time()
        await asyncio.sleep(OUTAGE_S)  # the outage itself, not a wait for a condition
        outage_end, cpu_during = time.monotonic(), time.process_time() - cpu_before
        assert runner.breaker.is_open
        assert metric(proxy, "consumer_proxy_circuit_open", group=group) == 1.0
        # every partition that holds messages is paused; one that holds none (the redrive
        # topic's, or a source partition drained before the outage) keeps fetching: a
        # probe needs a message (see PartitionSet.pause_plan)
        parts = runner.partitions.parts.values()
        holding = [p for p in parts if p.backlog or (p.tracker and p.tracker.pending)]
        assert holding and all(p.paused for p in holding)
        paused = metric(proxy, "consumer_proxy_partitions_paused", group=group)
        assert paused == len(holding)
        if mode == "stop":
            await service.restart()
        else:
            service.behaviour = working

        # Then delivery resumes and everything is committed
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        closes = metric(
            proxy, "consumer_proxy_circuit_transitions_total", group=group, state="closed"
        )
        opens = metric(proxy, "consumer_proxy_circuit_transitions_total", group=group, state="open")
        probes = metric(
            proxy, "consumer_proxy_circuit_transitions_total", group=group, state="half-open"
        )
        await proxy.shutdown()
        await task

    # every message was acked after the recovery, none went to the DLQ
    values = {d.value for d in service.deliveries if d.outcome == "ACK"}
    assert values == {f"m{i}".encode() for i in range(600)}
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq") == []
    assert metric(proxy, "consumer_proxy_dlq_writes_total", group=group, result="ok") == 0
    # the breaker opened and closed again
    assert opens >= 1 and closes >= 1 and runner.breaker.state == "closed"
    assert metric(proxy, "consumer_proxy_circuit_open", group=group) == 0.0
    # while it was open only probes went out: about one per reset timeout
    during = spy.between(opened_at, outage_end)
    assert 1 <= len(during) <= OUTAGE_S / RESET_S + 2, during
    assert set(during) == {"half-open"}
    assert sum(state != "closed" for _, state in spy.calls) <= probes
    # and the proxy idled instead of spinning (a busy loop burns a whole core: ratio ~1)
    cpu_ratio = cpu_during / (outage_end - opened_at)
    assert cpu_ratio < 0.25, f"the proxy used {cpu_ratio:.0%} of a core while the breaker was open"
    # the outage cost no message an attempt, but for the calls a stopping server cancelled:
    # CANCELLED counts by the status table, so each message in flight at the stop (at most
    # the 10 calls under way) may have had one more
    attempts = [d.attempt for d in service.deliveries]
    if mode == "stop":
        assert set(attempts) <= {1, 2} and attempts.count(2) <= 10, attempts
    else:
        assert set(attempts) == {1}


# -- endpoint health -------------------------------------------------------------------------


@pytest.mark.kafka
async def test_an_instance_answering_unavailable_is_ejected_and_the_others_carry_the_load(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="consumer_proxy.dispatcher")
    await _one_bad_instance(kafka.bootstrap)
    assert any("ejected" in r.getMessage() for r in caplog.records)


async def _one_bad_instance(bootstrap: str) -> None:
    # Given three instances, one of which answers UNAVAILABLE to everything
    topic, group = unique_name("eject"), unique_name("eject")
    create_topic(bootstrap, topic, partitions=4)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(1500)])
    good = always(Behaviour(delay_s=0.005))
    async with (
        TestService(good) as one,
        TestService(good) as two,
        TestService(always(Behaviour(status=grpc.StatusCode.UNAVAILABLE))) as bad,
    ):
        config = make_config(
            bootstrap,
            group,
            [topic],
            [one.address, two.address, bad.address],
            delivery={"concurrency": 30},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]

        # When the bad instance has been ejected
        def ejected() -> bool:
            return isinstance(runner.dispatcher, Dispatcher) and runner.dispatcher.ejected > 0

        await async_wait_until(ejected, timeout=60)
        assert metric(proxy, "consumer_proxy_endpoints_ejected", group=group) == 1.0
        dispatcher = runner.dispatcher
        assert isinstance(dispatcher, Dispatcher)
        by_target = {e.target: e for e in dispatcher.endpoints}
        bad_before = by_target[bad.address].calls
        total_before = sum(e.calls for e in dispatcher.endpoints)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        await proxy.shutdown()
        await task

    # Then after the ejection its share of the calls is about nothing
    bad_after = by_target[bad.address].calls - bad_before
    total_after = sum(e.calls for e in by_target.values()) - total_before
    assert total_after > 1000
    assert bad_after / total_after < 0.02, (bad_after, total_after)
    # and the two others acked everything between them, each a fair share
    assert len(acked(one) | acked(two)) == 1500
    assert min(len(acked(one)), len(acked(two))) > 1500 * 0.25
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq") == []


async def test_health_checks_take_instances_out_of_rotation_and_bring_them_back() -> None:
    await _health_checks()


async def _health_checks() -> None:
    # Given a dispatcher over two instances, checking health every 100 ms
    async with TestService() as a, TestService() as b:
        ejected_counts: list[int] = []
        service = ServiceConfig(endpoints=[a.address, b.address])
        dispatcher = Dispatcher(
            "g",
            service,
            Classifier(),
            on_ejected=ejected_counts.append,
            health_interval_s=0.1,
            ejected_check_interval_s=0.1,
        )
        dispatcher.start()
        ea, eb = dispatcher.endpoints
        try:
            # When b reports NOT_SERVING
            await b.set_health(False)
            await async_wait_until(lambda: eb.ejected, timeout=10)
            # Then every pick goes to a
            assert {dispatcher.pick().target for _ in range(200)} == {a.address}
            # When b is SERVING again, it returns
            await b.set_health(True)
            await async_wait_until(lambda: not eb.ejected, timeout=10)
            # When a becomes unreachable, it is ejected after failed checks, and returns
            # when it is back
            await a.stop()
            await async_wait_until(lambda: ea.ejected, timeout=10)
            await a.restart()
            await async_wait_until(lambda: not ea.ejected, timeout=15)
            # When both say NOT_SERVING, one stays in rotation: a full outage is the breaker's
            await a.set_health(False)
            await b.set_health(False)
            await async_wait_until(lambda: dispatcher.ejected == 1, timeout=10)
            for _ in range(5):  # several more rounds of checks
                await async_wait_until(lambda: ea.serving is False and eb.serving is False)
                await asyncio.sleep(0.1)
                assert dispatcher.ejected == 1
            await a.set_health(True)
            await b.set_health(True)
            await async_wait_until(lambda: dispatcher.ejected == 0, timeout=10)
        finally:
            await dispatcher.close()
    assert ejected_counts == [1, 0, 1, 0, 1, 0]


# -- concurrency and rate limits -------------------------------------------------------------


@pytest.mark.kafka
async def test_the_adaptive_limit_settles_near_what_the_service_admits(kafka: Broker) -> None:
    await _capacity(kafka.bootstrap)


async def _capacity(bootstrap: str) -> None:
    # Given a service that admits 8 concurrent calls of 20 ms and refuses the rest
    k = 8
    topic, group = unique_name("adaptive"), unique_name("adaptive")
    create_topic(bootstrap, topic, partitions=4)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(2400)])
    async with TestService(always(Behaviour(delay_s=0.02)), max_concurrency=k) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={
                "concurrency": "adaptive",
                "adaptive": {"min": 1, "max": 64, "initial": 2},
                "max_attempts": 10,
            },
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        samples: list[tuple[float, int]] = []

        async def sample() -> None:
            while True:
                samples.append((time.monotonic(), runner.limiter.limit))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        try:
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=120)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        gauge = metric(proxy, "consumer_proxy_concurrency_limit", group=group)
        final = runner.limiter.limit
        await proxy.shutdown()
        await task

    # Then, after the first second of pushing, the limit stays near K
    first = min(d.received_at for d in service.deliveries)
    last = max(d.received_at for d in service.deliveries)
    settled = [lim for t, lim in samples if first + 1.0 <= t <= last]
    assert len(settled) > 20
    inside = sum(k / 2 <= lim <= 2 * k for lim in settled) / len(settled)
    assert inside >= 0.9, sorted(settled)
    assert k / 2 <= statistics.median(settled) <= 2 * k
    assert gauge == final
    # the service's refusals were the signal, and few calls were wasted on them
    assert 0 < service.rejected < 0.25 * len(service.deliveries)
    # and nothing was dead-lettered
    assert len(acked(service)) == 2400
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq") == []


@pytest.mark.kafka
async def test_the_rate_limit_caps_messages_per_second(kafka: Broker) -> None:
    await _rate(kafka.bootstrap, {}, upper=1.15)


@pytest.mark.kafka
async def test_in_batch_mode_the_rate_limit_counts_messages_not_calls(kafka: Broker) -> None:
    # (a span of 300 messages may start or end within a call of 50: 1.2 x at most)
    service = await _rate(kafka.bootstrap, {"batch": {"max_messages": 50}}, upper=1.25)
    # (and the messages did travel in batches: the cap is not met by sending them one a call)
    assert service.batch_calls and max(service.batch_calls) > 1, service.batch_calls
    assert len(service.batch_calls) < 500


async def _rate(bootstrap: str, delivery: dict[str, Any], upper: float) -> TestService:
    # Given 500 messages, a fast service and a cap of 100 messages/s
    rate = 100.0
    topic, group = unique_name("rate"), unique_name("rate")
    create_topic(bootstrap, topic, partitions=2)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(500)])
    async with TestService() as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={**delivery, "rate_limit_per_s": rate},
        )
        proxy, task = start_proxy(config)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
    # Then past the first second's burst, messages arrive at about the cap
    arrivals = sorted(d.received_at for d in service.deliveries)
    assert len(arrivals) == 500
    measured = 300 / (arrivals[400] - arrivals[100])
    assert 0.5 * rate <= measured <= upper * rate, measured
    # and past that burst no span of time holds more than the first call in it, a second's
    # burst and the rate over the span (the bucket's promise: a burst comes only after a stall
    # let tokens pile up; slack for the time calls take to arrive). The first second is left
    # out: the first calls wait for the channel to connect, later than their tokens.
    largest_call = max(service.batch_calls, default=1)
    steady = arrivals[100:]
    worst = max(
        j - i + 1 - rate * (steady[j] - steady[i])
        for i in range(len(steady))
        for j in range(i, len(steady))
    )
    assert worst <= largest_call + rate + 10, (worst, largest_call)
    return service
