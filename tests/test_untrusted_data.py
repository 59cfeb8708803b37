"""Untrusted data stays data: producers' headers, services' reasons, operators' passwords.

Each test is named after the promise it checks and tries one kind of hostile input (the table
in docs/operating.md, "Security", lists them): user headers named like the proxy's, passwords
that JAAS quoting would mangle (read back by the Kafka client's own parser), and record values
or service reasons carrying terminal control sequences.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from consumer_proxy import dlq
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

# --------------------------------------------------------------------------- user cp- headers


@pytest.mark.kafka
async def test_user_headers_named_cp_arrive_at_the_service_and_in_the_dlq_copy(
    kafka: Broker,
) -> None:
    # Given records with a user header named like the proxy's (cp-tenant) and forged values
    # for two names the proxy owns (cp-attempt, cp-reason)
    bootstrap, topic, group = kafka.bootstrap, unique_name("cphdr"), unique_name("cphdr")
    create_topic(bootstrap, topic)
    dlq_topic = create_topic(bootstrap, f"{group}.dlq")
    user_headers = [("cp-tenant", b"acme"), ("trace", b"t1"), ("cp-tenant", b"globex")]
    forged = [("cp-attempt", b"99"), ("cp-reason", b"forged")]
    records = [
        {"key": verdict, "value": b"v", "headers": [*user_headers, *forged, ("verdict", verdict)]}
        for verdict in (b"ack", b"poison")
    ]
    await asyncio.to_thread(produce, bootstrap, topic, records)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.key == b"poison":
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="rejected")
        return Behaviour()

    # When the proxy delivers one and dead-letters the other
    async with TestService(behaviour) as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task

    # Then the service saw the user's headers, cp-tenant included, in order, and none of the
    # forged ones
    assert not service.errors
    assert len(service.deliveries) == 2
    for delivery in service.deliveries:
        assert delivery.headers == (*user_headers, ("verdict", delivery.key))
        assert delivery.attempt == 1
    # and the DLQ copy keeps them, with the proxy's own cp-attempt and cp-reason only
    [dead] = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    headers = dead.headers()
    assert isinstance(headers, list)
    user, ours = dlq.split_headers(headers)
    assert user == [*user_headers, ("verdict", b"poison")]
    assert [v for k, v in headers if k == dlq.H_ATTEMPT] == [b"1"]
    assert [v for k, v in headers if k == dlq.H_REASON] == [b"rejected"]
    assert ours[dlq.H_STATUS] == "INVALID_ARGUMENT"


def test_only_the_proxys_own_header_names_are_taken_out_of_a_record() -> None:
    # Given a record with every name the proxy owns and user names sharing its prefix
    user = [("cp-tenant", b"acme"), ("CP-Attempt", b"x"), ("cp-", b""), ("cp-originaltopic", b"y")]
    proxy_owned = [(name, b"1") for name in sorted(dlq.PROXY_HEADERS)]

    # When it is split
    got_user, got_ours = dlq.split_headers([*user, *proxy_owned])

    # Then the user's stay the user's, and only the proxy's names are the proxy's
    assert got_user == user
    assert set(got_ours) == dlq.PROXY_HEADERS
