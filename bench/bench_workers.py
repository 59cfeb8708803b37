#!/usr/bin/env python3
"""Scale-out: ``consumer-proxy run --workers 2`` vs ``--workers 1`` on the same load.

The handler (its own process) takes 5 ms per message. Each run starts the real command line
with a fresh group on a fresh topic of 8 partitions; with 2 workers Kafka's group protocol
(cooperative-sticky) spreads the partitions over the two processes, each with its own
``delivery.concurrency`` (100 by default, so twice the calls in flight in total). Once every
worker owns partitions and together they own all 8 (read from the proxy's log; the time it
took is reported as "group settled"), N messages are produced in bulk: the rates measure the
settled group, not the join and the rebalance.

Rates are measured at the handler, as in bench_push: ``seen`` = N-1 over first delivery ->
N-th distinct message, ``steady`` = the 10%..90% arrivals (the second worker's join and the
rebalance are outside that span), ``committed`` = N over first delivery -> all committed.
Runs alternate (1, 2, 1, 2, ...) so the neighbours' load hits both alike; the ratio is the
median of the per-round ratios.

The machine has 2 cores, shared by both workers, the handler and the broker: a ratio near 1
means the proxy was CPU-bound, not that the workers fail to share partitions.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from common import (
    HandlerServer,
    HandlerSpec,
    Result,
    base_parser,
    broker,
    create_topic,
    produce_bulk,
    proxy_backlog_run,
    unique_name,
)

PARTITIONS = 8
HANDLER_MS = 5.0


def main() -> int:
    parser = base_parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=30000, help="messages per run (default 30000)")
    parser.add_argument("--concurrency", type=int, default=100, help="per worker (default 100)")
    parser.add_argument("--rounds", type=int, default=2, help="(1, 2) pairs (default 2)")
    parser.add_argument(
        "--redrive-partitions", type=int, default=0, metavar="P",
        help="create each group's redrive topic with P partitions before the proxy starts "
        "(default 0: the proxy creates it, with as many partitions as the source topic)",
    )
    args = parser.parse_args()
    n, rounds = (6000, 1) if args.quick else (args.n, args.rounds)
    result = Result("bench_workers", params={
        "n": n, "partitions": PARTITIONS, "handler_ms": HANDLER_MS,
        "concurrency_per_worker": args.concurrency, "rounds": rounds,
        "redrive_partitions": args.redrive_partitions or "as the proxy creates it",
    })
    delivery = {"concurrency": args.concurrency, "commit_interval_ms": 200}
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    with broker(args.bootstrap) as bootstrap, HandlerServer(HandlerSpec(HANDLER_MS)) as handler:
        for round_ in range(rounds):
            for workers in (1, 2):
                print(f"round {round_ + 1}/{rounds}: --workers {workers}", flush=True)
                topic = create_topic(
                    bootstrap, unique_name("bench-workers"), partitions=PARTITIONS
                )
                group = unique_name("bench-workers")
                if args.redrive_partitions:
                    create_topic(bootstrap, f"{group}.redrive", args.redrive_partitions)
                run = proxy_backlog_run(
                    bootstrap, handler, topic, n, delivery, workers=workers, group=group,
                    produce_after_join=lambda t=topic: produce_bulk(
                        bootstrap, t, n, partitions=PARTITIONS
                    ),
                )
                # Source partitions per member, as the broker described the group when the
                # messages were produced: whether the work was actually split.
                split = sorted(len(m.get(topic, [])) for m in run["members"])
                run["source_partitions_per_member"] = split
                print(f"  seen {run['seen_rate']:,.0f}/s, steady {run['steady_rate']:,.0f}/s, "
                      f"committed {run['committed_rate']:,.0f}/s; group settled after "
                      f"{run['settled_s']:.1f}s, source partitions per member {split}; CPU/msg "
                      f"proxy {run['client_cpu_us_per_msg']:.0f}us; duplicates "
                      f"{run['duplicates']:.0f}", flush=True)
                runs[workers].append(run)
    for workers in (1, 2):
        for key in ("seen_rate", "steady_rate", "committed_rate"):
            result.figure(f"workers{workers}.{key.replace('_rate', '')}_msgs_per_s",
                          statistics.median(r[key] for r in runs[workers]), "msg/s")
        result.figure(f"workers{workers}.group_settled_s",
                      round(statistics.median(r["settled_s"] for r in runs[workers]), 1), "s")
        result.figure(f"workers{workers}.proxy_cpu_us_per_msg",
                      round(statistics.median(r["client_cpu_us_per_msg"] for r in runs[workers]),
                            1), "us")
        result.figure(f"workers{workers}.duplicates",
                      int(sum(r["duplicates"] for r in runs[workers])))
    splits = [r["source_partitions_per_member"] for r in runs[2]]
    result.figure("workers2.source_partitions_per_member", splits)
    unsplit = sum(1 for s in splits if min(s, default=0) == 0)
    if unsplit:
        result.note(f"{unsplit} of {len(splits)} --workers 2 runs had every partition of the "
                    "source topic on one member (the other held only redrive partitions): "
                    "those runs did not scale out")
    result.figures["runs"] = runs
    for key in ("seen_rate", "steady_rate", "committed_rate"):
        per_round = [b[key] / a[key] for a, b in zip(runs[1], runs[2], strict=True)]
        result.ratio(f"workers2_over_workers1.{key.replace('_rate', '')}",
                     statistics.median(per_round))
    split_rounds = [
        (a, b) for a, b in zip(runs[1], runs[2], strict=True)
        if min(b["source_partitions_per_member"], default=0) > 0
    ]
    if split_rounds and unsplit:
        result.ratio("workers2_over_workers1.steady_split_runs_only",
                     statistics.median(b["steady_rate"] / a["steady_rate"]
                                       for a, b in split_rounds))
    result.note("2 cores shared by the workers, the handler and the broker")
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
