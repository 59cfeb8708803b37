"""Profiling the proxy from its first delivery to its N-th: ``python -m bench.profiling
profile-proxy cprofile|pyinstrument|threads|stages OUT ARGS...`` runs ``consumer-proxy ARGS``
with a profiler that SIGUSR1 starts and SIGUSR2 stops (``BenchProxy(profile=...)`` sends
them), and :func:`summarise_cprofile` reads a dump as shares of the event loop's busy time
(``threads``: each thread's CPU and the collector's passes, :func:`threads_proxy_main`).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

STAGES = (
    "submitted",
    "asked",
    "consumer_thread",
    "event_loop",
    "ready",
    "taken",
    "push",
    "sent",
    "answered",
)
"""Where ``stages`` stamps a record on its way through the proxy: the event loop submitted the
consume that returned it to the consumer thread, the consumer thread began
the consume that returned it (below the record's own latency there: it was waiting already),
handed over by librdkafka on the consumer thread, received on the event loop, in the ready
queue (taken in by the core), taken into a call (batch mode), its push starting (the request
not built yet), its call sent (the request built), its call answered."""


def staged_proxy_main(out: str, argv: list[str]) -> int:
    """``consumer-proxy`` that stamps each record at each of :data:`STAGES` (wall clock minus
    the record's timestamp, ms) and writes ``{stage: [[offset, ms], ...]}`` as JSON to ``out``
    when it exits, with ``"gc"``: each collection as ``[wall ms at its start, ms, generation]``
    and ``"produced"``: each record's timestamp as ``[offset, ms]``
    (where the latency a proxy adds goes). It wraps some of the proxy's own methods
    (``Fetcher._run`` and ``Fetcher.consume``, ``ReadyDeque.put``/``put_batch``, batch mode's
    ``take``, ``Dispatcher.push`` and ``push_batch``, ``BatchPush._deliver``), so a rename
    there shows up here as a missing stage."""
    import contextvars
    import gc

    from consumer_proxy import batch_push, dispatcher, fetcher, readyq
    from consumer_proxy.cli import main as cli_main

    stamps: dict[str, list[tuple[int, float]]] = {stage: [] for stage in STAGES}
    pauses: list[tuple[float, float, int]] = []
    calling: contextvars.ContextVar[Any] = contextvars.ContextVar("calling", default=())

    produced: list[tuple[int, float]] = []

    def stamp(stage: str, records: Any, at_ms: float | None = None) -> None:
        """Book each record's latency at ``at_ms`` (wall clock, ms; by default now)."""
        now_ms = time.time() * 1000.0 if at_ms is None else at_ms
        book = stamps[stage].append
        for record in records:
            if record.error() is None:
                book((record.offset(), now_ms - record.timestamp()[1]))
                if stage == "consumer_thread":
                    produced.append((record.offset(), record.timestamp()[1]))

    def stamp_deliveries(stage: str, deliveries: Any) -> None:
        stamps[stage].extend(item_latencies(deliveries, time.time() * 1000.0))

    gc_started = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[:] = [time.time() * 1000.0, time.perf_counter()]
        else:
            ms = 1000.0 * (time.perf_counter() - gc_started[1])
            pauses.append((gc_started[0], ms, info["generation"]))

    gc.callbacks.append(on_gc)
    run, consume = fetcher.Fetcher._run, fetcher.Fetcher.consume

    async def staged_run(self: Any, fn: Any) -> Any:
        submitted = time.time() * 1000.0

        def call() -> Any:
            asked = time.time() * 1000.0
            result = fn()
            if fn.__name__ == "consume":
                stamp("consumer_thread", result)
                stamp("submitted", result, submitted)
                stamp("asked", result, asked)
            return result

        return await run(self, call)

    async def staged_consume(self: Any, max_messages: int, timeout_s: float) -> Any:
        records = await consume(self, max_messages, timeout_s)
        stamp("event_loop", records)
        return records

    put, put_batch = readyq.ReadyDeque.put, readyq.ReadyDeque.put_batch

    def staged_put(self: Any, delivery: Any) -> None:
        stamp_deliveries("ready", [delivery])
        put(self, delivery)

    def staged_put_batch(self: Any, deliveries: Any) -> None:
        stamp_deliveries("ready", deliveries)
        put_batch(self, deliveries)

    take = batch_push.take  # type: ignore[attr-defined]

    def staged_take(*args: Any) -> Any:
        batch = take(*args)
        stamp_deliveries("taken", batch)
        return batch

    unary, batch = dispatcher.Dispatcher.push, batch_push.BatchPush._deliver
    push_batch = dispatcher.Dispatcher.push_batch

    async def staged_push(self: Any, request: Any, endpoint: Any, metadata: Any = None) -> Any:
        message = request.message
        stamps["push"].append((message.offset, time.time() * 1000.0 - message.timestamp_ms))
        stamps["sent"].append((message.offset, time.time() * 1000.0 - message.timestamp_ms))
        result = await unary(self, request, endpoint, metadata)
        stamps["answered"].append((message.offset, time.time() * 1000.0 - message.timestamp_ms))
        return result

    async def staged_batch(
        self: Any, deliveries: Any, probe: bool, endpoint: Any, *rest: Any
    ) -> Any:
        stamp_deliveries("push", deliveries)
        calling.set(deliveries)
        result = await batch(self, deliveries, probe, endpoint, *rest)
        stamp_deliveries("answered", deliveries)
        return result

    async def staged_push_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        stamp_deliveries("sent", calling.get())
        return await push_batch(self, *args, **kwargs)

    fetcher.Fetcher._run = staged_run  # type: ignore[method-assign]
    fetcher.Fetcher.consume = staged_consume  # type: ignore[method-assign]
    readyq.ReadyDeque.put = staged_put  # type: ignore[method-assign]
    readyq.ReadyDeque.put_batch = staged_put_batch  # type: ignore[method-assign,assignment]
    batch_push.take = staged_take  # type: ignore[attr-defined,assignment]
    dispatcher.Dispatcher.push = staged_push  # type: ignore[method-assign]
    dispatcher.Dispatcher.push_batch = staged_push_batch  # type: ignore[method-assign]
    batch_push.BatchPush._deliver = staged_batch  # type: ignore[method-assign,assignment]
    try:
        code: int = cli_main(argv)
    finally:
        Path(out).write_text(json.dumps({**stamps, "gc": pauses, "produced": produced}))
    return code


def item_latencies(items: Any, now_ms: float) -> list[tuple[int, float]]:
    """Each message of ready items (``Delivery``s, and batch mode's ``Run``s: a run is its
    records) as ``(offset, ms since its record's timestamp)`` at ``now_ms``."""
    from consumer_proxy.core.partitions import Run

    found: list[tuple[int, float]] = []
    for item in items:
        if isinstance(item, Run):
            for record, offset in zip(item.records, item.offsets, strict=True):
                found.append((offset, now_ms - record.timestamp()[1]))
        else:
            found.append((item.offset, now_ms - item.origin.timestamp_ms))
    return found


def _thread_cpu_ns() -> dict[str, int]:
    """Each thread's CPU nanoseconds so far (``/proc``'s schedstat), by its name: the Python
    name of a Python thread (the main one: the event loop), else the OS's (librdkafka's,
    gRPC's); threads of the same name summed."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue  # (a thread that ended meanwhile)
        found[name] = found.get(name, 0) + ns
    return found


def threads_proxy_main(out: str, argv: list[str]) -> int:
    """``consumer-proxy`` that writes, between SIGUSR1 and SIGUSR2, each thread's CPU
    nanoseconds and the garbage collector's passes per generation (count, ns) to ``out`` as
    JSON (where a difference in the process's CPU goes, by thread)."""
    import gc

    from consumer_proxy.cli import main as cli_main

    passes: dict[int, list[int]] = {0: [0, 0], 1: [0, 0], 2: [0, 0]}
    pass_started = [0]
    first: dict[str, int] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            pass_started[0] = time.perf_counter_ns()
        else:
            book = passes[info["generation"]]
            book[0] += 1
            book[1] += time.perf_counter_ns() - pass_started[0]

    def start(_signum: int, _frame: object) -> None:
        for book in passes.values():
            book[:] = [0, 0]
        first.update(_thread_cpu_ns())
        gc.callbacks.append(on_gc)

    def stop(_signum: int, _frame: object) -> None:
        gc.callbacks.remove(on_gc)
        cpu = {name: ns - first.get(name, 0) for name, ns in _thread_cpu_ns().items()}
        Path(out).write_text(json.dumps({"thread_cpu_ns": cpu, "gc": passes}))
        Path(f"{out}.done").touch()

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    code: int = cli_main(argv)
    return code


def profiled_proxy_main(kind: str, out: str, argv: list[str]) -> int:
    """``consumer-proxy`` with a profiler that SIGUSR1 starts and SIGUSR2 stops and saves
    (``kind`` "stages": :func:`staged_proxy_main` instead).

    Both signal handlers run on the main thread, between two bytecodes of the event loop, so
    the profiler sees exactly the loop's thread (not the consumer's executor thread).
    """
    if kind == "stages":
        return staged_proxy_main(out, argv)
    if kind == "threads":
        return threads_proxy_main(out, argv)
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["profile-proxy"] and len(sys.argv) > 4:
        sys.exit(profiled_proxy_main(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(
        "usage: python -m bench.profiling profile-proxy cprofile|pyinstrument|threads|stages "
        "OUT ARGS..."
    )
