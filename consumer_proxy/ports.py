"""The I/O edges of a group, as small Protocols: what the shell (``group.py``) needs of them.

``Fetcher`` (Kafka consumer), ``Dispatcher`` (gRPC to the service instances) and
``DeadLetterWriter`` (the DLQ producer) implement them; mypy checks that they do. Decisions
never sit behind these: they are in ``core/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from confluent_kafka import TopicPartition

from .core.batching import BatchOutcome
from .core.outcomes import Classification
from .core.partitions import TP
from .core.records import Headers


class MessageSource(Protocol):
    """The group's Kafka consumer; every call runs off the event loop."""

    positions: dict[TP, int]
    positions_read: int  # how many times ``positions`` was read (it is re-read now and then)

    async def start(self) -> None: ...
    async def consume(self, max_messages: int, timeout_s: float) -> list[Any]: ...
    async def set_paused(self, pause: Sequence[TP], resume: Sequence[TP]) -> None: ...
    async def commit(self, offsets: Callable[[], list[TopicPartition]]) -> list[TopicPartition]: ...
    async def position(self, tp: TP) -> int | None: ...
    async def watermarks(self, partitions: Sequence[TP]) -> dict[TP, int]: ...
    async def close(self) -> None: ...


class Instance(Protocol):
    """One service instance as the shell sees it."""

    @property
    def target(self) -> str: ...
    @property
    def ejected(self) -> bool: ...


class Pusher(Protocol):
    """Pushes requests to the service's instances and classifies each result."""

    def start(self) -> None: ...
    def pick(self) -> Any: ...
    async def push(self, request: Any, endpoint: Any) -> Classification: ...
    async def push_batch(self, payload: bytes, count: int, endpoint: Any) -> BatchOutcome: ...
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
