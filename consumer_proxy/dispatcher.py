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

These decisions are :mod:`consumer_proxy.core.ejection`'s (pure, on an injected clock); this
module makes the calls and the checks it plans, and logs what changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import ServiceConfig, TlsConfig
from .core.batching import BatchOutcome, classify_batch, classify_failed_call
from .core.ejection import (
    EJECTED_CHECK_INTERVAL_S,
    HEALTH_INTERVAL_S,
    Change,
    Ejection,
    Instance,
    Verdict,
)
from .core.heartbeat import CallWatch, Limits, expiry_result, no_result
from .core.outcomes import Classification, Classifier
from .core.support import BatchSupport, Learnt
from .core.tracecontext import Metadata
from .kafka_log import KafkaLogGate
from .proto.v1 import handler_pb2

log = logging.getLogger(__name__)

Response = handler_pb2.HandleMessageResponse
StreamEvent = handler_pb2.HandleMessageStreamEvent
BatchResponse = handler_pb2.HandleMessageBatchResponse
_M = TypeVar("_M", Response, StreamEvent, BatchResponse)

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
UNARY_METHOD = f"/{SERVICE_NAME}/HandleMessage"
STREAM_METHOD = f"/{SERVICE_NAME}/HandleMessageStream"
HEALTH_TIMEOUT_S = 1.0


@dataclass(eq=False)
class Endpoint:
    """One service instance (or one balanced dns:/// target).

    ``state`` is its ejection state, which :class:`~consumer_proxy.core.ejection.Ejection`
    keeps; ``ejected`` and ``serving`` read it.
    """

    index: int
    target: str
    channel: aio.Channel
    handle: aio.UnaryUnaryMultiCallable[handler_pb2.HandleMessageRequest, bytes]
    """``HandleMessage``, its answer as bytes (decoded by the dispatcher: see ``decoded``)."""
    handle_stream: aio.UnaryStreamMultiCallable[handler_pb2.HandleMessageStreamRequest, bytes]
    """``HandleMessageStream``, each event as bytes."""
    health_stub: health_pb2_grpc.HealthStub
    state: Instance
    health_service: str = SERVICE_NAME
    outstanding: int = 0
    calls: int = 0
    latency_s: float = 0.0
    """A moving average of its calls' durations (unary and batch calls; the console's)."""

    def timed(self, started: float) -> None:
        """A call that began at ``started`` (time.monotonic) ended now."""
        took = time.monotonic() - started
        self.latency_s = (
            took if not self.latency_s else self.latency_s + 0.1 * (took - self.latency_s)
        )

    @property
    def ejected(self) -> bool:
        """Out of rotation."""
        return self.state.ejected

    @property
    def serving(self) -> bool | None:
        """The last health verdict since the last ejection, if any."""
        return self.state.serving


def _call_metadata(metadata: Metadata | None) -> aio.Metadata | None:
    """A call's metadata (the trace context) as grpc.aio's own object: given anything else,
    grpc.aio checks it against ``typing.Sequence`` (an ABC check through ``typing``, several
    µs cold) before making this object of it anyway."""
    return aio.Metadata(*metadata) if metadata else None


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


def undecodable(classifier: Classifier) -> Classification:
    """An answer (a unary response, a long call's event) that does not decode: grpc.aio hands
    back None for it (and logs). A broken service answer, retried like INTERNAL (counted)."""
    return classifier.from_status(
        grpc.StatusCode.INTERNAL, "the service's response could not be decoded"
    )


async def read_stream(
    read: Callable[[], Awaitable[Any]],
    watch: CallWatch,
    on_heartbeat: Callable[[float], None],
    classifier: Classifier,
) -> Classification:
    """A ``HandleMessageStream`` call's events (``read``: the next one, or ``aio.EOF``) until
    its result or its expiry by ``watch`` (on the event loop's clock): each heartbeat is told
    to the watch (its gap to ``on_heartbeat``) and moves the expiry. A failed call's
    ``AioRpcError`` goes to the caller."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(watch.due()[0]) as deadline:
            while True:
                event = await read()
                if event is aio.EOF:
                    return no_result(classifier)
                if event is None:
                    return undecodable(classifier)
                if event.HasField("result"):
                    return classifier.from_response(event.result)
                on_heartbeat(watch.heard(loop.time(), event.heartbeat.progress))
                deadline.reschedule(watch.due()[0])
    except TimeoutError:
        return expiry_result(watch.due()[1], watch.limits, classifier)


class Dispatcher:
    """Calls ``HandleMessage`` on the group's instances and classifies each result.

    ``start()`` begins the active health checks (with more than one instance); ``close()``
    stops them and closes every channel. ``on_ejected(n)`` runs whenever the number of
    instances out of rotation changes. Which instances are in rotation, and when each is
    checked, is :class:`~consumer_proxy.core.ejection.Ejection`'s decision; this class runs
    the calls and checks, and logs what changed.
    """

    def __init__(
        self,
        group: str,
        service: ServiceConfig,
        classifier: Classifier,
        *,
        on_ejected: Callable[[int], None] | None = None,
        auto_batch: bool = False,
        on_batch_support: Callable[[dict[str, int]], None] | None = None,
        health_interval_s: float = HEALTH_INTERVAL_S,
        ejected_check_interval_s: float = EJECTED_CHECK_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self._group = group
        # A service whose every answer is broken would log a line per call.
        self._lines = KafkaLogGate(log, f"group {group}")
        self._timeout_s = service.timeout_ms / 1000.0
        self._classifier = classifier
        self._on_ejected = on_ejected
        self._health_timeout_s = health_timeout_s
        self._rng = random.Random()
        # Per endpoint: a HandleMessageBatch callable that sends a request already encoded
        # by the shell (bytes, no protobuf object in between).
        self._batch_calls: dict[Endpoint, aio.UnaryUnaryMultiCallable[bytes, object]] = {}
        self._ejection = Ejection(
            len(service.endpoints),
            time.monotonic,
            health_interval_s=health_interval_s,
            ejected_check_interval_s=ejected_check_interval_s,
        )
        self._health_task: asyncio.Task[None] | None = None
        self._health_wake: asyncio.Event | None = None
        # delivery.batch auto: which instances serve HandleMessageBatch (None: not asked;
        # every batch call is a batch, as delivery.batch always wants).
        self._support = BatchSupport(len(service.endpoints), time.monotonic) if auto_batch else None
        self._on_batch_support = on_batch_support
        self._watches: list[asyncio.Task[None]] = []
        options = list(_CHANNEL_OPTIONS)
        creds = None
        if service.tls is not None:
            creds, extra = _credentials(service.tls)
            options += extra
        self.endpoints: list[Endpoint] = []
        for index, target in enumerate(service.endpoints):
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
                    index,
                    target,
                    channel,
                    channel.unary_unary(
                        UNARY_METHOD,
                        request_serializer=handler_pb2.HandleMessageRequest.SerializeToString,
                        response_deserializer=None,  # bytes: decoded by ``decoded``
                    ),
                    channel.unary_stream(
                        STREAM_METHOD,
                        request_serializer=handler_pb2.HandleMessageStreamRequest.SerializeToString,
                        response_deserializer=None,
                    ),
                    health_pb2_grpc.HealthStub(channel),
                    self._ejection.instances[index],
                )
            )

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the active health checks (needs a running loop; a no-op for one instance)
        and, with ``auto_batch``, the watch on each channel's connection."""
        if self._support is not None and not self._watches:
            loop = asyncio.get_running_loop()
            self._watches = [
                loop.create_task(self._watch(e), name=f"{self._group}:watch-{e.index}")
                for e in self.endpoints
            ]
            self._report_support()
        if self._health_task is not None or len(self.endpoints) < 2:
            return
        self._health_wake = asyncio.Event()
        self._health_task = asyncio.get_running_loop().create_task(
            self._health_loop(), name=f"{self._group}:health"
        )
        self._health_task.add_done_callback(self._health_ended)
        self._ejection.checking = True

    def _health_ended(self, task: asyncio.Task[None]) -> None:
        self._ejection.checking = False
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "group %s: endpoint health checks stopped; ejected instances now return on "
                "their ejection time only",
                self._group,
                exc_info=task.exception(),
            )

    async def close(self) -> None:
        """Stop the health checks and channel watches, and close every channel."""
        task, self._health_task = self._health_task, None
        watches, self._watches = self._watches, []
        for t in [*watches, *([task] if task is not None else [])]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for endpoint in self.endpoints:
            await endpoint.channel.close()

    # -- selection and pushing -----------------------------------------------------------

    @property
    def ejected(self) -> int:
        """Instances currently out of rotation."""
        return self._ejection.ejected

    def pick(self) -> Endpoint:
        """Power of two choices over the instances in rotation."""
        endpoints = self.endpoints
        if len(endpoints) == 1:
            return endpoints[0]
        ejection = self._ejection
        if ejection.ejected:
            returned = ejection.return_due()
            if returned:
                self._changed(*returned)
            live = ejection.live()
            if len(live) == 1:
                return endpoints[live[0]]
            i, j = self._rng.sample(live, 2)
            a, b = endpoints[i], endpoints[j]
        else:
            a, b = self._rng.sample(endpoints, 2)
        return a if a.outstanding <= b.outstanding else b

    async def push(
        self,
        request: handler_pb2.HandleMessageRequest,
        endpoint: Endpoint,
        metadata: Metadata | None = None,
    ) -> Classification:
        """One call; every failure becomes a classification, never an exception.
        ``metadata``: the trace context the service continues (tracing on)."""
        endpoint.outstanding += 1
        endpoint.calls += 1
        started = time.monotonic()
        try:
            answer = await endpoint.handle(
                request, timeout=self._timeout_s, metadata=_call_metadata(metadata)
            )
        except aio.AioRpcError as exc:
            result = self._classifier.from_status(exc.code(), exc.details())
        else:
            response = self.decoded(Response, answer, endpoint, "HandleMessage")
            if response is None:
                result = undecodable(self._classifier)
            else:
                result = self._classifier.from_response(response)
        finally:
            endpoint.outstanding -= 1
            endpoint.timed(started)
        change = self._ejection.observe(endpoint.index, result.service_failure, result.status)
        if change is not None:
            self._changed(change)
        return result

    def batches(self, endpoint: Endpoint) -> bool:
        """Whether the next call to ``endpoint`` is a batch (always, unless ``auto_batch``
        found that it does not serve ``HandleMessageBatch``)."""
        return self._support is None or self._support.batches(endpoint.index)

    def instances(self) -> list[dict[str, Any]]:
        """Each instance as the console shows it: target, in rotation or not, its last health
        verdict, calls under way and made, and its latency."""
        return [
            {
                "target": e.target,
                "ejected": e.ejected,
                "serving": e.serving,
                "in_flight": e.outstanding,
                "calls": e.calls,
                "latency_ms": round(e.latency_s * 1000, 1),
            }
            for e in self.endpoints
        ]

    def batch_support(self) -> str:
        """What ``auto_batch`` knows of the instances, for /readyz ('' without it)."""
        support = self._support
        if support is None:
            return ""
        parts = []
        for mode, label in (("batch", "HandleMessageBatch"), ("unary", "HandleMessage")):
            targets = [e.target for e in self.endpoints if support.modes[e.index] == mode]
            if targets:
                parts.append(f"{label} to {', '.join(targets)}")
        unknown = support.counts()["unknown"]
        if unknown:
            parts.append(f"{unknown} instance{'s' if unknown > 1 else ''} not asked yet")
        return "push: " + "; ".join(parts)

    async def push_stream(
        self,
        request: handler_pb2.HandleMessageStreamRequest,
        endpoint: Endpoint,
        watch: CallWatch,
        on_heartbeat: Callable[[float], None],
        metadata: Metadata | None = None,
    ) -> Classification:
        """One ``HandleMessageStream`` call (``delivery.long_running``): heartbeats keep it
        alive until its result; never raises for a failed call. ``watch`` (the core's) says
        when it expires: no heartbeat in time, or the cap; the call is then cancelled (the
        service sees the cancellation) and the expiry classified by the core. Each
        heartbeat's gap goes to ``on_heartbeat``. Times are the event loop's clock."""
        limits: Limits = watch.limits
        endpoint.outstanding += 1
        endpoint.calls += 1
        # gRPC's own deadline is a backstop only (the watch ends the call first).
        call = endpoint.handle_stream(
            request, timeout=limits.max_processing_s + 30, metadata=_call_metadata(metadata)
        )
        decoded = self.decoded

        async def read() -> Any:
            event = await call.read()
            if event is aio.EOF:
                return event
            return decoded(StreamEvent, event, endpoint, "HandleMessageStream")

        try:
            result = await read_stream(read, watch, on_heartbeat, self._classifier)
        except aio.AioRpcError as exc:
            result = self._classifier.from_status(exc.code(), exc.details())
        finally:
            endpoint.outstanding -= 1
            if not call.done():
                call.cancel()  # expired, or this task was cancelled: the service sees it
        change = self._ejection.observe(endpoint.index, result.service_failure, result.status)
        if change is not None:
            self._changed(change)
        return result

    async def push_batch(
        self, payload: bytes, count: int, endpoint: Endpoint, metadata: Metadata | None = None
    ) -> BatchOutcome:
        """One ``HandleMessageBatch`` call carrying ``count`` messages (``payload`` is the
        encoded ``HandleMessageBatchRequest``); never raises for a failed call. Endpoint
        ejection hears one result per call, like the breaker. With ``auto_batch`` the answer
        also tells whether the instance serves batches, and an UNIMPLEMENTED answer is no
        failure of the instance: the caller pushes the batch again, unary."""
        call = self._batch_calls.get(endpoint)
        if call is None:
            call = endpoint.channel.unary_unary(
                BATCH_METHOD,
                request_serializer=None,  # bytes as they are
                response_deserializer=None,  # bytes: decoded by ``decoded``
            )
            self._batch_calls[endpoint] = call
        endpoint.outstanding += 1
        endpoint.calls += 1
        status = "OK"
        started = time.monotonic()
        try:
            response = await call(
                payload, timeout=self._timeout_s, metadata=_call_metadata(metadata)
            )
        except aio.AioRpcError as exc:
            status = exc.code().name
            outcome = classify_failed_call(self._classifier, exc.code(), exc.details(), count)
        else:
            outcome = classify_batch(
                self._classifier,
                self.decoded(BatchResponse, response, endpoint, "HandleMessageBatch"),
                count,
            )
        finally:
            endpoint.outstanding -= 1
            endpoint.timed(started)
        if self._support is not None:
            learnt = self._support.answered(endpoint.index, status)
            if learnt is not None:
                self._learnt(learnt)
            if outcome.unimplemented:
                return outcome  # not the instance's failure: it serves HandleMessage
        call_result = outcome.call
        change = self._ejection.observe(
            endpoint.index, call_result.service_failure, call_result.status
        )
        if change is not None:
            self._changed(change)
        return outcome

    def decoded(self, kind: type[_M], data: Any, endpoint: Endpoint, method: str) -> _M | None:
        """A service's answer (bytes as received) decoded as ``kind``; None when it does not
        decode (retried like INTERNAL: ``undecodable``), said once a minute with the repeats
        counted. (gRPC's own decoding would log a traceback per answer.)"""
        try:
            return kind.FromString(data)
        except (DecodeError, TypeError) as exc:
            self._lines.say(
                logging.WARNING,
                f"{endpoint.target} answered {method} with bytes that do not decode "
                f"({str(exc)[:200]}); retried like INTERNAL",
            )
            return None

    def _learnt(self, learnt: Learnt) -> None:
        target = self.endpoints[learnt.index].target
        if learnt.mode == "batch":
            log.info(
                "group %s: instance %s %s: batches from now on", self._group, target, learnt.reason
            )
        else:
            log.warning(
                "group %s: instance %s %s: unary calls (HandleMessage) to it from now on; it "
                "is asked again when it disconnects, and every minute%s",
                self._group,
                target,
                learnt.reason,
                "" if learnt.before == "unknown" else " (it served batches before)",
            )
        self._report_support()

    def _report_support(self) -> None:
        if self._support is not None and self._on_batch_support is not None:
            self._on_batch_support(self._support.counts())

    async def _watch(self, endpoint: Endpoint) -> None:
        """Tell ``auto_batch`` each time ``endpoint``'s channel loses its connection: the
        instance stopped, and may come back as a build that serves other methods."""
        assert self._support is not None
        support = self._support
        channel = endpoint.channel
        state = channel.get_state(try_to_connect=False)
        while True:
            await channel.wait_for_state_change(state)
            was, state = state, channel.get_state(try_to_connect=False)
            if was != grpc.ChannelConnectivity.READY or state == was:
                continue
            before = support.modes[endpoint.index]
            support.disconnected(endpoint.index)
            if before != support.modes[endpoint.index]:
                log.info(
                    "group %s: instance %s disconnected; its next call asks for "
                    "HandleMessageBatch again",
                    self._group,
                    endpoint.target,
                )
                self._report_support()

    def _changed(self, *changes: Change) -> None:
        """Log each change of the rotation, report the count, and wake the health loop."""
        for change in changes:
            target = self.endpoints[change.index].target
            if change.ejected:
                log.warning(
                    "group %s: instance %s ejected (%s)%s; %d of %d out of rotation",
                    self._group,
                    target,
                    change.reason,
                    f" for at least {change.duration_s:.0f}s" if change.duration_s > 0 else "",
                    change.out,
                    len(self.endpoints),
                )
            else:
                log.warning(
                    "group %s: instance %s back in rotation (%s); %d of %d out of rotation",
                    self._group,
                    target,
                    change.reason,
                    change.out,
                    len(self.endpoints),
                )
            if self._on_ejected is not None:
                self._on_ejected(change.out)
            if self._health_wake is not None:
                self._health_wake.set()  # the loop re-plans its next checks

    # -- active health checks ------------------------------------------------------------

    async def check(self, endpoint: Endpoint) -> Verdict:
        """One ``grpc.health.v1`` Check of ``endpoint``."""
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

    async def _health_loop(self) -> None:
        assert self._health_wake is not None
        wake = self._health_wake
        ejection = self._ejection
        while True:
            due = ejection.checks_due()
            if due:
                verdicts = await asyncio.gather(*(self.check(self.endpoints[i]) for i in due))
                for index, verdict in zip(due, verdicts, strict=True):
                    endpoint = self.endpoints[index]
                    if verdict == "unsupported" and endpoint.state.health_supported:
                        log.info(
                            "group %s: instance %s has no grpc.health.v1 service; its call "
                            "results alone decide its ejection",
                            self._group,
                            endpoint.target,
                        )
                    change = ejection.apply_health(index, verdict)
                    if change is not None:
                        self._changed(change)
                self._changed(*ejection.return_due())
            wake.clear()
            delay = ejection.check_delay()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):  # not wait_for: see Breaker.acquire
                        await wake.wait()
