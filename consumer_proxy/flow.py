"""Flow control: the circuit breaker gate and the concurrency limiter of a group.

The breaker is pybreaker's state machine used from asyncio: pushes ask ``try_acquire`` before
they start (open: wait; half-open: one probe at a time), and every finished push reports its
classification with ``record``. Only service-level failures count (the status table marks
them), so an outage opens the breaker instead of burning messages' attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

import pybreaker

from .config import CircuitBreakerConfig

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class _ServiceFailure(Exception):
    """Raised inside pybreaker to count one service-level failure."""


def _fail() -> None:
    raise _ServiceFailure


def _succeed() -> None:
    return None


class Breaker:
    """A group's circuit breaker, driven from the event loop."""

    def __init__(
        self,
        group: str,
        config: CircuitBreakerConfig,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        self._group = group
        self._reset_timeout_s = config.reset_timeout_s
        self._on_change = on_change
        self._probe_in_flight = False
        self._changed = asyncio.Event()
        outer = self

        class _Listener(pybreaker.CircuitBreakerListener):
            def state_change(self, cb: object, old: object, new: object) -> None:
                outer._state_changed(str(getattr(old, "name", old)), str(getattr(new, "name", new)))

        self._cb = pybreaker.CircuitBreaker(
            fail_max=config.failure_threshold,
            reset_timeout=config.reset_timeout_s,
            listeners=[_Listener()],
            name=group,
        )

    def _state_changed(self, old: str, new: str) -> None:
        if new != HALF_OPEN:
            self._probe_in_flight = False
        log.warning("group %s: circuit breaker %s -> %s", self._group, old, new)
        self._changed.set()
        self._changed = asyncio.Event()
        if self._on_change is not None:
            self._on_change(old, new)

    @property
    def state(self) -> str:
        """closed, open or half-open."""
        return str(self._cb.current_state)

    @property
    def is_open(self) -> bool:
        """True while pushing is stopped or limited to a probe."""
        return self.state != CLOSED

    def seconds_until_probe(self) -> float:
        """How long until an open breaker lets a probe through (0 when not open)."""
        opened = self._cb._state_storage.opened_at
        if self.state != OPEN or opened is None:
            return 0.0
        elapsed = (datetime.now(UTC) - opened).total_seconds()
        return max(0.0, self._reset_timeout_s - elapsed)

    def try_acquire(self) -> tuple[bool, bool]:
        """(may push now, this push is the half-open probe)."""
        state = self.state
        if state == CLOSED:
            return True, False
        if state == OPEN:
            if self.seconds_until_probe() > 0:
                return False, False
            self._cb.half_open()
        if self._probe_in_flight:
            return False, False
        self._probe_in_flight = True
        return True, True

    async def acquire(self) -> bool:
        """Wait until a push may start; returns whether it is the probe. Never busy-waits."""
        while True:
            allowed, probe = self.try_acquire()
            if allowed:
                return probe
            changed = self._changed
            timeout = self.seconds_until_probe() or None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=timeout)

    def record(self, service_failure: bool, probe: bool) -> None:
        """Report a finished push."""
        if probe:
            self._probe_in_flight = False
        state = self.state
        if service_failure:
            if state == OPEN and not probe:
                return  # a call from before the breaker opened; it is open already
            with contextlib.suppress(_ServiceFailure, pybreaker.CircuitBreakerError):
                self._cb.call(_fail)
        elif state != OPEN or probe:
            with contextlib.suppress(pybreaker.CircuitBreakerError):
                self._cb.call(_succeed)
        if probe and self.state == HALF_OPEN:
            self._changed.set()  # the probe ended without a verdict; let another one go


class StaticLimiter:
    """A fixed number of concurrent pushes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)

    async def acquire(self) -> None:
        """Wait for a slot."""
        await self._sem.acquire()

    def release(self, rtt_s: float, dropped: bool) -> None:
        """Free a slot; ``dropped`` says the call was rejected or timed out (unused here)."""
        self._sem.release()


class RateLimiter:
    """A token bucket: at most ``rate_per_s`` acquisitions a second, bursts of one second."""

    def __init__(self, rate_per_s: float) -> None:
        self._rate = rate_per_s
        self._capacity = max(1.0, rate_per_s)
        self._tokens = self._capacity
        self._updated = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        """Wait for one token."""
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(
                    self._capacity, self._tokens + (now - self._updated) * self._rate
                )
                self._updated = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self._rate)
