"""The handler SDK: write a consumer-proxy service as one ``async`` function.

The proxy pushes every Kafka message to ``consumerproxy.v1.MessageHandler/HandleMessage``.
This module implements that gRPC service around a plain Python handler::

    from consumer_proxy import handler as cp

    async def handle(message: cp.Message) -> cp.Result | None:
        if message.value is None:
            return cp.drop()                      # a tombstone: nothing to do
        await save(message.value)                 # raise cp.PoisonPill(...) for bad input
        return None                               # None means ack

    cp.run(handle, port=50051)                    # blocks; stops cleanly on SIGINT/SIGTERM

A handler is an ``async def handle(message) -> Result | None`` function, or any object with
such a ``handle`` method. Delivery is at-least-once: handlers must be idempotent.

What the handler does, and what the proxy then does with the message (the proxy's default
status table, ``consumer_proxy/core/outcomes.py``; each group may override it with
``delivery.status_overrides``):

================================  =====================  ====================================
handler                           wire                   proxy outcome
================================  =====================  ====================================
``return None`` / ``ack()``       OK, ACK (or empty)     ACK: done
``retry(after_ms, reason)``       OK, RETRY              RETRY, counted towards max_attempts
``dead_letter(reason)``           OK, DEAD_LETTER        written to the DLQ, then done
``drop()``                        OK, DROP               done, no DLQ copy
``raise PoisonPill(msg)``         INVALID_ARGUMENT       DEAD_LETTER, no retry
``raise AlreadyProcessed(msg)``   ALREADY_EXISTS         ACK
``raise Overloaded(msg)``         RESOURCE_EXHAUSTED     RETRY, and the group slows down
``raise Unavailable(msg)``        UNAVAILABLE            RETRY not counted; breaker failure
``raise HandlerError(code, msg)`` ``code``               per the table (FAILED_PRECONDITION,
                                                         OUT_OF_RANGE, DATA_LOSS, NOT_FOUND
                                                         dead-letter; UNIMPLEMENTED,
                                                         UNAUTHENTICATED, PERMISSION_DENIED
                                                         are outages like UNAVAILABLE)
any other exception               INTERNAL               RETRY, counted; logged with its
                                  ("TypeName: text")     traceback here
(a call over max_request_bytes,   RESOURCE_EXHAUSTED     RETRY, counted, as "message too
refused before the handler runs)  ("Received message     large for the service"; no slow-down
                                  larger than max")      nor breaker failure
================================  =====================  ====================================

Reasons and error texts are cut to 1 KiB of UTF-8; a lone surrogate in them (text that has no
UTF-8 form) is sent as ``?`` rather than failing the answer.

``HandleMessageBatch`` is served too: it calls the handler concurrently for every message of
the batch and answers one result per message, in order. A raised error becomes that message's
result with the same gRPC status as in unary mode (the result's ``status_code``, the error as
its ``reason``), so the proxy classifies it exactly like a failed unary call: ``Unavailable``
for one message is the same outage signal (retried, not counted, a breaker failure). Each
such result also carries the action its status leads to (PoisonPill and the other
dead-letter codes -> DEAD_LETTER, AlreadyProcessed -> ACK, anything else -> RETRY) for
proxies that predate ``status_code``.

``HandleMessageStream`` is served too, for groups with ``delivery.long_running`` (handlers
that run for minutes): the same handler runs as a task while the SDK sends a heartbeat every
``heartbeat_interval_ms`` the proxy asks for, then the result, with the same statuses as
``HandleMessage``. ``await message.progress("40%")`` sends a heartbeat with a note now
(optional; a no-op under ``HandleMessage``). The heartbeats come from the server's event loop:
**a handler that blocks the loop** (CPU-bound work, a blocking call not moved to a thread)
stops them, and the proxy fails the call after its heartbeat timeout, as hung. When the
proxy cancels a call (unary, streaming or batch: no heartbeat in time, its processing cap, a
revoked or lost partition, its shutdown) the handler sees ``asyncio.CancelledError`` (in a
batch call, every message's handler does); clean up and re-raise.

Tracing: when the service has OpenTelemetry (``opentelemetry-api``, with an SDK it configures
itself), each message runs in a SERVER span ("consumerproxy.v1.MessageHandler/<method>"), the
child of the proxy's attempt (W3C ``traceparent`` in the call's metadata) or, in a batch, of
the proxy's span for that message (``Message.traceparent``), linked to the batch call. Spans
the handler starts nest under it. Without OpenTelemetry installed nothing is traced.

``serve()`` / :class:`Server` also serve the standard ``grpc.health.v1.Health`` service,
SERVING for ``""`` and ``"consumerproxy.v1.MessageHandler"``, NOT_SERVING once stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import CoroutineType, TracebackType
from typing import Any, Final, Literal, Protocol, TypeAlias, runtime_checkable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "SERVICE_NAME",
    "Action",
    "AlreadyProcessed",
    "Handler",
    "HandlerError",
    "HandlerFunc",
    "HandlerObject",
    "Message",
    "Overloaded",
    "PoisonPill",
    "Result",
    "Server",
    "Source",
    "Unavailable",
    "ack",
    "dead_letter",
    "drop",
    "retry",
    "run",
    "serve",
]

log = logging.getLogger(__name__)

SERVICE_NAME: Final = "consumerproxy.v1.MessageHandler"
"""The fully qualified gRPC service name, also the health-check service name."""

MAX_REASON_BYTES: Final = 1024
"""Reasons and error details are cut to this many UTF-8 bytes (the DLQ keeps at most 1 KiB)."""

DEFAULT_MAX_REQUEST_BYTES: Final = 128 * 1024 * 1024
"""The largest request a :class:`Server` accepts unless told otherwise (gRPC's own default is
4 MiB). It covers the proxy's largest batch (``batch.max_bytes`` up to 64 MiB of message
bytes, plus each message's coordinates) and any record a broker with the default
``socket.request.max.bytes`` (100 MiB) can store. It is a ceiling, not an allocation."""

_MAX_GRPC_LENGTH: Final = 2**31 - 1

DEFAULT_HEARTBEAT_INTERVAL_MS: Final = 1000
"""How often a long call heartbeats when the proxy's request does not say."""

Source: TypeAlias = Literal["primary", "redrive", "retry"]
"""Where a delivery comes from: the group's topics, merged back from its DLQ, or one of its
retry tiers (``delivery.retry_topics``)."""

_SOURCE_OF_PROTO: dict[int, Source] = {
    handler_pb2.DELIVERY_SOURCE_REDRIVE: "redrive",
    handler_pb2.DELIVERY_SOURCE_RETRY: "retry",
}
_PROTO_OF_SOURCE = {
    "primary": handler_pb2.DELIVERY_SOURCE_PRIMARY,
    "redrive": handler_pb2.DELIVERY_SOURCE_REDRIVE,
    "retry": handler_pb2.DELIVERY_SOURCE_RETRY,
}

_Pb = handler_pb2.HandleMessageResponse


# --------------------------------------------------------------------------------------------
# Messages


@dataclass(frozen=True, slots=True)
class Message:
    """One Kafka record as the proxy delivers it (mirrors ``consumerproxy.v1.Message``).

    ``topic``, ``partition`` and ``offset`` are always the record's original coordinates, also
    when it is redelivered from the DLQ (``source == "redrive"``) or from a retry tier
    (``source == "retry"``). ``key`` and ``value`` are
    ``None`` for a null key / a tombstone, distinct from empty bytes. ``headers`` keeps the
    record's order and repeated keys. ``attempt`` is 1 on first delivery and counts retries,
    carrying on across DLQ redrive.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int = 0
    consumer_group: str = ""
    attempt: int = 1
    source: Source = "primary"
    _progress: Callable[[str], None] | None = field(
        default=None, repr=False, compare=False, kw_only=True
    )

    @classmethod
    def from_proto(
        cls, message: handler_pb2.Message, _progress: Callable[[str], None] | None = None
    ) -> Message:
        """Build a :class:`Message` from the wire message.

        An unspecified (or unknown) delivery source is read as ``"primary"``.
        """
        # Positional, and no generator for the (usual) empty headers: this runs for every
        # message of a batch, and keywords plus the generator were half its cost (measured:
        # 4.2 -> 2.3 us per message).
        headers = message.headers
        return cls(
            message.topic,
            message.partition,
            message.offset,
            message.key if message.has_key else None,
            message.value if message.has_value else None,
            tuple([(h.key, h.value) for h in headers]) if headers else (),
            message.timestamp_ms,
            message.consumer_group,
            message.attempt,
            _SOURCE_OF_PROTO.get(message.source, "primary"),
            _progress=_progress,
        )

    def to_proto(self) -> handler_pb2.Message:
        """The wire form of this message (handy for tests and tools)."""
        return handler_pb2.Message(
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            key=self.key or b"",
            has_key=self.key is not None,
            value=self.value or b"",
            has_value=self.value is not None,
            headers=[handler_pb2.Header(key=k, value=v) for k, v in self.headers],
            timestamp_ms=self.timestamp_ms,
            consumer_group=self.consumer_group,
            attempt=self.attempt,
            source=_PROTO_OF_SOURCE[self.source],
        )

    async def progress(self, note: str = "") -> None:
        """Say how far the handler got (``"40%"``): a heartbeat with this note goes to the
        proxy now. Optional: while the handler runs under ``HandleMessageStream`` (a group
        with ``delivery.long_running``) the SDK heartbeats for it anyway; a no-op otherwise.
        """
        if self._progress is not None:
            self._progress(note)

    def header(self, name: str) -> bytes | None:
        """The value of the *first* header called ``name`` (case-sensitive), or ``None``.

        Kafka headers may repeat; use :meth:`header_values` to see every value.
        """
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def header_values(self, name: str) -> list[bytes]:
        """Every value of the headers called ``name``, in record order."""
        return [value for key, value in self.headers if key == name]


# --------------------------------------------------------------------------------------------
# Results


class Action(enum.Enum):
    """What the proxy should do with a message that the handler processed without error."""

    ACK = "ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    DROP = "drop"


_ACTION_TO_PROTO: Final = {
    Action.ACK: _Pb.ACK,
    Action.RETRY: _Pb.RETRY,
    Action.DEAD_LETTER: _Pb.DEAD_LETTER,
    Action.DROP: _Pb.DROP,
}


@dataclass(frozen=True, slots=True)
class Result:
    """A handler's explicit answer; build one with :func:`ack`, :func:`retry`,
    :func:`dead_letter` or :func:`drop`."""

    action: Action
    retry_after_ms: int = 0
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str):  # dead_letter(exc): its text, not a failed answer
            object.__setattr__(self, "reason", _text(self.reason))
        if self.retry_after_ms < 0:
            raise ValueError(f"retry_after_ms must be >= 0, got {self.retry_after_ms}")

    def to_proto(self) -> handler_pb2.HandleMessageResponse:
        """The wire response for this result."""
        return handler_pb2.HandleMessageResponse(
            action=_ACTION_TO_PROTO[self.action],
            retry_after_ms=self.retry_after_ms,
            reason=_truncate(self.reason),
        )


def ack() -> Result:
    """The message is done (the same as returning ``None``)."""
    return Result(Action.ACK)


def retry(after_ms: int = 0, reason: str = "") -> Result:
    """Deliver the message again, no sooner than ``after_ms`` (0 = the proxy's backoff).

    Counted towards the group's ``max_attempts``; after the last attempt the proxy
    dead-letters the message.
    """
    return Result(Action.RETRY, retry_after_ms=after_ms, reason=reason)


def dead_letter(reason: str) -> Result:
    """Write the message to the group's DLQ now, with ``reason`` (cut to 1 KiB); no retries."""
    return Result(Action.DEAD_LETTER, reason=reason)


def drop() -> Result:
    """The message is done without processing and without a DLQ copy."""
    return Result(Action.DROP)


# --------------------------------------------------------------------------------------------
# Errors


class HandlerError(Exception):
    """Raise to answer the call with gRPC status ``code`` and ``message`` as its details.

    The proxy classifies the status with its status table (see the module docstring).
    """

    def __init__(self, code: grpc.StatusCode, message: str = "") -> None:
        if not isinstance(code, grpc.StatusCode):
            raise TypeError(f"HandlerError needs a grpc.StatusCode, got {code!r}")
        if code == grpc.StatusCode.OK:
            raise ValueError("HandlerError needs a non-OK status code")
        # raise Unavailable(exc): the exception's text, so that the answer keeps its status
        message = _text(message)
        super().__init__(message)
        self.code: grpc.StatusCode = code
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r})"


class PoisonPill(HandlerError):
    """The message can never be processed: INVALID_ARGUMENT, the proxy dead-letters it."""

    def __init__(self, message: str = "") -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


class AlreadyProcessed(HandlerError):
    """The message was handled before (a duplicate): ALREADY_EXISTS, the proxy acks it."""

    def __init__(self, message: str = "") -> None:
        super().__init__(grpc.StatusCode.ALREADY_EXISTS, message)


class Overloaded(HandlerError):
    """Too busy right now: RESOURCE_EXHAUSTED, the proxy retries and slows the group down."""

    def __init__(self, message: str = "") -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class Unavailable(HandlerError):
    """A dependency is down: UNAVAILABLE, the proxy retries without counting an attempt and
    counts a failure towards its circuit breaker."""

    def __init__(self, message: str = "") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


# For proxies that predate a batch result's status_code: the action its status leads to.
_DEAD_LETTER_CODES: Final = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.NOT_FOUND,
    }
)


def _status_result(code: grpc.StatusCode, details: str) -> handler_pb2.HandleMessageResponse:
    """A batch result failing one message with ``code``, as a unary call would fail."""
    if code == grpc.StatusCode.ALREADY_EXISTS:
        action = handler_pb2.HandleMessageResponse.ACK
    elif code in _DEAD_LETTER_CODES:
        action = handler_pb2.HandleMessageResponse.DEAD_LETTER
    else:
        action = handler_pb2.HandleMessageResponse.RETRY
    return handler_pb2.HandleMessageResponse(
        action=action, reason=_truncate(details), status_code=code.value[0]
    )


def _text(value: object) -> str:
    """``value`` as text, never raising (an exception whose ``__str__`` fails included)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - text for an answer; the answer must not fail
        return f"<{type(value).__name__}: str() failed>"


_LATE_TEXT: Final = "no answer before the batch call's deadline"


def _truncate(text: str, limit: int = MAX_REASON_BYTES) -> str:
    # "replace": a lone surrogate (no UTF-8 form, e.g. from os.fsdecode) becomes "?" instead
    # of failing the answer; protobuf and gRPC take only valid UTF-8 as text.
    if not isinstance(text, str):
        text = _text(text)
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw.decode()
    return raw[:limit].decode(errors="ignore")


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails is still INTERNAL
        text = "<str() failed>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_LATE: Final = _status_result(grpc.StatusCode.DEADLINE_EXCEEDED, _LATE_TEXT)
"""A batch message's result when its handler had not answered shortly before the call's
deadline: retried and counted, as a unary call of it that ran into the deadline would be."""


# --------------------------------------------------------------------------------------------
# Handlers


HandlerFunc: TypeAlias = Callable[[Message], Awaitable[Result | None]]
"""``async def handle(message: Message) -> Result | None``."""


@runtime_checkable
class HandlerObject(Protocol):
    """An object whose ``async def handle(message)`` is the handler."""

    def handle(self, message: Message) -> Awaitable[Result | None]:
        """Handle one message; return ``None`` to ack."""
        ...


Handler: TypeAlias = HandlerFunc | HandlerObject
"""What :func:`serve`, :class:`Server` and :func:`run` accept."""


def _as_function(handler: Handler) -> HandlerFunc:
    if isinstance(handler, HandlerObject):
        handle = handler.handle
        if not callable(handle):
            raise TypeError(f"the handler's handle is not callable: {handle!r}")
        if inspect.isclass(handler) and inspect.isfunction(
            inspect.getattr_static(handler, "handle")
        ):
            raise TypeError(f"pass an instance of the handler class, not {handler!r}")
        return handle
    if callable(handler):
        return handler
    raise TypeError(f"a handler is an async function or has a handle() method, got {handler!r}")


async def _call_handler(handle: HandlerFunc, message: Message) -> Result | None:
    pending = handle(message)
    if type(pending) is not CoroutineType and not inspect.isawaitable(pending):
        raise TypeError(f"the handler must be async; it returned {type(pending).__name__}")
    result = await pending
    if result is not None and not isinstance(result, Result):
        raise TypeError(f"the handler must return a Result or None, got {type(result).__name__}")
    return result


def _answer_margin_s(remaining_s: float) -> float:
    """How long before a batch call's deadline the SDK answers it: a tenth of the time left,
    from 20 ms to 1 s (the answer still has to reach the proxy)."""
    return min(1.0, max(0.02, remaining_s * 0.1))


def _cancel_late(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()


STOP_WAIT_S = 10.0
"""How long ``Server.stop`` waits, after the grace, for handlers whose calls it cancelled."""

NOTE_GAP = 0.25
"""A long call's progress notes bring its next heartbeat forward, but to no less than this
share of the heartbeat interval after the last one: at most four a heartbeat interval."""


def _cancelled_by_itself() -> bool:
    """Whether a CancelledError the handler raised is its own (it awaited a task or future
    that something else cancelled): its task is not being cancelled, as a cancelled call's
    is. Answered as any failure (INTERNAL) at once; raised on, the call would get no answer,
    and the proxy would wait out its deadline and count a timeout, an outage's sign."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def _reraise(exc: BaseException) -> bool:
    """Whether a handler's exception is not the handler's failure but must propagate: the
    process is being interrupted or exited, or the call is being cancelled."""
    if isinstance(exc, asyncio.CancelledError):
        return not _cancelled_by_itself()
    return isinstance(exc, (KeyboardInterrupt, SystemExit))


def _response(result: Result | None) -> handler_pb2.HandleMessageResponse:
    return handler_pb2.HandleMessageResponse() if result is None else result.to_proto()


def _where(message: Message) -> str:
    return f"{message.topic}[{message.partition}]@{message.offset}"


_NO_SPAN: Final = contextlib.nullcontext()


class _ServerSpans:
    """A SERVER span per message when OpenTelemetry is installed and a tracer provider is
    set (the given one, or the global one once the service sets it); a no-op otherwise."""

    def __init__(self, provider: Any = None, recheck_s: float = 1.0) -> None:
        try:
            from opentelemetry import propagate, trace
        except ImportError:  # the service has no OpenTelemetry: nothing is traced
            self._tracer: Any = None
            return
        unset = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        if isinstance(provider, unset):
            self._tracer = None  # told to use the no-op provider: as if absent
            return
        self._unset = unset
        self._global = trace.get_tracer_provider
        self._waiting = provider is None
        """The global provider is still OpenTelemetry's default (no-op) one: until the service
        sets one (once, for good), a message costs a clock reading and no span object; the
        provider is looked at again every ``recheck_s`` (reading it costs ~1 µs)."""
        self._recheck_s = recheck_s
        self._next_check = 0.0
        self._extract = propagate.extract
        self._kind = trace.SpanKind.SERVER
        self._link = trace.Link
        self._current = trace.get_current_span
        self._error = trace.Status(trace.StatusCode.ERROR)
        self._tracer = trace.get_tracer(__name__, tracer_provider=provider)
        # The last call's metadata and its (context, links): a batch's messages share them.
        self._call: tuple[Any, Any, tuple[Any, ...]] = (object(), None, ())

    def span(
        self,
        method: str,
        message: handler_pb2.Message,
        metadata: Any,
        in_batch: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Run the handler of ``message`` in its span: the parent is the call's trace context
        (``metadata``), or in a batch the message's own, linked to the call's. Without
        OpenTelemetry, or while no tracer provider is set: one shared no-op (this runs for
        every message of a batch)."""
        if self._tracer is None:
            return _NO_SPAN
        if self._waiting:
            now = time.monotonic()
            if now < self._next_check:
                return _NO_SPAN
            if isinstance(self._global(), self._unset):
                self._next_check = now + self._recheck_s
                return _NO_SPAN
            self._waiting = False
        return self._span(method, message, metadata, in_batch)

    @contextlib.contextmanager
    def _span(
        self, method: str, message: handler_pb2.Message, metadata: Any, in_batch: bool
    ) -> Iterator[None]:
        tracer = self._tracer
        seen, call, call_links = self._call
        if metadata is not seen:  # (each message of a batch passes its call's metadata)
            call = self._extract({k: v for k, v in metadata or () if isinstance(v, str)})
            call_span = self._current(call).get_span_context()
            call_links = (self._link(call_span),) if call_span.is_valid else ()
            self._call = (metadata, call, call_links)
        links: tuple[Any, ...] = ()
        context = call
        if in_batch:
            own = {"traceparent": message.traceparent, "tracestate": message.tracestate}
            context = self._extract(own)
            links = call_links
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": SERVICE_NAME,
            "rpc.method": method,
            "messaging.system": "kafka",
            "messaging.destination.name": message.topic,
            "messaging.destination.partition.id": str(message.partition),
            "messaging.kafka.offset": message.offset,
            "messaging.consumer.group.name": message.consumer_group,
            "messaging.message.delivery_attempt": message.attempt,
        }
        with tracer.start_as_current_span(
            f"{SERVICE_NAME}/{method}",
            context=context,
            kind=self._kind,
            links=links,
            attributes=attributes,
        ):
            yield

    def failed(self, status: grpc.StatusCode) -> None:
        """The handler's answer for the current span's message is a non-OK status."""
        if self._tracer is not None:
            span = self._current()
            span.set_attribute("rpc.grpc.status_code", status.value[0])
            span.set_status(self._error)


class _MessageHandlerServicer(handler_pb2_grpc.MessageHandlerServicer):
    """Adapts a Python handler to the generated servicer."""

    def __init__(
        self, handle: HandlerFunc, max_concurrency: int | None, tracer_provider: Any = None
    ) -> None:
        self._handle = handle
        self._spans = _ServerSpans(tracer_provider)
        self._max_concurrency = max_concurrency
        self._in_flight = 0
        self.admitted: set[asyncio.Task[Any]] = set()
        """The tasks of the calls admitted and not yet ended (``Server.stop`` waits for them)."""

    async def HandleMessage(
        self, request: handler_pb2.HandleMessageRequest, context: Any
    ) -> handler_pb2.HandleMessageResponse:
        message = Message.from_proto(request.message)
        with self._admit() as admitted:
            if not admitted:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                details = f"over max_concurrency={self._max_concurrency}"
                response = handler_pb2.HandleMessageResponse()
            else:
                # A cancelled call (the proxy gave up on it) cancels this coroutine, and so
                # the handler: it sees asyncio.CancelledError.
                code, details, response = await self._answer(
                    message, ("HandleMessage", request.message, context)
                )
        if code != grpc.StatusCode.OK:
            await context.abort(code, _truncate(details))
        return response

    async def _answer(
        self, message: Message, call: tuple[str, handler_pb2.Message, Any]
    ) -> tuple[grpc.StatusCode, str, handler_pb2.HandleMessageResponse]:
        """Run the handler in its span (``call``: the method, the wire message, the call's
        context): the call's status, its details and (when OK) the response."""
        method, wire, context = call
        with self._spans.span(method, wire, context.invocation_metadata()):
            return await self._run(message)

    async def _run(
        self, message: Message
    ) -> tuple[grpc.StatusCode, str, handler_pb2.HandleMessageResponse]:
        try:
            result = await _call_handler(self._handle, message)
            response = _response(result)
        except HandlerError as exc:
            log.debug("%s: handler raised %r", _where(message), exc)
            self._spans.failed(exc.code)
            return exc.code, exc.message, handler_pb2.HandleMessageResponse()
        except BaseException as exc:
            if _reraise(exc):
                raise
            log.exception("%s: handler failed", _where(message))
            self._spans.failed(grpc.StatusCode.INTERNAL)
            return grpc.StatusCode.INTERNAL, _describe(exc), handler_pb2.HandleMessageResponse()
        return grpc.StatusCode.OK, "", response

    async def HandleMessageStream(
        self, request: handler_pb2.HandleMessageStreamRequest, context: Any
    ) -> AsyncIterator[handler_pb2.HandleMessageStreamEvent]:
        """The long-running call: heartbeats while the handler's task runs, then its result.

        The heartbeats come from this event loop: a handler that blocks the loop (CPU work or
        a blocking call not moved to a thread) stops them, and the proxy then treats the call
        as hung. When the proxy cancels the call (heartbeat timeout, max_processing_ms, a
        revoked partition, its shutdown), the handler's task is cancelled.
        """
        interval_s = (request.heartbeat_interval_ms or DEFAULT_HEARTBEAT_INTERVAL_MS) / 1000.0
        noted = asyncio.Event()
        notes: list[str] = [""]

        def progress(note: str) -> None:
            notes[0] = note
            noted.set()

        message = Message.from_proto(request.message, progress)
        if not self._try_admit():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"over max_concurrency={self._max_concurrency}",
            )
        # The slot (and stop()'s wait) is the handler's task's until it ends, not this call's:
        # a cancelled call may end at once (gRPC cancels it again), while the handler cleans up.
        work = asyncio.create_task(
            self._answer(message, ("HandleMessageStream", request.message, context)),
            name=_where(message),
        )
        self.admitted.add(work)
        work.add_done_callback(self._release)
        loop = asyncio.get_running_loop()
        last = loop.time()  # the last heartbeat (or the call's start)
        try:
            while not work.done():
                # A heartbeat every interval; a progress note brings the next one
                # forward, but never closer than NOTE_GAP of the interval to the last:
                # a handler noting progress in a tight loop must not flood the proxy.
                due = last + interval_s
                waiter: asyncio.Future[Any] | None = None
                if noted.is_set():
                    due = min(due, last + interval_s * NOTE_GAP)
                else:
                    waiter = asyncio.ensure_future(noted.wait())
                try:
                    await asyncio.wait(
                        {work} if waiter is None else {work, waiter},
                        timeout=max(0.0, due - loop.time()),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    if waiter is not None:
                        waiter.cancel()
                if work.done():
                    break
                if waiter is not None and waiter.done() and not waiter.cancelled():
                    continue  # a note came: its heartbeat is due again
                noted.clear()
                last = loop.time()
                yield handler_pb2.HandleMessageStreamEvent(
                    heartbeat=handler_pb2.Heartbeat(progress=_truncate(notes[0], 256))
                )
        finally:
            if not work.done():
                work.cancel()  # the call was cancelled: so is the handler (its slot is its own)
                await asyncio.wait({work})
        code, details, response = work.result()
        if code != grpc.StatusCode.OK:
            await context.abort(code, _truncate(details))
        yield handler_pb2.HandleMessageStreamEvent(result=response)

    async def HandleMessageBatch(
        self, request: handler_pb2.HandleMessageBatchRequest, context: Any
    ) -> handler_pb2.HandleMessageBatchResponse:
        with self._admit() as admitted:
            if admitted:
                metadata = context.invocation_metadata()
                remaining = context.time_remaining()
                timer: asyncio.TimerHandle | None = None
                try:
                    async with asyncio.TaskGroup() as group:
                        tasks = [
                            group.create_task(self._batch_item(m, metadata))
                            for m in request.messages
                        ]
                        if remaining is not None and tasks:
                            # Answer the messages that are done before the call's deadline:
                            # a hung one must not cost its batch-mates their answers.
                            timer = asyncio.get_running_loop().call_later(
                                max(0.0, remaining - _answer_margin_s(remaining)),
                                _cancel_late,
                                tasks,
                            )
                finally:
                    if timer is not None:
                        timer.cancel()
                # Added in place: an ack is an empty result (no message built and copied).
                response = handler_pb2.HandleMessageBatchResponse()
                results = response.results
                late = 0
                for task in tasks:
                    if task.cancelled():  # cancelled by the timer: no answer in time
                        late += 1
                        results.append(_LATE)
                        continue
                    result = task.result()
                    if result is None:
                        results.add()
                    else:
                        results.append(result)
                if late:
                    log.warning(
                        "%d of %d message(s) of a batch had no answer %.0f ms before the "
                        "call's deadline: answered DEADLINE_EXCEEDED",
                        late,
                        len(tasks),
                        _answer_margin_s(remaining or 0.0) * 1000,
                    )
                return response
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"over max_concurrency={self._max_concurrency}"
        )
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    async def _batch_item(
        self, wire: handler_pb2.Message, metadata: Any
    ) -> handler_pb2.HandleMessageResponse | None:
        """The message's result; None for an ack. Never raises (but for cancellation): an
        exception escaping here would fail every message of the batch through the task
        group."""
        message = Message.from_proto(wire)
        with self._spans.span("HandleMessageBatch", wire, metadata, in_batch=True):
            try:
                result = await _call_handler(self._handle, message)
                return None if result is None else result.to_proto()
            except HandlerError as exc:
                log.debug("%s: handler raised %r", _where(message), exc)
                self._spans.failed(exc.code)
                return _status_result(exc.code, exc.message)
            except BaseException as exc:
                if _reraise(exc):
                    raise
                log.exception("%s: handler failed", _where(message))
                self._spans.failed(grpc.StatusCode.INTERNAL)
                return _status_result(grpc.StatusCode.INTERNAL, _describe(exc))

    def _try_admit(self) -> bool:
        """Take a slot, unless all ``max_concurrency`` are taken. One event loop runs every
        call, so a plain counter is enough."""
        if self._max_concurrency is not None and self._in_flight >= self._max_concurrency:
            return False
        self._in_flight += 1
        return True

    def _release(self, task: asyncio.Task[Any]) -> None:
        self._in_flight -= 1
        self.admitted.discard(task)

    @contextlib.contextmanager
    def _admit(self) -> Iterator[bool]:
        """A slot for the running task's call (unary and batch), while the block runs."""
        if not self._try_admit():
            yield False
            return
        task = asyncio.current_task()
        assert task is not None
        self.admitted.add(task)
        try:
            yield True
        finally:
            self._release(task)


# --------------------------------------------------------------------------------------------
# Serving


class Server:
    """A running (or ready to run) handler service: MessageHandler plus grpc.health.v1.

    Use ``async with Server(handle, port=50051) as server: ...``, or ``await serve(...)``
    which returns a started server, then ``await server.stop()``.

    ``max_concurrency`` rejects calls beyond that many in flight with RESOURCE_EXHAUSTED (the
    proxy retries them later and slows the group down) instead of queueing them behind the
    proxy's deadline; a batch call counts as one call. ``credentials`` (from
    ``grpc.ssl_server_credentials``) serves TLS / mTLS instead of plaintext.

    ``max_request_bytes`` is the largest call (one message, or one batch) the server accepts,
    :data:`DEFAULT_MAX_REQUEST_BYTES` by default; keep it above the group's largest record and
    its ``batch.max_bytes``. A larger call is refused by gRPC before the handler sees it
    (RESOURCE_EXHAUSTED, "Received message larger than max"); the proxy retries the message
    as "message too large for the service", counted, and dead-letters it after
    ``max_attempts``.
    """

    def __init__(
        self,
        handler: Handler,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        max_concurrency: int | None = None,
        credentials: grpc.ServerCredentials | None = None,
        grace_s: float = 5.0,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tracer_provider: Any = None,
    ) -> None:
        """``tracer_provider``: the OpenTelemetry provider of the handler's spans (None: the
        global one, when OpenTelemetry is installed)."""
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not 1 <= max_request_bytes <= _MAX_GRPC_LENGTH:
            raise ValueError(
                f"max_request_bytes must be from 1 to {_MAX_GRPC_LENGTH}, got {max_request_bytes}"
            )
        self._max_request_bytes = max_request_bytes
        self._servicer = _MessageHandlerServicer(
            _as_function(handler), max_concurrency, tracer_provider
        )
        self._requested_port = port
        self._host = host
        self._credentials = credentials
        self._grace_s = grace_s
        self._server: Any = None
        self._port: int | None = None
        self._stopping: asyncio.Future[None] | None = None
        self.health = health_aio.HealthServicer()
        """The health servicer; ``await server.health.set(name, status)`` changes a status."""

    @property
    def port(self) -> int:
        """The bound port (the real one when started with port 0)."""
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` to dial, e.g. ``127.0.0.1:50051`` (IPv6 hosts in brackets)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    async def start(self) -> Server:
        """Bind and start serving; returns ``self``."""
        if self._server is not None:
            raise RuntimeError("the server was already started")
        # so_reuseport=0: a second instance on a taken port fails instead of sharing it.
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self._max_request_bytes),
            ]
        )
        handler_pb2_grpc.add_MessageHandlerServicer_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        target = f"{self._host}:{self._requested_port}"
        if ":" in self._host:
            target = f"[{self._host}]:{self._requested_port}"
        try:
            if self._credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, self._credentials)
        except RuntimeError as exc:
            await server.stop(None)
            raise OSError(f"cannot listen on {target}: {exc}") from exc
        if port == 0:
            await server.stop(None)
            raise OSError(f"cannot listen on {target}")
        await self.set_serving(True)
        await server.start()
        self._server, self._port = server, port
        return self

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for ``""`` and the MessageHandler service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop: report NOT_SERVING, refuse new calls, let in-flight calls finish within
        ``grace_s`` seconds (default: the constructor's), then cancel them.

        Idempotent; concurrent callers all wait for the same shutdown.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(
                self._stop(self._grace_s if grace_s is None else grace_s)
            )
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        # gRPC's stop cancels the calls still running after the grace and returns without
        # waiting for their handlers: one cleaning up on its cancellation (a rollback) would
        # outlive the server. Wait for them, up to STOP_WAIT_S.
        running = [t for t in self._servicer.admitted if not t.done()]
        if running:
            _done, late = await asyncio.wait(running, timeout=STOP_WAIT_S)
            if late:
                log.warning(
                    "%d handler(s) still running %.0f s after their calls were cancelled; "
                    "stopped without them",
                    len(late),
                    STOP_WAIT_S,
                )

    async def wait_for_termination(self) -> None:
        """Return when the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> Server:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve(
    handler: Handler,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    max_concurrency: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
    grace_s: float = 5.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> Server:
    """Start serving ``handler`` and return the started :class:`Server`.

    ``port=0`` picks a free port (read it back from ``server.port``). Call
    ``await server.stop()`` when done.
    """
    server = Server(
        handler,
        port,
        host,
        max_concurrency=max_concurrency,
        credentials=credentials,
        grace_s=grace_s,
        max_request_bytes=max_request_bytes,
    )
    return await server.start()


def run(
    handler: Handler,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    max_concurrency: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
    grace_s: float = 5.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Serve ``handler`` until SIGINT or SIGTERM, then stop gracefully and return.

    Logs ``serving on HOST:PORT`` at INFO once listening. For scripts; in an application
    that already runs an event loop use :func:`serve` or :class:`Server`.
    """
    asyncio.run(
        _run_until_signalled(
            Server(
                handler,
                port,
                host,
                max_concurrency=max_concurrency,
                credentials=credentials,
                grace_s=grace_s,
                max_request_bytes=max_request_bytes,
            )
        )
    )


async def _run_until_signalled(server: Server) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        async with server:
            log.info("serving on %s", server.address)
            await stop.wait()
            log.info("stopping: draining in-flight calls")
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    log.info("stopped")
