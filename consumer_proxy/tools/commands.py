"""``consumer-proxy dlq ...``: the DLQ commands and each one's flow.

- ``inspect`` peeks with a plain consumer (read-only: no group joins, no offsets committed).
- ``report`` and ``merge`` run on Spark (``jobs``; the optional ``pipeline`` extra); this
  module plans their offset ranges and keeps the merge mark (``mark``, ``kafka_ops``).
- ``purge`` deletes a prefix of each DLQ partition with the admin API (delete records).

A merge reads from the merged prefix to the end offsets seen at its start, selects with the
filters, skips what earlier merges sent back, writes the rest to the redrive topic (or to
``--to``), and only then records, per record, what it sent back. ``purge --merged`` deletes up
to the first record no merge sent back, so nothing unmerged is ever deleted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..config import GroupConfig, KafkaConfig, ProxyConfig
from ..errors import ConfigError
from . import jobs, kafka_ops, spark
from .mark import DEFAULT_BUDGET_CHARS, MergeMark, fit_islands
from .render import format_ms, printable, render_inspect, render_report, write_chart
from .reports import Island, MarkView, MergeSummary, PurgeSummary, ReportFiles, Selected, as_json

CommonOptions = Callable[..., None]
EXIT_OK, EXIT_FAILURE = 0, 1
INSPECT_LIMIT_MAX = 100_000
"""The most records ``dlq inspect --limit`` shows (it holds them all to print)."""


# --- arguments -------------------------------------------------------------------------------


def parse_time(text: str) -> int:
    """A time as epoch milliseconds: ISO-8601 (UTC when no offset is given) or epoch ms."""
    value = text.strip()
    if re.fullmatch(r"\d+", value):
        return int(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ISO-8601 (e.g. 2025-05-01T12:00:00Z) nor epoch milliseconds"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def _spark_options(parser: argparse.ArgumentParser) -> None:
    options = parser.add_argument_group("Spark")
    options.add_argument(
        "--master",
        default="local[*]",
        metavar="URL",
        help="Spark master (default local[*]: every core of this machine); e.g. "
        "spark://host:7077 for a cluster",
    )
    options.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.driver.memory=4g (repeatable)",
    )
    options.add_argument(
        "--connector-version",
        metavar="V",
        help="version of org.apache.spark:spark-sql-kafka-0-10 (default: the installed "
        "PySpark's; resolved through ~/.ivy2.5.2, ~/.m2 and Maven Central)",
    )


def add_dlq_commands(sub: Any, common: CommonOptions) -> None:
    """Register ``dlq`` and its subcommands on the top-level subparsers."""
    dlq = sub.add_parser("dlq", help="inspect, report on, merge back and purge a group's DLQ")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="DLQ_COMMAND")

    inspect = dlq_sub.add_parser(
        "inspect",
        help="per partition: count, oldest/newest, merge/purge marks, and a sample with cp-* "
        "headers decoded",
    )
    common(inspect, as_json=True)
    inspect.add_argument("--group", required=True, metavar="NAME", help="the group")
    inspect.add_argument(
        "--limit",
        type=int,
        default=10,
        metavar="N",
        help="records to show (default 10, at most 100,000)",
    )
    inspect.add_argument(
        "--dry-run", action="store_true", help="accepted for symmetry; inspect never writes"
    )

    report = dlq_sub.add_parser(
        "report",
        help="Spark job: counts by status, reason, original partition, hour and key; JSON + PNG",
        description="Aggregate the whole DLQ (bounded to its end offsets at start) on Spark. "
        "Writes <out>/<group>-dlq-report.json and .png and prints a summary.",
    )
    common(report, as_json=True)
    report.add_argument("--group", required=True, metavar="NAME", help="the group")
    report.add_argument(
        "--out", type=Path, default=Path("."), metavar="DIR", help="output directory (default .)"
    )
    report.add_argument("--top", type=int, default=10, metavar="N", help="top keys (default 10)")
    report.add_argument(
        "--dry-run", action="store_true", help="accepted for symmetry; report writes only files"
    )
    _spark_options(report)

    columns = "\n".join(f"  {name:<19} {meaning}" for name, meaning in jobs.DLQ_COLUMNS.items())
    merge = dlq_sub.add_parser(
        "merge",
        help="Spark job: send selected DLQ records back through the group's redrive topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Read the DLQ from the merge mark to its end offsets at start, keep the "
            "selected records that no merge sent back yet and write them, unchanged (key, "
            "value, all headers), to the group's redrive topic, which the proxy delivers with "
            "the original coordinates and the attempt count carried on. The merge mark then "
            "records exactly those records as merged: records the filters leave out stay for "
            "a later merge, and purge --merged never deletes them.",
            width=78,
        ),
        epilog="columns for --where (Spark SQL, view dlq; a failed cast is NULL):\n" + columns,
    )
    common(merge, as_json=True)
    merge.add_argument("--group", required=True, metavar="NAME", help="the group")
    merge.add_argument(
        "--since",
        type=parse_time,
        metavar="T",
        help="DLQ record timestamp at or after T (ISO-8601 or epoch ms)",
    )
    merge.add_argument(
        "--until",
        type=parse_time,
        metavar="T",
        help="DLQ record timestamp before T (ISO-8601 or epoch ms)",
    )
    merge.add_argument(
        "--status",
        action="append",
        default=[],
        metavar="S",
        help="cp-status equal to S, e.g. INVALID_ARGUMENT (repeatable, or comma-separated)",
    )
    merge.add_argument(
        "--where",
        metavar="SPARK_SQL",
        help="a Spark SQL condition, e.g. \"value LIKE '%%v2%%'\"; run with your rights "
        "(reflect() calls Java): never build one from a record's content",
    )
    merge.add_argument(
        "--from-start",
        action="store_true",
        help="read from the oldest record still in the DLQ and send the selected records "
        "again even when a merge already sent them back",
    )
    merge.add_argument(
        "--rate",
        type=float,
        metavar="N",
        help="write at most N records per second over the whole write (one cap across all "
        "Spark tasks, bursts of at most a twentieth of a second's worth), for a service "
        "still recovering",
    )
    merge.add_argument(
        "--to",
        metavar="TOPIC",
        help="write the selection to TOPIC instead of the redrive topic (a replay elsewhere); "
        "it does not count as merged: the mark does not move and purge --merged keeps them",
    )
    merge.add_argument(
        "--dry-run", action="store_true", help="count what would be merged; write nothing"
    )
    merge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _spark_options(merge)

    purge = dlq_sub.add_parser(
        "purge",
        help="delete DLQ records up to a bound (admin API delete records)",
        description="Delete, per DLQ partition, every record before a bound. Shows what it "
        "will delete and asks for confirmation (on a terminal) unless --yes.",
    )
    common(purge, as_json=True)
    purge.add_argument("--group", required=True, metavar="NAME", help="the group")
    bound = purge.add_mutually_exclusive_group(required=True)
    bound.add_argument(
        "--until",
        type=parse_time,
        metavar="T",
        help="records whose timestamp is before T (per partition, up to the first one at or "
        "after T)",
    )
    bound.add_argument(
        "--merged",
        action="store_true",
        help="records merges sent back, up to the first one no merge sent back (Kafka "
        "deletes prefixes: merged records after it stay until the records before them merge)",
    )
    bound.add_argument("--all", action="store_true", help="every record")
    purge.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def run_dlq_command(args: argparse.Namespace, config: ProxyConfig) -> int:
    """Dispatch ``dlq <command>``; returns the exit code."""
    kafka_ops.client_logs(debug=args.log_level == "debug")
    group = config.group(args.group)
    if args.dlq_command == "inspect":
        if not 0 <= args.limit <= INSPECT_LIMIT_MAX:
            raise ConfigError(
                [f"--limit must be 0 to {INSPECT_LIMIT_MAX:,} records, got {args.limit}; "
                 "`dlq report` reads a whole DLQ"]
            )  # fmt: skip
        report = kafka_ops.inspect_dlq(config.kafka, group, args.limit)
        print(json.dumps(as_json(report), indent=2) if args.json else render_inspect(report))
        return EXIT_OK
    if args.dlq_command == "report":
        return _report(args, config.kafka, group)
    if args.dlq_command == "merge":
        return _merge(args, config.kafka, group)
    if args.dlq_command == "purge":
        return _purge(args, config.kafka, group)
    raise ConfigError([f"unknown dlq command {args.dlq_command!r}"])


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _confirm(question: str) -> bool:
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:  # Ctrl-D, or stdin closed: no answer is no
        print(file=sys.stderr)
        return False
    return answer.strip().lower() in ("y", "yes")


def _require_confirmation_possible(args: argparse.Namespace, what: str) -> None:
    # Decided before anything runs: a script without --yes fails at once, not after a scan.
    if not args.yes and not args.dry_run and not sys.stdin.isatty():
        raise ConfigError(
            [
                f"refusing to {what} without confirmation: stdin is not a terminal; "
                "pass --yes (or --dry-run to look first)"
            ]
        )


def _spark_settings(args: argparse.Namespace) -> spark.SparkOptions:
    pairs = []
    for item in args.spark_conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--spark-conf {item!r}: expected KEY=VALUE"])
        pairs.append((key.strip(), value))
    return spark.SparkOptions(
        master=args.master,
        conf=tuple(pairs),
        connector_version=args.connector_version,
        # At debug level the JVM's own console output (Ivy, log4j) stays on the terminal.
        quiet=args.log_level != "debug",
    )


# --- report ----------------------------------------------------------------------------------


def _report(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    if args.top < 1:
        raise ConfigError([f"--top must be at least 1, got {args.top}"])
    try:  # before the job: a bad --out must not cost a whole Spark run
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            [f"--out {args.out}: not a directory that can be written: {exc.strerror or exc}"]
        ) from None
    spark.require_pipeline("report", chart=True)
    options = _spark_settings(args)
    state = kafka_ops.dlq_partitions(kafka, group)  # the bound: end offsets now
    ranges = {p.partition: (p.low, p.high) for p in state}
    _progress(
        f"dlq report: group {group.name}, {group.dlq_topic}: {len(ranges)} partitions, "
        f"{sum(h - lo for lo, h in ranges.values())} records up to the end offsets at start"
    )
    with spark.spark_session(options, _progress) as session:
        report = jobs.build_report(
            session,
            spark.java_kafka_options(kafka),
            group.dlq_topic,
            ranges,
            _progress,
            top=args.top,
        )
    report.group = group.name
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{group.name}-dlq-report.json"
    png_path = args.out / f"{group.name}-dlq-report.png"
    report.files = ReportFiles(json=str(json_path), png=str(png_path))
    write_chart(report, png_path)
    json_path.write_text(json.dumps(as_json(report), indent=2) + "\n")
    print(json.dumps(as_json(report), indent=2) if args.json else render_report(report))
    return EXIT_OK


# --- merge -----------------------------------------------------------------------------------


def _selection(args: argparse.Namespace) -> jobs.Selection:
    if args.since is not None and args.until is not None and args.since > args.until:
        raise ConfigError(
            [f"--since {format_ms(args.since)} is after --until {format_ms(args.until)}"]
        )
    statuses = tuple(s.strip() for item in args.status for s in item.split(",") if s.strip())
    if args.where is not None and not args.where.strip():
        raise ConfigError(["--where is empty"])
    return jobs.Selection(args.since, args.until, statuses, args.where)


def _plan_cuts(
    marks: dict[int, MergeMark], found: Selected, budget: int | None
) -> tuple[dict[int, int], list[Island]]:
    """Per partition, how far this merge may write so the new mark fits its metadata budget.

    Returns the end offset to write before, per partition, and the islands taken. No budget
    (``--to``: no mark to record): everything selected.
    """
    cuts: dict[int, int] = {}
    taken: list[Island] = []
    for part in sorted({i.partition for i in found.islands}):
        islands = [i for i in found.islands if i.partition == part]
        n = (
            len(islands)
            if budget is None
            else fit_islands(marks[part], [(i.start, i.end) for i in islands], budget)
        )
        taken += islands[:n]
        if n:
            cuts[part] = islands[n - 1].end
    return cuts, taken


def _merge(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    selection = _selection(args)
    if args.rate is not None and not args.rate > 0:
        raise ConfigError([f"--rate must be more than 0 records per second, got {args.rate:g}"])
    if args.to is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", args.to):
        raise ConfigError([f"--to {args.to!r} is not a valid topic name"])
    if args.to in (group.dlq_topic,):
        raise ConfigError([f"--to {args.to}: that is the DLQ itself"])
    _require_confirmation_possible(args, "merge")
    spark.require_pipeline("merge")
    options = _spark_settings(args)
    state = kafka_ops.dlq_partitions(kafka, group)
    target = args.to or group.redrive_topic
    counts_as_merge = args.to is None or args.to == group.redrive_topic
    kafka_ops.require_topic(kafka, group, target, "redrive" if counts_as_merge else "--to")

    # Records before a partition's start were purged: nothing left there to send back, so the
    # prefix may move past them (else it would wait forever on records that are gone).
    marks = {p.partition: (p.mark or MergeMark.empty()).with_merged([(0, p.low)]) for p in state}
    ranges: dict[int, tuple[int, int]] = {}
    for part in state:
        prefix = marks[part.partition].prefix
        start = part.low if args.from_start else max(part.low, prefix)
        if not args.from_start and kafka_ops.mark_past_end(marks[part.partition], part.high):
            _progress(
                f"warning: partition {part.partition}: the merge mark goes past the end "
                f"{part.high} (was the log cut or the topic recreated?); what it says was "
                "merged there is skipped, --from-start reads it again"
            )
        start = min(start, part.high)
        ranges[part.partition] = (start, part.high)
    in_range = sum(end - start for start, end in ranges.values())
    _progress(
        f"dlq merge: group {group.name}, {group.dlq_topic} -> {target}: {in_range} records "
        f"from the {'oldest record' if args.from_start else 'merge mark'} to the end offsets "
        "at start" + "".join(f"\n  partition {p}: offsets {s}..{e}" for p, (s, e) in ranges.items())
    )
    # What this merge skips as sent back already (--from-start: nothing, it sends them again).
    skip = {} if args.from_start else marks
    found = Selected(in_range=in_range)
    cuts: dict[int, int] = {}
    taken: list[Island] = []
    write_seconds = 0.0
    aborted = False
    if in_range or selection.where:
        with spark.spark_session(options, _progress) as session:
            java = spark.java_kafka_options(kafka)
            # A bad --where is an error even when there is nothing to merge.
            jobs.check_selection(session, java, group.dlq_topic, selection)
            if in_range:
                found = jobs.select_for_merge(
                    session, java, group.dlq_topic, ranges, selection, skip, _progress
                )
                budget = DEFAULT_BUDGET_CHARS if counts_as_merge else None
                cuts, taken = _plan_cuts(marks, found, budget)
            selected = sum(i.count for i in found.islands)
            to_write = sum(i.count for i in taken)
            _progress(
                f"selected {selected} of {in_range} records ({selection.describe()})"
                + (f"; {sum(found.already_merged.values())} of them merged before, skipped"
                   if found.already_merged else "")
            )  # fmt: skip
            if to_write < selected:
                # The mark records merged stretches between records still unmerged; its
                # metadata is bounded, so too many stretches cannot be recorded at once.
                _progress(
                    f"the merge mark has room for {to_write} of them: {selected - to_write} "
                    "stay for a later merge. Unmerged records between merged ones fill the "
                    "mark; merging them (another filter) frees it"
                )
            if not args.dry_run and to_write:
                if not args.yes:
                    _progress(_describe(taken))
                    aborted = not _confirm(f"write {to_write} records to {target}?")
                if not aborted:
                    write_seconds = _write(
                        session, java, kafka, group, target, ranges, cuts, selection, skip,
                        args.rate, to_write, taken if counts_as_merge else None,
                    )  # fmt: skip
    written = 0 if args.dry_run or aborted else sum(i.count for i in taken)
    new_marks: dict[int, MergeMark] = {}
    if written and counts_as_merge:
        for p in {i.partition for i in taken}:
            new_marks[p] = marks[p].with_merged((i.start, i.end) for i in taken if i.partition == p)
        kafka_ops.commit_merge_mark(kafka, group, new_marks)
    summary = _merge_summary(
        args, group, target, counts_as_merge, ranges, found, taken, written, aborted,
        write_seconds, {**marks, **new_marks} if counts_as_merge else None,
    )  # fmt: skip
    print(json.dumps(as_json(summary), indent=2) if args.json else _merge_text(summary, taken))
    return EXIT_FAILURE if aborted else EXIT_OK


def _write(
    session: Any,
    java: dict[str, str],
    kafka: KafkaConfig,
    group: GroupConfig,
    target: str,
    ranges: dict[int, tuple[int, int]],
    cuts: dict[int, int],
    selection: jobs.Selection,
    skip: dict[int, MergeMark],
    rate: float | None,
    to_write: int,
    marked: list[Island] | None,
) -> float:
    """The write pass; ``marked``: the islands the merge mark will record, written exactly
    (``jobs.write_selected``)."""
    pace = f" at most {rate:g}/s" if rate is not None else ""
    _progress(f"writing {to_write} records to {target}{pace} ...")
    # Only up to each partition's cut: what lies beyond stays for the next merge.
    write_ranges = {p: (start, cuts[p]) for p, (start, _end) in ranges.items() if p in cuts}
    baseline = kafka_ops.end_total(kafka, target)
    return jobs.write_selected(
        session, java, group.dlq_topic, write_ranges, selection, skip,
        jobs.WriteTarget(target, rate, kafka_ops.plain_conf(kafka)),
        _progress, lambda: kafka_ops.end_total(kafka, target) - baseline, to_write,
        None if marked is None else [(i.partition, i.start, i.end) for i in marked],
    )  # fmt: skip


def _merge_summary(
    args: argparse.Namespace,
    group: GroupConfig,
    target: str,
    counts_as_merge: bool,
    ranges: dict[int, tuple[int, int]],
    found: Selected,
    taken: list[Island],
    written: int,
    aborted: bool,
    write_seconds: float,
    marks: dict[int, MergeMark] | None,
) -> MergeSummary:
    by_partition: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for island in taken:
        key = str(island.partition)
        by_partition[key] = by_partition.get(key, 0) + island.count
        for status, n in island.by_status.items():
            by_status[status] = by_status.get(status, 0) + n
    selected = sum(i.count for i in found.islands)
    committed = marks is not None and not args.dry_run and not aborted
    return MergeSummary(
        group=group.name,
        dlq_topic=group.dlq_topic,
        target_topic=target,
        counts_as_merge=counts_as_merge,
        dry_run=args.dry_run,
        aborted=aborted,
        rate=args.rate,
        ranges={str(p): list(r) for p, r in ranges.items()},
        in_range=found.in_range,
        selected=selected,
        written=written,
        skipped_merged=sum(found.already_merged.values()),
        deferred=selected - sum(i.count for i in taken),
        merged=written if counts_as_merge else 0,
        by_partition=dict(sorted(by_partition.items())),
        by_status=dict(sorted(by_status.items())),
        merge_mark=(
            {
                str(p): MarkView(m.prefix, m.merged_between(m.prefix, ranges[p][1]))
                for p, m in sorted(marks.items())
                if p in ranges
            }
            if committed and marks is not None
            else None
        ),
        write_seconds=round(write_seconds, 3),
        written_per_s=round(written / write_seconds, 1) if written and write_seconds else None,
    )


def _describe(islands: list[Island]) -> str:
    by_partition: dict[int, int] = {}
    by_status: dict[str, int] = {}
    for island in islands:
        by_partition[island.partition] = by_partition.get(island.partition, 0) + island.count
        for status, n in island.by_status.items():
            by_status[status] = by_status.get(status, 0) + n
    parts = ", ".join(f"{p}: {n}" for p, n in sorted(by_partition.items()))
    statuses = ", ".join(f"{printable(s)}: {n}" for s, n in sorted(by_status.items()))
    return f"  by DLQ partition: {parts}\n  by status: {statuses}"


def _merge_text(summary: MergeSummary, taken: list[Island]) -> str:
    counts = f"selected {summary.selected}, skipped {summary.skipped_merged} merged before" + (
        f", {summary.deferred} left for the next merge" if summary.deferred else ""
    )
    if summary.dry_run:
        lines = [
            f"dry run: would merge {summary.selected - summary.deferred} of {summary.in_range} "
            f"records into {summary.target_topic}; nothing written ({counts})"
        ]
        if taken:
            lines.append(_describe(taken))
        return "\n".join(lines)
    if summary.aborted:
        return "aborted: nothing written, the merge mark did not move"
    speed = (
        f" in {summary.write_seconds:.1f}s ({summary.written_per_s:.0f}/s)"
        if summary.written_per_s
        else ""
    )
    verb = "merged" if summary.counts_as_merge else "copied"
    line = (
        f"{verb} {summary.written} of {summary.in_range} records into "
        f"{summary.target_topic}{speed} ({counts})"
    )
    if summary.merge_mark is not None:
        line += "; merge mark now at " + ", ".join(
            f"{p}:{m.merged_to}" + (f" (+{m.merged_above} above)" if m.merged_above else "")
            for p, m in summary.merge_mark.items()
        )
    elif not summary.counts_as_merge:
        line += f"; not counted as merged (--to {summary.target_topic}): the mark did not move"
    return line


# --- purge -----------------------------------------------------------------------------------


def _purge(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    _require_confirmation_possible(args, "delete records")
    plan = kafka_ops.plan_purge(kafka, group, until_ms=args.until, merged=args.merged)
    bound_name = (
        f"before {datetime.fromtimestamp(args.until / 1000, tz=UTC).isoformat()}"
        if args.until is not None
        else "up to the first record no merge sent back"
        if args.merged
        else "all"
    )
    total = sum(p.count for p in plan)
    kept = sum(p.merged_kept for p in plan) if args.merged else 0
    lines = [f"dlq purge: {group.dlq_topic} of group {group.name}, {bound_name}: {total} records"]
    for p in plan:
        lines.append(
            f"  partition {p.partition}: offsets {p.low}..{p.delete_before} "
            f"({p.count} records; partition end {p.high}, merged to "
            f"{'none' if p.merged_to is None else p.merged_to})"
            + (f"; {p.merged_kept} merged records after it kept" if args.merged and p.merged_kept
               else "")
        )  # fmt: skip
    if kept:
        lines.append(
            f"{kept} merged records stay until the unmerged records before them are merged "
            "(Kafka deletes prefixes only)"
        )
    for p in plan:
        if p.mark_past_end:
            lines.append(
                f"warning: partition {p.partition}: the merge mark goes past the end {p.high} "
                "(was the log cut or the topic recreated?), so it does not say which of its "
                "records were merged: nothing deleted there; `dlq merge --from-start` sends "
                "them back"
            )
    summary = PurgeSummary(
        group=group.name,
        topic=group.dlq_topic,
        bound=bound_name,
        dry_run=args.dry_run,
        partitions=plan,
        to_delete=total,
        merged_kept=kept,
    )

    def done(code: int, message: str) -> int:
        summary.result = message
        print(json.dumps(as_json(summary), indent=2) if args.json else "\n".join([*lines, message]))
        return code

    def show_plan_first() -> None:
        # On a terminal the plan comes before the question, and not again after it.
        if not args.json:
            print("\n".join(lines))
            lines.clear()

    if args.merged and all(p.merged_to is None for p in plan):
        return done(EXIT_OK, "nothing merged yet: nothing to delete")
    if total == 0:
        return done(EXIT_OK, "nothing to delete")
    if args.dry_run:
        return done(EXIT_OK, f"dry run: would delete {total} records; nothing deleted")
    if not args.yes:
        show_plan_first()
        if not _confirm(f"delete {total} records from {group.dlq_topic}? This cannot be undone."):
            return done(EXIT_FAILURE, "aborted: nothing deleted")
    bounds = {p.partition: p.delete_before for p in plan if p.count > 0}
    new_low = kafka_ops.delete_before(kafka, group.dlq_topic, bounds)
    summary.deleted = total
    summary.new_low = {str(p): o for p, o in sorted(new_low.items())}
    return done(
        EXIT_OK,
        f"deleted {total} records; partitions now start at "
        + ", ".join(f"{p}:{o}" for p, o in sorted(new_low.items())),
    )
