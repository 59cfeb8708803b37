"""Poll for a condition instead of sleeping: ``wait_until`` and its asyncio twin."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


def _describe(condition: Callable[..., object], message: str | None) -> str:
    if message:
        return message
    return getattr(condition, "__qualname__", None) or repr(condition)


def wait_until(
    condition: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str | None = None,
) -> T:
    """Call ``condition`` until it returns a truthy value and return that value.

    Raises AssertionError naming ``message`` (or the condition) and its last value when
    ``timeout`` seconds pass first. Exceptions from ``condition`` propagate at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {_describe(condition, message)}"
                f" (last value: {value!r})"
            )
        time.sleep(interval)


# The value returned is truthy: never None, whatever the condition returns while it waits.
@overload
async def async_wait_until(
    condition: Callable[[], Awaitable[T | None]],
    timeout: float = ...,
    interval: float = ...,
    message: str | None = ...,
) -> T: ...


@overload
async def async_wait_until(
    condition: Callable[[], T | None],
    timeout: float = ...,
    interval: float = ...,
    message: str | None = ...,
) -> T: ...


async def async_wait_until(
    condition: Callable[[], T | Awaitable[T | None] | None],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str | None = None,
) -> T:
    """Like ``wait_until`` without blocking the event loop; ``condition`` may be async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {_describe(condition, message)}"
                f" (last value: {value!r})"
            )
        await asyncio.sleep(interval)
