"""The shell's cadences, driven without a broker: the intake's poll wait, the commit ticks."""

from __future__ import annotations

import pytest

from consumer_proxy.core.cadence import (
    FETCH_WAIT_S,
    IDLE_COMMIT_GAP_S,
    IDLE_FETCH_WAIT_S,
    QUIET_TICKS,
    ROOM_WAIT_S,
    SEND_TURNS,
    STARVED_POLL_S,
    WAITING_POLL_S,
    CommitCadence,
    gives_way,
    poll_wait,
    quiet_polls,
    room_wait,
    turns_before_poll,
)
from consumer_proxy.core.ejection import breaker_hears


def wait(
    *,
    waiting: bool = False,
    ready_low: bool = False,
    fetching: bool = True,
    commit_due: bool = False,
    quiet: int = 0,
    commits_failing: bool = False,
    commit_answering: bool = False,
) -> float:
    return poll_wait(
        waiting=waiting,
        ready_low=ready_low,
        fetching=fetching,
        commit_due=commit_due,
        quiet=quiet,
        commits_failing=commits_failing,
        commit_answering=commit_answering,
    )


def test_a_partition_waiting_for_its_window_is_polled_briefly() -> None:
    # Given a partition paused for its window while another fetches: the poll is short
    assert wait(waiting=True, ready_low=False) == WAITING_POLL_S
    assert wait(waiting=True, ready_low=True) == WAITING_POLL_S
    # and that wins over an idle group's long wait
    assert wait(waiting=True, quiet=5) == WAITING_POLL_S


def test_while_little_is_ready_a_consume_gives_way_to_room_freed() -> None:
    # Given a partition paused for room, another fetching, and the workers about to run
    # dry: the consume gives way to room freed while it waits (no 5 ms polls)
    assert gives_way(waiting=True, ready_low=True, fetching=True)
    # Not with enough ready (room freed is not needed at once), nothing paused for room, or
    # every partition paused (the intake waits for room without a consume: room_wait)
    assert not gives_way(waiting=True, ready_low=False, fetching=True)
    assert not gives_way(waiting=False, ready_low=True, fetching=True)
    assert not gives_way(waiting=True, ready_low=True, fetching=False)


def test_with_every_partition_paused_the_intake_waits_for_room_instead_of_polling() -> None:
    # Given every partition paused, one for room, and the workers about to run dry: the
    # intake waits for a call to end, at most until a consume is ROOM_WAIT_S away
    assert room_wait(waiting=True, ready_low=True, fetching=False, since_poll_s=0.0) == (
        ROOM_WAIT_S
    )
    left = room_wait(waiting=True, ready_low=True, fetching=False, since_poll_s=0.03)
    assert left == pytest.approx(ROOM_WAIT_S - 0.03)
    # ... then it consumes (rebalance callbacks run only in there), without waiting in it
    assert room_wait(waiting=True, ready_low=True, fetching=False, since_poll_s=ROOM_WAIT_S) is None
    assert wait(waiting=True, ready_low=True, fetching=False) == 0.0
    # Another partition fetching, enough ready, or nothing paused for room: it polls
    assert room_wait(waiting=True, ready_low=True, fetching=True, since_poll_s=0.0) is None
    assert room_wait(waiting=True, ready_low=False, fetching=False, since_poll_s=0.0) is None
    assert room_wait(waiting=False, ready_low=False, fetching=False, since_poll_s=0.0) is None


def test_while_a_sent_commits_answer_is_awaited_an_idle_group_polls_briefly() -> None:
    # Given a group that held nothing for five polls, whose last commit was sent and its
    # answer not come yet (the committer's next commit, due from the group's last acks,
    # follows the answer)
    # Then the intake waits a normal poll, served in slices, not an idle group's long wait
    assert wait(quiet=5, commit_answering=True) == FETCH_WAIT_S
    # ... and once the answer came, the long wait again
    assert wait(quiet=5) == IDLE_FETCH_WAIT_S


def test_a_commit_due_or_under_way_is_never_held_up_by_a_long_poll() -> None:
    assert wait(commit_due=True, quiet=5) == STARVED_POLL_S


def test_only_a_group_quiet_for_two_polls_with_commits_working_waits_long() -> None:
    assert wait(quiet=0) == FETCH_WAIT_S
    assert wait(quiet=1) == FETCH_WAIT_S
    assert wait(quiet=2) == IDLE_FETCH_WAIT_S
    assert wait(quiet=2, commits_failing=True) == FETCH_WAIT_S


def test_quiet_polls_count_polls_in_a_row_that_found_nothing() -> None:
    quiet = 0
    for _ in range(3):
        quiet = quiet_polls(quiet, busy=False)
    assert quiet == 3
    assert quiet_polls(quiet, busy=True) == 0


def test_a_quiet_group_ticks_every_quiet_ticks_intervals_and_wakes_on_traffic() -> None:
    # Given a cadence of 1 s ticks
    cadence = CommitCadence.starting(0.0, 1.0)
    assert cadence.gap_s == pytest.approx(min(IDLE_COMMIT_GAP_S, 1.0))
    assert cadence.wait_s(0.25) == pytest.approx(0.75)
    # A commit round before the tick is no tick
    assert cadence.committed(0.5, committed=1, holding=False) is False
    # When two ticks pass with nothing held or committed: both read the lag, then it slows
    assert cadence.committed(1.0, committed=0, holding=False) is True
    assert cadence.committed(2.0, committed=0, holding=False) is True
    assert cadence.slow and cadence.next_tick == pytest.approx(2.0 + QUIET_TICKS)
    # and a quiet tick reads no lag (it cannot have changed)
    assert cadence.committed(12.0, committed=0, holding=False) is False
    # When the group holds a message again between ticks, the usual cadence returns
    assert cadence.committed(12.5, committed=0, holding=True) is False
    assert not cadence.slow and cadence.next_tick == pytest.approx(13.5)


def test_the_gap_after_a_commit_ends_early_once_when_the_whole_group_went_idle() -> None:
    cadence = CommitCadence.starting(0.0, 1.0)
    # A wake-up while the group still holds messages lets the gap go on
    assert cadence.gap_ends_early(idle=False) is False
    # When the group's last partition went idle during the gap: the next commit starts at once
    assert cadence.gap_ends_early(idle=True) is True
    cadence.gap_ended(early=True)
    # but not twice in a row: at most two commits start within any gap
    assert cadence.gap_ends_early(idle=True) is False
    cadence.gap_ended(early=False)
    # and after a gap waited out in full, the group's going idle ends the next one again
    assert cadence.gap_ends_early(idle=True) is True


def test_the_breaker_hears_neither_an_ejected_instances_failure_nor_a_protocol_error() -> None:
    assert breaker_hears(True, ejected=False) is True
    assert breaker_hears(False, ejected=False) is False
    assert breaker_hears(False, ejected=True) is False  # a success counts, ejected or not
    assert breaker_hears(True, ejected=True) is None
    assert breaker_hears(None, ejected=False) is None


def test_after_a_poll_that_was_not_full_the_call_slots_send_before_the_next_consume() -> None:
    # A trickle (fewer records than a fetch, an error among them counted too): the loop turns
    # in which woken call slots send, and grpc's task sends, come first
    assert turns_before_poll(taken=1, batch=5000) == SEND_TURNS == 2
    assert turns_before_poll(taken=4999, batch=5000) == SEND_TURNS
    # An empty poll has nothing to send; a full one is a backlog: its next records are in
    # the client already, so its consume is queued at once
    assert turns_before_poll(taken=0, batch=5000) == 0
    assert turns_before_poll(taken=5000, batch=5000) == 0
