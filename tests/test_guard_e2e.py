"""The dead-letter guard on the real broker with a real gRPC service: a bad deploy holds
instead of flooding the DLQ and is released when the service is rolled back; genuine poison
never trips it; an operator releases it through the admin endpoint (and the CLI), which
refuses a request without the token. The rules themselves: tests/test_guard.py and the seeded
schedules of tests/sim."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from confluent_kafka import Message

from consumer_proxy import cli
from consumer_proxy.config import ProxyConfig
from consumer_proxy.core import records as rec
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.ledger import Ledger
from tests.support.proxy import caught_up, config_dict, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

TOKEN = "t0ken-for-the-guard-e2e-tests"
REJECT = Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad deploy: cannot parse")
CONCURRENCY = 20


def _raw(bootstrap: str, group: str, topic: str, address: str, **guard: int) -> dict[str, Any]:
    raw = config_dict(
        bootstrap,
        group,
        [topic],
        [address],
        delivery={"concurrency": CONCURRENCY, "max_in_flight": 500},
        metrics_port=0,
    )
    raw["groups"][0]["dead_letter_guard"] = {"probe_interval_ms": 500, **guard}
    raw["admin"] = {"token": TOKEN}
    return raw


def _post(port: int, path: str, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/admin/{path}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _dlq(bootstrap: str, group: str) -> list[Message]:
    return await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0)


async def test_a_bad_deploy_holds_instead_of_flooding_the_dlq_and_a_rollback_acks_everything(
    kafka: Broker,
) -> None:
    # Given 5,000 messages and a service that is healthy for its first 1,000 answers, then
    # rejects every message with INVALID_ARGUMENT (a bad deploy)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("baddeploy"), unique_name("baddeploy")
    create_topic(bootstrap, topic, partitions=4)
    ledger = Ledger("dead-letter guard: a bad deploy, then a rollback")
    await asyncio.to_thread(produce, bootstrap, topic, ledger.records(5000, partitions=4))
    answered = 0
    bad = True

    def behaviour(_msg: handler_pb2.Message, _n: int) -> Behaviour:
        nonlocal answered
        answered += 1
        return REJECT if answered > 1000 and bad else Behaviour()

    async with TestService(behaviour) as service:
        proxy, task = start_proxy(ProxyConfig(**_raw(bootstrap, group, topic, service.address)))
        runner = proxy.runners[0]
        guard = runner.partitions.guard
        assert guard is not None
        try:
            # When the bad deploy answers, Then the guard trips and /readyz says so
            await async_wait_until(lambda: guard.held, timeout=60)
            await async_wait_until(lambda: "dead-letter guard: held" in proxy.ready()[1], 10)
            assert proxy.http is not None
            # (the DLQ writes decided before it tripped complete: acks=all takes a moment)
            await async_wait_until(lambda: not runner._parking.tasks, timeout=30)
            written = len(await _dlq(bootstrap, group))
            # ... having dead-lettered at most min_messages plus the calls in flight
            assert 0 < written <= 100 + CONCURRENCY, written
            # ... and it holds what would have gone to the DLQ (in the windows, paused)
            await async_wait_until(
                lambda: (runner.partitions.guard_state() or (None, 0))[1] > 0, timeout=10
            )
            await asyncio.sleep(2.0)  # several probe intervals: still held, nothing written
            assert guard.held and len(await _dlq(bootstrap, group)) == written
            # When the service is rolled back
            bad = False
            # Then a probe is acked, the guard releases, and every held message is acked
            await async_wait_until(lambda: not guard.held, timeout=30)
            await async_wait_until(functools.partial(caught_up, bootstrap, group, topic), 90)
        finally:
            await proxy.shutdown()
            await task
        ledger.observe(service.deliveries)
    # And the DLQ holds only what was written before the trip; nothing is lost
    dlq = await _dlq(bootstrap, group)
    ledger.observe_dlq(dlq)
    assert len(dlq) == written
    assert all(dict(rec.split_headers(m.headers())[1])[rec.H_STATUS] == "INVALID_ARGUMENT"
               for m in dlq)  # fmt: skip
    ledger.note(f"{written} dead-lettered before the guard tripped; 1 trip")
    ledger.check(max_duplicates=0)
    assert guard.trips == 1


async def test_one_percent_genuine_poison_never_trips_the_guard(kafka: Broker) -> None:
    # Given 20,000 messages of which 1 % are poison pills, default thresholds, batch push
    bootstrap = kafka.bootstrap
    topic, group = unique_name("poison1"), unique_name("poison1")
    create_topic(bootstrap, topic, partitions=4)
    values = [f"{'poison' if i % 100 == 7 else 'ok'}-{i}" for i in range(20_000)]
    await asyncio.to_thread(produce, bootstrap, topic, values)

    def behaviour(msg: handler_pb2.Message, _n: int) -> Behaviour:
        return REJECT if msg.value.startswith(b"poison") else Behaviour()

    async with TestService(behaviour, per_message_status=True) as service:
        raw = config_dict(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"batch": {"max_messages": 100}, "concurrency": 8},
        )
        proxy, task = start_proxy(ProxyConfig(**raw))
        try:
            await async_wait_until(functools.partial(caught_up, bootstrap, group, topic), 120)
        finally:
            await proxy.shutdown()
            await task
    # Then nothing tripped it and every pill is in the DLQ
    guard = proxy.runners[0].partitions.guard
    assert guard is not None and guard.trips == 0
    assert len(await _dlq(bootstrap, group)) == 200


async def test_an_operator_releases_the_guard_and_the_held_messages_go_to_the_dlq(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given a service that rejects every message, and a guard that tripped on it
    bootstrap = kafka.bootstrap
    topic, group = unique_name("release"), unique_name("release")
    create_topic(bootstrap, topic, partitions=2)
    ledger = Ledger("dead-letter guard: released by an operator")
    await asyncio.to_thread(produce, bootstrap, topic, ledger.records(300, partitions=2))

    async with TestService(lambda _m, _n: REJECT) as service:
        raw = _raw(bootstrap, group, topic, service.address, min_messages=20)
        proxy, task = start_proxy(ProxyConfig(**raw))
        runner = proxy.runners[0]
        guard = runner.partitions.guard
        assert guard is not None
        try:
            await async_wait_until(lambda: guard.held, timeout=60)
            assert proxy.http is not None
            port = proxy.http.port
            # Then the admin endpoint refuses a request without the token, or with another
            action = f"groups/{group}/guard/release"
            assert (await asyncio.to_thread(_post, port, action, None))[0] == 403
            assert (await asyncio.to_thread(_post, port, action, "x" * 20))[0] == 403
            assert guard.held
            # When the operator releases it with the CLI (the token from a file)
            await async_wait_until(
                lambda: (runner.partitions.guard_state() or (None, 0))[1] > 0, timeout=10
            )
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN + "\n")
            config_file = tmp_path / "proxy.json"
            config_file.write_text(json.dumps(raw))
            code = await asyncio.to_thread(
                cli.main,
                [
                    "guard",
                    "release",
                    "--config",
                    str(config_file),
                    "--group",
                    group,
                    "--url",
                    f"http://127.0.0.1:{port}",
                    "--token-file",
                    str(token_file),
                ],
            )
            assert code == 0

            # Then the held messages are written to the DLQ and the commit reaches the end
            # (the guard trips again on the rest, and is released again)
            async def everything_dead_lettered() -> bool:
                if guard.held:
                    runner.guard.release()
                return await caught_up(bootstrap, group, topic)

            await async_wait_until(everything_dead_lettered, timeout=90, interval=0.5)
        finally:
            await proxy.shutdown()
            await task
        ledger.observe(service.deliveries)
    # With their true status and attempt; nothing lost, nothing written twice
    dlq = await _dlq(bootstrap, group)
    ledger.observe_dlq(dlq)
    ledger.check(max_duplicates=0)
    assert len(dlq) == 300
    for record in dlq:
        _, ours = rec.split_headers(record.headers())
        assert ours[rec.H_STATUS] == "INVALID_ARGUMENT" and ours[rec.H_ATTEMPT] == "1"


async def test_the_admin_endpoint_is_off_without_a_token(kafka: Broker) -> None:
    bootstrap = kafka.bootstrap
    topic, group = unique_name("noadmin"), unique_name("noadmin")
    create_topic(bootstrap, topic, partitions=1)
    async with TestService() as service:
        raw = config_dict(bootstrap, group, [topic], [service.address], metrics_port=0)
        proxy, task = start_proxy(ProxyConfig(**raw))
        try:
            await async_wait_until(lambda: proxy.http is not None, timeout=30)
            assert proxy.http is not None
            status, text = await asyncio.to_thread(
                _post, proxy.http.port, f"groups/{group}/guard/hold", TOKEN
            )
            assert status == 404 and "admin.token" in text
        finally:
            await proxy.shutdown()
            await task
