"""The pure batch decisions: forming a batch, reading a batch answer, encoding a request."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from consumer_proxy.config import BackoffConfig, DeliveryConfig
from consumer_proxy.core.batching import (
    NOT_IMPLEMENTED_REASON,
    PROTOCOL_ERROR,
    BatchLimits,
    classify_batch,
    classify_failed_call,
    take,
)
from consumer_proxy.core.decision import Action, Evidence, Policy, decide
from consumer_proxy.core.outcomes import Classification, Classifier, Outcome
from consumer_proxy.proto.v1 import handler_pb2

Response = handler_pb2.HandleMessageResponse
CODE = grpc.StatusCode


@dataclass
class Item:
    size: int
    stale: bool = False
    name: str = ""
    alone: bool = False
    count: int = 1


def drop(item: Item | Several) -> bool:
    return item.stale


def sizes(batch: list[Item]) -> list[int]:
    return [item.size for item in batch]


# ------------------------------------------------------------------ forming batches


def test_a_batch_takes_what_is_ready_up_to_max_messages() -> None:
    ready = deque(Item(10) for _ in range(7))
    assert len(take(ready, BatchLimits(max_messages=5, max_bytes=1000), drop)) == 5
    assert len(ready) == 2
    assert len(take(ready, BatchLimits(max_messages=5, max_bytes=1000), drop)) == 2
    assert take(ready, BatchLimits(max_messages=5, max_bytes=1000), drop) == []


def test_a_batch_stops_before_the_byte_cap() -> None:
    ready = deque([Item(40), Item(40), Item(40)])
    assert sizes(take(ready, BatchLimits(max_messages=10, max_bytes=100), drop)) == [40, 40]
    assert sizes(list(ready)) == [40]


def test_a_message_larger_than_max_bytes_goes_alone() -> None:
    # Given a small message, an oversized one and another small one
    ready = deque([Item(10), Item(500), Item(10)])
    limits = BatchLimits(max_messages=10, max_bytes=100)
    # Then the oversized one neither joins nor blocks: it is the next batch, alone
    assert sizes(take(ready, limits, drop)) == [10]
    assert sizes(take(ready, limits, drop)) == [500]
    assert sizes(take(ready, limits, drop)) == [10]


def test_stale_messages_are_skipped_and_removed() -> None:
    ready = deque([Item(1, stale=True), Item(2), Item(3, stale=True), Item(4)])
    assert sizes(take(ready, BatchLimits(max_messages=10, max_bytes=100), drop)) == [2, 4]
    assert not ready


def test_a_message_marked_alone_goes_in_a_batch_of_its_own() -> None:
    ready = deque([Item(1), Item(2, alone=True), Item(3), Item(4)])
    limits = BatchLimits(max_messages=10, max_bytes=100)
    assert sizes(take(ready, limits, drop)) == [1]
    assert sizes(take(ready, limits, drop)) == [2]
    assert sizes(take(ready, limits, drop)) == [3, 4]


@given(
    st.lists(st.integers(min_value=0, max_value=300), max_size=60),
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=400),
)
def test_batches_keep_order_and_caps_and_lose_nothing(
    message_sizes: list[int], max_messages: int, max_bytes: int
) -> None:
    items = [Item(size, name=str(i)) for i, size in enumerate(message_sizes)]
    ready = deque(items)
    limits = BatchLimits(max_messages, max_bytes)
    taken: list[Item] = []
    while ready:
        batch = take(ready, limits, drop)
        assert 1 <= len(batch) <= max_messages
        assert len(batch) == 1 or sum(sizes(batch)) <= max_bytes
        taken += batch
    assert taken == items


@dataclass
class Several:
    """A ready item of several messages (as ``partitions.Run``): ``sizes`` are theirs."""

    sizes: list[int]
    alone: bool = False
    stale: bool = False

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def count(self) -> int:
        return len(self.sizes)

    def split(self, n: int) -> Several:
        head = Several(self.sizes[:n])
        del self.sizes[:n]
        return head


def _flat(batch: list[Item | Several]) -> list[int]:
    return [s for item in batch for s in (item.sizes if isinstance(item, Several) else [item.size])]


@example(groups=[[5, 0]], max_messages=10, max_bytes=5)  # (the cap reached before an empty one)
@given(
    st.lists(st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=8)),
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=1, max_value=300),
)
def test_an_item_of_several_messages_is_taken_as_its_messages_one_by_one(
    groups: list[list[int]], max_messages: int, max_bytes: int
) -> None:
    # Given ready items of several messages (one message: an item of its own), and the same
    # messages each an item of its own
    several: deque[Item | Several] = deque(
        Several(list(group)) if len(group) > 1 else Item(group[0]) for group in groups
    )
    single: deque[Item | Several] = deque(Item(size) for group in groups for size in group)
    limits = BatchLimits(max_messages, max_bytes)
    # When calls take from each / Then each call takes the same messages (an item whole, or
    # its first messages split off: the rest first in line for the next call)
    while single:
        assert _flat(take(several, limits, drop)) == _flat(take(single, limits, drop))
    assert not several


# ------------------------------------------------------------------ reading answers


def test_each_result_is_classified_like_a_unary_response_in_order() -> None:
    classifier = Classifier()
    answers = [
        Response(),
        Response(action=Response.RETRY, retry_after_ms=250, reason="later"),
        Response(action=Response.DEAD_LETTER, reason="bad"),
        Response(action=Response.DROP),
    ]
    outcome = classify_batch(classifier, handler_pb2.HandleMessageBatchResponse(results=answers), 4)
    assert outcome.results == [classifier.from_response(a) for a in answers]
    assert [r.outcome for r in outcome.results] == [
        Outcome.ACK,
        Outcome.RETRY,
        Outcome.DEAD_LETTER,
        Outcome.DROP,
    ]
    assert outcome.results[1].retry_after_ms == 250
    assert outcome.breaker is False  # one success for the call
    assert outcome.call.slow_down  # the limiter hears the retry_after
    assert not outcome.protocol_error and not outcome.unimplemented


def test_a_per_message_status_is_classified_exactly_like_a_unary_status() -> None:
    classifier = Classifier({"NOT_FOUND": "drop"})
    codes = [CODE.UNAVAILABLE, CODE.INVALID_ARGUMENT, CODE.DEADLINE_EXCEEDED, CODE.NOT_FOUND]
    answers = [
        # an old-style action next to the status: the status wins
        Response(status_code=code.value[0], reason=f"{code.name} details", action=Response.ACK)
        for code in codes
    ]
    outcome = classify_batch(
        classifier, handler_pb2.HandleMessageBatchResponse(results=answers), len(codes)
    )
    assert outcome.results == [
        classifier.from_status(code, f"{code.name} details") for code in codes
    ]
    assert outcome.results[0].service_failure and not outcome.results[0].counted
    assert outcome.results[3].outcome is Outcome.DROP  # the group's override applies too


def test_an_unknown_per_message_status_code_is_unknown() -> None:
    outcome = classify_batch(
        Classifier(),
        handler_pb2.HandleMessageBatchResponse(results=[Response(status_code=99)]),
        1,
    )
    assert outcome.results[0].status == "UNKNOWN"
    assert outcome.results[0].outcome is Outcome.RETRY


def test_a_batch_whose_every_result_is_an_outage_is_one_breaker_failure() -> None:
    down = Response(status_code=CODE.UNAVAILABLE.value[0], reason="database down")
    outcome = classify_batch(
        Classifier(), handler_pb2.HandleMessageBatchResponse(results=[down] * 3), 3
    )
    assert outcome.breaker is True
    assert outcome.call.status == "UNAVAILABLE"


def test_a_batch_with_some_outage_results_is_a_success_for_the_breaker() -> None:
    # The service answered other messages: it is up (like unary's consecutive count).
    down = Response(status_code=CODE.UNAVAILABLE.value[0])
    outcome = classify_batch(
        Classifier(), handler_pb2.HandleMessageBatchResponse(results=[down, Response()]), 2
    )
    assert outcome.breaker is False


def test_too_few_or_too_many_results_retry_the_batch_uncounted_without_a_breaker_record() -> None:
    policy = Policy(max_attempts=1, backoff=BackoffConfig())
    for answered in (2, 4, 0):
        response = handler_pb2.HandleMessageBatchResponse(results=[Response()] * answered)
        outcome = classify_batch(Classifier(), response, 3)
        assert outcome.breaker is None
        assert f"answered {answered} results for 3 messages" in outcome.protocol_error
        assert len(outcome.results) == 3
        for result in outcome.results:
            assert result.status == PROTOCOL_ERROR
            assert result.outcome is Outcome.RETRY
            assert not result.counted and not result.service_failure
            # even with max_attempts 1, nothing is dead-lettered for it
            decision = decide(0, 0, result, Evidence(), policy, random.Random(1))
            assert decision.action is Action.RETRY and not decision.counted


def test_an_undecodable_answer_alone_is_retried_like_internal() -> None:
    outcome = classify_batch(Classifier(), None, 1)
    assert [r.status for r in outcome.results] == ["INTERNAL"]
    assert all(r.counted for r in outcome.results)


def test_an_undecodable_answer_to_several_is_no_ones_failure_and_each_goes_alone() -> None:
    # Given an OK answer to a batch of 3 that does not decode (one result's reason that is
    # not UTF-8 spoils the whole answer)
    outcome = classify_batch(Classifier(), None, 3)
    # Then, as with an answer of the wrong length, no message is charged for it: each is
    # retried alone, no attempt counted, and the breaker hears nothing
    assert [r.status for r in outcome.results] == [PROTOCOL_ERROR] * 3
    assert all(r.alone and not r.counted and not r.service_failure for r in outcome.results)
    assert outcome.breaker is None
    assert "could not be decoded" in outcome.protocol_error


def test_a_failed_call_applies_its_status_to_every_message_with_one_breaker_record() -> None:
    outcome = classify_failed_call(Classifier(), CODE.UNAVAILABLE, "connection refused", 50)
    assert len(outcome.results) == 50
    assert all(r.service_failure and not r.counted for r in outcome.results)
    assert outcome.breaker is True  # one failure for the call, not 50
    poison = classify_failed_call(Classifier(), CODE.INVALID_ARGUMENT, "bad batch", 2)
    assert [r.outcome for r in poison.results] == [Outcome.DEAD_LETTER] * 2
    assert poison.breaker is False


def test_unimplemented_is_an_outage_even_when_overridden() -> None:
    # Given a group that dead-letters UNIMPLEMENTED in unary mode
    classifier = Classifier({"UNIMPLEMENTED": "dead_letter"})
    outcome = classify_failed_call(classifier, CODE.UNIMPLEMENTED, "Method not found!", 3)
    # Then a batch call answered UNIMPLEMENTED still never dead-letters: it is an outage
    assert outcome.unimplemented
    assert outcome.breaker is True
    for result in outcome.results:
        assert result.outcome is Outcome.RETRY
        assert result.service_failure and not result.counted
        assert result.reason == NOT_IMPLEMENTED_REASON


# ------------------------------------------------------------------ configuration


def test_batching_is_auto_by_default_off_when_asked_and_always_with_a_block() -> None:
    auto = DeliveryConfig().batch
    assert auto is not None and auto.mode == "auto"
    assert DeliveryConfig.model_validate({"batch": "off"}).batch is None
    on = DeliveryConfig.model_validate({"batch": {}}).batch
    assert on is not None and on.mode == "always"
    assert (on.max_messages, on.max_bytes, on.linger_ms) == (100, 1024 * 1024, 0)


def test_bad_batch_settings_are_rejected_with_their_field_path() -> None:
    for bad in ({"max_messages": 0}, {"max_bytes": 0}, {"linger_ms": -1}, {"nope": 1}):
        with pytest.raises(ValidationError) as caught:
            DeliveryConfig.model_validate({"batch": bad})
        assert caught.value.errors()[0]["loc"][0] == "batch"


def test_an_answer_of_plain_acks_is_read_once_not_result_by_result() -> None:
    class Counting(Classifier):
        calls = 0

        def from_response(self, response: Response) -> Classification:
            Counting.calls += 1
            return super().from_response(response)

    classifier = Counting()
    # Given an answer of 500 empty results (plain acks)
    answer = handler_pb2.HandleMessageBatchResponse(results=[Response() for _ in range(500)])
    # When it is classified / Then every message is acked, the call a success, read once
    outcome = classify_batch(classifier, answer, 500)
    assert outcome.results == [classifier.from_response(Response())] * 500
    assert (outcome.call.outcome, outcome.breaker) == (Outcome.ACK, False)
    assert Counting.calls == 2  # (one of them the assertion's)
    # When one result says anything (a drop) / Then each result is read on its own
    answer.results[7].action = Response.DROP
    outcome = classify_batch(classifier, answer, 500)
    assert [r.outcome for r in outcome.results[6:9]] == [Outcome.ACK, Outcome.DROP, Outcome.ACK]
