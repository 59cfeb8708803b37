"""The outcome classifier: one table from gRPC status (or response action) to what happens next.

Pure logic, no I/O. The default table is the design's contract; each group may override a
status with ``delivery.status_overrides``.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from ..config import BackoffConfig
from ..proto.v1 import handler_pb2

MAX_REASON_BYTES = 1024


class Outcome(enum.Enum):
    """What becomes of one delivery."""

    ACK = "ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class Rule:
    """How one status is treated.

    ``counted``: the failure counts towards ``max_attempts``. ``service_failure``: the breaker
    records a failure (the service, not the message, is at fault). ``slow_down``: flow control
    should reduce the group's rate.
    """

    outcome: Outcome
    counted: bool = True
    service_failure: bool = False
    slow_down: bool = False


@dataclass(frozen=True, slots=True)
class Classification:
    """A classified result of one push."""

    outcome: Outcome
    status: str
    counted: bool = True
    service_failure: bool = False
    slow_down: bool = False
    reason: str = ""
    retry_after_ms: int = 0
    alone: bool = False
    """The answer could not be pinned on this message (a batch answer of the wrong length):
    it goes in a batch of its own from now on."""


_C = grpc.StatusCode
_OUTAGE = Rule(Outcome.RETRY, counted=False, service_failure=True)
DEFAULT_TABLE: Mapping[grpc.StatusCode, Rule] = {
    _C.ALREADY_EXISTS: Rule(Outcome.ACK),
    _C.INVALID_ARGUMENT: Rule(Outcome.DEAD_LETTER),
    _C.FAILED_PRECONDITION: Rule(Outcome.DEAD_LETTER),
    _C.OUT_OF_RANGE: Rule(Outcome.DEAD_LETTER),
    _C.DATA_LOSS: Rule(Outcome.DEAD_LETTER),
    _C.NOT_FOUND: Rule(Outcome.DEAD_LETTER),
    _C.RESOURCE_EXHAUSTED: Rule(Outcome.RETRY, slow_down=True),
    _C.UNAVAILABLE: _OUTAGE,
    _C.UNIMPLEMENTED: _OUTAGE,
    _C.UNAUTHENTICATED: _OUTAGE,
    _C.PERMISSION_DENIED: _OUTAGE,
    # A deadline counts against the message, and against the service when it repeats across
    # messages: the breaker counts consecutive failures, so one slow message cannot open it.
    _C.DEADLINE_EXCEEDED: Rule(Outcome.RETRY, service_failure=True, slow_down=True),
}
_DEFAULT_RULE = Rule(Outcome.RETRY)  # UNKNOWN, INTERNAL, ABORTED, CANCELLED, ...
_OVERRIDE_RULES: Mapping[str, Rule] = {
    "ack": Rule(Outcome.ACK),
    "retry": Rule(Outcome.RETRY),
    "dead_letter": Rule(Outcome.DEAD_LETTER),
    "drop": Rule(Outcome.DROP),
    "outage": _OUTAGE,
}
_ACTIONS: Mapping[int, Outcome] = {
    handler_pb2.HandleMessageResponse.ACTION_UNSPECIFIED: Outcome.ACK,
    handler_pb2.HandleMessageResponse.ACK: Outcome.ACK,
    handler_pb2.HandleMessageResponse.RETRY: Outcome.RETRY,
    handler_pb2.HandleMessageResponse.DEAD_LETTER: Outcome.DEAD_LETTER,
    handler_pb2.HandleMessageResponse.DROP: Outcome.DROP,
}
_ACK = Classification(Outcome.ACK, "OK")

TOO_LARGE_REASON = "message too large for the service"
"""How a reason starts when gRPC refused a call as larger than a size limit."""
# How gRPC words a RESOURCE_EXHAUSTED for a size limit: C-core and Python ("SERVER: Received
# message larger than max (N vs. M)", "CLIENT: Sent message larger than max ..."), Go
# ("grpc: received message larger than max ...", "trying to send message larger than max
# ..."), Node, Java ("gRPC message exceeds maximum size N: M"), .NET ("Received message
# exceeds the maximum configured message size.").
_TOO_LARGE = re.compile(r"message (?:larger than max|exceeds (?:the )?maximum)", re.IGNORECASE)
_CODES: Mapping[int, grpc.StatusCode] = {
    code.value[0]: code for code in grpc.StatusCode if code is not grpc.StatusCode.OK
}


def clip_reason(text: str) -> str:
    """At most 1 KiB of UTF-8, cut on a character boundary."""
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_REASON_BYTES:
        return text
    return data[:MAX_REASON_BYTES].decode("utf-8", "ignore")


class Classifier:
    """Turns a gRPC status or a response into a Classification, honouring group overrides."""

    def __init__(self, overrides: Mapping[str, str] | None = None) -> None:
        table = dict(DEFAULT_TABLE)
        for name, outcome in (overrides or {}).items():
            table[grpc.StatusCode[name]] = _OVERRIDE_RULES[outcome]
        self._table = table

    def rule(self, code: grpc.StatusCode) -> Rule:
        """The rule applied to a non-OK status."""
        rule: Rule = self._table.get(code, _DEFAULT_RULE)
        return rule

    def from_status(self, code: grpc.StatusCode, details: str | None = None) -> Classification:
        """Classify a failed call (``code`` is never OK here).

        A RESOURCE_EXHAUSTED whose details say a size limit refused the call is not an
        overload: the message is at fault, or the service's limit is too low for it. It is
        retried and counted, with no slow-down and no breaker failure (the status table's
        row and its override do not apply), its reason starting with
        :data:`TOO_LARGE_REASON`, and so dead-lettered after ``max_attempts``.
        """
        # (details come from the service: only their start is searched, whatever their size)
        if code == _C.RESOURCE_EXHAUSTED and details and _TOO_LARGE.search(details, 0, 1024):
            return Classification(
                Outcome.RETRY, code.name, reason=clip_reason(f"{TOO_LARGE_REASON}: {details}")
            )
        rule = self.rule(code)
        return Classification(
            rule.outcome,
            code.name,
            counted=rule.counted,
            service_failure=rule.service_failure,
            slow_down=rule.slow_down,
            reason=clip_reason(details or code.name),
        )

    def from_response(self, response: handler_pb2.HandleMessageResponse) -> Classification:
        """Classify an OK call by the response's action (an empty response is an ACK), or by
        its ``status_code`` when it carries one (a per-message status in a batch result)."""
        action = response.action
        code = response.status_code
        if code:
            # A per-message status (batch results): classified exactly like a call's status.
            return self.from_status(_CODES.get(code, grpc.StatusCode.UNKNOWN), response.reason)
        if action == handler_pb2.HandleMessageResponse.ACTION_UNSPECIFIED:
            return _ACK
        outcome = _ACTIONS.get(action)
        if outcome is None:  # a newer service speaking an action this proxy does not know
            return Classification(
                Outcome.RETRY, "UNKNOWN_ACTION", reason=f"unknown response action {action}"
            )
        name = handler_pb2.HandleMessageResponse.Action.Name(action)
        return Classification(
            outcome,
            name,
            reason=clip_reason(response.reason),
            retry_after_ms=max(0, response.retry_after_ms),
            slow_down=outcome is Outcome.RETRY and response.retry_after_ms > 0,
        )


def backoff_s(attempt: int, config: BackoffConfig, rng: random.Random | None = None) -> float:
    """Delay before delivery ``attempt + 1`` after ``attempt`` failed (attempt >= 1), in seconds.

    Exponential in the attempt, capped at ``max_ms``; ``jitter`` of it is randomised downwards
    so that retries of a burst of failures spread out instead of arriving together.
    """
    exponent = min(max(attempt - 1, 0), 64)
    delay_ms = min(config.max_ms, config.initial_ms * config.multiplier**exponent)
    spread = (rng or random).random() * config.jitter
    return delay_ms * (1.0 - spread) / 1000.0
