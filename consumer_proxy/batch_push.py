"""Batch mode's push: ``BatchPush``, call slots sending what is ready in one call each.

    ReadyDeque -> call slot -> limiter, breaker, linger -> core.batching.take -> rate
    -> PartitionSet.begin each -> push_batch -> breaker once -> finish each -> Tally

Under ``delivery.batch: auto`` a slot picks its instance first: one without
``HandleMessageBatch`` (``Pusher.batches``, ``core.support``) gets one message in a unary call;
a batch answered UNIMPLEMENTED sends its first message again at once, unary, and gives the
rest back (a slot is one call in flight: ``concurrency`` holds), nothing counted for it. What
it shares with the unary path is ``push.Push``; what an answer means is ``core.batching``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from .core.batching import BatchLimits, BatchOutcome, summarize, take
from .core.decision import Action
from .core.outcomes import Classification
from .core.partitions import Delivery, Ready, expand
from .core.support import MissingMethod
from .kafka_log import KafkaLogGate
from .push import OpenCall, Push, PushParts, attempt_span
from .readyq import ReadyDeque
from .wire import batch_request, unary_request

log = logging.getLogger(__name__)


class BatchPush(Push):
    """Batch mode: ``workers`` call slots, each sending what is ready in one call."""

    def __init__(
        self,
        parts: PushParts,
        ready: ReadyDeque,
        workers: int,
        limits: BatchLimits,
        linger_ms: int,
        on_problem: Callable[[], None],
        auto: bool = False,
    ) -> None:
        """``on_problem`` is told when ``service_problem`` changes (health re-reads it);
        ``auto``: unary calls to the instances that do not serve ``HandleMessageBatch``."""
        super().__init__(parts)
        self.ready = ready
        self.workers = workers
        self.limits = limits
        self.auto = auto
        self._one = BatchLimits(1, limits.max_bytes)
        self._linger_s = linger_ms / 1000.0
        self._on_problem = on_problem
        self.service_problem = ""  # said by /readyz while set (the batch method is missing)
        self._missing = MissingMethod()
        self._m_batch_size = self._metrics.batch_size.labels(self.name)
        self._m_unsupported = self._metrics.batch_unsupported.labels(self.name)
        self._m_protocol_errors = self._metrics.batch_protocol_errors.labels(self.name)
        # A service that answers every batch wrongly would log a line per call (per message
        # once they go alone): repeats within a minute are counted and said once.
        self._lines = KafkaLogGate(log, f"group {self.name}")

    def ready_low(self) -> bool:
        """Fewer messages are ready than two batches."""
        return self.ready.fewer_than(self.limits.max_messages * 2)

    async def worker(self) -> None:
        """One call slot of batch mode: wait for anything ready, then send what is ready."""
        ready = self.ready
        limits = self.limits
        linger_s = self._linger_s
        me = asyncio.current_task()
        assert me is not None
        clock = self._clock
        partitions = self.partitions
        drop = partitions.drop_ready(ready.items)
        while not self.draining:
            await ready.wait()
            await self.limiter.acquire()
            probe = False
            outcome: BatchOutcome | None = None
            began: list[Ready] = []
            rtt = 0.0
            try:
                probe = await self.breaker.acquire()
                endpoint = self.pusher.pick()
                whole = self.pusher.batches(endpoint)  # auto: False for a unary instance
                if whole and linger_s and ready.fewer_than(limits.max_messages):
                    await asyncio.sleep(linger_s)
                # To begin() only the rate awaits (cancelled: what was taken goes back).
                taken = take(ready.items, limits if whole else self._one, drop)
                if ready.items:
                    ready.wake()  # more is ready than this call takes: another slot goes
                tracer = self._tracer  # (traced or unary: message by message)
                batch = expand(taken) if tracer is not None or not whole else taken
                if self.rate is not None and batch:  # (waiting for tokens is no push yet:
                    try:  # head_block_ms must not move it aside as a failed attempt)
                        await self.rate.acquire(sum(item.count for item in batch))
                    except asyncio.CancelledError:
                        ready.items.extendleft(reversed(taken))  # given back, in order
                        ready.wake()
                        raise
                began = partitions.begin_batch(batch)
                for d in began:
                    if d.tier:
                        self._tier_delivered(d)
                carried: list[int] = []
                if tracer is not None and began:  # (expanded: no ``Run`` among them)
                    carried = tracer.begin_batch(cast(list[Delivery], began))
                if began:
                    self.pushing.add(me)
                    call = OpenCall(me, clock())
                    self.open[call] = began  # for ``cancel_calls``
                    try:
                        started = clock()
                        if not whole:
                            outcome = await self._deliver_unary(
                                expand(began), probe, endpoint, carried
                            )
                        else:
                            outcome = await self._deliver(began, probe, endpoint, carried)
                            if outcome.unimplemented and self.auto:
                                # The instance serves HandleMessage only (the pusher now
                                # knows): the batch call counted for nothing.
                                outcome = None
                                began = self._one_of(began)
                                self.open[call] = began
                                carried = [0] if 0 in carried else []
                                outcome = await self._deliver_unary(
                                    expand(began), probe, endpoint, carried
                                )
                        rtt = clock() - started
                        self._m_push.observe(rtt)
                    except asyncio.CancelledError:
                        if not self._cancelled_here(call):
                            raise
                        self._call_ended.set()  # given back below, none counted
                    finally:
                        del self.open[call]
            finally:
                self.pushing.discard(me)
                if probe and outcome is None:
                    self.breaker.abandon_probe()
                if outcome is None:
                    for delivery in expand(began):
                        partitions.abandon(delivery)
                self.limiter.release(rtt, outcome.call if outcome is not None else None)

    async def _deliver(
        self, batch: list[Ready], probe: bool, endpoint: Any, carried: list[int]
    ) -> BatchOutcome:
        """``carried``: the messages that carry a trace context (``Tracer.begin_batch``; a
        traced call's ``batch`` holds no ``Run``)."""
        tracer = self._tracer
        payload = batch_request(batch, self.name, carried)
        count = sum(item.count for item in batch)
        span, metadata = (
            (None, None)
            if tracer is None or not carried
            else tracer.batch_call(
                cast(list[Delivery], batch), carried, "HandleMessageBatch", endpoint.target
            )
        )
        status = "CANCELLED"
        self._m_in_flight.inc()  # calls, as in unary mode
        try:
            outcome = await self.pusher.push_batch(payload, count, endpoint, metadata)
            status = outcome.call.status
        finally:
            self._m_in_flight.dec()
            self._call_ended.set()
            if span is not None and tracer is not None:  # (a call with a sampled message)
                tracer.batch_done(span, status, count)
        if outcome.unimplemented and self.auto:
            return outcome  # (the caller sends them again, unary)
        self._m_batch_size.observe(count)
        self._answered(outcome, endpoint.target)
        return self._finished(batch, outcome, probe, endpoint, carried)

    def _one_of(self, began: list[Ready]) -> list[Ready]:
        """A batch found an instance without ``HandleMessageBatch``: this call slot sends its
        first message again at once, in a unary call; the others go back to be taken one
        per call by the slots (sending them all from this slot would pass the group's
        ``concurrency``: a slot is one call in flight)."""
        deliveries = expand(began)
        abandon = self.partitions.abandon
        for delivery in deliveries[1:]:
            abandon(delivery)
        first: list[Ready] = [deliveries[0]]
        return first

    async def _deliver_unary(
        self, batch: list[Delivery], probe: bool, endpoint: Any, carried: list[int]
    ) -> BatchOutcome:
        """``batch`` as unary calls to ``endpoint``, all at once; one breaker record
        (``batch`` is expanded: a ``Run`` begun as one finishes message by message here)."""
        one = self._unary_call
        self._m_in_flight.inc()
        try:
            if len(batch) == 1:
                results = [await one(batch[0], endpoint)]
            else:
                results = list(await asyncio.gather(*(one(d, endpoint) for d in batch)))
        finally:
            self._m_in_flight.dec()
            self._call_ended.set()
        outcome = summarize(results)
        if outcome.breaker:
            call = outcome.call
            self.last_failure = f"{call.status} from {endpoint.target}: {call.reason}"
        return self._finished(batch, outcome, probe, endpoint, carried)

    def _unary_call(self, delivery: Delivery, endpoint: Any) -> Awaitable[Classification]:
        """One message of batch mode in a unary call (with its attempt span when traced)."""
        request = unary_request(delivery, self.name)
        if delivery.trace is None:
            return self.pusher.push(request, endpoint)
        return self._traced_call(delivery, request, endpoint)

    async def _traced_call(self, delivery: Delivery, request: Any, endpoint: Any) -> Classification:
        trace = delivery.trace
        span, metadata = attempt_span(delivery, "HandleMessage", endpoint)
        result: Classification | None = None
        try:
            result = await self.pusher.push(request, endpoint, metadata)
        finally:
            trace.attempt_done(span, result)
        return result

    def _finished(
        self,
        batch: Sequence[Ready],
        outcome: BatchOutcome,
        probe: bool,
        endpoint: Any,
        carried: list[int],
    ) -> BatchOutcome:
        """The breaker hears the call once, then the core decides each message (an answer
        of plain acks: all at once, ``PartitionSet.finish_acked``, then the process spans of
        the sampled messages among ``carried`` end, as ``decided`` would end them)."""
        # A protocol error (breaker None) says nothing about the service's health.
        self._tell_breaker(outcome.breaker, endpoint, probe)
        results = outcome.results
        if self.partitions.finish_acked(batch, results):
            self.tally.acked(len(results))
            for i in carried:  # (a message not sampled has no span to end)
                trace = batch[i].trace
                if trace.sampled:
                    trace.end(Action.ACK.value)
            return outcome
        deliveries = expand(batch)  # (the slow path: each message decided on its own)
        finish = self.partitions.finish
        settled = self.tally.settled
        target = endpoint.target
        acks = 0
        for delivery, result in zip(deliveries, results, strict=True):
            decision = finish(delivery, result, probe)
            if decision is None:
                continue  # stale (the core's ``gone`` ended its trace) or moved
            trace = delivery.trace
            if trace is not None:
                trace.decided(decision, result.status)
            if decision.action is Action.ACK:
                acks += 1
                continue
            settled(delivery, decision, result.status, target)
        if acks:
            self.tally.acked(acks)
        return outcome

    def _answered(self, outcome: BatchOutcome, target: str) -> None:
        """Logs, metrics and health for what a batch call's answer says about the service."""
        call = outcome.call
        if outcome.breaker:
            self.last_failure = f"{call.status} from {target}: {call.reason}"
        missing = self._missing
        ok = outcome.breaker is False  # (a success: not a failure, nor a protocol error)
        if missing.answered(self._clock(), target, outcome.unimplemented, ok):
            problem = self.service_problem = missing.problem
            self._m_unsupported.set(1 if problem else 0)
            if problem:
                log.error(
                    "group %s: %s; delivery.batch is configured, so messages wait (no fallback "
                    "to HandleMessage, nothing is dead-lettered) until the service implements "
                    "it or the group's batch setting is removed",
                    self.name,
                    problem,
                )
            else:
                log.warning("group %s: %s answers HandleMessageBatch again", self.name, target)
            self._on_problem()
        if outcome.protocol_error:
            self._m_protocol_errors.inc()
            self._lines.say(
                logging.WARNING,
                f"protocol error from {target}: {outcome.protocol_error}; its messages go "
                "alone (a batch of several: retried, no attempt counted; alone: counted)",
            )
