"""The proxy under test: ``consumer-proxy run`` as a child process (:class:`BenchProxy`, the
tests' ``ProxyProcess``), its configuration (:func:`bench_config`), and the common run of a
fresh group over a backlog (:func:`proxy_backlog_run`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from bench.handlers import HandlerServer
from bench.measure import cpu_seconds, rate, steady_rate, wait_for
from bench.offsets import CommittedReader, group_members
from bench.options import ROOT
from tests.support.kafka import partitions_of, unique_name
from tests.support.proxy import ProxyProcess, config_dict


def bench_config(
    bootstrap: str,
    group: str,
    topics: Sequence[str],
    endpoints: Sequence[str],
    delivery: dict[str, Any] | None = None,
    client: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The tests' one-group configuration with the bench's settings: metrics off (no port to
    pick), a 30 s service deadline, the proxy's own delivery defaults unless ``delivery``,
    but for ``batch``: off, as in the tests (the unary benches were written before the default
    became ``auto``); a bench that wants the default says ``{"batch": "auto"}``. ``client``:
    librdkafka properties (``kafka.client``)."""
    return config_dict(
        bootstrap,
        group,
        topics,
        endpoints,
        delivery=delivery,
        client=client,
        service={"timeout_ms": 30000},
        shutdown_grace_s=10,
        fast_delivery=False,
    )


class BenchProxy(ProxyProcess):
    """The tests' :class:`ProxyProcess` for ``consumer-proxy run --config F --workers N`` with
    a configuration dict, in a temporary directory of its own.

    ``profile`` ("cprofile" or "pyinstrument", the latter when importable) runs the same
    command under :func:`bench.profiling.profiled_proxy_main` instead: the profiler covers the
    main thread (the event loop) from :meth:`profile_start` to :meth:`profile_stop`, which writes
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
        root: Path = ROOT,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="cp-bench-proxy-")
        config_path = Path(self._dir.name) / "proxy.yaml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.profile_out = profile_out
        command = None
        if profile is not None:
            assert profile_out is not None
            command = [sys.executable, "-m", "bench.profiling", "profile-proxy", profile]
            command.append(str(profile_out))
        super().__init__(
            config_path,
            log_path or Path(self._dir.name) / "proxy.log",
            *("--workers", str(workers), "--log-level", log_level),
            command=command,
            env=env or {},
            cwd=root,
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


class Drained(Protocol):
    """What :func:`drain` needs of the process that consumes: the proxy or a floor."""

    def cpu_seconds(self) -> float: ...

    def check_alive(self) -> None: ...


def drain(
    handler: HandlerServer,
    process: Drained,
    reader: CommittedReader,
    n: int,
    deadline: float,
    on_first: Callable[[int], None] | None = None,
    on_last: Callable[[], object] | None = None,
    window_from: int = 1,
) -> dict[str, Any]:
    """Wait while ``process`` pushes ``n`` messages to ``handler`` and commits them all.

    Returns the monotonic ``first`` and ``last`` arrivals (see ``HandlerServer.progress``),
    ``committed_at``, the CPU seconds of the process and of the handler from the first arrival
    to the n-th (start-up left out), and the handler's ``stats``. ``on_first(seen)`` runs at the
    first arrival, ``on_last()`` at the n-th (a profiler's start and stop).

    ``window_from``: the CPU clock starts once that many messages arrived instead (a steady
    window: the start-up's one-time costs left out too); ``window_msgs`` is how many arrived
    between the two CPU readings (the handler's count as read just before each), the divisor
    of a CPU per message that does not depend on how late the first reading came.
    """
    cpu_first = cpu_last = handler_cpu_first = handler_cpu_last = 0.0
    seen_first = seen_last = 0
    started = False
    while True:
        seen, _calls, first, last, handler_cpu = handler.progress()
        if first is not None and not started and seen >= window_from:
            started = True
            cpu_first, handler_cpu_first, seen_first = process.cpu_seconds(), handler_cpu, seen
            if on_first is not None:
                on_first(seen)
        if seen >= n:
            cpu_last, handler_cpu_last, seen_last = process.cpu_seconds(), handler_cpu, seen
            if on_last is not None:
                on_last()
            break
        process.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} messages to push, {seen} arrived in time")
        time.sleep(0.02)
    assert first is not None and last is not None
    while reader.sum() < n:
        process.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError("not every offset was committed in time")
        time.sleep(0.01)
    return {
        "first": first,
        "last": last,
        "committed_at": time.monotonic(),
        "cpu_s": cpu_last - cpu_first,
        "handler_cpu_s": handler_cpu_last - handler_cpu_first,
        "window_msgs": seen_last - seen_first,
        "stats": handler.stats(),
    }


def drain_figures(n: int, drained: dict[str, Any], started_at: float) -> dict[str, Any]:
    """The figures of a :func:`drain`: rates, CPU per message, duplicates, batch sizes."""
    stats = drained["stats"]
    first = drained["first"]
    sizes = stats["sizes"]
    calls = stats["calls"]
    distinct = stats["distinct"] or stats["deliveries"]  # count_only books count deliveries
    return {
        "seen_rate": rate(n - 1, drained["last"] - first),
        "steady_rate": steady_rate(stats["first_seen"]) or 0.0,
        "committed_rate": rate(n, drained["committed_at"] - first),
        "startup_s": first - started_at,
        "duplicates": float(stats["deliveries"] - distinct),
        "client_cpu_us_per_msg": 1e6 * drained["cpu_s"] / n,
        "window_msgs": drained["window_msgs"],
        "window_cpu_us_per_msg": 1e6 * drained["cpu_s"] / max(drained["window_msgs"], 1),
        "handler_cpu_us_per_msg": 1e6 * drained["handler_cpu_s"] / n,
        "calls": calls,
        "mean_batch": stats["deliveries"] / max(calls, 1),
        "sizes": sizes,
        "peak_calls": stats["peak_calls"],
    }


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
    window_from: int = 1,
) -> dict[str, Any]:
    """Run ``consumer-proxy run`` with a fresh group over a topic holding ``n`` messages.

    Returns: ``seen_rate`` (n-1 over first delivery -> the n-th distinct message's arrival, at
    the handler), ``steady_rate`` (10%..90% of the arrivals), ``committed_rate`` (n over first
    delivery -> every offset committed), ``startup_s`` (process start -> first delivery),
    ``duplicates`` (deliveries beyond the first per message) and CPU microseconds per message
    of the proxy (all its processes) and of the handler, from the first delivery to the n-th.
    With ``log_level="info"``, ``assignments``: {worker pid: partitions ever assigned}.
    ``window_from``: see :func:`drain` (``window_cpu_us_per_msg``: the CPU per message of that
    window, over the messages that arrived in it).

    ``produce_after_join``: the topic starts empty; the proxy starts, and once every one of
    its ``workers`` processes owns partitions, together they own all of ``topic``'s and no
    rebalance happened for 2 s (read from the log), ``produce_after_join()`` writes the n
    messages. ``settled_s`` is the time from start to that point and ``members`` the group's
    assignment then, as the broker describes it ({topic: [partitions]} per member).
    """
    group = group or unique_name("bench")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    config.update(sections or {})  # top-level config sections to add (``tracing``)
    handler.reset()
    if produce_after_join is not None:
        log_level = "info"  # the assignments are read from the log
    proxy = BenchProxy(
        config, workers=workers, profile=profile, profile_out=profile_out, log_level=log_level
    )
    settled_s = 0.0
    profiled_from = [0]
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

        def profile_from(seen: int) -> None:
            proxy.profile_start()
            profiled_from[0] = seen

        drained = drain(
            handler,
            proxy,
            reader,
            n,
            deadline,
            on_first=profile_from if profile else None,
            on_last=proxy.profile_stop if profile else None,
            window_from=window_from,
        )
    finally:
        reader.__exit__()
        try:
            code = proxy.stop()
            assignments = proxy.assignments()
            tail = proxy.log_tail()
        finally:
            proxy.cleanup()  # (its temporary directory, even when the stop timed out)
    if code not in (0, None):
        raise RuntimeError(f"the proxy exited with {code}:\n{tail}")
    return {
        "assignments": assignments,
        "settled_s": settled_s,
        "members": members,
        **drain_figures(n, drained, proxy.started_at),
        "profiled_messages": float(n - profiled_from[0]) if profile else 0.0,
    }
