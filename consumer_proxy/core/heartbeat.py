"""Long-running calls (``delivery.long_running``): when a streaming call has failed, and what
that failure means.

A ``HandleMessageStream`` call is alive while its service heartbeats. :class:`CallWatch`
keeps one call's times (all passed in: no clock of its own) and answers when the call must
end: ``heartbeat_timeout`` after the last heartbeat (or the start), or ``max_processing``
after the start, whichever comes first. :func:`expiry_result` says what an expiry means:

- no heartbeat in time: the call failed as a deadline fails (``DEADLINE_EXCEEDED`` through
  the group's status table, so its overrides apply). Under the outage rule
  (``core.decision.charged``) it is charged to the message only while the service answers
  other calls: a hung service (every instance silent) dead-letters nothing.
- the cap reached: the service was alive (it heartbeated) but the message took too long; a
  counted failure of the message itself, not a service failure.

A call the proxy cancels for another reason (its partition revoked or lost, the proxy shutting
down) has no result at all: the shell gives the message back (``PartitionSet.abandon``) and
it never counts as an attempt (:class:`Cancel`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from .outcomes import Classification, Classifier, Outcome

MAX_PROGRESS_CHARS = 256
"""A heartbeat's progress note is cut to this many characters (logs, status)."""
MAX_PROCESSING_STATUS = "MAX_PROCESSING_EXCEEDED"
"""The status recorded (``cp-status``) for a call cancelled at ``max_processing_ms``."""


class Expiry(enum.Enum):
    """Why a long call ended without a result."""

    HEARTBEAT = "heartbeat"
    """No heartbeat within ``heartbeat_timeout_ms``."""
    CAP = "max_processing"
    """``max_processing_ms`` passed since the call began."""


class Cancel(enum.Enum):
    """Why the proxy cancelled a call that had not failed: never an attempt."""

    REVOKE = "revoke"
    LOST = "lost"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class Limits:
    """A group's long-running limits, in seconds."""

    heartbeat_timeout_s: float
    max_processing_s: float

    @classmethod
    def from_ms(cls, heartbeat_timeout_ms: int, max_processing_ms: int) -> Limits:
        """From the config's milliseconds."""
        return cls(heartbeat_timeout_ms / 1000.0, max_processing_ms / 1000.0)

    @property
    def heartbeat_interval_ms(self) -> int:
        """How often the service is asked to heartbeat: a third of the timeout, so that one
        late or lost heartbeat never fails a call."""
        return max(1, int(self.heartbeat_timeout_s * 1000 / 3))


@dataclass(slots=True)
class CallWatch:
    """One long call's times: when it began, when the service was last heard."""

    limits: Limits
    started: float
    last_heard: float = -1.0
    heartbeats: int = 0
    progress: str = ""

    def __post_init__(self) -> None:
        if self.last_heard < 0:
            self.last_heard = self.started

    def heard(self, now: float, progress: str = "") -> float:
        """A heartbeat at ``now``; returns the gap since the previous one (or the start)."""
        gap = now - self.last_heard
        self.last_heard = max(self.last_heard, now)
        self.heartbeats += 1
        if progress:
            self.progress = progress[:MAX_PROGRESS_CHARS]
        return gap

    def due(self) -> tuple[float, Expiry]:
        """When the call expires unless heard from again, and why it would."""
        silence = self.last_heard + self.limits.heartbeat_timeout_s
        cap = self.started + self.limits.max_processing_s
        if cap <= silence:
            return cap, Expiry.CAP
        return silence, Expiry.HEARTBEAT

    def expired(self, now: float) -> Expiry | None:
        """Why the call has expired at ``now``, or None while it may go on."""
        deadline, why = self.due()
        return why if now >= deadline else None

    def age(self, now: float) -> float:
        """How long the call has been open."""
        return now - self.started


def expiry_result(expiry: Expiry, limits: Limits, classifier: Classifier) -> Classification:
    """What an expired long call means for its message (see the module docstring)."""
    if expiry is Expiry.HEARTBEAT:
        ms = round(limits.heartbeat_timeout_s * 1000)
        return classifier.from_status(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"no heartbeat from the service within {ms} ms"
        )
    ms = round(limits.max_processing_s * 1000)
    return Classification(
        Outcome.RETRY,
        MAX_PROCESSING_STATUS,
        counted=True,
        service_failure=False,
        reason=f"still running after max_processing_ms ({ms} ms): cancelled",
    )


NO_RESULT_REASON = "the stream ended without a result"
"""A HandleMessageStream call that ended OK but sent no result: a broken service answer."""


def no_result(classifier: Classifier) -> Classification:
    """A stream that ended OK without its result event: retried like INTERNAL (counted)."""
    return classifier.from_status(grpc.StatusCode.INTERNAL, NO_RESULT_REASON)
