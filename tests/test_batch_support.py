"""``core.support``: which instances serve HandleMessageBatch (``delivery.batch: auto``)."""

from __future__ import annotations

import pytest

from consumer_proxy.core.support import (
    REPROBE_S,
    SAYS_NOTHING,
    SERVES_AGAIN_S,
    BatchSupport,
    MissingMethod,
)
from tests.support.clock import Clock


def test_an_instance_is_asked_with_a_batch_until_it_answers() -> None:
    # Given two instances nobody asked yet
    support = BatchSupport(2, Clock())
    # Then both get batches (the probe), and none is said to be anything yet
    assert support.batches(0) and support.batches(1)
    assert support.counts() == {"unknown": 2, "batch": 0, "unary": 0}


def test_unimplemented_makes_it_unary_once_and_an_answer_makes_it_batch_once() -> None:
    support = BatchSupport(2, Clock())
    # When instance 0 answers UNIMPLEMENTED to two probes, and instance 1 answers OK twice
    first = support.answered(0, "UNIMPLEMENTED")
    again = support.answered(0, "UNIMPLEMENTED")
    ok = support.answered(1, "OK")
    ok_again = support.answered(1, "INTERNAL")  # a handler error: the method exists
    # Then each change is said once
    assert first is not None and first.mode == "unary" and first.before == "unknown"
    assert again is None
    assert ok is not None and ok.mode == "batch"
    assert ok_again is None
    # and instance 0 gets unary calls, instance 1 batches
    assert not support.batches(0) and support.batches(1)
    assert support.counts() == {"unknown": 0, "batch": 1, "unary": 1}


@pytest.mark.parametrize("status", sorted(SAYS_NOTHING))
def test_a_call_that_may_not_have_reached_the_handler_says_nothing(status: str) -> None:
    support = BatchSupport(1, Clock())
    assert support.answered(0, status) is None
    assert support.modes == ["unknown"]


def test_a_batch_instance_replaced_by_a_unary_build_turns_unary() -> None:
    support = BatchSupport(1, Clock())
    support.answered(0, "OK")
    # When a rolling deploy brings a build without the method
    learnt = support.answered(0, "UNIMPLEMENTED")
    # Then it is said, with what it was before
    assert learnt is not None and (learnt.before, learnt.mode) == ("batch", "unary")
    assert not support.batches(0)


def test_a_unary_instance_is_asked_again_when_its_connection_is_lost() -> None:
    support = BatchSupport(1, Clock())
    support.answered(0, "UNIMPLEMENTED")
    # When its channel loses its connection (stopped, restarted, or replaced)
    support.disconnected(0)
    # Then its next call is a batch, and the answer is said
    assert support.batches(0)
    learnt = support.answered(0, "OK")
    assert learnt is not None and (learnt.before, learnt.mode) == ("unknown", "batch")


def test_a_unary_instance_is_asked_again_every_reprobe_interval_quietly() -> None:
    clock = Clock()
    support = BatchSupport(1, clock)
    support.answered(0, "UNIMPLEMENTED")
    # When less than the interval passed: unary
    clock.now = REPROBE_S - 1
    assert not support.batches(0)
    # When it passed: one batch asks again; the same answer says nothing new
    clock.now = REPROBE_S
    assert support.batches(0)
    assert support.answered(0, "UNIMPLEMENTED") is None
    assert not support.batches(0)
    # and a new answer after the next interval is said
    clock.now = 2 * REPROBE_S + 1
    assert support.batches(0)
    assert support.answered(0, "OK") is not None


def test_a_batch_instance_stays_batch_across_disconnects() -> None:
    support = BatchSupport(1, Clock())
    support.answered(0, "OK")
    support.disconnected(0)
    assert support.modes == ["batch"]


def test_the_missing_batch_method_is_told_once_and_back_only_after_it_settles() -> None:
    # Given delivery.batch always and a target whose calls alternate between a build
    # without HandleMessageBatch and one with it (a rolling deploy)
    missing = MissingMethod()
    told = []
    for i in range(100):
        now = float(i)
        if missing.answered(now, "svc:1", unimplemented=i % 2 == 0, ok=i % 2 == 1):
            told.append((now, missing.problem))
    # Then it was told missing once, at the first UNIMPLEMENTED, and never back while
    # UNIMPLEMENTED answers keep coming
    assert len(told) == 1 and "svc:1 answered UNIMPLEMENTED" in told[0][1]
    # When only successes come, Then it is back once SERVES_AGAIN_S passed since the last one
    last = 98.0  # (the last UNIMPLEMENTED)
    assert not missing.answered(last + SERVES_AGAIN_S - 1, "svc:1", False, True)
    assert not missing.answered(last + SERVES_AGAIN_S, "svc:1", False, False)  # not a success
    assert missing.answered(last + SERVES_AGAIN_S, "svc:1", False, True)
    assert missing.problem == ""
