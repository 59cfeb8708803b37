"""The shell's side of the dead-letter guard: what operators and probes see, what they do.

The decisions (when it trips, what it holds, when a probe releases it) are the core's
(``core/guard.py``, ``PartitionSet``). ``GuardControl`` owns the rest: the gauges read on each
scrape, the /readyz detail, and the operator's release (the held messages go to the DLQ
through the group's ``Tally``, like any dead letter) and hold by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .core.partitions import PartitionSet
from .metrics import ProxyMetrics
from .parking import Tally


class GuardControl:
    """One group's dead-letter guard as its operators see it."""

    def __init__(
        self,
        name: str,
        partitions: PartitionSet,
        tally: Tally,
        metrics: ProxyMetrics,
        changed: Callable[[], None],
    ) -> None:
        """``changed`` is told when an operator's action changes the group's health."""
        self._partitions = partitions
        self._tally = tally
        self._changed = changed
        guard = partitions.guard
        if guard is not None:  # read on each scrape: nothing to keep up to date
            metrics.guard_held.labels(name).set_function(lambda: float(guard.held))
            metrics.guard_trips.labels(name).set_function(lambda: float(guard.trips))
            metrics.guard_held_messages.labels(name).set_function(
                lambda: float(sum(len(p.held) for p in partitions.parts.values()))
            )

    @property
    def enabled(self) -> bool:
        """The group has a guard (``dead_letter_guard.enabled``)."""
        return self._partitions.guard is not None

    @property
    def problem(self) -> str:
        """What /readyz says while the guard holds ('' when it does not)."""
        state = self._partitions.guard_state()
        if state is None or not state[0].held:
            return ""
        view, held = state
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(view.since or 0))
        who = " by an operator" if view.by_operator else ""
        return (
            f"dead-letter guard: held{who} since {since}, {held} held, ratio {view.ratio:.2f} "
            f"of the last {view.finished} finished"
        )

    def release(self) -> int:
        """An operator says the dead letters are real: the held messages go to the DLQ (each
        done once its write is confirmed). Returns how many."""
        released = self._partitions.guard_release()
        for held in released:
            self._tally.settled(held.delivery, held.decision, held.status, "")
        self._changed()
        return len(released)

    def hold(self) -> bool:
        """An operator holds the group's dead letters by hand (an incident)."""
        changed = self._partitions.guard_hold()
        self._changed()
        return changed
