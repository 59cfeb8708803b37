"""examples/go: a Go service built from the generated stubs, run behind the proxy.

The example is its own Go module (examples/go/go.mod) with the stubs scripts/gen_go.py
generates. Here it is built with the machine's Go (modules from the Go module proxy the first
time, from the module and build caches after), its own `go test` runs, and the binary is run on
a free 127.0.0.1 port: first called directly, then behind the proxy against the real broker.
Without Go these tests skip locally and fail in CI (CI=true), like every integration test.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.goexample import MODULE, GoService, build, find_go, go
from tests.support.goexample import go_service as run_go_service
from tests.support.kafka import (
    Broker,
    consume_all,
    create_topic,
    headers_of,
    produce,
    unique_name,
    value_of,
)
from tests.support.proxy import Members, caught_up, make_config, revoke_took, start_proxy
from tests.support.scrape import parse
from tests.support.waiting import async_wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def go_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("go-example"))


@pytest.fixture
def go_service(go_binary: Path) -> Iterator[GoService]:
    """The example on a free 127.0.0.1 port (given by PORT), ready once its health says so."""
    yield from run_go_service(go_binary)


def test_the_go_example_passes_its_own_go_test() -> None:
    go_cmd = find_go()
    go(go_cmd, "vet", "./...")
    proc = go(go_cmd, "test", "./...")
    assert "ok  \tgithub.com/consumer-proxy/consumer-proxy/examples/go" in proc.stdout


def message(offset: int, value: bytes, attempt: int = 1) -> handler_pb2.HandleMessageRequest:
    return handler_pb2.HandleMessageRequest(
        message=handler_pb2.Message(
            topic="orders", partition=0, offset=offset, value=value, has_value=True, attempt=attempt
        )
    )


def test_the_go_example_acks_retries_dead_letters_and_stops_gracefully(
    go_service: GoService,
) -> None:
    # Given the Go example, serving
    Action = handler_pb2.HandleMessageResponse

    # When the proxy's own stubs call it
    with grpc.insecure_channel(go_service.address) as channel:
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        acked = stub.HandleMessage(message(1, b"an order"), timeout=10)
        retried = stub.HandleMessage(message(2, b"a flaky order"), timeout=10)
        retried_ok = stub.HandleMessage(message(2, b"a flaky order", attempt=2), timeout=10)
        dead = stub.HandleMessage(message(3, b"a poison order"), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="consumerproxy.v1.MessageHandler"), timeout=10
        )

    # Then it answers in the contract's terms, and reports per-service health
    assert acked == handler_pb2.HandleMessageResponse()  # an empty response: ack
    assert (retried.action, retried.retry_after_ms) == (Action.RETRY, 10)
    assert retried_ok == handler_pb2.HandleMessageResponse()
    assert dead.action == Action.DEAD_LETTER and "poison" in dead.reason
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # and stops on SIGTERM, with its counts
    log = go_service.stop()
    assert go_service.process.returncode == 0, log
    assert "stopped: acked=2 retried=1 dead_lettered=1" in log


def test_the_go_example_accepts_a_5_mib_record_alone_and_in_a_batch(
    go_service: GoService,
) -> None:
    # Given the Go example, serving with its default limits (gRPC's own would be 4 MiB)
    big = b"x" * (5 * 1024 * 1024)
    # When the proxy's own stubs send it a 5 MiB record, then a batch of three
    with grpc.insecure_channel(go_service.address) as channel:
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        alone = stub.HandleMessage(message(1, big), timeout=30)
        batch = stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[message(offset, big).message for offset in (2, 3, 4)]
            ),
            timeout=30,
        )
    # Then each is acked
    assert alone == handler_pb2.HandleMessageResponse()
    assert list(batch.results) == [handler_pb2.HandleMessageResponse()] * 3


@pytest.mark.kafka
async def test_the_go_example_behind_the_proxy_acks_retries_and_dead_letters_through_kafka(
    kafka: Broker, go_service: GoService
) -> None:
    # Given a topic with 120 messages: 6 poison pills and 6 that fail their first attempt
    bootstrap = kafka.bootstrap
    topic, group = unique_name("go"), unique_name("go")
    create_topic(bootstrap, topic, partitions=2)
    values = [
        f"order {i}" + (" poison" if i % 20 == 3 else " flaky" if i % 20 == 11 else "")
        for i in range(120)
    ]
    produce(bootstrap, topic, values)

    # When the proxy pushes the topic to the Go service until the group has caught up
    proxy, task = start_proxy(make_config(bootstrap, group, [topic], [go_service.address]))
    try:
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
    finally:
        await proxy.shutdown()
        await task
    outcomes = proxy.metrics.messages
    acked = outcomes.labels(group, "ack")._value.get()
    dead_lettered = outcomes.labels(group, "dead_letter")._value.get()

    # Then every message but the poison pills was acked (the flaky ones on their second attempt)
    assert (acked, dead_lettered) == (114, 6)
    log = go_service.stop()
    assert "stopped: acked=114 retried=6 dead_lettered=6" in log, log
    # and exactly the poison pills are in the DLQ, with the Go handler's reason
    dead = consume_all(bootstrap, f"{group}.dlq")
    assert sorted(value_of(m).decode() for m in dead) == sorted(v for v in values if "poison" in v)
    headers = [headers_of(m) for m in dead]
    assert {h["cp-reason"].decode() for h in headers} == {'value contains "poison"'}
    assert {h["cp-status"].decode() for h in headers} == {"DEAD_LETTER"}


@pytest.fixture
def go_long_service(go_binary: Path) -> Iterator[GoService]:
    """The example with 3 s "long" messages (HandleMessageStream)."""
    yield from run_go_service(go_binary, "-long-ms", "3000")


@pytest.mark.kafka
async def test_the_go_example_heartbeats_long_calls_and_sees_the_proxy_cancel_them(
    kafka: Broker, go_long_service: GoService
) -> None:
    # Given a long-running group (0.9 s heartbeat timeout, 6 s cap, one attempt) and the Go
    # example: "long" messages take 3 s (over three heartbeat timeouts), "stuck" never end
    bootstrap = kafka.bootstrap
    topic, group = unique_name("golong"), unique_name("golong")
    create_topic(bootstrap, topic, partitions=1)
    produce(bootstrap, topic, ["a long job", "a short job", "a stuck job", "another long job"])
    config = make_config(
        bootstrap,
        group,
        [topic],
        [go_long_service.address],
        delivery={
            "long_running": {"heartbeat_timeout_ms": 900, "max_processing_ms": 6000},
            "max_attempts": 1,
        },
    )
    # When the proxy pushes them until the group has caught up
    proxy, task = start_proxy(config)
    try:
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
    finally:
        await proxy.shutdown()
        await task
    # Then the long ones were kept alive by heartbeats and acked, the stuck one cancelled at
    # the cap (the Go handler saw ctx.Done()) and dead-lettered
    outcomes = proxy.metrics.messages
    assert outcomes.labels(group, "ack")._value.get() == 3
    log = go_long_service.stop()
    assert "stopped: acked=3 retried=0 dead_lettered=0 cancelled=1" in log, log
    assert re.search(rf"cancelled {topic}\[0\]@2: context canceled", log), log
    (dead,) = consume_all(bootstrap, f"{group}.dlq")
    assert value_of(dead) == b"a stuck job"
    assert headers_of(dead)["cp-status"] == b"MAX_PROCESSING_EXCEEDED"


LONG_MS = 12_000
REVOKE_GRACE_MS = 1000


@pytest.fixture
def go_longer_service(go_binary: Path) -> Iterator[GoService]:
    """The example with "long" messages of LONG_MS: open through a rebalance."""
    yield from run_go_service(go_binary, "-long-ms", str(LONG_MS))


@pytest.mark.kafka
async def test_a_rebalance_cancels_the_go_examples_long_calls_and_the_new_owner_delivers_them(
    kafka: Broker, go_longer_service: GoService, caplog: pytest.LogCaptureFixture
) -> None:
    # Given 5 long messages on each of two partitions, all 10 open on the Go example (12 s
    # each, kept alive by its heartbeats), and a 1 s revoke grace
    caplog.set_level(logging.INFO, logger="consumer_proxy")
    bootstrap = kafka.bootstrap
    topic, group = unique_name("gorebal"), unique_name("gorebal")
    create_topic(bootstrap, topic, partitions=2)
    produce(
        bootstrap,
        topic,
        [{"value": f"a long job {p}-{i}", "partition": p} for p in (0, 1) for i in range(5)],
    )
    delivery = {
        "long_running": {"heartbeat_timeout_ms": 1500, "max_processing_ms": 60_000},
        "revoke_grace_ms": REVOKE_GRACE_MS,
    }
    address = go_longer_service.address

    def cancelled() -> list[tuple[float, str]]:
        return [(t, line) for t, line in list(go_longer_service.lines) if " cancelled " in line]

    async with Members() as members:
        first = members.start(make_config(bootstrap, group, [topic], [address], delivery=delivery))

        def open_calls() -> float:
            scrape = parse(first.metrics.exposition().decode())
            return scrape.value("consumer_proxy_long_calls_open", group=group) or 0

        await async_wait_until(lambda: open_calls() == 10, timeout=30)
        # When a second member joins and takes one partition (a redrive topic of its own, so
        # the assignor balances the two source partitions between the members)
        redrive = {"redrive_topic": f"{group}.redrive-second"}
        second = members.start(
            make_config(bootstrap, group, [topic], [address], delivery=delivery, dlq=redrive)
        )
        [partition] = await members.owned(second, topic)
        # Then the Go handlers of that partition's 5 calls saw ctx.Done()
        await async_wait_until(lambda: len(cancelled()) >= 5, timeout=10)
        seen = re.findall(r"cancelled (\S+): context canceled", "".join(x for _, x in cancelled()))
        assert sorted(seen) == [f"{topic}[{partition}]@{offset}" for offset in range(5)]
        # within the revoke grace of the revoke (plus the wait for cancelled calls to end)
        began, took = revoke_took(caplog.records, group)
        assert took < REVOKE_GRACE_MS / 1000 + 1.0
        assert all(began < t < began + REVOKE_GRACE_MS / 1000 + 1.0 for t, _ in cancelled())
        # and the new owner delivers those 5 again, to the end: nothing is lost
        await async_wait_until(
            lambda: caught_up(bootstrap, group, topic), timeout=LONG_MS / 1000 + 30
        )
    # Each of the 10 acked once by the Go example, the 5 moving ones after one cancellation
    log = go_longer_service.stop()
    assert "stopped: acked=10 retried=0 dead_lettered=0 cancelled=5" in log, log
    acks = sum(p.metrics.messages.labels(group, "ack")._value.get() for p in members.proxies)
    assert acks == 10


def test_the_go_code_in_the_docs_is_code_that_compiles() -> None:
    # Given every Go block of the README and the docs
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [
        (doc.name, block)
        for doc in docs
        for block in re.findall(r"^```go\n(.*?)^```$", doc.read_text(encoding="utf-8"), re.S | re.M)
    ]
    assert blocks, "no Go code in the docs"

    # Then each is quoted as it is from a file of the Go example, which make test builds
    sources = [path.read_text(encoding="utf-8") for path in MODULE.glob("*.go")]
    for doc, block in blocks:
        assert any(block in source for source in sources), f"{doc}: a Go block not in examples/go"
        assert "examples/go/gen/consumerproxy/v1" in block or "import" not in block
