"""The dead-letter guard (core/guard.py) and how the core holds dead letters while it is held
(core/partitions.py), on a virtual clock. The same rules run under the seeded schedules of
tests/sim ("bad deploys"), and against the real broker in tests/test_guard_e2e.py."""

from __future__ import annotations

import random

import grpc
import pytest

from consumer_proxy.config import (
    BackoffConfig,
    DeadLetterGuardConfig,
    DeliveryConfig,
)
from consumer_proxy.core.decision import Action
from consumer_proxy.core.guard import DeadLetterGuard
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.partitions import Delivery
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.core import ACK, CoreRig
from tests.support.records import Rec

CLASSIFY = Classifier()
POISON = CLASSIFY.from_status(grpc.StatusCode.INVALID_ARGUMENT, "bad deploy")
DROP = CLASSIFY.from_response(
    handler_pb2.HandleMessageResponse(action=handler_pb2.HandleMessageResponse.DROP)
)
GUARD = DeadLetterGuardConfig(min_messages=20, window_ms=60_000, probe_interval_ms=1000)


# -- the ratio ---------------------------------------------------------------------------------


def feed(guard: DeadLetterGuard, outcomes: list[bool], now: float = 0.0) -> int | None:
    """Finish one message per outcome (True: dead letter); the index that tripped it."""
    dead = 0
    for index, is_dead in enumerate(outcomes):
        dead += is_dead
        if guard.observe(now + index * 0.01, index + 1, dead):
            return index
    return None


def test_a_bad_deploy_after_a_busy_healthy_spell_trips_within_min_messages() -> None:
    # Given 1,000 acks, then every message dead-lettered
    guard = DeadLetterGuard(GUARD)
    tripped = feed(guard, [False] * 1000 + [True] * 100)
    # Then the guard trips after at most min_messages dead letters (not after 1,000)
    assert tripped is not None and 1000 < tripped <= 1000 + 20
    assert guard.held and guard.ratio > 0.5


def test_fewer_than_min_messages_never_trip_it() -> None:
    guard = DeadLetterGuard(GUARD)
    assert feed(guard, [True] * 19) is None and not guard.held


def test_old_finishes_fall_out_of_the_window() -> None:
    # Given 15 dead letters an hour ago, then 15 now: never 20 within the minute
    guard = DeadLetterGuard(GUARD)
    for n, t in enumerate([0.0] * 15 + [3600.0] * 15, start=1):
        assert not guard.observe(t, n, n)


@pytest.mark.parametrize("seed", range(20))
def test_one_percent_poison_never_trips_the_default_guard(seed: int) -> None:
    rng = random.Random(seed)
    guard = DeadLetterGuard(DeadLetterGuardConfig())
    assert feed(guard, [rng.random() < 0.01 for _ in range(20_000)]) is None


def test_thirty_percent_poison_does_not_trip_the_default_guard() -> None:
    # (documented: more than 50 of any 100 is about 1 in 70,000 windows at 30 %)
    rng = random.Random(30)
    guard = DeadLetterGuard(DeadLetterGuardConfig())
    assert feed(guard, [rng.random() < 0.3 for _ in range(20_000)]) is None


def test_memory_is_bounded_by_min_messages() -> None:
    guard = DeadLetterGuard(GUARD)
    feed(guard, [False] * 10_000)
    assert len(guard._samples) <= GUARD.min_messages + 1


# -- the core holds dead letters -------------------------------------------------------------


class Rig(CoreRig):
    def __init__(self, guard: DeadLetterGuardConfig = GUARD) -> None:
        super().__init__(
            DeliveryConfig(max_attempts=3, backoff=BackoffConfig(initial_ms=10, jitter=0.0)),
            guard=guard,
        )
        self.dead: list[Delivery] = []

    def push(self, result: Classification) -> Action | None:
        delivery, decision = self.finish_next(result)
        if decision is not None and decision.action is Action.DEAD_LETTER:
            self.dead.append(delivery)
            self.core.dead_lettered(delivery)  # the write is confirmed at once here
        return decision.action if decision is not None else None


def test_a_tripped_guard_holds_dead_letters_in_their_window_and_pauses_the_partition() -> None:
    # Given a group that acked 50 messages, then a bad deploy that rejects every message
    rig = Rig()
    for offset in range(100):
        rig.core.intake(Rec("t", offset))
    actions = [rig.push(ACK) for _ in range(50)] + [rig.push(POISON) for _ in range(50)]
    # Then at most min_messages were dead-lettered before it tripped; the rest are held
    assert actions.count(Action.DEAD_LETTER) <= GUARD.min_messages
    held = actions.count(Action.HOLD)
    assert held > 0 and actions[-1] is Action.HOLD
    state = rig.core.guard_state()
    assert state is not None and state[0].held and state[1] == held
    # ... in their window (the commit stops at the first), their partition paused, no
    # attempt spent on them
    tracker = rig.core.parts[("t", 0)].tracker
    assert tracker is not None and tracker.committable() == 50 + len(rig.dead)
    assert rig.core.pause_plan().pause == [("t", 0)]
    assert all(h.delivery.counted_here == 0 for h in rig.core._held)


@pytest.mark.parametrize("answer", ["ack", "drop"])
def test_a_probe_that_is_acked_releases_the_guard_and_every_held_message_is_retried(
    answer: str,
) -> None:
    # (a DROP is an answer the service decided too: it releases the guard as an ack does)
    rig = Rig()
    for offset in range(60):
        rig.core.intake(Rec("t", offset))
    for _ in range(60):
        rig.push(POISON)
    dead = len(rig.dead)
    # When the probe interval passes, one held message is retried; the service was rolled back
    rig.clock.run_until(rig.clock.now + 1.0)
    assert len(rig.ready) == 1
    if answer == "ack":
        assert rig.push(ACK) is Action.ACK
    else:
        assert rig.push(DROP) is Action.DROP
    # Then the guard is released and every held message comes again, attempts as they were
    state = rig.core.guard_state()
    assert state is not None and not state[0].held and state[1] == 0
    assert len(rig.ready) == 60 - dead - 1
    while rig.ready:
        assert rig.push(ACK) is Action.ACK
    tracker = rig.core.parts[("t", 0)].tracker
    assert tracker is not None and tracker.committable() == 60
    assert rig.core.pause_plan().resume == [("t", 0)]


def test_a_probe_rejected_again_stays_held_and_the_next_probe_follows() -> None:
    rig = Rig()
    for offset in range(40):
        rig.core.intake(Rec("t", offset))
    for _ in range(40):
        rig.push(POISON)
    dead = len(rig.dead)
    for _ in range(3):
        rig.clock.run_until(rig.clock.now + 1.0)
        assert rig.push(POISON) is Action.HOLD
    assert len(rig.dead) == dead  # nothing more written while held


def test_an_operator_release_sends_the_held_messages_to_the_dlq_with_their_status() -> None:
    rig = Rig()
    for offset in range(40):
        rig.core.intake(Rec("t", offset))
    for _ in range(40):
        rig.push(POISON)
    released = rig.core.guard_release()
    assert released and all(h.status == "INVALID_ARGUMENT" for h in released)
    assert all(h.decision.action is Action.DEAD_LETTER for h in released)
    for held in released:
        rig.core.dead_lettered(held.delivery)
    tracker = rig.core.parts[("t", 0)].tracker
    assert tracker is not None and tracker.committable() == 40


def test_a_hold_by_hand_is_not_released_by_a_probe() -> None:
    rig = Rig()
    for offset in range(5):
        rig.core.intake(Rec("t", offset))
    assert rig.core.guard_hold()
    assert rig.push(POISON) is Action.HOLD
    rig.clock.run_until(rig.clock.now + 10.0)
    assert not rig.ready or all(not d.guard_probe for d in rig.ready)
    state = rig.core.guard_state()
    assert state is not None and state[0].by_operator and state[1] == 1


def test_a_revoked_partition_forgets_its_held_messages() -> None:
    rig = Rig()
    for offset in range(40):
        rig.core.intake(Rec("t", offset))
    for _ in range(40):
        rig.push(POISON)
    rig.core.forget(rig.core.parts[("t", 0)])
    assert rig.core.guard_release() == [] and rig.core.bytes == 0


def test_a_disabled_guard_dead_letters_as_before() -> None:
    rig = Rig(DeadLetterGuardConfig(enabled=False, min_messages=1))
    for offset in range(30):
        rig.core.intake(Rec("t", offset))
    assert all(rig.push(POISON) is Action.DEAD_LETTER for _ in range(30))


class TwoPartitionRig(CoreRig):
    """A guarded group of two partitions; ``push_next`` finishes the oldest ready message
    of one of them."""

    def __init__(self) -> None:
        super().__init__(
            DeliveryConfig(max_attempts=3, backoff=BackoffConfig(initial_ms=10, jitter=0.0)),
            tps=(("t", 0), ("t", 1)),
            guard=GUARD,
        )
        self.dead: list[Delivery] = []

    def push_next(self, result: Classification, tp: tuple[str, int]) -> Action | None:
        """Push the oldest ready message of ``tp`` and finish it with ``result``."""
        delivery = next(d for d in self.ready if (d.part.topic, d.part.partition) == tp)
        self.ready.remove(delivery)
        assert self.core.begin(delivery)
        self.breaker.record(result.service_failure, probe=False)
        decision = self.core.finish(delivery, result, probe=False)
        if decision is not None and decision.action is Action.DEAD_LETTER:
            self.dead.append(delivery)
            self.core.dead_lettered(delivery)
        return decision.action if decision is not None else None


def test_a_guard_whose_held_messages_all_left_with_their_partition_is_released() -> None:
    # Given a bad deploy that tripped the guard while only partition t-0 had traffic: every
    # held message is on t-0
    rig = TwoPartitionRig()
    for offset in range(40):
        rig.core.intake(Rec("t", offset, partition=0))
    for _ in range(40):
        rig.push_next(POISON, ("t", 0))
    state = rig.core.guard_state()
    assert state is not None and state[0].held and state[1] > 0
    # When t-0 is revoked (its new owner probes and redelivers it), and the service is rolled
    # back: t-1's messages are all acked
    rig.core.forget(rig.core.parts[("t", 0)])
    for offset in range(200):
        rig.core.intake(Rec("t", offset, partition=1))
    for _ in range(200):
        assert rig.push_next(ACK, ("t", 1)) is Action.ACK
    rig.clock.advance(60.0)  # many probe intervals, a whole guard window
    # Then the guard, holding nothing and with nothing to probe, does not stay held (/readyz
    # 503, guard_held 1) for ever ...
    state = rig.core.guard_state()
    assert state is not None
    view, held = state
    assert held == 0
    # ... and a single genuine poison pill on t-1 (1 in 201 finished: far below max_ratio)
    # is dead-lettered, not held with its partition paused for good
    rig.core.intake(Rec("t", 200, partition=1))
    action = rig.push_next(POISON, ("t", 1))
    for _ in range(10):  # ten probes: each is rejected again (it is real poison)
        rig.clock.advance(1.0)
        for _probe in [d for d in rig.ready if d.guard_probe]:
            rig.push_next(POISON, ("t", 1))
    plan = rig.core.pause_plan()
    assert (view.held, action, ("t", 1) in plan.pause or rig.core.parts[("t", 1)].paused) == (
        False,
        Action.DEAD_LETTER,
        False,
    )
