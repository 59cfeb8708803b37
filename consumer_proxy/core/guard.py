"""The dead-letter guard: a bad deploy never floods the DLQ.

A service deploy with a bug that rejects every message (INVALID_ARGUMENT, a DEAD_LETTER
answer, or failures until ``max_attempts``) turns each message into a "poison pill"; the
breaker does not help, since the service answers. The guard watches the ratio of dead-letter
decisions among the group's most recent finished messages (acked, dropped, dead-lettered):
the last ``min_messages`` of them, all finished within ``window_ms`` (a few more when the
counts were sampled between them). It trips when that ratio exceeds ``max_ratio``. Taking the
ratio over the last ``min_messages``, not over everything in the window, bounds the damage of
a bad deploy after a busy healthy spell: about ``min_messages`` dead letters at most are
written before it trips, however many acks came before.

While it is held, a message that would be dead-lettered stays in its window instead
(``PartitionSet`` parks it and pauses its partition), with no attempt spent. One held message
is retried every ``probe_interval_ms``, and its ack (or a DROP: the service decided it)
releases the guard; so does having nothing left to probe (the held messages left with their
partitions). The held messages are retried, their attempts counted from where they were. An
operator may release the guard instead (the held messages then go to the DLQ), or hold a group
by hand (no probe releases a hold made by hand).

The ratio is read from the group's cumulative counts, sampled when a dead letter is decided
and at the group's pause ticks, so the ack path costs nothing. Bounded: at most
``min_messages`` + 1 samples. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import DeadLetterGuardConfig


@dataclass(frozen=True, slots=True)
class GuardView:
    """What health, metrics and ``status`` say of a guard."""

    held: bool
    since: float | None  # epoch seconds the guard was held at
    by_operator: bool
    ratio: float  # dead letters / finished over the window, at the last sample
    finished: int  # finished messages in the window, at the last sample
    trips: int


class DeadLetterGuard:
    """One group's guard: trips on the dead-letter ratio, released by a probe or an operator."""

    __slots__ = (
        "_max_ratio",
        "_min",
        "_samples",
        "_window_s",
        "by_operator",
        "finished",
        "probe_interval_s",
        "ratio",
        "since",
        "trips",
    )

    def __init__(self, config: DeadLetterGuardConfig) -> None:
        self._window_s = config.window_ms / 1000.0
        self._max_ratio = config.max_ratio
        self._min = config.min_messages
        self.probe_interval_s = config.probe_interval_ms / 1000.0
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, finished, dead)
        self.since: float | None = None
        """When the guard was held (None: released)."""
        self.by_operator = False
        self.ratio = 0.0
        self.finished = 0
        self.trips = 0

    @property
    def held(self) -> bool:
        """Dead letters are held instead of written."""
        return self.since is not None

    def observe(self, now: float, finished: int, dead: int) -> bool:
        """Fold in the group's cumulative counts of finished messages and of dead-letter
        decisions among them; True when the guard trips now."""
        samples = self._samples
        if not samples or samples[-1][1] != finished:
            samples.append((now, finished, dead))
        # The base: the newest sample at least min_messages finished messages back (older
        # ones are dropped), unless that is older than the window.
        horizon = now - self._window_s
        while samples and (
            samples[0][0] < horizon or (len(samples) > 1 and finished - samples[1][1] >= self._min)
        ):
            samples.popleft()
        if not samples:
            samples.append((now, finished, dead))
        _, finished_then, dead_then = samples[0]
        window = finished - finished_then
        self.finished = window
        self.ratio = (dead - dead_then) / window if window else 0.0
        if self.since is None and window >= self._min and self.ratio > self._max_ratio:
            self.since = now
            self.by_operator = False
            self.trips += 1
            return True
        return False

    def hold(self, now: float) -> bool:
        """An operator holds the group by hand (no probe releases it); False if held already
        by hand."""
        if self.since is not None and self.by_operator:
            return False
        self.since = self.since if self.since is not None else now
        self.by_operator = True
        return True

    def release(self) -> None:
        """Released (a probe was acked, or an operator said so): the window starts afresh, so
        the dead letters that tripped it do not trip it again at once."""
        self.since = None
        self.by_operator = False
        self._samples.clear()
        self.ratio = 0.0
        self.finished = 0

    def view(self) -> GuardView:
        """The guard's state for health, metrics and ``status``."""
        return GuardView(
            self.held, self.since, self.by_operator, self.ratio, self.finished, self.trips
        )
