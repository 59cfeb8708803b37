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

``--profile cprofile|pyinstrument`` adds, per concurrency, one profiled proxy run (its event
loop from the first delivery to the N-th) and, with cProfile, one profiled bare run, and prints
their hot spots: own time summed by module and by function, as shares of the loop's busy time
and microseconds per message. pyinstrument is not a dependency: ``pip install --target DIR
pyinstrument`` and run with ``PYTHONPATH=DIR``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.handlers import HandlerServer, HandlerSpec
from bench.loops import run_bare_loop
from bench.measure import RESULTS_DIR, Result, rate, steady_rate
from bench.options import ROOT, BenchOptions, broker
from bench.producing import produce_bulk
from bench.profiling import summarise_cprofile
from bench.proxy import proxy_backlog_run
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions()

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
) -> dict[str, Any]:
    """One proxy run over the whole topic with a fresh group."""
    return proxy_backlog_run(
        bootstrap,
        handler,
        topic,
        n,
        {"concurrency": concurrency, "commit_interval_ms": 200},
        profile=profile,
        profile_out=profile_out,
    )


def bare_run(handler: HandlerServer, n: int, concurrency: int) -> dict[str, float]:
    handler.reset()
    handler_cpu = handler.progress()[4]
    timing = run_bare_loop(handler.address, n, concurrency)
    handler_cpu = handler.progress()[4] - handler_cpu
    stats = handler.stats()
    seen = stats["first_seen"]
    return {
        "seen_rate": rate(len(seen) - 1, seen[-1] - seen[0]),
        "steady_rate": steady_rate(seen) or 0.0,
        "client_rate": rate(n - 1, timing["ended"] - timing["started"]),
        "errors": timing["errors"],
        "client_cpu_us_per_msg": 1e6 * timing["cpu_s"] / n,
        "handler_cpu_us_per_msg": 1e6 * handler_cpu / n,
    }


def profile_runs(
    bootstrap: str,
    handler: HandlerServer,
    topic: str,
    n: int,
    concurrency: int,
    kind: str,
    result: Result,
) -> None:
    """One profiled proxy run (and, with cProfile, one profiled bare run) and their hot spots.

    The proxy's profiler covers its event-loop thread from the first delivery to the N-th;
    the bare loop's covers its timed part. Both profilers slow their process down (cProfile
    about 2x), so the rates of these runs are not comparable with the measured ones.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suffix = "txt" if kind == "pyinstrument" else "prof"
    out = RESULTS_DIR / f"bench_push-profile-proxy-c{concurrency}-{stamp}.{suffix}"
    print(f"profiled proxy run ({kind}, concurrency {concurrency})", flush=True)
    prof = proxy_run(bootstrap, handler, topic, n, concurrency, profile=kind, profile_out=out)
    profiled = int(prof["profiled_messages"])
    result.figure(f"profiled.c{concurrency}.proxy_msgs_per_s_seen", prof["seen_rate"], "msg/s")
    result.figures[f"profiled.c{concurrency}.proxy_file"] = str(out.relative_to(ROOT))
    if kind == "pyinstrument":
        text = out.read_text()
        print(text, flush=True)
        result.figures[f"profiled.c{concurrency}.proxy"] = text.splitlines()
        return
    lines = summarise_cprofile(out, profiled)
    print("\n".join(f"  {line}" for line in lines), flush=True)
    result.figures[f"profiled.c{concurrency}.proxy"] = lines
    bare_out = RESULTS_DIR / f"bench_push-profile-bare-c{concurrency}-{stamp}.prof"
    print(f"profiled bare run (cProfile, concurrency {concurrency})", flush=True)
    handler.reset()
    timing = run_bare_loop(handler.address, n, concurrency, profile_out=bare_out)
    result.figure(
        f"profiled.c{concurrency}.bare_msgs_per_s",
        rate(n - 1, timing["ended"] - timing["started"]),
        "msg/s",
    )
    lines = summarise_cprofile(bare_out, n)
    print("\n".join(f"  {line}" for line in lines), flush=True)
    result.figures[f"profiled.c{concurrency}.bare"] = lines
    result.figures[f"profiled.c{concurrency}.bare_file"] = str(bare_out.relative_to(ROOT))


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=20000, help="messages per run (default 20000)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[100, 200], help="default: 100 200"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="bare/proxy pairs per concurrency (default 3)"
    )
    parser.add_argument("--profile", choices=["cprofile", "pyinstrument"], default=None)
    args = parser.parse_args()
    n = 5000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    result = Result(
        "bench_push",
        params={
            "n": n,
            "partitions": PARTITIONS,
            "concurrency": args.concurrency,
            "rounds": rounds,
            "handler": "no-op (separate process)",
            "value_bytes": 16,
        },
    )
    with broker(args.bootstrap) as bootstrap, HandlerServer(HandlerSpec()) as handler:
        topic = create_topic(bootstrap, unique_name("bench-push"), partitions=PARTITIONS)
        started = time.monotonic()
        produce_bulk(bootstrap, topic, n, partitions=PARTITIONS)
        print(
            f"produced {n} messages to {topic} ({PARTITIONS} partitions) in "
            f"{time.monotonic() - started:.1f}s",
            flush=True,
        )
        for concurrency in args.concurrency:
            bares, proxies = [], []
            for round_ in range(rounds):
                # Alternating, so a change in the neighbours' load hits both sides alike.
                print(f"concurrency {concurrency}, round {round_ + 1}/{rounds}", flush=True)
                bare = bare_run(handler, n, concurrency)
                print(
                    f"  bare : seen {bare['seen_rate']:,.0f}/s (steady "
                    f"{bare['steady_rate']:,.0f}/s); CPU/msg client "
                    f"{bare['client_cpu_us_per_msg']:.0f}us handler "
                    f"{bare['handler_cpu_us_per_msg']:.0f}us",
                    flush=True,
                )
                prox = proxy_run(bootstrap, handler, topic, n, concurrency)
                print(
                    f"  proxy: seen {prox['seen_rate']:,.0f}/s (steady "
                    f"{prox['steady_rate']:,.0f}/s), committed {prox['committed_rate']:,.0f}/s,"
                    f" start-up {prox['startup_s']:.1f}s; CPU/msg proxy "
                    f"{prox['client_cpu_us_per_msg']:.0f}us handler "
                    f"{prox['handler_cpu_us_per_msg']:.0f}us",
                    flush=True,
                )
                bares.append(bare)
                proxies.append(prox)
            c = f"c{concurrency}"

            def med(runs: list[dict[str, float]], key: str) -> float:
                return statistics.median(r[key] for r in runs)

            bare_rate, proxy_rate = med(bares, "seen_rate"), med(proxies, "seen_rate")
            result.figure(f"{c}.bare_msgs_per_s", bare_rate, "msg/s")
            result.figure(f"{c}.proxy_msgs_per_s_seen", proxy_rate, "msg/s")
            result.figure(f"{c}.proxy_msgs_per_s_steady", med(proxies, "steady_rate"), "msg/s")
            result.figure(
                f"{c}.proxy_msgs_per_s_to_committed", med(proxies, "committed_rate"), "msg/s"
            )
            result.figure(f"{c}.proxy_startup_s", round(med(proxies, "startup_s"), 2), "s")
            result.figure(
                f"{c}.proxy_duplicate_deliveries", int(sum(p["duplicates"] for p in proxies))
            )
            bare_cpu = med(bares, "client_cpu_us_per_msg")
            proxy_cpu = med(proxies, "client_cpu_us_per_msg")
            result.figure(f"{c}.bare_client_cpu_us_per_msg", round(bare_cpu, 1), "us")
            result.figure(f"{c}.proxy_cpu_us_per_msg", round(proxy_cpu, 1), "us")
            result.figure(
                f"{c}.handler_cpu_us_per_msg_bare",
                round(med(bares, "handler_cpu_us_per_msg"), 1),
                "us",
            )
            result.figure(
                f"{c}.handler_cpu_us_per_msg_proxy",
                round(med(proxies, "handler_cpu_us_per_msg"), 1),
                "us",
            )
            result.figures[f"{c}.runs"] = {"bare": bares, "proxy": proxies}
            pairs = list(zip(bares, proxies, strict=True))
            per_round = [p["seen_rate"] / b["seen_rate"] for b, p in pairs]
            result.figures[f"{c}.ratio_per_round"] = [round(r, 3) for r in per_round]
            result.ratio(f"{c}.proxy_over_bare", statistics.median(per_round), 0.8)
            result.ratio(
                f"{c}.proxy_committed_over_bare",
                statistics.median(p["committed_rate"] / b["seen_rate"] for b, p in pairs),
            )
            # CPU per message is what the neighbours' load disturbs least.
            result.ratio(f"{c}.bare_cpu_over_proxy_cpu", bare_cpu / proxy_cpu)
        if args.profile:
            for concurrency in args.concurrency:
                profile_runs(bootstrap, handler, topic, n, concurrency, args.profile, result)
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
