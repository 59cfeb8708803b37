"""One group as the operator console shows it: ``group_snapshot``, a read-only, JSON-ready
picture of its breaker, dead-letter guard, concurrency limit, instances, outcome counters and
owned partitions (``PartitionSet.views``, with each partition's oldest call under way). It
reads the group's parts and writes nothing; ``GroupRunner.snapshot`` hands them over."""

from __future__ import annotations

import dataclasses
from typing import Any

from .core.partitions import PartitionSet
from .flow import Breaker, ConcurrencyLimiter
from .ports import Pusher
from .push import Push


def group_snapshot(
    name: str,
    *,
    started: bool,
    stopping: bool,
    partitions: PartitionSet,
    breaker: Breaker,
    push: Push | None,
    limiter: ConcurrencyLimiter,
    adaptive: bool,
    pusher: Pusher | None,
) -> dict[str, Any]:
    """The picture of one group (``push`` and ``pusher`` are None until it runs)."""
    oldest = push.oldest() if push is not None else {}
    rows = []
    for view in partitions.views():
        row = dataclasses.asdict(view)
        call = oldest.get((view.topic, view.partition))
        row["oldest_call"] = (
            None
            if call is None
            else {"offset": call[0], "age_s": round(call[1], 3), "note": call[2][:200]}
        )
        rows.append(row)
    guard = partitions.guard_state()
    return {
        "name": name,
        "started": started,
        "stopping": stopping,
        "breaker": {
            "state": breaker.state,
            "failures": breaker.failures,
            "probe_in_s": round(breaker.seconds_until_probe(), 1),
            "last_failure": push.last_failure[:500] if push is not None else "",
        },
        "guard": (
            None if guard is None else {**dataclasses.asdict(guard[0]), "messages": guard[1]}
        ),
        "limit": limiter.limit,
        "adaptive": adaptive,
        "instances": pusher.instances() if pusher is not None else [],
        "counters": dataclasses.asdict(partitions.counters),
        "partitions": rows,
    }
