"""Batch push decisions: what goes into the next call, and what a batch answer means.

Pure: no asyncio, no gRPC I/O. The shell (``batch_push.BatchPush``) takes a batch from its ready
deque with :func:`take` when a call slot is free, sends it with ``Dispatcher.push_batch``,
which maps the answer onto one classification per message with :func:`classify_batch`, and
then records the call in the breaker once (one call, one breaker record; what it records is
``core.ejection.breaker_hears``'s rule) before finishing every message with its own
classification.

The rules:

- A batch takes what is ready, in order, up to ``max_messages`` and ``max_bytes`` (message
  bytes: key, value, headers). A message larger than ``max_bytes`` goes alone in a batch of
  one; it never waits behind the cap. Stale messages (revoked, cut) are dropped (the caller
  gives their bytes back). A message marked ``alone`` goes in a batch of its own.
- A failed call (non-OK status) applies to every message in it as the status table says;
  UNIMPLEMENTED means the service does not implement ``HandleMessageBatch``: an outage,
  whatever the group's overrides say (no silent fallback to unary, never a dead letter).
- An OK answer carries one result per message, in order, each classified like a unary
  response; a result's ``status_code`` is classified like a unary call's status.
- A result list of the wrong length is a protocol error, with no breaker record (neither
  failure nor success). It cannot be pinned on one message of a batch of several: each is
  retried, no attempt counted, and goes alone from then on (``Classification.alone``). In a
  batch of one it is that message's failure, counted towards ``max_attempts``, so a message
  that always gets a broken answer ends in the DLQ, never in an endless uncounted loop.
- The breaker hears one record per call: a failure when the call failed with a service-level
  status, or when every result in it is a service-level failure (the service answered
  nothing else); a success otherwise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import grpc

from ..proto.v1 import handler_pb2
from .outcomes import Classification, Classifier, Outcome, clip_reason

NOT_IMPLEMENTED_REASON = "service does not implement HandleMessageBatch"
PROTOCOL_ERROR = "BATCH_PROTOCOL_ERROR"

_UNIMPLEMENTED = Classification(
    Outcome.RETRY,
    grpc.StatusCode.UNIMPLEMENTED.name,
    counted=False,
    service_failure=True,
    reason=NOT_IMPLEMENTED_REASON,
)


class Sized(Protocol):
    """What batching reads of a ready item (a ``partitions.Delivery`` fits: one message)."""

    @property
    def size(self) -> int: ...
    @property
    def alone(self) -> bool: ...
    @property
    def count(self) -> int:
        """How many messages: 1, but for a run (``Splittable``)."""


class Splittable(Protocol):
    """A ready item of several messages (a ``partitions.Run``): taken whole, or split where
    a call has room for only part of it."""

    @property
    def sizes(self) -> list[int]:
        """Each message's size."""

    def split(self, n: int) -> Splittable:
        """The first ``n`` messages as an item of their own; this one keeps the rest."""


T = TypeVar("T", bound=Sized)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The group's batch caps."""

    max_messages: int
    max_bytes: int


def take(ready: deque[T], limits: BatchLimits, drop: Callable[[T], bool]) -> list[T]:
    """Remove and return the next batch from the front of ``ready`` (empty when nothing
    fresh is ready). ``drop(item)`` says whether an item is stale (and gives its bytes back):
    those met on the way leave ``ready`` without going out. An item of several messages
    (``Splittable``) counts as that many: it goes whole when all of them fit, else its first
    messages that fit (as message by message) go and the rest stays first in ``ready``."""
    batch: list[T] = []
    append = batch.append
    popleft = ready.popleft
    total = taken = 0
    max_messages = limits.max_messages
    max_bytes = limits.max_bytes
    while ready and taken < max_messages:
        item = popleft()
        if drop(item):
            continue
        count = item.count
        if count != 1:
            size = item.size
            if taken + count <= max_messages and total + size < max_bytes:
                append(item)  # (no prefix reaches either cap: message by message takes all)
                taken += count
                total += size
                continue
            fit = 0
            for one in cast(Splittable, item).sizes[: max_messages - taken]:
                if (taken or fit) and total + one > max_bytes:
                    break
                fit += 1
                total += one
                if total >= max_bytes:
                    break
            if fit < count:
                if fit:
                    append(cast(T, cast(Splittable, item).split(fit)))
                ready.appendleft(item)
            else:
                append(item)
            break
        alone = item.alone
        size = item.size
        if taken and (alone or total + size > max_bytes):
            ready.appendleft(item)  # the cap is reached, or it goes alone: it goes next
            break
        append(item)
        taken += 1
        total += size
        if alone or total >= max_bytes:
            break
    return batch


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What one batch call means: one classification per message, in request order, and
    the one record the breaker (and the limiter, and endpoint ejection) hears of the call."""

    results: Sequence[Classification]
    call: Classification
    """The call as a whole: its failed status, or a summary of the results."""
    breaker: bool | None
    """True: one breaker failure; False: one success; None: no record (protocol error)."""
    unimplemented: bool = False
    """The service answered UNIMPLEMENTED: it does not serve HandleMessageBatch."""
    protocol_error: str = ""
    """Why the answer was not usable ('' when it was)."""


_OK_CALL = Classification(Outcome.ACK, "OK")
_EMPTY = handler_pb2.HandleMessageResponse()  # read only


def classify_failed_call(
    classifier: Classifier, code: grpc.StatusCode, details: str | None, count: int
) -> BatchOutcome:
    """A batch call that ended with a non-OK status: the same classification for each of
    its ``count`` messages, one breaker record."""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return BatchOutcome([_UNIMPLEMENTED] * count, _UNIMPLEMENTED, True, unimplemented=True)
    result = classifier.from_status(code, details)
    return BatchOutcome([result] * count, result, result.service_failure)


def classify_batch(
    classifier: Classifier,
    response: handler_pb2.HandleMessageBatchResponse | None,
    count: int,
) -> BatchOutcome:
    """An OK batch call's answer (None: it did not decode) for ``count`` messages."""
    if response is None:
        if count == 1:
            # Alone, the broken answer is that message's own: a counted failure, as in
            # unary mode.
            result = classifier.from_status(
                grpc.StatusCode.INTERNAL, "the service's batch response could not be decoded"
            )
            return BatchOutcome([result], result, result.service_failure)
        # One result that does not decode (a reason that is not UTF-8) spoils the whole
        # answer: like an answer of the wrong length, it is no one message's.
        return _no_ones(count, "HandleMessageBatch's answer could not be decoded")
    answers = response.results
    if len(answers) != count:
        noun = "message" if count == 1 else "messages"
        return _no_ones(
            count, f"HandleMessageBatch answered {len(answers)} results for {count} {noun}"
        )
    if count and response.ByteSize() == 2 * count:
        # Every result is empty (a plain ack): each encodes as its tag and a zero length, two
        # bytes, and any field set in one makes the answer longer. Read in C, not per result.
        return BatchOutcome([classifier.from_response(_EMPTY)] * count, _OK_CALL, False)
    from_response = classifier.from_response
    return summarize([from_response(answer) for answer in answers])


def _no_ones(count: int, why: str) -> BatchOutcome:
    """An answer that says nothing of any one message: in a batch of one it is that
    message's own (counted) failure; in a larger batch it is no one's, and each message goes
    alone next, no attempt counted. No breaker record either way (a protocol error)."""
    reason = clip_reason(why)
    retry = Classification(
        Outcome.RETRY,
        PROTOCOL_ERROR,
        counted=count == 1,
        service_failure=False,
        reason=reason,
        alone=count > 1,
    )
    return BatchOutcome([retry] * count, retry, None, protocol_error=reason)


def summarize(results: Sequence[Classification]) -> BatchOutcome:
    """The outcome of a call's messages classified one by one (an OK batch answer, or the
    unary calls that carried a batch to an instance without ``HandleMessageBatch``)."""
    count = len(results)
    failures = 0
    slow: Classification | None = None
    for result in results:
        if result.service_failure:
            failures += 1
        if result.slow_down and slow is None:
            slow = result
    if count and failures == count:
        return BatchOutcome(results, results[0], True)
    # The limiter learns "slow down" from the call when any message asked for it.
    return BatchOutcome(results, slow or _OK_CALL, False)
