"""Typed results of the DLQ commands: what ``--json`` prints and what the renderers take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def as_json(value: Any) -> Any:
    """A report as plain JSON data (dataclasses to objects, keys as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


# --- inspect ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """One record header; a record's headers are an ordered list and keys may repeat."""

    key: str
    value: str


@dataclass(frozen=True)
class SampleRecord:
    """A DLQ record as inspect shows it: values as text (or hex), cp-* headers decoded."""

    partition: int
    offset: int
    timestamp_ms: int | None
    key: str
    value: str
    headers: list[Header]
    cp: dict[str, str]


@dataclass(frozen=True)
class PartitionInspect:
    """One DLQ partition: what it holds and how far purge and merges got."""

    partition: int
    low: int
    high: int
    count: int
    oldest_ms: int | None
    newest_ms: int | None
    purged_to: int  # everything before it was deleted
    merged_to: int | None  # the merged prefix: every record before it was sent back
    merged_above: int  # records at or after merged_to (and still held) already sent back
    not_merged: int


@dataclass(frozen=True)
class InspectReport:
    """``dlq inspect``."""

    group: str
    topic: str
    merge_mark_group: str
    total: int
    not_merged: int
    partitions: list[PartitionInspect]
    sample: list[SampleRecord]


# --- report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionCount:
    partition: int
    count: int


@dataclass(frozen=True)
class StatusCount:
    status: str | None
    count: int


@dataclass(frozen=True)
class ReasonCount:
    reason: str | None
    count: int


@dataclass(frozen=True)
class ReasonTemplate:
    """Reasons that differ only in their values (numbers, quoted values, ids masked)."""

    template: str | None
    count: int
    distinct: int  # distinct reasons behind the template
    example: str | None


@dataclass(frozen=True)
class OriginCount:
    topic: str | None
    partition: int | None
    count: int


@dataclass(frozen=True)
class HourCount:
    hour: str | None
    hour_ms: int | None
    count: int


@dataclass(frozen=True)
class KeyCount:
    key: str
    count: int


@dataclass(frozen=True)
class ReportFiles:
    json: str
    png: str


@dataclass
class DlqReport:
    """``dlq report``: counts over the DLQ up to its end offsets when the report started."""

    topic: str
    generated_at: str
    offsets: dict[str, list[int]]
    total: int
    by_dlq_partition: list[PartitionCount]
    by_status: list[StatusCount]
    by_reason_template: list[ReasonTemplate]
    by_reason: list[ReasonCount]  # the most frequent exact reasons
    reasons_distinct: int
    by_original_partition: list[OriginCount]
    by_hour: list[HourCount]
    top_keys: list[KeyCount]
    group: str | None = None
    files: ReportFiles | None = None


# --- merge -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Island:
    """A stretch of selected records with no record between them that stays unmerged."""

    partition: int
    start: int  # first selected offset
    end: int  # one past the last selected offset
    count: int
    by_status: dict[str, int]


@dataclass
class Selected:
    """What a merge's selection found in its range (the counting pass)."""

    in_range: int
    islands: list[Island] = field(default_factory=list)
    already_merged: dict[int, int] = field(default_factory=dict)  # per DLQ partition


@dataclass(frozen=True)
class MarkView:
    """A DLQ partition's merge mark as shown to the operator."""

    merged_to: int
    merged_above: int  # merged records above merged_to (in the metadata)


@dataclass
class MergeSummary:
    """``dlq merge``: what was selected, written, skipped, and the mark afterwards."""

    group: str
    dlq_topic: str
    target_topic: str
    counts_as_merge: bool  # False with --to: another topic, the mark does not move
    dry_run: bool
    aborted: bool
    rate: float | None
    ranges: dict[str, list[int]]
    in_range: int
    selected: int  # matching the filters and not merged yet
    written: int
    skipped_merged: int  # matching, but a merge already sent them back
    deferred: int  # selected, left for the next merge: the mark's metadata budget was full
    merged: int  # written to the redrive topic (0 with --to)
    by_partition: dict[str, int]
    by_status: dict[str, int]
    merge_mark: dict[str, MarkView] | None
    write_seconds: float
    written_per_s: float | None


# --- purge -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PurgePartition:
    """One DLQ partition in a purge plan."""

    partition: int
    low: int
    high: int
    merged_to: int | None
    delete_before: int
    count: int
    merged_kept: int  # merged records kept because an unmerged one comes before them
    mark_past_end: bool = False  # the merge mark goes past the end: nothing deleted here


@dataclass
class PurgeSummary:
    """``dlq purge``."""

    group: str
    topic: str
    bound: str
    dry_run: bool
    partitions: list[PurgePartition]
    to_delete: int
    merged_kept: int
    deleted: int = 0
    new_low: dict[str, int] | None = None
    result: str = ""
