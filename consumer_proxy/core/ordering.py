"""The ordering gate: at most one message per key out, the key's later messages held back.

``delivery.ordering`` of a group:

- ``none`` (default): no gate; every message is handed to the workers as it is accepted.
- ``key``: one message per (partition, key) is *out* (ready, in flight, waiting for its retry,
  or waiting for its DLQ write to be confirmed); the key's later messages wait in offset order
  and the next one goes out when the one before it is done (acked, dropped, or confirmed in
  the DLQ). Messages with no key form one lane of their own per partition: they are ordered
  among themselves (never silently unordered in a mode that asked for order) and do not wait
  for keyed messages, nor keyed ones for them.
- ``partition``: every message of a partition is in one lane: one out per partition, in
  offset order (a plain consumer's semantics, with the proxy's retries, DLQ and breaker).

The gate holds only messages already accepted into the partition's tracker window (their
bytes counted), so it is bounded by ``max_in_flight`` and the byte budget like everything
else; a hot key that fills the window pauses the partition. Since only deliverable messages
ever reach the ready queue, any batch built from it holds at most one message per key.

Pure: no I/O, no asyncio. One ``KeyGate`` per partition (``PartitionState.gate``), created on
assign and dropped with the partition.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Literal, TypeVar

__all__ = ["ORDERINGS", "PARTITION_LANE", "KeyGate", "Ordering"]

T = TypeVar("T")

Ordering = Literal["none", "key", "partition"]
ORDERINGS: tuple[Ordering, ...] = ("none", "key", "partition")

PARTITION_LANE: Hashable = ("partition",)
"""The lane of every message in ``partition`` mode (no record key equals a tuple)."""


class KeyGate(Generic[T]):
    """Per key, one item out and the rest waiting in arrival order.

    ``admit(key, item)`` says whether ``item`` may go out now; ``release(key, item)`` is called
    when the item that is out is finished and returns the key's next item (now out), if any.
    Keys are any hashable (record keys are bytes; ``None`` is the no-key lane).
    """

    __slots__ = ("_out", "_waiting")

    def __init__(self) -> None:
        self._out: dict[Hashable, T] = {}
        # Only keys with something waiting have an entry, so its size is "keys with a backlog".
        self._waiting: dict[Hashable, deque[T]] = {}

    def admit(self, key: Hashable, item: T) -> bool:
        """Take ``item``; True when it may go out now (nothing of its key is out)."""
        if key in self._out:
            waiting = self._waiting.get(key)
            if waiting is None:
                self._waiting[key] = deque((item,))
            else:
                waiting.append(item)
            return False
        self._out[key] = item
        return True

    def release(self, key: Hashable, item: T) -> T | None:
        """``item`` (out for ``key``) is finished: return the key's next item, now out.

        A release of an item that is not the one out for its key (it was pruned meanwhile)
        changes nothing and returns None.
        """
        if self._out.get(key) is not item:
            return None
        waiting = self._waiting.get(key)
        if waiting:
            nxt = waiting.popleft()
            if not waiting:
                del self._waiting[key]
            self._out[key] = nxt
            return nxt
        del self._out[key]
        return None

    def prune(self, gone: Callable[[T], bool]) -> tuple[list[T], list[T]]:
        """Forget every item for which ``gone(item)`` holds (its record was cut from the log).

        A gone item that is out stops holding its key back (whatever still runs for it is no
        longer a message of the log). Returns (the gone items that were waiting, the items that
        went out because of it); the caller returns the first list's bytes and hands out the
        second.
        """
        dropped: list[T] = []
        promoted: list[T] = []
        for key in list(self._out):
            waiting = self._waiting.get(key)
            if waiting is not None:
                kept = deque(i for i in waiting if not gone(i))
                dropped.extend(i for i in waiting if gone(i))
                if kept:
                    self._waiting[key] = kept
                else:
                    del self._waiting[key]
            if gone(self._out[key]):
                del self._out[key]
                rest = self._waiting.pop(key, None)
                if rest:
                    nxt = rest.popleft()
                    self._out[key] = nxt
                    promoted.append(nxt)
                    if rest:
                        self._waiting[key] = rest
        return dropped, promoted

    def waiting_items(self) -> Iterator[T]:
        """Every item waiting behind its key's item out (for accounting checks)."""
        for waiting in self._waiting.values():
            yield from waiting

    def out(self, key: Hashable) -> T | None:
        """The item out for ``key``, if any."""
        return self._out.get(key)

    def waiting(self, key: Hashable) -> int:
        """How many items of ``key`` wait behind the one out."""
        waiting = self._waiting.get(key)
        return len(waiting) if waiting is not None else 0

    @property
    def keys_out(self) -> int:
        """Keys with an item out."""
        return len(self._out)

    @property
    def held(self) -> int:
        """Items held back (waiting), all keys."""
        return sum(len(w) for w in self._waiting.values())

    def backlog(self) -> tuple[int, int]:
        """(keys with items waiting, the most items waiting behind one key)."""
        waiting = self._waiting
        return len(waiting), max((len(w) for w in waiting.values()), default=0)
