"""W3C Trace Context (``traceparent``, ``tracestate``) in record headers: parsed and formatted
without OpenTelemetry, bounded in cost, never raising on what a producer wrote."""

from __future__ import annotations

import re
from collections.abc import Sequence

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACEPARENT_BYTES = 128
"""A longer traceparent header is ignored (version 00 is 55 bytes; later versions may add)."""
MAX_TRACESTATE_BYTES = 512
"""The W3C limit of a tracestate a propagator must keep; a longer one is dropped."""

Metadata = Sequence[tuple[str, str]]
"""gRPC call metadata: the W3C traceparent (and tracestate) of the span the service continues."""

_HEX = frozenset("0123456789abcdef")
_VERSION_00 = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACESTATE_ENTRIES = 32
"""The W3C limit of list members in a tracestate; more makes the header invalid."""
_MEMBER = re.compile(
    r"([a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])"
)


def parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C ``traceparent`` header value, None when it is
    malformed, too long, or all zeros. Never raises; costs at most 128 bytes' work."""
    if len(value) == 55:  # version 00, nearly every one: one match in C
        found = _VERSION_00.fullmatch(value)
        if found is None:
            return _parse_traceparent(value)  # (another version of the same length)
        trace_id = int(found[1], 16)
        span_id = int(found[2], 16)
        if not trace_id or not span_id:
            return None
        return trace_id, span_id, int(found[3], 16)
    return _parse_traceparent(value)


def _parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    if len(value) > MAX_TRACEPARENT_BYTES or len(value) < 55:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = text.split("-", 4)
    if len(parts) < 4:
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if (
        len(version) != 2
        or version == "ff"
        or len(trace_hex) != 32
        or len(span_hex) != 16
        or len(flags_hex) != 2
        or not _HEX.issuperset(version + trace_hex + span_hex + flags_hex)
        or (version == "00" and len(parts) != 4)
    ):
        return None
    trace_id = int(trace_hex, 16)
    span_id = int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags_hex, 16)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C ``traceparent`` value (version 00)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def tracestate_header(members: Sequence[tuple[str, str]] | None) -> str:
    """The ``tracestate`` header of checked members (``parse_tracestate``); "" for none."""
    return ",".join(f"{key}={value}" for key, value in members) if members else ""


def trace_headers(headers: Sequence[tuple[str, bytes]]) -> tuple[bytes | None, bytes | None]:
    """The first ``traceparent`` and ``tracestate`` values of a record's headers."""
    parent: bytes | None = None
    state: bytes | None = None
    for key, value in headers:
        if key == TRACEPARENT:
            if parent is None:
                parent = value
        elif key == TRACESTATE and state is None:
            state = value
    return parent, state


def parse_tracestate(value: bytes) -> list[tuple[str, str]] | None:
    """A ``tracestate`` header's (key, value) members, or None when it breaks the W3C grammar
    (over 512 bytes, not ASCII, a malformed member, a key twice, over 32 members): the header
    is then ignored as a whole, and nothing of it reaches a log line or a span."""
    if len(value) > MAX_TRACESTATE_BYTES or not value.isascii():
        return None
    members: list[tuple[str, str]] = []
    seen: set[str] = set()
    for member in value.decode("ascii").split(","):
        member = member.strip(" \t")
        if not member:
            continue
        found = _MEMBER.fullmatch(member)
        if found is None or found[1] in seen or len(members) == MAX_TRACESTATE_ENTRIES:
            return None
        seen.add(found[1])
        members.append((found[1], found[2]))
    return members
