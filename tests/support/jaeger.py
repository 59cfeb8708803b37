"""A real OTLP receiver for tests: Jaeger v2 (an OpenTelemetry Collector distribution), built from
the Go module proxy and run with in-memory storage; traces are read back through its query API.

The module tests/support/jaeger-tool/ (go.mod and go.sum as committed, the Jaeger program as its
``tool``) pins the version; the binary is built once into ~/.cache/consumer-proxy (keyed by
go.sum), from Go's module and build caches (~/go, ~/.cache/go-build). A cold build downloads
and compiles Jaeger: minutes; a cached start takes about a second. Without Go it skips locally
and fails under CI=true, like every integration test.

    with Jaeger.start(tmp_path) as jaeger:
        ...  # export OTLP to jaeger.otlp_grpc (http://127.0.0.1:port) or jaeger.otlp_http
        spans = jaeger.trace(trace_id)   # the trace's spans, OTLP JSON flattened
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "tests" / "support" / "jaeger-tool"
PROGRAM = "github.com/jaegertracing/jaeger/cmd/jaeger"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "consumer-proxy"
BUILD_TIMEOUT_S = 1500  # cold: downloads and compiles the collector and its components

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{grpc}
      http:
        endpoint: 127.0.0.1:{http}
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def find_go() -> str:
    """The go command; skips without one, except in CI where a missing tool is a failure."""
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if _in_ci():
        pytest.fail("no go command (set GO or put go on PATH): Jaeger cannot be built")
    pytest.skip("no go command (a failure under CI=true): set GO or put go on PATH")


def binary_path() -> Path:
    """Where the built Jaeger lives: one per go.sum (a version change builds anew)."""
    digest = hashlib.sha256((MODULE / "go.sum").read_bytes()).hexdigest()[:12]
    return CACHE / f"jaeger-{digest}" / "jaeger"


def build() -> Path:
    """The Jaeger binary, built unless cached; one build at a time across processes."""
    target = binary_path()
    if target.exists():
        return target
    go = find_go()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building it right now
        if target.exists():
            return target
        partial = target.with_suffix(".partial")
        proc = subprocess.run(
            [go, "build", "-trimpath", "-o", str(partial), PROGRAM],
            cwd=MODULE,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
            # -mod=readonly: go.mod and go.sum as committed, never edited by the build.
            env={**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"},
        )
        if proc.returncode != 0:
            pytest.fail(f"building Jaeger failed:\n{proc.stdout}{proc.stderr}", pytrace=False)
        os.replace(partial, target)
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


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


@dataclass
class Jaeger:
    """A running Jaeger: OTLP in (gRPC and HTTP), the query API out."""

    process: subprocess.Popen[bytes]
    otlp_grpc: str
    otlp_http: str
    query: str
    log: Path

    @classmethod
    @contextmanager
    def start(cls, directory: Path) -> Iterator[Jaeger]:
        binary = build()
        query, query_grpc, grpc, http = _free_ports(4)
        config = directory / "jaeger.yaml"
        config.write_text(CONFIG.format(query=query, query_grpc=query_grpc, grpc=grpc, http=http))
        log = directory / "jaeger.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [str(binary), "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        jaeger = cls(
            process,
            f"http://127.0.0.1:{grpc}",
            f"http://127.0.0.1:{http}",
            f"http://127.0.0.1:{query}",
            log,
        )
        try:
            wait_until(
                lambda: process.poll() is not None or jaeger.ready(),
                timeout=60,
                message="Jaeger's query API",
            )
            assert process.poll() is None, f"Jaeger exited:\n{log.read_text()[-4000:]}"
            yield jaeger
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def ready(self) -> bool:
        try:
            _get(f"{self.query}/api/v3/services")
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return True

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans of one trace (hex id), each an OTLP JSON span plus ``service`` (its
        resource's service.name); [] while Jaeger has none of it."""
        try:
            body = _get(f"{self.query}/api/v3/traces/{trace_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
        spans: list[dict[str, Any]] = []
        for resource_spans in body.get("result", {}).get("resourceSpans", []):
            attributes = resource_spans.get("resource", {}).get("attributes", [])
            service = next(
                (a["value"].get("stringValue") for a in attributes if a["key"] == "service.name"),
                None,
            )
            for scope in resource_spans.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    spans.append({**span, "service": service})
        return spans


def attributes(span: dict[str, Any]) -> dict[str, Any]:
    """An OTLP JSON span's attributes as a plain dict (int values as ints)."""
    found: dict[str, Any] = {}
    for attribute in span.get("attributes", []):
        value = attribute["value"]
        if "intValue" in value:
            found[attribute["key"]] = int(value["intValue"])
        else:
            found[attribute["key"]] = next(iter(value.values()), None)
    return found
