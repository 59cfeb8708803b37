#!/usr/bin/env python3
"""Throughput against the floor: the proxy vs a bare consume-push-commit loop (issue 34, item 3).

The workload of issue 13: 200,000 pre-produced 100-byte records on 4 partitions, a no-op
batch handler (the Go bench handler, ``--handler python`` for the grpc.aio one with its cheap
books), each run a fresh group reading from the start:

- **floor**: ``bench.floors`` ``throughput``: a bare Python loop that consumes, pushes the same
  batches (``HandleMessageBatch`` of up to 500 records, 4 calls in flight) and commits what
  was answered every 100 ms; no tracking, no windows.
- **proxy**: ``consumer-proxy run`` making the same calls: ``batch.max_messages`` 500,
  ``concurrency`` 4 (calls), ``commit_interval_ms`` 100; ``max_in_flight`` 20,000 and
  ``fetch_batch`` 5,000 (the settings of ``bench_batch.py``: its window must not be what
  limits it).
- **proxy, defaults**: the same proxy with its delivery defaults (``batch: auto``,
  ``max_messages`` 100, 100 calls, a 1,000 window, commits every second): what a new user
  gets.

Both consume with the same librdkafka settings: the floor takes the proxy's consumer settings
(``floor_client``: its defaults, a batch group's ``fetch.wait.max.ms``, ``--proxy-client``),
but for group membership and commits.

What the default figure measures: librdkafka stops fetching a partition for
``fetch.queue.backoff.ms`` (1,000 ms by default) once its prefetch queue holds
``queued.min.messages`` (100,000). Both sides fill it within the first ~0.2 s, drain it, and
then wait for the backoff: about half of each run (measured 2026-11-26: the floor consumed
50 % of the records by ~350 ms and 75 % at ~1,200 ms). The shared wait pulls the ratio
towards 1 and adds most of its noise. ``--proxy-client fetch.queue.backoff.ms=10`` (both
sides take it) measures the consume-push-commit path alone: floor ~380,000 msg/s, proxy
~165,000, ratio 0.42-0.44 in five of five rounds.

Interleaved rounds (floor, proxy, proxy defaults; the order rotates each round) after a
warm-up round that is not counted (``--warmup``). The rate is
committed msg/s: N / (first arrival at the handler -> every offset committed), read on one
client. Target: **proxy >= 0.9 x floor**, the median of per-round ratios. Also CPU
microseconds per message (first arrival -> N-th) of each. ``--workers N`` runs the proxy as N
processes (the floor stays one): a figure of its own, never the single-process one.
``--baseline-root DIR`` adds the proxy of another checkout to every round (``baseline``: the
proxy's settings above, run from ``DIR``): before/after from one run, ``proxy_over_baseline``
the median of per-round ratios.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.floors import FloorProcess
from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, rotated
from bench.offsets import CommittedReader
from bench.options import ROOT, BenchOptions, broker, client_settings
from bench.producing import produce_bulk, sized_value
from bench.proxy import BenchProxy, bench_config, drain, drain_figures
from consumer_proxy.adapters import group_consumer_config
from consumer_proxy.config import ProxyConfig
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(handler=True, proxy_client=True, rounds=3, warmup=1)

VALUE_BYTES = 100
MAX_MESSAGES = 500
CALLS = 4
COMMIT_INTERVAL_MS = 100
TARGET = 0.9
FETCH_BATCH = 5000  # the proxy's delivery.fetch_batch (--fetch-batch)
PROXY_DELIVERY = {
    "batch": {"max_messages": MAX_MESSAGES},
    "concurrency": CALLS,
    "commit_interval_ms": COMMIT_INTERVAL_MS,
    "max_in_flight": 20_000,
    "fetch_batch": FETCH_BATCH,
}
CONTENDERS = ("floor", "proxy", "proxy_defaults")
BASELINE = "baseline"  # the proxy of another checkout (--baseline-root), the proxy's settings


FLOOR_OWN = (
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "partition.assignment.strategy",
)
"""The proxy's consumer settings the floor does not take: its group membership and how it
commits (the floor commits what was answered, by itself)."""


def floor_client(config: dict[str, Any]) -> list[str]:
    """The librdkafka settings of the proxy's consumer for ``config`` (its defaults, a batch
    group's additions, ``--proxy-client``) as the floor's ``--client`` arguments: the same
    fetch path on both sides (the floor took librdkafka's defaults before: another prefetch
    bound and fetch long-poll)."""
    proxy = ProxyConfig.model_validate(config)
    settings = group_consumer_config(proxy.kafka, proxy.groups[0])
    return [
        f"{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in settings.items()
        if key not in FLOOR_OWN
    ]


def run_one(
    who: str,
    bootstrap: str,
    handler: HandlerServer,
    topic: str,
    n: int,
    client: dict[str, str] | None = None,
    workers: int = 1,
    baseline_root: Path | None = None,
    fetch_batch: int = FETCH_BATCH,
) -> dict[str, Any]:
    """One fresh group drains ``topic`` through the floor or the proxy (``workers``
    processes; ``baseline``: the proxy in ``baseline_root``; ``fetch_batch`` of the proxy's
    settings)."""
    group = unique_name(f"bench-tput-{who}")
    process: BenchProxy | FloorProcess
    if who == "floor":
        args = ["--bootstrap", bootstrap, "--topic", topic, "--group", group]
        args += ["--address", handler.address, "-n", str(n), "--max-messages", str(MAX_MESSAGES)]
        args += ["--concurrency", str(CALLS), "--commit-interval-ms", str(COMMIT_INTERVAL_MS)]
        proxy = bench_config(bootstrap, group, [topic], [handler.address], PROXY_DELIVERY, client)
        args += ["--client", *floor_client(proxy)]
        process = FloorProcess("throughput", *args)
    else:
        delivery = (
            {"batch": "auto"}
            if who == "proxy_defaults"
            else {**PROXY_DELIVERY, "fetch_batch": fetch_batch}
        )
        config = bench_config(bootstrap, group, [topic], [handler.address], delivery, client)
        root = baseline_root if who == BASELINE and baseline_root is not None else ROOT
        process = BenchProxy(config, workers=workers, root=root)
    handler.reset()
    with CommittedReader(bootstrap, group, topic) as reader:
        reader.sum()  # the reader's connection and coordinator lookup, before the clock runs
        with process:
            drained = drain(handler, process, reader, n, time.monotonic() + 300)
    return drain_figures(n, drained, process.started_at)


def throughput_rounds(
    bootstrap: str,
    handler: HandlerServer,
    topic: str,
    n: int,
    rounds: int,
    client: dict[str, str] | None = None,
    workers: int = 1,
    baseline_root: Path | None = None,
    fetch_batch: int = FETCH_BATCH,
    warmup: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """Interleaved rounds of every contender over the same records, after ``warmup`` rounds
    that are not counted (the first run on a fresh broker and handler is slower, and it was
    always the floor's: round 1's ratio came out 0.03-0.08 above the others)."""
    contenders = CONTENDERS + ((BASELINE,) if baseline_root is not None else ())
    runs: dict[str, list[dict[str, Any]]] = {who: [] for who in contenders}
    for round_ in range(-warmup, rounds):
        order = rotated(contenders, round_)
        for who in order:
            run = run_one(
                who, bootstrap, handler, topic, n, client, workers, baseline_root, fetch_batch
            )
            if round_ >= 0:
                runs[who].append(run)
            print(
                f"  {f'round {round_ + 1}' if round_ >= 0 else 'warm-up':<8} {who:<14}: "
                f"committed {run['committed_rate']:,.0f} msg/s "
                f"(seen {run['seen_rate']:,.0f}), CPU {run['client_cpu_us_per_msg']:.1f} "
                f"us/msg, {run['calls']} calls (mean {run['mean_batch']:.0f}), "
                f"duplicates {run['duplicates']:.0f}",
                flush=True,
            )
    return runs


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=200_000, help="records")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the proxy's worker processes (--workers N; the floor stays one process): a "
        "figure of its own, not the single-process one",
    )
    parser.add_argument(
        "--baseline-root",
        type=Path,
        help="a checkout whose proxy runs in every round too, with the proxy's settings "
        "(before/after in one run)",
    )
    parser.add_argument(
        "--fetch-batch",
        type=int,
        default=FETCH_BATCH,
        help="the proxy's (and the baseline's) delivery.fetch_batch (the floor takes up to "
        f"{MAX_MESSAGES} records a poll)",
    )
    args = parser.parse_args()
    n = 40_000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    warmup = 0 if args.quick else args.warmup
    client = client_settings(args.proxy_client)
    result = Result(
        "bench_throughput",
        params={
            "n": n,
            "rounds": rounds,
            "warmup": warmup,
            "handler": args.handler,
            "proxy": {**PROXY_DELIVERY, "fetch_batch": args.fetch_batch},
            "client": client,
            "workers": args.workers,
            "baseline_root": str(args.baseline_root or ""),
        },
    )
    med = statistics.median
    with broker(args.bootstrap) as bootstrap:
        topic = create_topic(bootstrap, unique_name("bench-tput"), partitions=4)
        produce_bulk(bootstrap, topic, n, partitions=4, value=sized_value)
        with HandlerServer(HandlerSpec(count_only=True), args.handler) as handler:
            runs = throughput_rounds(
                bootstrap,
                handler,
                topic,
                n,
                rounds,
                client,
                args.workers,
                args.baseline_root,
                args.fetch_batch,
                warmup,
            )
    for who in runs:
        result.figure(f"{who}.committed_msgs_per_s", med(r["committed_rate"] for r in runs[who]))
        result.figure(
            f"{who}.cpu_us_per_msg", med(r["client_cpu_us_per_msg"] for r in runs[who]), "us"
        )
    result.figures["runs"] = runs
    floor = runs["floor"]
    if BASELINE in runs:
        result.ratio(
            "proxy_over_baseline",
            med(
                p["committed_rate"] / b["committed_rate"]
                for b, p in zip(runs[BASELINE], runs["proxy"], strict=True)
            ),
        )
    for who in [w for w in ("proxy", "proxy_defaults", BASELINE) if w in runs]:
        per_round = [
            p["committed_rate"] / f["committed_rate"] for f, p in zip(floor, runs[who], strict=True)
        ]
        result.figures[f"{who}_over_floor_per_round"] = [round(r, 3) for r in per_round]
        result.ratio(f"{who}_over_floor", med(per_round), TARGET if who == "proxy" else None)
        result.ratio(
            f"{who}_cpu_over_floor_cpu",
            med(
                p["client_cpu_us_per_msg"] / f["client_cpu_us_per_msg"]
                for f, p in zip(floor, runs[who], strict=True)
            ),
        )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
