"""The Go example (examples/go) as a test service: built with the machine's Go (modules from
the Go module proxy the first time, from the module and build caches after) and run on a free
127.0.0.1 port. Without Go it skips locally and fails in CI (CI=true)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "examples" / "go"
GO_TIMEOUT_S = 600  # a cold build downloads grpc-go and compiles it (about a minute here)


def find_go() -> str:
    """The go command; skips without one, except in CI where a missing tool is a failure."""
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail("no go command (set GO or put go on PATH): the Go example cannot be built")
    pytest.skip("no go command (a failure under CI=true): set GO or put go on PATH")


def go(
    go_cmd: str, *args: str, module: Path = MODULE, timeout_s: float = GO_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``go ARGS`` in ``module`` (the example's by default); fails the test on an error."""
    proc = subprocess.run(
        [go_cmd, *args],
        cwd=module,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        # -mod=readonly: the build uses go.mod and go.sum as committed, never edits them.
        env={**os.environ, "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"},
    )
    assert proc.returncode == 0, f"go {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc


def build(directory: Path) -> Path:
    """The example's binary, built into ``directory``."""
    binary = directory / "example"
    go(find_go(), "build", "-o", str(binary), ".")
    return binary


@dataclass
class GoService:
    process: subprocess.Popen[str]
    address: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    """Its log (stderr) so far: each line with the wall time (``time.time()``) it was read."""

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append((time.time(), line))

    def stop(self) -> str:
        """SIGTERM, wait for the graceful stop; returns its log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(10)
        if self.process.stderr is not None:
            self.process.stderr.close()
        return "".join(line for _, line in self.lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serving(address: str) -> bool:
    """One grpc.health.v1 check of the whole server; False until it answers SERVING."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def go_service(
    go_binary: Path, *flags: str, env: Mapping[str, str] | None = None
) -> Iterator[GoService]:
    """Run the example on a free port (given by PORT) until the generator is closed."""
    port = free_port()
    process = subprocess.Popen(
        [str(go_binary), "-host", "127.0.0.1", *flags],
        env={**os.environ, **(env or {}), "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    service = GoService(process, f"127.0.0.1:{port}")
    try:
        wait_until(
            lambda: process.poll() is not None or serving(service.address),
            timeout=30,
            message="the Go example to serve grpc.health.v1",
        )
        assert process.poll() is None, f"the Go example exited:\n{service.stop()}"
        yield service
    finally:
        service.stop()
