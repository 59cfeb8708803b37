"""Which service instances serve ``HandleMessageBatch``: ``delivery.batch`` in ``auto`` mode.

Pure: no I/O, no asyncio; times are seconds on the caller's clock. The dispatcher keeps one
:class:`BatchSupport` for the group's instances, asks :meth:`BatchSupport.batches` before each
call whether to send that instance a batch, and reports what it learnt:
:meth:`BatchSupport.answered` after every batch call to it, :meth:`BatchSupport.disconnected`
when its channel lost its connection. Every :class:`Learnt` value it gets back is one change to
log and count (once per instance and change, never per call).

The rules:

- An instance starts ``unknown``: its next call is a batch (the probe). UNIMPLEMENTED makes
  it ``unary``; any other answer that reached the server (an OK answer, or a status not in
  ``SAYS_NOTHING``) makes it ``batch``; a connection failure or a deadline changes nothing.
  The probe's messages are then pushed again at once with unary calls to the same instance:
  the failed batch call is no attempt, no breaker failure, no ejection failure, and never a
  dead letter. Server reflection is not needed (it is optional on servers, and often off).
- A ``batch`` instance that answers UNIMPLEMENTED (a rolling deploy replaced it with a build
  without the batch method) turns ``unary`` the same way, its batch pushed again unary.
- A ``unary`` instance is probed again (turns ``unknown``) once its channel lost its
  connection (the instance stopped, restarted or was replaced: its next call asks), and at
  the latest ``REPROBE_S`` after it was last
  found unary: a ``dns:///`` target balances over instances the channel's state cannot tell
  apart, and one probe a minute costs one UNIMPLEMENTED round trip.
- A ``batch`` instance stays ``batch`` across disconnects: a replacement without the method is
  found by its first UNIMPLEMENTED, which costs nothing more than a probe would.

With ``delivery.batch`` always there is no fallback: :class:`MissingMethod` says when the
service is to be told not to serve the method (its first UNIMPLEMENTED) and when it serves it
again (a success ``SERVES_AGAIN_S`` after the last UNIMPLEMENTED: instances of two builds
behind one target, a rolling deploy, would flip it at every call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .batching import NOT_IMPLEMENTED_REASON

__all__ = [
    "REPROBE_S",
    "SAYS_NOTHING",
    "SERVES_AGAIN_S",
    "BatchSupport",
    "Learnt",
    "MissingMethod",
    "Mode",
]

REPROBE_S = 60.0
"""A unary instance is asked again, with one batch call, at least this often."""

Mode = Literal["unknown", "batch", "unary"]

SAYS_NOTHING = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNAUTHENTICATED", "PERMISSION_DENIED"}
)
"""Batch call statuses that say nothing about the method: the call may have ended before the
server looked the method up (no connection, a deadline, an auth interceptor)."""


@dataclass(frozen=True, slots=True)
class Learnt:
    """Instance ``index`` is now in ``mode`` (it was ``before``), and why."""

    index: int
    mode: Mode
    before: Mode
    reason: str


class BatchSupport:
    """The batch support of ``n`` instances, as their answers showed it."""

    def __init__(self, n: int, clock: Callable[[], float], reprobe_s: float = REPROBE_S) -> None:
        if n < 1:
            raise ValueError(f"needs at least one instance, got {n}")
        self._clock = clock
        self._reprobe_s = reprobe_s
        self.modes: list[Mode] = ["unknown"] * n
        self._unary_since = [0.0] * n
        self._reprobing = [False] * n  # unknown again only because REPROBE_S passed

    def batches(self, index: int) -> bool:
        """Whether the next call to instance ``index`` is a batch (``unknown`` probes)."""
        mode = self.modes[index]
        if mode != "unary":
            return True
        if self._clock() - self._unary_since[index] >= self._reprobe_s:
            self.modes[index] = "unknown"
            self._reprobing[index] = True  # a probe that finds it unary again says nothing
            return True
        return False

    def answered(self, index: int, status: str) -> Learnt | None:
        """A batch call to instance ``index`` ended with ``status`` (a gRPC status name, or
        the name of the answer's first action); a status in ``SAYS_NOTHING`` (the call may
        not have reached the handler) changes nothing."""
        if status in SAYS_NOTHING:
            return None
        unimplemented = status == "UNIMPLEMENTED"
        before = self.modes[index]
        reprobing, self._reprobing[index] = self._reprobing[index], False
        if unimplemented:
            self._unary_since[index] = self._clock()
            self.modes[index] = "unary"
            if before == "unary" or (before == "unknown" and reprobing):
                return None  # known already (a periodic re-probe found what was known)
            return Learnt(index, "unary", before, "answered UNIMPLEMENTED to HandleMessageBatch")
        self.modes[index] = "batch"
        if before == "batch":
            return None
        return Learnt(index, "batch", before, "answers HandleMessageBatch")

    def disconnected(self, index: int) -> None:
        """Instance ``index``'s channel lost its connection: a ``unary`` one is asked again
        on its next call (it may come back as another build)."""
        if self.modes[index] == "unary":
            self.modes[index] = "unknown"
            self._reprobing[index] = False  # a restarted instance: what it serves is said

    def counts(self) -> dict[str, int]:
        """Instances per mode."""
        out = {"unknown": 0, "batch": 0, "unary": 0}
        for mode in self.modes:
            out[mode] += 1
        return out


SERVES_AGAIN_S = 30.0
"""``MissingMethod``: how long after the last UNIMPLEMENTED a success says the method is back."""


class MissingMethod:
    """``delivery.batch`` always: whether the service is said not to serve
    ``HandleMessageBatch`` (``problem``: why, for ``/readyz``; '' while it serves it)."""

    __slots__ = ("_seen_at", "problem")

    def __init__(self) -> None:
        self.problem = ""
        self._seen_at = 0.0

    def answered(self, now: float, target: str, unimplemented: bool, ok: bool) -> bool:
        """A batch call to ``target`` ended at ``now``: answered UNIMPLEMENTED, or ``ok`` (a
        success of the service); True when ``problem`` changed (to log and tell, once)."""
        if unimplemented:
            self._seen_at = now
            if self.problem:
                return False
            self.problem = f"{NOT_IMPLEMENTED_REASON} ({target} answered UNIMPLEMENTED)"
            return True
        if self.problem and ok and now - self._seen_at >= SERVES_AGAIN_S:
            self.problem = ""
            return True
        return False
