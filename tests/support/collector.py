"""A real OTLP receiver for tests: the OpenTelemetry Collector, built from the Go module proxy with
two upstream components only (the OTLP receiver, gRPC and HTTP, and the file exporter), whose
file of OTLP JSON lines the tests read the traces back from.

tests/support/otelcol/ is the collector's Go module: main.go is the few lines the
collector's builder (ocb) would generate for those two components; go.mod and go.sum (as
committed) pin the versions. The binary is built once into ~/.cache/consumer-proxy (keyed by
go.sum and main.go) from Go's module and build caches (~/go, ~/.cache/go-build): a cold build
downloads and compiles about four minutes' worth on two cores, a cached start takes a second.
Without Go it skips locally and fails under CI=true, like every integration test.

    with Collector.start(tmp_path) as collector:
        ...  # export OTLP to collector.otlp_grpc (http://127.0.0.1:port) or .otlp_http
        spans = collector.trace(trace_id)   # the trace's spans so far, OTLP JSON
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .cache import cache_dir, prune, used
from .goexample import find_go, go
from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "tests" / "support" / "otelcol"
PORT_ATTEMPTS = 3  # starts on fresh ports after a port was taken by another process
BUILD_TIMEOUT_S = 1200  # cold: downloads and compiles the collector's core and two components

CONFIG = """\
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{grpc}
      http:
        endpoint: 127.0.0.1:{http}
exporters:
  file:
    path: {path}
    flush_interval: 100ms
service:
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
"""


def binary_path() -> Path:
    """Where the built collector lives: one per go.sum and main.go."""
    digest = hashlib.sha256()
    for name in ("go.sum", "main.go"):
        digest.update((MODULE / name).read_bytes())
    return cache_dir() / f"otelcol-{digest.hexdigest()[:12]}" / "otelcol"


def build() -> Path:
    """The collector binary, built unless cached; one build at a time across processes."""
    target = binary_path()
    if target.exists():
        used(target.parent)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building it right now
        if target.exists():
            return target
        partial = target.with_suffix(".partial")
        build_cmd = ("build", "-trimpath", "-o", str(partial), ".")
        go(find_go(), *build_cmd, module=MODULE, timeout_s=BUILD_TIMEOUT_S)
        os.replace(partial, target)
    prune(target.parent)  # other versions' builds no checkout used for a week
    return target


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on 127.0.0.1:``port`` (not another process that
    took the free port first: a connect alone would not tell them apart)."""
    wanted = f"0100007F:{port:04X}"
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == wanted and fields[3] == "0A":  # local address, state LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    try:
        links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
    except OSError:  # the process is gone, or a descriptor closed while read
        return False
    return bool(inodes & links)


def _up_or_gone(process: subprocess.Popen[bytes], grpc: int, http: int) -> bool:
    """The collector listens on both its ports, or it exited."""
    if process.poll() is not None:
        return True
    return _listening(process.pid, grpc) and _listening(process.pid, http)


class Collector:
    """A running collector: OTLP in (gRPC and HTTP), spans out to a file, indexed by trace."""

    def __init__(self, process: subprocess.Popen[bytes], grpc: int, http: int, path: Path) -> None:
        self.process = process
        self.otlp_grpc = f"http://127.0.0.1:{grpc}"
        self.otlp_http = f"http://127.0.0.1:{http}"
        self._path = path
        self._read = 0  # bytes of the file already indexed
        self._traces: dict[str, list[dict[str, Any]]] = defaultdict(list)

    @classmethod
    @contextmanager
    def start(cls, directory: Path) -> Iterator[Collector]:
        binary = build()
        traces = directory / "traces.jsonl"
        log = directory / "otelcol.log"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            grpc, http = _free_ports(2)
            config = directory / "otelcol.yaml"
            config.write_text(CONFIG.format(grpc=grpc, http=http, path=traces))
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    [str(binary), "--config", str(config)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            wait_until(
                functools.partial(_up_or_gone, process, grpc, http),
                timeout=60,
                message="the collector's OTLP ports",
            )
            if process.poll() is None:
                break
            output = log.read_text()
            # Another process took a free port between our probe and the collector's bind.
            assert "address already in use" in output and attempt < PORT_ATTEMPTS, (
                f"the collector exited:\n{output[-4000:]}"
            )
        collector = cls(process, grpc, http, traces)
        try:
            yield collector
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def _index(self) -> None:
        """Index the export lines written since the last call (whole lines only)."""
        if not self._path.exists():
            return
        with open(self._path, "rb") as file:
            file.seek(self._read)
            data = file.read()
        end = data.rfind(b"\n") + 1
        self._read += end
        for line in data[:end].splitlines():
            for resource_spans in json.loads(line).get("resourceSpans", []):
                attributes = resource_spans.get("resource", {}).get("attributes", [])
                service = next(
                    (
                        a["value"].get("stringValue")
                        for a in attributes
                        if a["key"] == "service.name"
                    ),
                    None,
                )
                for scope in resource_spans.get("scopeSpans", []):
                    for span in scope.get("spans", []):
                        self._traces[span["traceId"]].append({**span, "service": service})

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans of one trace (hex id) received so far, each an OTLP JSON span plus
        ``service`` (its resource's service.name)."""
        self._index()
        return list(self._traces.get(trace_id, ()))


def attributes(item: dict[str, Any]) -> dict[str, Any]:
    """An OTLP JSON span's (or event's) attributes as a plain dict (int values as ints)."""
    found: dict[str, Any] = {}
    for attribute in item.get("attributes", []):
        value = attribute["value"]
        if "intValue" in value:
            found[attribute["key"]] = int(value["intValue"])
        else:
            found[attribute["key"]] = next(iter(value.values()), None)
    return found
