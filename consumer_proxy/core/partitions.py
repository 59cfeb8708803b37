"""The partition set of one group: every decision between a fetched record and a commit.

Assignment and revocation with restored ack state, intake into the tracker windows (with a
backlog when a window is full), the byte budget, results (through ``decision.decide``),
retries on an injected scheduler, DLQ writes pending, the pause plan and the commit plan.
Pure: no asyncio, no Kafka client, no gRPC I/O. The shell (``group.py`` and its objects:
``intake``, ``push``, ``committer``, ``parking``) feeds it records and results and executes
what it returns; the simulation (``tests/sim``) feeds it the same
way on a virtual clock.

Follow one message: ``intake`` -> (backlog ->) (ordering gate ->) ``emit`` (ready for a
worker) -> ``begin`` (a push starts) -> ``finish`` (the result, decided) -> done, or a retry
(``schedule`` -> ``emit`` again), or a DLQ write (``dead_lettered`` when confirmed -> done).
With ``delivery.ordering`` key or partition, a message whose key (lane) has one out waits in
the partition's ``KeyGate`` and is emitted when that one is done (``core/ordering.py``).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, ClassVar, Protocol, overload

from ..config import DeadLetterGuardConfig, DeliveryConfig
from .codec import CodecError, decode
from .decision import Action, Decision, Evidence, Policy, decide, unblock
from .guard import DeadLetterGuard, GuardView
from .ordering import PARTITION_LANE, KeyGate
from .outcomes import Classification, Outcome
from .records import (
    Origin,
    UserHeaders,
    counted_from_headers,
    due_at_from_headers,
    origin_from_headers,
    split_headers,
)
from .tracker import PartitionTracker

log = logging.getLogger(__name__)

TP = tuple[str, int]
SOURCE_PRIMARY = 1  # handler.proto DeliverySource values (the core does not import protos)
SOURCE_REDRIVE = 2
SOURCE_RETRY = 3
_ACKED = Decision(Action.ACK)
_HOLD = Decision(Action.HOLD, reason="held by the dead-letter guard")
_NO_HEADERS: dict[str, str] = {}  # read only
_NO_USER_HEADERS: UserHeaders = []  # read only: a record without headers (most of them)


class Record(Protocol):
    """What the core reads of a fetched record (a confluent_kafka.Message fits)."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> Any: ...
    def timestamp(self) -> tuple[int, int]: ...
    def leader_epoch(self) -> int | None: ...


class BreakerView(Protocol):
    """The breaker's counters the outage rule reads."""

    @property
    def successes(self) -> int: ...
    @property
    def openings(self) -> int: ...
    @property
    def is_open(self) -> bool: ...


class Handle(Protocol):
    """A scheduled callback that can be cancelled."""

    def cancel(self) -> None: ...


Scheduler = Callable[[float, Callable[[], None]], Handle]


@dataclass(eq=False, slots=True)
class Budget:
    """A byte budget shared by some of a group's partitions: intake pauses when it is spent.

    A group has one for its source and redrive topics and one per retry tier, so that tier
    records waiting for their due time never hold the source, or an earlier tier, back."""

    limit: int
    held: int = 0
    waiting: int = 0
    """Bytes of the records in the partitions' backlogs (fetched, not taken in yet)."""

    @property
    def spent(self) -> bool:
        """The messages taken in hold ``limit`` bytes or more: no more is taken in."""
        return self.held >= self.limit

    @property
    def full(self) -> bool:
        """With the backlogs, the budget holds ``limit`` bytes or more: fetching pauses."""
        return self.held + self.waiting >= self.limit


@dataclass(eq=False, slots=True)
class PartitionState:
    """One assigned partition."""

    topic: str
    partition: int
    tracker: PartitionTracker | None = None
    backlog: deque[Record] = field(default_factory=deque)
    backlog_bytes: int = 0  # of the records in the backlog (``_record_size``: headers too)
    paused: bool | None = None  # None: unknown (librdkafka keeps a pause across re-assign)
    revoked: bool = False
    leaving: bool = False  # being revoked: in-flight calls may finish, no new push starts
    epoch: int = 0  # bumped when the log is cut below what was received
    cuts: list[tuple[int, int]] = field(default_factory=list)  # (epoch, offset) of each cut
    received_end: int = -1  # the offset after the last record received (tracked or backlog)
    meta_over_budget: bool = False
    last_commit: tuple[int, str] | None = None
    last_epoch: int | None = None  # the leader epoch the last commit carried (None: unknown)
    calls: int = 0  # pushes and DLQ writes under way
    bytes: int = 0
    timers: set[Handle] = field(default_factory=set)
    gate: KeyGate[Delivery] | None = None  # delivery.ordering key / partition only
    tier: int = 0  # the retry tier this partition's topic is (0: a source or redrive topic)
    budget: Budget = field(default_factory=lambda: Budget(0))  # set on assign: whose bytes
    positions_from: int = 0  # the first consumer position reading that describes this log
    # Head-of-line unblocking (delivery.head_block_ms) only:
    head: tuple[int, float] = (-1, 0.0)  # (committable offset, since when it has not moved)
    unblocks: deque[float] = field(default_factory=deque)  # when it moved a head, last minute
    out: dict[int, Delivery] = field(default_factory=dict)  # pushes under way, by offset
    retrying: dict[int, tuple[Delivery, Handle]] = field(default_factory=dict)  # in memory
    due: dict[int, tuple[Delivery, Handle]] = field(default_factory=dict)  # tier, not yet due
    held: dict[int, Held] = field(default_factory=dict)  # by the dead-letter guard

    @property
    def tp(self) -> TP:
        """(topic, partition)."""
        return (self.topic, self.partition)


@dataclass(eq=False, slots=True)
class Delivery:
    """One message on its way through the proxy."""

    part: PartitionState
    epoch: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: UserHeaders
    given_origin: Origin | None  # None: a source record's own coordinates (``origin``)
    size: int
    source: int
    attempt: int  # the attempt number the handler sees (carries on across redrive)
    timestamp_ms: int = 0  # the record's, read by ``origin`` when ``given_origin`` is None
    counted_here: int = 0  # counted failures in this proxy: the max_attempts budget
    uncounted: int = 0  # service-level failures (outage): never dead-letter
    successes_mark: int = -1  # breaker successes when the previous attempt ended
    openings_mark: int = 0  # breaker openings when this call started
    request: Any = None  # the shell's cached request object
    tier: int = 0  # the retry tier it was read from (0: a source or redrive topic)
    due_at_ms: int = 0  # with Action.TIER: when the tier record is due (epoch ms)
    moved: bool = False  # moved aside as it blocked its partition: a late result is ignored
    alone: bool = False  # batch mode: goes in a batch of its own (its batch's answer was bad)
    retry_counted: bool = False  # waiting for an in-memory retry after a counted failure
    guard_probe: bool = False  # retried to probe a held dead-letter guard: its ack releases it
    trace: Any = None  # the shell's trace of it (tracing.MessageTrace); None with tracing off
    count: ClassVar[int] = 1  # messages in this ready item (a ``Run`` holds several)

    @property
    def origin(self) -> Origin:
        """The original coordinates: given (a redriven or tier record's, from its headers),
        else this record's own, made on first use (most messages are pushed and acked
        without it: ``wire`` reads the fields, and one object fewer per message is fewer of
        the collector's passes)."""
        origin = self.given_origin
        if origin is None:
            part = self.part
            origin = Origin(part.topic, part.partition, self.offset, self.timestamp_ms, 0)
            self.given_origin = origin
        return origin

    @property
    def stale(self) -> bool:
        """The partition was revoked, or its log was cut below this offset, since this
        message was fetched (a record at this offset now is another message)."""
        part = self.part
        if part.revoked:
            return True
        if part.epoch == self.epoch:
            return False
        return any(self.offset >= cut for epoch, cut in part.cuts if epoch > self.epoch)


@dataclass(eq=False, slots=True)
class Run:
    """A contiguous run of one partition's fetched source records, ready as one item (batch
    mode's fast path, ``PartitionSet(runs=True)``): taken into a call whole or split
    (``batching.take``), begun as one (``begin_batch``), its request built from the records
    (``wire.batch_request``) and finished as one when every message of it is a plain ack
    (``finish_acked``). Anywhere else it becomes the ``Delivery`` objects the record-by-record
    path makes (``deliveries``): a failure, a retry, a stale or leaving partition, a traced
    or unary call, a cancelled call, shutdown. Its records were tracked when it was made; a
    record with headers keeps its user headers in ``headers`` (what ``split_headers`` leaves
    of them, counted in its size, as the record-by-record path does: on a primary topic the
    proxy's own headers are dropped there too)."""

    part: PartitionState
    epoch: int
    records: list[Record]
    offsets: list[int]
    sizes: list[int]  # each record's key, value and user header bytes
    size: int  # their sum
    headers: list[UserHeaders] | None = None  # each record's user headers (None: none has any)
    openings_mark: int = 0  # as a ``Delivery``'s, once begun
    successes_mark: int = -1
    alone: ClassVar[bool] = False  # (never set: a message goes alone as a ``Delivery``)
    tier: ClassVar[int] = 0  # (a source record's)
    trace: ClassVar[Any] = None  # (never traced: a traced call takes its ``deliveries``)

    @property
    def count(self) -> int:
        """How many messages."""
        return len(self.offsets)

    def split(self, n: int) -> Run:
        """The first ``n`` messages as a run of their own; this one keeps the rest."""
        sizes = self.sizes[:n]
        size = sum(sizes)
        headers = self.headers
        head = Run(
            self.part,
            self.epoch,
            self.records[:n],
            self.offsets[:n],
            sizes,
            size,
            None if headers is None else headers[:n],
        )
        del self.records[:n], self.offsets[:n], self.sizes[:n]
        if headers is not None:
            del headers[:n]
        self.size -= size
        return head

    def deliveries(self) -> list[Delivery]:
        """Its messages as the record-by-record path would have made them (``_take_run``),
        with its begin marks."""
        part = self.part
        epoch = self.epoch
        openings = self.openings_mark
        successes = self.successes_mark
        out = []
        headers = self.headers
        if headers is None:
            headers = [_NO_USER_HEADERS] * len(self.offsets)
        for record, offset, size, user in zip(
            self.records, self.offsets, self.sizes, headers, strict=True
        ):
            ts = record.timestamp()[1]
            delivery = Delivery(
                part,
                epoch,
                offset,
                record.key(),
                record.value(),
                user,
                None,
                size,
                SOURCE_PRIMARY,
                1,
                ts if ts > 0 else 0,
            )
            delivery.openings_mark = openings
            delivery.successes_mark = successes
            out.append(delivery)
        return out


Ready = Delivery | Run
"""An item of batch mode's ready deque."""


def expand(items: Iterable[Ready]) -> list[Delivery]:
    """Each ``Run`` among ``items`` as its ``deliveries``, in order."""
    out: list[Delivery] = []
    for item in items:
        if isinstance(item, Run):
            out.extend(item.deliveries())
        else:
            out.append(item)
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """A message the dead-letter guard holds: what it would have been written with."""

    delivery: Delivery
    decision: Decision  # the DEAD_LETTER decision it would have had
    status: str  # the status of its last attempt (cp-status, if an operator releases it)


@dataclass(frozen=True, slots=True)
class Commit:
    """One partition's planned commit."""

    part: PartitionState
    offset: int
    metadata: str
    epoch: int | None = None  # the leader epoch of the record before ``offset`` (KIP-320)


def _commit_epoch(part: PartitionState, offset: int) -> int | None:
    """The leader epoch to commit ``offset`` with (its tracker's ``commit_epoch``). When the
    tracker knows none (nothing tracked since a cut, and no epoch committed before), the
    epoch of the backlog's first record: fetched after everything tracked, so at or above
    ``offset``, and epochs never decrease along a log, so it bounds the epoch of the record
    before ``offset`` from above, as ``commit_epoch``'s own fallback does. Without it, a commit
    made while every record waits in the backlog carries no epoch, and the next owner cannot
    find a second cut below it."""
    assert part.tracker is not None
    epoch = part.tracker.commit_epoch(offset)
    if epoch is None and part.backlog:
        epoch = part.backlog[0].leader_epoch()
    return epoch


def _repeats(part: PartitionState, offset: int, metadata: str, epoch: int | None) -> bool:
    """A commit of ``offset`` and ``metadata`` in leader ``epoch`` (that of the record
    before it) says nothing the last one did not. A known epoch other than the last commit's
    is news: after a log cut below a commit, the next owner finds the cut by the commit's
    epoch and reads from it again (KIP-320); once those records are done, the same offset
    must be committed again in their epoch, or every later owner reads them again too."""
    return part.last_commit == (offset, metadata) and (epoch is None or epoch == part.last_epoch)


@dataclass(slots=True)
class PausePlan:
    """Partitions to pause and to resume now."""

    pause: list[TP]
    resume: list[TP]
    paused: int  # partitions paused after the plan
    waiting: int = 0
    """... of which paused for room (their window, a backlog, the byte budget, the ack state's
    size), which the workers' progress frees; not those waiting only for a due time, the
    dead-letter guard or the breaker, which no poll brings sooner."""


@dataclass(slots=True)
class Counters:
    """Monotonic counts the shell turns into metrics."""

    ack: int = 0
    drop: int = 0
    retry: int = 0
    dead_letter: int = 0
    tier: int = 0
    unblocks: int = 0
    over_budget: int = 0
    resets: int = 0
    held: int = 0  # dead-letter decisions the guard held (each time one was held)


PAUSE_REASONS = ("breaker", "budget", "backlog", "metadata", "tier_due", "guard")
"""Why a partition is paused (``PartitionSet.views``): the breaker is open and it holds
messages; the group's byte budget is spent (by the messages taken in, or with the backlogs);
its backlog, the records fetched beyond its full window, is at its bound (``backlog_bound``);
its ack state is over the metadata budget; a retry tier record it read is not due yet; the
dead-letter guard holds a message of it."""
ROOM_REASONS = frozenset(("budget", "backlog", "metadata"))
"""The pause reasons the workers' progress undoes (``PausePlan.waiting``)."""
BACKLOG_WINDOWS = 10
"""A partition's backlog holds up to this many windows (``max_in_flight``) of records before
the partition pauses, and it resumes when the backlog is down to half of that. A pause costs
more than the records: librdkafka drops the partition's prefetched records, and on resume the
partition joins the next fetch request only, after the one in flight (long-polling the group's
other, often empty, partitions for up to ``fetch.wait.max.ms``, 500 ms) has returned. Paused
for every full window, one partition at 10,000 msg/s fell behind by 10-20 s; the records
held instead are bounded by the count below and their bytes by the group's byte budget."""
BACKLOG_MAX = 20_000
"""... and never more than this many records (a confluent_kafka.Message each)."""


def backlog_bound(max_in_flight: int) -> int:
    """The records a partition's backlog holds before the partition pauses."""
    return min(BACKLOG_WINDOWS * max_in_flight, BACKLOG_MAX)


@dataclass(frozen=True, slots=True)
class PartitionView:
    """One owned partition as an operator sees it (plain data, read-only)."""

    topic: str
    partition: int
    tier: int  # the retry tier this topic is (0: a source or redrive topic)
    committed: int | None  # the last confirmed commit
    ack_state_bytes: int  # its commit metadata
    window: int  # tracked offsets at or above the committable one
    window_max: int
    pending: int  # tracked and not done
    calls: int  # pushes and DLQ writes under way
    backlog: int
    retrying: int  # waiting for an in-memory retry
    due: int  # retry tier records read and not due yet
    next_due_ms: int | None  # the earliest of them (epoch ms)
    held: int  # by the dead-letter guard
    paused: bool
    reasons: tuple[str, ...]
    leaving: bool  # being revoked


@dataclass(frozen=True, slots=True)
class KeyBacklog:
    """The ordering gates' backlog (all zero when ordering is none)."""

    keys: int  # keys (lanes) with messages waiting behind their own message out
    longest: int  # messages waiting behind one key, at most
    held: int  # messages waiting, all keys


class PartitionSet:
    """All partitions of one group owned by this member, and what happens to their messages.

    ``emit(delivery)`` hands a message to the workers; ``schedule(delay_s, fn)`` runs ``fn``
    later (``loop.call_later`` in the shell, the virtual clock in the simulation);
    ``on_idle()`` tells the committer that a partition has nothing pending any more, so its
    progress can be committed soon instead of at the next interval.
    """

    def __init__(
        self,
        group: str,
        delivery: DeliveryConfig,
        redrive_topic: str,
        breaker: BreakerView,
        emit: Callable[[Delivery], None],
        schedule: Scheduler,
        on_idle: Callable[[], None] | None = None,
        rng: random.Random | None = None,
        retry_topics: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
        guard: DeadLetterGuardConfig | None = None,
        emit_batch: Callable[[Sequence[Ready]], None] | None = None,
        runs: bool = False,
    ) -> None:
        self.group = group
        self.parts: dict[TP, PartitionState] = {}
        self.budgets = [
            Budget(delivery.max_in_flight_bytes) for _ in range(len(delivery.retry_topics) + 1)
        ]
        """The source (and redrive) topics' byte budget, then one per retry tier, each of
        ``max_in_flight_bytes``: records waiting an hour for their due time in a tier must
        hold back neither the source nor an earlier tier (memory: at most the setting times
        one plus the number of tiers)."""
        self._positions_seen = 0  # the newest consumer position reading given to us
        self.counters = Counters()
        self.commits_failing = False
        """The last commit failed (broker unreachable): a partition whose done prefix runs
        ``max_in_flight`` past its last confirmed commit stops taking messages, so that losing
        it (or a crash) redelivers at most a window, however long the outage."""
        self._max_in_flight = delivery.max_in_flight
        self._backlog_max = backlog_bound(delivery.max_in_flight)
        self._backlog_resume = self._backlog_max // 2
        self._budget = delivery.metadata_budget_bytes
        self._policy = Policy(
            delivery.max_attempts,
            delivery.backoff,
            tuple(t.delay_ms for t in delivery.retry_topics),
            delivery.in_memory_attempts,
        )
        self._tiers = {topic: n for n, topic in enumerate(retry_topics, start=1)}
        # A tier record's cp-due-at is believed at most the longest tier delay ahead (a forged
        # or skewed one must not park a partition for years).
        self._max_due_s = max(self._policy.tiers_ms, default=0) / 1000.0
        self._clock = clock  # epoch seconds: a tier record's due time is wall-clock
        self._head_block_s = (
            delivery.head_block_ms / 1000.0 if delivery.head_block_ms is not None else None
        )
        self._max_unblock = delivery.max_unblock_per_minute
        self._watch = self._head_block_s is not None  # keep pushes under way by offset
        self._redrive = redrive_topic
        self._breaker = breaker
        self._emit = emit
        self._schedule = schedule
        self._on_idle = on_idle
        self.gone: Callable[[Delivery, str], None] | None = None
        """Told when a message leaves without being done here (why: ``revoked``, ``lost``,
        ``stale``, ``truncated``, ``shutdown``), wherever it waited: a retry timer, the
        dead-letter guard, the ready queue; the shell ends its trace (None: tracing off)."""
        self.guard = DeadLetterGuard(guard) if guard is not None and guard.enabled else None
        self._held: deque[Held] = deque()  # what the guard holds, oldest first (probes)
        self._probe: Handle | None = None
        self._probes: set[Delivery] = set()  # guard probes emitted that may still come back
        self._rng = rng or random.Random()
        # The ordering hooks are chosen once: with ordering none the per-message path is the
        # same as without a gate (``_admit`` is ``emit``, ``_complete`` is ``_done``).
        self.ordering = delivery.ordering
        self._admit: Callable[[Delivery], None] = emit
        self._complete: Callable[[Delivery], None] = self._done
        self._lane: Callable[[Delivery], Hashable] | None = None
        # A run of records taken in at once goes out at once (``emit_batch``, when the shell
        # has one); with an ordering gate each message passes the gate on its own.
        self._admit_run: Callable[[Sequence[Ready]], None] = emit_batch or self._admit_each
        if delivery.ordering != "none":
            self._admit_run = self._admit_each
            self._admit = self._admit_ordered
            self._complete = self._done_ordered
            self._lane = _key_lane if delivery.ordering == "key" else _partition_lane
        self.runs = (
            runs and emit_batch is not None and self._admit_run == emit_batch and not self._watch
        )
        """A run of records taken in at once goes out as ``Run`` items (batch mode's fast
        path; ``emit_batch`` takes them): not with an ordering gate or the head-of-line
        watch, whose bookkeeping is per message."""

    @property
    def bytes(self) -> int:
        """Bytes of fetched messages held (both budgets)."""
        return sum(budget.held for budget in self.budgets)

    # -- assignment ----------------------------------------------------------------------

    def assign(
        self,
        topic: str,
        partition: int,
        committed: int | None,
        metadata: str,
        epoch: int | None = None,
    ) -> None:
        """A partition arrives with its committed offset, commit metadata and the leader epoch
        committed with them (None when unknown)."""
        restored = None
        if committed is not None and metadata:
            try:
                # (a window's offsets make at most twice as many runs, and one more: a
                # state of more is not ours, and would cost memory no config bounds)
                restored = decode(metadata, max_runs=2 * self._max_in_flight + 2)
            except CodecError as exc:
                log.warning(
                    "group %s: %s[%d]: ignoring commit metadata that is not ours (%s); "
                    "messages above offset %d may be redelivered",
                    self.group,
                    topic,
                    partition,
                    exc,
                    committed,
                )
        part = PartitionState(topic, partition)
        if committed is not None:
            part.tracker = PartitionTracker(committed, self._max_in_flight, restored, epoch)
            part.last_commit = (committed, metadata or "")
            part.last_epoch = epoch
            part.received_end = committed
        if self._lane is not None:
            part.gate = KeyGate()
        part.tier = self._tiers.get(topic, 0)
        part.budget = self.budgets[part.tier]
        # A position read before this assignment describes the previous one (see
        # ``skip_unfetchable``).
        part.positions_from = self._positions_seen + 1
        old = self.parts.get(part.tp)
        if old is not None:
            self.forget(old)
        self.parts[part.tp] = part
        log.info(
            "group %s: assigned %s[%d] at offset %s%s",
            self.group,
            topic,
            partition,
            committed,
            " with ack state" if restored is not None else "",
        )

    def final_commit(self, part: PartitionState) -> Commit | None:
        """The commit to send as ``part`` leaves (None when nothing new is done)."""
        tracker = part.tracker
        if tracker is None:
            return None
        offset = tracker.committable()
        meta = tracker.metadata(self._budget)[0]
        epoch = _commit_epoch(part, offset)
        if _repeats(part, offset, meta, epoch):
            return None
        return Commit(part, offset, meta, epoch)

    def cancel_timers(self) -> None:
        """Shutdown: no retry timer nor the guard's probe fires any more (the messages are
        redelivered later)."""
        for part in self.parts.values():
            for timer in part.timers:
                timer.cancel()
            self._gone_waiting(part, "shutdown")
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None

    def _gone_waiting(self, part: PartitionState, why: str) -> None:
        """``gone`` for each message of ``part`` waiting on a retry timer or the guard."""
        gone = self.gone
        if gone is not None:
            for delivery, _ in part.retrying.values():
                gone(delivery, why)
            for held in part.held.values():
                gone(held.delivery, why)

    def forget(self, part: PartitionState, why: str = "revoked") -> None:
        """Drop a partition (``why``: revoked or lost): its timers, backlog and bytes go with
        it."""
        part.revoked = True
        for timer in part.timers:
            timer.cancel()
        part.timers.clear()
        self._gone_waiting(part, why)
        part.retrying.clear()
        part.due.clear()
        if part.held:
            part.held.clear()
            self._held = deque(h for h in self._held if h.delivery.part is not part)
        part.budget.held -= part.bytes
        part.bytes = 0
        part.backlog.clear()
        part.budget.waiting -= part.backlog_bytes
        part.backlog_bytes = 0
        if self.parts.get(part.tp) is part:
            del self.parts[part.tp]

    # -- intake --------------------------------------------------------------------------

    def intake(self, record: Record) -> None:
        """A fetched record (errors already handled by the shell)."""
        part = self.parts.get((record.topic() or "", record.partition() or 0))
        if part is None:
            return  # revoked while the batch was in flight
        offset = record.offset() or 0
        if offset < part.received_end and part.tracker is not None:
            self._reset(part, offset)
        part.received_end = offset + 1
        if part.tracker is None:
            part.tracker = PartitionTracker(offset, self._max_in_flight)
        if part.backlog or self._full(part) or part.budget.spent:
            part.backlog.append(record)
            size = _record_size(record)
            part.backlog_bytes += size
            part.budget.waiting += size
            return
        self._accept(part, record)

    def intake_batch(self, records: Sequence[Record]) -> None:
        """Fetched records in fetch order (errors already handled by the shell), as
        ``intake`` of each would take them. A run of one partition's records with nothing
        special about it (increasing offsets above what was received; not a retry tier or
        the redrive topic, no restored ack state, commits succeeding) is taken in at once:
        one window reading, one tracker call, one byte budget update, one ``emit``; what the
        window or the byte budget has no room for joins the backlog at once; anything else
        goes record by record through ``intake``."""
        parts = self.parts
        count = len(records)
        start = 0
        while start < count:
            record = records[start]
            topic = record.topic()
            partition = record.partition()
            end = start + 1
            while (
                end < count
                and records[end].partition() == partition
                and records[end].topic() == topic
            ):
                end += 1
            part = parts.get((topic or "", partition or 0))
            if part is not None:
                index = start
                if part.tracker is None:
                    # A partition without a committed offset: its first record makes the
                    # window (``intake``), and the rest may go as a run.
                    self.intake(record)
                    index += 1
                if (
                    index < end
                    and self._plain(part)
                    and (records[index].offset() or 0) >= part.received_end
                ):
                    if not part.backlog:
                        index += self._take_run(part, records, index, end)
                    index += self._backlog_run(part, records, index, end)
                for rest in range(index, end):
                    self.intake(records[rest])
            start = end

    def _plain(self, part: PartitionState) -> bool:
        """Nothing about ``part`` asks for its records one at a time (``_take_run`` may)."""
        tracker = part.tracker
        return (
            tracker is not None
            and not tracker.restoring
            and not part.tier
            and part.topic != self._redrive
            and not self.commits_failing
        )

    def _take_run(
        self, part: PartitionState, records: Sequence[Record], start: int, end: int
    ) -> int:
        """Track and admit records[start:end] of a ``_plain`` partition at once, as
        ``_accept`` of each would, as far as the window and the byte budget have room and
        the offsets increase above the last tracked one. With ``runs`` the records go out
        as one ``Run`` item (a record's user headers count in its size), else as
        ``Delivery`` items. Returns how many were taken."""
        tracker = part.tracker
        assert tracker is not None
        if start >= end or not tracker.takes_run_from(records[start].offset() or 0):
            return 0
        previous = (records[start].offset() or 0) - 1
        # (a new list: a ``Run`` of all of it keeps it, one of fewer a copy of its head)
        records = records[start : start + min(end - start, self._max_in_flight - tracker.in_flight)]
        if not isinstance(records, list):
            records = list(records)
        budget = part.budget
        spare = budget.limit - budget.held  # bytes before the budget is spent
        runs = self.runs
        epoch = part.epoch
        items: list[Ready] = []
        append = items.append
        offsets: list[int] = []
        sizes: list[int] = []
        track = offsets.append
        weigh = sizes.append
        total = 0
        marked: list[tuple[int, UserHeaders]] = []  # (with ``runs``) records with headers
        taken = 0
        no_headers = _NO_USER_HEADERS
        for record in records:
            if total >= spare:
                break  # the byte budget is spent: the rest waits in the backlog
            offset = record.offset() or 0
            if offset <= previous:
                break  # not increasing (a reset within the batch): record by record
            key = record.key()
            value = record.value()
            size = len(key or b"") + len(value or b"")
            headers = record.headers()
            if headers:
                user = split_headers(headers, False)[0]  # (a source topic's: all the user's)
                for name, data in user:  # (measured: a third of ``sum`` over a generator)
                    size += len(name) + len(data)
                if runs:
                    marked.append((taken, user))
            else:
                user = no_headers
            if not runs:
                ts = record.timestamp()[1]
                # (no Origin: ``Delivery.origin`` makes it from the fields if it is asked for)
                append(
                    Delivery(
                        part,
                        epoch,
                        offset,
                        key,
                        value,
                        user,
                        None,
                        size,
                        SOURCE_PRIMARY,
                        1,
                        ts if ts > 0 else 0,
                    )
                )
            else:
                weigh(size)  # (a ``Run`` keeps each record's size)
            track(offset)
            total += size
            previous = offset
            taken += 1
        if taken:
            self._saw_epochs(tracker, records, taken, offsets)
            if runs:
                append(self._run(part, records, taken, offsets, sizes, marked))
            tracker.track_run(offsets)
            part.received_end = max(part.received_end, previous + 1)
            part.bytes += total
            budget.held += total
            self._admit_run(items)
        return taken

    @staticmethod
    def _saw_epochs(
        tracker: PartitionTracker, records: Sequence[Record], taken: int, offsets: list[int]
    ) -> None:
        """Tell ``tracker`` the leader epochs of the first ``taken`` records (at ``offsets``,
        increasing), before it tracks them, as ``_accept`` of each would. Epochs never
        decrease along a log, so when the first and the last of them carry the same one, so
        does every record between (one reading per run instead of one per record)."""
        last_epoch = tracker.last_epoch
        leader = records[0].leader_epoch()
        if leader == records[taken - 1].leader_epoch():
            if leader != last_epoch and leader is not None:
                tracker.saw_epoch(offsets[0], leader)
            return
        for index in range(taken):
            leader = records[index].leader_epoch()
            if leader != last_epoch and leader is not None:
                tracker.saw_epoch(offsets[index], leader)
                last_epoch = tracker.last_epoch

    @staticmethod
    def _run(
        part: PartitionState,
        records: list[Record],
        taken: int,
        offsets: list[int],
        sizes: list[int],
        marked: list[tuple[int, UserHeaders]],
    ) -> Run:
        """The ``Run`` of the first ``taken`` records, with the user headers of those
        ``marked``: ``records`` itself when it holds no more (``_take_run``'s own list)."""
        headers: list[UserHeaders] | None = None
        if marked:
            headers = [_NO_USER_HEADERS] * len(offsets)
            for index, user in marked:
                headers[index] = user
        taken_records = records if taken == len(records) else records[:taken]
        return Run(part, part.epoch, taken_records, offsets, sizes, sum(sizes), headers)

    def _backlog_run(
        self, part: PartitionState, records: Sequence[Record], start: int, end: int
    ) -> int:
        """Append records[start:end] to the backlog of ``part`` at once while it has one or
        its window or byte budget is full (as ``intake`` of each would) and the offsets
        increase; returns how many."""
        if start >= end or not (part.backlog or self._full(part) or part.budget.spent):
            return 0
        previous = part.received_end - 1
        backlog = part.backlog
        size = taken = 0
        for index in range(start, end):
            record = records[index]
            offset = record.offset() or 0
            if offset <= previous:
                break
            backlog.append(record)
            size += len(record.key() or b"") + len(record.value() or b"")  # _record_size
            headers = record.headers()
            if headers:
                size += _headers_size(headers)
            previous = offset
            taken += 1
        part.received_end = previous + 1
        part.backlog_bytes += size
        part.budget.waiting += size
        return taken

    def _admit_each(self, deliveries: Sequence[Any]) -> None:  # (never a ``Run``: no ``runs``)
        admit = self._admit
        for delivery in deliveries:
            admit(delivery)

    def _reset(self, part: PartitionState, offset: int) -> None:
        """The consumer went back below what it handed over: the log was truncated (an
        unclean leader election) or the offset was reset. Everything at or above ``offset``
        is forgotten and delivered again as it is fetched; results for those offsets that
        arrive later are stale. Redelivering is safe, skipping would lose."""
        log.warning(
            "group %s: %s[%d]: position reset from %d to %d (log truncated or offset reset); "
            "delivering from %d again",
            self.group,
            part.topic,
            part.partition,
            part.received_end,
            offset,
            offset,
        )
        self.counters.resets += 1
        part.epoch += 1
        part.cuts.append((part.epoch, offset))
        part.received_end = offset
        # Positions read so far may predate the cut: none of them may move the commit.
        part.positions_from = self._positions_seen + 1
        assert part.tracker is not None
        first_cut = next((r for r in part.backlog if (r.offset() or 0) >= offset), None)
        if first_cut is not None:  # its epoch, when nothing tracked knows one (``bound_epoch``)
            epoch = first_cut.leader_epoch()
            if epoch is not None:
                part.tracker.bound_epoch(first_cut.offset() or 0, epoch)
        part.backlog = deque(r for r in part.backlog if (r.offset() or 0) < offset)
        part.budget.waiting -= part.backlog_bytes
        part.backlog_bytes = sum(_record_size(r) for r in part.backlog)
        part.budget.waiting += part.backlog_bytes
        part.tracker.truncate(offset)
        # Messages cut from the log that wait on a timer here (a retry, a tier due time) give
        # their bytes back now, and their offsets free for the new records' entries. Those
        # in the ready queue or in a call give them back when they come out (``drop_stale``,
        # ``finish``).
        for timed in (part.retrying, part.due):
            for o in [o for o in timed if o >= offset]:
                delivery, handle = timed.pop(o)
                handle.cancel()
                part.timers.discard(handle)
                self._release(delivery, "truncated")
        cut_held = [part.held.pop(o) for o in [o for o in part.held if o >= offset]]
        if cut_held:
            for held in cut_held:
                self._release(held.delivery, "truncated")
            self._held = deque(h for h in self._held if h not in cut_held)
        if part.gate is not None:
            # Messages cut from the log no longer hold their key back, and those waiting
            # are forgotten (their records come again with the new fetches).
            dropped, promoted = part.gate.prune(_is_stale)
            for delivery in dropped:
                self._release(delivery, "truncated")
            for delivery in promoted:
                self._emit(delivery)

    def truncated(self, tp: TP, position: int | None) -> None:
        """The consumer detected log truncation on ``tp`` (an unclean leader election) and
        moved its position back to ``position`` (None if unknown). What was received at or
        above it is gone and will be fetched anew; a restored ack state above what was
        received may describe records that are gone too, so it is dropped (redelivery, not
        loss). A cut below what was received but not reported here is caught by ``intake``."""
        part = self.parts.get(tp)
        if part is None or part.tracker is None:
            return
        if position is not None and 0 <= position < part.received_end:
            self._reset(part, position)
        else:
            part.tracker.truncate(max(part.received_end, 0))

    def skip_unfetchable(self, positions: dict[TP, int], reading: int) -> None:
        """Let the commit pass what the consumer skipped (transaction markers, aborted records).

        ``positions`` is the consumer's ``reading``-th reading of its positions (numbered from
        1, read right after a batch of records was handed over; the shell reads them every so
        often, not after every batch). A partition uses only readings taken after it was
        assigned and after its log was last cut: an older one may say 100 for a log now cut at
        60, and skipping to it would lose the records written at 60.. after the cut.
        Only for partitions without a backlog: a backlog holds handed-over messages that are
        not tracked yet, and skipping past them would lose them.
        """
        self._positions_seen = max(self._positions_seen, reading)
        for tp, position in positions.items():
            part = self.parts.get(tp)
            if (
                part is None
                or part.backlog
                or position < 0
                or position < part.received_end
                or reading < part.positions_from
            ):
                continue
            if part.tracker is None:  # no commit yet and nothing but markers so far
                part.tracker = PartitionTracker(position, self._max_in_flight)
            else:
                part.tracker.skip_to(position)
            part.received_end = position

    def _accept(self, part: PartitionState, record: Record) -> None:
        tracker = part.tracker
        assert tracker is not None
        offset = record.offset() or 0
        epoch = record.leader_epoch()
        if epoch is not None and (epoch != tracker.last_epoch or tracker.restoring):
            tracker.saw_epoch(offset, epoch)  # (once per epoch unless restoring: per record)
        if not tracker.track(offset):
            return  # done before a restart or rebalance: the commit metadata says so
        headers = record.headers()
        own = bool(part.tier) or part.topic == self._redrive  # (its cp-* headers are ours)
        if headers:
            user, ours = split_headers(headers, own)
        else:
            user, ours = _NO_USER_HEADERS, _NO_HEADERS
        key = record.key()
        value = record.value()
        source = SOURCE_PRIMARY
        origin = None
        attempt = 1
        if own:
            origin = origin_from_headers(ours)
            if origin is not None:
                source = SOURCE_RETRY if part.tier else SOURCE_REDRIVE
                attempt = origin.attempt + 1
        if origin is None:
            _, ts = record.timestamp()
            origin = Origin(part.topic, part.partition, offset, max(ts, 0), 0)
        size = len(key or b"") + len(value or b"")
        for name, data in user:  # (a generator per message cost more than the sum)
            size += len(name) + len(data)
        part.bytes += size
        part.budget.held += size
        delivery = Delivery(
            part, part.epoch, offset, key, value, user, origin, size, source, attempt
        )
        if part.tier and source == SOURCE_RETRY:
            # The attempts already made count towards max_attempts across the tiers.
            delivery.tier = part.tier
            delivery.counted_here = counted_from_headers(ours, origin)
            wait_s = min(due_at_from_headers(ours) / 1000.0 - self._clock(), self._max_due_s)
            if wait_s > 0:
                self._hold_until_due(delivery, wait_s)
                return
        self._admit(delivery)

    def _hold_until_due(self, delivery: Delivery, wait_s: float) -> None:
        """A retry tier record not yet due waits (inside the window, in the tiers' byte
        budget) on a timer; its partition pauses meanwhile (``pause_plan``), so nothing is
        fetched behind it."""
        part = delivery.part
        handle: Handle | None = None

        def due() -> None:
            part.timers.discard(handle)
            del part.due[delivery.offset]  # a cut would have cancelled this timer
            self._admit(delivery)

        handle = self._schedule(wait_s, due)
        part.timers.add(handle)
        part.due[delivery.offset] = (delivery, handle)

    def _admit_ordered(self, delivery: Delivery) -> None:
        gate = delivery.part.gate
        assert gate is not None and self._lane is not None
        if gate.admit(self._lane(delivery), delivery):
            self._emit(delivery)

    def _drain_backlog(self, part: PartitionState) -> None:
        """Take in what the window has room for (one window reading per call, not per
        record: a record takes at most one slot, so the room is never overrun)."""
        tracker = part.tracker
        if tracker is None:
            return
        if self.commits_failing:
            room = 0 if self._full(part) else 1
        else:
            room = self._max_in_flight - tracker.in_flight
        backlog = part.backlog
        budget = part.budget
        if room > 0 and backlog and self._plain(part):
            run = list(islice(backlog, min(room, len(backlog))))
            taken = self._take_run(part, run, 0, len(run))
            size = 0
            for _ in range(taken):  # (their sizes here, off the primary path's run)
                size += _record_size(backlog.popleft())
            part.backlog_bytes -= size
            budget.waiting -= size
            room -= taken
        while room > 0 and backlog and not budget.spent:
            record = backlog.popleft()
            size = _record_size(record)
            part.backlog_bytes -= size
            budget.waiting -= size
            self._accept(part, record)
            room -= 1

    # -- delivery ------------------------------------------------------------------------

    def drop_stale(self, delivery: Delivery) -> bool:
        """True when a ready message is stale (revoked, or cut from the log): a worker drops
        it, and its bytes are given back here."""
        part = delivery.part
        if part.epoch == delivery.epoch and not part.revoked:
            return False  # (``stale``'s common case, without the property: once a message)
        if delivery.stale:
            self._release(delivery, "stale")
            return True
        return False

    def begin(self, delivery: Delivery) -> bool:
        """A worker is about to push ``delivery``; False when it must be skipped: it is
        stale (its bytes are given back), or its partition is leaving (a revoke returns the
        partition's bytes)."""
        if self.drop_stale(delivery):
            return False
        if delivery.part.leaving:
            if self.gone is not None:
                self.gone(delivery, "revoked")
            return False
        delivery.part.calls += 1
        if self._watch:
            delivery.part.out[delivery.offset] = delivery
        breaker = self._breaker
        delivery.openings_mark = breaker.openings
        if delivery.successes_mark < 0:
            delivery.successes_mark = breaker.successes
        return True

    def drop_ready(self, ready: deque[Ready]) -> Callable[[Ready], bool]:
        """``batching.take``'s ``drop`` for batch mode's ready deque ``ready``: a stale
        message is dropped (``drop_stale``); a ``Run`` whose partition was cut or revoked
        becomes its ``deliveries`` at the front of ``ready`` (each then taken or dropped as
        the record-by-record path's; one of a leaving partition is taken, and ``begin_batch``
        skips its messages as ``begin`` would)."""
        drop_stale = self.drop_stale

        def drop(item: Ready) -> bool:
            if isinstance(item, Run):
                part = item.part
                if part.epoch == item.epoch and not part.revoked:
                    return False
                ready.extendleft(reversed(item.deliveries()))
                return True
            return drop_stale(item)

        return drop

    @overload
    def begin_batch(self, batch: Sequence[Delivery]) -> list[Delivery]: ...
    @overload
    def begin_batch(self, batch: Sequence[Ready]) -> list[Ready]: ...
    def begin_batch(self, batch: Sequence[Ready]) -> list[Ready] | list[Delivery]:
        """``begin`` of each message of one call: those that may be pushed, in order (the
        common case, a message of a partition neither cut nor leaving, without the call to
        ``begin``; a ``Run`` of such a partition begun as one, else as its ``deliveries``)."""
        breaker = self._breaker
        openings = breaker.openings
        successes = breaker.successes
        if self._watch:
            return [delivery for delivery in expand(batch) if self.begin(delivery)]
        began: list[Ready] = []  # (only messages when ``batch`` holds no ``Run``)
        append = began.append
        last: PartitionState | None = None
        plain = False  # ``last`` is neither revoked nor leaving
        for delivery in batch:
            part = delivery.part
            if part is not last:  # (a call's messages come in runs of one partition)
                last = part
                plain = not (part.revoked or part.leaving)
            if not plain or part.epoch != delivery.epoch:
                for one in delivery.deliveries() if isinstance(delivery, Run) else (delivery,):
                    if self.begin(one):
                        append(one)
                continue
            part.calls += delivery.count
            delivery.openings_mark = openings
            if delivery.successes_mark < 0:
                delivery.successes_mark = successes
            append(delivery)
        return began

    def finish(self, delivery: Delivery, result: Classification, probe: bool) -> Decision | None:
        """The push of ``delivery`` ended with ``result``; returns the decision taken, or None
        when the result is stale (the partition was revoked or reset meanwhile)."""
        part = delivery.part
        part.calls -= 1
        if self._watch:
            if delivery.moved:
                return None  # moved to a tier as it blocked the partition: too late
            if part.out.get(delivery.offset) is delivery:
                del part.out[delivery.offset]
        if result.outcome is Outcome.ACK and not delivery.stale:
            # The common case, once per message at batch rates: nothing to weigh.
            self.counters.ack += 1
            if delivery.guard_probe:
                self._probe_acked()
            self._complete(delivery)
            return _ACKED
        breaker = self._breaker
        evidence = Evidence(
            probe=probe,
            opened_during_call=breaker.openings != delivery.openings_mark,
            service_answered=breaker.successes > delivery.successes_mark,
        )
        delivery.successes_mark = breaker.successes
        if delivery.stale:
            self._release(delivery, "stale")
            return None
        if result.alone:
            delivery.alone = True
        decision = decide(
            delivery.counted_here,
            delivery.uncounted,
            result,
            evidence,
            self._policy,
            self._rng,
            delivery.tier,
        )
        action = decision.action
        counters = self.counters
        probe = delivery.guard_probe
        if probe and action is not Action.RETRY:
            delivery.guard_probe = False  # (held again: a later probe flags it again)
            self._probes.discard(delivery)
        if action is Action.ACK:
            counters.ack += 1
            self._complete(delivery)
        elif action is Action.DROP:
            counters.drop += 1
            if probe:  # the service decided it, as an ack would: the service works again
                self._probe_acked()
            self._complete(delivery)
        elif action is Action.DEAD_LETTER:
            if self.guard is not None and self._guard_holds(delivery, decision, result.status):
                return _HOLD
            counters.dead_letter += 1
            part.calls += 1  # the DLQ write: the partition's revoke waits for it too
        elif action is Action.TIER:
            # Done only once the tier write is confirmed (``tier_written``), as a DLQ write.
            counters.tier += 1
            delivery.counted_here += 1
            delivery.due_at_ms = int((self._clock() + decision.delay_s) * 1000)
            part.calls += 1
        else:
            counters.retry += 1
            delivery.retry_counted = decision.counted
            if decision.counted:
                delivery.counted_here += 1
                delivery.attempt += 1
            else:
                delivery.uncounted += 1
            self._retry_later(delivery, decision.delay_s)
        return decision

    def finish_acked(self, batch: Sequence[Ready], results: Sequence[Classification]) -> bool:
        """One call's answers, when every one is a plain ack: ``finish`` of each would ack
        it (ACK, not stale, not a guard probe; ordering none, no head-of-line watch). Then
        they are finished together (one tracker call and one byte budget update per
        partition, its backlog drained or the committer told it is idle once) and True is
        returned; otherwise nothing changes and False says to ``finish`` each in turn (of
        ``expand(batch)``: ``results`` has one per message, a ``Run`` holding several)."""
        if self._complete != self._done or self._watch:
            return False
        done: dict[PartitionState, tuple[list[int], list[int]]] = {}
        ack = Outcome.ACK
        last: PartitionState | None = None
        offsets: list[int] = []
        sizes: list[int] = []
        at = 0  # the first result of ``delivery``
        # The common answer is one classification object repeated (``classify_batch``):
        # read once, not per message.
        uniform = bool(results) and results.count(results[0]) == len(results)
        if uniform and results[0].outcome is not ack:
            return False
        for delivery in batch:
            part = delivery.part
            if part.epoch != delivery.epoch:
                return False
            if part is not last:  # (a call's messages come in runs of one partition)
                if part.revoked:
                    return False
                last = part
                entry = done.get(part)
                if entry is None:
                    entry = done[part] = ([], [])
                offsets, sizes = entry
            if isinstance(delivery, Run):
                count = len(delivery.offsets)
                if not uniform:
                    for result in results[at : at + count]:
                        if result.outcome is not ack:
                            return False
                offsets += delivery.offsets
                sizes.append(delivery.size)
                at += count
                continue
            if delivery.guard_probe or not (uniform or results[at].outcome is ack):
                return False
            offsets.append(delivery.offset)
            sizes.append(delivery.size)
            at += 1
        if at != len(results):
            raise ValueError(f"{len(results)} results for {at} messages")
        self.counters.ack += at
        for part, (offsets, sizes) in done.items():
            part.calls -= len(offsets)
            tracker = part.tracker
            assert tracker is not None
            tracker.done_many(offsets)
            size = sum(sizes)
            part.bytes -= size
            part.budget.held -= size
            if part.backlog:
                self._drain_backlog(part)
            elif tracker.pending == 0 and self._on_idle is not None:
                self._on_idle()
        return True

    def abandon(self, delivery: Delivery) -> None:
        """A push that began never reached the service (cancelled): deliver it again now."""
        part = delivery.part
        part.calls -= 1
        if self._watch:
            if delivery.moved:
                return
            if part.out.get(delivery.offset) is delivery:
                del part.out[delivery.offset]
        if delivery.stale:
            self._release(delivery, "stale")
        else:
            self._emit(delivery)

    def _retry_later(self, delivery: Delivery, delay_s: float) -> None:
        part = delivery.part
        handle: Handle | None = None

        def requeue() -> None:
            part.timers.discard(handle)
            del part.retrying[delivery.offset]  # a cut or an unblock would have cancelled us
            if delivery.stale:  # (revoked: forget() cancels the timers too)
                self._release(delivery, "stale")
            else:
                self._emit(delivery)

        handle = self._schedule(delay_s, requeue)
        part.timers.add(handle)
        part.retrying[delivery.offset] = (delivery, handle)

    def unblock(self, now_s: float) -> list[tuple[Delivery, Decision]]:
        """Head-of-line unblocking (``delivery.head_block_ms``), on the caller's clock: each
        partition whose committable offset has not moved for ``head_block_ms`` while offsets
        above it are done, and whose blocking message is being pushed or waits for an
        in-memory retry, while the service answers other calls (never in an outage), moves
        that message aside: to the next retry tier (or the DLQ after
        the last), as a failed attempt; its call's late result is ignored. At most
        ``max_unblock_per_minute`` per partition. Returns the writes to start, as ``finish``
        would for a TIER or DEAD_LETTER decision."""
        block_s = self._head_block_s
        if block_s is None:
            return []
        breaker = self._breaker
        if breaker.is_open:
            return []  # an outage: it never moves a message (guarantee 2)
        moves: list[tuple[Delivery, Decision]] = []
        for part in self.parts.values():
            tracker = part.tracker
            if tracker is None or part.leaving:
                continue
            head = tracker.committable()
            if part.head[0] != head:
                part.head = (head, now_s)
                continue
            waited = now_s - part.head[1]
            if waited < block_s or tracker.in_flight <= tracker.pending:
                continue  # not blocked long enough, or nothing done above it
            delivery = part.out.get(head)
            retrying = part.retrying.get(head)
            if delivery is None and retrying is not None:
                delivery = retrying[0]
            if delivery is None or delivery.stale or delivery.moved:
                continue  # fetched, waiting for its due time, or its write is under way
            if breaker.successes <= delivery.successes_mark or (
                retrying is None and breaker.openings != delivery.openings_mark
            ):
                # The outage rule: only a message stuck while the service answers others
                # (since its call began, or its previous attempt ended) is moved.
                continue
            unblocks = part.unblocks
            while unblocks and unblocks[0] <= now_s - 60.0:
                unblocks.popleft()
            if len(unblocks) >= self._max_unblock:
                continue
            # A message waiting for an in-memory retry after a counted failure has that
            # failure charged already, and its next attempt was not made: moving it charges
            # nothing more, and its record carries the attempts made.
            waiting = retrying is not None and retrying[0] is delivery
            charged = waiting and delivery.retry_counted
            decision = unblock(delivery.counted_here - charged, delivery.tier, self._policy, waited)
            if decision.action is Action.DEAD_LETTER and self.guard is not None and self.guard.held:
                continue  # a dead letter waits while the guard holds (no unblock spent)
            unblocks.append(now_s)
            part.head = (head, now_s)
            if retrying is not None and retrying[0] is delivery:
                retrying[1].cancel()
                part.timers.discard(retrying[1])
                del part.retrying[head]
            else:
                del part.out[head]
                delivery.moved = True  # its push's result, when it comes, is ignored
            self.counters.unblocks += 1
            if charged:
                delivery.attempt -= 1  # (the retry never came: attempts made so far)
            else:
                delivery.counted_here += 1
            part.calls += 1  # the write
            if decision.action is Action.TIER:
                self.counters.tier += 1
                delivery.due_at_ms = int((self._clock() + decision.delay_s) * 1000)
            else:
                self.counters.dead_letter += 1
            moves.append((delivery, decision))
        return moves

    def dead_lettered(self, delivery: Delivery) -> None:
        """The DLQ write of ``delivery`` is confirmed: its offset is done."""
        delivery.part.calls -= 1
        if delivery.stale:
            self._release(delivery)
        else:
            self._complete(delivery)

    def tier_written(self, delivery: Delivery) -> None:
        """The retry tier write of ``delivery`` is confirmed: its offset here is done."""
        self.dead_lettered(delivery)

    def tier_abandoned(self, delivery: Delivery) -> None:
        """The retry tier write was cancelled (revoked, shutdown): not done here, so the next
        owner delivers the message again."""
        self.dead_letter_abandoned(delivery)

    def dead_letter_abandoned(self, delivery: Delivery) -> None:
        """The DLQ write was cancelled (revoked, shutdown): the next owner dead-letters it.

        Its key stays held back (it is not done): the gate goes with the partition."""
        delivery.part.calls -= 1
        self._release(delivery)

    def _release(self, delivery: Delivery, gone: str = "") -> None:
        """Give ``delivery``'s bytes back; ``gone``: why it leaves without being done."""
        part = delivery.part
        if not part.revoked:  # a revoked partition's bytes were returned by forget()
            part.bytes -= delivery.size
            part.budget.held -= delivery.size
        if gone and self.gone is not None:
            self.gone(delivery, gone)

    def _done(self, delivery: Delivery) -> None:
        part = delivery.part
        tracker = part.tracker
        assert tracker is not None
        tracker.done(delivery.offset)
        if not part.revoked:  # _release, inline: once per message
            part.bytes -= delivery.size
            part.budget.held -= delivery.size
        if part.backlog:
            self._drain_backlog(part)
        elif tracker.pending == 0 and self._on_idle is not None:
            self._on_idle()

    def _done_ordered(self, delivery: Delivery) -> None:
        # The next message of the key goes out once this one is done, before the backlog
        # is drained (which may admit more behind it).
        gate = delivery.part.gate
        assert gate is not None and self._lane is not None
        nxt = gate.release(self._lane(delivery), delivery)
        if nxt is not None:
            self._emit(nxt)
        self._done(delivery)

    # -- the dead-letter guard (core/guard.py) ----------------------------------------------

    def _finished(self) -> tuple[int, int]:
        """The group's finished messages and the dead-letter decisions among them, so far."""
        c = self.counters
        dead = c.dead_letter + c.held
        return c.ack + c.drop + dead, dead

    def _guard_tick(self) -> None:
        assert self.guard is not None
        if self.guard.observe(self._clock(), *self._finished()):
            self._tripped()

    def _guard_holds(self, delivery: Delivery, decision: Decision, status: str) -> bool:
        """A dead-letter decision: True when the guard holds it (it holds, or this one tripped
        it); the message then waits in its window, its partition paused, no attempt spent."""
        guard = self.guard
        assert guard is not None
        finished, dead = self._finished()
        if guard.observe(self._clock(), finished + 1, dead + 1):
            self._tripped()
        if not guard.held:
            return False
        self.counters.held += 1
        held = Held(delivery, decision, status)
        delivery.part.held[delivery.offset] = held
        self._held.append(held)
        return True

    def _tripped(self) -> None:
        guard = self.guard
        assert guard is not None
        log.error(
            "group %s: dead-letter guard held: %.0f%% of the last %d finished messages were "
            "dead letters; messages that would be dead-lettered wait in their partitions "
            "(paused) until a probe (one every %.1fs) is acked, or an operator runs "
            "'consumer-proxy guard release'",
            self.group,
            guard.ratio * 100,
            guard.finished,
            guard.probe_interval_s,
        )
        self._schedule_probe()

    def _schedule_probe(self) -> None:
        assert self.guard is not None
        if self._probe is None:
            self._probe = self._schedule(self.guard.probe_interval_s, self._probe_due)

    def _live_held(self) -> Iterable[Held]:
        """The held messages still owned and not cut from their log, oldest first."""
        for held in self._held:
            delivery = held.delivery
            if delivery.part.held.get(delivery.offset) is held:
                yield held

    def _probe_due(self) -> None:
        """Retry the oldest held message: its ack releases the guard; a dead-letter decision
        holds it again (at the back)."""
        self._probe = None
        guard = self.guard
        if guard is None or not guard.held or guard.by_operator:
            return
        for held in self._live_held():
            delivery = held.delivery
            del delivery.part.held[delivery.offset]
            self._held = deque(h for h in self._held if h is not held)
            delivery.guard_probe = True
            self._probes.add(delivery)
            self._emit(delivery)
            break
        else:
            # Nothing held is left to probe (the held messages left with their partitions,
            # or were cut from their log) and no probe can come back: nothing can release
            # the guard any more, so it goes now; the window starts afresh.
            self._probes = {d for d in self._probes if not (d.stale or d.moved)}
            if not self._probes:
                since = guard.since or self._clock()
                self._held.clear()
                guard.release()
                log.warning(
                    "group %s: dead-letter guard released after %.1fs: it holds no message "
                    "any more (their partitions were revoked or cut), so no probe can decide",
                    self.group,
                    self._clock() - since,
                )
                return
        self._schedule_probe()

    def _probe_acked(self) -> None:
        guard = self.guard
        if guard is None or not guard.held or guard.by_operator:
            return
        held = list(self._live_held())
        for entry in held:
            delivery = entry.delivery
            del delivery.part.held[delivery.offset]
            self._emit(delivery)  # attempts counted from where they were
        since = guard.since or self._clock()
        self._held.clear()
        self._probes.clear()
        guard.release()
        log.warning(
            "group %s: dead-letter guard released after %.1fs: a held message was acked (the "
            "service was fixed or rolled back); %d held messages are retried",
            self.group,
            self._clock() - since,
            len(held),
        )

    def guard_hold(self) -> bool:
        """An operator holds the group's dead letters by hand (no probe releases it); False
        when there is no guard or it is held by hand already."""
        guard = self.guard
        if guard is None or not guard.hold(self._clock()):
            return False
        log.warning("group %s: dead-letter guard held by an operator", self.group)
        return True

    def guard_release(self) -> list[Held]:
        """An operator releases the guard: the dead letters are real. Returns the held
        messages, each to be written to the DLQ as decided (``dead_lettered`` once
        confirmed, like any dead letter)."""
        guard = self.guard
        if guard is None or not guard.held:
            return []
        released = list(self._live_held())
        for held in released:
            delivery = held.delivery
            del delivery.part.held[delivery.offset]
            delivery.part.calls += 1  # the DLQ write
        self.counters.dead_letter += len(released)
        self._held.clear()
        self._probes.clear()
        since = guard.since or self._clock()
        guard.release()
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        log.warning(
            "group %s: dead-letter guard released by an operator after %.1fs; %d held "
            "messages go to the DLQ",
            self.group,
            self._clock() - since,
            len(released),
        )
        return released

    def guard_state(self) -> tuple[GuardView, int] | None:
        """The guard's state and how many messages it holds (None: no guard)."""
        if self.guard is None:
            return None
        return self.guard.view(), sum(len(part.held) for part in self.parts.values())

    def key_backlog(self) -> KeyBacklog:
        """The ordering gates' backlog over the owned partitions (for the metrics)."""
        keys = longest = held = 0
        for part in self.parts.values():
            if part.gate is not None:
                k, m = part.gate.backlog()
                keys += k
                longest = max(longest, m)
                held += part.gate.held
        return KeyBacklog(keys, longest, held)

    # -- plans ---------------------------------------------------------------------------

    def pause_plan(self) -> PausePlan:
        """Which partitions to pause and resume now (drains backlogs that fit first).

        A partition pauses while the breaker is open and it holds messages (one with none
        keeps fetching: the half-open probe needs a message, and after a rebalance during an
        outage nothing else would bring one), the group is over its byte budget (with the
        backlogs), its backlog is at its bound (a full window alone does not pause: the
        records fetched beyond it wait in the backlog; a paused partition resumes when its
        backlog is down to half the bound), or its ack state is over the metadata budget and
        can still shrink by acks (never while it is re-fetching a restored range: only
        fetching could undo that). A partition whose pause state is unknown (just assigned:
        librdkafka keeps a pause across revoke and re-assign) always gets an explicit call.
        """
        breaker_open = self._breaker.is_open
        if self.guard is not None:
            self._guard_tick()
        pause: list[TP] = []
        resume: list[TP] = []
        paused = waiting = 0
        for part in self.parts.values():
            if part.backlog and not breaker_open:
                self._drain_backlog(part)
            kind = self._pause_kind(part, breaker_open)
            want = kind != 0
            if want is not part.paused:
                (pause if want else resume).append(part.tp)
                part.paused = want
            paused += want
            waiting += kind == 2
        return PausePlan(pause, resume, paused, waiting)

    def _pause_kind(self, part: PartitionState, breaker_open: bool) -> int:
        """``_pause_reasons`` as ``pause_plan`` needs it, short-circuited (it runs for every
        partition on every poll): 0 to fetch, 2 paused for room (``ROOM_REASONS``), 1 paused
        for another reason."""
        tracker = part.tracker
        if (
            part.budget.spent
            or (part.budget.full and part.backlog)
            or len(part.backlog) > (self._backlog_resume if part.paused else self._backlog_max - 1)
            or (part.meta_over_budget and tracker is not None and not tracker.restoring)
        ):
            return 2
        if (
            part.due
            or part.held
            or (breaker_open and (part.backlog or (tracker is not None and tracker.pending)))
        ):
            return 1
        return 0

    def _pause_reasons(self, part: PartitionState, breaker_open: bool) -> tuple[str, ...]:
        """Why ``part`` should be paused now (empty: it should fetch), named as in
        ``PAUSE_REASONS``."""
        tracker = part.tracker
        holding = bool(part.backlog) or (tracker is not None and tracker.pending > 0)
        backlog = len(part.backlog)
        checks = (
            breaker_open and holding,
            # (the backlogs' bytes pause only partitions with a backlog: one stuck partition's
            # must not stop the others)
            part.budget.spent or (part.budget.full and backlog > 0),
            backlog > (self._backlog_resume if part.paused else self._backlog_max - 1),
            part.meta_over_budget and tracker is not None and not tracker.restoring,
            bool(part.due),
            bool(part.held),
        )
        if not any(checks):  # the common case, once per partition on every poll
            return ()
        return tuple(name for name, hit in zip(PAUSE_REASONS, checks, strict=True) if hit)

    def views(self) -> list[PartitionView]:
        """A read-only picture of every owned partition (the operator console's)."""
        breaker_open = self._breaker.is_open
        views = []
        for part in self.parts.values():
            tracker = part.tracker
            due_ms = min((d.due_at_ms for d, _ in part.due.values()), default=0)
            views.append(
                PartitionView(
                    topic=part.topic,
                    partition=part.partition,
                    tier=part.tier,
                    committed=part.last_commit[0] if part.last_commit is not None else None,
                    ack_state_bytes=len(part.last_commit[1]) if part.last_commit else 0,
                    window=tracker.in_flight if tracker is not None else 0,
                    window_max=self._max_in_flight,
                    pending=tracker.pending if tracker is not None else 0,
                    calls=part.calls,
                    backlog=len(part.backlog),
                    retrying=len(part.retrying),
                    due=len(part.due),
                    next_due_ms=due_ms or None,
                    held=len(part.held),
                    paused=bool(part.paused),
                    reasons=self._pause_reasons(part, breaker_open),
                    leaving=part.leaving,
                )
            )
        return views

    def _full(self, part: PartitionState) -> bool:
        """The partition's window is full: ``max_in_flight`` offsets above the committable
        offset, or, while commits fail, above the last confirmed commit."""
        tracker = part.tracker
        assert tracker is not None
        if tracker.is_full:
            return True
        if not self.commits_failing or part.last_commit is None:
            return False
        last = tracker.last_tracked
        frontier = part.last_commit[0] if last is None else last + 1
        return frontier - part.last_commit[0] >= self._max_in_flight

    def commit_plan(self) -> tuple[list[Commit], list[PartitionState]]:
        """Each owned partition's commit (done prefix + ack state) that differs from the last
        one, and the partitions whose ack state newly went over the metadata budget."""
        plan: list[Commit] = []
        over: list[PartitionState] = []
        for part in self.parts.values():
            tracker = part.tracker
            if tracker is None:
                continue
            offset = tracker.committable()
            meta, complete = tracker.metadata(self._budget)
            if not complete and not part.meta_over_budget:
                self.counters.over_budget += 1
                over.append(part)
            part.meta_over_budget = not complete
            epoch = _commit_epoch(part, offset)
            if not _repeats(part, offset, meta, epoch):
                plan.append(Commit(part, offset, meta, epoch))
        return plan, over

    @staticmethod
    def committed(plan: Iterable[Commit]) -> list[Commit]:
        """Record a confirmed commit; returns the entries still owned."""
        kept = []
        for commit in plan:
            if not commit.part.revoked:
                commit.part.last_commit = (commit.offset, commit.metadata)
                commit.part.last_epoch = commit.epoch
                kept.append(commit)
        return kept

    def holding(self) -> bool:
        """True while any partition holds a message not yet done (tracked or in a backlog)."""
        return any(
            part.backlog or (part.tracker is not None and part.tracker.pending > 0)
            for part in self.parts.values()
        )

    def owned(self, tps: Sequence[TP]) -> list[PartitionState]:
        """The states of those of ``tps`` this member owns."""
        return [self.parts[tp] for tp in tps if tp in self.parts]

    @staticmethod
    def leave(parts: Iterable[PartitionState]) -> None:
        """These partitions are being revoked: calls in flight may finish, no new push
        starts (``begin`` refuses them)."""
        for part in parts:
            part.leaving = True

    def commit_confirmed(self, ok: bool) -> None:
        """The outcome of the last commit sent to Kafka (``commits_failing`` follows it)."""
        self.commits_failing = not ok


_new_tuple = tuple.__new__  # an Origin without the named tuple's Python-level __new__


def _record_size(record: Record) -> int:
    """What a backlog record counts in the byte budget: its key, value and headers (all of
    them, as fetched: a producer's bytes may all be in its headers)."""
    headers = record.headers()
    size = len(record.key() or b"") + len(record.value() or b"")
    return size + _headers_size(headers) if headers else size


def _headers_size(headers: Sequence[tuple[str, bytes | None]]) -> int:
    """The bytes of a record's headers, names and values."""
    size = 0
    for name, data in headers:  # (a loop: a generator in ``sum`` cost more)
        size += len(name) + len(data or b"")
    return size


def _key_lane(delivery: Delivery) -> Hashable:
    return delivery.key  # None: the partition's no-key lane


def _partition_lane(_delivery: Delivery) -> Hashable:
    return PARTITION_LANE


def _is_stale(delivery: Delivery) -> bool:
    return delivery.stale
