"""The tracing seam: what the push objects, the intake and the DLQ / tier writer ask of
OpenTelemetry, and nothing of it when tracing is off.

Off (the default, ``tracing.enabled: false``) the group's tracer is None: no
``opentelemetry`` module is imported and a message costs one None check. On,
``start_tracing`` imports ``consumer_proxy.otel`` (the OpenTelemetry SDK and an OTLP
exporter, the ``tracing`` extra) and every message gets a ``MessageTrace`` on
``Delivery.trace``:

    first push   -> CONSUMER span "<topic> process" (parent: the record's traceparent, or a
                    link to it with link_producer; a root without one)
    each attempt -> CLIENT span, its context in the call's gRPC metadata (W3C)
    retry, backoff, breaker hold, outage wait, guard hold -> events on the process span
    a long-running call's heartbeats -> events on its attempt span
    dead letter, retry tier -> PRODUCER span; the record carries the process span's traceparent
    batch call   -> CLIENT span linked to each message's process span; each message's context
                    in its ``Message.traceparent`` field

The record's headers are untrusted: ``core.tracecontext.parse_traceparent`` reads at most
``MAX_TRACEPARENT_BYTES`` and anything malformed is ignored (the message gets a root span).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from .core.tracecontext import Metadata

if TYPE_CHECKING:
    from .config import TracingConfig
    from .core.decision import Decision
    from .core.outcomes import Classification
    from .core.partitions import Delivery

log = logging.getLogger(__name__)


class MessageTrace(Protocol):
    """One message's process span and what happens to it (``Delivery.trace``)."""

    traceparent: str
    """The process span's context as a W3C traceparent (a batch request carries it); "" for
    a new trace not sampled."""
    tracestate: str
    """The W3C tracestate that goes with ``traceparent`` ("" when there is none)."""
    sampled: bool
    """Whether its spans are recorded."""

    def attempt(self, method: str, target: str, attempt: int) -> tuple[object, Metadata | None]:
        """Start an attempt (a CLIENT span): the handle for ``attempt_done`` and the call's
        metadata."""

    def attempt_done(self, handle: object, result: Classification | None) -> None:
        """The attempt ended with ``result`` (None: cancelled by the proxy)."""

    def heartbeat(self, gap_s: float, progress: str) -> None:
        """A long-running call's heartbeat (``gap_s`` after the previous one, the handler's
        latest ``progress`` note): an event on the attempt under way."""

    def event(self, name: str, attributes: Mapping[str, str | int | float | bool]) -> None:
        """Something happened to the message (a breaker hold, ...)."""

    def decided(self, decision: Decision, status: str) -> None:
        """The core decided: ack and drop end the span, retry and guard hold are events, a
        dead letter or tier move waits for its write."""

    def end(self, outcome: str) -> None:
        """The message's work here is over (``outcome``: what became of it)."""

    def stamped(self, headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """``headers`` with the record's trace context replaced by the process span's."""

    def write(self, topic: str, what: str) -> object:
        """Start the DLQ or tier write (a PRODUCER span)."""

    def written(self, handle: object, ok: bool) -> None:
        """The write was confirmed (ok) or cancelled; ends the process span either way."""


class Tracer(Protocol):
    """A group's tracer (None when tracing is off)."""

    def begin(self, delivery: Delivery, held_s: float) -> MessageTrace:
        """``delivery``'s trace, its process span started on its first push (``held_s``:
        seconds its worker waited on the breaker first)."""

    def begin_batch(self, batch: Sequence[Delivery]) -> list[int]:
        """``begin`` of each message of a batch call (no breaker hold); the positions of those
        whose trace carries a context (sampled, or a producer's passed on), usually none."""

    def batch_call(
        self, batch: Sequence[Delivery], carried: Sequence[int], method: str, target: str
    ) -> tuple[object, Metadata | None]:
        """Start a batch call's CLIENT span, linked to the process span of each sampled
        message (among ``carried``, ``begin_batch``'s); (None, None) when there is none."""

    def batch_done(self, handle: object, status: str, count: int) -> None:
        """The batch call ended with the call's ``status``."""


class Tracing(Protocol):
    """The process's tracing: one tracer per group, flushed at shutdown."""

    def tracer(self, group: str) -> Tracer: ...

    def shutdown(self) -> None: ...


def end_trace(delivery: Delivery, why: str) -> None:
    """``PartitionSet.gone`` while tracing is on: a message that leaves without being done
    here (revoked, lost, stale, truncated, shutdown) ends its process span with that
    outcome, wherever it waited."""
    trace = delivery.trace
    if trace is not None:
        trace.end(why)


def start_tracing(config: TracingConfig) -> Tracing | None:
    """The process's tracing, or None when it is off (nothing of OpenTelemetry is imported
    then). ``OTEL_SDK_DISABLED=true`` turns it off as the SDK's own switch does."""
    if not config.enabled or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    from .otel import OtelTracing  # the tracing extra: imported only when tracing is on

    tracing = OtelTracing(config)
    log.info("tracing on: %s", tracing.describe())
    return tracing
