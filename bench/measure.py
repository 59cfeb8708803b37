"""Measurement: CPU time from /proc, waiting, percentiles and rates, and the ``Result`` every
bench prints as it goes and writes as JSON to ``bench/results/<bench>-<time>.json`` (a
``ratios`` mapping ``{name: {"value", "target", "meets"}}``, which ``run_all.py`` tabulates).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from bench.options import ROOT

T = TypeVar("T")

RESULTS_DIR = ROOT / "bench" / "results"


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


class Child:
    """A child process a bench measures (set ``proc`` when it starts): its pid, its CPU
    seconds, and a stop by SIGTERM, then SIGKILL."""

    proc: subprocess.Popen[Any] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU seconds of the process and its children so far."""
        return cpu_seconds(self.pid)

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout_s``; the exit code (None when never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode


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


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in the order of interleaved round ``round_`` (each round starts one later), so
    that no contender always runs first on a fresh broker and handler, or last on a warm one."""
    shift = round_ % len(items)
    return [*items[shift:], *items[:shift]]


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
    """One bench run's figures and ratios, printed as it goes and written as JSON, with the
    machine's load average when it was made and when written (how shared the run was), and
    how long the bench took in between."""

    bench: str
    params: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loadavg_at_start: list[float] = field(default_factory=lambda: list(os.getloadavg()))
    started: float = field(default_factory=time.monotonic)

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
                "loadavg": list(os.getloadavg()),
            },
        }
        data["seconds"] = round(time.monotonic() - self.started, 1)
        path.write_text(json.dumps(data, indent=2, default=str))
        print(
            f"load average {self.loadavg_at_start[0]:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end; {data['seconds']:.0f} s",
            flush=True,
        )
        print(f"result written to {path.relative_to(ROOT)}", flush=True)
        return path


def rate(n: int, seconds: float) -> float:
    """n / seconds, 0 for an empty interval."""
    return n / seconds if seconds > 0 else 0.0


def mean(values: Sequence[float]) -> float | None:
    """The arithmetic mean; None for no values."""
    return statistics.fmean(values) if values else None


def load_average() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15 minute load averages (how shared the run was)."""
    return os.getloadavg()
