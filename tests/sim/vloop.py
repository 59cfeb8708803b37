"""A virtual-time asyncio event loop: its clock jumps to the next timer when nothing is ready.

Why our own (about thirty lines) rather than ``looptime`` from PyPI: the simulation runs
outside pytest too (``python -m tests.sim``), it must be deterministic bit for bit (no thread,
no real I/O, no wall clock anywhere), and a deadlock (nothing ready, no timer, the driver
still waiting) must fail loudly instead of hanging. Subclassing the selector loop with a
selector that has no I/O does all three without patching asyncio or adding a dependency:
``BaseEventLoop._run_once`` asks the selector to wait ``timeout`` seconds (0 when a callback
is ready, the time to the earliest timer otherwise, None when there is neither), and this
selector waits by moving the loop's clock forward by that (at least a microsecond: a turn of
a real loop takes time too). One thread, no I/O, no wall clock: the same coroutines run in
the same order at the same virtual times on every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


TICK_S = 1e-6
"""The time one turn of the loop takes at least."""


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is scheduled, yet the loop was asked to wait."""


class _NoIO(selectors.BaseSelector):
    """A selector over no file descriptors: ``select`` advances the virtual clock."""

    def __init__(self) -> None:
        self.loop: VirtualLoop | None = None
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key  # the loop's self-pipe: never written (no threads here)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self.loop is not None
        if timeout is None:
            raise Deadlock(f"nothing ready and no timer at t={self.loop.now:.3f}s")
        # Every turn of the loop takes a tick, as on a real machine. Without it, a deadline
        # recomputed from the clock can come out a hair above now (float rounding:
        # 2.0 - (t + 2.0 - t) > 0) and be re-armed at the same instant forever (the
        # breaker's probe wait did: asyncio.timeout then calls back at once).
        self.loop.now += max(timeout, TICK_S)
        return []

    def close(self) -> None:
        self._map.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at 0: ``sleep(3600)`` returns at once."""

    def __init__(self) -> None:
        selector = _NoIO()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh virtual-time loop, then close it."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        # As asyncio.run: whatever is left (a failed run) is cancelled and awaited first;
        # a task waiting for another that was cancelled first is cancelled again.
        try:
            for _ in range(100):
                left = [task for task in asyncio.all_tasks(loop) if not task.done()]
                if not left:
                    break
                for task in left:
                    task.cancel()
                with contextlib.suppress(Deadlock):
                    loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
