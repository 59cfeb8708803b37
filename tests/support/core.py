"""The pure core on a virtual clock (``CoreRig``): the one rig the core's unit tests share.

A ``PartitionSet`` of group ``g`` wired as the group wires it, but with the tests' manual
``Clock`` for its time and timers and a seeded random source, so a test decides every step:
what is fetched (``core.intake``), which emitted message is pushed and what it answers
(``finish_next``), and when time moves (``clock.advance``)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from consumer_proxy.config import CircuitBreakerConfig, DeliveryConfig
from consumer_proxy.core.decision import Decision
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.partitions import Delivery, PartitionSet
from consumer_proxy.flow import Breaker
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.clock import Clock

ACK = Classifier().from_response(handler_pb2.HandleMessageResponse())
"""A plain ack, classified as the push workers classify an empty response."""

WALL_CLOCK_START = 1_000_000.0
"""Epoch seconds to start at when the test needs wall-clock times (tier due times are)."""


class CoreRig:
    """A ``PartitionSet`` whose emitted messages wait in ``ready`` until ``finish_next`` takes one.

    ``tps`` are assigned at offset 0; ``retry_topics`` name the tiers' topics (the
    ``DeliveryConfig`` gives their delays); ``core`` passes any further ``PartitionSet``
    argument (``guard``, ``on_idle``, ``emit_batch``). ``pause_plan`` runs the first pause plan
    as the intake does (it resumes every partition: librdkafka's pause state is unknown)."""

    def __init__(
        self,
        delivery: DeliveryConfig,
        *,
        tps: Sequence[tuple[str, int]] = (("t", 0),),
        retry_topics: Sequence[str] = (),
        breaker: CircuitBreakerConfig | None = None,
        start: float = 0.0,
        pause_plan: bool = False,
        **core: Any,
    ) -> None:
        self.clock = Clock(start)
        self.ready: deque[Delivery] = deque()
        self.breaker = Breaker("g", breaker or CircuitBreakerConfig(), clock=self.clock)
        emit: Callable[[Delivery], None] = self.ready.append
        self.core = PartitionSet(
            "g",
            delivery,
            "g.redrive",
            self.breaker,
            emit=emit,
            schedule=self.clock.call_later,
            rng=random.Random(1),
            retry_topics=retry_topics,
            clock=self.clock,
            **core,
        )
        for topic, partition in tps:
            self.core.assign(topic, partition, 0, "")
        if pause_plan:
            self.core.pause_plan()

    def finish_next(self, result: Classification = ACK) -> tuple[Delivery, Decision | None]:
        """Push the oldest ready message and finish it with ``result`` (the breaker records
        it first, as the push workers do); returns the message and the core's decision."""
        delivery = self.ready.popleft()
        assert self.core.begin(delivery)
        self.breaker.record(result.service_failure, probe=False)
        return delivery, self.core.finish(delivery, result, probe=False)

    def ack(self, n: int) -> None:
        """Push the ``n`` oldest ready messages, each answered with a plain ack."""
        for _ in range(n):
            self.finish_next()
