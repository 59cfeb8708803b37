"""The pure core under seeded random schedules (tests/sim): rebalances, restarts, crashes,
log truncation, service and DLQ outages, with the invariants checked at every step.

A failure names its seed; replay it with ``python -m tests.sim --seed N``. The long soak is
``make simulate`` (1M steps).
"""

from __future__ import annotations

import logging
import random

import pytest

from tests.sim.runner import Member, Simulation, Stats, run

SCHEDULES = 1000
STEPS = 150


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.disable(logging.WARNING)  # thousands of state-change lines otherwise
    yield
    logging.disable(logging.NOTSET)


def test_thousands_of_random_schedules_keep_every_invariant() -> None:
    total = Stats()
    for seed in range(SCHEDULES):
        stats = run(10_000 + seed, STEPS)
        for name in vars(total):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
    # The schedules really exercise what the invariants are about.
    assert total.rebalances > 100 and total.restarts > 20 and total.crashes > 5
    assert total.outages > 50 and total.truncations > 5 and total.pauses > 100
    assert total.dead_lettered > 0 and total.acked > 10_000
    # ... in unary and in batch mode, with real batches and broken batch answers
    assert 300 < total.batch_schedules < 700
    assert total.batched_messages > 1.2 * total.batch_calls > 0
    assert total.protocol_errors > 50


def test_a_paused_partition_reassigned_to_the_same_member_drains() -> None:
    # Given a member whose partitions are paused by a full window (librdkafka keeps the
    # pause flag across revoke and re-assign)
    sim = Simulation(seed=7)
    sim.reset_tps = set()
    for _ in range(40):
        sim.produce()
    for _ in range(40):
        sim.fetch()
    assert sim.consumer.paused, "the windows filled up and paused"
    # When every partition is revoked and assigned back to the same member
    sim._revoke(sorted(sim.consumer.assigned))
    sim._assign(sim.tps)
    # Then every partition still drains
    sim.drain()


def test_a_hung_service_dead_letters_nothing() -> None:
    # Given a service that hangs on every call (deadlines) for a long outage
    sim = Simulation(seed=3)
    sim.reset_tps = set()
    for _ in range(10):
        sim.produce()
    sim.outage = "hung"
    for _ in range(400):
        sim.fetch()
        sim.dispatch()
        sim.clock.run_until(sim.clock.now + 0.5)
    # Then nothing was dead-lettered meanwhile, and everything drains once it answers
    assert sim.truth.dlq == [] or all(
        sim.truth.behaviour[i].startswith(("poison", "timeout:")) for i in sim.truth.dlq
    )
    sim.drain()


def test_restored_ack_state_over_the_budget_does_not_stall_the_partition() -> None:
    # Given a partition whose committed ack state has many holes (written by a pod with a
    # large metadata budget: every other offset is done)
    from consumer_proxy.core.codec import AckState, encode

    sim = Simulation(seed=5)
    sim.reset_tps = set()
    for _ in range(200):
        sim.produce()
    tp = sim.tps[0]
    log = sim.logs[tp]
    base = min(log.records)
    rng = random.Random(1)
    runs = [rng.randint(1, 3) for _ in range(100)]  # pending, done, pending, done, ...
    offset = base
    for index, length in enumerate(runs):
        for o in range(offset, offset + length):
            if index % 2 == 1 and o in log.records:
                sim.truth.done.add(log.records[o].ident)
                sim.truth.acked.add(log.records[o].ident)
        offset += length
    assert offset <= log.end
    state = encode(AckState(base, tuple(runs)))
    assert len(state) > 64
    sim._revoke(sorted(sim.consumer.assigned))
    sim.commits[tp] = (base, state)
    # When a pod with a 64-byte budget takes it over and commits before fetching anything
    sim.member = Member(sim, 64)
    sim._assign(sim.tps)
    sim.commit()
    part = sim.member.core.parts[tp]
    assert part.meta_over_budget
    # Then it keeps fetching the restored range (only fetching can shrink that state)
    sim.fetch()
    assert not part.paused or part.tracker.is_full or part.backlog
    sim.drain()


@pytest.mark.parametrize("outage", ["hung", "unavailable", "unimplemented"])
def test_a_batch_service_outage_dead_letters_nothing(outage: str) -> None:
    # Given a group in batch mode whose service hangs, says UNAVAILABLE (per call or per
    # message) or does not implement HandleMessageBatch, for a long outage
    from consumer_proxy.core.batching import BatchLimits

    sim = Simulation(seed=11)
    sim.reset_tps = set()
    sim.batch = BatchLimits(max_messages=20, max_bytes=1000)
    for _ in range(20):
        sim.produce()
    sim.outage = outage
    for _ in range(400):
        sim.fetch()
        sim.dispatch()
        sim.clock.run_until(sim.clock.now + 0.5)
    # Then nothing was dead-lettered meanwhile, and everything drains once it answers
    assert sim.stats.batch_calls > 0
    assert all(sim.truth.behaviour[i].startswith(("poison", "timeout:")) for i in sim.truth.dlq)
    assert sim.member.breaker.is_open
    sim.drain()
