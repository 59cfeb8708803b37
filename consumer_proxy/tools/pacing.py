"""A write-rate pacer for ``dlq merge --rate`` (pure logic: the clock is injected).

GCRA (the generic cell rate algorithm): record *i* is due at ``start + i / rate`` and may go
up to ``tolerance_s`` early. The tolerance absorbs sleep jitter (a late wake-up does not
shift the schedule) while any one-second window holds at most ``rate * (1 + tolerance_s) + 1``
records. A writer that stalled longer than the tolerance does not catch up with a burst: the
schedule restarts from now.
"""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_TOLERANCE_S = 0.05


class Pacer:
    """Says how long to wait before the next record so the rate stays under ``rate``/s."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float],
        tolerance_s: float = DEFAULT_TOLERANCE_S,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.interval = 1.0 / rate
        self.tolerance_s = max(0.0, tolerance_s)
        self._clock = clock
        self._due: float | None = None  # when the next record is due (None: not started)

    def delay(self) -> float:
        """Seconds to wait before the next record may go (0 when it may go now)."""
        if self._due is None:
            return 0.0
        return max(0.0, self._due - self.tolerance_s - self._clock())

    def sent(self) -> None:
        """Record that one record went (call after waiting ``delay()``)."""
        now = self._clock()
        self._due = max(self._due if self._due is not None else now, now) + self.interval
