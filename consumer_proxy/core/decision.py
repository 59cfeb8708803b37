"""The outcome decision: what becomes of a message after one push.

(the message's attempt counts, the classified result, what the breaker saw around the call,
the policy) -> ack / drop / retry(delay, counted) / dead-letter(reason). Pure: no I/O, no
asyncio; the randomness of the backoff jitter comes from an injected ``random.Random``.

The outage rule (docs/guarantees.md, guarantee 2): a failure the breaker counts (a deadline, say) is
charged to the message only while the service is demonstrably healthy, i.e. it answered some
other call successfully since this message's previous attempt ended (or, for a first attempt,
since this call started). A failed half-open probe is never charged, and neither is a call
that was in flight when the breaker opened. A message that keeps timing out while the service
answers others is still dead-lettered after ``max_attempts``.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from ..config import BackoffConfig
from .outcomes import Classification, Outcome, backoff_s


class Action(enum.Enum):
    """What the shell does with the message next."""

    ACK = "ack"
    DROP = "drop"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    TIER = "tier"
    """Move to a retry tier: write to ``<group>.retry.<tier>``, done once confirmed."""
    HOLD = "hold"
    """Held by the dead-letter guard (``core/guard.py``): it waits in its window instead of
    going to the DLQ, until a probe's ack or an operator releases the guard."""


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the breaker saw around one call (all pure counts, no clock)."""

    probe: bool = False
    """The call was the half-open probe."""
    opened_during_call: bool = False
    """The breaker opened while the call was in flight."""
    service_answered: bool = True
    """Another call succeeded since this message's previous attempt ended (or this call began)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The group's retry policy."""

    max_attempts: int
    backoff: BackoffConfig
    tiers_ms: tuple[int, ...] = ()
    """The retry tiers' delays (``delivery.retry_topics``); empty: retries in memory only."""
    in_memory_attempts: int = 1
    """With tiers: counted attempts made from memory before a message moves to tier 1."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The next step for one message."""

    action: Action
    delay_s: float = 0.0
    counted: bool = False
    reason: str = ""
    tier: int = 0
    """With ``Action.TIER``: the tier (1-based) the message moves to, ``delay_s`` later."""


_ACK = Decision(Action.ACK)
_DROP = Decision(Action.DROP)


def charged(result: Classification, evidence: Evidence) -> bool:
    """Whether a failed attempt counts towards ``max_attempts``."""
    if not result.counted:
        return False
    if not result.service_failure:
        return True  # the message's own failure (INTERNAL, RESOURCE_EXHAUSTED, ...)
    return not evidence.probe and not evidence.opened_during_call and evidence.service_answered


def decide(
    counted: int,
    uncounted: int,
    result: Classification,
    evidence: Evidence,
    policy: Policy,
    rng: random.Random,
    tier: int = 0,
) -> Decision:
    """The decision after a push, given the failures already counted / not counted.

    ``tier`` is the retry tier the message was read from (0: a source or redrive topic).
    With retry tiers, a counted failure moves the message to the next tier once its
    in-memory attempts are spent (at once when it came from a tier), and to the DLQ after
    the last tier or at ``max_attempts``, whichever comes first. An uncounted (outage)
    failure never moves it: it waits in memory, as without tiers.
    """
    outcome = result.outcome
    if outcome is Outcome.ACK:
        return _ACK
    if outcome is Outcome.DROP:
        return _DROP
    if outcome is Outcome.DEAD_LETTER:
        return Decision(Action.DEAD_LETTER, reason=result.reason)
    if charged(result, evidence):
        if counted + 1 >= policy.max_attempts:
            reason = f"gave up after {counted + 1} attempts: {result.reason}"
            return Decision(Action.DEAD_LETTER, counted=True, reason=reason)
        tiers = policy.tiers_ms
        if tiers and (tier > 0 or counted + 1 >= policy.in_memory_attempts):
            nxt = tier + 1
            if nxt > len(tiers):
                reason = f"gave up after the last retry tier ({counted + 1} attempts): "
                return Decision(Action.DEAD_LETTER, counted=True, reason=reason + result.reason)
            # The tier's delay, or longer when the service asks: a tier holds no window, so
            # retry_after is not capped by backoff.max_ms here, but by the longest tier delay
            # (2**63-1 ms would park the tier partition for 292 million years).
            delay_ms = max(tiers[nxt - 1], min(result.retry_after_ms or 0, max(tiers)))
            return Decision(Action.TIER, delay_ms / 1000.0, True, result.reason, tier=nxt)
        delay = backoff_s(counted + 1, policy.backoff, rng)
        is_counted = True
    else:
        delay = backoff_s(uncounted + 1, policy.backoff, rng)
        is_counted = False
    if result.retry_after_ms:
        # Capped by backoff.max_ms: a service asking for days would hold the partition's
        # commit (and its window) for that long.
        delay = min(result.retry_after_ms, policy.backoff.max_ms) / 1000.0
    return Decision(Action.RETRY, delay, is_counted, result.reason)


HEAD_BLOCKED = "HEAD_BLOCKED"
"""The status recorded (``cp-status``) for a message moved aside as it blocked its partition."""


def unblock(counted: int, tier: int, policy: Policy, waited_s: float) -> Decision:
    """The decision for a message that blocks the head of its partition (head-of-line
    unblocking): its attempt under way counts as failed, and it moves to the next retry tier,
    or to the DLQ after the last tier or at ``max_attempts``."""
    reason = f"blocked the head of its partition for {waited_s:.1f}s"
    if counted + 1 >= policy.max_attempts or tier + 1 > len(policy.tiers_ms):
        return Decision(Action.DEAD_LETTER, counted=True, reason=f"gave up: {reason}")
    return Decision(Action.TIER, policy.tiers_ms[tier] / 1000.0, True, reason, tier=tier + 1)
