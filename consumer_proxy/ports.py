"""The I/O edges of a group, as small Protocols: what the shell (``group.py`` and the objects
it runs) needs of them.

``Fetcher`` (Kafka consumer), ``Dispatcher`` (gRPC to the service instances) and
``DeadLetterWriter`` (the DLQ and retry tier producer) implement them; mypy checks that they
do. ``GroupRunner`` is given an ``OpenEdges`` factory and builds none of them itself:
``adapters.RealEdges`` builds the real ones. Decisions never sit behind these: they are in
``core/``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import TopicPartition

from .core.batching import BatchOutcome
from .core.heartbeat import CallWatch
from .core.outcomes import Classification
from .core.partitions import TP
from .core.records import Headers

if TYPE_CHECKING:
    from .config import GroupConfig
    from .core.tracecontext import Metadata
    from .health import KafkaLink
    from .tracing import Tracer

Clock = Callable[[], float]
"""Monotonic seconds (the event loop's clock for the real group)."""


class RebalanceListener(Protocol):
    """What the group runner does when partitions come and go (runs on the event loop)."""

    async def partitions_assigned(self, committed: Sequence[TopicPartition]) -> None:
        """New partitions with their committed offsets and metadata."""

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        """Partitions leaving; return the final offsets to commit for them."""

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Partitions taken away without a chance to commit."""


class MessageSource(Protocol):
    """The group's Kafka consumer; every call runs off the event loop."""

    positions: dict[TP, int]
    positions_read: int  # how many times ``positions`` was read (it is re-read now and then)

    async def start(self) -> None: ...
    async def consume(self, max_messages: int, timeout_s: float) -> list[Any]: ...
    async def set_paused(self, pause: Sequence[TP], resume: Sequence[TP]) -> None: ...
    async def commit(self, offsets: Callable[[], list[TopicPartition]]) -> list[TopicPartition]: ...
    async def send_commit(
        self, offsets: Callable[[], list[TopicPartition]]
    ) -> asyncio.Future[list[TopicPartition]] | None:
        """Send ``offsets()`` without waiting for the broker: its answer to await later (the
        committed list, or KafkaException; it may never come), or None if nothing was sent."""
        ...

    async def position(self, tp: TP) -> int | None: ...
    async def watermarks(self, partitions: Sequence[TP]) -> dict[TP, int]: ...
    async def close(self) -> None: ...


class Pusher(Protocol):
    """Pushes requests to the service's instances and classifies each result."""

    def start(self) -> None: ...
    def pick(self) -> Any: ...
    async def push(
        self, request: Any, endpoint: Any, metadata: Metadata | None = None
    ) -> Classification: ...
    async def push_batch(
        self, payload: bytes, count: int, endpoint: Any, metadata: Metadata | None = None
    ) -> BatchOutcome: ...
    def batches(self, endpoint: Any) -> bool: ...
    def batch_support(self) -> str: ...
    def instances(self) -> list[dict[str, Any]]: ...
    async def push_stream(
        self,
        request: Any,
        endpoint: Any,
        watch: CallWatch,
        on_heartbeat: Callable[[float], None],
        metadata: Metadata | None = None,
    ) -> Classification: ...
    async def close(self) -> None: ...


class DeadLetterSink(Protocol):
    """Writes DLQ records; ``write`` returns only once the broker confirmed (acks=all)."""

    async def write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        on_failure: Any = None,
    ) -> int: ...
    async def close(self, timeout_s: float = 10.0) -> None: ...
    def refusal(self) -> str | None: ...


@dataclass(frozen=True)
class Edges:
    """A running group's I/O edges."""

    source: MessageSource
    pusher: Pusher
    sink: DeadLetterSink
    clock: Clock
    tracer: Tracer | None = None
    """The group's tracer (``tracing``); None while tracing is off."""


@dataclass(frozen=True)
class EdgeHooks:
    """What a group gives the factory of its edges."""

    listener: RebalanceListener
    """Told of rebalances (the consumer's callbacks)."""
    link: KafkaLink
    """The consumer's view of Kafka, for health."""
    stopping: asyncio.Event
    """Set when the group stops: a factory still waiting (for topics) gives up."""
    health_changed: Callable[[], None]
    """Told when something health reads changed (the DLQ refuses, Kafka is unreachable)."""


class OpenEdges(Protocol):
    """Builds a group's edges when it runs (None: the group stopped meanwhile). The runner
    starts the source (``MessageSource.start``) and closes all three at shutdown."""

    async def __call__(self, group: GroupConfig, hooks: EdgeHooks) -> Edges | None: ...
