"""The handler service the benches push to, in a process of its own.

``HandlerServer(spec)`` runs a bare grpc.aio ``MessageHandler`` (multiprocessing, spawn);
``HandlerServer(spec, "go")`` runs ``bench/gohandler`` (:class:`GoHandlerProcess`), the same
answers and books in Go at a few microseconds of CPU per call instead of ~150, so on a
two-core machine a bench measures the proxy rather than its service. Every call sleeps
``delay_ms`` (``slow_ms`` for a value starting with :data:`SLOW_MARKER`) and acks; a batch's
messages are worked on concurrently (one sleep per call).

Two kinds of books (:class:`HandlerSpec`): by default each distinct message's first arrival
(and, for unary calls, its latency since its Kafka timestamp), which costs the Python handler
a set insertion per message; with ``count_only`` the Python handler parses a request in C and
never reads a message in Python (the throughput benches: 200k messages at 100k msg/s), and
``progress`` counts deliveries and call times instead of distinct messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from bench.options import ROOT
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.cache import cache_dir, prune, used

SLOW_MARKER = b"slow"
SERVICE = "consumerproxy.v1.MessageHandler"
SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class HandlerSpec:
    """What the handler service does with each call and what it books.

    Every call sleeps ``delay_ms`` (none when 0: a no-op handler answers straight away), or
    ``slow_ms`` when the message value starts with :data:`SLOW_MARKER`. The answer is always
    an ack. ``latency``: record every first attempt's latency (receipt wall clock minus the
    record's timestamp), unary and batch alike, in ``stats()["latency_ms"]``, and its offset in
    ``stats()["latency_offsets"]`` (same order: one partition's records compared one by one
    between two consumers of the same topic). ``count_only``:
    the cheap books (see the module docstring).
    """

    delay_ms: float = 0.0
    slow_ms: float = 0.0
    latency: bool = False
    count_only: bool = False


class _Recorder:
    """The handler process's books."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.deliveries = 0  # messages received, a batch counting each of its messages
        self.first: float | None = None  # time.monotonic() of the first and the latest call
        self.last: float | None = None
        self.sizes: dict[int, int] = {}  # batch calls by size
        self.in_flight = 0
        self.peak_in_flight = 0
        self.seen: set[tuple[str, int, int]] = set()
        self.first_seen: list[float] = []  # time.monotonic() of each distinct message's arrival
        # time.time() at arrival minus the record's Kafka timestamp, first deliveries only
        self.latency_fast_ms: list[float] = []
        self.latency_slow_ms: list[float] = []
        self.latency_ms: list[float] = []  # ``latency``: every first attempt's
        self.latency_offsets: list[int] = []  # ... and its offset, in the same order
        self.partitions: dict[int, int] = {}

    def arrived(self, count: int, batch: bool = False) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.calls += 1
        self.deliveries += count
        if batch:
            self.sizes[count] = self.sizes.get(count, 0) + 1

    def progress(self, count_only: bool) -> tuple[int, int, float | None, float | None, float]:
        if count_only:
            return (self.deliveries, self.calls, self.first, self.last, time.process_time())
        first = self.first_seen[0] if self.first_seen else None
        last = self.first_seen[-1] if self.first_seen else None
        return (len(self.seen), self.calls, first, last, time.process_time())

    def stats(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "deliveries": self.deliveries,
            "distinct": len(self.seen),
            "first_seen": self.first_seen,
            "latency_fast_ms": self.latency_fast_ms,
            "latency_slow_ms": self.latency_slow_ms,
            "latency_ms": self.latency_ms,
            "latency_offsets": self.latency_offsets,
            "partitions": self.partitions,
            "sizes": self.sizes,
            "peak_calls": self.peak_in_flight,
        }


class _Servicer(handler_pb2_grpc.MessageHandlerServicer):
    def __init__(self, spec: HandlerSpec, books: _Recorder) -> None:
        self._delay_s = spec.delay_ms / 1000.0
        self._slow_s = spec.slow_ms / 1000.0
        self._books = books
        self._latency = spec.latency
        self._empty = handler_pb2.HandleMessageResponse()

    async def HandleMessage(
        self, request: handler_pb2.HandleMessageRequest, context: Any
    ) -> handler_pb2.HandleMessageResponse:
        msg = request.message
        books = self._books
        books.arrived(1)
        key = (msg.topic, msg.partition, msg.offset)
        slow = msg.value.startswith(SLOW_MARKER)
        if key not in books.seen:
            books.seen.add(key)
            books.first_seen.append(time.monotonic())
            books.partitions[msg.partition] = books.partitions.get(msg.partition, 0) + 1
            if msg.timestamp_ms > 0:
                latency = time.time() * 1000.0 - msg.timestamp_ms
                (books.latency_slow_ms if slow else books.latency_fast_ms).append(latency)
                if self._latency and msg.attempt == 1:
                    books.latency_ms.append(latency)
                    books.latency_offsets.append(msg.offset)
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
        books.arrived(len(request.messages), batch=True)
        delay = 0.0
        for msg in request.messages:
            key = (msg.topic, msg.partition, msg.offset)
            if key not in books.seen:
                books.seen.add(key)
                books.first_seen.append(time.monotonic())
                books.partitions[msg.partition] = books.partitions.get(msg.partition, 0) + 1
                if self._latency and msg.attempt == 1:
                    books.latency_ms.append(time.time() * 1000.0 - msg.timestamp_ms)
                    books.latency_offsets.append(msg.offset)
            delay = max(delay, self._slow_s if msg.value.startswith(SLOW_MARKER) else self._delay_s)
        if delay > 0:
            await asyncio.sleep(delay)
        return handler_pb2.HandleMessageBatchResponse(
            results=[self._empty for _ in request.messages]
        )


def _counting_handlers(spec: HandlerSpec, books: _Recorder) -> grpc.GenericRpcHandler:
    """``count_only``: the requests are parsed in C and no message is read in Python (but a
    first attempt's timestamp with ``latency``); answers are pre-encoded."""
    delay_s = spec.delay_ms / 1000.0
    answers: dict[int, bytes] = {}
    parse_batch = handler_pb2.HandleMessageBatchRequest.FromString
    parse_one = handler_pb2.HandleMessageRequest.FromString

    async def batch(request: bytes, _context: Any) -> bytes:
        messages = parse_batch(request).messages
        count = len(messages)
        books.arrived(count, batch=True)
        if spec.latency:
            wall_ms = time.time() * 1000.0
            first = [m for m in messages if m.attempt == 1]
            books.latency_ms += [wall_ms - m.timestamp_ms for m in first]
            books.latency_offsets += [m.offset for m in first]
        if delay_s:
            books.in_flight += 1
            books.peak_in_flight = max(books.peak_in_flight, books.in_flight)
            await asyncio.sleep(delay_s)
            books.in_flight -= 1
        answer = answers.get(count)
        if answer is None:  # `count` empty results (field 1, length 0): all acks
            answer = answers[count] = b"\x0a\x00" * count
        return answer

    async def unary(request: bytes, _context: Any) -> bytes:
        books.arrived(1)
        if spec.latency:
            message = parse_one(request).message
            if message.attempt == 1:
                books.latency_ms.append(time.time() * 1000.0 - message.timestamp_ms)
                books.latency_offsets.append(message.offset)
        if delay_s:
            await asyncio.sleep(delay_s)
        return b""  # the empty response: ack

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "HandleMessageBatch": grpc.unary_unary_rpc_method_handler(batch),
            "HandleMessage": grpc.unary_unary_rpc_method_handler(unary),
        },
    )


def _handler_main(spec: HandlerSpec, conn: Connection) -> None:
    """Entry point of the handler process: serve until told to stop on ``conn``."""
    asyncio.run(_serve(spec, conn))


async def _serve(spec: HandlerSpec, conn: Connection) -> None:
    books = _Recorder()
    server = aio.server(options=[("grpc.so_reuseport", 0)])
    if spec.count_only:
        server.add_generic_rpc_handlers((_counting_handlers(spec, books),))
    else:
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
                conn.send(books.progress(spec.count_only))
            elif command == "stats":
                conn.send(books.stats())
    finally:
        await server.stop(grace=1.0)
        conn.send("stopped")


GO_HANDLER_DIR = ROOT / "bench" / "gohandler"


def stale(target: Path, sources: Sequence[Path]) -> bool:
    """Whether ``target`` is missing or older than a file under ``sources``."""
    newest = max(f.stat().st_mtime for d in sources for f in d.rglob("*") if f.is_file())
    return not target.exists() or target.stat().st_mtime < newest


def _find_go() -> str:
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("building a Go service needs the go command (set GO or put go on PATH)")


def sources_digest(sources: Sequence[Path]) -> str:
    """A short digest of every file under ``sources`` (their paths and contents)."""
    digest = hashlib.sha256()
    for d in sources:
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(d)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def go_binary(package: Path, name: str) -> Path:
    """The Go command in ``package``, built into the cache as ``name-<digest of its sources
    and the generated stubs>`` when missing (grpc-go comes from the Go module proxy the first
    time). The digest, not a modification time, names it: the checkouts of one machine share
    the cache, and one with other sources must neither take nor replace another's build."""
    sources = (package, ROOT / "examples" / "go" / "gen")
    binary = cache_dir() / f"{name}-{sources_digest(sources)}"
    if binary.exists():
        return used(binary)
    print(f"building {package.relative_to(ROOT)} ...", flush=True)
    binary.parent.mkdir(parents=True, exist_ok=True)
    building = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    proc = subprocess.run(
        [_find_go(), "build", "-o", str(building), "."],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {package} failed:\n{proc.stdout}{proc.stderr}")
    building.replace(binary)  # whole or not at all, for a checkout building it at once
    prune(binary)
    return binary


class GoHandlerProcess:
    """``bench/gohandler`` as a child process: ``ask(command)`` answers a JSON value."""

    def __init__(self, delay_ms: float = 0.0, slow_ms: float = 0.0, latency: bool = False):
        binary = go_binary(GO_HANDLER_DIR, "bench-gohandler")
        args = [str(binary), f"-delay-ms={delay_ms}", f"-slow-ms={slow_ms}"]
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
        self.pid = self._proc.pid
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
        self._conn, child = SPAWN.Pipe()
        self._proc = SPAWN.Process(
            target=_handler_main, args=(spec, child), name="bench-handler", daemon=True
        )
        self._lock = threading.Lock()
        self.port = 0

    def __enter__(self) -> HandlerServer:
        if self.impl == "go":
            spec = self.spec
            self._go = GoHandlerProcess(spec.delay_ms, spec.slow_ms, latency=spec.latency)
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

    @property
    def pid(self) -> int:
        """The service's process id (for its CPU time)."""
        if self._go is not None:
            return self._go.pid
        pid = self._proc.pid
        assert pid is not None
        return pid

    def _ask(self, command: str) -> Any:
        if self._go is not None:
            return self._from_go(command, self._go.ask(command))
        with self._lock:
            self._conn.send(command)
            return self._conn.recv()

    def _from_go(self, command: str, answer: Any) -> Any:
        """The Go handler's answer in the Python handler's shapes."""
        if command == "progress":
            if self.spec.count_only:
                first, last, count = answer["first"], answer["last"], answer["deliveries"]
            else:
                first, last = answer["first_seen_first"], answer["first_seen_last"]
                count = answer["distinct"]
            return (count, answer["calls"], first, last, answer["cpu_s"])
        if command == "stats":
            answer["partitions"] = {int(k): v for k, v in answer["partitions"].items()}
            answer["sizes"] = {int(k): v for k, v in answer["sizes"].items()}
        return answer

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._ask("reset")

    def progress(self) -> tuple[int, int, float | None, float | None, float]:
        """(messages: distinct ones, or every delivery with ``count_only``; calls; monotonic
        time of the first and of the latest arrival (of a distinct message, or of a call with
        ``count_only``); the handler process's CPU seconds so far)."""
        result: tuple[int, int, float | None, float | None, float] = self._ask("progress")
        return result

    def stats(self) -> dict[str, Any]:
        """Everything recorded (calls, deliveries, lists of arrival times and latencies, batch
        sizes, the peak of calls in flight while sleeping)."""
        result: dict[str, Any] = self._ask("stats")
        return result

    def wait_seen(self, n: int, timeout_s: float, interval_s: float = 0.1) -> float:
        """Wait until ``n`` messages arrived (see :meth:`progress`); returns the monotonic time
        it happened (the arrival time of the n-th, as the handler recorded it)."""
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
