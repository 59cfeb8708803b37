"""When the shell polls and commits: the intake's poll wait and the committer's tick schedule.

Pure: no asyncio, no I/O; times are seconds on the caller's clock. The intake
(``intake.Intake``) asks :func:`room_wait` whether to wait for room instead of its next consume,
and :func:`poll_wait` how long that consume may wait; the committer
(``committer.Committer``) keeps a :class:`CommitCadence` that says when its next tick is due,
whether a tick reads the lag, and when a quiet group ticks slowly.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FETCH_WAIT_S",
    "IDLE_COMMIT_GAP_S",
    "IDLE_FETCH_WAIT_S",
    "QUIET_TICKS",
    "ROOM_WAIT_S",
    "SEND_TURNS",
    "STARVED_POLL_S",
    "WAITING_POLL_S",
    "CommitCadence",
    "gives_way",
    "poll_wait",
    "quiet_polls",
    "room_wait",
    "turns_before_poll",
]

IDLE_COMMIT_GAP_S = 0.1
"""At most this often an idle partition's progress is committed before the next interval."""
FETCH_WAIT_S = 0.2
"""How long one consume waits for a first message."""
IDLE_FETCH_WAIT_S = 6.0
"""... while the group holds no message at all (served in 2 s chunks on the consumer thread,
which end early for a commit, a rebalance or shutdown: see ``Fetcher.consume``)."""
QUIET_TICKS = 10
"""A group that held nothing for two commit intervals ticks every this many intervals."""
STARVED_POLL_S = 0.005
"""... while a commit is due or on its way to the consumer thread."""
WAITING_POLL_S = 0.05
"""... while a partition is paused for its window or the byte budget (a consume that gives
way to room freed meanwhile while little is ready: :func:`gives_way`)."""
ROOM_WAIT_S = 0.2
"""The longest the intake waits for room without a consume (:func:`room_wait`): a rebalance,
served only inside a consume, or room freed by anything but a call or a write (a commit that
shrank an ack state, a stale message dropped) waits at most this long, as long as behind one
ordinary poll (``FETCH_WAIT_S``). (At 50 ms, the consumes of groups blocked on slow calls
were a fifth of the simulation's polls.)"""


SEND_TURNS = 2
"""Turns of the event loop the intake lets pass after a poll that was not full, before it
queues its next consume (:func:`turns_before_poll`)."""


def turns_before_poll(*, taken: int, batch: int) -> int:
    """How many turns of the event loop the intake lets pass, after handing over the
    ``taken`` records (errors included) of a poll of at most ``batch``, before it queues its
    next consume on the consumer thread.

    A queued consume wakes the consumer thread, which then waits for the interpreter's lock
    and takes it as soon as the event loop lets go of it, at the next turn's select:
    between the intake and the call slot its records woke, or between the slot and the
    task in which grpc.aio sends the call (a turn later). The loop then waits for the lock
    back, and the call goes out late. Two turns first let the woken slots send (measured at
    1,000 msg/s, batch mode, ``bench_latency --stages``, 6 rounds each: a consume began
    0.28-0.72 ms after it was queued and a call went out 0.15-0.38 ms after its records
    reached the loop, p50; with the turns 0.09-0.12 and 0.11-0.17). A full poll (a backlog:
    the next records wait in the client already) queues its consume at once, as does an
    empty one."""
    return SEND_TURNS if 0 < taken < batch else 0


def quiet_polls(before: int, busy: bool) -> int:
    """Polls in a row that found the group holding nothing: ``busy`` says this poll fetched
    a message, or a partition is paused, or the group holds a message not yet done."""
    return 0 if busy else before + 1


def room_wait(
    *, waiting: bool, ready_low: bool, fetching: bool, since_poll_s: float
) -> float | None:
    """How long the intake may wait for room instead of its next consume; None: it consumes
    (for :func:`poll_wait`'s time).

    ``waiting`` and ``ready_low`` as for :func:`poll_wait`; ``fetching``: some assigned
    partition is not paused (a consume may bring its records); ``since_poll_s``: the time
    since the last consume returned. The intake's wait ends as soon as a call or a DLQ or
    retry tier write ends (its result is in the core: it may have freed a window, a backlog
    or bytes), or after the time returned.
    """
    # Every partition is paused, one for room, and the workers are about to run dry: a
    # consume can bring nothing but a rebalance or an error, and a freed window would wait
    # out its timeout. Polling every 5 ms for room was four fifths of the simulation's
    # polls, each a hop to the consumer thread; waiting for the calls resumes the partition
    # as soon as room is freed, with no hop until then. Rebalance callbacks run only inside
    # a consume: one comes at least every ROOM_WAIT_S (plus its own short wait), however
    # long the room takes.
    if waiting and ready_low and not fetching and since_poll_s < ROOM_WAIT_S:
        return ROOM_WAIT_S - since_poll_s
    return None


def gives_way(*, waiting: bool, ready_low: bool, fetching: bool) -> bool:
    """Whether the intake's next consume gives way to room freed while it waits (arguments
    as for :func:`poll_wait`): a partition is paused for room, another fetches, and the
    workers are about to run dry. Each call or DLQ or tier write that ends meanwhile gets a
    pause plan at once, and a change of it is
    queued on the consumer thread, which ends the consume's wait after its slice
    (``fetcher.wait_chunk``): the partition resumes then, not at the end of the wait."""
    return waiting and ready_low and fetching


def poll_wait(
    *,
    waiting: bool,
    ready_low: bool,
    fetching: bool,
    commit_due: bool,
    quiet: int,
    commits_failing: bool,
    commit_answering: bool,
) -> float:
    """How long the intake's next consume may wait for a first message.

    ``waiting``: a partition is paused for its window or the byte budget (not for the
    breaker); ``ready_low``: fewer messages are ready than the workers take in one round;
    ``fetching``: some assigned partition is not paused; ``commit_due``: a commit is due or
    on its way to the consumer thread; ``quiet``: polls in a row that found the group holding
    nothing (:func:`quiet_polls`); ``commit_answering``: a sent commit's answer is awaited.
    """
    # A paused partition resumes only from the intake, after the next consume returns: while
    # one waits for its window (not for the breaker) and another partition fetches (else
    # :func:`room_wait`), poll briefly, or a freed window would wait out the whole fetch
    # timeout (measured: 1 partition, batches of 50 at 20 ms, a 200
    # window: 1,000 msg/s instead of 10,000).
    if waiting:
        # Poll often only while the workers are about to run dry: each poll is a hop to the
        # consumer thread, and polling every 5 ms throughout cost the 1-partition batch
        # workload 15% (0.80 -> 0.94 of a bare loop at 50 ms).
        if not ready_low:
            return WAITING_POLL_S
        # While the workers run dry and another partition fetches, the consume gives way
        # (:func:`gives_way`): room freed while it waits ends it as soon as the consumer
        # thread sees the resume queued. (It polled every 5 ms instead: half the
        # simulation's polls, each a hop to the consumer thread and a pause plan.)
        # With every partition paused, the consume that ends a wait for room (room_wait)
        # can bring only a rebalance or an error: waiting in it would hold up a resume.
        return WAITING_POLL_S if fetching else 0.0
    if commit_due:
        # A commit is due or on its way to the consumer thread: a long poll ahead of it would
        # hold it up (measured: a group's last commit 0.3-0.4 s late).
        return STARVED_POLL_S
    if quiet < 2 or commits_failing or commit_answering:
        # (A sent commit's answer comes inside any consume, however long it waits, but the
        # committer's next commit, due from a wake-up meanwhile (the group's last acks), is
        # queued only after it: behind an idle wait's 2 s chunk it waited for the chunk's end,
        # the group's last commit ~2 s late in 3 of 36 rounds of bench_throughput.)
        return FETCH_WAIT_S
    # Nothing held or paused for two polls, and no commit due, running or failing (the
    # committer is woken by the last ack and holds its lock until its commit returned; one
    # queued behind a long wait would wait for its 2 s chunk, as a group's last commit did in
    # half the runs of the 1-partition batch bench): only a new message, which ends the wait
    # at once, or a rebalance, served inside consume, can change anything. An idle group's
    # intake wakes every 6 s instead of five times a second (the idle cost of many groups).
    return IDLE_FETCH_WAIT_S


@dataclass
class CommitCadence:
    """The committer's ticks: every ``interval_s``, and every ``QUIET_TICKS`` intervals once
    the group held nothing and committed nothing for two ticks in a row (the idle cost).
    Between ticks the committer also commits when woken (a partition went idle), ``gap_s``
    after the last commit at the soonest, or at once when the whole group went idle
    (``gap_ends_early``)."""

    interval_s: float
    next_tick: float
    quiet: int = 0
    """Ticks in a row with nothing held and nothing to commit."""
    early: bool = False
    """The last commit started before its gap ended (``gap_ends_early``)."""

    @classmethod
    def starting(cls, now: float, interval_s: float) -> CommitCadence:
        """The cadence of a committer starting at ``now``: its first tick one interval on."""
        return cls(interval_s, now + interval_s)

    @property
    def gap_s(self) -> float:
        """The least time between two commits."""
        return min(IDLE_COMMIT_GAP_S, self.interval_s)

    @property
    def slow(self) -> bool:
        """Ticking every ``QUIET_TICKS`` intervals: new traffic should wake the committer."""
        return self.quiet >= 2

    def gap_ends_early(self, idle: bool) -> bool:
        """Woken during the gap after a commit: whether the next commit may start at once.
        It may when the group holds nothing any more (its last partition went idle after
        the commit: committing it now is what a bare loop does at its end; measured: a
        group's last commit waited for the gap, up to 100 ms, after the first of its
        partitions to go idle took the commit before), unless the commit before started
        early itself: at most two commits start within any ``gap_s``."""
        return idle and not self.early

    def gap_ended(self, early: bool) -> None:
        """The gap after a commit ended: ``early`` (``gap_ends_early``), or waited out."""
        self.early = early

    def wait_s(self, now: float) -> float:
        """How long to wait for a wake-up before the next tick."""
        return max(0.0, self.next_tick - now)

    def committed(self, now: float, committed: int, holding: bool) -> bool:
        """A commit round ended at ``now`` (``committed`` partitions; ``holding``: the group
        holds a message not yet done). Returns True when this round is a tick that should
        read the lag."""
        if now >= self.next_tick:
            # A quiet group's lag cannot change: new records wake it (it holds them).
            read_lag = self.quiet < 2 or bool(committed) or holding
            self.quiet = 0 if committed or holding else self.quiet + 1
            # A group that holds nothing has nothing to commit until messages come (the
            # intake then wakes the committer): it ticks every QUIET_TICKS intervals.
            self.next_tick = now + self.interval_s * (QUIET_TICKS if self.quiet >= 2 else 1)
            return read_lag
        if holding and self.quiet:
            self.quiet = 0
            self.next_tick = min(self.next_tick, now + self.interval_s)  # busy again
        return False
