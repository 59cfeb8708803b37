"""Pushing to the service: one grpc.aio channel per instance, power-of-two-choices selection.

Selection takes two random instances in rotation and picks the one with fewer calls
outstanding, so load follows capacity and no single instance runs hot. A ``dns:///`` target is
one channel with round-robin balancing.

Endpoint health, so that one bad instance does not slow the group:

- Passive: an instance whose calls fail at the service level ``EJECT_AFTER_FAILURES`` times in
  a row is ejected for a while (doubling with each ejection up to a limit, reset by a success).
- Active: with several instances, each is checked with ``grpc.health.v1`` every
  ``health_interval_s``; NOT_SERVING (or two failed checks in a row) ejects it. An ejected
  instance is checked at once and then every ``ejected_check_interval_s``, and returns when
  its check says SERVING. After a passive ejection that needs more: either the checks saw it
  down since (it crashed, and is back), or its ejection time has passed (a health service
  that says SERVING while calls fail is not believed before then). An instance without a
  health service returns when its ejection time has passed.
- The last instance in rotation is never ejected: a full outage is the circuit breaker's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import ServiceConfig, TlsConfig
from .core.batching import BatchOutcome, classify_batch, classify_failed_call
from .core.outcomes import Classification, Classifier
from .proto.v1 import handler_pb2, handler_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # the proxy owns retries (attempt counting, backoff, DLQ)
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # gRPC's default reconnect backoff grows to 120 s; a returning instance should be back in
    # use within about a second (a refused connect to a dead instance costs next to nothing).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
SERVICE_NAME = "consumerproxy.v1.MessageHandler"
"""The health-check service name (the server's overall status, "", when it does not know it)."""
BATCH_METHOD = f"/{SERVICE_NAME}/HandleMessageBatch"
EJECT_AFTER_FAILURES = 5
EJECT_BASE_S = 2.0
EJECT_MAX_S = 60.0
HEALTH_INTERVAL_S = 5.0
EJECTED_CHECK_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
FAILED_CHECKS_TO_EJECT = 2  # a check can time out under load; an unreachable instance fails on

Health = Literal["serving", "not_serving", "unreachable", "unsupported"]


@dataclass(eq=False)
class Endpoint:
    """One service instance (or one balanced dns:/// target)."""

    target: str
    channel: aio.Channel
    stub: handler_pb2_grpc.MessageHandlerStub
    health_stub: health_pb2_grpc.HealthStub | None = None
    outstanding: int = 0
    consecutive_failures: int = 0
    ejections: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    serving: bool | None = None  # the last health verdict since the last ejection, if any
    seen_down: bool = False  # a check failed since the last ejection: SERVING means recovered
    health_supported: bool = True
    health_service: str = SERVICE_NAME
    failed_checks: int = 0
    next_check: float = 0.0
    calls: int = field(default=0)

    def available(self, now: float | None = None) -> bool:
        """In rotation (not ejected)."""
        return not self.ejected


def _read(path: object) -> bytes:
    with open(str(path), "rb") as f:
        return f.read()


def _credentials(tls: TlsConfig) -> tuple[grpc.ChannelCredentials, list[tuple[str, int | str]]]:
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file) if tls.ca_file else None,
        private_key=_read(tls.key_file) if tls.key_file else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file else None,
    )
    options: list[tuple[str, int | str]] = []
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return creds, options


class Dispatcher:
    """Calls ``HandleMessage`` on the group's instances and classifies each result.

    ``start()`` begins the active health checks (with more than one instance); ``close()``
    stops them and closes every channel. ``on_ejected(n)`` runs whenever the number of
    instances out of rotation changes.
    """

    def __init__(
        self,
        group: str,
        service: ServiceConfig,
        classifier: Classifier,
        *,
        on_ejected: Callable[[int], None] | None = None,
        health_interval_s: float = HEALTH_INTERVAL_S,
        ejected_check_interval_s: float = EJECTED_CHECK_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self._group = group
        self._timeout_s = service.timeout_ms / 1000.0
        self._classifier = classifier
        self._on_ejected = on_ejected
        self._health_interval_s = health_interval_s
        self._ejected_interval_s = ejected_check_interval_s
        self._health_timeout_s = health_timeout_s
        self._rng = random.Random()
        # Per endpoint: a HandleMessageBatch callable that sends a request already encoded
        # by the shell (bytes, no protobuf object in between).
        self._batch_calls: dict[Endpoint, aio.UnaryUnaryMultiCallable[bytes, object]] = {}
        self._n_ejected = 0
        self._health_task: asyncio.Task[None] | None = None
        self._health_wake: asyncio.Event | None = None
        options = list(_CHANNEL_OPTIONS)
        creds = None
        if service.tls is not None:
            creds, extra = _credentials(service.tls)
            options += extra
        self.endpoints: list[Endpoint] = []
        for target in service.endpoints:
            chan_options = list(options)
            if target.startswith("dns:"):
                chan_options.append(("grpc.lb_policy_name", "round_robin"))
            channel = (
                aio.secure_channel(target, creds, options=chan_options)
                if creds is not None
                else aio.insecure_channel(target, options=chan_options)
            )
            self.endpoints.append(
                Endpoint(
                    target,
                    channel,
                    handler_pb2_grpc.MessageHandlerStub(channel),
                    health_pb2_grpc.HealthStub(channel),
                )
            )

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the active health checks (needs a running loop; a no-op for one instance)."""
        if self._health_task is not None or len(self.endpoints) < 2:
            return
        self._health_wake = asyncio.Event()
        self._health_task = asyncio.get_running_loop().create_task(
            self._health_loop(), name=f"{self._group}:health"
        )
        self._health_task.add_done_callback(self._health_ended)

    def _health_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "group %s: endpoint health checks stopped; ejected instances now return on "
                "their ejection time only",
                self._group,
                exc_info=task.exception(),
            )

    async def close(self) -> None:
        """Stop the health checks and close every channel."""
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for endpoint in self.endpoints:
            await endpoint.channel.close()

    @property
    def _checking(self) -> bool:
        return self._health_task is not None and not self._health_task.done()

    # -- selection and pushing -----------------------------------------------------------

    @property
    def ejected(self) -> int:
        """Instances currently out of rotation."""
        return self._n_ejected

    def pick(self) -> Endpoint:
        """Power of two choices over the instances in rotation (all of them if none is)."""
        endpoints = self.endpoints
        if len(endpoints) == 1:
            return endpoints[0]
        if self._n_ejected:
            self._return_due(time.monotonic())
            live = [e for e in endpoints if not e.ejected] or endpoints
        else:
            live = endpoints
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if a.outstanding <= b.outstanding else b

    async def push(
        self, request: handler_pb2.HandleMessageRequest, endpoint: Endpoint
    ) -> Classification:
        """One call; every failure becomes a classification, never an exception."""
        endpoint.outstanding += 1
        endpoint.calls += 1
        try:
            response = await endpoint.stub.HandleMessage(request, timeout=self._timeout_s)
        except aio.AioRpcError as exc:
            result = self._classifier.from_status(exc.code(), exc.details())
        else:
            if response is None:
                # grpc.aio hands back None (and logs) when an OK response does not decode as
                # a HandleMessageResponse: a broken service answer, retried like INTERNAL.
                result = self._classifier.from_status(
                    grpc.StatusCode.INTERNAL, "the service's response could not be decoded"
                )
            else:
                result = self._classifier.from_response(response)
        finally:
            endpoint.outstanding -= 1
        self._observe(endpoint, result)
        return result

    async def push_batch(self, payload: bytes, count: int, endpoint: Endpoint) -> BatchOutcome:
        """One ``HandleMessageBatch`` call carrying ``count`` messages (``payload`` is the
        encoded ``HandleMessageBatchRequest``); never raises for a failed call. Endpoint
        ejection hears one result per call, like the breaker."""
        call = self._batch_calls.get(endpoint)
        if call is None:
            call = endpoint.channel.unary_unary(
                BATCH_METHOD,
                request_serializer=None,  # bytes as they are
                response_deserializer=handler_pb2.HandleMessageBatchResponse.FromString,
            )
            self._batch_calls[endpoint] = call
        endpoint.outstanding += 1
        endpoint.calls += 1
        try:
            response = await call(payload, timeout=self._timeout_s)
        except aio.AioRpcError as exc:
            outcome = classify_failed_call(self._classifier, exc.code(), exc.details(), count)
        else:
            outcome = classify_batch(
                self._classifier,
                response if isinstance(response, handler_pb2.HandleMessageBatchResponse) else None,
                count,
            )
        finally:
            endpoint.outstanding -= 1
        self._observe(endpoint, outcome.call)
        return outcome

    def _observe(self, endpoint: Endpoint, result: Classification) -> None:
        if not result.service_failure:
            endpoint.consecutive_failures = 0
            endpoint.ejections = 0
            return
        endpoint.consecutive_failures += 1
        if endpoint.consecutive_failures < EJECT_AFTER_FAILURES or endpoint.ejected:
            return
        duration = min(EJECT_MAX_S, EJECT_BASE_S * 2**endpoint.ejections)
        if self._eject(
            endpoint, duration, f"{endpoint.consecutive_failures} {result.status} in a row"
        ):
            endpoint.ejections += 1
            endpoint.consecutive_failures = 0

    # -- ejection and return -------------------------------------------------------------

    def _eject(self, endpoint: Endpoint, duration_s: float, reason: str) -> bool:
        """Take ``endpoint`` out of rotation for at least ``duration_s``; False when it is the
        last one in rotation (never ejected)."""
        if not any(e is not endpoint and not e.ejected for e in self.endpoints):
            return False
        now = time.monotonic()
        endpoint.ejected = True
        endpoint.ejected_until = now + duration_s
        endpoint.seen_down = duration_s == 0  # ejected by a failed check: it was seen down
        if duration_s > 0:
            endpoint.serving = None  # a check after this ejection decides the return
        endpoint.next_check = now  # check it at once: is it down, or does it only fail calls?
        self._n_ejected += 1
        log.warning(
            "group %s: instance %s ejected (%s)%s; %d of %d out of rotation",
            self._group,
            endpoint.target,
            reason,
            f" for at least {duration_s:.0f}s" if duration_s > 0 else "",
            self._n_ejected,
            len(self.endpoints),
        )
        self._ejected_changed()
        return True

    def _return(self, endpoint: Endpoint, reason: str) -> None:
        endpoint.ejected = False
        endpoint.failed_checks = 0
        endpoint.next_check = time.monotonic() + self._health_interval_s
        self._n_ejected -= 1
        log.warning(
            "group %s: instance %s back in rotation (%s); %d of %d out of rotation",
            self._group,
            endpoint.target,
            reason,
            self._n_ejected,
            len(self.endpoints),
        )
        self._ejected_changed()

    def _ejected_changed(self) -> None:
        if self._on_ejected is not None:
            self._on_ejected(self._n_ejected)
        if self._health_wake is not None:
            self._health_wake.set()  # the loop re-plans its next checks

    def _return_due(self, now: float) -> None:
        """Return instances whose ejection time passed and that the health checks allow."""
        for endpoint in self.endpoints:
            if not endpoint.ejected:
                continue
            if endpoint.serving is True and (endpoint.seen_down or now >= endpoint.ejected_until):
                self._return(endpoint, "health check SERVING")
            elif (
                endpoint.serving is None
                and now >= endpoint.ejected_until
                and (not endpoint.health_supported or not self._checking)
            ):
                self._return(endpoint, "ejection time over")

    # -- active health checks ------------------------------------------------------------

    async def check(self, endpoint: Endpoint) -> Health:
        """One ``grpc.health.v1`` Check of ``endpoint``."""
        assert endpoint.health_stub is not None
        request = health_pb2.HealthCheckRequest(service=endpoint.health_service)
        try:
            response = await endpoint.health_stub.Check(request, timeout=self._health_timeout_s)
        except aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND and endpoint.health_service:
                endpoint.health_service = ""  # no status for the handler: the server's status
                return await self.check(endpoint)
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return "unsupported"
            return "unreachable"
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return "serving"
        return "not_serving"

    def _apply_health(self, endpoint: Endpoint, health: Health) -> None:
        if health == "unsupported":
            if endpoint.health_supported:
                log.info(
                    "group %s: instance %s has no grpc.health.v1 service; its call results "
                    "alone decide its ejection",
                    self._group,
                    endpoint.target,
                )
            endpoint.health_supported = False
            endpoint.serving = None
            return
        endpoint.health_supported = True
        endpoint.serving = health == "serving"
        endpoint.failed_checks = 0 if endpoint.serving else endpoint.failed_checks + 1
        if endpoint.ejected:
            endpoint.seen_down = endpoint.seen_down or not endpoint.serving
            return  # _return_due decides
        if health == "not_serving":
            self._eject(endpoint, 0.0, "health check NOT_SERVING")
        elif health == "unreachable" and endpoint.failed_checks >= FAILED_CHECKS_TO_EJECT:
            self._eject(endpoint, 0.0, f"{endpoint.failed_checks} health checks failed")

    async def _health_loop(self) -> None:
        assert self._health_wake is not None
        wake = self._health_wake
        while True:
            now = time.monotonic()
            due = [e for e in self.endpoints if e.next_check <= now]
            if due:
                results = await asyncio.gather(*(self.check(e) for e in due))
                for endpoint, health in zip(due, results, strict=True):
                    self._apply_health(endpoint, health)
                    interval = (
                        self._ejected_interval_s if endpoint.ejected else (self._health_interval_s)
                    )
                    endpoint.next_check = max(endpoint.next_check, time.monotonic() + interval)
                self._return_due(time.monotonic())
            wake.clear()
            delay = min(e.next_check for e in self.endpoints) - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):  # not wait_for: see Breaker.acquire
                        await wake.wait()
