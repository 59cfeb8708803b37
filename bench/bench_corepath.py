#!/usr/bin/env python3
"""The core's batch path without I/O: µs a message, step by step, ready runs vs messages.

Issue 34, item 3: what the event loop spends per message between a consume() batch and its
commit, without Kafka, gRPC or asyncio. ``bench_throughput``'s workload (200,000 records of
100 bytes, 4 partitions, polls of 5,000 records, calls of 500 messages all acked, a commit
plan after each poll) through a ``PartitionSet`` the way ``BatchPush`` drives it: intake
(``intake_batch``), ``take``, ``begin_batch``, the request (``wire.batch_request``),
``finish_acked``, the commit plan. Records are real ``confluent_kafka.Message`` objects.

Two contenders in interleaved rounds: ``runs`` (batch mode's ready runs, ``core.partitions.Run``)
and ``messages`` (a ``Delivery`` per record, the path without them). Ratio: the median of the
per-round ratios of their totals (messages ÷ runs: how many times cheaper the run path is).
No broker (``--bootstrap`` is not taken). ``--headers``: each record carries a W3C
``traceparent`` header (55 bytes), as a traced producer's do. ``--ahead N``: the first N polls
are taken in before any call (the windows fill, the rest waits in the backlog, as in
``bench_throughput``'s proxy). The collector's young passes wait for
``cli.YOUNG_GC_THRESHOLD`` allocations, as in ``consumer-proxy run`` (since 2026-11-27 03:00;
before, Python's 700: a record with headers held several young objects, and the passes over
them were about half of its intake; ``--python-gc`` for that).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque

from confluent_kafka import Message

from bench.measure import Result, rotated
from bench.options import BenchOptions
from consumer_proxy.cli import YOUNG_GC_THRESHOLD
from consumer_proxy.config import CircuitBreakerConfig, DeliveryConfig
from consumer_proxy.core.batching import BatchLimits, take
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.core.partitions import PartitionSet, Ready
from consumer_proxy.flow import Breaker
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.wire import batch_request

OPTIONS = BenchOptions(bootstrap=False)

POLL = 5000
CALL = 500
PARTITIONS = 4
STEPS = ("intake", "take", "begin", "request", "finish", "commit")
ACK = Classifier().from_response(handler_pb2.HandleMessageResponse())


TRACEPARENT: list[tuple[str, str | bytes | None]] = [
    ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
]


def polls(n: int, headers: bool = False) -> list[list[Message]]:
    """``n`` 100-byte records in consume() batches of ``POLL``, each a run per partition
    (``headers``: each with a ``traceparent``)."""
    value = b"x" * 100
    carried = TRACEPARENT if headers else None
    offsets = [0] * PARTITIONS
    out = []
    for _ in range(n // POLL):
        records = []
        for partition in range(PARTITIONS):
            for _ in range(POLL // PARTITIONS):
                offset = offsets[partition]
                ts = (1, 1_764_000_000_000 + offset)
                records.append(
                    Message(
                        topic="t",
                        partition=partition,
                        offset=offset,
                        value=value,
                        headers=carried,
                        timestamp=ts,
                    )
                )
                offsets[partition] += 1
        out.append(records)
    return out


def one_run(batches: list[list[Message]], runs: bool, ahead: int = 0) -> dict[str, float]:
    """µs a message of each step, draining ``batches`` through a fresh core (``ahead``: the
    first that many polls are taken in before any call, as the proxy's fetcher runs ahead
    of its calls: what the windows have no room for waits in the backlog, and comes out
    of it as acks make room, in ``finish``)."""
    ready: deque[Ready] = deque()
    core = PartitionSet(
        "g",
        DeliveryConfig(max_in_flight=20_000, fetch_batch=POLL),
        "g.redrive",
        Breaker("g", CircuitBreakerConfig()),
        emit=ready.append,
        schedule=lambda _delay, _fn: None,  # type: ignore[arg-type,return-value]
        emit_batch=ready.extend,
        runs=runs,
    )
    for partition in range(PARTITIONS):
        core.assign("t", partition, 0, "")
    core.pause_plan()
    limits = BatchLimits(CALL, 4 * 1024 * 1024)
    stale = core.drop_stale
    drop = core.drop_ready(ready) if runs else lambda item: stale(item)
    acks = [ACK] * CALL
    spent = dict.fromkeys(STEPS, 0.0)
    clock = time.perf_counter
    count = 0
    for polled, records in enumerate(batches, 1):
        a = clock()
        core.intake_batch(records)
        spent["intake"] += clock() - a
        count += len(records)
        while ready and polled >= min(ahead, len(batches)):
            a = clock()
            batch = take(ready, limits, drop)
            b = clock()
            began = core.begin_batch(batch)
            c = clock()
            batch_request(began, "g")
            d = clock()
            done = core.finish_acked(began, acks[: sum(item.count for item in began)])
            e = clock()
            assert done, "every answer is a plain ack"
            spent["take"] += b - a
            spent["begin"] += c - b
            spent["request"] += d - c
            spent["finish"] += e - d
        a = clock()
        plan, _ = core.commit_plan()
        core.committed(plan)
        spent["commit"] += clock() - a
    assert not ready and core.bytes == 0
    return {step: 1e6 * seconds / count for step, seconds in spent.items()}


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=200_000, help="records")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--headers", action="store_true", help="a traceparent on each record")
    parser.add_argument(
        "--python-gc",
        action="store_true",
        help="Python's collector thresholds (by default the young passes wait for "
        "consumer_proxy.cli.YOUNG_GC_THRESHOLD allocations, as in `consumer-proxy run`)",
    )
    parser.add_argument(
        "--ahead",
        type=int,
        default=0,
        help="polls taken in before the first call (24: the windows fill and 40,000 records "
        "wait in the backlog, as in bench_throughput's proxy)",
    )
    args = parser.parse_args()
    n = 20_000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    params = {"n": n, "rounds": rounds, "poll": POLL, "call": CALL, "headers": args.headers}
    params["ahead"] = args.ahead
    params["young_gc_threshold"] = gc.get_threshold()[0] if args.python_gc else YOUNG_GC_THRESHOLD
    result = Result("bench_corepath", params=params)
    batches = polls(n, args.headers)
    if not args.python_gc:  # (the records made above are out of the young passes then)
        gc.collect()
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    measured: dict[str, list[dict[str, float]]] = {"runs": [], "messages": []}
    for round_ in range(rounds):
        for who in rotated(tuple(measured), round_):
            steps = one_run(batches, who == "runs", args.ahead)
            measured[who].append(steps)
            shown = ", ".join(f"{step} {us:.3f}" for step, us in steps.items())
            print(f"  round {round_ + 1} {who:<8}: {sum(steps.values()):.3f} us/msg ({shown})")
    med = statistics.median
    for who, runs in measured.items():  # (in ns: the figures print one decimal)
        for step in STEPS:
            result.figure(
                f"{who}.{step}_ns_per_msg", round(1000 * med(r[step] for r in runs)), "ns"
            )
        total = med(sum(r.values()) for r in runs)
        result.figure(f"{who}.total_ns_per_msg", round(1000 * total), "ns")
    result.ratio(
        "messages_over_runs",
        med(
            sum(m.values()) / sum(r.values())
            for m, r in zip(measured["messages"], measured["runs"], strict=True)
        ),
    )
    result.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
