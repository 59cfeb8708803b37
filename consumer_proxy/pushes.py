"""The group's push, as its config chooses: ``build_push``.

unary calls from a ready queue (``push.UnaryPush``), streaming calls under
``delivery.long_running`` (``stream.StreamPush``), or batch mode (``delivery.batch``, always or
auto) from a ready deque (``batch_push.BatchPush``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .batch_push import BatchPush as BatchPush
from .config import DeliveryConfig
from .core.batching import BatchLimits
from .core.partitions import Delivery
from .push import PushParts, UnaryPush
from .readyq import ReadyDeque
from .stream import StreamPush


def build_push(
    parts: PushParts,
    ready: asyncio.Queue[Delivery] | ReadyDeque,
    workers: int,
    delivery: DeliveryConfig,
    on_problem: Callable[[], None],
) -> UnaryPush | BatchPush:
    """The group's push: unary with a ready queue (streaming calls under
    ``delivery.long_running``), batch mode (``delivery.batch``, always or auto) with a deque."""
    batch = delivery.batch
    if batch is None:
        assert isinstance(ready, asyncio.Queue)
        if delivery.long_running is not None:  # (validate refuses it with batch mode)
            return StreamPush(parts, ready, workers, delivery.long_running)
        return UnaryPush(parts, ready, workers)
    assert isinstance(ready, ReadyDeque)
    limits = BatchLimits(batch.max_messages, batch.max_bytes)
    auto = batch.mode == "auto"
    return BatchPush(parts, ready, workers, limits, batch.linger_ms, on_problem, auto)
