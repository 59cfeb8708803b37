"""A long call's service answering events that do not decode: the dispatcher classifies the
call (INTERNAL, counted, like a unary answer that does not decode) and never raises. Real
gRPC: a raw service in the same loop that yields bytes of its choosing, and the proxy's own
``Dispatcher.push_stream``. (The proxy end to end: ``test_long_running``.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from consumer_proxy.config import ServiceConfig
from consumer_proxy.core.heartbeat import CallWatch, Limits
from consumer_proxy.core.outcomes import Classifier, Outcome
from consumer_proxy.dispatcher import Dispatcher
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.service import raw_stream_service

HEARTBEAT = handler_pb2.HandleMessageStreamEvent(
    heartbeat=handler_pb2.Heartbeat(progress="half")
).SerializeToString()
UNDECODABLE = b"\x0a\xff"  # field 1 (the heartbeat), 255 bytes long, and nothing follows
NOT_UTF8 = (
    handler_pb2.HandleMessageStreamEvent(
        heartbeat=handler_pb2.Heartbeat(progress="x")
    ).SerializeToString()[:-1]
    + b"\xff"
)  # a note cut in the middle of a character


async def _push_stream(events: list[bytes]) -> tuple[Any, int]:
    """One ``push_stream`` call to a service that yields ``events`` as they are: its
    classification, and the endpoint's outstanding calls afterwards."""

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for event in events:
            yield event
        await asyncio.sleep(30)  # and then nothing: only the proxy ends this call

    async with raw_stream_service(stream) as address:
        return await _push_stream_to(address)


async def _push_stream_to(address: str) -> tuple[Any, int]:
    """The proxy's dispatcher's ``push_stream`` of one message to ``address``."""
    dispatcher = Dispatcher("g", ServiceConfig(endpoints=[address]), Classifier())
    try:
        loop = asyncio.get_running_loop()
        request = handler_pb2.HandleMessageStreamRequest(
            message=handler_pb2.Message(topic="t", partition=0, offset=1, attempt=1),
            heartbeat_interval_ms=1000,
            max_processing_ms=60_000,
        )
        endpoint = dispatcher.pick()
        result = await asyncio.wait_for(
            dispatcher.push_stream(
                request,
                endpoint,
                CallWatch(Limits.from_ms(10_000, 60_000), loop.time()),
                lambda gap: None,
            ),
            timeout=8,  # well inside the heartbeat timeout: an expiry is not the answer
        )
        return result, endpoint.outstanding
    finally:
        await dispatcher.close()


@pytest.mark.parametrize(
    "events",
    [[UNDECODABLE], [HEARTBEAT, UNDECODABLE], [NOT_UTF8]],
    ids=["undecodable-first", "undecodable-after-a-heartbeat", "note-not-utf8"],
)
async def test_an_undecodable_event_is_retried_like_internal_and_never_raises(
    events: list[bytes],
) -> None:
    # Given a service whose long call sends an event that does not decode
    # When the proxy's dispatcher reads it
    result, outstanding = await _push_stream(events)
    # Then the call is classified at once, as a counted INTERNAL failure, and the endpoint's
    # call is given back
    assert result.outcome is Outcome.RETRY
    assert result.status == "INTERNAL"
    assert result.counted
    assert "could not be decoded" in result.reason
    assert outstanding == 0
