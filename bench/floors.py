"""The floors: bare Python loops that do with Kafka what the proxy does, and nothing else.

Each runs in a process of its own (``python -m bench.floors KIND ...``, :class:`FloorProcess`)
with confluent-kafka's ``Consumer`` and a synchronous gRPC channel, against the same handler
service as the proxy it is compared with:

- ``latency``: consumes a topic and makes the proxy's call (``HandleMessage`` for each record,
  all of a poll's records in flight together; or one ``HandleMessageBatch`` of a poll's
  records) as soon as a record is there: the first record with a blocking wait, then whatever
  librdkafka already holds. No tracking, no commit of its own (auto commit, in the
  background). What a proxy adds to produce -> handler latency is measured against it.
- ``throughput``: consumes (a fresh group, from the start; ``--client``: the librdkafka
  settings of the proxy it is compared with), pushes batches of up to
  ``max_messages`` with ``concurrency`` calls in flight, and commits the positions of the
  calls answered so far every ``commit_interval_ms`` and at the end. No windows, no per-message
  state: calls are reaped oldest first, so what is committed was answered.
- :func:`consume_only_run`: reads the records and does nothing with them (what any Python
  consumer, a proxy included, can at most move on this machine).

Requests carry the fields the proxy sets (``consumer_proxy.wire``), built from each record as
it arrives: building them is part of what the proxy's cost is compared with.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from confluent_kafka import Consumer, TopicPartition

from bench.handlers import SERVICE
from bench.loops import in_child
from bench.measure import Child, rate
from bench.options import ROOT
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import unique_name

UNARY_METHOD = f"/{SERVICE}/HandleMessage"
BATCH_METHOD = f"/{SERVICE}/HandleMessageBatch"
PRIMARY = handler_pb2.DELIVERY_SOURCE_PRIMARY


def _fill(m: Any, record: Any, group: str) -> None:
    """A ``Message`` with the fields ``consumer_proxy.wire`` sets, from a consumed record."""
    m.topic = record.topic()
    m.partition = record.partition()
    m.offset = record.offset()
    key, value, headers = record.key(), record.value(), record.headers()
    if key is not None:
        m.key, m.has_key = key, True
    if value is not None:
        m.value, m.has_value = value, True
    if headers:
        m.headers.extend([handler_pb2.Header(key=k, value=v or b"") for k, v in headers])
    m.timestamp_ms = record.timestamp()[1]
    m.consumer_group = group
    m.attempt = 1
    m.source = PRIMARY


def batch_request(records: Sequence[Any], group: str) -> bytes:
    """The encoded ``HandleMessageBatchRequest`` of ``records``."""
    request = handler_pb2.HandleMessageBatchRequest()
    add = request.messages.add
    for record in records:
        _fill(add(), record, group)
    return request.SerializeToString()


def unary_request(record: Any, group: str) -> bytes:
    """The encoded ``HandleMessageRequest`` of one record."""
    request = handler_pb2.HandleMessageRequest()
    _fill(request.message, record, group)
    return request.SerializeToString()


class _Stop:
    """SIGTERM ends the loop after its current step."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGTERM, self._ask)

    def _ask(self, _signum: int, _frame: object) -> None:
        self.asked = True


def _consumer(
    bootstrap: str, group: str, topic: str, auto_commit: bool, client: dict[str, str] | None = None
) -> Consumer:
    """``client``: librdkafka settings (the proxy's, for the same fetch path); the floor's own
    group, start and commit settings win."""
    consumer = Consumer(
        {
            **(client or {}),
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": auto_commit,
        }
    )
    consumer.subscribe([topic])
    return consumer


def _records(consumer: Consumer, max_messages: int, timeout_s: float) -> list[Any]:
    """The first record with a wait of up to ``timeout_s``, then what is already there (as the
    proxy's fetcher does: librdkafka's consume(n, t) would wait for n records or all of t)."""
    records: list[Any] = consumer.consume(1, timeout_s)
    if records and max_messages > 1:
        records += consumer.consume(max_messages - 1, 0)
    return [r for r in records if r.error() is None]


def latency_floor(args: argparse.Namespace) -> int:
    """Push every record as soon as it is consumed, one poll's records at a time.
    ``--stages OUT``: each record's latency when consumed, as JSON ``{"consumed": [[offset,
    ms], ...]}`` when it stops (``bench.profiling.staged_proxy_main``'s counterpart)."""
    stop = _Stop()
    consumer = _consumer(args.bootstrap, args.group, args.topic, auto_commit=True)
    consumed: list[tuple[int, float]] = []

    def take() -> list[Any]:
        records = _records(consumer, args.max_messages, 0.1)
        if args.stages:
            now_ms = time.time() * 1000.0
            consumed.extend((r.offset(), now_ms - r.timestamp()[1]) for r in records)
        return records

    with grpc.insecure_channel(args.address) as channel:
        if args.mode == "batch":
            call = channel.unary_unary(BATCH_METHOD)
            while not stop.asked:
                records = take()
                if records:
                    call(batch_request(records, args.group), timeout=30)
        else:
            call = channel.unary_unary(UNARY_METHOD)
            while not stop.asked:
                records = take()
                calls = [call.future(unary_request(r, args.group), timeout=30) for r in records]
                for answer in calls:
                    answer.result()
    consumer.close()
    if args.stages:
        Path(args.stages).write_text(json.dumps({"consumed": consumed}))
    return 0


def throughput_floor(args: argparse.Namespace) -> int:
    """Consume ``n`` records, push them in batches, commit what was answered."""
    stop = _Stop()
    client = dict(pair.split("=", 1) for pair in args.client)
    consumer = _consumer(args.bootstrap, args.group, args.topic, auto_commit=False, client=client)
    in_flight: collections.deque[tuple[Any, dict[tuple[str, int], int]]] = collections.deque()
    answered: dict[tuple[str, int], int] = {}
    interval_s = args.commit_interval_ms / 1000.0
    next_commit = time.monotonic() + interval_s
    seen = 0

    def reap() -> None:
        future, positions = in_flight.popleft()
        future.result()
        answered.update(positions)  # oldest first: a later call's positions are higher

    def commit(last: bool) -> None:
        if answered:
            offsets = [TopicPartition(t, p, o) for (t, p), o in answered.items()]
            if last:
                consumer.commit(offsets=offsets, asynchronous=False)
            else:
                consumer.commit(offsets=offsets, asynchronous=True)

    with grpc.insecure_channel(args.address) as channel:
        call = channel.unary_unary(BATCH_METHOD)
        while seen < args.n and not stop.asked:
            records = _records(consumer, args.max_messages, 0.1)
            if records:
                seen += len(records)
                positions = {(r.topic(), r.partition()): r.offset() + 1 for r in records}
                future = call.future(batch_request(records, args.group), timeout=30)
                in_flight.append((future, positions))
            while len(in_flight) >= args.concurrency or (in_flight and in_flight[0][0].done()):
                reap()
            if time.monotonic() >= next_commit:
                next_commit = time.monotonic() + interval_s
                commit(last=False)
        while in_flight:
            reap()
    commit(last=True)
    while not stop.asked:  # stay in the group until told (the bench reads the commits)
        time.sleep(0.05)
    consumer.close()
    return 0


class FloorProcess(Child):
    """``python -m bench.floors KIND ARGS`` as a child process, with the surface of
    ``bench.proxy.BenchProxy`` that the drain and latency runs use."""

    def __init__(self, kind: str, *args: str) -> None:
        self._args = [sys.executable, "-m", "bench.floors", kind, *args]
        self._log = tempfile.NamedTemporaryFile(prefix="cp-bench-floor-", suffix=".log")  # noqa: SIM115
        self.started_at = 0.0

    def start(self) -> FloorProcess:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self._args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        return self

    def log_tail(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-3000:]

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the floor exited with {self.proc.returncode}:\n{self.log_tail()}")

    def __enter__(self) -> FloorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate()
        finally:
            self._log.close()


def _consume_only_main(bootstrap: str, topic: str, n: int, out: Connection) -> None:
    consumer = _consumer(bootstrap, unique_name("bench-consume-only"), topic, auto_commit=False)
    seen, started = 0, 0.0
    cpu0 = time.process_time()
    while seen < n:
        messages = consumer.consume(1000, 1.0)
        if messages and not started:
            started, cpu0 = time.monotonic(), time.process_time()
        seen += sum(1 for m in messages if m.error() is None and m.value() is not None)
    ended = time.monotonic()
    cpu = time.process_time() - cpu0
    consumer.close()
    out.send({"rate": rate(n, ended - started), "cpu_us_per_msg": 1e6 * cpu / n})


def consume_only_run(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    """Read ``n`` records of ``topic`` with a fresh group and do nothing with them; returns
    ``rate`` (first record -> n-th) and ``cpu_us_per_msg``."""
    return in_child(_consume_only_main, (bootstrap, topic, n), "the consume-only loop")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="a floor loop (see bench/floors.py)")
    parser.add_argument("kind", choices=["latency", "throughput"])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--address", required=True, help="the handler service")
    parser.add_argument("--mode", choices=["unary", "batch"], default="batch")
    parser.add_argument("--max-messages", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4, help="throughput: calls in flight")
    parser.add_argument("--commit-interval-ms", type=int, default=100)
    parser.add_argument("-n", type=int, default=0, help="throughput: records to consume")
    parser.add_argument("--stages", help="latency: write when each record was consumed here")
    parser.add_argument(
        "--client",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="throughput: librdkafka settings of the consumer (the proxy's: bench_throughput)",
    )
    args = parser.parse_args(argv)
    return latency_floor(args) if args.kind == "latency" else throughput_floor(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
