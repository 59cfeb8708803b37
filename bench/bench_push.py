#!/usr/bin/env python3
"""Push overhead: the proxy (one process) vs a bare grpc.aio loop calling the same no-op handler.

Both sides call the same handler service (a no-op grpc.aio server in its own process) with the
same number of calls in flight:

- bare: a grpc.aio client in its own process sends N pre-built requests, ``concurrency`` at a
  time;
- proxy: ``consumer-proxy run`` (one worker process) consumes N pre-produced small messages
  from a topic of a few partitions, with ``delivery.concurrency = concurrency``.

Throughput is measured on the handler's side for both, the same way: N-1 over the time from the
first message's arrival to the N-th distinct message's arrival ("seen" rate). For the proxy it
also reports first arrival -> every offset committed ("committed" rate; commit_interval_ms=200)
and start-up (process start -> first arrival). The ratio proxy/bare of the seen rates is the
headline (target >= 0.8).

``--profile cprofile|pyinstrument`` adds one profiled proxy run and prints its hot spots.
"""

from __future__ import annotations

import pstats
import sys
import time
from pathlib import Path

from common import (
    RESULTS_DIR,
    HandlerServer,
    HandlerSpec,
    ProxyProcess,
    Result,
    base_parser,
    broker,
    committed_sum,
    create_topic,
    produce_bulk,
    proxy_config_yaml,
    rate,
    run_bare_loop,
    steady_rate,
    unique_name,
)

PARTITIONS = 4


def proxy_run(
    bootstrap: str,
    handler: HandlerServer,
    topic: str,
    n: int,
    concurrency: int,
    *,
    profile: str | None = None,
    profile_out: Path | None = None,
) -> dict[str, float]:
    """One proxy run over the whole topic with a fresh group; returns its timings."""
    group = unique_name("bench-push")
    config = proxy_config_yaml(
        bootstrap,
        group,
        [topic],
        [handler.address],
        {"concurrency": concurrency, "commit_interval_ms": 200},
    )
    handler.reset()
    proxy = ProxyProcess(config, profile=profile, profile_out=profile_out)
    try:
        proxy.start()
        deadline = time.monotonic() + 300
        while True:
            seen, _calls, first, last = handler.progress()
            if seen >= n:
                break
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy delivered {seen} of {n} in 300s")
            time.sleep(0.05)
        assert first is not None and last is not None
        while committed_sum(bootstrap, group, topic) < n:
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the proxy did not commit every offset")
            time.sleep(0.1)
        committed_at = time.monotonic()
        stats = handler.stats()
    finally:
        code = proxy.stop()
        proxy.cleanup()
    if code not in (0, None):
        raise RuntimeError(f"the proxy exited with {code}")
    return {
        "seen_rate": rate(n - 1, last - first),
        "steady_rate": steady_rate(stats["first_seen"]) or 0.0,
        "committed_rate": rate(n, committed_at - first),
        "startup_s": first - proxy.started_at,
        "duplicates": float(stats["calls"] - stats["distinct"]),
    }


def bare_run(handler: HandlerServer, n: int, concurrency: int) -> dict[str, float]:
    handler.reset()
    timing = run_bare_loop(handler.address, n, concurrency)
    stats = handler.stats()
    seen = stats["first_seen"]
    return {
        "seen_rate": rate(len(seen) - 1, seen[-1] - seen[0]),
        "steady_rate": steady_rate(seen) or 0.0,
        "client_rate": rate(n - 1, timing["ended"] - timing["started"]),
        "errors": timing["errors"],
    }


def show_profile(kind: str, path: Path, top: int = 25) -> list[str]:
    """Print (and return) the profile's hot spots."""
    lines: list[str] = []
    if kind == "pyinstrument":
        text = path.read_text()
        print(text)
        return text.splitlines()
    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    entries = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        entries.append((tt, ct, nc, f"{Path(file).name}:{line}({func})"))
    print(f"  cProfile of the proxy's main thread (event loop); total {total:.2f}s")
    print(f"  {'own s':>7} {'own %':>6} {'cum s':>7} {'cum %':>6} {'calls':>9}  function")
    for key, title in ((0, "by own time"), (1, "by cumulative time")):
        print(f"  -- {title}")
        for tt, ct, nc, name in sorted(entries, key=lambda e: -e[key])[:top]:
            line = (
                f"  {tt:7.2f} {100 * tt / total:5.1f}% {ct:7.2f} {100 * ct / total:5.1f}% "
                f"{nc:9d}  {name}"
            )
            print(line)
            lines.append(f"{title}: {line.strip()}")
    return lines


def main() -> int:
    parser = base_parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=30000, help="messages per run (default 30000)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[100, 200], help="default: 100 200"
    )
    parser.add_argument("--rounds", type=int, default=1, help="bare/proxy pairs per concurrency")
    parser.add_argument("--profile", choices=["cprofile", "pyinstrument"], default=None)
    args = parser.parse_args()
    n = 5000 if args.quick else args.n
    result = Result("bench_push", params={
        "n": n, "partitions": PARTITIONS, "concurrency": args.concurrency,
        "rounds": args.rounds, "handler": "no-op (separate process)", "value_bytes": 16,
    })
    with broker(args.bootstrap) as bootstrap, HandlerServer(HandlerSpec()) as handler:
        topic = create_topic(bootstrap, unique_name("bench-push"), partitions=PARTITIONS)
        started = time.monotonic()
        produce_bulk(bootstrap, topic, n, partitions=PARTITIONS)
        print(f"produced {n} messages to {topic} ({PARTITIONS} partitions) in "
              f"{time.monotonic() - started:.1f}s", flush=True)
        for concurrency in args.concurrency:
            bares, proxies = [], []
            for round_ in range(args.rounds):
                print(f"concurrency {concurrency}, round {round_ + 1}", flush=True)
                bare = bare_run(handler, n, concurrency)
                print(f"  bare : seen {bare['seen_rate']:,.0f}/s "
                      f"(steady {bare['steady_rate']:,.0f}/s)", flush=True)
                prox = proxy_run(bootstrap, handler, topic, n, concurrency)
                print(f"  proxy: seen {prox['seen_rate']:,.0f}/s (steady "
                      f"{prox['steady_rate']:,.0f}/s), committed {prox['committed_rate']:,.0f}/s,"
                      f" start-up {prox['startup_s']:.1f}s", flush=True)
                bares.append(bare)
                proxies.append(prox)
            bare_rate = max(b["seen_rate"] for b in bares)
            best = max(proxies, key=lambda p: p["seen_rate"])
            c = f"c{concurrency}"
            result.figure(f"{c}.bare_msgs_per_s", bare_rate, "msg/s")
            result.figure(f"{c}.proxy_msgs_per_s_seen", best["seen_rate"], "msg/s")
            result.figure(f"{c}.proxy_msgs_per_s_steady", best["steady_rate"], "msg/s")
            result.figure(f"{c}.proxy_msgs_per_s_to_committed", best["committed_rate"], "msg/s")
            result.figure(f"{c}.proxy_startup_s", round(best["startup_s"], 2), "s")
            result.figure(f"{c}.proxy_duplicate_deliveries", int(best["duplicates"]))
            result.figures[f"{c}.runs"] = {"bare": bares, "proxy": proxies}
            result.ratio(f"{c}.proxy_over_bare", best["seen_rate"] / bare_rate, 0.8)
            result.ratio(
                f"{c}.proxy_committed_over_bare", best["committed_rate"] / bare_rate
            )
        if args.profile:
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            out = RESULTS_DIR / f"bench_push-profile-{time.strftime('%Y%m%d-%H%M%S')}." + (
                "txt" if args.profile == "pyinstrument" else "prof"
            )
            concurrency = args.concurrency[0]
            print(f"profiled proxy run ({args.profile}, concurrency {concurrency})", flush=True)
            prof = proxy_run(
                bootstrap, handler, topic, n, concurrency, profile=args.profile, profile_out=out
            )
            result.figure("profiled.proxy_msgs_per_s_seen", prof["seen_rate"], "msg/s")
            result.figures["profile_file"] = str(out)
            result.figures["profile_top"] = show_profile(args.profile, out)
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
