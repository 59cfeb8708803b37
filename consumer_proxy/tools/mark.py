"""The merge mark: which DLQ records merges have sent back, per DLQ partition (pure logic).

Kafka keeps it as the committed offsets of the consumer group ``<group>.dlq-merge`` on the DLQ
topic, never joined: the committed offset is the *merged prefix* (every record below it was
sent back by a merge, or never existed), and the records merged above it travel in the commit
metadata, encoded with the proxy's ack-state codec (``core.codec``): an ``AckState`` whose base
is the committed offset and whose done runs are the merged offsets. So a merge with one filter
leaves the records it did not select findable by the next merge, and ``purge --merged`` stops
at the first record no merge sent back.

Metadata written before marks were per record (JSON, or nothing) decodes as "nothing merged
above the committed offset", which is what those marks meant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..core.codec import AckState, CodecError, decode, encode

Interval = tuple[int, int]
"""[start, end) offsets."""

DEFAULT_BUDGET_CHARS = 4000
"""Metadata size limit: under the broker's ``offset.metadata.max.bytes`` (4096 by default)."""


@dataclass(frozen=True)
class MergeMark:
    """One DLQ partition's mark: offsets below ``state.base`` and its done runs are merged."""

    state: AckState

    @classmethod
    def empty(cls, offset: int = 0) -> MergeMark:
        """Nothing merged at or above ``offset``."""
        return cls(AckState(max(0, offset)))

    @classmethod
    def from_commit(cls, offset: int, metadata: str | None) -> MergeMark:
        """The mark from a committed offset and its metadata (foreign metadata: prefix only)."""
        try:
            state = decode(metadata)
        except CodecError:
            return cls.empty(offset)
        if state.base != offset:  # metadata not written together with this offset
            return cls.empty(offset)
        return cls(state)

    @property
    def prefix(self) -> int:
        """The committed offset: every record below it was merged."""
        return self.state.base

    def metadata(self) -> str:
        """The commit metadata carrying the merged runs above the prefix."""
        return encode(self.state)

    def is_merged(self, offset: int) -> bool:
        """Whether a merge sent the record at ``offset`` back."""
        return self.state.is_done(offset)

    def merged_runs(self) -> list[Interval]:
        """The merged intervals above the prefix, in order."""
        runs: list[Interval] = []
        at = self.state.base
        for index, length in enumerate(self.state.runs):
            if index % 2 == 1:
                runs.append((at, at + length))
            at += length
        return runs

    def merged_intervals(self) -> list[Interval]:
        """Every merged interval, the prefix ``[0, prefix)`` first when it is not empty."""
        head = [(0, self.prefix)] if self.prefix > 0 else []
        return head + self.merged_runs()

    def merged_between(self, start: int, end: int) -> int:
        """How many offsets in ``[start, end)`` are merged."""
        return sum(
            max(0, min(end, e) - max(start, s)) for s, e in self.merged_intervals() if s < end
        )

    def with_merged(self, intervals: Iterable[Interval]) -> MergeMark:
        """This mark plus ``intervals`` (merged from now on); the prefix only moves forward."""
        merged = _union([*self.merged_runs(), *((s, e) for s, e in intervals if e > s)])
        base = self.state.base
        runs: list[int] = []
        at = base
        for start, end in merged:
            if end <= base:
                continue
            if start <= at and not runs:
                base = at = max(at, end)  # extends the contiguous prefix
                continue
            runs += [start - at, end - start]
            at = end
        return MergeMark(AckState(base, tuple(runs)))

    def fits(self, budget_chars: int) -> bool:
        """Whether the metadata fits in ``budget_chars``."""
        return len(self.metadata()) <= budget_chars


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def fit_islands(
    mark: MergeMark, islands: Sequence[Interval], budget_chars: int = DEFAULT_BUDGET_CHARS
) -> int:
    """How many of ``islands`` (in offset order) this merge may take so the mark still fits.

    Each island is a stretch of records the merge selected with no record between them that
    stays unmerged. Taking fewer islands is always safe: the records after the cut are not
    written and stay for the next merge, whose mark starts from a longer prefix.
    """
    if mark.with_merged(islands).fits(budget_chars):
        return len(islands)
    low, high = 0, len(islands)  # low fits (prefix of none), high does not
    while high - low > 1:
        middle = (low + high) // 2
        if mark.with_merged(islands[:middle]).fits(budget_chars):
            low = middle
        else:
            high = middle
    return low
