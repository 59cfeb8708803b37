"""The proxy's own health: grpc.health.v1 (overall and per group) and the /readyz verdict.

A group is SERVING once its consumer is up (its first poll returned) and Kafka is reachable,
and NOT_SERVING while its circuit breaker is open or half-open (the service is failing),
while none of its consumer's broker connections is up, or while its DLQ refuses a record
(the dead letter waits and its offset stays uncommitted; the verdict names the DLQ and the
reason, and clears by itself once the record is written). The overall service ``""`` is SERVING
only when every group is; the per-group service name is the group name. /readyz answers from
the same verdicts, so the gRPC and the HTTP probes never disagree.

Kafka reachability is the group consumer's own view, without extra requests to the brokers:
a rebalance callback or a commit that succeeded says "reachable" at once (that is how a new
group becomes ready), librdkafka's "all broker connections are down" error says the opposite
at once, and librdkafka's statistics (``statistics.interval.ms``, 15 s by default for a
consumer) confirm either way, from the connections the group really uses. (Building and
parsing the statistics JSON was most of an idle group's CPU at 1 s, a sixth of it at 5 s.)
Setting ``statistics.interval.ms: 0`` under ``kafka.client`` turns them off, and with them
this check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from confluent_kafka import KafkaError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from .flow import Breaker
from .kafka_log import CONSUMER_STATS_INTERVAL_MS, broker_states

log = logging.getLogger(__name__)

OVERALL = ""
"""The grpc.health.v1 service name of the proxy as a whole."""
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class KafkaLink:
    """Whether one consumer can reach Kafka: its statistics, errors and successful calls."""

    def __init__(self) -> None:
        self.enabled = False
        self.reachable: bool | None = None  # None until the first statistics arrive
        self.detail = "waiting for the first connection to Kafka"
        self.on_change: Callable[[], None] | None = None
        """Called (on the consumer thread) when ``reachable`` changes."""

    def attach(self, conf: dict[str, Any]) -> None:
        """Add the statistics and error callbacks to a consumer configuration (a user's
        interval wins; the log gate chains its own callbacks to these)."""
        conf.setdefault("statistics.interval.ms", CONSUMER_STATS_INTERVAL_MS)
        conf["stats_cb"] = self.on_stats
        conf["error_cb"] = self.on_error
        self.enabled = int(conf["statistics.interval.ms"]) > 0

    def on_stats(self, raw: str) -> None:
        """librdkafka's statistics JSON; runs on the consumer thread, so it only sets fields."""
        states = broker_states(raw)
        if states is None:
            return
        if any(state == "UP" for state in states.values()):
            self._set(True, "connected to Kafka")
        else:
            listed = ", ".join(f"{name} {state}" for name, state in sorted(states.items()))
            self._set(False, f"cannot reach Kafka: no broker connection is up ({listed})")

    def on_error(self, err: KafkaError) -> None:
        """librdkafka's ``error_cb``: "all broker connections are down" makes it unreachable."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._set(False, f"cannot reach Kafka: {err.str()}")

    def confirm(self) -> None:
        """A call that needs a broker succeeded (a rebalance callback, a commit)."""
        if self.reachable is not True:
            self._set(True, "connected to Kafka")

    def _set(self, up: bool, detail: str) -> None:
        self.detail = detail
        changed = up != self.reachable
        self.reachable = up
        if changed and self.on_change is not None:
            self.on_change()


class RefusalSource(Protocol):
    """A DLQ writer as health sees it (``dlq.DeadLetterWriter``)."""

    def refusal(self) -> str | None:
        """Why the DLQ refuses records right now, or None while every write goes through."""


class GroupView(Protocol):
    """What health needs to know about a running group (GroupRunner provides it)."""

    @property
    def name(self) -> str:
        """The group name (also its health service name)."""

    @property
    def started(self) -> asyncio.Event:
        """Set once the group's consumer has polled."""

    @property
    def breaker(self) -> Breaker:
        """The group's circuit breaker."""

    @property
    def kafka_link(self) -> KafkaLink:
        """The group's consumer's view of Kafka."""

    @property
    def writer(self) -> RefusalSource | None:
        """The group's DLQ writer, once started."""


def group_verdict(group: GroupView) -> tuple[bool, str]:
    """(serving, why) for one group."""
    if not group.started.is_set():
        return False, "starting: the consumer has not polled Kafka yet"
    running = getattr(group, "run_problem", "")  # stopping (failed?), or commits failing
    if running:
        return False, running
    problem = getattr(group, "service_problem", "")  # e.g. the batch method is missing
    held = getattr(group, "guard_problem", "")  # the dead-letter guard holds
    if held:
        return False, held
    if group.breaker.is_open:
        return False, f"circuit {group.breaker.state}: the service is failing" + (
            f": {problem}" if problem else ""
        )
    if problem:
        return False, problem
    link = group.kafka_link
    if link.enabled and link.reachable is not True:
        return False, link.detail
    refusal = group.writer.refusal() if group.writer is not None else None
    if refusal is not None:
        return False, refusal
    detail = getattr(group, "push_detail", "")  # delivery.batch auto: batch or unary
    return True, "consumer up, Kafka reachable, circuit closed" + (f"; {detail}" if detail else "")


def pod_verdict(group: GroupView) -> tuple[bool, str]:
    """(up, why) for one group, as far as the pod itself goes: its consumer polled, it runs
    (not stopping, commits not failing for a minute) and Kafka is reachable. What other teams'
    services do (breaker, dead-letter guard, a missing batch method, a DLQ that refuses)
    is not the pod's: a rollout must not wait for it (Kubernetes' readiness probe)."""
    if not group.started.is_set():
        return False, "starting: the consumer has not polled Kafka yet"
    running = getattr(group, "run_problem", "")
    if running:
        return False, running
    link = group.kafka_link
    if link.enabled and link.reachable is not True:
        return False, link.detail
    return True, "consumer up, Kafka reachable"


class ProxyHealth:
    """Verdicts for every group, published to grpc.health.v1 when a port is configured.

    ``changed()`` is the hook the groups call on every transition (consumer up, Kafka reachable
    or not, breaker opened or closed, DLQ refusing or accepting, batch method missing); every
    verdict is also re-read every ``interval_s``, a safety net (re-reading 40 groups twice a
    second was a tenth of an idle proxy's CPU).
    """

    def __init__(self, groups: Sequence[GroupView], interval_s: float = 5.0) -> None:
        self._groups = list(groups)
        self._interval_s = interval_s
        self._changed = asyncio.Event()
        self._stopping = False
        self._published: dict[str, bool] = {}
        self._server: grpc.aio.Server | None = None
        self._servicer: health_aio.HealthServicer | None = None
        self._port: int | None = None

    # -- verdicts ------------------------------------------------------------------------

    def verdicts(self) -> dict[str, tuple[bool, str]]:
        """{group name: (serving, why)}."""
        if self._stopping:
            return {g.name: (False, "shutting down") for g in self._groups}
        return {g.name: group_verdict(g) for g in self._groups}

    def ready(self) -> tuple[bool, str]:
        """The /readyz answer: ready when every group is serving; else what is not."""
        verdicts = self.verdicts()
        failing = [f"{name}: {why}" for name, (ok, why) in verdicts.items() if not ok]
        if failing:
            return False, "; ".join(failing)
        pushing = [
            f"{g.name}: {detail}" for g in self._groups if (detail := getattr(g, "push_detail", ""))
        ]
        return True, "; ".join(["ready", *pushing])

    def pod_ready(self) -> tuple[bool, str]:
        """The /readyz/pod answer (the chart's readiness probe): every group's consumer is up
        and reaches Kafka; what the services behind the groups do is /readyz's to say."""
        if self._stopping:
            return False, "shutting down"
        failing = [
            f"{g.name}: {why}" for g in self._groups for ok, why in [pod_verdict(g)] if not ok
        ]
        return (False, "; ".join(failing)) if failing else (True, "pod ready")

    def changed(self) -> None:
        """A group's state changed: publish soon (callable from the event loop only)."""
        self._changed.set()

    def shutting_down(self) -> None:
        """Report NOT_SERVING from now on (the proxy is draining)."""
        self._stopping = True
        self._changed.set()

    # -- grpc.health.v1 ------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound gRPC port (useful with port 0)."""
        if self._port is None:
            raise RuntimeError("the gRPC health service is not started")
        return self._port

    async def start(self, host: str, port: int) -> None:
        """Serve grpc.health.v1 on host:port; every service starts NOT_SERVING."""
        server = grpc.aio.server()
        servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} for the gRPC health service")
        for name in (OVERALL, *(g.name for g in self._groups)):
            await servicer.set(name, _NOT_SERVING)
        await server.start()
        self._server, self._servicer, self._port = server, servicer, bound
        log.info("serving grpc.health.v1 on %s:%d", host, bound)

    async def publish(self) -> None:
        """Push every verdict that changed to the health service, and log it."""
        verdicts = self.verdicts()
        overall = all(ok for ok, _ in verdicts.values())
        why = "every group is serving" if overall else "a group is not serving"
        for name, (ok, detail) in [*verdicts.items(), (OVERALL, (overall, why))]:
            previous = self._published.get(name)
            if previous == ok:
                continue
            self._published[name] = ok
            if name != OVERALL and previous is not None:
                log.log(
                    logging.INFO if ok else logging.WARNING,
                    "group %s: %s (%s)",
                    name,
                    "SERVING" if ok else "NOT_SERVING",
                    detail,
                )
            if self._servicer is not None:
                await self._servicer.set(name, _SERVING if ok else _NOT_SERVING)

    async def run(self) -> None:
        """Publish verdicts until cancelled: at once after ``changed()``, else periodically."""
        while True:
            self._changed.clear()
            try:
                await self.publish()
            except Exception:
                # Health reporting must never take delivery down; the next round retries.
                log.exception("publishing health failed")
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # arrives as the event fires (shutdown does both), and this loop then never ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._changed.wait()

    async def close(self) -> None:
        """Answer NOT_SERVING to the last probes and stop the gRPC server (idempotent)."""
        server, self._server = self._server, None
        if server is not None and self._servicer is not None:
            await self._servicer.enter_graceful_shutdown()
            await server.stop(1.0)
