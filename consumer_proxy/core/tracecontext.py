"""W3C Trace Context (``traceparent``, ``tracestate``) in record headers: parsed and formatted
without OpenTelemetry, bounded in cost, never raising on what a producer wrote."""

from __future__ import annotations

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


def parse_traceparent(value: bytes) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a W3C ``traceparent`` header value, None when it is
    malformed, too long, or all zeros. Never raises; costs at most 128 bytes' work."""
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
