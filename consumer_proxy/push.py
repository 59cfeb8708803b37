"""Pushing a group's messages to its service: what every mode shares (``Push``) and the
unary path (``UnaryPush``); batch mode is ``batch_push.BatchPush``, the streaming push for
long-running handlers ``stream.StreamPush``.

Each owns the group's workers (in batch mode, call slots), the calls themselves (through the
``ports.Pusher``), the calls in flight (``pushing``, which shutdown waits on) and handing
each answer to the core: the breaker hears the call (``core.ejection.breaker_hears``, the
one rule for an instance out of rotation and a probe, in every mode), then
``PartitionSet.finish`` decides each message, and ``Tally.settled`` counts the decision and
starts a DLQ or retry tier write (``parking.Parking``) when the message leaves its
partition.

    unary: ready queue -> worker -> rate, limiter, breaker -> PartitionSet.begin -> push
           -> breaker -> PartitionSet.finish -> Tally

What a result means is the core's (``core.decision``, ``core.batching``); these classes only
run the calls. A worker stops once ``draining`` is set (shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from .core.ejection import breaker_hears
from .core.heartbeat import CallWatch, Cancel
from .core.outcomes import Classification
from .core.partitions import Delivery, PartitionSet, PartitionState, Ready, Run
from .core.tracecontext import Metadata
from .flow import Breaker, ConcurrencyLimiter, RateLimiter
from .metrics import ProxyMetrics
from .parking import Tally
from .ports import Clock, Edges, Pusher
from .tracing import Tracer
from .wire import unary_request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushParts:
    """What both modes are built from."""

    name: str
    partitions: PartitionSet
    edges: Edges
    """The pusher, the clock and the tracer (None while tracing is off: a message then costs
    a None check) are the push's."""
    breaker: Breaker
    limiter: ConcurrencyLimiter
    rate: RateLimiter | None
    tally: Tally
    metrics: ProxyMetrics
    call_ended: asyncio.Event
    """Set after every call (revocation waits on it)."""


@dataclass(eq=False, slots=True)
class OpenCall:
    """A call under way (unary or streaming), so that it can be cancelled on its own."""

    worker: asyncio.Task[Any]
    started: float
    watch: CallWatch | None = None
    """A long-running call's heartbeat times (``stream.StreamPush``)."""
    cancel: Cancel | None = None
    """Set when the proxy cancelled it (revoke, lost, shutdown): never an attempt."""


def attempt_span(delivery: Delivery, method: str, endpoint: Any) -> tuple[object, Metadata | None]:
    """A traced delivery's attempt span and the call's metadata; (None, None) untraced."""
    trace = delivery.trace
    if trace is None:
        return None, None
    return trace.attempt(method, endpoint.target, delivery.attempt)  # type: ignore[no-any-return]


class Push:
    """What both modes share: the flow objects, the call bookkeeping, the breaker rule."""

    def __init__(self, parts: PushParts) -> None:
        self.name = parts.name
        self.partitions = parts.partitions
        self.pusher: Pusher = parts.edges.pusher
        self.breaker = parts.breaker
        self.limiter = parts.limiter
        self.rate = parts.rate
        self.tally = parts.tally
        self._metrics = parts.metrics
        self._clock: Clock = parts.edges.clock
        self._call_ended = parts.call_ended
        self._tracer: Tracer | None = parts.edges.tracer
        self.pushing: set[asyncio.Task[Any]] = set()
        """The workers with a call under way (shutdown gives them the grace period)."""
        self.draining = False
        """Shutdown began: workers take nothing more."""
        self.last_failure = ""
        """The latest service-level failure, said when the breaker opens."""
        self.open: dict[OpenCall, Sequence[Ready]] = {}
        """Calls under way, each with its messages (one bookkeeping entry per call, not per
        message: a batch call's 500 entries cost more than its request)."""
        self.probe_heard: set[asyncio.Task[Any]] = set()
        """Workers whose half-open probe the breaker has heard already, before the call ended
        (a long call's first heartbeat: ``stream.StreamPush``)."""
        self._m_push = parts.metrics.push_duration.labels(parts.name)
        self._m_in_flight = parts.metrics.in_flight.labels(parts.name)

    def _tier_delivered(self, delivery: Ready) -> None:
        self._metrics.retry_tier_deliveries.labels(self.name, str(delivery.tier)).inc()

    def oldest(self) -> dict[tuple[str, int], tuple[int, float, str]]:
        """Per partition, its oldest call under way (unary, batch or streaming): (offset, age
        in seconds, the handler's progress note of a streaming call)."""
        now = self._clock()
        found: dict[tuple[str, int], tuple[int, float, str]] = {}
        for call, deliveries in self.open.items():
            age = now - call.started
            for delivery in deliveries:
                tp = (delivery.part.topic, delivery.part.partition)
                if tp not in found or age > found[tp][1]:
                    note = call.watch.progress if call.watch is not None else ""
                    offset = (
                        delivery.offsets[0] if isinstance(delivery, Run) else delivery.origin.offset
                    )
                    found[tp] = (offset, age, note)
        return found

    async def _one_call(
        self,
        delivery: Delivery,
        endpoint: Any,
        method: str,
        send: Callable[[Metadata | None], Awaitable[Classification]],
        watch: CallWatch | None = None,
    ) -> Classification | None:
        """One message's call (unary or streaming): open under ``delivery`` for
        ``cancel_calls`` while ``send(metadata)`` runs, inside its attempt span when traced.
        None when ``cancel_calls`` cancelled it (the message is given back, no attempt)."""
        worker = asyncio.current_task()
        assert worker is not None
        call = OpenCall(worker, self._clock(), watch)
        self.open[call] = (delivery,)
        self._m_in_flight.inc()
        trace = delivery.trace
        span, metadata = attempt_span(delivery, method, endpoint)
        result: Classification | None = None
        try:
            result = await send(metadata)
        except asyncio.CancelledError:
            if self._cancelled_here(call):
                return None
            raise
        finally:
            del self.open[call]
            self._m_in_flight.dec()
            self._call_ended.set()
            if trace is not None:
                trace.attempt_done(span, result)
        return result

    def cancel_calls(self, parts: Collection[PartitionState] | None, cause: Cancel) -> int:
        """Cancel the open calls of ``parts`` (None: all); returns how many. The service sees
        the cancellation; each message is given back (``PartitionSet.abandon``), never
        counted as an attempt, and its worker carries on. A batch call goes as a whole once
        one of its partitions does: its messages of partitions still owned are pushed again
        (uncounted), rather than the leaving ones being worked on beside their new owner."""
        count = 0
        for call, deliveries in self.open.items():
            if call.cancel is None and (
                parts is None or any(delivery.part in parts for delivery in deliveries)
            ):
                call.cancel = cause
                call.worker.cancel()
                count += 1
        if count:
            self._metrics.calls_cancelled.labels(self.name, cause.value).inc(count)
        return count

    @staticmethod
    def _cancelled_here(call: OpenCall) -> bool:
        """After a CancelledError in ``call``: True when ``cancel_calls`` did it (the worker
        is uncancelled and goes on), False for a cancellation of the worker."""
        if call.cancel is None:
            return False
        call.worker.uncancel()
        return True

    def _tell_breaker(self, failure: bool | None, endpoint: Any, probe: bool) -> None:
        # ``ejected`` is read only for a service failure, the one case the rule looks at it.
        heard = breaker_hears(failure, failure is True and endpoint.ejected)
        if heard is None:
            if probe:
                self.breaker.abandon_probe()
        else:
            self.breaker.record(heard, probe)


class UnaryPush(Push):
    """Unary mode: ``workers`` workers, each pushing one message at a time."""

    def __init__(self, parts: PushParts, ready: asyncio.Queue[Delivery], workers: int) -> None:
        super().__init__(parts)
        self.ready = ready
        self.workers = workers

    def ready_low(self) -> bool:
        """Fewer messages are ready than the workers can take in one round."""
        return self.ready.qsize() < self.workers

    async def worker(self) -> None:
        """One worker: take a ready message, push it, hand the answer to the core."""
        ready = self.ready
        me = asyncio.current_task()
        assert me is not None
        clock = self._clock
        partitions = self.partitions
        tracer = self._tracer
        while not self.draining:
            delivery = await ready.get()
            if partitions.drop_stale(delivery):
                continue
            if self.rate is not None:
                await self.rate.acquire()
            await self.limiter.acquire()
            # The breaker comes last, right before the push: a worker that waited for a slot
            # must not push on an admission the breaker has withdrawn since (it opened). The
            # price: workers held by an open breaker keep the rate token they took, so the
            # rate cap may be exceeded once, by at most the worker count, when it closes.
            probe = False
            result: Classification | None = None
            rtt = 0.0
            began = False
            try:
                # (traced: how long an open breaker holds the message, an event of its span)
                held_from = clock() if tracer is not None and self.breaker.is_open else None
                probe = await self.breaker.acquire()
                began = partitions.begin(delivery)
                if began:
                    if delivery.tier:
                        self._tier_delivered(delivery)
                    if tracer is not None:
                        tracer.begin(delivery, 0.0 if held_from is None else clock() - held_from)
                    self.pushing.add(me)
                    started = clock()
                    result = await self._deliver(delivery, probe)
                    rtt = clock() - started  # one timing feeds the histogram and limiter
                    self._m_push.observe(rtt)
            finally:
                self.pushing.discard(me)
                if probe and result is None and me not in self.probe_heard:
                    self.breaker.abandon_probe()
                self.probe_heard.discard(me)
                if began and result is None:
                    partitions.abandon(delivery)
                self.limiter.release(rtt, result)

    async def _deliver(self, delivery: Delivery, probe: bool) -> Classification | None:
        """Push ``delivery``; None when ``cancel_calls`` cancelled the call."""
        endpoint = self.pusher.pick()
        request = unary_request(delivery, self.name)
        push = self.pusher.push
        result = await self._one_call(
            delivery, endpoint, "HandleMessage", lambda metadata: push(request, endpoint, metadata)
        )
        return None if result is None else self._settle(delivery, result, probe, endpoint)

    def _settle(
        self,
        delivery: Delivery,
        result: Classification,
        probe: bool,
        endpoint: Any,
        heard: bool = False,
    ) -> Classification:
        """A one-message call's answer: the breaker hears it, then the core decides.
        ``heard``: the breaker heard this probe already (its first heartbeat), so it hears the
        answer as any call's; the core still weighs it as the probe's (never charged)."""
        if result.service_failure:
            self.last_failure = f"{result.status} from {endpoint.target}: {result.reason}"
        self._tell_breaker(result.service_failure, endpoint, probe and not heard)
        decision = self.partitions.finish(delivery, result, probe)
        if decision is not None:
            self.tally.settled(delivery, decision, result.status, endpoint.target)
        # (None: stale, its trace ended by the core's ``gone``, or moved, its write under way)
        if decision is not None and delivery.trace is not None:
            delivery.trace.decided(decision, result.status)
        return result
