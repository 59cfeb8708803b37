"""Test a handler without a server or a proxy, the way Temporal's ``ActivityEnvironment`` runs
an activity without a worker.

:class:`HandlerEnvironment` calls the very handler object that :func:`consumer_proxy.handler.run`
serves, through the SDK's own servicer code (so a raised :class:`~consumer_proxy.handler.PoisonPill`
becomes INVALID_ARGUMENT exactly as on the wire), and then classifies the answer with the proxy's
status table (``consumer_proxy/core/outcomes.py``), honouring a group's ``status_overrides``::

    from consumer_proxy import handler as cp
    from consumer_proxy.testing import HandlerEnvironment, message

    async def handle(msg: cp.Message) -> cp.Result | None:
        if msg.value is None:
            return cp.drop()
        if not msg.value.startswith(b"{"):
            raise cp.PoisonPill("not JSON")
        return None

    env = HandlerEnvironment(handle)
    env.run(message(b'{"id": 1}')).assert_ack()          # from a plain (sync) test
    env.run(message(b"oops")).assert_dead_letter("not JSON")
    env.run(message(None)).assert_drop()

    async def test_in_a_loop() -> None:                  # or from an async test
        outcome = await env.handle(message(b"{}", attempt=3))
        assert outcome.kind == "ack"

What the outcome covers: one call, classified. The proxy's decisions beyond that (its backoff
when ``retry_after_ms`` is 0, turning a counted retry on the last of ``max_attempts`` into a
dead letter, the circuit breaker) depend on the group's state and are not modelled here;
``counted``, ``service_failure`` and ``slow_down`` say what the proxy would feed them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeAlias

import grpc
from pydantic import ValidationError

from .config import DeliveryConfig
from .core.outcomes import Classification, Classifier
from .handler import (
    Handler,
    HandlerFunc,
    Message,
    Result,
    Source,
    _as_function,
    _MessageHandlerServicer,
)
from .proto.v1 import handler_pb2

__all__ = [
    "HandlerEnvironment",
    "Kind",
    "Outcome",
    "classify_status",
    "message",
]

Kind: TypeAlias = Literal["ack", "retry", "dead_letter", "drop"]
"""What becomes of the message: the values of the proxy's ``Outcome`` enum."""

HeaderValue: TypeAlias = bytes | str


def message(
    value: bytes | str | None = b"",
    *,
    key: bytes | str | None = None,
    headers: Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]] = (),
    topic: str = "test-topic",
    partition: int = 0,
    offset: int = 0,
    timestamp_ms: int = 0,
    consumer_group: str = "test-group",
    attempt: int = 1,
    source: Source = "primary",
) -> Message:
    """A :class:`~consumer_proxy.handler.Message` with test defaults; only say what matters.

    ``str`` values, keys and header values are encoded as UTF-8; ``value=None`` is a tombstone
    and ``key=None`` a null key, as the proxy delivers them. ``headers`` is a mapping or a
    sequence of pairs (the latter keeps repeated keys).
    """
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        key=_encode(key),
        value=_encode(value),
        headers=tuple((name, v.encode() if isinstance(v, str) else v) for name, v in pairs),
        timestamp_ms=timestamp_ms,
        consumer_group=consumer_group,
        attempt=attempt,
        source=source,
    )


def _encode(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class Outcome:
    """One handled message as the proxy would classify it.

    ``kind`` is what happens to the message. ``status`` is what the proxy saw: the response
    action (``"ACK"``, ``"RETRY"``, ``"DEAD_LETTER"``, ``"DROP"``; ``"OK"`` for an empty
    response) or, for a failed call, the gRPC status name (``"INVALID_ARGUMENT"``), which is
    also in ``code``. ``reason`` is the dead-letter or retry reason as the proxy records it (at
    most 1 KiB; a failed call's details). ``retry_after_ms`` is the handler's requested delay
    (0: the proxy's backoff). ``counted``: a retry counts towards ``max_attempts``;
    ``service_failure``: the circuit breaker records a failure; ``slow_down``: flow control
    reduces the group's rate. ``error`` is the exception the handler raised, if any.
    """

    kind: Kind
    status: str
    code: grpc.StatusCode
    reason: str = ""
    retry_after_ms: int = 0
    counted: bool = True
    service_failure: bool = False
    slow_down: bool = False
    error: BaseException | None = None

    def assert_ack(self) -> None:
        """Fail unless the message is done (acked, or an ALREADY_EXISTS duplicate)."""
        self._expect("ack")

    def assert_drop(self) -> None:
        """Fail unless the message is dropped (done, no DLQ copy)."""
        self._expect("drop")

    def assert_retry(self, after_ms: int | None = None, *, counted: bool | None = None) -> None:
        """Fail unless the message is retried; optionally with this delay and counting."""
        self._expect("retry")
        if after_ms is not None and self.retry_after_ms != after_ms:
            self._fail(f"a retry after {after_ms} ms")
        if counted is not None and self.counted != counted:
            self._fail("a counted retry" if counted else "a retry that is not counted")

    def assert_dead_letter(self, reason: str | None = None) -> None:
        """Fail unless the message is dead-lettered; optionally with ``reason`` contained in
        the recorded reason."""
        self._expect("dead_letter")
        if reason is not None and reason not in self.reason:
            self._fail(f"a dead letter whose reason contains {reason!r}")

    def _expect(self, kind: Kind) -> None:
        if self.kind != kind:
            self._fail(kind.replace("_", "-"))

    def _fail(self, wanted: str) -> NoReturn:
        raise AssertionError(f"expected {wanted}, got {self}")

    def __str__(self) -> str:
        parts = [f"{self.kind} ({self.status})"]
        if self.kind == "retry":
            parts.append(f"after_ms={self.retry_after_ms}")
            parts.append("counted" if self.counted else "not counted")
        if self.reason:
            parts.append(f"reason={self.reason!r}")
        if self.error is not None:
            parts.append(f"raised {self.error!r}")
        return ", ".join(parts)


def classify_status(
    code: grpc.StatusCode,
    details: str = "",
    *,
    status_overrides: Mapping[str, str] | None = None,
) -> Outcome:
    """What the proxy's status table makes of a call failed with ``code`` (never OK).

    ``status_overrides`` is a group's ``delivery.status_overrides``, e.g.
    ``{"NOT_FOUND": "drop"}``.
    """
    if code == grpc.StatusCode.OK:
        raise ValueError("an OK call is classified by its response, not its status")
    classifier = Classifier(_checked_overrides(status_overrides))
    return _outcome(classifier.from_status(code, details), code, None)


def _checked_overrides(overrides: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``overrides`` as the proxy's config checks them (a ValueError saying what is wrong):
    a test must not pass a table the proxy would refuse to start with."""
    if not overrides:
        return overrides
    try:
        DeliveryConfig.model_validate({"status_overrides": dict(overrides)})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"status_overrides: {problems}") from None
    return overrides


def _outcome(found: Classification, code: grpc.StatusCode, error: BaseException | None) -> Outcome:
    kind: Kind = found.outcome.value
    return Outcome(
        kind=kind,
        status=found.status,
        code=code,
        reason=found.reason,
        retry_after_ms=found.retry_after_ms,
        counted=found.counted,
        service_failure=found.service_failure,
        slow_down=found.slow_down,
        error=error,
    )


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Aborted(Exception):
    """Raised by the fake context's ``abort``, as grpc.aio raises ``AbortError``."""


class _Context:
    """The part of ``grpc.aio.ServicerContext`` that the SDK's servicer uses."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.OK
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: Any) -> NoReturn:
        self.code, self.details = code, details
        raise _Aborted(code.name)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The call's metadata: none (no trace context from a proxy in a unit test)."""
        return ()

    def time_remaining(self) -> float | None:
        """The call's time left: no deadline (the handler runs to its end)."""
        return None


class HandlerEnvironment:
    """Runs a handler the way the SDK serves it and classifies the answers like the proxy.

    ``handler`` is anything :func:`consumer_proxy.handler.serve` accepts: an ``async def
    handle(message)`` function or an object with such a ``handle`` method. A handler that is
    not async gets what the SDK answers for it (INTERNAL, so a counted retry), which is the
    bug to fix. ``status_overrides`` is the group's ``delivery.status_overrides``.

    :meth:`handle` and :meth:`handle_batch` are for async tests; :meth:`run` and
    :meth:`run_batch` run them on a fresh event loop for plain tests.
    """

    def __init__(
        self, handler: Handler, *, status_overrides: Mapping[str, str] | None = None
    ) -> None:
        self._handle = _as_function(handler)
        self._classifier = Classifier(_checked_overrides(status_overrides))

    async def handle(self, message: Message) -> Outcome:
        """Call the handler with ``message`` as ``HandleMessage`` does; the outcome."""
        errors: dict[tuple[str, int, int], BaseException] = {}
        servicer = _MessageHandlerServicer(_recording(self._handle, errors), None)
        context = _Context()
        request = handler_pb2.HandleMessageRequest(message=message.to_proto())
        try:
            response = await servicer.HandleMessage(request, context)
        except _Aborted:
            found = self._classifier.from_status(context.code, context.details)
            return _outcome(found, context.code, errors.get(_coordinates(message)))
        found = self._classifier.from_response(response)
        return _outcome(found, grpc.StatusCode.OK, errors.get(_coordinates(message)))

    async def handle_batch(self, messages: Sequence[Message]) -> list[Outcome]:
        """Call the handler with every message as ``HandleMessageBatch`` does (concurrently);
        one outcome per message, in order. In a batch a raised error becomes that message's
        status, classified like a unary call's (see :mod:`consumer_proxy.handler`). The messages
        need distinct coordinates (topic, partition, offset), as a batch from Kafka has: pass
        ``offset=`` to :func:`message`."""
        seen = [_coordinates(m) for m in messages]
        if len(set(seen)) != len(seen):
            twice = sorted({c for c in seen if seen.count(c) > 1})
            raise ValueError(
                f"messages of a batch share coordinates {twice} (topic, partition, offset): "
                "a batch from Kafka never does, and the outcomes could not be told apart; "
                "give each message its own offset= (message(..., offset=i))"
            )
        errors: dict[tuple[str, int, int], BaseException] = {}
        servicer = _MessageHandlerServicer(_recording(self._handle, errors), None)
        request = handler_pb2.HandleMessageBatchRequest(messages=[m.to_proto() for m in messages])
        response = await servicer.HandleMessageBatch(request, _Context())
        return [
            _outcome(
                self._classifier.from_response(result),
                _CODES.get(result.status_code, grpc.StatusCode.UNKNOWN),
                errors.get(_coordinates(m)),
            )
            for m, result in zip(messages, response.results, strict=True)
        ]

    def run(self, message: Message) -> Outcome:
        """:meth:`handle` on a fresh event loop (not from inside a running loop)."""
        _refuse_running_loop("run")
        return asyncio.run(self.handle(message))

    def run_batch(self, messages: Sequence[Message]) -> list[Outcome]:
        """:meth:`handle_batch` on a fresh event loop (not from inside a running loop)."""
        _refuse_running_loop("run_batch")
        return asyncio.run(self.handle_batch(messages))


def _refuse_running_loop(name: str) -> None:
    # Checked before the coroutine exists: asyncio.run would refuse too, but leave it unawaited.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() cannot be called from a running event loop; await handle()")


def _coordinates(message: Message) -> tuple[str, int, int]:
    return message.topic, message.partition, message.offset


def _recording(
    handle: HandlerFunc, errors: dict[tuple[str, int, int], BaseException]
) -> HandlerFunc:
    """``handle``, noting what it raises so the outcome can show it (the SDK only logs it).

    Sync on purpose: the SDK's check that the handler returned an awaitable must still see
    what the handler returned.
    """

    def call(message: Message) -> Awaitable[Result | None]:
        try:
            pending = handle(message)
        except Exception as exc:
            errors[_coordinates(message)] = exc
            raise
        if not inspect.isawaitable(pending):
            return pending  # the SDK answers INTERNAL for a handler that is not async
        return _watch(pending, message, errors)

    return call


async def _watch(
    pending: Awaitable[Result | None],
    message: Message,
    errors: dict[tuple[str, int, int], BaseException],
) -> Result | None:
    try:
        return await pending
    except Exception as exc:
        errors[_coordinates(message)] = exc
        raise
