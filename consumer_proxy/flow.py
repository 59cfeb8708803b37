"""Flow control of a group: the circuit breaker, the concurrency limiters and the rate limit.

Each piece is a pure-logic core driven by an explicit clock (unit-tested with a fake one) plus,
where pushes have to wait, a thin asyncio wrapper:

- :class:`Breaker`: pybreaker's state machine used from asyncio. A push asks ``acquire`` before
  it starts (open: wait for the probe time; half-open: one probe at a time) and reports its
  classification with ``record``. Only service-level failures count (the status table marks
  them), so an outage opens the breaker instead of burning messages' attempts.
- :class:`StaticLimiter`: ``concurrency: N``.
- :class:`AdaptiveLimit` (the logic) and :class:`AdaptiveLimiter` (the wrapper):
  ``concurrency: adaptive``.
- :class:`TokenBucket` (the logic) and :class:`RateLimiter` (the wrapper): ``rate_limit_per_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import pybreaker

from .config import AdaptiveConfig, CircuitBreakerConfig, DeliveryConfig
from .core.outcomes import Classification

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"

Clock = Callable[[], float]


class _ServiceFailure(Exception):
    """Raised inside pybreaker to count one service-level failure."""


def _fail() -> None:
    raise _ServiceFailure


def _succeed() -> None:
    return None


class Breaker:
    """A group's circuit breaker, driven from the event loop.

    pybreaker keeps the state and counts consecutive service-level failures (a success resets
    the count); this class adds what pybreaker's Tornado-only async support lacks: waiting
    without polling, the probe time on an injectable monotonic clock, and a single half-open
    probe. In half-open only the probe's result decides: results of calls that started before
    the breaker opened are stale evidence and are ignored.
    """

    def __init__(
        self,
        group: str,
        config: CircuitBreakerConfig,
        on_change: Callable[[str, str], None] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._group = group
        self._reset_timeout_s = config.reset_timeout_s
        self._on_change = on_change
        self._clock = clock
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.successes = 0
        """Calls recorded without a service failure: evidence that the service answers."""
        self.openings = 0
        """Transitions to open: a call in flight across one is not charged to its message."""
        self._changed = asyncio.Event()
        outer = self

        class _Listener(pybreaker.CircuitBreakerListener):
            def state_change(self, cb: object, old: object, new: object) -> None:
                outer._state_changed(str(getattr(old, "name", old)), str(getattr(new, "name", new)))

        # pybreaker's own reset timer (wall clock) is never consulted: try_acquire moves to
        # half-open on our clock, and record() does not call into an open breaker.
        self._cb = pybreaker.CircuitBreaker(
            fail_max=config.failure_threshold,
            reset_timeout=config.reset_timeout_s,
            listeners=[_Listener()],
            name=group,
        )

    def _state_changed(self, old: str, new: str) -> None:
        if new == OPEN:
            self._opened_at = self._clock()
            self.openings += 1
            log.warning(
                "group %s: circuit breaker %s -> open: delivery paused, a probe in %.1fs",
                self._group,
                old,
                self._reset_timeout_s,
            )
        elif new == HALF_OPEN:
            log.info("group %s: circuit breaker open -> half-open: probing", self._group)
        else:
            log.warning("group %s: circuit breaker %s -> closed: pushing again", self._group, old)
        if new != HALF_OPEN:
            self._probe_in_flight = False
        self._wake()
        if self._on_change is not None:
            self._on_change(old, new)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def state(self) -> str:
        """closed, open or half-open."""
        return str(self._cb.current_state)

    @property
    def is_open(self) -> bool:
        """True while pushing is stopped or limited to a probe."""
        return self.state != CLOSED

    @property
    def failures(self) -> int:
        """Consecutive service-level failures counted so far."""
        return int(self._cb.fail_counter)

    def seconds_until_probe(self) -> float:
        """How long until an open breaker lets a probe through (0 when not open)."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self._reset_timeout_s - (self._clock() - self._opened_at))

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
        """Wait until a push may start; returns whether it is the probe.

        Never busy-waits: a waiter sleeps until the state changes or the probe time comes.
        """
        while True:
            allowed, probe = self.try_acquire()
            if allowed:
                return probe
            changed = self._changed
            timeout = self.seconds_until_probe() or None
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives as the event fires, and a worker that ignores its cancel hangs shutdown.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await changed.wait()

    def record(self, service_failure: bool, probe: bool, answered: bool = True) -> None:
        """Report a finished push: ``service_failure`` as the classification says.
        ``answered`` False: a success that is no answer (a long call's heartbeat: an instance
        that dies mid-call heartbeats too), so no evidence that the service answers others."""
        cb = self._cb
        if not service_failure and answered:
            self.successes += 1
        if not (service_failure or probe) and cb.fail_counter == 0 and cb.current_state == CLOSED:
            return  # the common case, once per push: nothing for pybreaker to learn
        if probe:
            self._probe_in_flight = False
        state = self.state
        if state == OPEN or (state == HALF_OPEN and not probe):
            # Open: nothing decides before the probe. Half-open: only the probe decides.
            if probe:
                self._wake()
            return
        if service_failure:
            with contextlib.suppress(_ServiceFailure, pybreaker.CircuitBreakerError):
                self._cb.call(_fail)
        else:
            with contextlib.suppress(pybreaker.CircuitBreakerError):
                self._cb.call(_succeed)

    def abandon_probe(self) -> None:
        """The probe never reached the service (revoked, cancelled): let another one go."""
        if self._probe_in_flight:
            self._probe_in_flight = False
            self._wake()


class ConcurrencyLimiter(Protocol):
    """What a group's workers need from a concurrency limiter."""

    @property
    def limit(self) -> int:
        """Calls allowed in flight now."""
        ...

    async def acquire(self) -> None:
        """Wait for a slot."""
        ...

    def release(self, rtt_s: float, result: Classification | None) -> None:
        """Free a slot; ``result`` is None when no call was made with it."""
        ...


class StaticLimiter:
    """A fixed number of concurrent pushes (``concurrency: N``).

    The group runs exactly N workers, each with at most one push under way, so the worker
    pool is the limit: this limiter never has to make anyone wait, and keeps no semaphore on
    the per-message path.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit

    @property
    def limit(self) -> int:
        """The configured number (= the group's worker count)."""
        return self._limit

    async def acquire(self) -> None:
        """Nothing to wait for: a worker holds its slot for its whole life."""

    def release(self, rtt_s: float, result: Classification | None) -> None:
        """A fixed limit learns nothing from the result: per-message backoff and
        ``retry_after`` still apply, but only an adaptive limit slows the whole group."""


MAX_HOLD_S = 60.0
"""The longest a ``retry_after`` holds the limit's growth: the service's answer is a hint (its
redelivery delay is capped at ``backoff.max_ms``), and one absurd value must not freeze the
limit for the life of the process."""


class AdaptiveLimit:
    """The adaptive concurrency limit, pure logic: AIMD with a latency guard.

    Why AIMD and not a gradient / Vegas limiter alone: the overload signals this proxy gets are
    mostly explicit (RESOURCE_EXHAUSTED, ``retry_after``, deadlines), and a service that sheds
    load answers at once, so its latency does not rise at all; a purely delay-based limiter
    would grow right through such a service's capacity. Loss-based AIMD (TCP's rule) reacts to
    those signals; a Vegas-style comparison of recent latency with a baseline covers services
    that queue instead of refusing.

    - Growth, only while the limit is in use (at least half of it in flight: an idle group
      proves nothing) and latency holds: slow start first (+1 per success, doubling each round
      trip) until the first overload, then +1/limit per success (+1 per round trip).
    - Decrease on an overload (RESOURCE_EXHAUSTED, a ``retry_after``, a timeout) and when a
      window's mean latency exceeds ``tolerance`` x the baseline: x``backoff``, halving when
      it ends slow start. An overload counts only for a call started after the last decrease
      (TCP NewReno's recovery point): calls sent under an older limit say nothing about the
      new one, so the burst of rejections they earn is one congestion event, not many (else
      one burst would collapse the limit to the minimum); and while the limit is still too
      high, the next refused call brings the next decrease at once, without waiting a round
      trip (refusals come back much faster than successes). A latency decrease waits a round
      trip, as does growth after any decrease.
    - ``retry_after`` also holds growth for that long (``MAX_HOLD_S`` at most).
    - The round trip (``srtt``) is an EWMA of successful calls; the latency window lasts one
      srtt; the baseline is the lowest window mean, drifting up with time constant
      ``baseline_tau_s`` so that a service that became slower for good is accepted eventually.

    Bounded by ``[min_limit, max_limit]``. ``now`` arguments are seconds on any monotonic clock.
    """

    def __init__(
        self,
        min_limit: int,
        max_limit: int,
        initial: int,
        *,
        backoff: float = 0.9,
        tolerance: float = 2.0,
        min_window_s: float = 0.005,
        baseline_tau_s: float = 60.0,
    ) -> None:
        if not 1 <= min_limit <= initial <= max_limit:
            raise ValueError(
                f"need 1 <= min <= initial <= max, got {min_limit}, {initial}, {max_limit}"
            )
        self.min_limit = min_limit
        self.max_limit = max_limit
        self._limit = float(initial)
        self._backoff = backoff
        self._tolerance = tolerance
        self._min_window_s = min_window_s
        self._baseline_tau_s = baseline_tau_s
        self.slow_start = True
        self.srtt: float | None = None
        self.baseline: float | None = None
        self._window_start: float | None = None
        self._window_sum = 0.0
        self._window_n = 0
        self._last_decrease = -math.inf
        self._quiet_until = -math.inf  # no growth, no latency decrease before this
        self._latency_high = False  # the last latency window was above tolerance: no growth
        self._hold_until = -math.inf  # no growth before this (retry_after)
        self.decreases = 0

    @property
    def limit(self) -> int:
        """The current limit: calls allowed in flight."""
        return max(self.min_limit, min(self.max_limit, int(self._limit)))

    @property
    def value(self) -> float:
        """The limit before rounding down (for tests and diagnostics)."""
        return self._limit

    def _round_trip(self) -> float:
        return max(self.srtt or 0.0, self._min_window_s)

    def on_success(self, now: float, rtt_s: float, in_flight: int) -> None:
        """A call the service handled, ``rtt_s`` long; ``in_flight`` counts it too."""
        rtt_s = max(rtt_s, 0.0)
        self.srtt = rtt_s if self.srtt is None else self.srtt + (rtt_s - self.srtt) / 8
        if self._close_window(now, rtt_s):
            return
        if (
            self._latency_high
            or now < self._quiet_until
            or now < self._hold_until
            or in_flight * 2 < self._limit
        ):
            return
        step = 1.0 if self.slow_start else 1.0 / self._limit
        self._limit = min(float(self.max_limit), self._limit + step)

    def on_overload(self, now: float, rtt_s: float, hold_s: float = 0.0) -> None:
        """RESOURCE_EXHAUSTED, a ``retry_after`` of ``hold_s`` seconds, or a timeout, for a
        call that took ``rtt_s``."""
        if hold_s > 0:
            self._hold_until = max(self._hold_until, now + min(hold_s, MAX_HOLD_S))
        if now - rtt_s >= self._last_decrease:
            self._decrease(now)

    def _close_window(self, now: float, rtt_s: float) -> bool:
        """Add to the latency window; when it closes, compare with the baseline.

        Returns whether latency was too high (and the limit was decreased).
        """
        if self._window_start is None:
            self._window_start = now
        self._window_sum += rtt_s
        self._window_n += 1
        length = now - self._window_start
        if length < self._round_trip():
            return False
        mean = self._window_sum / self._window_n
        self._window_start, self._window_sum, self._window_n = now, 0.0, 0
        if self.baseline is None or mean < self.baseline:
            self.baseline = mean
        else:
            self.baseline += (mean - self.baseline) * min(1.0, length / self._baseline_tau_s)
        self._latency_high = mean > self._tolerance * self.baseline
        if self._latency_high and now >= self._quiet_until:
            self._decrease(now)
            return True
        return False

    def _decrease(self, now: float) -> None:
        factor = 0.5 if self.slow_start else self._backoff
        self.slow_start = False
        self._limit = max(float(self.min_limit), self._limit * factor)
        self._last_decrease = now
        self._quiet_until = now + self._round_trip()
        self.decreases += 1


class AdaptiveLimiter:
    """``concurrency: adaptive``: slots follow an :class:`AdaptiveLimit`.

    Waiters queue in FIFO order; a release hands freed slots straight to them, so waking costs
    one task per slot, not one per waiter. ``on_change(limit)`` runs whenever the limit moves.
    """

    def __init__(
        self,
        config: AdaptiveConfig,
        on_change: Callable[[int], None] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.core = AdaptiveLimit(config.min, config.max, config.initial)
        self._on_change = on_change
        self._clock = clock
        self._held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._last_limit = self.core.limit

    @property
    def limit(self) -> int:
        """The current limit."""
        return self.core.limit

    @property
    def held(self) -> int:
        """Slots taken now."""
        return self._held

    async def acquire(self) -> None:
        """Wait for a slot."""
        if not self._waiters and self._held < self.core.limit:
            self._held += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._free()  # the slot was handed over just as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(future)
            raise

    def release(self, rtt_s: float, result: Classification | None) -> None:
        """Free a slot and learn from the call made with it (None: no call was made)."""
        in_flight = self._held
        if result is not None:
            now = self._clock()
            if result.slow_down:
                self.core.on_overload(now, rtt_s, result.retry_after_ms / 1000.0)
            elif not result.service_failure:
                # An outage (UNAVAILABLE, ...) says nothing about capacity: the breaker's job.
                self.core.on_success(now, rtt_s, in_flight)
        limit = self.core.limit
        if limit != self._last_limit:
            self._last_limit = limit
            if self._on_change is not None:
                self._on_change(limit)
        self._free()

    def _free(self) -> None:
        self._held -= 1
        while self._waiters and self._held < self.core.limit:
            future = self._waiters.popleft()
            if not future.done():
                self._held += 1
                future.set_result(None)


class TokenBucket:
    """A token bucket, pure logic: ``rate_per_s`` tokens a second, holding at most ``burst``.

    A caller reserves the tokens it needs at once and is told when they are paid for: the
    bucket goes into debt for tokens not yet there, and every later reservation waits behind
    that debt. So callers go in the order they asked, a call of many messages goes as soon as
    its own tokens are there (never sharing the refill with calls queued beside it), and a call
    larger than the burst waits for the rest.
    """

    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = burst
        self._updated = now

    def reserve(self, now: float, count: int = 1) -> float:
        """Take ``count`` tokens: 0.0 when they were there, else the seconds until they are."""
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate_per_s)
        self._updated = now
        self._tokens -= count
        return max(0.0, -self._tokens / self.rate_per_s)


class RateLimiter:
    """At most ``rate_per_s`` messages a second for the group, in bursts of up to one second."""

    def __init__(self, rate_per_s: float, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.bucket = TokenBucket(rate_per_s, max(1.0, rate_per_s), clock())

    async def acquire(self, count: int = 1) -> None:
        """Wait for ``count`` tokens: one per message of a call (one timed sleep at most).

        A caller cancelled while it waits does not give its tokens back: the callers behind it
        wait longer than they had to, never less.
        """
        wait = self.bucket.reserve(self._clock(), count)
        if wait > 0:
            await asyncio.sleep(wait)


def group_limiter(delivery: DeliveryConfig, on_change: Callable[[int], None]) -> ConcurrencyLimiter:
    """The concurrency limiter ``delivery.concurrency`` asks for (``on_change``: the adaptive
    limit's gauge)."""
    if delivery.concurrency == "adaptive":
        return AdaptiveLimiter(delivery.adaptive, on_change=on_change)
    return StaticLimiter(delivery.concurrency)
