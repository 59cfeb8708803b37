#!/usr/bin/env python3
"""Scale-out: ``consumer-proxy run --workers 2`` vs ``--workers 1`` on the same load.

The handler (its own process) takes 5 ms per message. Each run starts the real command line
with a fresh group on a fresh topic of 8 partitions; with 2 workers Kafka's group protocol
(cooperative-sticky) spreads the partitions over the two processes, each with its own
``delivery.concurrency`` (100 by default, so twice the calls in flight in total). Once every
worker owns partitions, together they own all 8 and no rebalance happened for 2 s (read from
the proxy's log; the time it took is reported as "group settled"), N messages are produced in
bulk: the rates measure the settled group, not the join and the rebalance. The group's
assignment at that moment (from the broker: describe_consumer_groups) is reported as the
source-topic partitions each member held.

Each group also subscribes to its redrive topic, which the proxy creates with as many
partitions as the source topic. The assignor balances the total partition count, so a member
can end up with every redrive partition and no source partition. Two variants run:

- ``proxy-created``: the redrive topic as the proxy creates it (what a user gets);
- ``redrive-1``: the bench creates ``<group>.redrive`` with 1 partition first (what the split
  gives when the redrive topic barely weighs in the balance).

Rates are measured at the handler, as in bench_push: ``seen`` = N-1 over first delivery ->
N-th distinct message, ``steady`` = the 10%..90% arrivals, ``committed`` = N over first
delivery -> all committed. Each round runs --workers 1, then --workers 2 for each variant, so
the neighbours' load hits all alike; a ratio is the median of the per-round ratios.

The machine has 2 cores, shared by both workers, the handler and the broker: even a perfect
split gives well under 2x here. The bench prints the ceiling two cores put on the rate
(2 s of CPU / (proxy + handler CPU per message), the broker not counted) and how close one
worker already gets to it.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk
from bench.proxy import proxy_backlog_run
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(rounds=2)

PARTITIONS = 8
HANDLER_MS = 5.0
VARIANTS = {"proxy-created": 0, "redrive-1": 1}  # name: redrive partitions (0: the proxy's)


def one_run(
    bootstrap: str,
    handler: HandlerServer,
    n: int,
    delivery: dict[str, Any],
    workers: int,
    redrive_partitions: int,
) -> dict[str, Any]:
    topic = create_topic(bootstrap, unique_name("bench-workers"), partitions=PARTITIONS)
    group = unique_name("bench-workers")
    if redrive_partitions:
        create_topic(bootstrap, f"{group}.redrive", redrive_partitions)
    run = proxy_backlog_run(
        bootstrap,
        handler,
        topic,
        n,
        delivery,
        workers=workers,
        group=group,
        produce_after_join=lambda: produce_bulk(bootstrap, topic, n, partitions=PARTITIONS),
    )
    # Whether the work was actually split: source partitions per member when producing.
    run["split"] = sorted(len(m.get(topic, [])) for m in run["members"])
    print(
        f"  seen {run['seen_rate']:,.0f}/s, steady {run['steady_rate']:,.0f}/s, committed "
        f"{run['committed_rate']:,.0f}/s; group settled after {run['settled_s']:.1f}s, "
        f"source partitions per member {run['split']}; CPU/msg proxy "
        f"{run['client_cpu_us_per_msg']:.0f}us; duplicates {run['duplicates']:.0f}",
        flush=True,
    )
    return run


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=30000, help="messages per run (default 30000)")
    parser.add_argument("--concurrency", type=int, default=100, help="per worker (default 100)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="--workers 2 variants (default: both)",
    )
    args = parser.parse_args()
    n, rounds = (6000, 1) if args.quick else (args.n, args.rounds)
    result = Result(
        "bench_workers",
        params={
            "n": n,
            "partitions": PARTITIONS,
            "handler_ms": HANDLER_MS,
            "concurrency_per_worker": args.concurrency,
            "rounds": rounds,
            "variants": args.variants,
        },
    )
    delivery = {"concurrency": args.concurrency, "commit_interval_ms": 200}
    runs: dict[str, list[dict[str, Any]]] = {"workers1": []}
    runs.update({f"workers2.{v}": [] for v in args.variants})
    with broker(args.bootstrap) as bootstrap, HandlerServer(HandlerSpec(HANDLER_MS)) as handler:
        for round_ in range(rounds):
            print(f"round {round_ + 1}/{rounds}: --workers 1", flush=True)
            runs["workers1"].append(one_run(bootstrap, handler, n, delivery, 1, 0))
            for variant in args.variants:
                print(f"round {round_ + 1}/{rounds}: --workers 2, {variant}", flush=True)
                runs[f"workers2.{variant}"].append(
                    one_run(bootstrap, handler, n, delivery, 2, VARIANTS[variant])
                )
    for label, group_runs in runs.items():
        for key in ("seen_rate", "steady_rate", "committed_rate"):
            result.figure(
                f"{label}.{key.replace('_rate', '')}_msgs_per_s",
                statistics.median(r[key] for r in group_runs),
                "msg/s",
            )
        result.figure(
            f"{label}.group_settled_s",
            round(statistics.median(r["settled_s"] for r in group_runs), 1),
            "s",
        )
        result.figure(
            f"{label}.proxy_cpu_us_per_msg",
            round(statistics.median(r["client_cpu_us_per_msg"] for r in group_runs), 1),
            "us",
        )
        result.figure(f"{label}.duplicates", int(sum(r["duplicates"] for r in group_runs)))
        result.figure(f"{label}.source_partitions_per_member", [r["split"] for r in group_runs])
    # What two cores can carry at all: the proxy's and the handler's CPU per message (the
    # broker's not counted) bound the rate whatever the number of workers.
    cpu = statistics.median(
        r["client_cpu_us_per_msg"] + r["handler_cpu_us_per_msg"] for r in runs["workers1"]
    )
    ceiling = 2 * 1e6 / cpu
    result.figure("cpu_us_per_msg_proxy_plus_handler", round(cpu, 1), "us")
    result.figure("two_core_ceiling_msgs_per_s", round(ceiling), "msg/s")
    result.figure(
        "workers1.steady_share_of_ceiling",
        round(statistics.median(r["steady_rate"] for r in runs["workers1"]) / ceiling, 2),
    )
    result.figures["runs"] = runs
    for variant in args.variants:
        label = f"workers2.{variant}"
        unsplit = sum(1 for r in runs[label] if min(r["split"]) == 0)
        if unsplit:
            result.note(
                f"{variant}: {unsplit} of {len(runs[label])} --workers 2 runs had every "
                "source partition on one member (the other held only redrive "
                "partitions): no scale-out in those runs"
            )
        for key in ("steady_rate", "seen_rate", "committed_rate"):
            per_round = [
                b[key] / a[key] for a, b in zip(runs["workers1"], runs[label], strict=True)
            ]
            result.ratio(
                f"{label}_over_workers1.{key.replace('_rate', '')}", statistics.median(per_round)
            )
    result.note("2 cores shared by the workers, the handler and the broker")
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
