"""A partition whose window fills keeps fetching into its backlog (up to ``backlog_bound``
records) instead of pausing: a pause drops librdkafka's prefetched records, and on resume the
partition waits for the fetch request in flight, which long-polls the group's other (empty)
partitions for up to ``fetch.wait.max.ms``. The core's rule, then the proxy on the real broker.
What the stall cost (10,000 msg/s on one partition): ``bench/bench_latency.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from consumer_proxy.config import DeliveryConfig
from consumer_proxy.core.partitions import PartitionSet, PartitionState, backlog_bound
from tests.support.core import CoreRig
from tests.support.kafka import Broker, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.records import Rec
from tests.support.service import Behaviour, TestService, always
from tests.support.waiting import async_wait_until

TP = ("t", 0)
TPs = tuple[str, int]


def _rig(window: int, budget: int = 64 * 1024 * 1024) -> CoreRig:
    return CoreRig(
        DeliveryConfig(max_in_flight=window, max_in_flight_bytes=budget), pause_plan=True
    )


def test_a_full_window_fetches_on_until_its_backlog_is_at_the_bound() -> None:
    # Given a window of 4 (a backlog bound of 40)
    rig = _rig(window=4)
    core = rig.core
    bound = backlog_bound(4)
    assert bound == 40
    # When the window is full and records keep coming, short of the bound
    for offset in range(4 + bound - 1):
        core.intake(Rec("t", offset))
    # Then the partition keeps fetching
    assert core.pause_plan().pause == []
    # And it pauses with the record that brings its backlog to the bound
    core.intake(Rec("t", 4 + bound - 1))
    assert core.pause_plan().pause == [TP]
    # And it resumes only once the backlog is down to half of it (not at every free slot)
    rig.ack(bound // 2 - 1)
    assert core.pause_plan().resume == []
    rig.ack(1)
    assert core.pause_plan().resume == [TP]


def test_the_backlog_counts_in_the_byte_budget_and_gives_its_bytes_back() -> None:
    # Given a budget of 2,000 bytes and 100-byte records beyond a full window of 4
    rig = _rig(window=4, budget=2000)
    core = rig.core
    for offset in range(4):
        core.intake(Rec("t", offset, value=b"x" * 100))
    part = core.parts[TP]
    assert core.pause_plan().pause == []
    # When the backlog's bytes bring the budget to its limit (400 taken in, 16 x 100 waiting)
    for offset in range(4, 20):
        core.intake(Rec("t", offset, value=b"x" * 100))
    # Then the partition pauses for the budget, with fewer records than the bound
    assert core.pause_plan().pause == [TP]
    assert part.budget.waiting == 1600 and len(part.backlog) < backlog_bound(4)
    # And everything acked, every byte is given back and it fetches again
    while rig.ready:
        rig.ack(len(rig.ready))
    assert (part.budget.held, part.budget.waiting, part.backlog_bytes) == (0, 0, 0)
    assert core.pause_plan().resume == [TP]


def test_one_stuck_partitions_backlog_does_not_pause_the_others() -> None:
    # Given two partitions sharing a 4,000-byte budget, and t[0]'s head never answered: its
    # window of 4 is full and 36 records of 100 bytes wait in its backlog (the budget full)
    rig = _rig(window=4, budget=4000)
    core = rig.core
    core.assign("t", 1, 0, "")
    core.pause_plan()
    for offset in range(40):
        core.intake(Rec("t", offset, value=b"x" * 100))
    plan = core.pause_plan()
    # Then t[0] pauses for the budget, but t[1], which holds nothing, keeps fetching
    assert plan.pause == [TP] and core.parts[TP].budget.full
    # and what it fetches is taken in while the messages taken in leave room (4 x 100 held)
    core.intake(Rec("t", 0, partition=1, value=b"y" * 100))
    assert ("t", 1) not in core.pause_plan().pause
    assert [d.part.partition for d in rig.ready][-1] == 1


def _six_in_the_backlog() -> tuple[PartitionSet, PartitionState]:
    """A full window of 4 and six 10-byte records in the backlog (offsets 4..9)."""
    core = _rig(window=4).core
    for offset in range(10):
        core.intake(Rec("t", offset, value=b"x" * 10))
    part = core.parts[TP]
    assert part.budget.waiting == 60
    return core, part


def test_a_revoked_partition_gives_its_backlog_bytes_back() -> None:
    core, part = _six_in_the_backlog()
    core.forget(part)
    assert part.budget.waiting == 0


def test_a_log_cut_below_the_backlog_gives_the_cut_records_bytes_back() -> None:
    core, part = _six_in_the_backlog()
    # When the log is cut at 7 (the consumer hands over offset 7 again)
    core.intake(Rec("t", 7, value=b"y" * 10))
    # Then the backlog keeps 4..6 and the new 7, and counts exactly their bytes
    assert [r.offset() for r in part.backlog] == [4, 5, 6, 7]
    assert part.budget.waiting == part.backlog_bytes == 40


# -- on the real broker ------------------------------------------------------------------------

WINDOW = 20
BURST = 150  # more than the window, less than the backlog bound (200)


@pytest.mark.kafka
async def test_a_burst_beyond_a_full_window_waits_in_the_backlog_and_nothing_pauses(
    kafka: Broker,
) -> None:
    # Given a proxy with a window of 20 on one partition, assigned, and a service that holds
    # its calls open until the test lets them go
    topic, group = unique_name("backlog"), unique_name("backlog")
    create_topic(kafka.bootstrap, topic, partitions=1)
    hold = asyncio.Event()
    async with TestService(always(Behaviour(hold=hold))) as service:
        config = make_config(
            kafka.bootstrap, group, [topic], [service.address], delivery={"max_in_flight": WINDOW}
        )
        proxy, task = start_proxy(config)
        try:
            runner = proxy.runners[0]
            await async_wait_until(lambda: (topic, 0) in runner.partitions.parts, timeout=60)
            assert runner.fetcher is not None
            pauses: list[tuple[str, int]] = []
            real_set_paused = runner.fetcher.set_paused

            async def set_paused(pause: Sequence[TPs], resume: Sequence[TPs]) -> None:
                pauses.extend(pause)
                await real_set_paused(pause, resume)

            runner.fetcher.set_paused = set_paused  # type: ignore[method-assign]
            # When a burst of 150 records comes while the window's calls are held
            await asyncio.to_thread(
                produce, kafka.bootstrap, topic, [f"m{i}" for i in range(BURST)]
            )
            part = runner.partitions.parts[(topic, 0)]
            await async_wait_until(lambda: len(part.backlog) == BURST - WINDOW, timeout=60)
            # Then the window is full, the rest waits in the backlog, and the partition was
            # never paused (a pause drops librdkafka's prefetched records, and the resume
            # waits for the fetch request in flight: up to fetch.wait.max.ms)
            assert part.tracker is not None and part.tracker.in_flight == WINDOW
            assert (topic, 0) not in pauses and not part.paused
            # And once the calls go, every record is delivered
            hold.set()
            await async_wait_until(lambda: caught_up(kafka.bootstrap, group, topic), timeout=60)
            assert len({d.offset for d in service.deliveries}) == BURST
            assert (topic, 0) not in pauses
        finally:
            await proxy.shutdown()
            await task


def test_records_fetched_again_across_an_epoch_change_record_the_change_again() -> None:
    # Given offsets 0-19 written in epoch 5 and 20-29 in epoch 6, all fetched
    core = _rig(window=100).core
    for offset in range(30):
        core.intake(Rec("t", offset, epoch=5 if offset < 20 else 6))
    # When the consumer goes back to 10 (an offset reset) and fetches 10-29 again, one at a
    # time and as a batch
    for offset in range(10, 20):
        core.intake(Rec("t", offset, epoch=5))
    core.intake_batch([Rec("t", offset, epoch=6) for offset in range(20, 30)])
    # Then a commit past them carries epoch 6, the epoch of record 29 (before the fix the
    # intake compared with the highest epoch ever seen, 6, skipped the change at 20 and the
    # commit carried 5: the next owner's client would report a cut at 20 that is not there)
    tracker = core.parts[TP].tracker
    assert tracker is not None
    for offset in range(30):
        tracker.done(offset)
    assert tracker.commit_epoch(tracker.committable()) == 6


def _epochless_partition_in_the_backlog() -> tuple[PartitionSet, PartitionState]:
    """Partition 1 committed at 10 with no leader epoch, its records at 10..14 (epoch 7)
    all waiting in its backlog: partition 0 spent the byte budget."""
    rig = CoreRig(DeliveryConfig(max_in_flight=100, max_in_flight_bytes=1024), tps=(("t", 0),))
    core = rig.core
    core.intake(Rec("t", 0, value=b"x" * 1500))
    core.assign("t", 1, 10, "")
    for offset in range(10, 15):
        core.intake(Rec("t", offset, partition=1, epoch=7))
    part = core.parts[("t", 1)]
    assert part.tracker is not None and part.tracker.in_flight == 0 and len(part.backlog) == 5
    return core, part


def test_a_commit_with_every_record_in_the_backlog_carries_the_backlogs_epoch() -> None:
    # Given partition 1 committed at 10 by a client that sent no leader epoch (an operator's
    # reset), and the byte budget spent by partition 0, so partition 1's records all wait in
    # its backlog: nothing tracked tells an epoch
    core, part = _epochless_partition_in_the_backlog()
    # When commits are planned
    plan, _ = core.commit_plan()
    # Then 10 is committed again, with the backlog's first record's epoch: an upper bound of
    # record 9's (before session 19's fix no commit was made, and one made back to a cut
    # carried no epoch: the next owner could not find a second cut below it)
    (commit,) = [c for c in plan if c.part is part]
    assert (commit.offset, commit.metadata, commit.epoch) == (10, "", 7)
    # And so does the commit as the partition leaves
    final = core.final_commit(part)
    assert final is not None and (final.offset, final.epoch) == (10, 7)


def test_a_commit_after_a_cut_that_dropped_the_whole_backlog_carries_its_records_epoch() -> None:
    # Given partition 1 committed at 10 by a client that sent no leader epoch, and its
    # records at 10..14 (epoch 7) waiting in its backlog behind partition 0's spent budget
    core, part = _epochless_partition_in_the_backlog()
    # When the log is cut at 8 (an unclean election), which drops every record of the backlog,
    # before any record written after the cut comes
    core.truncated(("t", 1), 8)
    assert not part.backlog
    # Then the commit back to 8 carries the epoch of the first record the cut dropped: fetched
    # at or above the commit, before the cut, so an upper bound of record 7's epoch (before
    # the fix it carried none, and the next owner could not find a second cut below 8)
    plan, _ = core.commit_plan()
    (commit,) = [c for c in plan if c.part is part]
    assert (commit.offset, commit.epoch) == (8, 7)
    final = core.final_commit(part)
    assert final is not None and (final.offset, final.epoch) == (8, 7)


@pytest.mark.parametrize("batch", [False, True], ids=["one-by-one", "in-a-batch"])
def test_a_backlog_of_records_whose_bytes_are_in_their_headers_pauses_at_the_byte_budget(
    batch: bool,
) -> None:
    # Given a full window (the service is slow) and a byte budget of 64 KiB
    rig = CoreRig(DeliveryConfig(max_in_flight=10, max_in_flight_bytes=64 * 1024), pause_plan=True)
    for offset in range(10):
        rig.core.intake(Rec("t", offset, value=b"v"))
    # When records come whose 100 kB are headers, not key or value
    records = [Rec("t", o, value=b"", headers=[("h", b"x" * 100_000)]) for o in range(10, 13)]
    if batch:
        rig.core.intake_batch(records)
    else:
        for record in records:
            rig.core.intake(record)
    # Then the backlog counts them in the budget, and the partition pauses (it would have
    # taken up to 20,000 of them: 2 GB against 64 KiB)
    part = rig.core.parts[("t", 0)]
    assert part.budget.waiting >= 3 * 100_000
    assert ("t", 0) in rig.core.pause_plan().pause
    # ... and everything acked, every byte is given back (none left counted, none twice)
    while rig.ready:
        rig.ack(len(rig.ready))
    assert (part.budget.held, part.budget.waiting, part.backlog_bytes) == (0, 0, 0)
