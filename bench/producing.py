"""Producing the benches' records: a backlog as fast as the broker takes it, or an open loop at
a steady rate with each record's timestamp set when it is handed to the client."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer


def produce_bulk(
    bootstrap: str,
    topic: str,
    n: int,
    *,
    partitions: int = 1,
    value: Callable[[int], bytes] = lambda i: b"m%015d" % i,
    key: Callable[[int], bytes] | None = None,
    headers: Callable[[int], list[tuple[str, str | bytes | None]]] | None = None,
    settings: dict[str, Any] | None = None,
) -> None:
    """Produce ``n`` records round-robin over ``partitions`` (acks=all) and flush; ``key``
    and ``headers`` give record i's (none by default); ``settings`` override the producer's."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 20,
            "batch.num.messages": 10000,
            "queue.buffering.max.messages": 200000,
            **(settings or {}),
        }
    )
    failures: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for i in range(n):
        while True:
            try:
                producer.produce(
                    topic,
                    value(i),
                    key(i) if key is not None else None,
                    partition=i % partitions,
                    on_delivery=delivered,
                    headers=headers(i) if headers is not None else None,
                )
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    if left or failures:
        raise RuntimeError(f"producing to {topic}: {left} left, failures {failures[:3]}")


def produce_at_rate(
    bootstrap: str,
    topic: str,
    rate_per_s: float,
    duration_s: float,
    *,
    value: Callable[[int], bytes] = lambda i: b"m%015d" % i,
) -> int:
    """Produce at a steady rate (open loop: ticks are not delayed by the consumer side) for
    ``duration_s`` to partition 0; returns how many were produced. linger.ms=0, so a record's
    timestamp is within a millisecond of when it was handed to the client."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 0})
    started = time.monotonic()
    i = 0
    while True:
        due = started + i / rate_per_s
        now = time.monotonic()
        if due - started >= duration_s:
            break
        if due > now:
            time.sleep(due - now)
        producer.produce(topic, value(i), partition=0)
        producer.poll(0)
        i += 1
    if producer.flush(60):
        raise RuntimeError(f"producing to {topic}: records left after 60s")
    return i


def sized_value(i: int, size: int = 100) -> bytes:
    """Record i's value: its number, padded to ``size`` bytes."""
    return (b"m%015d" % i).ljust(size, b".")
