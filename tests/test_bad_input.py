"""Bad input: odd records, transactional and compacted topics, and a handler answering garbage.

Each test runs the proxy against the real broker and proves with the ledger
(tests/support/ledger.py) that every message was acked or dead-lettered, none lost.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from confluent_kafka import Producer
from grpc import aio

from consumer_proxy.core import records as dlq_records
from consumer_proxy.core.tracker import PartitionTracker
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    unique_name,
)
from tests.support.ledger import ID_HEADER, Ledger
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

MIB = 1024 * 1024
BIG_TOPIC = {"max.message.bytes": str(4 * MIB)}
BIG_CLIENT = {"message.max.bytes": 4 * MIB}  # producers refuse > 1,000,000 bytes by default


def _acks(service: TestService) -> int:
    return sum(1 for d in service.deliveries if d.outcome == "ACK")


# --------------------------------------------------------------------------- odd records


def _odd_shapes(rng: random.Random) -> list[dict[str, Any]]:
    """One record of each awkward shape (without the ledger id)."""
    binary = bytes(range(256))
    return [
        {"key": b"k-empty-value", "value": b""},
        {"value": b"no key"},  # a null key
        {"key": b"tombstone"},  # a null value
        {},  # null key and null value
        {"key": b"", "value": b""},
        {"key": b"one-mib", "value": rng.randbytes(MIB)},
        {"key": binary, "value": binary[::-1]},
        {
            "key": b"odd-headers",
            "value": b"v",
            "headers": [
                ("non-utf8", b"\xff\xfe\x00\x80"),
                ("empty", b""),
                ("null", None),
                ("kl\u00fc\u0447", "\u2603".encode()),
                ("binary", binary),
            ],
        },
        {
            "key": b"many-headers",
            "value": b"v",
            # 200 headers, repeated names, order matters
            "headers": [(f"h{i % 7}", i.to_bytes(2, "big")) for i in range(200)],
        },
    ]


def _expected_headers(record: dict[str, Any]) -> tuple[tuple[str, bytes], ...]:
    # The contract's Header.value is bytes: a null header value arrives as b"".
    return tuple((k, v if v is not None else b"") for k, v in record.get("headers", ()))


async def test_odd_records_arrive_byte_exact_and_dead_letter_intact(kafka: Broker) -> None:
    await _odd_records(kafka.bootstrap)


async def _odd_records(bootstrap: str) -> None:
    # Given every awkward shape twice over 2 partitions: once for the handler to ack and once
    # marked "poison" for it to dead-letter (the topics and clients allow 4 MiB records)
    topic, group = unique_name("odd"), unique_name("odd")
    create_topic(bootstrap, topic, partitions=2, config=BIG_TOPIC)
    dlq_topic = create_topic(bootstrap, f"{group}.dlq", partitions=1, config=BIG_TOPIC)
    rng = random.Random(8)
    ledger = Ledger("odd records (empty/null/1 MiB/binary/200 headers)")
    shapes = _odd_shapes(rng)
    records, by_id, poison = [], {}, set()
    for verdict in ("ack", "poison"):
        for i, shape in enumerate(shapes):
            record = dict(shape, partition=i % 2)
            record["headers"] = [*shape.get("headers", ()), ("verdict", verdict.encode())]
            tagged = ledger.tag(record)
            ident = Ledger.id_of(tagged["headers"])
            by_id[ident] = tagged
            if verdict == "poison":
                poison.add(ident)
            records.append(tagged)
    await asyncio.to_thread(produce, bootstrap, topic, records, BIG_CLIENT)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if (h := dict((x.key, x.value) for x in msg.headers)).get("verdict") == b"poison":
            assert h[ID_HEADER]
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="\u2603 rejected")
        return Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(bootstrap, group, [topic], [service.address])
        config = config.model_copy(
            update={"kafka": config.kafka.model_copy(update={"client": BIG_CLIENT})}
        )
        proxy, task = start_proxy(config)
        # When the proxy delivers them all
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        await proxy.shutdown()
        await task
    assert not service.errors
    # Then each acked record reached the handler byte for byte
    for delivery in service.deliveries:
        ident = Ledger.id_of(delivery.headers)
        sent = by_id[ident]
        assert delivery.key == sent.get("key"), ident
        assert delivery.value == sent.get("value"), ident
        assert delivery.headers == _expected_headers(sent), ident
    # and each poison pill is in the DLQ with its key, value and headers intact
    dead = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    for message in dead:
        user, ours = dlq_records.split_headers(message.headers())
        sent = by_id[Ledger.id_of(user)]
        assert message.key() == sent.get("key")
        assert message.value() == sent.get("value")
        assert tuple(user) == _expected_headers(sent)
        assert ours[dlq_records.H_REASON] == "\u2603 rejected"
    ledger.observe(service.deliveries)
    ledger.observe_dlq(dead)
    assert ledger.dead_lettered() == poison
    ledger.check(max_duplicates=0, bound="no faults: none")


# --------------------------------------------------------------------------- transactions


def _transaction(
    producer: Producer, topic: str, records: list[dict[str, Any]], commit: bool
) -> None:
    producer.begin_transaction()
    for record in records:
        producer.produce(topic, **record)
    # Flushed before an abort too, so that the aborted records are really in the log.
    assert producer.flush(30) == 0
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)


def test_the_tracker_skips_unfetchable_offsets_but_never_a_pending_one() -> None:
    # Given offsets 10..12 tracked, 11 still pending, and the consumer's position at 15
    tracker = PartitionTracker(10, 100)
    for offset in (10, 11, 12):
        assert tracker.track(offset)
    tracker.done(10)
    tracker.done(12)
    tracker.skip_to(15)  # 13 and 14 were markers
    # Then the pending offset still holds the commit, and nothing moves backwards
    assert tracker.committable() == 11
    tracker.skip_to(5)
    tracker.done(11)
    assert tracker.committable() == 15
    # and a skipped offset is not taken again should it show up
    assert not tracker.track(14)
    assert tracker.track(15)


async def test_read_committed_skips_aborted_transactions_and_commits_past_the_markers(
    kafka: Broker,
) -> None:
    await _transactions(kafka.bootstrap)


async def _transactions(bootstrap: str) -> None:
    # Given committed, aborted and committed transactions on 2 partitions, then one still open
    topic, group = unique_name("txn"), unique_name("txn")
    partitions = 2
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger("transactions: committed / aborted / open")
    aborted = Ledger("aborted (never to be delivered)")
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": unique_name("tx")})
    await asyncio.to_thread(producer.init_transactions, 30)
    for batch, commit in ((ledger, True), (aborted, False), (ledger, True), (aborted, False)):
        records = batch.records(40, partitions=partitions)
        await asyncio.to_thread(_transaction, producer, topic, records, commit)
    open_records = ledger.records(20, partitions=partitions)
    await asyncio.to_thread(producer.begin_transaction)
    for record in open_records:
        producer.produce(topic, **record)
    assert await asyncio.to_thread(producer.flush, 30) == 0
    open_ids = {Ledger.id_of(r["headers"]) for r in open_records}

    async with TestService() as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        # When the proxy consumes the committed part
        await async_wait_until(lambda: _acks(service) >= 80, timeout=60)
        stable = await asyncio.to_thread(end_offsets, bootstrap, topic, committed_only=True)

        async def at_stable() -> bool:
            found = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
            return {p: c[0] for p, c in found.items()} == stable

        # Then the commit moves past the markers up to the last stable offset
        await async_wait_until(at_stable, timeout=30)
        delivered = {Ledger.id_of(d.headers) for d in service.deliveries}
        assert not delivered & open_ids, "an open transaction's records were delivered"
        # When the open transaction commits
        await asyncio.to_thread(producer.commit_transaction, 30)
        # Then its records follow and the commit reaches the end of the log
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
    delivered = {Ledger.id_of(d.headers) for d in service.deliveries}
    assert not delivered & set(aborted.ids), "an aborted transaction's records were delivered"
    ledger.observe(service.deliveries)
    ledger.note(f"{len(aborted.ids)} aborted records, none delivered")
    ledger.check(max_duplicates=0, bound="no faults: none")


# --------------------------------------------------------------------------- compaction


async def test_a_compacted_topic_with_gaps_is_delivered_and_committed_to_the_end(
    kafka: Broker,
) -> None:
    await _compacted(kafka.bootstrap)


async def _compacted(bootstrap: str) -> None:
    # Given a compacted topic where 20 keys were written 8 times each (some ending in a
    # tombstone) between keys written once, and the log cleaner has removed the older values:
    # the offsets have gaps
    topic, group = unique_name("compact"), unique_name("compact")
    create_topic(
        bootstrap,
        topic,
        partitions=1,
        config={
            "cleanup.policy": "compact",
            "segment.ms": "100",
            "min.cleanable.dirty.ratio": "0.001",
            "min.compaction.lag.ms": "0",
            "delete.retention.ms": "86400000",
        },
    )
    written = Ledger("written (compaction removes most)")
    # Record timestamps one second apart per round: segment.ms rolls on record time, so every
    # round starts a new segment and the older ones become cleanable.
    first_ms = int(time.time() * 1000) - 60_000
    for round_ in range(8):
        # 20 keys rewritten every round, 10 written once: compaction leaves holes between these
        records = written.records(
            30, key=lambda i, _id, r=round_: (f"key-{i}" if i < 20 else f"once-{r}-{i}").encode()
        )
        for record in records:
            record["timestamp"] = first_ms + 1000 * round_
        if round_ == 7:
            for i in range(0, 20, 5):
                records[i].pop("value")  # the last word on every 5th key: a tombstone
        await asyncio.to_thread(produce, bootstrap, topic, records)

    def survivors() -> list[Any]:
        found = consume_all(bootstrap, topic)
        return found if len(found) < len(written.ids) else []

    kept = await asyncio.to_thread(
        wait_until, survivors, 60, 0.5, "the log cleaner to compact the topic"
    )
    ledger = Ledger("compacted topic with gaps")
    ids = [Ledger.id_of(m.headers()) for m in kept]
    assert None not in ids, "a surviving record without its ledger id"
    ledger.ids = [i for i in ids if i is not None]
    offsets = [m.offset() for m in kept]
    assert offsets[-1] - offsets[0] + 1 > len(offsets)  # there are gaps

    async with TestService() as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        # When the proxy consumes it
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task
    # Then exactly the surviving records were delivered, tombstones with a null value
    assert sorted(d.offset for d in service.deliveries) == offsets
    assert sum(1 for d in service.deliveries if d.value is None) == 4
    ledger.observe(service.deliveries)
    ledger.note(f"{len(written.ids)} written, {len(kept)} kept by compaction")
    ledger.check(max_duplicates=0, bound="no faults: none")


# --------------------------------------------------------------------------- garbage answers

GARBAGE_MODES = (
    "undecodable-response",  # OK with bytes that are not a HandleMessageResponse
    "unknown-status-code",  # a numeric status gRPC does not define (the client sees UNKNOWN)
    "huge-trailers",  # 1 MB of trailing metadata
    "huge-initial-metadata",
    "huge-details",  # a 200 kB status message
    "unknown-action",  # an action this proxy does not know
    "unknown-fields",  # a valid response with fields from the future (acked at once)
    "raise",  # the handler raises: UNKNOWN
    "hang",  # never answers: the deadline
    "huge-retry-after",  # RETRY after 2**62 ms: capped by backoff.max_ms
    "negative-retry-after",
    "huge-reason-dead-letter",  # DEAD_LETTER with a 100 kB reason: clipped to 1 KiB
)
GARBAGE_ATTEMPTS = 2  # each message gets garbage this many times, then an ack


class _UndefinedCode:
    """Quacks like grpc.StatusCode for a code number gRPC does not define."""

    value = (42, "undefined")
    name = "UNDEFINED_42"


@dataclass(frozen=True)
class _Seen:
    headers: tuple[tuple[str, bytes], ...]
    outcome: str


class GarbageService:
    """A MessageHandler that answers each message's first attempts with its garbage mode."""

    def __init__(self) -> None:
        self.seen: list[_Seen] = []
        self.attempts: dict[tuple[str, int, int], int] = {}
        self.server: Any = None
        self.port = 0

    async def start(self) -> GarbageService:
        self.server = aio.server()
        handler = grpc.method_handlers_generic_handler(
            "consumerproxy.v1.MessageHandler",
            {"HandleMessage": grpc.unary_unary_rpc_method_handler(self._handle)},
        )
        self.server.add_generic_rpc_handlers([handler])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(None)

    async def _handle(self, data: bytes, context: Any) -> bytes:
        msg = handler_pb2.HandleMessageRequest.FromString(data).message
        headers = tuple((h.key, h.value) for h in msg.headers)
        key = (msg.topic, msg.partition, msg.offset)
        n = self.attempts[key] = self.attempts.get(key, 0) + 1
        mode = dict(headers)["garbage"].decode()
        response = handler_pb2.HandleMessageResponse
        if mode == "huge-reason-dead-letter":
            self.seen.append(_Seen(headers, "DEAD_LETTER"))
            return response(action=response.DEAD_LETTER, reason="r" * 100_000).SerializeToString()
        if n > GARBAGE_ATTEMPTS or mode == "unknown-fields":
            self.seen.append(_Seen(headers, "ACK"))
            # An unknown field (number 111, bytes): proto3 parsers must skip it.
            return response().SerializeToString() + b"\xfa\x06\x03new"
        self.seen.append(_Seen(headers, mode))
        if mode == "undecodable-response":
            return b"\xff\xff\xff\xff"
        if mode == "unknown-status-code":
            context.set_code(_UndefinedCode())
            context.set_details("a status from the future")
            return b""
        if mode == "huge-trailers":
            context.set_trailing_metadata([("x-big", "t" * 1_000_000)])
            return b""
        if mode == "huge-initial-metadata":
            await context.send_initial_metadata([("x-big", "i" * 1_000_000)])
            return b""
        if mode == "huge-details":
            await context.abort(grpc.StatusCode.INTERNAL, "d" * 200_000)
        if mode == "unknown-action":
            return response(action=99).SerializeToString()  # type: ignore[arg-type]
        if mode == "raise":
            raise RuntimeError("the handler blew up")
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "huge-retry-after":
            return response(action=response.RETRY, retry_after_ms=2**62).SerializeToString()
        if mode == "negative-retry-after":
            return response(action=response.RETRY, retry_after_ms=-5).SerializeToString()
        raise AssertionError(f"unknown mode {mode}")


async def _junk_endpoint() -> asyncio.Server:
    """A TCP port that answers anything with non-HTTP/2 bytes and hangs up."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(64)
        writer.write(b"HTTP/1.0 418 garbage\r\n\r\n\x00\xff")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_handler_answering_garbage_does_not_stop_the_proxy_or_lose_anything(
    kafka: Broker,
) -> None:
    await _garbage(kafka.bootstrap)


async def _garbage(bootstrap: str) -> None:
    # Given 8 messages per garbage mode, a service answering each one's first 2 attempts with
    # its garbage, and a second endpoint that is not gRPC at all
    topic, group = unique_name("garbage"), unique_name("garbage")
    create_topic(bootstrap, topic, partitions=2)
    ledger = Ledger("handler answering garbage")
    records = []
    for mode in GARBAGE_MODES:
        records += ledger.records(8, partitions=2, headers=[("garbage", mode.encode())])
    random.Random(3).shuffle(records)
    await asyncio.to_thread(produce, bootstrap, topic, records)
    dead_modes = {"huge-reason-dead-letter"}
    service = await GarbageService().start()
    junk = await _junk_endpoint()
    junk_address = f"127.0.0.1:{junk.sockets[0].getsockname()[1]}"
    try:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [f"127.0.0.1:{service.port}", junk_address],
            service={"timeout_ms": 1000},
            delivery={"backoff": {"initial_ms": 20, "max_ms": 300}},
        )
        proxy, task = start_proxy(config)

        # When the proxy works through them
        async def finished() -> bool:
            return task.done() or await caught_up(bootstrap, group, topic)

        await async_wait_until(finished, timeout=120)
        # Then it is still running, and every message was acked or dead-lettered
        assert not task.done(), task
        await proxy.shutdown()
        await task
    finally:
        await service.stop()
        junk.close()
        await junk.wait_closed()
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    for message in dead:
        _, ours = dlq_records.split_headers(message.headers())
        assert len(ours[dlq_records.H_REASON].encode()) <= 1024
    ledger.observe(service.seen)
    ledger.observe_dlq(dead)
    expected_dead = {
        Ledger.id_of(r["headers"])
        for r in records
        if dict(r["headers"])["garbage"].decode() in dead_modes
    }
    assert ledger.dead_lettered() == expected_dead
    ledger.note(f"{len(GARBAGE_MODES)} kinds of garbage x {GARBAGE_ATTEMPTS} attempts + junk")
    ledger.check(max_duplicates=0, bound="no faults: none")
