"""Prometheus metrics on an injected registry, and the HTTP endpoint for metrics and probes.

Labels stay low-cardinality: group, outcome, topic and partition (bounded by the assignment).
A failing metrics call never breaks delivery: hot-path updates are plain prometheus-client
operations that do not raise, and the HTTP server runs apart from the delivery loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class KeyBacklogView(Protocol):
    """What the ordering metrics read (``core.partitions.KeyBacklog``)."""

    @property
    def keys(self) -> int: ...
    @property
    def longest(self) -> int: ...


class ProxyMetrics:
    """Every metric the proxy exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "consumer_proxy_messages",
            "Push results by outcome (ack, retry, dead_letter, drop).",
            ["group", "outcome"],
            registry=r,
        )
        self.push_duration = Histogram(
            "consumer_proxy_push_duration_seconds",
            "Duration of one push call to the service.",
            ["group"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "consumer_proxy_in_flight", "Push calls under way.", ["group"], registry=r
        )
        self.uncommitted = Gauge(
            "consumer_proxy_uncommitted_messages",
            "Offsets fetched and not yet committed (the tracker window).",
            ["group", "topic", "partition"],
            registry=r,
        )
        self.committed_offset = Gauge(
            "consumer_proxy_committed_offset",
            "Last committed offset.",
            ["group", "topic", "partition"],
            registry=r,
        )
        self.lag = Gauge(
            "consumer_proxy_lag_messages",
            "High watermark minus committed offset.",
            ["group", "topic", "partition"],
            registry=r,
        )
        self.circuit_open = Gauge(
            "consumer_proxy_circuit_open",
            "1 while the group's circuit breaker is open or half-open.",
            ["group"],
            registry=r,
        )
        self.partitions_paused = Gauge(
            "consumer_proxy_partitions_paused",
            "Partitions paused (window full, breaker open, metadata budget, byte budget).",
            ["group"],
            registry=r,
        )
        self.retry_tier_writes = Counter(
            "consumer_proxy_retry_tier_writes",
            "Messages written to a retry tier topic (result ok or error: a failed attempt).",
            ["group", "tier", "result"],
            registry=r,
        )
        self.retry_tier_deliveries = Counter(
            "consumer_proxy_retry_tier_deliveries",
            "Messages read back from a retry tier topic and pushed when due.",
            ["group", "tier"],
            registry=r,
        )
        self.head_unblocks = Counter(
            "consumer_proxy_head_unblocks",
            "Messages moved aside as they blocked their partition's commit (head_block_ms), "
            "by the tier they moved to ('dlq' after the last).",
            ["group", "tier"],
            registry=r,
        )
        self.dlq_writes = Counter(
            "consumer_proxy_dlq_writes",
            "DLQ writes by result (ok, error).",
            ["group", "result"],
            registry=r,
        )
        self.dlq_write_errors = Counter(
            "consumer_proxy_dlq_write_errors",
            "Failed DLQ writes by reason (record_too_large, topic_authorization, unknown_topic, "
            "timed_out, queue_full, fatal, other); each is retried, never skipped.",
            ["group", "reason"],
            registry=r,
        )
        self.dlq_held = Gauge(
            "consumer_proxy_dlq_held_messages",
            "Dead letters the DLQ refused and that wait for it (their offsets stay uncommitted).",
            ["group"],
            registry=r,
        )
        self.commits = Counter(
            "consumer_proxy_commits",
            "Offset commits by result (ok, error).",
            ["group", "result"],
            registry=r,
        )
        self.metadata_over_budget = Counter(
            "consumer_proxy_metadata_over_budget",
            "Commits whose ack state did not fit the metadata budget (partition paused).",
            ["group"],
            registry=r,
        )
        self.concurrency_limit = Gauge(
            "consumer_proxy_concurrency_limit", "Current concurrency limit.", ["group"], registry=r
        )
        self.endpoints_ejected = Gauge(
            "consumer_proxy_endpoints_ejected",
            "Service instances taken out of rotation.",
            ["group"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "consumer_proxy_circuit_transitions",
            "Circuit breaker state changes by new state.",
            ["group", "state"],
            registry=r,
        )
        self.batch_size = Histogram(
            "consumer_proxy_batch_size_messages",
            "Messages per HandleMessageBatch call (_count: calls, _sum: messages).",
            ["group"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000),
            registry=r,
        )
        self.batch_unsupported = Gauge(
            "consumer_proxy_batch_unsupported",
            "1 while the service does not implement HandleMessageBatch (answers UNIMPLEMENTED) "
            "for a group with delivery.batch.",
            ["group"],
            registry=r,
        )
        self.push_instances = Gauge(
            "consumer_proxy_push_instances",
            "delivery.batch auto: service instances by how they are pushed to (batch: they "
            "serve HandleMessageBatch; unary: they answered UNIMPLEMENTED to it; unknown: not "
            "asked yet).",
            ["group", "mode"],
            registry=r,
        )
        self.batch_protocol_errors = Counter(
            "consumer_proxy_batch_protocol_errors",
            "Batch answers with the wrong number of results (the batch is retried).",
            ["group"],
            registry=r,
        )
        self.long_calls_open = Gauge(
            "consumer_proxy_long_calls_open",
            "Long-running (streaming) calls under way (delivery.long_running).",
            ["group"],
            registry=r,
        )
        self.oldest_open_call = Gauge(
            "consumer_proxy_oldest_open_call_seconds",
            "Age of the group's oldest long-running call under way (0: none), read on scrape.",
            ["group"],
            registry=r,
        )
        self.heartbeat_gap = Histogram(
            "consumer_proxy_heartbeat_gap_seconds",
            "Time between two heartbeats (or the start and the first) of a long-running call.",
            ["group"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.calls_cancelled = Counter(
            "consumer_proxy_calls_cancelled",
            "Calls the proxy cancelled, by cause: revoke, lost, shutdown (never an attempt), "
            "heartbeat (no heartbeat in time) or max_processing (the cap; both counted as "
            "failed attempts under the status table).",
            ["group", "cause"],
            registry=r,
        )
        self.guard_held = Gauge(
            "consumer_proxy_dead_letter_guard_held",
            "1 while the group's dead-letter guard holds its dead letters (a bad deploy?).",
            ["group"],
            registry=r,
        )
        self.guard_held_messages = Gauge(
            "consumer_proxy_dead_letter_guard_held_messages",
            "Messages the dead-letter guard holds in their windows instead of the DLQ.",
            ["group"],
            registry=r,
        )
        self.guard_trips = Gauge(
            "consumer_proxy_dead_letter_guard_trips",
            "Times the dead-letter guard tripped since the process started.",
            ["group"],
            registry=r,
        )

        self.http_refused = Counter(
            "consumer_proxy_http_refused",
            "HTTP connections to the proxy's endpoint (/metrics, /healthz, /readyz, /console/ "
            "and /admin/) refused, by reason: "
            "connections (over metrics.max_connections), deadline (no whole exchange within "
            "metrics.request_timeout_ms), too_large (a request or header line over 8 KiB), "
            "forbidden (an admin request without the admin token), error (a request that "
            "failed in the proxy: its first of a kind logged with its traceback).",
            ["reason"],
            registry=r,
        )
        self.keys_backlogged = Gauge(
            "consumer_proxy_ordering_keys_backlogged",
            "delivery.ordering key/partition: keys with messages waiting behind one of their "
            "own that is in flight, waiting for its retry or for its DLQ write.",
            ["group"],
            registry=r,
        )
        self.key_backlog_longest = Gauge(
            "consumer_proxy_ordering_longest_key_backlog",
            "delivery.ordering key/partition: most messages waiting behind one key.",
            ["group"],
            registry=r,
        )

    def key_backlog(self, group: str, backlog: KeyBacklogView) -> None:
        """Set the ordering gauges (updated every commit interval)."""
        self.keys_backlogged.labels(group).set(backlog.keys)
        self.key_backlog_longest.labels(group).set(backlog.longest)

    def batch_instances(self, group: str, counts: Mapping[str, int]) -> None:
        """delivery.batch auto: how many of the group's instances are pushed to how."""
        for mode, count in counts.items():
            self.push_instances.labels(group, mode).set(count)

    def forget_partition(self, group: str, topic: str, partition: int) -> None:
        """Drop a revoked partition's series so label sets stay bounded by the assignment."""
        labels = (group, topic, str(partition))
        for gauge in (self.uncommitted, self.committed_offset, self.lag):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)

    def exposition(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class Answer(NamedTuple):
    """One HTTP answer: status line, content type, body and any further headers."""

    status: str
    ctype: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def text_answer(status: str, text: str) -> Answer:
    """A text/plain answer of one line."""
    return Answer(status, "text/plain; charset=utf-8", f"{text}\n".encode())


ADMIN_PREFIX = "/admin/"
Admin = Callable[[str, str], Awaitable[Answer]]
"""An admin action, already authorised: (the path after /admin/, the query string) -> answer."""
Pages = Callable[[str, str], Awaitable[Answer | None]]
"""Read-only pages beside /metrics (the console): (path, query) of a GET -> answer, or None
when the path is not theirs."""
MAX_LINE_BYTES = 8192
"""Longest request line or header line the HTTP endpoint reads (the usual servers' limit)."""
MAX_HEAD_BYTES = 32 * 1024
"""Most bytes of request line and headers together."""
_LINGER_BYTES = 256 * 1024
"""After refusing an oversized request, read at most this much more of it before closing, so
the client gets the answer instead of a reset (closing with unread input sends a reset)."""


class _Refusal(Exception):
    """A request the endpoint answers with an error status and closes at once."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class HttpEndpoint:
    """A minimal asyncio HTTP/1.0 server: GET /metrics, /healthz (alive), /readyz (ready),
    /console/ (the operator console, when enabled) and POST /admin/... (operator actions) when
    an admin token is configured.

    ``ready`` returns (ok, detail); /readyz answers 503 with the detail while not ready.
    ``pod_ready`` the same for /readyz/pod (the pod's own part: Kubernetes' readiness probe).
    ``admin`` performs an operator action, only for a request that carries ``admin_token``.

    Bounded, as it faces whatever can reach its port: at most ``max_connections`` open at once
    (one more is closed as soon as it is accepted), one whole exchange (request in, answer
    out) within ``request_timeout_s`` or the connection is cut, and a request line or header
    line over ``MAX_LINE_BYTES`` (or a head over ``MAX_HEAD_BYTES``) answered 414 / 431 and
    closed. Each refusal is counted in ``consumer_proxy_http_refused_total`` and logged at
    debug level only: whoever sends them should not be able to fill the proxy's logs.
    """

    def __init__(
        self,
        metrics: ProxyMetrics,
        ready: Callable[[], tuple[bool, str]],
        host: str,
        port: int,
        *,
        max_connections: int = 64,
        request_timeout_s: float = 5.0,
        admin: Admin | None = None,
        admin_token: str | None = None,
        pages: Pages | None = None,
        pod_ready: Callable[[], tuple[bool, str]] | None = None,
    ) -> None:
        self._metrics = metrics
        self._ready = ready
        self._pod_ready = pod_ready or ready
        self._admin = admin
        self._pages = pages
        self._admin_token = admin_token.encode() if admin_token else None
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._request_timeout_s = request_timeout_s
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._errors_told: set[str] = set()  # kinds of failed requests logged (once each)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None:
            raise RuntimeError("not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and serve in the background of the running loop."""
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=MAX_LINE_BYTES
        )
        log.info("serving /metrics, /healthz, /readyz on %s:%d", self._host, self.port)

    async def close(self) -> None:
        """Stop serving and cut the connections still open."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    def _refused(self, reason: str, peer: object, detail: str) -> None:
        self._metrics.http_refused.labels(reason).inc()
        log.debug("HTTP endpoint: refused %s: %s", peer, detail)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if len(self._open) >= self._max_connections:
            writer.close()  # nothing read or written yet: the client sees the connection end
            self._refused(
                "connections", peer, f"{self._max_connections} connections are open already"
            )
            return
        self._open.add(writer)
        try:
            async with asyncio.timeout(self._request_timeout_s):
                await self._exchange(reader, writer, peer)
                writer.close()
                await writer.wait_closed()
        except TimeoutError:
            self._refused("deadline", peer, f"no exchange within {self._request_timeout_s:g} s")
        except ConnectionError:
            pass  # the client went away
        except Exception as exc:  # (a request must never reach asyncio's log)
            # A request that trips a bug: counted, and told once per kind of error (whoever
            # can reach the port must not fill the log); the connection is cut.
            self._metrics.http_refused.labels("error").inc()
            where = traceback.extract_tb(exc.__traceback__)[-1:]
            kind = f"{type(exc).__name__} at " + "".join(f"{f.filename}:{f.lineno}" for f in where)
            if kind not in self._errors_told:
                self._errors_told.add(kind)
                log.exception("HTTP endpoint: a request from %s failed (told once)", peer)
        finally:
            self._open.discard(writer)
            writer.transport.abort()  # at once, whatever is still unsent or unread

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object
    ) -> None:
        try:
            request = await self._read_head(reader)
        except _Refusal as refusal:
            self._refused("too_large", peer, str(refusal))
            self._answer(writer, Answer(refusal.status, "text/plain", f"{refusal}\n".encode()))
            await writer.drain()
            writer.write_eof()
            lingered = 0
            while lingered < _LINGER_BYTES:
                chunk = await reader.read(_LINGER_BYTES)
                if not chunk:
                    break
                lingered += len(chunk)
            return
        if request is None:
            return  # closed before a whole request arrived
        line, authorization = request
        parts = line.decode("latin-1").split()
        method = parts[0] if parts else ""
        path, _, query = parts[1].partition("?") if len(parts) >= 2 else ("", "", "")
        answer: Answer | None = None
        if path.startswith(ADMIN_PREFIX):
            answer = await self._admin_route(method, path, query, authorization, peer)
        elif self._pages is not None and method in ("GET", "HEAD"):
            answer = await self._pages(path, query)
        if answer is None:
            answer = self._route(path)
        self._answer(writer, answer, head_only=method == "HEAD")
        await writer.drain()

    async def _admin_route(
        self, method: str, path: str, query: str, authorization: bytes, peer: object
    ) -> Answer:
        """POST /admin/... (the guard's release or hold, the console's actions) with
        ``Authorization: Bearer T``.

        Off (404) unless a token is configured; a missing or wrong token is 403 (compared in
        constant time), and every refusal is counted, never logged above debug."""
        if self._admin is None or self._admin_token is None:
            return text_answer("404 Not Found", "admin endpoint off: set admin.token")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._admin_token):
            self._refused("forbidden", peer, "admin request without the right token")
            return text_answer("403 Forbidden", "forbidden: a valid admin token is required")
        if method != "POST":
            return text_answer("405 Method Not Allowed", "use POST")
        return await self._admin(path[len(ADMIN_PREFIX) :], query)

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
        """The request line and the Authorization header's value (b"" when absent), after
        reading the headers up to the blank line (None: EOF)."""
        size = 0
        request: bytes | None = None
        authorization = b""
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # over MAX_LINE_BYTES (the reader's limit)
                if request is None:
                    raise _Refusal(
                        "414 URI Too Long", f"request line over {MAX_LINE_BYTES} bytes"
                    ) from None
                raise _Refusal(
                    "431 Request Header Fields Too Large",
                    f"header line over {MAX_LINE_BYTES} bytes",
                ) from None
            if not line.endswith(b"\n"):
                return None
            size += len(line)
            if size > MAX_HEAD_BYTES:
                raise _Refusal(
                    "431 Request Header Fields Too Large", f"headers over {MAX_HEAD_BYTES} bytes"
                )
            if request is None:
                request = line
            elif line in (b"\r\n", b"\n"):
                return request, authorization
            elif line[:14].lower() == b"authorization:":
                authorization = line[14:].strip()

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, answer: Answer, *, head_only: bool = False) -> None:
        extra = "".join(f"{name}: {value}\r\n" for name, value in answer.headers)
        head = (
            f"HTTP/1.0 {answer.status}\r\nContent-Type: {answer.ctype}\r\n"
            f"Content-Length: {len(answer.body)}\r\n{extra}Connection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + (b"" if head_only else answer.body))

    def _route(self, path: str) -> Answer:
        if path == "/metrics":
            return Answer("200 OK", CONTENT_TYPE_LATEST, self._metrics.exposition())
        if path == "/healthz":
            return Answer("200 OK", "text/plain", b"ok\n")
        if path in ("/readyz", "/readyz/pod"):
            ok, detail = (self._ready if path == "/readyz" else self._pod_ready)()
            return Answer(
                ("200 OK" if ok else "503 Service Unavailable"),
                "text/plain",
                f"{detail}\n".encode(),
            )
        return Answer(
            "404 Not Found", "text/plain", b"not found; try /metrics, /healthz, /readyz\n"
        )
