"""What the simulation knows about every message, and how it reports a broken invariant."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvariantViolation(AssertionError):
    """An invariant failed; the message names the seed and step."""


@dataclass
class Truth:
    """Ground truth about every message."""

    behaviour: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # acked, dropped or confirmed in the DLQ
    acked: set[int] = field(default_factory=set)
    dup_ok: set[int] = field(default_factory=set)  # may be delivered again (crash, budget)
    attempts: dict[int, int] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)  # rejected by a bad deploy at least once
    released: set[int] = field(default_factory=set)  # held, then sent to the DLQ by an operator
