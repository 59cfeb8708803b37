"""Rendering: values as text, reason templates, the terminal tables and the report's chart."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .reports import DlqReport, InspectReport

# Masks that turn a reason into its template, in order. They are written in the regular
# expression syntax Python's re and Java's java.util.regex share, so the Spark job (Java) and
# reason_template() (Python) agree on every template.
REASON_MASKS: tuple[tuple[str, str], ...] = (
    (r"'[^']*'", "'<v>'"),
    (r'"[^"]*"', '"<v>"'),
    (r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}", "<id>"),
    # A token of 6+ characters mixing letters and digits: an id, a hash, a key. It starts and
    # ends where a run of token characters does (not at any word boundary: "0-0-0-..." has one
    # at every character, and each re-ran the lookaheads to the run's end, quadratic in a
    # service's 1 KiB reason: 25.8 s against 0.2 s for 2,000 templates).
    (
        r"(?<![A-Za-z0-9_-])(?=[A-Za-z0-9_-]*[0-9])(?=[A-Za-z0-9_-]*[A-Za-z])"
        r"[A-Za-z0-9_-]{6,}(?![A-Za-z0-9_-])",
        "<id>",
    ),
    (r"[0-9]+(?:\.[0-9]+)?", "<n>"),
)


def reason_template(reason: str | None) -> str | None:
    """``reason`` with numbers, quoted values and ids masked: reasons of one kind group."""
    if reason is None:
        return None
    for pattern, replacement in REASON_MASKS:
        reason = re.sub(pattern, replacement, reason)
    return reason


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every character that is not printable (C0 and C1
    controls such as ESC, CR and LF, DEL, Unicode format characters such as bidi overrides,
    line and paragraph separators) is escaped as Python writes it (``\\x1b``, ``\\n``,
    ``\\u202e``), so data from producers and services can neither send terminal sequences,
    overwrite a line nor print lines of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def show_value(value: bytes | None, limit: int = 200) -> str:
    """Text when the bytes are UTF-8 text, else hex with the length; never raw bytes."""
    if value is None:
        return "(null)"
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        head = value[: limit // 2].hex()
        return f"hex:{head}{'...' if len(value) > limit // 2 else ''} ({len(value)} bytes)"
    if not text.isprintable() and not all(c.isprintable() or c in "\n\t\r" for c in text):
        return f"hex:{value[: limit // 2].hex()} ({len(value)} bytes)"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} bytes)"


def literal(text: str) -> str:
    """``text`` as a chart label shows it: matplotlib reads what stands between two ``$`` as
    math (a service's reason ``bad value $\\frac{$`` failed the whole report)."""
    return text.replace("$", r"\$")


def format_ms(ms: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC (a time no date holds, a record's or a forged
    header's, as its number)."""
    try:
        return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms (not a date)"


def format_hour(ms: int) -> str:
    """The start of an hour (epoch ms) as ``2025-05-01T13:00Z``."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:00Z")


def clip(text: str, width: int) -> str:
    """One line of at most ``width`` characters, control characters escaped."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= width else text[: width - 1] + "…"


# --- inspect ---------------------------------------------------------------------------------


def render_inspect(report: InspectReport) -> str:
    """A readable summary and the sample."""
    lines = [
        f"DLQ {report.topic} of group {report.group}: {report.total} records, "
        f"{report.not_merged} not merged yet"
    ]
    for p in report.partitions:
        merged = "none" if p.merged_to is None else p.merged_to
        above = f" (+{p.merged_above} merged above)" if p.merged_above else ""
        lines.append(
            f"  partition {p.partition}: {p.count} records (offsets {p.low}..{p.high})"
            f" purged to {p.purged_to}, merged to {merged}{above};"
            f" oldest_ms={p.oldest_ms} newest_ms={p.newest_ms}"
        )
    for rec in report.sample:
        cp = rec.cp
        # Everything here comes from the record (producers, services): printed escaped.
        lines.append(
            f"- [{rec.partition}@{rec.offset}] {printable(str(cp.get('cp-original-topic')))}"
            f"[{printable(str(cp.get('cp-original-partition')))}]"
            f"@{printable(str(cp.get('cp-original-offset')))} "
            f"status={printable(str(cp.get('cp-status')))} "
            f"attempt={printable(str(cp.get('cp-attempt')))} "
            f"reason={cp.get('cp-reason', '')[:120]!r}"
        )
        lines.append(f"    key={printable(rec.key)} value={printable(rec.value)}")
    return "\n".join(lines)


# --- report ----------------------------------------------------------------------------------


def render_report(report: DlqReport) -> str:
    """The terminal summary: a few small tables."""
    total = report.total or 1
    lines = [f"DLQ {report.topic} of group {report.group}: {report.total} records"]

    def table(title: str, rows: list[tuple[str, int]], limit: int = 12) -> None:
        lines.append("")
        lines.append(f"{title:<48} {'count':>10} {'share':>7}")
        for label, count in rows[:limit]:
            lines.append(f"  {clip(label, 46):<46} {count:>10} {100 * count / total:>6.1f}%")
        if len(rows) > limit:
            rest = sum(c for _, c in rows[limit:])
            lines.append(f"  {f'... {len(rows) - limit} more':<46} {rest:>10}")

    table("by cp-status", [(s.status or "(none)", s.count) for s in report.by_status])
    templates = report.by_reason_template
    lines.append("")
    lines.append(
        f"{f'by cp-reason ({len(templates)} kinds of {report.reasons_distinct} distinct)':<48}"
        f" {'count':>10} {'share':>7}"
    )
    for t in templates[:8]:
        label = t.template or "(none)"
        lines.append(f"  {clip(label, 46):<46} {t.count:>10} {100 * t.count / total:>6.1f}%")
        if t.example is not None and t.example != t.template:
            lines.append(f"    e.g. {clip(t.example, 70)}")
    if len(templates) > 8:
        rest = sum(t.count for t in templates[8:])
        lines.append(f"  {f'... {len(templates) - 8} more':<46} {rest:>10}")
    table(
        "by original partition",
        [(f"{o.topic}[{o.partition}]", o.count) for o in report.by_original_partition],
    )
    table("by hour (UTC)", [(h.hour or "(none)", h.count) for h in report.by_hour], 24)
    table("top keys", [(k.key, k.count) for k in report.top_keys])
    if report.files is not None:
        lines.append("")
        lines.append(f"report: {report.files.json}")
        lines.append(f"chart:  {report.files.png}")
    return "\n".join(lines)


def write_chart(report: DlqReport, path: Path) -> None:
    """A 2x2 PNG: records per hour, by status, by original partition, top reason templates."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(
        f"DLQ {report.topic} of group {report.group or '?'}: {report.total} records"
        f" (generated {report.generated_at})"
    )
    ax_hour, ax_status, ax_part, ax_reason = fig.subplots(2, 2).flatten()

    hours = [h for h in report.by_hour if h.hour_ms is not None]
    ax_hour.set_title("dead-lettered per hour (UTC)")
    if hours:
        times = [datetime.fromtimestamp((h.hour_ms or 0) / 1000, tz=UTC) for h in hours]
        ax_hour.bar(times, [h.count for h in hours], width=0.9 / 24, align="edge")
        locator = AutoDateLocator()  # type: ignore[no-untyped-call]
        ax_hour.xaxis.set_major_locator(locator)
        ax_hour.xaxis.set_major_formatter(ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    ax_hour.set_ylabel("records")

    def barh(ax: Any, title: str, labels: Sequence[str], counts: Sequence[int]) -> None:
        ax.set_title(title)
        ax.barh(range(len(labels)), counts)
        ax.set_yticks(range(len(labels)), [literal(label) for label in labels])
        ax.invert_yaxis()  # biggest first
        ax.set_xlabel("records")

    barh(
        ax_status,
        "by cp-status",
        [s.status or "(none)" for s in report.by_status],
        [s.count for s in report.by_status],
    )
    origins = report.by_original_partition
    topics = {o.topic for o in origins}
    ax_part.set_title("by original partition")
    ax_part.bar(
        range(len(origins)),
        [o.count for o in origins],
        tick_label=[
            literal(f"{o.topic}[{o.partition}]" if len(topics) > 1 else str(o.partition))
            for o in origins
        ],
    )
    ax_part.set_ylabel("records")
    templates = report.by_reason_template[:10]
    barh(
        ax_reason,
        "top cp-reason kinds (values masked)",
        [clip(t.template or "(none)", 45) for t in templates],
        [t.count for t in templates],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
