"""Real services and Parallel Consumer as child processes, for the whole-system benches.

- :func:`sdk_service`: a no-op handler served by the Python SDK (``consumer_proxy.handler``),
  ``python -m bench.services sdk [--profile OUT]`` (cProfile of the whole process, written
  when it stops);
- :func:`go_example_service`: ``examples/go`` (the Go example service), built into the cache;
- :class:`ParallelConsumer`: ``bench/parallelconsumer/PcBench.java`` (a no-op function on
  Confluent's Parallel Consumer, ``io.confluent.parallelconsumer:parallel-consumer-core`` from
  Maven Central), built with the machine's Maven and Java 17: the artifacts in ``~/.m2``, the
  classes and the resolved class path in ``~/.cache/consumer-proxy/bench-pc``.

Each has ``pid`` / ``cpu_seconds()`` for the CPU accounting and stops on ``close()``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from bench.handlers import go_binary, stale
from bench.measure import Child
from bench.options import ROOT
from tests.support.cache import cache_dir

PC_DIR = ROOT / "bench" / "parallelconsumer"
PC_VERSION = "0.5.3.2"


class ServiceProcess(Child):
    """A gRPC service in a child process; its address comes from its ``serving on HOST:PORT``
    log line (the SDK's ``run`` and the Go example both say it)."""

    def __init__(self, args: list[str], what: str) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="cp-bench-service-", suffix=".log")  # noqa: SIM115
        self._what = what
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while True:
            found = re.search(r"serving on (\S+)", self.output())
            if found:
                self.address = found[1]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{what} did not start:\n{self.output()[-2000:]}")
            time.sleep(0.05)

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def close(self) -> None:
        """SIGTERM (both stop gracefully), then SIGKILL after 20 s."""
        self.terminate(20)
        self._log.close()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sdk_service(profile_out: Path | None = None) -> ServiceProcess:
    """A no-op handler on the Python SDK, in a process of its own."""
    args = [sys.executable, "-m", "bench.services", "sdk"]
    if profile_out is not None:
        args += ["--profile", str(profile_out)]
    return ServiceProcess(args, "the Python SDK service")


def go_example_service() -> ServiceProcess:
    """``examples/go`` on a free port (it acks every message of this workload)."""
    binary = go_binary(ROOT / "examples" / "go", "bench-goexample")
    return ServiceProcess([str(binary), "-port", "0"], "the Go example service")


def _sdk_main(profile_out: str | None) -> int:
    import logging

    from consumer_proxy.handler import Message, Result, run

    async def handle(_message: Message) -> Result | None:
        return None  # ack

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if profile_out is None:
        run(handle, port=0)
        return 0
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run(handle, port=0)
    finally:
        profiler.disable()
        profiler.dump_stats(profile_out)
    return 0


# --------------------------------------------------------------------------- Parallel Consumer


def _tool(name: str, env: str) -> str:
    found = os.environ.get(env) or shutil.which(name)
    if not found:
        raise RuntimeError(f"Parallel Consumer's bench needs {name} (set {env} or put it on PATH)")
    return found


def _run_or_raise(command: list[str], path_file: Path) -> None:
    proc = subprocess.run(
        command, cwd=PC_DIR, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        path_file.unlink(missing_ok=True)  # built again next time
        output = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{Path(command[0]).name} failed:\n{output}")


def pc_classpath() -> str:
    """The class path of ``PcBench``: resolved by Maven (from Maven Central into ``~/.m2``) and
    compiled with javac when missing or older than ``bench/parallelconsumer``. Raises
    RuntimeError when Maven cannot resolve it (no network, Central not reachable)."""
    out = cache_dir() / "bench-pc"
    classes, path_file = out / "classes", out / "classpath.txt"
    if stale(classes / "bench" / "PcBench.class", (PC_DIR,)) or not path_file.exists():
        print("building bench/parallelconsumer (Maven, javac) ...", flush=True)
        classes.mkdir(parents=True, exist_ok=True)
        resolve = [_tool("mvn", "MVN"), "-B", "-q", "dependency:build-classpath"]
        _run_or_raise([*resolve, f"-Dmdep.outputFile={path_file}"], path_file)
        sources = [str(p) for p in sorted((PC_DIR / "src").rglob("*.java"))]
        javac = [_tool("javac", "JAVAC"), "-d", str(classes), "-cp", path_file.read_text().strip()]
        _run_or_raise([*javac, *sources], path_file)
    return f"{classes}{os.pathsep}{path_file.read_text().strip()}"


class ParallelConsumer(Child):
    """``PcBench`` consuming ``topic`` with a fresh ``group``; :meth:`event` waits for its
    ``first`` and ``last`` (the n-th record processed) lines."""

    def __init__(self, bootstrap: str, topic: str, group: str, n: int, concurrency: int) -> None:
        java = _tool("java", "JAVA")
        args = [java, "-cp", pc_classpath(), "bench.PcBench", bootstrap, topic, group]
        self.proc = self._proc = subprocess.Popen(
            [*args, str(n), str(concurrency)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.started_at = time.monotonic()
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._other: list[str] = []
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str]) -> None:
        for line in out:
            if line.startswith("{"):
                self._events.put(json.loads(line))
            else:
                self._other = [*self._other[-40:], line.rstrip()]

    def check_alive(self) -> None:
        if self._proc.poll() is not None:
            tail = "\n".join(self._other)
            raise RuntimeError(f"Parallel Consumer exited with {self._proc.returncode}:\n{tail}")

    def event(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The next event line, which must be ``name``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                found = self._events.get(timeout=0.1)
            except queue.Empty:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Parallel Consumer said no {name!r} in time") from None
                continue
            if found["event"] != name:
                raise RuntimeError(f"Parallel Consumer said {found}, expected {name!r}")
            return found

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write("stop\n")
                self._proc.stdin.flush()
                self._proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(10)

    def __enter__(self) -> ParallelConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="a bench service (see bench/services.py)")
    parser.add_argument("kind", choices=["sdk"])
    parser.add_argument("--profile", help="write a cProfile dump here when it stops")
    sys.exit(_sdk_main(parser.parse_args().profile))
