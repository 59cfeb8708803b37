"""A programmable in-process MessageHandler service for integration tests.

Built on the raw generated servicer, not on ``consumer_proxy.handler``, so a bug in the SDK
cannot hide a bug in the proxy. The test decides, per delivery, what the service does::

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value == b"poison":
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad")
        if n < 3:                       # n = how many times this offset was seen, 1 first
            return Behaviour(action=RETRY, retry_after_ms=10)
        return Behaviour(delay_s=0.01)  # an empty response: ack

    async with TestService(behaviour) as service:          # in the test's event loop
        ...  # point the proxy at service.address
        assert service.count("t", 0, 5) == 3

    with ThreadedService(behaviour) as service:            # its own loop in a thread
        ...  # sync tests, or a proxy running in another loop

Every call is recorded as a :class:`Delivery` when it arrives (outcome ``"PENDING"``) and
updated when it ends. Outcomes: the action's name for an OK answer (``"ACK"`` also for the
empty response), the status name for a non-OK one (``"INVALID_ARGUMENT"``), ``"CRASH"``,
``"CANCELLED"`` when the caller went away first (its deadline passed or it cancelled), and
``"BEHAVIOUR_ERROR"`` when the test's behaviour function raised (also kept in ``errors``).

``Behaviour(crash=True)`` simulates the service process dying: the server stops at once
without grace, so that call and every other in-flight call fail on the caller's side
(UNAVAILABLE "Cancelling all calls", sometimes CANCELLED) and new connections are refused
until the test calls ``restart()``, which listens on the same port again. A plain
``Behaviour(status=UNAVAILABLE)`` is the polite variant: the service is up and says no.

With ``max_concurrency=K`` a call arriving while K calls are in flight is answered
RESOURCE_EXHAUSTED at once, without consulting the behaviour; such calls are counted in
``rejected`` and are not deliveries. A batch call counts as one call.

A batch call plays each message's behaviour concurrently. By default the first non-OK status
(in request order) fails the whole call; with ``per_message_status=True`` each message's
status goes into its own result (``status_code``, the details as ``reason``), as the SDK
answers. ``batch_calls`` lists the size of every batch call received.

The recorded state sits behind a lock, so a test may read it from any thread while the
service runs; the behaviour function runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc

__all__ = [
    "ACK",
    "DEAD_LETTER",
    "DROP",
    "EMPTY",
    "RETRY",
    "SERVICE_NAME",
    "Behaviour",
    "BehaviourFn",
    "Delivery",
    "TestService",
    "ThreadedService",
    "ack_all",
    "always",
    "raw_stream_service",
]

SERVICE_NAME = "consumerproxy.v1.MessageHandler"

_Response = handler_pb2.HandleMessageResponse
EMPTY = _Response.ACTION_UNSPECIFIED
"""The empty response: the contract's default ack."""
ACK = _Response.ACK
RETRY = _Response.RETRY
DEAD_LETTER = _Response.DEAD_LETTER
DROP = _Response.DROP

_SOURCES = {
    handler_pb2.DELIVERY_SOURCE_UNSPECIFIED: "unspecified",
    handler_pb2.DELIVERY_SOURCE_PRIMARY: "primary",
    handler_pb2.DELIVERY_SOURCE_REDRIVE: "redrive",
    handler_pb2.DELIVERY_SOURCE_RETRY: "retry",
}

T = TypeVar("T")


@dataclass(frozen=True)
class Behaviour:
    """What the service does with one delivery.

    First waits ``delay_s``, then until ``hold`` (an event of the service's loop) is set, if
    given; then ``crash`` (see the module docstring), or answers the non-OK ``status`` with
    ``details``, or answers OK with ``action`` (``EMPTY`` = an empty response),
    ``retry_after_ms`` and ``reason``. ``hold`` lets a test keep calls open until a step of
    its own has happened, so a "mid-run" precondition holds by construction.
    """

    delay_s: float = 0.0
    hold: asyncio.Event | None = None
    status: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    action: handler_pb2.HandleMessageResponse.Action.ValueType = EMPTY
    retry_after_ms: int = 0
    reason: str = ""
    crash: bool = False
    silent: bool = False
    """Under HandleMessageStream: send no heartbeat while playing (a hung handler)."""

    def response(self) -> handler_pb2.HandleMessageResponse:
        if self.action == EMPTY and not self.retry_after_ms and not self.reason:
            return _Response()
        return _Response(
            action=self.action,
            retry_after_ms=self.retry_after_ms,
            reason=self.reason,
        )


BehaviourFn = Callable[[handler_pb2.Message, int], Behaviour]
"""``behaviour(msg, n)``: n counts the deliveries of msg's (topic, partition, offset), 1 first."""


def always(behaviour: Behaviour) -> BehaviourFn:
    """A behaviour function that does the same for every delivery."""
    return lambda _msg, _n: behaviour


def ack_all(_msg: handler_pb2.Message, _n: int) -> Behaviour:
    """Ack everything at once (the default)."""
    return Behaviour()


@dataclass(frozen=True)
class Delivery:
    """One call as the service saw it. Times are ``time.monotonic()`` seconds."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    attempt: int
    source: str  # "primary", "redrive", "retry" or "unspecified"
    consumer_group: str
    timestamp_ms: int
    n: int  # the count passed to the behaviour: 1 on the first delivery of this offset
    batch: bool
    received_at: float
    outcome: str = "PENDING"
    finished_at: float | None = None
    call: int = -1
    """The batch call that carried it (its index in ``batch_calls``); -1 alone."""

    @property
    def coordinates(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


@dataclass
class _State:
    deliveries: list[Delivery] = field(default_factory=list)
    counts: dict[tuple[str, int, int], int] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    rejected: int = 0
    crashes: int = 0
    batch_calls: list[int] = field(default_factory=list)


class _Crash(Exception):
    """Raised inside a call when its behaviour asks for a crash."""


class TestService:
    """A MessageHandler (+ grpc.health.v1) server on 127.0.0.1, programmable per delivery."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        behaviour: BehaviourFn = ack_all,
        *,
        max_concurrency: int | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        per_message_status: bool = False,
    ) -> None:
        self.behaviour = behaviour
        self.per_message_status = per_message_status
        """Batch answers carry each message's non-OK status in its result."""
        """Read on every call; a test may replace it while the service runs."""
        self.server_credentials = server_credentials
        """TLS (or mTLS) credentials to serve with (kept across restarts); None = plaintext."""
        self.max_concurrency = max_concurrency
        """Calls beyond this many in flight get RESOURCE_EXHAUSTED; None = no limit."""
        self.health = health_aio.HealthServicer()
        self._lock = threading.Lock()
        self._state = _State()
        self._server: Any = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the service is not started")
        return self._port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    async def start(self) -> TestService:
        """Listen on a free port, or on the previous port when restarting."""
        if self._server is not None:
            raise RuntimeError("already running")
        # The health servicer is bound to the loop that serves it: a fresh one per start.
        self.health = health_aio.HealthServicer()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handler_pb2_grpc.add_MessageHandlerServicer_to_server(_Servicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"127.0.0.1:{self._port or 0}"
        port = (
            server.add_secure_port(address, self.server_credentials)
            if self.server_credentials is not None
            else server.add_insecure_port(address)
        )
        if port == 0:
            await server.stop(None)
            raise OSError(f"cannot listen on {address}")
        await self.set_health(True)
        await server.start()
        self._server, self._port = server, port
        return self

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s`` to finish); idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await self.health.enter_graceful_shutdown()
            await server.stop(grace_s)
        await self._reap()

    async def crash(self) -> None:
        """Die abruptly: every in-flight call fails and the port refuses connections."""
        with self._lock:
            self._state.crashes += 1
        await self.stop(grace_s=None)

    async def restart(self) -> TestService:
        """Start again on the same port (after ``crash()`` or ``stop()``)."""
        await self.stop()
        return await self.start()

    async def set_health(self, serving: bool) -> None:
        """SERVING / NOT_SERVING for ``""`` and for the MessageHandler service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def __aenter__(self) -> TestService:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _crash_soon(self) -> None:
        # Stopping the server cancels the calling RPC itself, so the crash runs as a task
        # owned by the service (reaped in stop()).
        task = asyncio.get_running_loop().create_task(self.crash())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self) -> None:
        current = asyncio.current_task()
        others = [t for t in self._tasks if t is not current]
        if others:
            await asyncio.gather(*others, return_exceptions=True)

    # ---------------------------------------------------------------- recorded state

    @property
    def deliveries(self) -> list[Delivery]:
        """A snapshot of every delivery so far, in arrival order."""
        with self._lock:
            return list(self._state.deliveries)

    @property
    def counts(self) -> dict[tuple[str, int, int], int]:
        """A snapshot of {(topic, partition, offset): deliveries}."""
        with self._lock:
            return dict(self._state.counts)

    def count(self, topic: str, partition: int, offset: int) -> int:
        with self._lock:
            return self._state.counts.get((topic, partition, offset), 0)

    def finished(self) -> list[Delivery]:
        """The deliveries whose call has ended."""
        return [d for d in self.deliveries if d.outcome != "PENDING"]

    def outcomes(self) -> dict[str, int]:
        """{outcome: how many deliveries ended so}."""
        result: dict[str, int] = {}
        for delivery in self.deliveries:
            result[delivery.outcome] = result.get(delivery.outcome, 0) + 1
        return result

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._state.in_flight

    @property
    def peak_in_flight(self) -> int:
        """The most calls ever in flight at once (rejected calls not included)."""
        with self._lock:
            return self._state.peak_in_flight

    @property
    def rejected(self) -> int:
        """Calls refused with RESOURCE_EXHAUSTED by the max_concurrency limit."""
        with self._lock:
            return self._state.rejected

    @property
    def batch_calls(self) -> list[int]:
        """The number of messages in each batch call received, in arrival order."""
        with self._lock:
            return list(self._state.batch_calls)

    @property
    def crashes(self) -> int:
        with self._lock:
            return self._state.crashes

    @property
    def errors(self) -> list[BaseException]:
        """Exceptions raised by the behaviour function (a test bug); expect it empty."""
        with self._lock:
            return list(self._state.errors)

    def reset(self) -> None:
        """Forget every delivery, count and error (the peak restarts from now)."""
        with self._lock:
            in_flight = self._state.in_flight
            self._state = _State(in_flight=in_flight, peak_in_flight=in_flight)

    # ---------------------------------------------------------------- used by the servicer

    def _admit(self) -> bool:
        with self._lock:
            limit = self.max_concurrency
            if limit is not None and self._state.in_flight >= limit:
                self._state.rejected += 1
                return False
            self._state.in_flight += 1
            self._state.peak_in_flight = max(self._state.peak_in_flight, self._state.in_flight)
            return True

    def _release(self) -> None:
        with self._lock:
            self._state.in_flight -= 1

    def _receive(self, msg: handler_pb2.Message, *, batch: bool, call: int = -1) -> tuple[int, int]:
        """Record an arriving delivery; returns (its index, n)."""
        coordinates = (msg.topic, msg.partition, msg.offset)
        with self._lock:
            n = self._state.counts.get(coordinates, 0) + 1
            self._state.counts[coordinates] = n
            self._state.deliveries.append(
                Delivery(
                    topic=msg.topic,
                    partition=msg.partition,
                    offset=msg.offset,
                    key=msg.key if msg.has_key else None,
                    value=msg.value if msg.has_value else None,
                    headers=tuple((h.key, h.value) for h in msg.headers),
                    attempt=msg.attempt,
                    source=_SOURCES.get(msg.source, str(msg.source)),
                    consumer_group=msg.consumer_group,
                    timestamp_ms=msg.timestamp_ms,
                    n=n,
                    batch=batch,
                    received_at=time.monotonic(),
                    call=call,
                )
            )
            return len(self._state.deliveries) - 1, n

    def _finish(self, index: int, outcome: str) -> None:
        with self._lock:
            # reset() may have dropped the record meanwhile.
            if index < len(self._state.deliveries):
                delivery = self._state.deliveries[index]
                if delivery.outcome == "PENDING":
                    self._state.deliveries[index] = replace(
                        delivery, outcome=outcome, finished_at=time.monotonic()
                    )

    def _behaviour_failed(self, exc: BaseException) -> None:
        with self._lock:
            self._state.errors.append(exc)

    async def _deliver(
        self,
        msg: handler_pb2.Message,
        *,
        batch: bool,
        chosen: list[Behaviour] | None = None,
        call: int = -1,
    ) -> Behaviour:
        """Record one delivery and play its behaviour, up to (not including) the answer.

        Returns the behaviour (also appended to ``chosen`` as soon as it is known); raises
        _Crash, or CancelledError when the caller went away.
        """
        index, n = self._receive(msg, batch=batch, call=call)
        try:
            behaviour = self.behaviour(msg, n)
        except Exception as exc:
            self._behaviour_failed(exc)
            self._finish(index, "BEHAVIOUR_ERROR")
            return Behaviour(status=grpc.StatusCode.INTERNAL, details=f"behaviour raised {exc!r}")
        if chosen is not None:
            chosen.append(behaviour)
        try:
            if behaviour.delay_s > 0:
                await asyncio.sleep(behaviour.delay_s)
            if behaviour.hold is not None:
                await behaviour.hold.wait()
        except asyncio.CancelledError:
            self._finish(index, "CANCELLED")
            raise
        if behaviour.crash:
            self._finish(index, "CRASH")
            raise _Crash
        if behaviour.status != grpc.StatusCode.OK:
            self._finish(index, behaviour.status.name)
        else:
            self._finish(index, _Response.Action.Name(behaviour.action or ACK))
        return behaviour


class _Servicer(handler_pb2_grpc.MessageHandlerServicer):
    def __init__(self, service: TestService) -> None:
        self._service = service

    async def HandleMessage(
        self, request: handler_pb2.HandleMessageRequest, context: Any
    ) -> handler_pb2.HandleMessageResponse:
        if not self._service._admit():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_concurrency reached")
        try:
            behaviour = await self._service._deliver(request.message, batch=False)
        except _Crash:
            self._service._crash_soon()
            await asyncio.Event().wait()  # cancelled by the crash
            raise
        finally:
            self._service._release()
        if behaviour.status != grpc.StatusCode.OK:
            await context.abort(behaviour.status, behaviour.details)
        return behaviour.response()

    async def HandleMessageStream(
        self, request: handler_pb2.HandleMessageStreamRequest, context: Any
    ) -> AsyncIterator[handler_pb2.HandleMessageStreamEvent]:
        """Plays the behaviour as HandleMessage does, heartbeating every
        ``heartbeat_interval_ms`` meanwhile (none with ``Behaviour.silent``), then answers
        the result event (or fails the call with the behaviour's status)."""
        if not self._service._admit():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_concurrency reached")
        interval_s = (request.heartbeat_interval_ms or 1000) / 1000.0
        chosen: list[Behaviour] = []
        try:
            play = asyncio.ensure_future(
                self._service._deliver(request.message, batch=False, chosen=chosen)
            )
            try:
                while not play.done():
                    await asyncio.wait({play}, timeout=interval_s)
                    if play.done():
                        break
                    if not (chosen and chosen[0].silent):
                        yield handler_pb2.HandleMessageStreamEvent(
                            heartbeat=handler_pb2.Heartbeat(progress="working")
                        )
            finally:
                if not play.done():
                    play.cancel()  # the caller went away: so does the work
                    with contextlib.suppress(asyncio.CancelledError):
                        await play
            behaviour = play.result()
        except _Crash:
            self._service._crash_soon()
            await asyncio.Event().wait()  # cancelled by the crash
            raise
        finally:
            self._service._release()
        if behaviour.status != grpc.StatusCode.OK:
            await context.abort(behaviour.status, behaviour.details)
        yield handler_pb2.HandleMessageStreamEvent(result=behaviour.response())

    async def HandleMessageBatch(
        self, request: handler_pb2.HandleMessageBatchRequest, context: Any
    ) -> handler_pb2.HandleMessageBatchResponse:
        """Plays each message's behaviour concurrently; the first non-OK status (in request
        order) fails the whole call, as a service that answers per call would."""
        if not self._service._admit():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_concurrency reached")
        with self._service._lock:
            call = len(self._service._state.batch_calls)
            self._service._state.batch_calls.append(len(request.messages))
        try:
            results = await asyncio.gather(
                *(self._service._deliver(m, batch=True, call=call) for m in request.messages),
                return_exceptions=True,
            )
            if any(isinstance(r, _Crash) for r in results):
                self._service._crash_soon()
                await asyncio.Event().wait()  # cancelled by the crash
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        finally:
            self._service._release()
        behaviours = [r for r in results if isinstance(r, Behaviour)]
        if self._service.per_message_status:
            return handler_pb2.HandleMessageBatchResponse(
                results=[
                    b.response()
                    if b.status == grpc.StatusCode.OK
                    else _Response(status_code=b.status.value[0], reason=b.details)
                    for b in behaviours
                ]
            )
        for behaviour in behaviours:
            if behaviour.status != grpc.StatusCode.OK:
                await context.abort(behaviour.status, behaviour.details)
        return handler_pb2.HandleMessageBatchResponse(results=[b.response() for b in behaviours])


class ThreadedService:
    """A :class:`TestService` on its own event loop in a background thread.

    For sync tests, or when the proxy under test runs in another loop. Reads (deliveries,
    counts, ...) are safe from any thread; actions that touch the server (``set_health``,
    ``crash``, ``restart``) are sync here and run on the service's loop.
    """

    def __init__(
        self,
        behaviour: BehaviourFn = ack_all,
        *,
        max_concurrency: int | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        timeout_s: float = 10.0,
        per_message_status: bool = False,
    ) -> None:
        self.service = TestService(
            behaviour,
            max_concurrency=max_concurrency,
            server_credentials=server_credentials,
            per_message_status=per_message_status,
        )
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="test-service", daemon=True)

    def __enter__(self) -> ThreadedService:
        self._thread.start()
        if not self._ready.wait(self._timeout_s):
            raise TimeoutError("the test service did not start")
        if self._failure is not None:
            self._thread.join(self._timeout_s)
            raise RuntimeError("the test service failed to start") from self._failure
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the service and its thread; idempotent."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.ident is not None:
            self._thread.join(self._timeout_s)
            if self._thread.is_alive():
                raise TimeoutError("the test service thread did not stop")

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.service.start()
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.service.stop()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the service's loop and return its result."""
        if self._loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the service is not running")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    # Delegation: the service's API, sync.

    @property
    def port(self) -> int:
        return self.service.port

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def behaviour(self) -> BehaviourFn:
        return self.service.behaviour

    @behaviour.setter
    def behaviour(self, value: BehaviourFn) -> None:
        self.service.behaviour = value

    @property
    def max_concurrency(self) -> int | None:
        return self.service.max_concurrency

    @max_concurrency.setter
    def max_concurrency(self, value: int | None) -> None:
        self.service.max_concurrency = value

    @property
    def deliveries(self) -> list[Delivery]:
        return self.service.deliveries

    @property
    def counts(self) -> dict[tuple[str, int, int], int]:
        return self.service.counts

    def count(self, topic: str, partition: int, offset: int) -> int:
        return self.service.count(topic, partition, offset)

    def outcomes(self) -> dict[str, int]:
        return self.service.outcomes()

    @property
    def in_flight(self) -> int:
        return self.service.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self.service.peak_in_flight

    @property
    def rejected(self) -> int:
        return self.service.rejected

    @property
    def errors(self) -> list[BaseException]:
        return self.service.errors

    def reset(self) -> None:
        self.service.reset()

    def set_health(self, serving: bool) -> None:
        self.call(self.service.set_health(serving))

    def crash(self) -> None:
        self.call(self.service.crash())

    def restart(self) -> None:
        self.call(self.service.restart())


Answer = Callable[[handler_pb2.Message], handler_pb2.HandleMessageResponse]


class UnaryOnly(handler_pb2_grpc.MessageHandlerServicer):
    """A hand-written service with HandleMessage only: gRPC answers UNIMPLEMENTED to the batch
    method, as for any method a server does not serve. Records what it got; ``answer`` (acks
    when not given) says what each message gets."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.got: list[handler_pb2.Message] = []
        self.batch_calls = 0
        self._answer = answer

    async def HandleMessage(self, request: Any, context: Any) -> Any:
        self.got.append(request.message)
        if self._answer is not None:
            return self._answer(request.message)
        return handler_pb2.HandleMessageResponse()

    async def HandleMessageBatch(self, request: Any, context: Any) -> Any:
        self.batch_calls += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    def HandleMessageStream(self, request: Any, context: Any) -> Any:
        raise NotImplementedError  # never called: the groups using it are not long-running


async def serve(
    servicer: handler_pb2_grpc.MessageHandlerServicer, port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """Serve a hand-written servicer (one that misbehaves in a way ``TestService`` does not
    model) on 127.0.0.1; returns the started server and its port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler_pb2_grpc.add_MessageHandlerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        await server.stop(None)
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    return server, bound


@contextlib.asynccontextmanager
async def raw_stream_service(
    stream: Callable[[bytes, Any], AsyncIterator[bytes]],
) -> AsyncIterator[str]:
    """A service of ``HandleMessageStream`` only, on 127.0.0.1: ``stream`` gets each request's
    bytes and yields event bytes sent as they are (garbage included, which the generated stubs
    would refuse to encode). Yields the address."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "consumerproxy.v1.MessageHandler",
                {"HandleMessageStream": grpc.unary_stream_rpc_method_handler(stream)},
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
