"""The HTTP endpoint (/metrics, /healthz, /readyz) faces whatever reaches its port: slow
clients are cut at the request deadline, connections over the cap are closed, and oversized
requests are refused with a status and no log noise.

Every test runs the real proxy (real broker, a real service) with its default limits and
talks to its endpoint over sockets, as Prometheus, the kubelet or an attacker would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest

from consumer_proxy.config import MetricsConfig
from consumer_proxy.metrics import MAX_HEAD_BYTES, MAX_LINE_BYTES
from consumer_proxy.proxy import Proxy
from tests.support.kafka import Broker, create_topic, unique_name
from tests.support.proxy import make_config, start_proxy
from tests.support.scrape import http_get, scrape
from tests.support.service import TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

DEFAULTS = MetricsConfig()
DEADLINE_S = DEFAULTS.request_timeout_ms / 1000
CAP = DEFAULTS.max_connections


@pytest.fixture
async def proxy(kafka: Broker) -> AsyncIterator[Proxy]:
    """A proxy of one group, its HTTP endpoint on a free port with the default limits."""
    topic, group = unique_name("http"), unique_name("http")
    create_topic(kafka.bootstrap, topic, partitions=1)
    async with TestService() as service:
        config = make_config(kafka.bootstrap, group, [topic], [service.address], metrics_port=0)
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: _serving(proxy), timeout=30, message="HTTP is up")
            # and the group started (its DLQ topics made), so no start-up work outlives the test
            await async_wait_until(lambda: proxy.ready()[0], timeout=30, message="ready")
            yield proxy
        finally:
            await proxy.shutdown()
            await task


def _serving(proxy: Proxy) -> bool:
    with contextlib.suppress(RuntimeError):  # "not started"
        return proxy.http is not None and proxy.http.port > 0
    return False


def _port(proxy: Proxy) -> int:
    assert proxy.http is not None
    return proxy.http.port


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    """True when the server ends the connection within ``within_s`` (EOF or reset)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=within_s) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _healthz(port: int) -> bool:
    try:
        return await http_get(port, "/healthz") == (200, "ok\n")
    except (ConnectionError, IndexError):  # refused at the cap while it drains
        return False


async def test_a_client_trickling_header_lines_is_cut_at_the_request_deadline(
    proxy: Proxy,
) -> None:
    # Given a client that sends a request line, then a header line every 0.5 s, never ending
    port = _port(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(b"GET /metrics HTTP/1.1\r\n")
    closed = False
    try:
        # When it keeps going for up to the deadline and 3 s more
        while not closed and time.monotonic() - started < DEADLINE_S + 3:
            try:
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            # the interval between lines, and the check whether the server hung up
            closed = await _closed_by_server(reader, within_s=0.5)
        elapsed = time.monotonic() - started
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    # Then the server cut it at the deadline, however busy the client kept the line
    assert closed, f"still connected after {elapsed:.1f} s"
    assert DEADLINE_S - 0.5 <= elapsed <= DEADLINE_S + 2, elapsed
    metrics = await scrape(port)
    assert metrics.value("consumer_proxy_http_refused_total", reason="deadline") == 1


async def test_connections_over_the_cap_are_closed_at_once(proxy: Proxy) -> None:
    # Given 300 idle connections, as a careless or hostile client opens them
    port = _port(proxy)
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
    ended = [asyncio.create_task(_closed_by_server(r, within_s=30)) for r, _ in opened]
    try:
        # Then all but the cap are closed at once (long before the request deadline)
        await async_wait_until(
            lambda: sum(task.done() for task in ended) >= 300 - CAP,
            timeout=DEADLINE_S - 1,
            message=f"{300 - CAP} connections closed by the server",
        )
        assert sum(task.done() for task in ended) == 300 - CAP
    finally:
        for _, writer in opened:
            writer.close()
        await asyncio.gather(*ended)

    # and once the clients let go, the endpoint answers again and counted the refusals
    await async_wait_until(lambda: _healthz(port), timeout=DEADLINE_S)
    metrics = await scrape(port)
    assert metrics.value("consumer_proxy_http_refused_total", reason="connections") == 300 - CAP


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (
            b"GET /metrics HTTP/1.1\r\n"
            + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40))
            + b"\r\n",
            431,
        ),
    ],
    ids=["request line of 70 KiB", "header line of 70 KiB", "40 headers of 1 KiB"],
)
async def test_an_oversized_request_is_refused_quietly(
    proxy: Proxy, caplog: pytest.LogCaptureFixture, request_head: bytes, status: int
) -> None:
    assert len(request_head) > MAX_HEAD_BYTES > MAX_LINE_BYTES
    caplog.set_level(logging.INFO)
    port = _port(proxy)
    # When a client sends a request line or headers over the limits
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_head)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=DEADLINE_S)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    # Then it gets an error status, the endpoint goes on serving, and nothing is logged
    assert answer.split(b"\r\n", 1)[0].split()[1] == str(status).encode(), answer[:200]
    assert await _healthz(port)
    metrics = await scrape(port)
    assert metrics.value("consumer_proxy_http_refused_total", reason="too_large") == 1
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage() for r in noisy]
