"""Pushing to the service: one grpc.aio channel per instance, power-of-two-choices selection.

Selection takes two random instances in rotation and picks the one with fewer calls
outstanding, so load follows capacity and no single instance runs hot. An instance that keeps
failing at the service level while others succeed is ejected for a while (doubling up to a
limit) and returns on its own; a ``dns:///`` target is one channel with round-robin balancing.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import grpc
from grpc import aio

from .config import ServiceConfig, TlsConfig
from .outcomes import Classification, Classifier
from .proto.v1 import handler_pb2, handler_pb2_grpc

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # the proxy owns retries (attempt counting, backoff, DLQ)
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
EJECT_AFTER_FAILURES = 5
EJECT_BASE_S = 2.0
EJECT_MAX_S = 60.0


@dataclass(eq=False)
class Endpoint:
    """One service instance (or one balanced dns:/// target)."""

    target: str
    channel: aio.Channel
    stub: handler_pb2_grpc.MessageHandlerStub
    outstanding: int = 0
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    calls: int = field(default=0)

    def available(self, now: float) -> bool:
        """In rotation (not ejected)."""
        return self.ejected_until <= now


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
    """Calls ``HandleMessage`` on the group's instances and classifies each result."""

    def __init__(self, group: str, service: ServiceConfig, classifier: Classifier) -> None:
        self._group = group
        self._timeout_s = service.timeout_ms / 1000.0
        self._classifier = classifier
        self._rng = random.Random()
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
                Endpoint(target, channel, handler_pb2_grpc.MessageHandlerStub(channel))
            )

    @property
    def ejected(self) -> int:
        """Instances currently out of rotation."""
        now = time.monotonic()
        return sum(not e.available(now) for e in self.endpoints)

    def pick(self) -> Endpoint:
        """Power of two choices over the instances in rotation (all of them if none is)."""
        endpoints = self.endpoints
        if len(endpoints) == 1:
            return endpoints[0]
        now = time.monotonic()
        live = [e for e in endpoints if e.available(now)] or endpoints
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
            result = self._classifier.from_response(response)
        finally:
            endpoint.outstanding -= 1
        self._observe(endpoint, result)
        return result

    def _observe(self, endpoint: Endpoint, result: Classification) -> None:
        if not result.service_failure:
            endpoint.consecutive_failures = 0
            endpoint.ejections = 0
            return
        endpoint.consecutive_failures += 1
        if endpoint.consecutive_failures < EJECT_AFTER_FAILURES or len(self.endpoints) == 1:
            return
        now = time.monotonic()
        others_live = any(e.available(now) and e is not endpoint for e in self.endpoints)
        if not others_live or not endpoint.available(now):
            return  # never eject the last instance: the breaker handles a full outage
        endpoint.ejections += 1
        duration = min(EJECT_MAX_S, EJECT_BASE_S * 2 ** (endpoint.ejections - 1))
        endpoint.ejected_until = now + duration
        endpoint.consecutive_failures = 0
        log.warning(
            "group %s: instance %s ejected for %.0fs after repeated %s",
            self._group,
            endpoint.target,
            duration,
            result.status,
        )

    async def close(self) -> None:
        """Close every channel."""
        for endpoint in self.endpoints:
            await endpoint.channel.close()
