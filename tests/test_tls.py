"""service.tls: TLS and mTLS to the service instances with a throwaway CA, and a wrong CA
that opens the breaker (an outage) instead of dead-lettering anything."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.certs import CertificateAuthority, Issued
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    produce,
    unique_name,
)
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

SERVER_NAME = "billing.test.internal"  # the only name in the server certificate


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Issued
    client: Issued
    rogue_ca: CertificateAuthority

    def server_credentials(self, *, mtls: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.server.key_pem, self.server.cert_pem)],
            root_certificates=self.ca.cert_pem if mtls else None,
            require_client_auth=mtls,
        )


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority(tmp_path, "test-ca")
    return Pki(
        ca=ca,
        server=ca.issue(SERVER_NAME, server=True, dns_names=(SERVER_NAME,)),
        client=ca.issue("consumer-proxy", server=False),
        rogue_ca=CertificateAuthority(tmp_path, "rogue-ca"),
    )


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
async def test_messages_reach_a_tls_service_through_the_proxy(
    kafka: Broker, pki: Pki, mtls: bool
) -> None:
    await _tls_run(kafka.bootstrap, pki, mtls)


async def _tls_run(bootstrap: str, pki: Pki, mtls: bool) -> None:
    # Given a service that only speaks TLS (and with mTLS, only to clients our CA signed)
    topic, group = unique_name("tls"), unique_name("tls")
    create_topic(bootstrap, topic, partitions=2)
    values = [f"m{i}" for i in range(30)]
    await asyncio.to_thread(produce, bootstrap, topic, values)
    tls = {"ca_file": str(pki.ca.cert_file), "server_name": SERVER_NAME}
    if mtls:
        tls |= {"cert_file": str(pki.client.cert_file), "key_file": str(pki.client.key_file)}

    async with TestService(server_credentials=pki.server_credentials(mtls=mtls)) as service:
        # a client without the right credentials is refused, so the service really is secured
        refused = (
            grpc.aio.secure_channel(
                service.address,
                grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem),
                options=[("grpc.ssl_target_name_override", SERVER_NAME)],
            )
            if mtls
            else grpc.aio.insecure_channel(service.address)
        )
        async with refused:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await handler_pb2_grpc.MessageHandlerStub(refused).HandleMessage(
                    handler_pb2.HandleMessageRequest(), timeout=5
                )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        # When the proxy pushes with service.tls
        config = make_config(bootstrap, group, [topic], [service.address], service={"tls": tls})
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        finally:
            await proxy.shutdown()
            await task

    # Then every message was acked over the secured channel
    assert sorted(
        (d.value or b"").decode() for d in service.deliveries if d.outcome == "ACK"
    ) == sorted(values)


async def test_a_wrong_ca_opens_the_breaker_and_dead_letters_nothing(
    kafka: Broker, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await _wrong_ca(kafka.bootstrap, pki)

    # and the log says why, naming the group and the TLS failure
    opened = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "circuit open" in r.getMessage()
    ]
    assert opened, caplog.text
    assert "UNAVAILABLE" in opened[0]
    assert any(word in opened[0].lower() for word in ("ssl", "handshake", "certificate")), opened


async def _wrong_ca(bootstrap: str, pki: Pki) -> None:
    # Given a TLS service and a proxy that trusts another CA
    topic, group = unique_name("wrongca"), unique_name("wrongca")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(10)])
    tls = {"ca_file": str(pki.rogue_ca.cert_file), "server_name": SERVER_NAME}

    async with TestService(server_credentials=pki.server_credentials(mtls=False)) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            service={"tls": tls},
            breaker={"failure_threshold": 3, "reset_timeout_s": 60},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        try:
            # When it pushes, every handshake fails: an outage, so the breaker opens
            await async_wait_until(lambda: runner.breaker.is_open, timeout=30)
            metrics = proxy.metrics
            assert metrics.circuit_open.labels(group)._value.get() == 1
        finally:
            await proxy.shutdown()
            await task

    # Then nothing reached the service, nothing was dead-lettered, nothing was committed
    assert service.deliveries == []
    assert metrics.messages.labels(group, "dead_letter")._value.get() == 0
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 5) == []
    committed = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
    assert committed.get(0, (None,))[0] in (None, 0)
