"""examples/example_service.py, run as a real process and called over gRPC."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.kafka import Broker, headers_of, value_of

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "example_service.py"
SERVING = re.compile(rb"serving on (\S+)")


def message(offset: int, value: bytes) -> handler_pb2.HandleMessageRequest:
    return handler_pb2.HandleMessageRequest(
        message=handler_pb2.Message(
            topic="orders", partition=0, offset=offset, value=value, has_value=True, attempt=1
        )
    )


async def start_example() -> tuple[asyncio.subprocess.Process, str, bytearray]:
    """Start the example on a free port; returns the process, its address and its log so far."""
    # The example imports consumer_proxy, which need not be installed in the venv.
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        "--port=0",
        "--latency-ms=1",
        "--jitter-ms=2",
        "--poison-marker=poison",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert process.stderr is not None
    log = bytearray()
    try:
        while (found := SERVING.search(log)) is None:
            line = await asyncio.wait_for(process.stderr.readline(), 30)
            if not line:
                raise AssertionError(f"the example exited before serving:\n{log.decode()}")
            log += line
    except BaseException:
        process.kill()
        await process.communicate()
        raise
    return process, found.group(1).decode(), log


async def test_the_example_acks_dead_letters_poison_reports_health_and_stops_on_sigterm() -> None:
    process, address, log = await start_example()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

            response = await stub.HandleMessage(message(1, b"hello"), timeout=10)
            assert response == handler_pb2.HandleMessageResponse()  # ack

            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.HandleMessage(message(2, b"a poison pill"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "poison" in (caught.value.details() or "")

        process.send_signal(signal.SIGTERM)
        _, rest = await asyncio.wait_for(process.communicate(), 30)
        log += rest
        assert process.returncode == 0, log.decode()
        assert b"stopped" in log
    finally:
        if process.returncode is None:
            process.kill()
            await process.communicate()


@pytest.mark.kafka
async def test_the_sdk_example_behind_the_proxy_acks_and_dead_letters_through_kafka(
    kafka: Broker,
) -> None:
    # Given a topic with 200 messages, 5 of them poison, and the example service as a process
    from tests.support.kafka import consume_all, create_topic, produce, unique_name
    from tests.support.proxy import caught_up, make_config, start_proxy
    from tests.support.waiting import async_wait_until

    bootstrap = kafka.bootstrap
    topic, group = unique_name("sdk"), unique_name("sdk")
    create_topic(bootstrap, topic, partitions=2)
    values = [f"order {i}" + (" poison" if i % 40 == 7 else "") for i in range(200)]
    produce(bootstrap, topic, values)

    process, address, _ = await start_example()
    try:
        # When the proxy pushes the topic to it
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [address]))
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
        acked = proxy.metrics.messages.labels(group, "ack")._value.get()
        assert acked == 195
    finally:
        process.send_signal(signal.SIGTERM)
        await process.communicate()
    # Then exactly the poison pills are in the DLQ, with the SDK's reason
    dead = consume_all(bootstrap, f"{group}.dlq")
    assert sorted(value_of(m).decode() for m in dead) == sorted(v for v in values if "poison" in v)
    reasons = {headers_of(m)["cp-reason"].decode() for m in dead}
    assert all("poison" in r for r in reasons), reasons
