"""The status table, response actions, overrides and backoff (pure logic)."""

from __future__ import annotations

import random

import grpc
import pytest

from consumer_proxy import handler as sdk
from consumer_proxy.config import BackoffConfig
from consumer_proxy.core.outcomes import (
    DEFAULT_TABLE,
    MAX_REASON_BYTES,
    Classifier,
    Outcome,
    backoff_s,
    clip_reason,
)
from consumer_proxy.proto.v1 import handler_pb2

C = grpc.StatusCode
Response = handler_pb2.HandleMessageResponse

# (status, outcome, counted, service_failure): the design's default table
TABLE = [
    (C.ALREADY_EXISTS, Outcome.ACK, True, False),
    (C.INVALID_ARGUMENT, Outcome.DEAD_LETTER, True, False),
    (C.FAILED_PRECONDITION, Outcome.DEAD_LETTER, True, False),
    (C.OUT_OF_RANGE, Outcome.DEAD_LETTER, True, False),
    (C.DATA_LOSS, Outcome.DEAD_LETTER, True, False),
    (C.NOT_FOUND, Outcome.DEAD_LETTER, True, False),
    (C.RESOURCE_EXHAUSTED, Outcome.RETRY, True, False),
    (C.UNAVAILABLE, Outcome.RETRY, False, True),
    (C.UNIMPLEMENTED, Outcome.RETRY, False, True),
    (C.UNAUTHENTICATED, Outcome.RETRY, False, True),
    (C.PERMISSION_DENIED, Outcome.RETRY, False, True),
    (C.DEADLINE_EXCEEDED, Outcome.RETRY, True, True),
    (C.UNKNOWN, Outcome.RETRY, True, False),
    (C.INTERNAL, Outcome.RETRY, True, False),
    (C.ABORTED, Outcome.RETRY, True, False),
    (C.CANCELLED, Outcome.RETRY, True, False),
]


@pytest.mark.parametrize(("code", "outcome", "counted", "service_failure"), TABLE)
def test_default_status_table(
    code: grpc.StatusCode, outcome: Outcome, counted: bool, service_failure: bool
) -> None:
    result = Classifier().from_status(code, "details")
    assert (result.outcome, result.counted, result.service_failure) == (
        outcome,
        counted,
        service_failure,
    )
    assert result.status == code.name
    assert result.reason == "details"


def test_resource_exhausted_slows_the_group_down() -> None:
    assert Classifier().from_status(C.RESOURCE_EXHAUSTED).slow_down


@pytest.mark.parametrize(
    "details",
    [
        "SERVER: Received message larger than max (5242892 vs. 4194304)",  # Python, C-core
        "CLIENT: Sent message larger than max (5242892 vs. 4194304)",
        "grpc: received message larger than max (5242892 vs. 4194304)",  # Go server
        "grpc: trying to send message larger than max (5242892 vs. 4194304)",  # Go client
        "gRPC message exceeds maximum size 4194304: 5242892",  # Java
        "Received message exceeds the maximum configured message size.",  # .NET
    ],
)
@pytest.mark.parametrize("overrides", [{}, {"RESOURCE_EXHAUSTED": "outage"}])
def test_a_message_too_large_for_the_service_is_counted_with_its_own_reason_not_slowed_or_broken(
    details: str, overrides: dict[str, str]
) -> None:
    result = Classifier(overrides).from_status(C.RESOURCE_EXHAUSTED, details)
    assert (result.outcome, result.counted, result.service_failure, result.slow_down) == (
        Outcome.RETRY,
        True,
        False,
        False,
    )
    assert result.status == "RESOURCE_EXHAUSTED"
    assert result.reason == f"message too large for the service: {details}"


def test_an_overload_is_not_taken_for_a_message_too_large() -> None:
    result = Classifier().from_status(C.RESOURCE_EXHAUSTED, "over max_concurrency=10")
    assert result.slow_down
    assert result.reason == "over max_concurrency=10"


@pytest.mark.parametrize(
    ("response", "outcome"),
    [
        (Response(), Outcome.ACK),
        (Response(action=Response.ACK), Outcome.ACK),
        (Response(action=Response.RETRY, retry_after_ms=250), Outcome.RETRY),
        (Response(action=Response.DEAD_LETTER, reason="bad"), Outcome.DEAD_LETTER),
        (Response(action=Response.DROP), Outcome.DROP),
    ],
)
def test_response_actions(response: handler_pb2.HandleMessageResponse, outcome: Outcome) -> None:
    result = Classifier().from_response(response)
    assert result.outcome is outcome
    assert result.retry_after_ms == response.retry_after_ms
    assert result.reason == response.reason


def test_an_unknown_action_from_a_newer_service_is_retried_not_lost() -> None:
    result = Classifier().from_response(Response(action=99))  # type: ignore[arg-type]
    assert result.outcome is Outcome.RETRY
    assert "unknown response action 99" in result.reason


def test_group_overrides_replace_single_rows() -> None:
    classifier = Classifier({"NOT_FOUND": "retry", "INTERNAL": "outage", "ABORTED": "drop"})
    assert classifier.from_status(C.NOT_FOUND).outcome is Outcome.RETRY
    internal = classifier.from_status(C.INTERNAL)
    assert (internal.outcome, internal.counted, internal.service_failure) == (
        Outcome.RETRY,
        False,
        True,
    )
    assert classifier.from_status(C.ABORTED).outcome is Outcome.DROP
    assert classifier.from_status(C.INVALID_ARGUMENT).outcome is Outcome.DEAD_LETTER


def test_reasons_are_clipped_to_1_kib_on_a_character_boundary() -> None:
    text = "é" * 2000
    clipped = clip_reason(text)
    assert len(clipped.encode()) <= MAX_REASON_BYTES
    assert clipped == "é" * (MAX_REASON_BYTES // 2)
    assert clip_reason("short") == "short"


def test_backoff_grows_exponentially_to_the_cap_with_downward_jitter() -> None:
    config = BackoffConfig(initial_ms=100, max_ms=1000, multiplier=2.0, jitter=0.0)
    assert [backoff_s(a, config) for a in range(1, 6)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    jittered = BackoffConfig(initial_ms=100, max_ms=1000, multiplier=2.0, jitter=0.5)
    rng = random.Random(1)
    delays = [backoff_s(3, jittered, rng) for _ in range(200)]
    assert all(0.2 <= d <= 0.4 for d in delays)
    assert max(delays) - min(delays) > 0.1  # the jitter really spreads retries
    assert backoff_s(10_000, config) == 1.0  # huge attempt counts do not overflow


def test_the_sdk_agrees_with_the_status_table() -> None:
    """The SDK's batch mapping and reason limit are copies (the SDK does not import the proxy's
    core); this pins them to the table so that changing one without the other fails here."""
    by_outcome: dict[Outcome, set[grpc.StatusCode]] = {}
    for code, rule in DEFAULT_TABLE.items():
        by_outcome.setdefault(rule.outcome, set()).add(code)

    assert by_outcome[Outcome.DEAD_LETTER] == set(sdk._DEAD_LETTER_CODES)
    assert by_outcome[Outcome.ACK] == {C.ALREADY_EXISTS}  # the batch path's only ack
    assert Outcome.DROP not in by_outcome  # the batch path never drops on an error
    assert sdk.MAX_REASON_BYTES == MAX_REASON_BYTES
    assert Classifier().from_status(sdk.PoisonPill().code).outcome is Outcome.DEAD_LETTER
    assert Classifier().from_status(sdk.AlreadyProcessed().code).outcome is Outcome.ACK
    assert Classifier().from_status(sdk.Overloaded().code).slow_down
    assert not Classifier().from_status(sdk.Unavailable().code).counted
