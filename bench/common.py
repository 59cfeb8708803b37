"""Shared harness of the benchmarks: broker, handler service, load, proxy processes, results.

Every process that matters runs on its own, so no two of them share an event loop or a GIL:

- the handler service (:class:`HandlerServer`): a bare grpc.aio ``MessageHandler`` in a
  process of its own (multiprocessing, spawn), with a configurable latency and a "slow"
  marker; it records when each distinct message first arrived and, on request, each fast
  message's latency since its Kafka timestamp;
  ``HandlerServer(spec, impl="go")`` runs the same books in Go (:class:`GoHandlerProcess`,
  ``bench/gohandler``): a few microseconds of CPU per call instead of ~150, so on a two-core
  machine a bench measures the proxy rather than its service;
- the bare client (:func:`run_bare_loop`): a grpc.aio loop in a process of its own;
- the proxy (:class:`BenchProxy`, the tests' ``ProxyProcess``): the real ``consumer-proxy run
  --config F`` command line;
- the bench process itself only produces, polls the handler's counters and reads offsets.

Conventions for every ``bench/bench_*.py`` (``run_all.py`` relies on them): ``--bootstrap``
uses a running broker (otherwise the bench starts its own and stops it), ``--quick`` runs
smaller sizes, and the result is written as JSON to ``bench/results/<bench>-<time>.json``
with a ``ratios`` mapping ``{name: {"value", "target", "meets"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from grpc import aio

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.kafka import (
    create_topic,
    partitions_of,
    start_broker,
    stop_broker,
    unique_name,
)
from tests.support.proxy import ProxyProcess, config_dict

ROOT = Path(__file__).resolve().parents[1]

RESULTS_DIR = ROOT / "bench" / "results"
SLOW_MARKER = b"slow"
_SPAWN = multiprocessing.get_context("spawn")

__all__ = [
    "RESULTS_DIR",
    "ROOT",
    "SLOW_MARKER",
    "BenchProxy",
    "CommittedReader",
    "GoHandlerProcess",
    "HandlerServer",
    "HandlerSpec",
    "Result",
    "base_parser",
    "bench_config",
    "broker",
    "committed_sum",
    "cpu_seconds",
    "create_topic",
    "group_members",
    "mean",
    "percentile",
    "produce_at_rate",
    "produce_bulk",
    "proxy_backlog_run",
    "rate",
    "run_bare_loop",
    "steady_rate",
    "summarise_cprofile",
    "unique_name",
    "wait_for",
]


# --------------------------------------------------------------------------- arguments, broker


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every bench takes: ``--bootstrap``, ``--quick``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="use this running broker (default: start a private one in a temp dir and stop it)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    return parser


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """Yield a bootstrap address: the given one, or a private broker started for the bench."""
    if bootstrap:
        yield bootstrap
        return
    with tempfile.TemporaryDirectory(prefix="cp-bench-kafka-") as tmp:
        print("starting a private Kafka broker ...", flush=True)
        started = time.monotonic()
        found = start_broker(Path(tmp), watch_pid=os.getpid())
        print(f"broker at {found.bootstrap} ({time.monotonic() - started:.1f}s)", flush=True)
        try:
            yield found.bootstrap
        finally:
            stop_broker(Path(tmp))


# --------------------------------------------------------------------------- handler service


@dataclass(frozen=True)
class HandlerSpec:
    """What the handler service does with each call.

    Every call sleeps ``delay_ms`` (none when 0: a no-op handler answers straight away), or
    ``slow_ms`` when the message value starts with :data:`SLOW_MARKER`. The answer is always
    the empty response (ACK).
    """

    delay_ms: float = 0.0
    slow_ms: float = 0.0


class _Recorder:
    """The handler process's books: first arrival of each distinct message, and latencies."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.deliveries = 0  # messages received, a batch counting each of its messages
        self.seen: set[tuple[str, int, int]] = set()
        self.first_seen: list[float] = []  # time.monotonic() of each distinct message's arrival
        # time.time() at arrival minus the record's Kafka timestamp, first deliveries only
        self.latency_fast_ms: list[float] = []
        self.latency_slow_ms: list[float] = []
        self.partitions: dict[int, int] = {}


class _Servicer(handler_pb2_grpc.MessageHandlerServicer):
    def __init__(self, spec: HandlerSpec, books: _Recorder) -> None:
        self._delay_s = spec.delay_ms / 1000.0
        self._slow_s = spec.slow_ms / 1000.0
        self._books = books
        self._empty = handler_pb2.HandleMessageResponse()

    async def HandleMessage(
        self, request: handler_pb2.HandleMessageRequest, context: Any
    ) -> handler_pb2.HandleMessageResponse:
        msg = request.message
        books = self._books
        books.calls += 1
        books.deliveries += 1
        key = (msg.topic, msg.partition, msg.offset)
        slow = msg.value.startswith(SLOW_MARKER)
        if key not in books.seen:
            books.seen.add(key)
            books.first_seen.append(time.monotonic())
            books.partitions[msg.partition] = books.partitions.get(msg.partition, 0) + 1
            if msg.timestamp_ms > 0:
                latency = time.time() * 1000.0 - msg.timestamp_ms
                (books.latency_slow_ms if slow else books.latency_fast_ms).append(latency)
        delay = self._slow_s if slow else self._delay_s
        if delay > 0:
            await asyncio.sleep(delay)
        return self._empty

    async def HandleMessageStream(
        self, request: handler_pb2.HandleMessageStreamRequest, context: Any
    ) -> AsyncIterator[handler_pb2.HandleMessageStreamEvent]:
        """The long-running call: heartbeats every ``heartbeat_interval_ms`` while it works
        as HandleMessage does, then the result."""
        work = asyncio.ensure_future(self.HandleMessage(request, context))  # type: ignore[arg-type]
        interval_s = (request.heartbeat_interval_ms or 1000) / 1000.0
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=interval_s)
                if done:
                    break
                yield handler_pb2.HandleMessageStreamEvent(heartbeat=handler_pb2.Heartbeat())
        finally:
            work.cancel()
        yield handler_pb2.HandleMessageStreamEvent(result=work.result())

    async def HandleMessageBatch(
        self, request: handler_pb2.HandleMessageBatchRequest, context: Any
    ) -> handler_pb2.HandleMessageBatchResponse:
        """Records every message like a unary call and works on them concurrently: the call
        takes one ``delay_ms`` (the longest of its messages' delays) and acks them all."""
        books = self._books
        books.calls += 1
        books.deliveries += len(request.messages)
        delay = 0.0
        for msg in request.messages:
            key = (msg.topic, msg.partition, msg.offset)
            if key not in books.seen:
                books.seen.add(key)
                books.first_seen.append(time.monotonic())
                books.partitions[msg.partition] = books.partitions.get(msg.partition, 0) + 1
            delay = max(delay, self._slow_s if msg.value.startswith(SLOW_MARKER) else self._delay_s)
        if delay > 0:
            await asyncio.sleep(delay)
        return handler_pb2.HandleMessageBatchResponse(
            results=[self._empty for _ in request.messages]
        )


def _handler_main(spec: HandlerSpec, conn: Connection) -> None:
    """Entry point of the handler process: serve until told to stop on ``conn``."""
    asyncio.run(_serve(spec, conn))


async def _serve(spec: HandlerSpec, conn: Connection) -> None:
    books = _Recorder()
    server = aio.server(options=[("grpc.so_reuseport", 0)])
    handler_pb2_grpc.add_MessageHandlerServicer_to_server(_Servicer(spec, books), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    loop = asyncio.get_running_loop()
    try:
        while True:
            # The pipe is read off the loop; commands are answered on it (no locking needed).
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            if command == "reset":
                books.reset()
                conn.send(True)
            elif command == "progress":
                first = books.first_seen[0] if books.first_seen else None
                last = books.first_seen[-1] if books.first_seen else None
                conn.send((len(books.seen), books.calls, first, last, time.process_time()))
            elif command == "stats":
                conn.send(
                    {
                        "calls": books.calls,
                        "deliveries": books.deliveries,
                        "distinct": len(books.seen),
                        "first_seen": books.first_seen,
                        "latency_fast_ms": books.latency_fast_ms,
                        "latency_slow_ms": books.latency_slow_ms,
                        "partitions": books.partitions,
                    }
                )
    finally:
        await server.stop(grace=1.0)
        conn.send("stopped")


GO_HANDLER_DIR = ROOT / "bench" / "gohandler"
_GO_SOURCES = (GO_HANDLER_DIR, ROOT / "examples" / "go" / "gen")


def _find_go() -> str:
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        "the Go bench handler needs the go command (set GO or put go on PATH), "
        "or run the bench with --handler python"
    )


def go_handler_binary() -> Path:
    """The Go bench handler, built into the user's cache when missing or older than its
    sources (grpc-go comes from the Go module proxy the first time)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    binary = cache / "consumer-proxy" / "bench-gohandler"
    newest = max(f.stat().st_mtime for d in _GO_SOURCES for f in d.rglob("*") if f.is_file())
    if binary.exists() and binary.stat().st_mtime >= newest:
        return binary
    print("building the Go bench handler ...", flush=True)
    binary.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [_find_go(), "build", "-o", str(binary), "."],
        cwd=GO_HANDLER_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building bench/gohandler failed:\n{proc.stdout}{proc.stderr}")
    return binary


class GoHandlerProcess:
    """``bench/gohandler`` as a child process: ``ask(command)`` answers a JSON value."""

    def __init__(self, delay_ms: float = 0.0, slow_ms: float = 0.0, latency: bool = False):
        args = [str(go_handler_binary()), f"-delay-ms={delay_ms}", f"-slow-ms={slow_ms}"]
        if latency:
            args.append("-latency")
        self._proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self._out, self._in = self._proc.stdout, self._proc.stdin
        line = self._out.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the Go bench handler did not start: {line!r}")
        self.port = int(line)
        self._lock = threading.Lock()

    def ask(self, command: str) -> Any:
        with self._lock:
            self._in.write(command + "\n")
            self._in.flush()
            return json.loads(self._out.readline())

    def close(self) -> None:
        """Stop the server and the process (idempotent)."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._in.write("stop\n")
                self._in.flush()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


class HandlerServer:
    """The handler service in its own process; ``with HandlerServer(spec) as h: h.address``.

    ``impl="go"`` runs ``bench/gohandler`` instead of the grpc.aio servicer above: the same
    answers and the same books.
    """

    def __init__(self, spec: HandlerSpec, impl: str = "python") -> None:
        self.spec = spec
        self.impl = impl
        self._go: GoHandlerProcess | None = None
        self._conn, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(
            target=_handler_main, args=(spec, child), name="bench-handler", daemon=True
        )
        self._lock = threading.Lock()
        self.port = 0

    def __enter__(self) -> HandlerServer:
        if self.impl == "go":
            self._go = GoHandlerProcess(self.spec.delay_ms, self.spec.slow_ms)
            self.port = self._go.port
            return self
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the handler service did not start within 60s")
        self.port = self._conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ask(self, command: str) -> Any:
        if self._go is not None:
            return self._from_go(command, self._go.ask(command))
        with self._lock:
            self._conn.send(command)
            return self._conn.recv()

    @staticmethod
    def _from_go(command: str, answer: Any) -> Any:
        """The Go handler's answer in the Python handler's shapes."""
        if command == "progress":
            return (
                answer["distinct"],
                answer["calls"],
                answer["first_seen_first"],
                answer["first_seen_last"],
                answer["cpu_s"],
            )
        if command == "stats":
            answer["partitions"] = {int(k): v for k, v in answer["partitions"].items()}
        return answer

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._ask("reset")

    def progress(self) -> tuple[int, int, float | None, float | None, float]:
        """(distinct messages seen, calls, monotonic time of the first and of the latest first
        arrival, the handler process's CPU seconds so far)."""
        result: tuple[int, int, float | None, float | None, float] = self._ask("progress")
        return result

    def stats(self) -> dict[str, Any]:
        """Everything recorded (lists of arrival times and latencies)."""
        result: dict[str, Any] = self._ask("stats")
        return result

    def wait_seen(self, n: int, timeout_s: float, interval_s: float = 0.1) -> float:
        """Wait until ``n`` distinct messages arrived; returns the monotonic time it happened
        (the arrival time of the n-th, as the handler recorded it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen, _calls, _first, last, _cpu = self.progress()
            if seen >= n and last is not None:
                return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"the handler saw {seen} of {n} messages in {timeout_s:g}s")
            time.sleep(interval_s)

    def close(self) -> None:
        """Stop the server and its process (idempotent)."""
        if self._go is not None:
            self._go.close()
        if self._proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._conn.send("stop")
                if self._conn.poll(10):
                    self._conn.recv()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)


# --------------------------------------------------------------------------- bare grpc.aio loop


def in_child(target: Callable[..., None], args: tuple[Any, ...], what: str) -> dict[str, float]:
    """Run ``target(*args, conn)`` in a process of its own and return what it sends on
    ``conn`` (a dict of figures); ``what`` names it in the timeout error."""
    parent, child = _SPAWN.Pipe()
    proc = _SPAWN.Process(target=target, args=(*args, child))
    proc.start()
    try:
        if not parent.poll(600):
            raise TimeoutError(f"{what} did not finish within 600s")
        result: dict[str, float] = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return result


def _bare_main(
    address: str, topic: str, n: int, concurrency: int, profile_out: str | None, out: Connection
) -> None:
    out.send(asyncio.run(_bare_loop(address, topic, n, concurrency, profile_out)))


async def _bare_loop(
    address: str, topic: str, n: int, concurrency: int, profile_out: str | None = None
) -> dict[str, float]:
    # Requests shaped like the proxy's (same fields, distinct offsets), built before timing:
    # the proxy's cost of building them is part of what the comparison measures.
    requests = [
        handler_pb2.HandleMessageRequest(
            message=handler_pb2.Message(
                topic=topic,
                partition=i % 4,
                offset=i,
                key=b"",
                value=b"x" * 16,
                has_value=True,
                timestamp_ms=0,
                consumer_group="bare",
                attempt=1,
                source=handler_pb2.DELIVERY_SOURCE_PRIMARY,
            )
        )
        for i in range(n)
    ]
    async with aio.insecure_channel(address) as channel:
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        await stub.HandleMessage(requests[0], timeout=10)  # connect outside the timing
        it = iter(requests[1:])
        errors = 0

        async def worker() -> None:
            nonlocal errors
            for request in it:  # a shared iterator: each request is sent once
                try:
                    await stub.HandleMessage(request, timeout=10)
                except aio.AioRpcError:
                    errors += 1

        profiler = None
        if profile_out is not None:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended, cpu = time.monotonic(), time.process_time() - cpu
        if profiler is not None and profile_out is not None:
            profiler.disable()
            profiler.dump_stats(profile_out)
    return {"started": started, "ended": ended, "errors": float(errors), "cpu_s": cpu}


def run_bare_loop(
    address: str, n: int, concurrency: int, topic: str = "bare", profile_out: Path | None = None
) -> dict[str, float]:
    """Call the handler ``n`` times with ``concurrency`` calls in flight, from a process of its
    own; returns its monotonic ``started`` / ``ended`` (first call to last answer) and
    ``cpu_s``. ``profile_out``: a cProfile dump of the timed part."""
    out = None if profile_out is None else str(profile_out)
    return in_child(_bare_main, (address, topic, n, concurrency, out), "the bare loop")


# --------------------------------------------------------------------------- producing


def produce_bulk(
    bootstrap: str,
    topic: str,
    n: int,
    *,
    partitions: int = 1,
    value: Callable[[int], bytes] = lambda i: b"m%015d" % i,
    key: Callable[[int], bytes] | None = None,
) -> None:
    """Produce ``n`` records round-robin over ``partitions`` (acks=all) and flush; ``key``
    gives record i's key (none by default)."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 20,
            "batch.num.messages": 10000,
            "queue.buffering.max.messages": 200000,
        }
    )
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for i in range(n):
        while True:
            try:
                producer.produce(
                    topic,
                    value(i),
                    key(i) if key is not None else None,
                    partition=i % partitions,
                    on_delivery=delivered,
                )
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"producing to {topic}: {left} left, failures {failures[:3]}")


def produce_at_rate(
    bootstrap: str,
    topic: str,
    rate_per_s: float,
    duration_s: float,
    *,
    value: Callable[[int], bytes] = lambda i: b"m%015d" % i,
) -> int:
    """Produce at a steady rate (open loop: ticks are not delayed by the consumer side) for
    ``duration_s`` to partition 0; returns how many were produced. linger.ms=0, so a record's
    timestamp is within a millisecond of when it was handed to the client."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 0})
    started = time.monotonic()
    i = 0
    while True:
        due = started + i / rate_per_s
        now = time.monotonic()
        if due - started >= duration_s:
            break
        if due > now:
            time.sleep(due - now)
        producer.produce(topic, value(i), partition=0)
        producer.poll(0)
        i += 1
    if producer.flush(60):
        raise RuntimeError(f"producing to {topic}: records left after 60s")
    return i


# --------------------------------------------------------------------------- CPU accounting

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of every thread) of a live process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants (all threads), from /proc.

    A load-independent cost figure: on a shared two-core machine throughput depends on what
    the neighbours do, CPU per message much less.
    """
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None:
                parents[int(entry.name)], cpu[int(entry.name)] = found
    wanted = {pid}
    grew = True
    while grew:
        more = {child for child, parent in parents.items() if parent in wanted} - wanted
        wanted |= more
        grew = bool(more)
    return sum(cpu.get(p, 0.0) for p in wanted)


# --------------------------------------------------------------------------- offsets


def committed_sum(bootstrap: str, group: str, topic: str) -> int:
    """Sum over the topic's partitions of the group's committed offsets (0 where none)."""
    with CommittedReader(bootstrap, group, topic) as reader:
        return reader.sum()


_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


class CommittedReader:
    """:func:`committed_sum` again and again on one client: one read is a round trip
    (~1 ms), where a new client per read (~0.1-0.2 s) made "every offset committed" late by
    up to that much, i.e. 2-3 % of a 7 s run."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        self._wanted = [TopicPartition(topic, p) for p in partitions_of(bootstrap, topic)]

    def sum(self) -> int:
        """The sum now; retried for up to 30 s while the group's coordinator is not known yet
        (a new group's first read may answer NOT_COORDINATOR)."""
        deadline = time.monotonic() + 30.0
        while True:
            try:
                found = self._consumer.committed(self._wanted, timeout=30)
                return sum(max(tp.offset, 0) for tp in found)
            except KafkaException as exc:
                err = exc.args[0]
                if time.monotonic() > deadline or not (
                    err.retriable() or err.code() in _COORDINATOR_NOT_READY
                ):
                    raise
                time.sleep(0.05)

    def __enter__(self) -> CommittedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._consumer.close()


def group_members(bootstrap: str, group: str) -> list[dict[str, list[int]]]:
    """The group's members as the broker sees them: {topic: [partitions]} each."""
    from confluent_kafka.admin import AdminClient

    client = AdminClient({"bootstrap.servers": bootstrap})
    description = client.describe_consumer_groups([group])[group].result(timeout=30)
    members = []
    for member in description.members:
        owned: dict[str, list[int]] = {}
        for tp in member.assignment.topic_partitions:
            owned.setdefault(tp.topic, []).append(tp.partition)
        members.append({t: sorted(ps) for t, ps in sorted(owned.items())})
    return members


def wait_for(
    condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.1, what: str = ""
) -> float:
    """Poll ``condition`` until true; returns the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what or condition}")
        time.sleep(interval_s)
    return time.monotonic()


# --------------------------------------------------------------------------- the proxy


def bench_config(
    bootstrap: str,
    group: str,
    topics: Sequence[str],
    endpoints: Sequence[str],
    delivery: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The tests' one-group configuration with the bench's settings: metrics off (no port to
    pick), a 30 s service deadline, the proxy's own delivery defaults unless ``delivery``."""
    return config_dict(
        bootstrap,
        group,
        topics,
        endpoints,
        delivery=delivery,
        service={"timeout_ms": 30000},
        shutdown_grace_s=10,
        fast_delivery=False,
    )


class BenchProxy(ProxyProcess):
    """The tests' :class:`ProxyProcess` for ``consumer-proxy run --config F --workers N`` with
    a configuration dict, in a temporary directory of its own.

    ``profile`` ("cprofile" or "pyinstrument", the latter when importable) runs the same
    command under :func:`_profiled_proxy_main` instead: the profiler covers the main thread
    (the event loop) from :meth:`profile_start` to :meth:`profile_stop`, which writes
    ``profile_out``, so start-up and shutdown stay out of the picture.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        workers: int = 1,
        log_path: Path | None = None,
        profile: str | None = None,
        profile_out: Path | None = None,
        env: dict[str, str] | None = None,
        log_level: str = "warning",
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="cp-bench-proxy-")
        config_path = Path(self._dir.name) / "proxy.yaml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.profile_out = profile_out
        command = None
        if profile is not None:
            assert profile_out is not None
            command = [sys.executable, "-m", "bench.common", "profile-proxy", profile]
            command.append(str(profile_out))
        super().__init__(
            config_path,
            log_path or Path(self._dir.name) / "proxy.log",
            *("--workers", str(workers), "--log-level", log_level),
            command=command,
            env=env or {},
            cwd=ROOT,
        )

    @property
    def log_path(self) -> Path:
        return self.log

    def cpu_seconds(self) -> float:
        """CPU seconds the proxy (and its worker processes) used so far."""
        return cpu_seconds(self.pid)

    def profile_start(self) -> None:
        """Start the profiler in a process started with ``profile``."""
        os.kill(self.pid, signal.SIGUSR1)

    def profile_stop(self, timeout_s: float = 60.0) -> Path:
        """Stop the profiler and wait until it wrote ``profile_out``."""
        assert self.profile_out is not None
        os.kill(self.pid, signal.SIGUSR2)
        done = Path(f"{self.profile_out}.done")
        wait_for(done.exists, timeout_s, what=f"{done} to appear")
        done.unlink()
        return self.profile_out

    def assignments(self) -> dict[int, list[str]]:
        """{pid: partitions ever assigned to it}, from the log (needs ``log_level="info"``)."""
        found: dict[int, set[str]] = {}
        # Any of the package's loggers: the line moved from proxy to core.partitions before.
        pattern = re.compile(r"\[(\d+)\] consumer_proxy\.[\w.]+: group \S+: assigned (\S+) ")
        for line in self._log_text().splitlines():
            match = pattern.search(line)
            if match:
                found.setdefault(int(match[1]), set()).add(match[2])
        return {pid: sorted(parts) for pid, parts in found.items()}

    def rebalance_events(self) -> int:
        """How many assigned / revoked / lost lines the log holds so far (log level info)."""
        return len(
            re.findall(
                r"consumer_proxy\.[\w.]+: group \S+: (?:assigned|revoked|lost) ",
                self._log_text(),
            )
        )

    def _log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.output()
        return ""

    def cleanup(self) -> None:
        self._dir.cleanup()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.cleanup()


def proxy_backlog_run(
    bootstrap: str,
    handler: HandlerServer,
    topic: str,
    n: int,
    delivery: dict[str, Any],
    *,
    workers: int = 1,
    profile: str | None = None,
    profile_out: Path | None = None,
    timeout_s: float = 300.0,
    log_level: str = "warning",
    produce_after_join: Callable[[], None] | None = None,
    group: str | None = None,
    sections: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``consumer-proxy run`` with a fresh group over a topic holding ``n`` messages.

    Returns: ``seen_rate`` (n-1 over first delivery -> the n-th distinct message's arrival, at
    the handler), ``steady_rate`` (10%..90% of the arrivals), ``committed_rate`` (n over first
    delivery -> every offset committed), ``startup_s`` (process start -> first delivery),
    ``duplicates`` (deliveries beyond the first per message) and CPU microseconds per message
    of the proxy (all its processes) and of the handler, from the first delivery to the n-th.
    With ``log_level="info"``, ``assignments``: {worker pid: partitions ever assigned}.

    ``produce_after_join``: the topic starts empty; the proxy starts, and once every one of
    its ``workers`` processes owns partitions, together they own all of ``topic``'s and no
    rebalance happened for 2 s (read from the log), ``produce_after_join()`` writes the n
    messages. ``settled_s`` is the time from start to that point and ``members`` the group's
    assignment then, as the broker describes it ({topic: [partitions]} per member).
    ``sections``: top-level config sections to add (``tracing``).
    """
    group = group or unique_name("bench")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    config.update(sections or {})
    handler.reset()
    if produce_after_join is not None:
        log_level = "info"  # the assignments are read from the log
    proxy = BenchProxy(
        config, workers=workers, profile=profile, profile_out=profile_out, log_level=log_level
    )
    cpu_first = handler_cpu_first = 0.0
    profiled_from = 0
    settled_s = 0.0
    members: list[dict[str, list[int]]] = []
    reader = CommittedReader(bootstrap, group, topic)
    try:
        reader.sum()  # the reader's connection and coordinator lookup, before the clock runs
        proxy.start()
        deadline = time.monotonic() + timeout_s
        if produce_after_join is not None:
            everything = {f"{topic}[{p}]" for p in partitions_of(bootstrap, topic)}
            last_change = [time.monotonic(), -1]

            def settled() -> bool:
                # Every worker holds partitions (of any of its topics: the redrive topic counts
                # too), together they hold all of ``topic``, and nothing moved for 2 s.
                proxy.check_alive()
                now, events = time.monotonic(), proxy.rebalance_events()
                if events != last_change[1]:
                    last_change[:] = [now, events]
                assigned = proxy.assignments()
                covered = set().union(*assigned.values()) if assigned else set()
                return (
                    len(assigned) == workers
                    and everything <= covered
                    and now - last_change[0] >= 2.0
                )

            wait_for(settled, timeout_s, interval_s=0.1, what="the group to settle")
            settled_s = time.monotonic() - proxy.started_at
            members = group_members(bootstrap, group)
            produce_after_join()
        while True:
            seen, _calls, first, last, handler_cpu = handler.progress()
            if first is not None and not cpu_first:
                # CPU from the first delivery on: start-up (imports, group join) left out
                cpu_first, handler_cpu_first = proxy.cpu_seconds(), handler_cpu
                if profile:
                    proxy.profile_start()
                    profiled_from = seen
            if seen >= n:
                cpu_last, handler_cpu_last = proxy.cpu_seconds(), handler_cpu
                if profile:
                    proxy.profile_stop()
                break
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy delivered {seen} of {n} in {timeout_s:g}s")
            time.sleep(0.05)
        assert first is not None and last is not None
        while reader.sum() < n:
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy did not commit every offset in {timeout_s:g}s")
            time.sleep(0.01)
        committed_at = time.monotonic()
        stats = handler.stats()
    finally:
        reader.__exit__()
        code = proxy.stop()
        assignments = proxy.assignments()
        tail = proxy.log_tail()
        proxy.cleanup()
    if code not in (0, None):
        raise RuntimeError(f"the proxy exited with {code}:\n{tail}")
    return {
        "assignments": assignments,
        "settled_s": settled_s,
        "members": members,
        "seen_rate": rate(n - 1, last - first),
        "steady_rate": steady_rate(stats["first_seen"]) or 0.0,
        "committed_rate": rate(n, committed_at - first),
        "startup_s": first - proxy.started_at,
        "duplicates": float(stats["deliveries"] - stats["distinct"]),
        "client_cpu_us_per_msg": 1e6 * (cpu_last - cpu_first) / n,
        "handler_cpu_us_per_msg": 1e6 * (handler_cpu_last - handler_cpu_first) / n,
        "profiled_messages": float(n - profiled_from) if profile else 0.0,
    }


def _profiled_proxy_main(kind: str, out: str, argv: list[str]) -> int:
    """``consumer-proxy`` with a profiler that SIGUSR1 starts and SIGUSR2 stops and saves.

    Both signal handlers run on the main thread, between two bytecodes of the event loop, so
    the profiler sees exactly the loop's thread (not the consumer's executor thread).
    """
    from consumer_proxy.cli import main as cli_main

    profiler: Any = None

    def start(_signum: int, _frame: object) -> None:
        nonlocal profiler
        if kind == "pyinstrument":
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
        else:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()

    def stop(_signum: int, _frame: object) -> None:
        if profiler is None:
            return
        if kind == "pyinstrument":
            session = profiler.stop()
            from pyinstrument.renderers import ConsoleRenderer

            text = ConsoleRenderer(unicode=False, color=False, show_all=False).render(session)
            Path(out).write_text(text)
        else:
            profiler.disable()
            profiler.dump_stats(out)
        Path(f"{out}.done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    code: int = cli_main(argv)
    return code


def summarise_cprofile(path: Path, n: int, top: int = 20) -> list[str]:
    """Hot spots of a cProfile dump: own time by area and by function, as shares of the
    loop's busy time (total minus the time blocked in epoll) and microseconds per message."""
    import pstats

    stats: Any = pstats.Stats(str(path))
    entries = []
    idle = 0.0
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        if "select.epoll" in func or func == "<method 'poll' of 'select.epoll' objects>":
            idle += tt
            continue
        entries.append((tt, ct, nc, file, line, func))
    busy = sum(e[0] for e in entries)
    lines = [
        f"profile {path.name}: loop busy {busy:.2f}s, idle in epoll {idle:.2f}s, "
        f"{n} messages -> {1e6 * busy / n:.0f} us busy per message"
    ]

    def area(file: str, func: str) -> str:
        if file == "~":
            return "C builtins called directly"
        parts = Path(file).parts
        if "consumer_proxy" in parts:
            return "consumer_proxy." + Path(file).stem
        for name in (
            "grpc",
            "asyncio",
            "google",
            "prometheus_client",
            "pybreaker",
            "confluent_kafka",
            "concurrent",
            "logging",
            "threading",
        ):
            if name in parts or Path(file).stem == name:
                return {"google": "protobuf"}.get(name, name)
        return Path(file).name

    by_area: dict[str, float] = {}
    for tt, _ct, _nc, file, _line, func in entries:
        key = area(file, func)
        by_area[key] = by_area.get(key, 0.0) + tt
    lines.append(f"{'own s':>7} {'busy %':>6} {'us/msg':>7}  area (own time summed by module)")
    for key, tt in sorted(by_area.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{tt:7.2f} {100 * tt / busy:5.1f}% {1e6 * tt / n:7.1f}  {key}")
    lines.append(f"{'own s':>7} {'busy %':>6} {'us/msg':>7} {'cum %':>6} {'calls':>8}  function")
    for tt, ct, nc, file, line, func in sorted(entries, key=lambda e: -e[0])[:top]:
        where = f"{Path(file).name}:{line}" if file != "~" else "~"
        lines.append(
            f"{tt:7.2f} {100 * tt / busy:5.1f}% {1e6 * tt / n:7.1f} "
            f"{100 * ct / busy:5.1f}% {nc:8d}  {where}({func})"
        )
    return lines


# --------------------------------------------------------------------------- results


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, nearest rank); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def steady_rate(first_seen: Sequence[float], lo: float = 0.1, hi: float = 0.9) -> float | None:
    """Messages/s between the lo and hi fractions of the arrivals (start-up and tail left out)."""
    times = sorted(first_seen)
    if len(times) < 20:
        return None
    a, b = int(lo * (len(times) - 1)), int(hi * (len(times) - 1))
    span = times[b] - times[a]
    return (b - a) / span if span > 0 else None


@dataclass
class Result:
    """One bench run's figures and ratios, printed as it goes and written as JSON."""

    bench: str
    params: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def figure(self, name: str, value: Any, unit: str = "") -> None:
        self.figures[name] = value
        shown = f"{value:,.1f}" if isinstance(value, float) else str(value)
        print(f"  {name:<48} {shown} {unit}".rstrip(), flush=True)

    def ratio(
        self, name: str, value: float, target: float | None = None, *, higher_is_better: bool = True
    ) -> None:
        meets = None
        if target is not None:
            meets = value >= target if higher_is_better else value <= target
        self.ratios[name] = {"value": round(value, 4), "target": target, "meets": meets}
        goal = (
            ""
            if target is None
            else f"  (target {'>=' if higher_is_better else '<='} "
            f"{target:g}: {'MET' if meets else 'NOT MET'})"
        )
        print(f"  RATIO {name:<42} {value:,.3f}{goal}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    def write(self) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = RESULTS_DIR / f"{self.bench}-{stamp}.json"
        data = {
            **asdict(self),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "grpc": grpc.__version__,
                "loadavg_1m": os.getloadavg()[0],
            },
        }
        path.write_text(json.dumps(data, indent=2, default=str))
        print(f"result written to {path.relative_to(ROOT)}", flush=True)
        return path


def rate(n: int, seconds: float) -> float:
    """n / seconds, 0 for an empty interval."""
    return n / seconds if seconds > 0 else 0.0


def mean(values: Sequence[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    return statistics.fmean(values) if values else None


if __name__ == "__main__":
    if sys.argv[1:2] == ["profile-proxy"] and len(sys.argv) > 4:
        sys.exit(_profiled_proxy_main(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit("usage: python -m bench.common profile-proxy cprofile|pyinstrument OUT ARGS...")
