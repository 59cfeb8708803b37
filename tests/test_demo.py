"""The README's demo (`make demo` -> scripts/demo.py) as a new user meets it: a machine
without Java is told so, and stopping it however it is stopped leaves nothing running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "scripts" / "demo.py"
KAFKA_DIR = ROOT / ".demo" / "kafka"

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def test_demo_without_java_says_that_java_is_missing(tmp_path: Path) -> None:
    # Given a machine without Java (no java on PATH, no JAVA_HOME)
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # an empty directory: no java, no mvn
    env["PYTHONPATH"] = str(ROOT)

    # When the README's demo runs
    proc = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=120, env=env
    )
    output = proc.stdout + proc.stderr

    # Then it fails with scripts/kafka's reason, not a bare traceback of a CalledProcessError
    assert proc.returncode != 0
    assert "java not found" in output, output[-1500:]
    assert "Traceback" not in output, output[-1500:]


def test_demo_stopped_with_sigterm_leaves_no_process_behind() -> None:
    # Given the demo running: its broker, three example services and the proxy
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = ROOT / ".demo" / "sigterm-test.out"
    out.parent.mkdir(exist_ok=True)
    with open(out, "wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, str(DEMO), "--seconds", "120"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # as a terminal job would be, apart from pytest
        )
    spawned: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while b"producing" not in out.read_bytes():
            assert demo.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        spawned = [int((KAFKA_DIR / "kafka.pid").read_text()), *_children(demo.pid)]
        assert len(spawned) >= 5  # broker, 3 services, proxy

        # When it is stopped with SIGTERM (timeout(1), a CI job's cancel, kill, an IDE's stop)
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=60)
        settle = time.monotonic() + 40
        while any(_alive(p) for p in spawned) and time.monotonic() < settle:
            time.sleep(0.5)

        # Then it stopped everything it started, as it does at its normal end
        left = [p for p in spawned if _alive(p)]
        assert not left, f"still running after the demo exited: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            demo.kill()
        demo.wait(timeout=30)
        for pid in spawned[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "kafka"), "stop", "--dir", str(KAFKA_DIR)],
            capture_output=True,
            timeout=60,
            check=False,
        )
        out.unlink(missing_ok=True)
