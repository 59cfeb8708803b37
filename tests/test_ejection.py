"""Endpoint ejection on a fake clock: every rule by example, then random schedules.

A failing schedule is replayed, step by step, with ``.venv/bin/python -m tests.test_ejection SEED``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer_proxy.core.ejection import (
    EJECT_AFTER_FAILURES,
    EJECT_BASE_S,
    EJECT_MAX_S,
    FAILED_CHECKS_TO_EJECT,
    Change,
    Ejection,
    Verdict,
)
from tests.support.clock import Clock

relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rotation(n: int, *, checking: bool = True) -> tuple[Ejection, Clock]:
    clock = Clock(1000.0)
    ejection = Ejection(n, clock, health_interval_s=5.0, ejected_check_interval_s=0.5)
    ejection.checking = checking
    return ejection, clock


def fail(ejection: Ejection, index: int, times: int) -> list[Change]:
    """``times`` UNAVAILABLE calls on ``index``; the changes they made."""
    changes = (ejection.observe(index, True, "UNAVAILABLE") for _ in range(times))
    return [c for c in changes if c is not None]


# -- passive ejection ----------------------------------------------------------------------


def test_service_failures_in_a_row_eject_an_instance_for_a_while() -> None:
    # Given three instances in rotation
    ejection, clock = rotation(3)
    # When instance 1 fails one call fewer than the limit, nothing happens
    assert fail(ejection, 1, EJECT_AFTER_FAILURES - 1) == []
    assert not ejection.instances[1].ejected
    # When it fails once more, it is out for the base time
    assert fail(ejection, 1, 1) == [
        Change(1, True, f"{EJECT_AFTER_FAILURES} UNAVAILABLE in a row", 1, EJECT_BASE_S)
    ]
    assert ejection.instances[1].ejected_until == clock.now + EJECT_BASE_S
    assert list(ejection.live()) == [0, 2]
    assert ejection.ejected == 1


def test_failures_that_are_not_the_services_never_eject() -> None:
    # Given an instance whose calls end in poison pills or acks (no service failure)
    ejection, _ = rotation(3)
    # When it answers many of them / Then it stays in rotation
    for _ in range(3 * EJECT_AFTER_FAILURES):
        assert ejection.observe(0, False, "INVALID_ARGUMENT") is None
    assert ejection.ejected == 0


def test_each_ejection_doubles_the_time_up_to_the_limit() -> None:
    # Given an instance that fails every call and a health service that says SERVING
    ejection, clock = rotation(2)
    durations = []
    for _ in range(8):
        # When it is ejected, checked SERVING, and returns when its time is over
        (change,) = fail(ejection, 0, EJECT_AFTER_FAILURES)
        durations.append(change.duration_s)
        ejection.apply_health(0, "serving")
        clock.advance(change.duration_s - 0.01)
        assert ejection.return_due() == []
        clock.advance(0.01)
        assert ejection.return_due() == [Change(0, False, "health check SERVING", 0)]
    # Then each ejection lasted twice the one before, up to the limit
    assert durations == [min(EJECT_MAX_S, EJECT_BASE_S * 2**k) for k in range(8)]
    assert durations[-1] == EJECT_MAX_S


def test_a_success_resets_the_failure_count_and_the_ejection_time() -> None:
    # Given an instance with one failure short of an ejection
    ejection, clock = rotation(2, checking=False)
    fail(ejection, 0, EJECT_AFTER_FAILURES - 1)
    # When one call succeeds, the count starts again
    assert ejection.observe(0, False, "OK") is None
    assert fail(ejection, 0, EJECT_AFTER_FAILURES - 1) == []
    # Given two ejections in a row (the second one for twice the time)
    fail(ejection, 0, 1)
    clock.advance(EJECT_BASE_S)
    ejection.return_due()
    (second,) = fail(ejection, 0, EJECT_AFTER_FAILURES)
    assert second.duration_s == 2 * EJECT_BASE_S
    clock.advance(second.duration_s)
    ejection.return_due()
    # When a call succeeds / Then the next ejection is for the base time again
    ejection.observe(0, False, "OK")
    (third,) = fail(ejection, 0, EJECT_AFTER_FAILURES)
    assert third.duration_s == EJECT_BASE_S


def test_failures_while_ejected_do_not_eject_again() -> None:
    # Given an ejected instance whose calls in flight keep failing
    ejection, clock = rotation(3)
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    until = ejection.instances[0].ejected_until
    clock.advance(1.0)
    # When they end / Then nothing changes: no second ejection, no longer time
    assert fail(ejection, 0, 3 * EJECT_AFTER_FAILURES) == []
    assert ejection.ejected == 1
    assert ejection.instances[0].ejected_until == until


# -- never the last one --------------------------------------------------------------------


def test_the_last_instance_in_rotation_is_never_ejected() -> None:
    # Given two instances, one of them ejected
    ejection, clock = rotation(2)
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    # When the other fails every call and every check
    assert fail(ejection, 1, 10 * EJECT_AFTER_FAILURES) == []
    assert ejection.apply_health(1, "not_serving") is None
    for _ in range(3 * FAILED_CHECKS_TO_EJECT):
        assert ejection.apply_health(1, "unreachable") is None
    # Then it stays in rotation, and is still checked at the normal pace
    assert list(ejection.live()) == [1]
    assert ejection.ejected == 1
    assert ejection.instances[1].next_check == clock.now + 5.0


def test_a_single_instance_is_never_ejected() -> None:
    ejection, _ = rotation(1)
    assert fail(ejection, 0, 10 * EJECT_AFTER_FAILURES) == []
    assert ejection.apply_health(0, "not_serving") is None
    assert (ejection.ejected, list(ejection.live())) == (0, [0])


def test_the_last_one_is_ejected_once_another_returns() -> None:
    # Given instance 1 kept in rotation, failing, while 0 was out
    ejection, clock = rotation(2, checking=False)
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    fail(ejection, 1, EJECT_AFTER_FAILURES + 3)
    # When 0 returns / Then 1's next failure ejects it (its streak was kept)
    clock.advance(EJECT_BASE_S)
    assert [c.index for c in ejection.return_due()] == [0]
    assert fail(ejection, 1, 1) == [
        Change(1, True, f"{EJECT_AFTER_FAILURES + 4} UNAVAILABLE in a row", 1, EJECT_BASE_S)
    ]


def test_there_is_no_instance_to_rotate() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Ejection(0, Clock(1000.0))


# -- active health checks ------------------------------------------------------------------


def test_not_serving_ejects_until_a_check_says_serving() -> None:
    # Given three instances in rotation
    ejection, clock = rotation(3)
    # When instance 2 says NOT_SERVING
    assert ejection.apply_health(2, "not_serving") == Change(2, True, "health check NOT_SERVING", 1)
    # Then it stays out however long it takes, while its checks fail
    clock.advance(3 * EJECT_MAX_S)
    ejection.apply_health(2, "not_serving")
    assert ejection.return_due() == []
    # When it says SERVING / Then it returns at once
    assert ejection.apply_health(2, "serving") is None  # returns are return_due's
    assert ejection.return_due() == [Change(2, False, "health check SERVING", 0)]
    assert list(ejection.live()) == [0, 1, 2]


def test_when_the_checks_stop_an_instance_seen_down_returns_on_its_ejection_time() -> None:
    # Given an instance ejected by a NOT_SERVING check
    ejection, clock = rotation(3)
    ejection.apply_health(2, "not_serving")
    assert ejection.return_due() == []
    # When the health checks stop (their loop died) / Then the ejection time alone decides
    ejection.checking = False
    clock.advance(0.001)
    assert ejection.return_due() == [Change(2, False, "ejection time over", 0)]


def test_two_failed_checks_in_a_row_eject() -> None:
    # Given an instance whose checks fail once, then pass
    ejection, _ = rotation(2)
    assert ejection.apply_health(0, "unreachable") is None
    assert ejection.apply_health(0, "serving") is None
    assert ejection.apply_health(0, "unreachable") is None
    # When two checks in a row fail / Then it is ejected
    assert ejection.apply_health(0, "unreachable") == Change(
        0, True, f"{FAILED_CHECKS_TO_EJECT} health checks failed", 1
    )
    # and it returns when a check passes
    assert ejection.apply_health(0, "serving") is None
    assert [c.reason for c in ejection.return_due()] == ["health check SERVING"]
    assert ejection.instances[0].failed_checks == 0


def test_failed_checks_count_again_from_a_return() -> None:
    # Given an instance whose check failed once, ejected for its calls, back on its time
    ejection, clock = rotation(2, checking=False)
    ejection.apply_health(0, "unreachable")
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    clock.advance(EJECT_BASE_S)
    assert [c.reason for c in ejection.return_due()] == ["ejection time over"]
    # When one check fails / Then that is the first in a row, not the second
    assert ejection.apply_health(0, "unreachable") is None
    assert ejection.apply_health(0, "unreachable") is not None


def test_serving_after_a_passive_ejection_waits_for_the_ejection_time() -> None:
    # Given an instance once ejected by a check and back, now ejected for its failing calls,
    # whose health service says SERVING
    ejection, clock = rotation(2)
    for verdict in ("not_serving", "unreachable", "serving"):
        ejection.apply_health(0, verdict)
    assert len(ejection.return_due()) == 1
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    assert ejection.instances[0].serving is None  # the verdict before the ejection is void
    ejection.apply_health(0, "serving")
    # When its ejection time is not over / Then SERVING is not believed
    clock.advance(EJECT_BASE_S - 0.1)
    ejection.apply_health(0, "serving")
    assert ejection.return_due() == []
    # When it is over / Then it returns
    clock.advance(0.1)
    assert ejection.return_due() == [Change(0, False, "health check SERVING", 0)]


def test_serving_after_a_check_saw_it_down_returns_it_before_its_time() -> None:
    # Given an instance ejected for its failing calls (it crashed)
    ejection, clock = rotation(2)
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    # When a check finds it down, and a later one SERVING (it restarted)
    ejection.apply_health(0, "unreachable")
    assert ejection.return_due() == []
    clock.advance(0.5)
    ejection.apply_health(0, "serving")
    # Then it returns long before its ejection time
    assert clock.now < ejection.instances[0].ejected_until
    assert ejection.return_due() == [Change(0, False, "health check SERVING", 0)]


def test_an_instance_without_a_health_service_returns_on_time_only() -> None:
    # Given an instance with no grpc.health.v1 service, ejected for its failing calls
    ejection, clock = rotation(2)
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    assert ejection.apply_health(0, "unsupported") is None
    assert not ejection.instances[0].health_supported
    # When its ejection time is not over / Then it stays out
    clock.advance(EJECT_BASE_S - 0.1)
    assert ejection.return_due() == []
    # When it is / Then it returns
    clock.advance(0.1)
    assert ejection.return_due() == [Change(0, False, "ejection time over", 0)]
    # and "unsupported" never ejects an instance in rotation
    for _ in range(3):
        assert ejection.apply_health(0, "unsupported") is None


def test_with_checks_running_a_passive_ejection_waits_for_a_verdict() -> None:
    # Given an instance checked SERVING, then ejected for its calls, with the checks running
    # but no verdict since
    ejection, clock = rotation(2)
    ejection.apply_health(0, "serving")
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    clock.advance(10 * EJECT_BASE_S)
    assert ejection.return_due() == []
    # When the checks stop / Then its ejection time alone decides
    ejection.checking = False
    assert ejection.return_due() == [Change(0, False, "ejection time over", 0)]


# -- the checking plan ---------------------------------------------------------------------


def check_round(ejection: Ejection, verdicts: Callable[[int], Verdict]) -> list[int]:
    """What the dispatcher's loop does once: check what is due, apply, return."""
    due = ejection.checks_due()
    for index in due:
        ejection.apply_health(index, verdicts(index))
    ejection.return_due()
    return due


def test_instances_in_rotation_are_checked_every_health_interval() -> None:
    # Given two instances never checked / Then both are due at once
    ejection, clock = rotation(2)
    assert check_round(ejection, lambda i: "serving") == [0, 1]
    # and then every health interval
    assert ejection.check_delay() == 5.0
    clock.advance(4.9)
    assert ejection.checks_due() == []
    clock.advance(0.1)
    assert check_round(ejection, lambda i: "serving") == [0, 1]


def test_an_ejected_instance_is_checked_at_once_then_every_ejected_interval() -> None:
    # Given two instances checked a second ago
    ejection, clock = rotation(2)
    check_round(ejection, lambda i: "serving")
    clock.advance(1.0)
    # When instance 0 is ejected for its calls / Then it is due at once, 1 is not
    fail(ejection, 0, EJECT_AFTER_FAILURES)
    assert ejection.check_delay() == 0
    assert check_round(ejection, lambda i: "unreachable") == [0]
    # and then every ejected interval while it is out
    for _ in range(4):
        assert ejection.check_delay() == 0.5
        clock.advance(0.5)
        assert check_round(ejection, lambda i: "unreachable") == [0]
    # When it returns / Then it is back at the normal pace
    clock.advance(0.5)
    assert check_round(ejection, lambda i: "serving") == [0]
    assert not ejection.instances[0].ejected
    assert ejection.instances[0].next_check == clock.now + 5.0


def test_an_instance_ejected_by_a_check_is_next_checked_after_the_ejected_interval() -> None:
    ejection, clock = rotation(2)
    ejection.apply_health(1, "not_serving")
    assert ejection.instances[1].ejected
    assert ejection.instances[1].next_check == clock.now + 0.5


def test_a_round_of_verdicts_is_applied_before_anyone_returns() -> None:
    # Given 0 ejected by a check, and a round in which 0 says SERVING and 1 NOT_SERVING
    ejection, clock = rotation(2)
    ejection.apply_health(0, "not_serving")
    clock.advance(0.5)
    verdicts: dict[int, Verdict] = {0: "serving", 1: "not_serving"}
    assert check_round(ejection, verdicts.__getitem__) == [0, 1]
    # Then 1 was the last in rotation when its verdict came: it stays, and 0 returns
    assert ejection.ejected == 0


# -- random schedules ----------------------------------------------------------------------

# How a simulated instance behaves: the chance that a call fails, and its checks' verdict.
WORLDS: dict[str, tuple[float, Verdict]] = {
    "healthy": (0.02, "serving"),
    "crashed": (1.0, "unreachable"),
    "draining": (0.9, "not_serving"),
    "liar": (1.0, "serving"),  # its health service says SERVING while its calls fail
    "no-health": (0.5, "unsupported"),
    "flaky": (0.5, "unreachable"),  # and SERVING every other check
}


@dataclass
class Expected:
    """What the rules, read from the module docstring, say about one instance: kept apart
    from the core's own state so that the simulation checks one against the other."""

    failures: int = 0  # service failures in a row
    ejections: int = 0  # passive ejections since the last success
    failed_checks: int = 0  # in a row, since the last return
    out: bool = False
    until: float = 0.0
    serving: bool | None = None  # the last verdict since the last passive ejection
    seen_down: bool = False
    supported: bool = True
    next_check: float = 0.0


class EjectionModel:
    """A model check of the ejection rules (not the group simulation of ``tests/sim``): one
    seeded schedule of calls, checks, clock moves and changes of the instances, each answer of
    ``Ejection`` compared with what the model expects."""

    def __init__(self, seed: int, trace: Callable[[str], None] | None) -> None:
        self.rng = rng = random.Random(seed)
        self.trace = trace or (lambda line: None)
        self.clock = Clock(1000.0)
        self.n = n = rng.randint(1, 5)
        self.health_interval = rng.choice([0.2, 1.0, 5.0])
        self.ejected_interval = rng.choice([0.05, 0.5])
        self.ejection = Ejection(
            n,
            self.clock,
            health_interval_s=self.health_interval,
            ejected_check_interval_s=self.ejected_interval,
        )
        self.ejection.checking = n > 1 and rng.random() < 0.8
        self.world = [rng.choice(list(WORLDS)) for _ in range(n)]
        self.expected = [Expected() for _ in range(n)]
        self.reported_out = 0  # instances out of rotation, from the changes alone

    @property
    def last_in_rotation(self) -> bool:
        return sum(e.out for e in self.expected) == self.n - 1

    def report(self, change: Change) -> None:
        self.trace(f"  {change}")
        self.reported_out += 1 if change.ejected else -1
        assert change.out == self.reported_out

    def call(self, i: int, failed: bool) -> None:
        """A call on ``i`` ends: the passive rule."""
        now, e = self.clock.now, self.expected[i]
        last = self.last_in_rotation
        change = self.ejection.observe(i, failed, "UNAVAILABLE")
        self.trace(f"  call {i}: {'failed' if failed else 'ok'}")
        if not failed:
            e.failures = e.ejections = 0
            assert change is None
            return
        e.failures += 1
        if e.failures < EJECT_AFTER_FAILURES or e.out or last:
            assert change is None
            return
        duration = min(EJECT_MAX_S, EJECT_BASE_S * 2**e.ejections)
        assert change is not None
        assert change == Change(i, True, f"{e.failures} UNAVAILABLE in a row", change.out, duration)
        self.report(change)
        e.ejections, e.failures = e.ejections + 1, 0
        e.out, e.until, e.serving, e.seen_down, e.next_check = (
            True,
            now + duration,
            None,
            False,
            now,
        )

    def verdict(self, i: int, verdict: Verdict) -> None:
        """A check of ``i`` answers: the active rule and the checking pace."""
        now, e = self.clock.now, self.expected[i]
        last = self.last_in_rotation
        change = self.ejection.apply_health(i, verdict)
        self.trace(f"  check {i}: {verdict}")
        ejects = False
        if verdict == "unsupported":
            e.supported, e.serving = False, None
        else:
            e.supported, e.serving = True, verdict == "serving"
            e.failed_checks = 0 if e.serving else e.failed_checks + 1
            if e.out:
                e.seen_down = e.seen_down or not e.serving
            else:
                ejects = not last and (
                    verdict == "not_serving" or e.failed_checks >= FAILED_CHECKS_TO_EJECT
                )
        if ejects:
            assert change is not None
            assert (change.index, change.ejected, change.duration_s) == (i, True, 0.0)
            self.report(change)
            e.out, e.until, e.seen_down, e.next_check = True, now, True, now
        else:
            assert change is None
        interval = self.ejected_interval if e.out else self.health_interval
        e.next_check = max(e.next_check, now + interval)

    def return_due(self) -> None:
        """The return rule: exactly the instances it allows come back, each for its reason."""
        now, checking = self.clock.now, self.ejection.checking
        due = {}
        for i, e in enumerate(self.expected):
            if e.out and e.serving is True and (e.seen_down or now >= e.until):
                due[i] = "health check SERVING"
            elif (
                e.out
                and now >= e.until
                and (not checking or (e.serving is None and not e.supported))
            ):
                due[i] = "ejection time over"
        changes = self.ejection.return_due()
        assert {c.index: c.reason for c in changes} == due
        for change in changes:
            assert not change.ejected
            self.report(change)
            e = self.expected[change.index]
            e.out, e.failed_checks, e.next_check = False, 0, now + self.health_interval

    def check_round(self) -> None:
        """What the dispatcher's health loop does once."""
        due = self.ejection.checks_due()
        assert due == [i for i, e in enumerate(self.expected) if e.next_check <= self.clock.now]
        for i in due:
            verdict = WORLDS[self.world[i]][1]
            if self.world[i] == "flaky":
                verdict = self.rng.choice(["unreachable", "serving"])
            self.verdict(i, verdict)
        self.return_due()

    def check_invariants(self) -> None:
        states, n = self.ejection.instances, self.n
        assert 0 <= self.ejection.ejected < n, "every instance out of rotation"
        assert [s.ejected for s in states] == [e.out for e in self.expected]
        assert self.ejection.ejected == sum(s.ejected for s in states) == self.reported_out
        assert list(self.ejection.live()) == [i for i in range(n) if not states[i].ejected]
        if self.ejection.checking:
            delay = min(e.next_check for e in self.expected) - self.clock.now
            assert self.ejection.check_delay() == pytest.approx(delay)

    def step(self, number: int) -> None:
        rng, n = self.rng, self.n
        roll = rng.random()
        self.trace(f"{number} t={self.clock.now:.3f} world={self.world}")
        if roll < 0.4:  # a call ends, mostly on an instance in rotation
            i = rng.choice(self.ejection.live()) if rng.random() < 0.9 else rng.randrange(n)
            self.call(i, rng.random() < WORLDS[self.world[i]][0])
        elif roll < 0.6 and self.ejection.checking:
            self.check_round()
        elif roll < 0.8:
            self.clock.advance(rng.expovariate(1.0))
        elif roll < 0.88:
            self.world[rng.randrange(n)] = rng.choice(list(WORLDS))
        elif roll < 0.9 and n > 1:
            self.ejection.checking = not self.ejection.checking
        else:  # a pick
            self.return_due()
        self.check_invariants()

    def heal(self) -> None:
        """Every instance says SERVING from now on: each ejected one is back by its ejection
        time, or one ejected-check interval after it heals if that is later."""
        self.world = ["healthy"] * self.n
        self.ejection.checking = self.n > 1
        healed = self.clock.now
        deadline = {
            i: max(e.until, healed) + self.ejected_interval + 1e-6
            for i, e in enumerate(self.expected)
            if e.out
        }
        while deadline:
            assert self.clock.now <= max(deadline.values()), (deadline, self.ejection.instances)
            self.check_round()
            self.check_invariants()
            for i in [i for i in deadline if not self.expected[i].out]:
                assert self.clock.now <= deadline.pop(i)
            self.clock.advance(self.ejection.check_delay())
        assert self.ejection.ejected == 0


def simulate(seed: int, steps: int = 400, trace: Callable[[str], None] | None = None) -> None:
    """Run one schedule, checking every rule at every step, then heal every instance."""
    simulation = EjectionModel(seed, trace)
    for number in range(steps):
        simulation.step(number)
    simulation.heal()


@settings(relaxed, max_examples=300)
@given(st.integers(0, 2**32 - 1))
def test_random_schedules_keep_the_rules(seed: int) -> None:
    simulate(seed)


if __name__ == "__main__":
    simulate(int(sys.argv[1]), trace=print)
