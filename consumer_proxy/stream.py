"""Pushing a long-running group's messages: ``StreamPush`` (``delivery.long_running``).

The unary workers (``push.UnaryPush``: rate, limiter, breaker, ``PartitionSet.begin``), but
each message goes through the server-streaming ``HandleMessageStream`` call: the service
heartbeats while it works, then sends one result with the same shape and statuses as
``HandleMessage``. There is no fixed deadline: the core's ``core.heartbeat.CallWatch`` ends a
call that went silent for ``heartbeat_timeout_ms`` (a deadline, under the outage rule) or ran
for ``max_processing_ms`` (a counted failure); the dispatcher cancels it, so the service sees
the cancellation. Then, as in unary mode: the breaker hears the call
(``core.ejection.breaker_hears``), ``PartitionSet.finish`` decides, ``Tally`` counts.

    ready queue -> worker -> rate, limiter, breaker -> PartitionSet.begin
      -> push_stream (heartbeats -> CallWatch.heard; expiry -> core.heartbeat.expiry_result)
      -> breaker -> PartitionSet.finish -> Tally

A revoked or lost partition's calls, and every call at shutdown, are cancelled through
``cancel_calls`` (shared with unary mode): the message is given back, never an attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .config import LongRunningConfig
from .core.heartbeat import MAX_PROCESSING_STATUS, CallWatch, Expiry, Limits
from .core.outcomes import Classification
from .core.partitions import Delivery
from .proto.v1 import handler_pb2
from .push import PushParts, UnaryPush
from .wire import message


class StreamPush(UnaryPush):
    """Long-running mode: ``workers`` workers, each with one streaming call at a time."""

    def __init__(
        self,
        parts: PushParts,
        ready: asyncio.Queue[Delivery],
        workers: int,
        long_running: LongRunningConfig,
    ) -> None:
        super().__init__(parts, ready, workers)
        self.limits = Limits.from_ms(
            long_running.heartbeat_timeout_ms, long_running.max_processing_ms
        )
        self._m_open = self._metrics.long_calls_open.labels(self.name)
        self._m_gap = self._metrics.heartbeat_gap.labels(self.name)
        self._m_expired = {
            why: self._metrics.calls_cancelled.labels(self.name, why.value) for why in Expiry
        }
        # Read on each scrape: nothing to keep up to date on the hot path.
        self._metrics.oldest_open_call.labels(self.name).set_function(self._oldest_age)

    def _oldest_age(self) -> float:
        oldest = self.oldest()
        return max((age for _, age, _ in oldest.values()), default=0.0)

    def request(self, delivery: Delivery) -> handler_pb2.HandleMessageStreamRequest:
        """The ``HandleMessageStreamRequest`` of one push (attempt and limits set)."""
        m = message(delivery, self.name)
        m.attempt = delivery.attempt
        return handler_pb2.HandleMessageStreamRequest(
            message=m,
            heartbeat_interval_ms=self.limits.heartbeat_interval_ms,
            max_processing_ms=round(self.limits.max_processing_s * 1000),
        )

    async def _deliver(self, delivery: Delivery, probe: bool) -> Classification | None:
        """Push ``delivery`` in a streaming call; None when ``cancel_calls`` cancelled it."""
        endpoint = self.pusher.pick()
        request = self.request(delivery)
        # The watch runs on the event loop's clock, as the dispatcher's timers do.
        watch = CallWatch(self.limits, asyncio.get_running_loop().time())
        push_stream = self.pusher.push_stream
        observe = self._m_gap.observe
        on_gap: Callable[[float], None] = observe
        trace = delivery.trace
        if trace is not None and trace.sampled:  # each heartbeat an event of the attempt

            def on_gap(gap_s: float) -> None:
                observe(gap_s)
                trace.heartbeat(gap_s, watch.progress)

        if probe:
            # A half-open probe's first heartbeat closes the breaker: the service is up.
            # Waiting for the result would hold the group at one call for a whole handler (up
            # to max_processing_ms). It is no answer, though: no other call's silence is
            # charged on its evidence (an instance dying mid-call heartbeats too).
            me = asyncio.current_task()
            assert me is not None
            beat = on_gap

            def on_gap(gap_s: float) -> None:
                beat(gap_s)
                if me not in self.probe_heard:
                    self.probe_heard.add(me)
                    self.breaker.record(False, probe=True, answered=False)

        self._m_open.inc()
        try:
            result = await self._one_call(
                delivery,
                endpoint,
                "HandleMessageStream",
                lambda metadata: push_stream(request, endpoint, watch, on_gap, metadata),
                watch,
            )
        finally:
            self._m_open.dec()
        if result is None:
            return None
        expiry = watch.expired(asyncio.get_running_loop().time())
        if expiry is not None and result.status in {"DEADLINE_EXCEEDED", MAX_PROCESSING_STATUS}:
            self._m_expired[expiry].inc()
        heard = probe and asyncio.current_task() in self.probe_heard
        return self._settle(delivery, result, probe, endpoint, heard)
