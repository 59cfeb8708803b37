"""Batch mode's ready queue: call slots wait for any ready message, then take a batch."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from .core.partitions import Delivery, Ready, expand


class ReadyDeque:
    """Batch mode's ready messages: workers wait for any, then take a whole batch.

    Each arriving message wakes one waiting worker (a free call slot sends what is ready at
    once); while every worker is in a call, messages queue here and the next free worker
    takes up to a batch of them. An item is a message or a ``Run`` of several.
    """

    __slots__ = ("_waiters", "items")

    def __init__(self) -> None:
        self.items: deque[Ready] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()

    def put(self, delivery: Delivery) -> None:
        """A message is ready (``PartitionSet``'s ``emit``)."""
        self.items.append(delivery)
        if self._waiters:
            self.wake()

    put_nowait = put  # asyncio.Queue's name: the runner hands either queue's to the core

    def put_batch(self, items: Sequence[Ready]) -> None:
        """Messages are ready together (``PartitionSet``'s ``emit_batch``): as ``put`` of
        each, one waiting worker woken per message while any waits."""
        self.items.extend(items)
        waiters = len(self._waiters)
        if waiters:
            for _ in range(min(sum(item.count for item in items), waiters)):
                self.wake()

    def fewer_than(self, n: int) -> bool:
        """Fewer than ``n`` messages are ready (a ``Run`` counts as its messages)."""
        items = self.items
        if len(items) >= n:
            return False  # (each item holds one message or more)
        seen = 0
        for item in items:
            seen += item.count
            if seen >= n:
                return False
        return True

    def wake(self) -> None:
        """Wake one waiting worker, if any."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait(self) -> None:
        """Return once a message is ready."""
        while not self.items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.wake()  # the wake-up meant for this worker goes to another
                raise


def take_all(ready: asyncio.Queue[Delivery] | ReadyDeque) -> list[Delivery]:
    """Empty either mode's ready queue (shutdown): what was in it, in order."""
    if isinstance(ready, ReadyDeque):
        left = expand(ready.items)
        ready.items.clear()
        return left
    return [ready.get_nowait() for _ in range(ready.qsize())]
