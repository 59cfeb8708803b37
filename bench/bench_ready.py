#!/usr/bin/env python3
"""Readiness after assignment: how soon /readyz turns 200 once a group owns its partitions.

Issue 34, item 5: ready within 1 s of a group being assigned its partitions and connected,
without the idle cost of frequent librdkafka statistics. Each round starts a proxy (in this
process, the production consumer settings, the default statistics interval) with one fresh
group and one no-op service, and records, from the moment the assignment callback returned:

- ``ready``: until ``Proxy.ready()`` (what /readyz and grpc.health.v1 answer) says ready;
- ``stats``: until the consumer's first statistics arrived: what readiness waited for before
  a rebalance callback confirmed Kafka (the baseline, measured in the same round).

Ratios: median ready ÷ 1 s (target <= 1) and median ready ÷ median stats (the old wait).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.measure import Result
from bench.options import BenchOptions, broker
from consumer_proxy.config import ProxyConfig
from tests.support.kafka import create_topic, unique_name
from tests.support.proxy import config_dict, start_proxy
from tests.support.service import TestService

OPTIONS = BenchOptions(rounds=3)


async def one_round(bootstrap: str) -> tuple[float, float]:
    """(seconds from assignment to ready, seconds from assignment to the first statistics)."""
    topic, group = unique_name("ready"), unique_name("ready")
    create_topic(bootstrap, topic, partitions=4)
    async with TestService() as service:
        config = ProxyConfig(**config_dict(bootstrap, group, [topic], [service.address]))
        proxy, task = start_proxy(config, consumer_overrides={})  # production settings
        runner = proxy.runners[0]
        marks: dict[str, float] = {}
        assigned = runner.partitions_assigned
        on_stats = runner.kafka_link.on_stats

        async def assigned_and_marked(committed: Sequence[Any]) -> None:
            await assigned(committed)
            if committed:
                marks.setdefault("assigned", time.monotonic())

        def stats_and_marked(raw: str) -> None:
            marks.setdefault("stats", time.monotonic())  # the consumer thread
            on_stats(raw)

        # Before the group runs: the consumer's configuration takes the link's callback then.
        runner.partitions_assigned = assigned_and_marked  # type: ignore[method-assign]
        runner.kafka_link.on_stats = stats_and_marked  # type: ignore[method-assign]
        try:
            while not proxy.ready()[0]:
                await asyncio.sleep(0.005)
            marks["ready"] = time.monotonic()
            while "stats" not in marks:
                await asyncio.sleep(0.05)
        finally:
            await proxy.shutdown()
            await task
    return marks["ready"] - marks["assigned"], marks["stats"] - marks["assigned"]


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    result = Result("bench_ready", params={"rounds": rounds})
    with broker(args.bootstrap) as bootstrap:
        ready, stats = [], []
        for i in range(rounds):
            r, s = asyncio.run(one_round(bootstrap))
            print(f"  round {i + 1}: ready {r:.3f}s, first statistics {s:.3f}s", flush=True)
            ready.append(r)
            stats.append(s)
    result.figure("ready_after_assignment_s.median", round(statistics.median(ready), 3), "s")
    result.figure("ready_after_assignment_s.max", round(max(ready), 3), "s")
    result.figure("first_statistics_after_assignment_s.median", round(statistics.median(stats), 3))
    result.ratio("ready_over_1s", statistics.median(ready) / 1.0, 1.0, higher_is_better=False)
    result.ratio("ready_over_first_statistics", statistics.median(ready) / statistics.median(stats))
    result.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
