"""Out-of-order commit tracker: the committed offset, the window, and the ack state it carries."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from consumer_proxy.core.codec import AckState, decode, encode
from consumer_proxy.core.tracker import DEFAULT_METADATA_BUDGET, PartitionTracker

TOP = 2**63 - 1  # the largest Kafka offset

# No per-example deadline: the suite shares small CI boxes, where a descheduled process would
# otherwise fail an example for being slow rather than wrong.
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_committable(start: int, tracked: list[int], done: set[int]) -> int:
    """The committable offset straight from its definition."""
    for offset in tracked:
        if offset not in done:
            return offset
    return tracked[-1] + 1 if tracked else start


def restart(tracker: PartitionTracker, budget: int = DEFAULT_METADATA_BUDGET) -> PartitionTracker:
    """What a new owner of the partition builds from the commit the old one made."""
    committed = tracker.committable()
    metadata, _ = tracker.metadata(budget)
    return PartitionTracker(committed, 100, decode(metadata) if metadata else None)


# -- examples ------------------------------------------------------------------------------


def test_nothing_tracked_commits_at_the_start() -> None:
    # Given a fresh tracker at offset 42 / Then it commits where it started, with no state
    tracker = PartitionTracker(42, 10)
    assert tracker.committable() == 42
    assert tracker.metadata() == ("", True)
    assert tracker.last_tracked is None
    assert (tracker.in_flight, tracker.pending, tracker.is_full) == (0, 0, False)


def test_commit_stops_at_the_first_pending_offset() -> None:
    # Given offsets 10-14 fetched
    tracker = PartitionTracker(10, 100)
    assert all(tracker.track(offset) for offset in range(10, 15))

    # When 11, 12 and 14 finish first
    for offset in (11, 12, 14):
        tracker.done(offset)

    # Then the commit waits for 10; once 10 is done it waits for 13
    assert tracker.committable() == 10
    tracker.done(10)
    assert tracker.committable() == 13
    tracker.done(13)
    assert tracker.committable() == 15


def test_gaps_in_fetched_offsets_never_stall_the_commit() -> None:
    # Given a compacted partition: offsets 5, 9 and 20 exist, the rest were compacted away
    tracker = PartitionTracker(0, 100)
    for offset in (5, 9, 20):
        tracker.track(offset)

    # When all three are done / Then the commit moves past every gap
    assert tracker.committable() == 5
    for offset in (9, 5, 20):
        tracker.done(offset)
    assert tracker.committable() == 21


def test_duplicates_and_late_results_are_ignored() -> None:
    # Given offsets 0-2 fetched and 0 done
    tracker = PartitionTracker(0, 100)
    for offset in range(3):
        tracker.track(offset)
    tracker.done(0)

    # When the fetcher returns 0 and 1 again and a late result arrives for an unknown offset
    # Then neither re-fetch is delivered, and nothing changes
    assert tracker.track(0) is False
    assert tracker.track(1) is False
    tracker.done(99)
    tracker.done(0)
    assert (tracker.committable(), tracker.pending, tracker.in_flight) == (1, 2, 2)


def test_window_accounting_and_full() -> None:
    # Given a window of 3
    tracker = PartitionTracker(0, 3)
    for offset in range(3):
        tracker.track(offset)

    # Then it is full, also when a later offset is done (it still occupies the window)
    assert tracker.is_full
    tracker.done(2)
    assert (tracker.in_flight, tracker.pending, tracker.is_full) == (3, 2, True)

    # When the head is done / Then the window shrinks and has room again
    tracker.done(0)
    assert (tracker.in_flight, tracker.pending, tracker.is_full) == (2, 1, False)
    assert tracker.last_tracked == 2


def test_metadata_records_acks_above_the_commit() -> None:
    # Given 100-109 fetched, 100 and 104 still pending, 109 pending at the top
    tracker = PartitionTracker(100, 100)
    for offset in range(100, 110):
        tracker.track(offset)
    for offset in (101, 102, 103, 105, 106, 107, 108):
        tracker.done(offset)

    # When the commit is prepared
    metadata, whole = tracker.metadata()

    # Then it commits 100 and says which offsets above it are done; the pending tail is left
    # out because it would be redelivered anyway
    assert whole
    assert decode(metadata) == AckState(100, (1, 3, 1, 4))
    assert tracker.committable() == 100


def test_restart_skips_exactly_the_acked_messages() -> None:
    # Given 0-9 fetched, the even offsets done except 0
    tracker = PartitionTracker(0, 100)
    for offset in range(10):
        tracker.track(offset)
    for offset in (2, 4, 6, 8):
        tracker.done(offset)

    # When the partition moves to a new owner that fetches 0-9 again
    successor = restart(tracker)
    delivered = [offset for offset in range(10) if successor.track(offset)]

    # Then only the odd offsets and 0 are delivered again
    assert delivered == [0, 1, 3, 5, 7, 9]
    assert successor.committable() == 0
    for offset in delivered:
        successor.done(offset)
    assert successor.committable() == 10


def test_restored_state_is_ignored_after_an_offset_reset() -> None:
    # Given ack state written at offset 10, but the committed offset was reset to 5
    state = AckState(10, (1, 5))

    # When a tracker starts at 5 with it / Then every message is delivered
    tracker = PartitionTracker(5, 100, state)
    assert all(tracker.track(offset) for offset in range(5, 20))


def test_a_second_rebalance_before_refetching_keeps_the_acks() -> None:
    # Given a restored state (10 pending, 11-15 done) and nothing fetched again yet
    state = AckState(10, (1, 5))
    metadata = encode(state)
    tracker = PartitionTracker(10, 100, decode(metadata))

    # When the partition is revoked right away / Then the commit carries the same state
    assert tracker.committable() == 10
    assert tracker.metadata() == (metadata, True)

    # When 10 is fetched and done / Then the commit moves past the restored acks as they
    # are fetched again (never before: the log may have been cut there since), without
    # delivering them, and until then the metadata carries them
    assert tracker.track(10)
    tracker.done(10)
    assert tracker.committable() == 11
    assert decode(tracker.metadata()[0]) == AckState(11, (0, 5))  # 11 itself is done
    assert [tracker.track(offset) for offset in range(11, 17)] == [False] * 5 + [True]
    assert tracker.committable() == 16


def test_over_budget_state_is_truncated_and_says_so() -> None:
    # Given 1000 offsets with a fifth of them, at random, still pending
    randoms = random.Random(7)
    tracker = PartitionTracker(0, 10_000)
    for offset in range(1000):
        tracker.track(offset)
        if offset and randoms.random() > 0.2:
            tracker.done(offset)
    full, whole = tracker.metadata(10**6)
    assert whole

    # When the budget is smaller than the state
    metadata, whole = tracker.metadata(60)

    # Then the metadata fits, the flag says it is partial, and it is a prefix of the state
    assert not whole
    assert 0 < len(metadata) <= 60 < len(full)
    prefix, state = decode(metadata), decode(full)
    assert prefix.base == state.base == 0
    assert prefix.runs == state.runs[: len(prefix.runs)]


def test_a_budget_too_small_for_anything_gives_empty_partial_metadata() -> None:
    # Given some acks above a pending offset / When the budget cannot hold even one run pair
    tracker = PartitionTracker(0, 10)
    tracker.track(0)
    tracker.track(1)
    tracker.done(1)

    # Then nothing is written and the caller is told
    assert tracker.metadata(5) == ("", False)


def test_offsets_near_the_top_of_the_int64_range() -> None:
    # Given the last offsets a partition can have
    tracker = PartitionTracker(TOP - 3, 10)
    for offset in range(TOP - 3, TOP + 1):
        tracker.track(offset)
    tracker.done(TOP)

    # When restarted / Then the ack of the very last offset survives
    successor = restart(tracker)
    assert [o for o in range(TOP - 3, TOP + 1) if successor.track(o)] == [TOP - 3, TOP - 2, TOP - 1]


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="committed"):
        PartitionTracker(-1, 10)
    with pytest.raises(ValueError, match="max_in_flight"):
        PartitionTracker(0, 0)


# -- properties ----------------------------------------------------------------------------


operations = st.lists(
    st.one_of(
        st.tuples(st.just("track"), st.integers(0, 3)),  # next offset after a gap of 0-3
        st.tuples(st.just("done"), st.integers(0, 10**6)),  # index into what was tracked
        st.tuples(st.just("late"), st.integers(-5, 400)),  # any offset at all
    ),
    max_size=300,
)


@relaxed
@given(st.integers(0, 1000), operations)
def test_committable_matches_the_definition(start: int, ops: list[tuple[str, int]]) -> None:
    # Given random fetches with gaps and acks in any order
    tracker = PartitionTracker(start, 50)
    tracked: list[int] = []
    done: set[int] = set()
    previous = start
    for op, value in ops:
        # When each operation is applied
        if op == "track":
            offset = (tracked[-1] + 1 if tracked else start) + value
            assert tracker.track(offset)
            tracked.append(offset)
        elif op == "done" and tracked:
            offset = tracked[value % len(tracked)]
            tracker.done(offset)
            done.add(offset)
        elif op == "late":
            tracker.done(value)
            if value in tracked:
                done.add(value)
        committable = tracker.committable()

        # Then it is the definition, it never goes backwards nor passes a pending offset
        assert committable == naive_committable(start, tracked, done)
        assert committable >= previous
        assert all(offset >= committable for offset in tracked if offset not in done)
        previous = committable
        window = [offset for offset in tracked if offset >= committable]
        assert tracker.in_flight == len(window)
        assert tracker.pending == len(set(tracked) - done)
        assert tracker.is_full == (len(window) >= 50)


@st.composite
def windows(draw: st.DrawFn) -> PartitionTracker:
    """A tracker holding up to 2000 offsets with random holes and gaps, maybe restored."""
    start = draw(st.sampled_from([0, 1_000_000, TOP - 20_000]))
    hole_rate = draw(st.sampled_from([0.01, 0.1, 0.5]))
    count = draw(st.integers(0, 2000))
    randoms = draw(st.randoms(use_true_random=False))
    tracker = PartitionTracker(start, 10**6)
    fetched: list[int] = []
    offset = start
    for _ in range(count):
        offset += 1 + (randoms.random() < 0.05) * randoms.randrange(1, 5)
        tracker.track(offset)
        fetched.append(offset)
        if randoms.random() >= hole_rate:
            tracker.done(offset)
    if draw(st.booleans()):
        # A new owner that has fetched part of the window again: its state is partly the
        # window and partly what it restored.
        committed = tracker.committable()
        metadata, _ = tracker.metadata(10**9)
        tracker = PartitionTracker(committed, 10**6, decode(metadata) if metadata else None)
        again = [offset for offset in fetched if offset >= committed]
        for offset in again[: draw(st.integers(0, len(again)))]:
            if tracker.track(offset) and randoms.random() < 0.5:
                tracker.done(offset)
    return tracker


@given(windows(), st.one_of(st.integers(0, 4000), st.integers(-3, -1)))
@settings(relaxed, max_examples=80)
def test_metadata_fits_the_budget_and_flags_truncation(
    tracker: PartitionTracker, budget: int
) -> None:
    # Given a window and the whole state it would like to write
    full, whole = tracker.metadata(10**9)
    assert whole
    if budget < 0:
        # A budget just short of the whole state: the longest prefix is then the hardest case
        budget = max(0, len(full) + budget)

    # When the commit is prepared within a budget
    metadata, whole = tracker.metadata(budget)

    # Then it fits, and it is partial exactly when the whole state does not fit
    assert len(metadata) <= budget
    assert whole == (len(full) <= budget)
    if whole:
        assert metadata == full
    else:
        # And what was kept is the longest prefix of whole run pairs that fits
        state = decode(full)
        prefix = decode(metadata) if metadata else AckState(state.base)
        kept = len(prefix.runs)
        assert kept % 2 == 0
        assert prefix.runs == state.runs[:kept]
        longer = AckState(state.base, state.runs[: kept + 2])
        assert len(encode(longer)) > budget


class TrackerLifecycle(RuleBasedStateMachine):
    """Fetch, ack, re-fetch and restart a partition at random, against a model of the truth.

    The model records every offset that exists (the log) and whether its message is done as
    far as the current owner may know. A restart keeps an ack only if the commit metadata
    carried it; acks above a truncated prefix are forgotten and must be redelivered.
    """

    @initialize(
        start=st.sampled_from([0, 7, TOP - 5_000]),
        max_in_flight=st.integers(1, 20),
        budget=st.sampled_from([0, 16, 24, 40, 80, DEFAULT_METADATA_BUDGET]),
    )
    def begin(self, start: int, max_in_flight: int, budget: int) -> None:
        self.max_in_flight = max_in_flight
        self.budget = budget
        self.start = start
        self.tracker = PartitionTracker(start, max_in_flight)
        self.log: list[int] = []  # every offset ever fetched
        self.status: dict[int, bool] = {}  # offset -> done, as the current owner may know it
        self.tracked: list[int] = []  # fetched by the current owner
        self.refetch: deque[int] = deque()  # fetched before the restart, not yet again
        self.previous = start

    @precondition(lambda self: not self.refetch)
    @rule(gap=st.integers(0, 3))
    def fetch_new(self, gap: int) -> None:
        offset = (self.log[-1] + 1 if self.log else self.start) + gap
        assert self.tracker.track(offset), "a new message is always delivered"
        self.log.append(offset)
        self.status[offset] = False
        self.tracked.append(offset)

    @precondition(lambda self: self.refetch)
    @rule()
    def fetch_again(self) -> None:
        offset = self.refetch.popleft()
        assert self.tracker.track(offset) == (not self.status[offset])
        self.tracked.append(offset)

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def duplicate_fetch(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(self.tracked))
        assert self.tracker.track(offset) is False

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(self.tracked))
        self.tracker.done(offset)
        self.status[offset] = True

    @precondition(lambda self: self.log)
    @rule(data=st.data())
    def late_result(self, data: st.DataObject) -> None:
        # A result for a delivery made before the last restart: the new owner ignores it.
        offset = data.draw(st.sampled_from(self.log))
        if offset not in self.tracked:
            self.tracker.done(offset)

    @rule()
    def restart(self) -> None:
        committed = self.tracker.committable()
        metadata, whole = self.tracker.metadata(self.budget)
        full, full_whole = self.tracker.metadata(10**9)
        assert full_whole
        assert len(metadata) <= self.budget
        assert whole == (len(full) <= self.budget)
        above = [offset for offset in self.log if offset >= committed]

        # The whole state records every known ack above the commit and no pending offset.
        state = decode(full) if full else None
        for offset in above:
            recorded = state is not None and state.is_done(offset)
            assert recorded == self.status[offset]

        # Acks above a truncated prefix are forgotten: those messages come again.
        restored = decode(metadata) if metadata else None
        if restored is not None:
            assert restored.base == committed
        for offset in above:
            self.status[offset] = restored is not None and restored.is_done(offset)

        self.start = committed
        self.previous = committed
        self.tracker = PartitionTracker(committed, self.max_in_flight, restored)
        self.tracked = []
        self.refetch = deque(above)

    @invariant()
    def commit_is_safe_and_monotonic(self) -> None:
        committable = self.tracker.committable()
        assert committable >= self.previous
        self.previous = committable
        # Never past a message that is not done, whether fetched again yet or not.
        assert all(self.status[offset] for offset in self.log if self.start <= offset < committable)
        if not self.refetch:
            # Once everything is fetched again, the restored state has nothing left to add.
            assert committable == naive_committable(
                self.start, self.tracked, {o for o in self.tracked if self.status[o]}
            )

    @invariant()
    def window_accounting(self) -> None:
        committable = self.tracker.committable()
        window = [offset for offset in self.tracked if offset >= committable]
        assert self.tracker.in_flight == len(window)
        assert self.tracker.pending == sum(not self.status[o] for o in self.tracked)
        assert self.tracker.is_full == (len(window) >= self.max_in_flight)
        assert self.tracker.last_tracked == (self.tracked[-1] if self.tracked else None)


TrackerLifecycle.TestCase.settings = settings(relaxed, max_examples=150, stateful_step_count=60)
test_tracker_lifecycle = TrackerLifecycle.TestCase


# --------------------------------------------------------------------------- leader epochs


def test_a_commit_carries_the_leader_epoch_of_the_record_before_it() -> None:
    # Given records 10..19 written in epoch 3 and 20..24 in epoch 5 (a leader election)
    tracker = PartitionTracker(10, 100)
    for offset in range(10, 25):
        tracker.saw_epoch(offset, 3 if offset < 20 else 5)
        tracker.track(offset)
    # Nothing done: a commit at 10 covers no fetched record; the first one known above it
    # bounds its epoch from above (epochs only grow along a log)
    assert tracker.commit_epoch(tracker.committable()) == 3
    # When 10..21 are done, the commit at 22 covers record 21, written in epoch 5
    for offset in range(10, 22):
        tracker.done(offset)
    assert tracker.committable() == 22
    assert tracker.commit_epoch(22) == 5
    # and a commit that stops at 20 covers record 19, of epoch 3 (with nothing known: none)
    assert PartitionTracker(10, 100).commit_epoch(20) is None
    again = PartitionTracker(10, 100)
    for offset in range(10, 25):
        again.saw_epoch(offset, 3 if offset < 20 else 5)
        again.track(offset)
    for offset in range(10, 20):
        again.done(offset)
    assert again.commit_epoch(again.committable()) == 3


def test_the_committed_epoch_goes_with_a_commit_that_has_not_moved() -> None:
    # Given a partition assigned at 40, committed with epoch 7, nothing fetched yet
    tracker = PartitionTracker(40, 100, committed_epoch=7)
    # Then a commit at 40 (new ack state, same offset) keeps epoch 7
    assert tracker.commit_epoch(tracker.committable()) == 7
    # An unknown committed epoch (-1 from the client) or offset 0 gives none
    assert PartitionTracker(40, 100, committed_epoch=-1).commit_epoch(40) is None
    assert PartitionTracker(0, 100, committed_epoch=7).commit_epoch(0) is None


def test_a_commit_below_a_cut_keeps_an_epoch_for_the_next_owner_to_check() -> None:
    # Given a partition assigned at 40 with epoch 0, its log then cut at 33 (the client seeks
    # back: the core truncates) and rewritten in epoch 1
    tracker = PartitionTracker(40, 100, committed_epoch=0)
    tracker.truncate(33)
    for offset in range(33, 36):
        tracker.saw_epoch(offset, 1)
        tracker.track(offset)
    # Then a commit at 33 (nothing done yet) still carries an epoch for record 32: the first
    # known above it, 1, an upper bound (its own was 0). Were the log cut again below 33, a
    # leader asked where epoch 1 ends answers for epoch 0 (epoch 1 began above the cut and
    # is gone), so the next owner's client still finds the cut (found by the simulation: a
    # commit with no epoch made the next owner skip a record written at 32 after a second cut)
    assert tracker.committable() == 33
    assert tracker.commit_epoch(33) == 1
    tracker.done(33)
    assert tracker.commit_epoch(tracker.committable()) == 1


def test_records_fetched_again_from_below_replace_the_epochs_of_a_cut_log() -> None:
    # Given records 0..9 of epoch 1, then the log cut at 5 and rewritten in epoch 2 (librdkafka
    # seeks back silently): 5.. arrive again with epoch 2, and track() refuses them as
    # duplicates
    tracker = PartitionTracker(0, 100)
    for offset in range(10):
        tracker.saw_epoch(offset, 1)
        tracker.track(offset)
    for offset in range(5, 12):
        tracker.saw_epoch(offset, 2)
        tracker.track(offset)
    for offset in range(12):
        tracker.done(offset)
    # Then a commit past 5 carries epoch 2: the log as it is now
    assert tracker.committable() == 12
    assert tracker.commit_epoch(5) == 1  # record 4 was not cut
    assert tracker.commit_epoch(12) == 2


def test_the_epochs_remembered_are_bounded() -> None:
    tracker = PartitionTracker(0, 10_000)
    for epoch in range(1000):
        tracker.saw_epoch(epoch, epoch)
        tracker.track(epoch)
    assert len(tracker._epochs) <= 64
    # the newest ones are kept; for the oldest offsets an upper bound (the oldest kept), never
    # an epoch lower than the record's (which would find a cut that is not there)
    assert tracker.commit_epoch(1) == 1000 - 64
    assert tracker.commit_epoch(1000) == 999


@relaxed
@given(
    start=st.integers(0, 50),
    steps=st.lists(st.integers(1, 3), max_size=30),
    done=st.sets(st.integers(0, 150)),
)
def test_a_run_tracked_at_once_is_each_offset_tracked(
    start: int, steps: list[int], done: set[int]
) -> None:
    # Given an increasing run of fetched offsets (gaps included) above a tracker's start
    offsets = []
    offset = start
    for step in steps:
        offsets.append(offset)
        offset += step
    one, many = PartitionTracker(start, 100), PartitionTracker(start, 100)
    # When one tracker takes them one by one and the other as a run, then some are done
    assert many.takes_run_from(start)
    assert all(one.track(o) for o in offsets)
    many.track_run(offsets)
    for o in done:
        one.done(o)
    many.done_many(done)
    # Then both answer the same, and neither takes the run again
    assert (many.committable(), many.in_flight, many.pending, many.metadata()) == (
        one.committable(),
        one.in_flight,
        one.pending,
        one.metadata(),
    )
    assert not offsets or not many.takes_run_from(offsets[-1])


def test_a_restored_state_is_never_taken_as_a_run() -> None:
    # Given a tracker restored with offset 11 acked / Then a run from 10 is not taken at once
    # (record by record, 11 is done without a delivery)
    tracker = PartitionTracker(10, 100, AckState(10, (1, 1)))
    assert not tracker.takes_run_from(10)
