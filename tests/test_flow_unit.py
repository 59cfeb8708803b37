"""Flow control logic with fake clocks: the adaptive limit, the breaker, the token bucket."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_proxy.config import AdaptiveConfig, CircuitBreakerConfig
from consumer_proxy.core.outcomes import Classification, Outcome
from consumer_proxy.flow import (
    CLOSED,
    HALF_OPEN,
    MAX_HOLD_S,
    OPEN,
    AdaptiveLimit,
    AdaptiveLimiter,
    Breaker,
    TokenBucket,
)
from tests.support.clock import Clock

ACK = Classification(Outcome.ACK, "OK")
EXHAUSTED = Classification(Outcome.RETRY, "RESOURCE_EXHAUSTED", slow_down=True)
UNAVAILABLE = Classification(Outcome.RETRY, "UNAVAILABLE", counted=False, service_failure=True)


# -- AdaptiveLimit ---------------------------------------------------------------------------


def busy_round(limit: AdaptiveLimit, now: float, rtt: float) -> None:
    """One round trip of successes with the limit fully used."""
    n = limit.limit
    for i in range(n):
        limit.on_success(now + rtt * (i + 1) / n, rtt, n)


def test_slow_start_doubles_the_limit_each_round_trip_while_it_is_used() -> None:
    limit = AdaptiveLimit(1, 1000, 4)
    now = 0.0
    seen = []
    for _ in range(4):
        busy_round(limit, now, 0.01)
        now += 0.01
        seen.append(limit.limit)
    assert seen == [8, 16, 32, 64]


def test_an_idle_group_does_not_grow_its_limit() -> None:
    # Given a limit of 20 with only 2 calls ever in flight
    limit = AdaptiveLimit(1, 1000, 20)
    for i in range(500):
        limit.on_success(i * 0.01, 0.01, 2)
    # Then the limit has not moved: low use proves nothing about capacity
    assert limit.limit == 20


def test_the_first_overload_halves_and_later_ones_back_off_by_a_tenth() -> None:
    limit = AdaptiveLimit(1, 1000, 40)
    busy_round(limit, 0.0, 0.01)  # srtt ~ 10 ms; slow start took it to 80
    assert limit.limit == 80
    limit.on_overload(1.0, 0.001)
    assert limit.limit == 40 and not limit.slow_start
    limit.on_overload(1.02, 0.001)
    assert limit.limit == 36


def test_rejections_of_calls_sent_before_a_decrease_are_one_congestion_event() -> None:
    limit = AdaptiveLimit(1, 1000, 100)
    busy_round(limit, 0.0, 0.02)
    before = limit.value
    for i in range(50):  # 50 calls sent at 0.99 s, refused within 5 ms of each other
        now = 1.0 + i * 0.0001
        limit.on_overload(now, now - 0.99)
    assert limit.value == pytest.approx(before / 2)
    assert limit.decreases == 1
    # A call sent after the decrease and refused too: the limit is still too high, and the
    # next decrease comes at once
    limit.on_overload(1.0052, 0.0002)
    assert limit.value == pytest.approx(before / 2 * 0.9)
    assert limit.decreases == 2


def test_congestion_avoidance_adds_about_one_per_round_trip() -> None:
    limit = AdaptiveLimit(1, 1000, 50)
    busy_round(limit, 0.0, 0.01)
    limit.on_overload(0.02, 0.001)  # leave slow start at 50
    now = 0.1
    start = limit.value
    for _ in range(10):
        busy_round(limit, now, 0.01)
        now += 0.01
    assert start + 8 <= limit.value <= start + 11


def test_the_limit_stays_within_min_and_max() -> None:
    limit = AdaptiveLimit(3, 12, 5)
    now = 0.0
    for _ in range(20):
        busy_round(limit, now, 0.01)
        now += 0.01
    assert limit.limit == 12
    for _ in range(100):
        now += 1.0
        limit.on_overload(now, 0.001)
    assert limit.limit == 3


def test_latency_well_above_the_baseline_shrinks_the_limit() -> None:
    limit = AdaptiveLimit(1, 1000, 40)
    now = 0.0
    for _ in range(5):  # establish a 10 ms baseline
        busy_round(limit, now, 0.01)
        now += 0.01
    limit.on_overload(now, 0.001)  # out of slow start
    grown = limit.value
    # When latency triples for a few round trips
    for _ in range(5):
        busy_round(limit, now, 0.03)
        now += 0.03
    # Then the limit went down, not up
    assert limit.value < grown * 0.9
    assert limit.baseline == pytest.approx(0.01, rel=0.2)


def test_latency_within_tolerance_lets_the_limit_grow() -> None:
    limit = AdaptiveLimit(1, 1000, 40)
    now = 0.0
    rng = random.Random(3)
    for _ in range(5):
        busy_round(limit, now, 0.01)
        now += 0.01
    limit.on_overload(now, 0.001)
    start = limit.value
    for _ in range(20):  # jitter up to +50%
        busy_round(limit, now, 0.01 * (1 + rng.random() * 0.5))
        now += 0.015
    assert limit.value > start + 10


def test_retry_after_holds_growth_for_that_long() -> None:
    limit = AdaptiveLimit(1, 1000, 20)
    busy_round(limit, 0.0, 0.01)
    limit.on_overload(0.02, 0.001, hold_s=1.0)
    held = limit.value
    now = 0.1
    while now < 1.0:
        busy_round(limit, now, 0.01)
        now += 0.01
    assert limit.value == held
    busy_round(limit, 1.05, 0.01)
    assert limit.value > held


def test_a_retry_after_from_the_far_future_holds_growth_for_at_most_the_cap() -> None:
    # Given a limit that grew, then one answer whose retry_after is a timestamp in epoch ms
    # (a service's bug), 56 years read as a delay
    limit = AdaptiveLimit(1, 1000, 20)
    busy_round(limit, 0.0, 0.01)
    limit.on_overload(0.02, 0.001, hold_s=1_764_000_000.0)
    held = limit.value
    # When healthy, busy traffic goes on past the cap
    now = 0.1
    while now < MAX_HOLD_S + 1:
        busy_round(limit, now, 0.01)
        now += 0.01
    # Then the limit grows again (it waited no longer than the cap)
    assert limit.value > held


def simulate(
    limit: AdaptiveLimit,
    *,
    capacity: int,
    service_s: float,
    queueing: bool,
    seconds: float,
    seed: int = 1,
) -> list[tuple[float, int]]:
    """A proxy with endless backlog against a service of ``capacity`` parallel slots.

    queueing=False: calls beyond capacity are refused at once (RESOURCE_EXHAUSTED);
    queueing=True: they wait in the service's queue (latency grows instead).
    Returns (time, limit) after every finished call.
    """
    rng = random.Random(seed)
    now = 0.0
    events: list[tuple[float, int, bool, float]] = []  # (end, seq, ok, started)
    busy_until: list[float] = []  # service slots, as end times (queueing model)
    in_flight = 0
    seq = 0
    samples = []
    while now < seconds:
        while in_flight < limit.limit:
            service = service_s * (0.8 + 0.4 * rng.random())
            running = [t for t in busy_until if t > now]
            if queueing:
                start = now if len(running) < capacity else sorted(running)[-capacity]
                busy_until = [*running, start + service]
                heapq.heappush(events, (start + service, seq, True, now))
            elif len(running) < capacity:
                busy_until = [*running, now + service]
                heapq.heappush(events, (now + service, seq, True, now))
            else:
                heapq.heappush(events, (now + 0.0005, seq, False, now))
            seq += 1
            in_flight += 1
        end, _, ok, started = heapq.heappop(events)
        now = end
        if ok:
            limit.on_success(now, now - started, in_flight)
        else:
            limit.on_overload(now, now - started)
        in_flight -= 1
        samples.append((now, limit.limit))
    return samples


@pytest.mark.parametrize("initial", [2, 60])
def test_against_a_service_that_refuses_beyond_k_the_limit_settles_near_k(initial: int) -> None:
    k = 12
    samples = simulate(
        AdaptiveLimit(1, 200, initial), capacity=k, service_s=0.015, queueing=False, seconds=10
    )
    settled = [lim for t, lim in samples if t > 2.0]
    assert k / 2 <= min(settled) and max(settled) <= 2 * k
    assert 0.8 * k <= sum(settled) / len(settled) <= 1.3 * k


def test_against_a_service_that_queues_the_latency_guard_bounds_the_limit() -> None:
    # Given a service with 10 parallel slots that queues the rest (no rejection at all)
    k = 10
    samples = simulate(
        AdaptiveLimit(1, 500, 5), capacity=k, service_s=0.02, queueing=True, seconds=10
    )
    settled = [lim for t, lim in samples if t > 2.0]
    # Then the limit stops where queueing doubles the latency, far below the maximum
    assert max(settled) <= 3 * k
    assert min(settled) >= k / 2


# -- AdaptiveLimiter (the asyncio wrapper) ---------------------------------------------------


async def test_the_adaptive_limiter_holds_callers_to_the_limit_and_follows_it_down() -> None:
    clock = Clock(0.0)
    changes: list[int] = []
    limiter = AdaptiveLimiter(
        AdaptiveConfig(min=1, max=50, initial=4), on_change=changes.append, clock=clock
    )
    for _ in range(4):
        await limiter.acquire()
    fifth = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(0)
    assert not fifth.done() and limiter.held == 4
    # When a call ends in RESOURCE_EXHAUSTED the limit halves (end of slow start) to 2
    limiter.release(0.01, EXHAUSTED)
    await asyncio.sleep(0)
    assert limiter.limit == 2 and changes == [2]
    assert not fifth.done() and limiter.held == 3
    # and the waiter gets a slot only once in-flight calls fall below the new limit
    clock.advance(1.0)
    limiter.release(0.01, None)
    await asyncio.sleep(0)
    assert not fifth.done()
    limiter.release(0.01, None)
    await asyncio.sleep(0)
    assert fifth.done() and limiter.held == 2
    # An outage's failures teach the limit nothing
    limiter.release(0.01, UNAVAILABLE)
    assert limiter.limit == 2
    # A cancelled waiter leaves no slot behind
    waiter = asyncio.ensure_future(limiter.acquire())
    other = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    limiter.release(0.01, None)
    await asyncio.sleep(0)
    assert other.done() and limiter.held == 2


async def test_a_retry_after_answer_slows_the_whole_group() -> None:
    clock = Clock(0.0)
    limiter = AdaptiveLimiter(AdaptiveConfig(min=1, max=100, initial=10), clock=clock)
    for _ in range(10):
        await limiter.acquire()
    # When one message is answered RETRY with retry_after 500 ms
    retry = Classification(Outcome.RETRY, "RETRY", slow_down=True, retry_after_ms=500)
    limiter.release(0.01, retry)
    for _ in range(9):
        limiter.release(0.01, None)
    # Then the group's limit drops, and does not grow back for those 500 ms
    assert limiter.limit == 5

    async def busy_round() -> None:  # the full limit in use, every call a success
        n = limiter.limit
        for _ in range(n):
            await limiter.acquire()
        for _ in range(n):
            limiter.release(0.01, ACK)

    for step in range(40):
        clock.now = 0.01 * (step + 1)
        await busy_round()
    assert limiter.limit == 5
    clock.now = 0.6
    await busy_round()
    assert limiter.core.value > 5


# -- Breaker ---------------------------------------------------------------------------------


def make_breaker(
    threshold: int = 3, reset_s: float = 10.0
) -> tuple[Breaker, Clock, list[tuple[str, str]]]:
    clock = Clock(1000.0)
    changes: list[tuple[str, str]] = []
    breaker = Breaker(
        "g",
        CircuitBreakerConfig(failure_threshold=threshold, reset_timeout_s=reset_s),
        lambda old, new: changes.append((old, new)),
        clock=clock,
    )
    return breaker, clock, changes


def test_consecutive_service_failures_open_the_breaker_and_a_success_resets_the_count() -> None:
    breaker, _, changes = make_breaker(threshold=3)
    breaker.record(True, False)
    breaker.record(True, False)
    breaker.record(False, False)  # a success in between: the count starts again
    breaker.record(True, False)
    breaker.record(True, False)
    assert breaker.state == CLOSED and breaker.failures == 2
    breaker.record(True, False)
    assert breaker.state == OPEN and changes == [(CLOSED, OPEN)]
    assert breaker.try_acquire() == (False, False)


def test_an_open_breaker_lets_one_probe_through_after_the_reset_timeout() -> None:
    breaker, clock, changes = make_breaker(threshold=1, reset_s=10.0)
    breaker.record(True, False)
    clock.advance(9.5)
    assert breaker.seconds_until_probe() == pytest.approx(0.5)
    assert breaker.try_acquire() == (False, False)
    clock.advance(0.5)
    assert breaker.try_acquire() == (True, True)
    assert breaker.state == HALF_OPEN
    assert breaker.try_acquire() == (False, False)  # one probe at a time
    # Results of calls that started before the breaker opened decide nothing
    breaker.record(False, False)
    breaker.record(True, False)
    assert breaker.state == HALF_OPEN
    # The probe's success closes it
    breaker.record(False, True)
    assert breaker.state == CLOSED
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert breaker.try_acquire() == (True, False)


def test_a_failed_probe_reopens_the_breaker_for_another_full_timeout() -> None:
    breaker, clock, _ = make_breaker(threshold=1, reset_s=5.0)
    breaker.record(True, False)
    clock.advance(5.0)
    assert breaker.try_acquire() == (True, True)
    clock.advance(2.0)
    breaker.record(True, True)
    assert breaker.state == OPEN
    assert breaker.seconds_until_probe() == pytest.approx(5.0)
    # Late results while open change nothing
    breaker.record(False, False)
    assert breaker.state == OPEN


def test_an_abandoned_probe_lets_another_one_go() -> None:
    breaker, clock, _ = make_breaker(threshold=1, reset_s=1.0)
    breaker.record(True, False)
    clock.advance(1.0)
    assert breaker.try_acquire() == (True, True)
    breaker.abandon_probe()
    assert breaker.state == HALF_OPEN
    assert breaker.try_acquire() == (True, True)


async def test_waiters_on_an_open_breaker_sleep_until_the_probe_time() -> None:
    breaker = Breaker("g", CircuitBreakerConfig(failure_threshold=1, reset_timeout_s=0.3))
    attempts = 0
    real_try = breaker.try_acquire

    def counting_try() -> tuple[bool, bool]:
        nonlocal attempts
        attempts += 1
        return real_try()

    breaker.try_acquire = counting_try  # type: ignore[method-assign]
    breaker.record(True, False)
    waiters = [asyncio.ensure_future(breaker.acquire()) for _ in range(20)]
    done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    # One waiter became the probe after the reset timeout; the others still wait
    assert [w.result() for w in done] == [True]
    # Each waiter asked about twice (on arrival, at the probe time): no polling
    assert attempts <= 3 * len(waiters)
    probe_attempts = attempts
    breaker.record(False, True)  # the probe succeeded: everyone goes
    results = await asyncio.gather(*waiters)
    assert results.count(True) == 1
    assert attempts <= probe_attempts + 2 * len(waiters)


# -- TokenBucket -----------------------------------------------------------------------------


def test_the_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(10.0, 10.0, now=0.0)
    assert all(bucket.reserve(0.0) == 0.0 for _ in range(10))
    # Past the burst, each token is paid for a tenth of a second after the one before
    assert [bucket.reserve(0.0) for _ in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    # and a caller that comes once they are paid for finds the refill again
    assert bucket.reserve(0.4) == 0.0
    assert bucket.reserve(0.4) == pytest.approx(0.1)


def test_a_call_of_several_messages_goes_once_its_own_tokens_are_there() -> None:
    # Given a cap of 10 a second, its burst spent
    bucket = TokenBucket(10.0, 10.0, now=0.0)
    assert bucket.reserve(0.0, 10) == 0.0
    # When two calls of 5 messages wait side by side, then a call larger than the burst
    waits = [bucket.reserve(0.0, 5), bucket.reserve(0.0, 5), bucket.reserve(0.0, 25)]
    # Then each goes when its own tokens are there, in the order they asked: not both at the
    # end of the refill they would share token by token
    assert waits == pytest.approx([0.5, 1.0, 3.5])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.6, allow_nan=False), st.integers(1, 30)),
        min_size=1,
        max_size=50,
    )
)
def test_no_span_of_grants_holds_more_than_a_burst_and_the_rate(
    calls: list[tuple[float, int]],
) -> None:
    rate, burst = 10.0, 10.0
    bucket = TokenBucket(rate, burst, now=0.0)
    now, grants = 0.0, []
    for gap, count in calls:
        now += gap
        grants.append((now + bucket.reserve(now, count), count))
    times = [at for at, _ in grants]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(times))  # in the order they asked
    # After any grant, the calls granted up to a later time hold at most a burst plus the rate
    # over the span (the first grant's own tokens were paid for before it)
    for i, (start, _) in enumerate(grants):
        total = 0
        for at, count in grants[i + 1 :]:
            total += count
            assert total <= burst + rate * (at - start) + 1e-6
