"""The one factory of a group's real I/O edges: ``RealEdges``.

It builds what ``ports`` describes from the configuration: the DLQ, redrive and retry tier
topics (created when missing), the ``Dispatcher`` (gRPC channels to the service instances,
their health checks started), the ``DeadLetterWriter`` on the process's shared producer, and
the ``Fetcher`` (one consumer, subscribed when the runner starts it) with the consumer's
statistics wired to the group's ``KafkaLink``. The clock is the event loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .config import REVOKE_MARGIN_MS, GroupConfig, KafkaConfig
from .core.outcomes import Classifier
from .dispatcher import Dispatcher
from .dlq import DeadLetterWriter, SharedProducers, ensure_topics_unless_stopped, producer_config
from .fetcher import Fetcher, consumer_config
from .metrics import ProxyMetrics
from .ports import EdgeHooks, Edges
from .tracing import Tracing

BATCH_FETCH_WAIT = "fetch.wait.max.ms"
BATCH_FETCH_WAIT_MS = 20
"""Batch groups' default long-poll of a fetch request (librdkafka's default: 500 ms)."""


def group_consumer_config(
    kafka: KafkaConfig, group: GroupConfig, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The librdkafka settings of ``group``'s consumer (``fetcher.consumer_config`` with the
    group's own additions; ``overrides``: the process's, e.g. the tests' short session), before
    its statistics and error callbacks are attached. The throughput bench's floor reads the
    same settings (``bench/bench_throughput.py``)."""
    added = dict(overrides or {})
    batch = group.delivery.batch
    if batch is not None and batch.mode == "always" and BATCH_FETCH_WAIT not in kafka.client:
        # A paused partition (its backlog at its bound) is resumed while the consumer's
        # fetch request long-polls the group's other (often empty: the redrive topic)
        # partitions; librdkafka's 500 ms default then starves the batch path (measured
        # when a full window paused: 1 partition, 20 ms batches of 50, 200 window: 1,000
        # msg/s at 500 ms, 4,456 at 10 ms). kafka.client overrides it. Not for ``auto``,
        # every group's default, which keeps up without it since a full window no longer
        # pauses (partitions.BACKLOG_WINDOWS): an idle consumer fetches 50 times a second
        # at 20 ms (bench_idle, 10 groups: 2.6% of a core instead of 0.6%, librdkafka's
        # broker thread 22.8 ms/s instead of 1.7).
        added.setdefault(BATCH_FETCH_WAIT, BATCH_FETCH_WAIT_MS)
    return consumer_config(kafka, group.name, added)


class RealEdges:
    """Builds each group's Kafka consumer, gRPC pusher and DLQ writer (``ports.OpenEdges``)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        metrics: ProxyMetrics,
        consumer_overrides: dict[str, Any] | None = None,
        producers: SharedProducers | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        """``producers``: the process's DLQ producers (None: each group a private one);
        ``tracing``: the process's tracing (None: off)."""
        self.kafka = kafka
        self._tracing = tracing
        self._metrics = metrics
        self._consumer_overrides = consumer_overrides or {}
        self._producers = producers

    async def __call__(self, group: GroupConfig, hooks: EdgeHooks) -> Edges | None:
        """The group's edges once its topics exist; None when it stopped first."""
        kafka, metrics, name = self.kafka, self._metrics, group.name
        loop = asyncio.get_running_loop()
        if not await ensure_topics_unless_stopped(kafka, group, hooks.stopping):
            return None
        dispatcher = Dispatcher(
            name,
            group.service,
            Classifier(group.delivery.status_overrides),
            on_ejected=metrics.endpoints_ejected.labels(name).set,
            auto_batch=group.delivery.batch is not None and group.delivery.batch.mode == "auto",
            on_batch_support=lambda counts: metrics.batch_instances(name, counts),
        )
        dispatcher.start()
        producer_conf = producer_config(kafka, group.dlq.write_timeout_ms)
        writer = DeadLetterWriter(
            producer_conf,
            loop,
            group=name,
            metrics=metrics,
            on_change=hooks.health_changed,
            producer=(
                self._producers.get(producer_conf, loop) if self._producers is not None else None
            ),
        )
        conf = group_consumer_config(kafka, group, self._consumer_overrides)
        link = hooks.link
        link.attach(conf)

        def link_changed() -> None:  # the consumer thread
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(hooks.health_changed)

        link.on_change = link_changed
        topics = [*group.topics, group.redrive_topic, *group.retry_topics]
        grace_s = group.delivery.revoke_grace_ms / 1000.0
        fetcher = Fetcher(
            conf,
            topics,
            hooks.listener,
            loop,
            callback_timeout_s=grace_s + REVOKE_MARGIN_MS / 1000.0,
            from_start=[group.redrive_topic, *group.retry_topics],
        )
        fetcher.on_reached = link.confirm
        tracer = self._tracing.tracer(name) if self._tracing is not None else None
        return Edges(fetcher, dispatcher, writer, loop.time, tracer)
