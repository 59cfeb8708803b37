"""The outcome decision (pure): the outage rule for attempt charging, retries and dead letters."""

from __future__ import annotations

import random

import grpc
import pytest

from consumer_proxy.config import BackoffConfig
from consumer_proxy.core.decision import Action, Evidence, Policy, charged, decide
from consumer_proxy.core.outcomes import Classifier

C = grpc.StatusCode
POLICY = Policy(max_attempts=3, backoff=BackoffConfig(initial_ms=100, max_ms=1000, jitter=0.0))
classify = Classifier().from_status
DEADLINE = classify(C.DEADLINE_EXCEEDED, "deadline")
HEALTHY = Evidence(service_answered=True)


def test_a_deadline_while_the_service_answers_others_is_charged() -> None:
    assert charged(DEADLINE, HEALTHY)


@pytest.mark.parametrize(
    "evidence",
    [
        Evidence(service_answered=False),
        Evidence(probe=True, service_answered=True),
        Evidence(opened_during_call=True, service_answered=True),
    ],
    ids=["nothing-answered", "half-open-probe", "breaker-opened-during-call"],
)
def test_a_deadline_during_an_outage_is_never_charged(evidence: Evidence) -> None:
    # Given a message at its last counted attempt
    decision = decide(2, 0, DEADLINE, evidence, POLICY, random.Random(1))
    # Then an outage-looking deadline retries it, uncounted, instead of dead-lettering it
    assert decision.action is Action.RETRY and not decision.counted


def test_a_message_that_always_times_out_while_others_succeed_is_dead_lettered() -> None:
    counted = 0
    for _ in range(POLICY.max_attempts):
        decision = decide(counted, 0, DEADLINE, HEALTHY, POLICY, random.Random(1))
        counted += decision.counted
    assert decision.action is Action.DEAD_LETTER
    assert decision.reason.startswith("gave up after 3 attempts")


def test_an_unavailable_service_never_counts_and_a_message_fault_always_does() -> None:
    unavailable = classify(C.UNAVAILABLE, "down")
    internal = classify(C.INTERNAL, "bug")
    assert not charged(unavailable, HEALTHY)
    # a probe that reaches the handler and fails on the message itself is the message's fault
    assert charged(internal, Evidence(probe=True, service_answered=False))


def test_retry_after_is_capped_by_backoff_max() -> None:
    result = Classifier().from_status(C.INTERNAL, "x")
    slow = type(result)(result.outcome, result.status, retry_after_ms=10**9)
    assert decide(0, 0, slow, HEALTHY, POLICY, random.Random(1)).delay_s == 1.0
