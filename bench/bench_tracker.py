"""Benchmark of the commit tracker and the commit-metadata codec.

Run: ``.venv/bin/python -m bench.bench_tracker``. Prints

* done() + committable() pairs per second, for acks in fetch order and shuffled within a
  window, next to a baseline measured in the same run: the same work written inline with a
  bare ``set.discard`` and ``deque`` loop, so the ratio shows what the tracker's method calls
  cost on this machine;
* the commit-metadata size for a 10,000-offset window with 1% and 10% random holes (raw
  varints, after DEFLATE, final text with base85 and with base64 for comparison), whether it
  fits the default budget, and how long preparing it takes;
* the largest window that still fits the default budget at those hole rates.

Throughput is CPU time of this process (``time.process_time``), best of a few runs: on a
shared two-core box wall-clock time mostly measures the neighbours.
"""

from __future__ import annotations

import base64
import random
import time
from collections import deque
from collections.abc import Callable
from itertools import groupby

from bench.options import BenchOptions
from consumer_proxy.core import codec
from consumer_proxy.core.codec import AckState, decode, encode
from consumer_proxy.core.tracker import DEFAULT_METADATA_BUDGET, PartitionTracker

OPTIONS = BenchOptions(bootstrap=False, quick=False)

WINDOW = 10_000
BATCHES = 100  # 1,000,000 pairs per measurement
REPEATS = 5
BASE = 1_234_567_890  # a realistic offset: its varint takes 5 bytes, like in production


def ack_orders(shuffled: bool) -> list[list[int]]:
    """Per batch, the order in which the window's offsets are acked."""
    randoms = random.Random(42)
    orders = []
    for batch in range(BATCHES):
        order = list(range(BASE + batch * WINDOW, BASE + (batch + 1) * WINDOW))
        if shuffled:
            randoms.shuffle(order)
        orders.append(order)
    return orders


def time_tracker(orders: list[list[int]]) -> float:
    """Seconds spent in done() + committable(), fetching each batch untimed before acking it."""
    tracker = PartitionTracker(BASE, WINDOW)
    elapsed = 0.0
    for order in orders:
        for offset in sorted(order):
            tracker.track(offset)
        started = time.process_time()
        for offset in order:
            tracker.done(offset)
            tracker.committable()
        elapsed += time.process_time() - started
    assert tracker.committable() == BASE + BATCHES * WINDOW
    return elapsed


def time_baseline(orders: list[list[int]]) -> float:
    """The same bookkeeping written inline: no method calls, no restored state, no checks."""
    offsets: deque[int] = deque()
    pending: set[int] = set()
    elapsed = 0.0
    for order in orders:
        for offset in sorted(order):
            offsets.append(offset)
            pending.add(offset)
        started = time.process_time()
        for offset in order:
            pending.discard(offset)
            while offsets and offsets[0] not in pending:
                offsets.popleft()
        elapsed += time.process_time() - started
    assert not offsets
    return elapsed


def best_rate(measure: Callable[[list[list[int]]], float], orders: list[list[int]]) -> float:
    """Pairs per second of the fastest of a few runs (the least disturbed by other work)."""
    return BATCHES * WINDOW / min(measure(orders) for _ in range(REPEATS))


def window_with_holes(size: int, hole_rate: float, seed: int = 7) -> PartitionTracker:
    """A window of ``size`` fetched offsets, all done except random holes (and the head)."""
    randoms = random.Random(seed)
    tracker = PartitionTracker(BASE, size + 1)
    for offset in range(BASE, BASE + size):
        tracker.track(offset)
        if offset != BASE and randoms.random() >= hole_rate:
            tracker.done(offset)
    return tracker


def report_sizes(hole_rate: float) -> None:
    """Print the metadata sizes of a 10,000-offset window at ``hole_rate``."""
    tracker = window_with_holes(WINDOW, hole_rate)
    started = time.process_time()
    text, whole = tracker.metadata(10**9)
    prepare_ms = (time.process_time() - started) * 1000
    state = decode(text)
    # The codec's own helpers, so the raw and compressed figures are the real ones.
    body = codec._body(state)
    deflated = codec._deflate(body)
    stored = deflated if len(deflated) < len(body) else body
    as_base64 = len(codec.PREFIX) + 1 + len(base64.b64encode(bytes(4) + stored).rstrip(b"="))
    fits = len(text) <= DEFAULT_METADATA_BUDGET
    print(
        f"  {hole_rate:4.0%} holes: {tracker.pending:5d} pending, {len(state.runs):5d} runs | "
        f"raw {len(body):5d} B, deflate {len(deflated):5d} B | "
        f"text {len(text):5d} chars (base64 would be {as_base64}) | "
        f"fits {DEFAULT_METADATA_BUDGET}: {'yes' if fits else 'NO'} | "
        f"metadata() {prepare_ms:.2f} ms"
    )
    assert whole


def largest_fitting_window(hole_rate: float) -> int:
    """The largest window whose whole state fits the default budget, found by bisection.

    Builds the states with the codec directly (the runs a tracker would write for a window
    without gaps), since constructing trackers of a few hundred thousand offsets per probe
    would dominate the run time.
    """
    randoms = random.Random(7)
    limit = 400_000
    done_flags = [False] + [randoms.random() >= hole_rate for _ in range(limit - 1)]

    def fits(size: int) -> bool:
        runs = [len(list(group)) for _, group in groupby(done_flags[:size])]
        if len(runs) % 2:
            runs.pop()  # the trailing pending run is not written
        return len(encode(AckState(BASE, tuple(runs)))) <= DEFAULT_METADATA_BUDGET

    low, high = 1, limit
    while low < high:
        size = (low + high + 1) // 2
        if fits(size):
            low = size
        else:
            high = size - 1
    return low


def main() -> None:
    """Run every measurement and print the figures."""
    print(f"done() + committable() pairs, window {WINDOW:,}, CPU time, best of {REPEATS}:")
    for label, shuffled in (("acks in fetch order", False), ("acks shuffled", True)):
        orders = ack_orders(shuffled)
        tracker_rate = best_rate(time_tracker, orders)
        baseline_rate = best_rate(time_baseline, orders)
        print(
            f"  {label:20s} tracker {tracker_rate / 1e6:5.2f} M pairs/s | "
            f"inline set+deque baseline {baseline_rate / 1e6:5.2f} M/s | "
            f"tracker/baseline {tracker_rate / baseline_rate:.2f}"
        )

    print(f"commit metadata for a {WINDOW:,}-offset window (base offset {BASE:,}):")
    for hole_rate in (0.01, 0.10):
        report_sizes(hole_rate)

    print(f"largest window whose whole state fits {DEFAULT_METADATA_BUDGET} chars:")
    for hole_rate in (0.01, 0.10):
        print(f"  {hole_rate:4.0%} holes: {largest_fitting_window(hole_rate):,} offsets")

    # A sanity check that the figures above describe states that decode to what was encoded.
    state = AckState(BASE, (1, 5, 2, 7))
    assert decode(encode(state)) == state


if __name__ == "__main__":
    main()
