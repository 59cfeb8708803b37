"""Out-of-order commit tracker: which fetched offsets of one partition are done.

Messages are pushed in parallel and finish in any order, but Kafka only stores one committed
offset per partition. The tracker keeps the window of offsets fetched and not yet committed,
each pending or done, and answers two questions: up to where may we commit (the first
tracked offset that is not done), and which acks above that point must travel in the commit
metadata so that a rebalance or a restart does not redeliver them.

Pure logic, no I/O, not thread-safe: one owner per partition.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from .codec import AckState, encode

__all__ = ["DEFAULT_METADATA_BUDGET", "PartitionTracker"]

DEFAULT_METADATA_BUDGET = 4000
"""Characters of commit metadata, under the broker's default 4096-byte limit."""


MAX_EPOCH_CHANGES = 64
"""Leader-epoch changes remembered above the commit point (an election each; a few at most)."""


class PartitionTracker:
    """Pending / done state of one partition's fetched offsets, and the committable offset.

    The committable offset C is the first tracked offset that is not done; when every
    tracked offset is done it is the last tracked offset + 1, and before anything is tracked
    it is ``committed``. A restored ack state never moves C past an offset not fetched
    again (the log may have been cut there); its acks make re-fetched offsets done at once.
    Fetched offsets need not be contiguous (compaction and transaction markers leave gaps); a
    gap never holds C back. C never goes backwards.

    ``max_in_flight`` does not make :meth:`track` refuse anything: messages already fetched
    must still be tracked. It drives :attr:`is_full`, which tells the caller to pause fetching.
    """

    __slots__ = (
        "_committed",
        "_epochs",
        "_last",
        "_max_in_flight",
        "_offsets",
        "_pending",
        "_restored",
        "epoch",
    )

    def __init__(
        self,
        committed: int,
        max_in_flight: int,
        restored: AckState | None = None,
        committed_epoch: int | None = None,
    ) -> None:
        """Start tracking at the ``committed`` offset.

        ``restored`` is the ack state decoded from the commit metadata; it is used only when
        it starts at ``committed``. Otherwise someone moved the committed offset (an offset
        reset) and the state describes a different position, so it is ignored.
        ``committed_epoch`` is the leader epoch committed with ``committed``, when known.
        """
        if committed < 0:
            raise ValueError(f"committed offset must be >= 0, got {committed}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._committed = committed
        self._max_in_flight = max_in_flight
        # Tracked offsets in fetch order, from C upwards. Done offsets at the left end are
        # dropped lazily by committable(), so done() stays a single set operation.
        self._offsets: deque[int] = deque()
        self._pending: set[int] = set()
        # committed - 1 before anything is tracked, so one comparison in track() rejects both
        # duplicates and offsets below C.
        self._last = committed - 1
        self._restored = restored if restored is not None and restored.base == committed else None
        self.epoch: int | None = self._restored.epoch if self._restored is not None else None
        """The highest leader epoch seen (fetched records and a restored state): the epoch
        the metadata records."""
        # Where the leader epoch changes in the log, as (first offset, epoch), offsets and
        # epochs increasing (and the committed one's, when known): the epoch of the record
        # before C goes with a commit at C (KIP-320), so that the next owner's client finds a
        # log cut below C and seeks back to it instead of skipping what was written there
        # after the cut. A cut leaves the entries above it: upper bounds, see commit_epoch.
        self._epochs: list[tuple[int, int]] = []
        if committed_epoch is not None and committed_epoch >= 0 and committed > 0:
            self._epochs.append((committed - 1, committed_epoch))
            if self.epoch is None or committed_epoch > self.epoch:
                self.epoch = committed_epoch  # (records of it skip saw_epoch: last_epoch)

    def track(self, offset: int) -> bool:
        """Record a fetched offset; return True if its message must be delivered.

        Returns False without tracking it for a duplicate fetch (an offset at or below the
        last tracked one, which includes everything below C). Returns False and tracks it as
        done when the restored ack state says it was already acked, so C can move past it.
        """
        if offset <= self._last:
            return False
        self._last = offset
        self._offsets.append(offset)
        restored = self._restored
        if restored is not None:
            if offset < restored.end:
                if restored.is_done(offset):
                    return False
            else:
                # Fetches only move forward, so the restored state has nothing more to say.
                self._restored = None
        self._pending.add(offset)
        return True

    def takes_run_from(self, offset: int) -> bool:
        """True when :meth:`track` would deliver every offset of an increasing run starting
        at ``offset``: it is above the last tracked one and no restored state is left to
        say that one of them was acked already (:meth:`track_run` may take the run)."""
        return offset > self._last and self._restored is None

    def track_run(self, offsets: list[int]) -> None:
        """Record a run of fetched offsets at once, as :meth:`track` of each would (each
        returning True): strictly increasing, the first one accepted by
        :meth:`takes_run_from`."""
        if not offsets:
            return
        assert self.takes_run_from(offsets[0]), "a run must start above the last tracked offset"
        self._last = offsets[-1]
        self._offsets.extend(offsets)
        self._pending.update(offsets)

    def saw_epoch(self, offset: int, epoch: int) -> None:
        """The record about to be tracked at ``offset`` was written in leader ``epoch``.

        A restored state was committed after every record it describes was fetched, so a
        record in its range written in a later epoch than the state's reuses an offset of a
        truncated log (an unclean leader election): the state no longer describes the log,
        and is dropped (its acks are redelivered, never skipped). Call before :meth:`track`.
        """
        restored = self._restored
        if (
            restored is not None
            and restored.epoch is not None
            and epoch > restored.epoch
            and offset < restored.end
        ):
            self._restored = None
        if self.epoch is None or epoch > self.epoch:
            self.epoch = epoch
        epochs = self._epochs
        while epochs and epochs[-1][0] >= offset:
            epochs.pop()  # fetched again from below: the log was cut there
        if not epochs or epoch > epochs[-1][1]:
            epochs.append((offset, epoch))
            if len(epochs) > MAX_EPOCH_CHANGES:
                del epochs[0]  # the oldest offsets then get the first kept: an upper bound

    def bound_epoch(self, offset: int, epoch: int) -> None:
        """A record at ``offset`` in leader ``epoch`` was fetched but never tracked (a cut
        dropped it from the backlog). When nothing tracked tells an epoch, it bounds the epoch
        of every record before it from above, as :meth:`commit_epoch`'s fallback does: a
        commit below it then still carries an epoch by which the next owner finds a second
        cut below the commit (KIP-320)."""
        if not self._epochs:
            self._epochs.append((offset, epoch))

    def commit_epoch(self, offset: int) -> int | None:
        """The leader epoch of the record before ``offset`` (:meth:`committable`: the last
        record a commit there covers), or None when nothing is known of it.

        When no epoch change is known at or below that record, the epoch of the first known
        record above it (a later record's, or the committed one's: epochs only grow along a
        log) is given instead. That errs on the safe side: a leader asked where that epoch
        ends answers for the latest epoch it still has at or below it, which a cut below the
        commit never leaves past the cut (KIP-320 finds the cut all the same)."""
        before = offset - 1
        epochs = self._epochs
        while len(epochs) > 1 and epochs[1][0] <= before:
            del epochs[0]
        return epochs[0][1] if epochs else None

    def skip_to(self, offset: int) -> None:
        """The consumer moved on to ``offset``: untracked offsets below it will never be fetched.

        Transaction markers and aborted records are skipped by the consumer without being
        handed over, so a trailing one would otherwise hold C one short of the log's end
        forever. Call only when every message the consumer handed over below ``offset`` is
        tracked; a smaller ``offset`` is ignored.
        """
        if offset - 1 > self._last:
            self._last = offset - 1
        restored = self._restored
        if restored is not None and offset >= restored.end:
            self._restored = None  # fetching has passed the restored range

    def truncate(self, offset: int) -> None:
        """The log was cut at ``offset`` (an unclean leader election): forget every offset at
        or above it, done or not; new records will reuse those offsets. Offsets below it keep
        their state. The committable offset drops to ``offset`` if it was above."""
        self._offsets = deque(o for o in self._offsets if o < offset)
        self._pending = {o for o in self._pending if o < offset}
        self._last = min(self._last, offset - 1)
        self._committed = min(self._committed, offset)
        restored = self._restored
        if restored is not None and restored.end > offset:
            self._restored = None  # its acks above the cut describe records that are gone

    def done(self, offset: int) -> None:
        """Mark a tracked offset done; unknown or already done offsets are ignored.

        Late results for offsets that are no longer tracked (after a rebalance, or below C)
        are harmless, so they are not errors.
        """
        self._pending.discard(offset)

    def done_many(self, offsets: Iterable[int]) -> None:
        """:meth:`done` of each offset (one call for a batch call's answers)."""
        self._pending.difference_update(offsets)

    def committable(self) -> int:
        """Return the offset to commit: the first offset that is not known to be done.

        That is the first tracked offset that is not done, else the offset after the last
        tracked one. Amortised O(1):
        each tracked offset is dropped from the window exactly once.
        """
        offsets = self._offsets
        pending = self._pending
        while offsets:
            head = offsets[0]
            if head in pending:
                return head
            offsets.popleft()
        # Never past what was fetched, even where a restored state marks offsets done: an
        # unclean leader election may have cut the log there since, and only fetching the
        # offset (and seeing its leader epoch) tells whether its record is still the one the
        # state describes. Until then the state's acks travel in the metadata.
        return self._last + 1

    @property
    def in_flight(self) -> int:
        """Number of tracked offsets at or above C, done or not: the window's size."""
        self.committable()
        return len(self._offsets)

    @property
    def last_epoch(self) -> int | None:
        """The epoch of the last change :meth:`saw_epoch` recorded: a record of this epoch
        above it changes nothing (the intake skips the call), one of another epoch does."""
        epochs = self._epochs
        return epochs[-1][1] if epochs else None

    @property
    def restoring(self) -> bool:
        """True while fetching has not yet passed the end of a restored ack state: only
        fetching, not acks, can shrink the metadata until then."""
        return self._restored is not None

    @property
    def pending(self) -> int:
        """Number of tracked offsets not yet done."""
        return len(self._pending)

    @property
    def is_full(self) -> bool:
        """True when the window holds ``max_in_flight`` offsets: pause fetching."""
        if len(self._offsets) < self._max_in_flight:  # the window before done heads go
            return False
        return self.in_flight >= self._max_in_flight

    @property
    def max_in_flight(self) -> int:
        """The window size at which :attr:`is_full` turns True."""
        return self._max_in_flight

    @property
    def last_tracked(self) -> int | None:
        """The highest tracked offset, or None if nothing was tracked since the start."""
        # Tracked offsets are >= committed, so _last is still committed - 1 iff none was.
        return None if self._last < self._committed else self._last

    def metadata(self, budget: int = DEFAULT_METADATA_BUDGET) -> tuple[str, bool]:
        """Return the commit metadata for a commit at :meth:`committable` and whether it is whole.

        The metadata records which offsets above C are done: acks in the window, and acks of
        a restored state for offsets not fetched again yet (so a second rebalance soon after
        the first does not forget them). Call it right after :meth:`committable` with no
        :meth:`done` in between, so both describe the same C.

        The string is never longer than ``budget``. When the whole state does not fit, the
        longest prefix of it that fits is returned with False: acks above the prefix would be
        redelivered after a crash (never lost), and the caller should stop fetching the
        partition until the state fits again. With no done offset above C the metadata is ""
        and the flag True.
        """
        base = self.committable()
        runs = self._runs(base)
        if not runs:
            return "", True
        text = encode(AckState(base, runs, self.epoch))
        if len(text) <= budget:
            return text, True
        return self._longest_prefix(base, runs, budget, self.epoch), False

    def _runs(self, base: int) -> tuple[int, ...]:
        """Pending/done run lengths from ``base`` (which is C) up to the last done offset.

        A gap (an offset never fetched) joins the run before it: it will never be fetched,
        so its state does not matter, and joining a neighbour never adds a run. The trailing
        pending run is left out because offsets past the state's end are redelivered anyway.
        """
        offsets = self._offsets
        pending = self._pending
        restored = self._restored
        fetched_end = self._last + 1
        if restored is None and len(offsets) == len(pending):
            return ()
        runs: list[int] = []
        if offsets:
            run_start = base
            in_done_run = False
            for offset in offsets:
                if (offset not in pending) != in_done_run:
                    runs.append(offset - run_start)
                    run_start = offset
                    in_done_run = not in_done_run
            runs.append(fetched_end - run_start)
        if restored is not None:
            for is_done, length in _segments_from(restored, max(base, fetched_end)):
                if not runs and is_done:
                    # C itself is a restored ack not fetched again (C stops at what was
                    # fetched): the state starts with an empty pending run.
                    runs.append(0)
                # Runs alternate, so a run at an odd index is a done run.
                if is_done == (len(runs) % 2 == 1):
                    runs.append(length)
                else:
                    runs[-1] += length
        if len(runs) % 2 == 1:
            runs.pop()
        return tuple(runs)

    @staticmethod
    def _longest_prefix(base: int, runs: tuple[int, ...], budget: int, epoch: int | None) -> str:
        # Binary search over whole pending+done run pairs: a prefix ending in a pending run
        # says nothing more than the shorter one. The compressed size is not strictly monotonic
        # in the prefix length, but every returned candidate is checked against the budget.
        best = ""
        low, high = 1, len(runs) // 2 - 1
        while low <= high:
            pairs = (low + high) // 2
            text = encode(AckState(base, runs[: 2 * pairs], epoch))
            if len(text) <= budget:
                best = text
                low = pairs + 1
            else:
                high = pairs - 1
        return best


def _segments_from(state: AckState, start: int) -> Iterator[tuple[bool, int]]:
    """Yield (is_done, length) for the runs of ``state`` clipped to offsets >= ``start``."""
    run_start = state.base
    is_done = False
    for length in state.runs:
        run_end = run_start + length
        if run_end > start:
            yield is_done, run_end - max(run_start, start)
        run_start = run_end
        is_done = not is_done
