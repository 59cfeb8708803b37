#!/usr/bin/env python3
"""delivery.ordering: key vs none vs partition, one partition, a 20 ms handler.

Parallel Consumer's README puts KEY ≈ UNORDERED ≈ 10 x PARTITION. Key mode has a ceiling:
at most one message per key in flight, so with K keys and a handler latency L it cannot beat
min(unordered rate, K / L): 100 keys at 20 ms is 5,000 msg/s. The target is key mode at
>= 0.8 of that ceiling, with the unordered rate measured in the same run.

One partition; each record's key is ``k<i % keys>`` (round robin: the best case for the gate
and the usual one for a busy topic). The handler (own process) sleeps 20 ms per call; it is
the Go one by default (``--handler python``: the grpc.aio one), because on a two-core box the
Python handler's own ~150 us per call and its sleeps' slippage were charged to every mode's
cycle, i.e. the bench measured the service as much as the proxy. Each run
is ``consumer-proxy run`` with a fresh group over a pre-produced backlog, concurrency 200 and
max_in_flight 10000, and measures the steady rate (10%..90% of the first arrivals at the
handler) and the committed rate. Rounds interleave none and key (the machine is shared and
noisy) and the ratio is the median of the per-round ratios; partition mode runs once on a
smaller backlog (it is 1 / (20 ms + overhead) whatever else happens). A last key-mode run with
10 keys shows the ceiling's K / L term (10 / 20 ms = 500 msg/s).

Diagnostics: by Little's law each mode's *cycle* (push -> answer -> next push in that slot) is
its in-flight cap / its rate (200 for none, min(keys, 200) for key, 1 for partition). The
ceiling assumes a cycle of exactly the handler's 20 ms; on a loaded two-core box the round
trip adds to it, for every mode alike. ``key_cycle_over_none_cycle`` near 1 says the gate adds
no latency of its own; the proxy's CPU per message in each mode is printed too. Each round also
runs none with concurrency = keys (``none_c<keys>``): the same number of calls in flight as key
mode, without the gate, so ``key_over_none_same_in_flight`` is the gate's own cost and the rest
of the gap to the ceiling is what fewer calls in flight cost on this machine. A last key-mode
run has batching on (``batch: {max_messages: 100}``, 4 calls; the handler works a batch's
messages concurrently, one 20 ms per call), over the same ceiling.
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

OPTIONS = BenchOptions(handler=True)

HANDLER_MS = 20.0
PC_KEY_MODE = 3691.0  # msg/s: Parallel Consumer's KEY mode here (100 keys, 20 ms; issue 14)


def run(
    bootstrap: str,
    handler: HandlerServer,
    ordering: str,
    n: int,
    keys: int,
    concurrency: int = 200,
    batch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    topic = create_topic(bootstrap, unique_name(f"bench-order-{ordering}"), partitions=1)
    produce_bulk(bootstrap, topic, n, key=lambda i: b"k%d" % (i % keys))
    delivery: dict[str, Any] = {
        "ordering": ordering,
        "concurrency": concurrency,
        "max_in_flight": 10_000,
        "commit_interval_ms": 200,
    }
    if batch is not None:
        delivery["batch"] = batch
    return proxy_backlog_run(bootstrap, handler, topic, n, delivery, timeout_s=300)


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000, help="per none / key run")
    parser.add_argument("--partition-messages", type=int, default=500)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved none/key rounds")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.partition_messages, args.rounds = 6000, 200, 1
    result = Result(
        "bench_ordering",
        params={
            "handler_ms": HANDLER_MS,
            "messages": args.messages,
            "partition_messages": args.partition_messages,
            "keys": args.keys,
            "rounds": args.rounds,
            "concurrency": 200,
            "max_in_flight": 10_000,
            "handler": args.handler,
        },
    )
    key_ceiling_by_keys = args.keys / (HANDLER_MS / 1000.0)
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec(HANDLER_MS), args.handler) as handler,
    ):
        nones: list[float] = []
        keyed: list[float] = []
        per_round: list[float] = []
        of_ceiling: list[float] = []
        cycles: list[float] = []
        same_in_flight: list[float] = []
        in_flight = {"none": 200.0, "key": float(min(args.keys, 200))}
        for i in range(args.rounds):
            # Alternate which goes first, so a drift in the machine's load favours neither.
            order = ["none", "key"] if i % 2 == 0 else ["key", "none"]
            rates: dict[str, float] = {}
            for ordering in order:
                found = run(bootstrap, handler, ordering, args.messages, args.keys)
                rates[ordering] = found["steady_rate"]
                result.figure(f"round{i}.{ordering}.msgs_per_s_steady", found["steady_rate"])
                result.figure(f"round{i}.{ordering}.msgs_per_s_committed", found["committed_rate"])
                result.figure(f"round{i}.{ordering}.duplicates", found["duplicates"])
                result.figure(
                    f"round{i}.{ordering}.proxy_cpu_us_per_msg", found["client_cpu_us_per_msg"]
                )
                result.figure(
                    f"round{i}.{ordering}.cycle_ms",
                    1000.0 * in_flight[ordering] / max(found["steady_rate"], 1e-9),
                )
            nones.append(rates["none"])
            keyed.append(rates["key"])
            per_round.append(rates["key"] / rates["none"])
            ceiling = min(rates["none"], key_ceiling_by_keys)
            of_ceiling.append(rates["key"] / ceiling)
            cycles.append((in_flight["key"] / rates["key"]) / (in_flight["none"] / rates["none"]))
            capped = run(bootstrap, handler, "none", args.messages, args.keys, min(args.keys, 200))
            result.figure(f"round{i}.none_c{args.keys}.msgs_per_s_steady", capped["steady_rate"])
            result.figure(
                f"round{i}.none_c{args.keys}.proxy_cpu_us_per_msg", capped["client_cpu_us_per_msg"]
            )
            same_in_flight.append(rates["key"] / capped["steady_rate"])
        part = run(bootstrap, handler, "partition", args.partition_messages, args.keys)
        result.figure("partition.msgs_per_s_steady", part["steady_rate"])
        result.figure("partition.msgs_per_s_committed", part["committed_rate"])
        few = run(bootstrap, handler, "key", max(1000, args.partition_messages * 6), 10)
        result.figure("key_10_keys.msgs_per_s_steady", few["steady_rate"])
        # Key mode with batching on: a batch holds one message per key, the handler works a
        # batch's messages concurrently (one 20 ms per call), 4 calls of up to 100.
        batched = run(bootstrap, handler, "key", args.messages, args.keys, 4, {"max_messages": 100})
        result.figure("key_batch.msgs_per_s_steady", batched["steady_rate"])
        result.figure("key_batch.proxy_cpu_us_per_msg", batched["client_cpu_us_per_msg"])
        result.figure("key_batch.duplicates", batched["duplicates"])
    none_rate, key_rate = statistics.median(nones), statistics.median(keyed)
    result.figure("none.msgs_per_s_steady (median)", none_rate)
    result.figure("key.msgs_per_s_steady (median)", key_rate)
    result.figure("key ceiling min(none, keys / 20 ms)", min(none_rate, key_ceiling_by_keys))
    result.ratio("key_over_ceiling", statistics.median(of_ceiling), 0.8)
    result.ratio("key_over_parallel_consumer_key", key_rate / PC_KEY_MODE, 1.0)
    result.ratio("key_over_none", statistics.median(per_round))
    result.ratio("key_cycle_over_none_cycle", statistics.median(cycles), higher_is_better=False)
    result.ratio("key_over_none_same_in_flight", statistics.median(same_in_flight))
    result.ratio("none_over_partition", none_rate / part["steady_rate"])
    result.ratio("key_over_partition", key_rate / part["steady_rate"])
    result.ratio("key_10_keys_over_its_ceiling", few["steady_rate"] / min(none_rate, 10 / 0.02))
    result.ratio(
        "key_batch_over_ceiling", batched["steady_rate"] / min(none_rate, key_ceiling_by_keys)
    )
    result.note(
        "steady rates (10%..90% of first arrivals at the handler); ratios of none and key are "
        "medians of per-round ratios, the rounds interleaved"
    )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
