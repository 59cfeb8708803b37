"""The pure core under seeded random schedules (tests/sim): rebalances, restarts, crashes,
log truncation, service and DLQ outages, with the invariants checked at every step.

A failure names its seed; replay it with ``python -m tests.sim --seed N``. The long soak is
``make simulate`` (1M steps).
"""

from __future__ import annotations

import logging

import pytest

from tests.sim.runner import Simulation, Stats, run

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
