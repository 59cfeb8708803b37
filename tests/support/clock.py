"""The tests' manual clock (``Clock``): time moves only when a test moves it."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass


class Clock:
    """Virtual time that moves only when told, plus a timer heap: ``call_later`` returns a
    cancellable handle; ``advance`` and ``run_until`` move the time, firing what falls due.

    The one clock of the tests that drive pure code (the core, the flow objects, the log
    gates); the simulation's ``tests/sim/vloop.py`` is the same idea as an asyncio loop."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(fn)
        heapq.heappush(self._heap, (self.now + max(0.0, delay_s), next(self._seq), timer))
        return timer

    def next_due(self) -> float | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def run_until(self, until: float) -> None:
        """Fire every timer due up to ``until`` in order, then set the time to ``until``."""
        while True:
            due = self.next_due()
            if due is None or due > until:
                break
            when, _, timer = heapq.heappop(self._heap)
            self.now = max(self.now, when)
            timer.fire()
        self.now = max(self.now, until)

    def advance(self, seconds: float) -> None:
        self.run_until(self.now + seconds)


@dataclass(eq=False)
class Timer:
    """A scheduled callback."""

    fn: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.fn()
