"""The proxy's finished spans as an OTLP ``ExportTraceServiceRequest``, encoded straight to
protobuf bytes (``otel`` imports it only when tracing is on).

The OTLP exporter's own encoder builds a protobuf object per span, attribute, value, event
and link in Python: ~45 µs a span of the proxy's, the largest part of what a sampled message
costs (measured in bench/README.md's bench_tracing paragraph). This one writes the same
message field by field into bytes, with the resource, the scope and every attribute key
encoded once; ``tests/test_tracing_unit.py`` checks that it decodes to exactly what the
exporter's encoder builds, for spans of every kind the proxy makes. (One difference: spans
are grouped by their resource and scope *objects*, the proxy's one tracer's; equal but
distinct ones would make two groups, which OTLP receivers read the same.) Only the gRPC
exporter uses it; OTLP over HTTP keeps the exporter's own encoder. ``span_bytes`` writes
one span from its fields: an SDK span's (``encode_span``) or the proxy's own
(``spans.ProxySpan``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace.span import TraceState

_BYTES = [bytes((n,)) for n in range(128)]
_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
MAX_CACHED = 4096
"""Encoded attribute keys (and resources, scopes) kept; the proxy's are a few dozen."""

_FLAGS_HAS_IS_REMOTE = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAGS_IS_REMOTE = 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_FLAGS_LOCAL = _FIXED32(_FLAGS_HAS_IS_REMOTE)
_FLAGS_REMOTE = _FIXED32(_FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _BYTES[n]
    if 0 < n < 0x4000:  # (a span's length in a request, a small offset)
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` already encoded)."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, text: str) -> bytes:
    return _field(tag, text.encode("utf-8"))


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s fields, as the exporter's ``_encode_value`` chooses them."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        pairs = b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", pairs)
    raise TypeError(f"an attribute value of type {type(value).__name__}")


_KEYS: dict[str, bytes] = {}


def _key(key: str) -> bytes:
    """A ``KeyValue``'s key field."""
    encoded = _KEYS.get(key)
    if encoded is None:
        encoded = _text(b"\x0a", key)
        if len(_KEYS) < MAX_CACHED:
            _KEYS[key] = encoded
    return encoded


def _key_value(key: str, value: Any) -> bytes:
    return _key(key) + _field(b"\x12", _any_value(value))


_PAIRS: dict[tuple[bytes, str, Any, type], bytes] = {}
_NAMES: dict[str, bytes] = {}
_UNCACHED = frozenset(
    ("messaging.kafka.message.key", "consumer_proxy.reason", "consumer_proxy.progress")
)
"""Attributes whose values come from producers or services: a value each message, never kept
(they would fill the cache for good and crowd the proxy's own values out)."""


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a ``tag`` field; a text or bool attribute, most of the proxy's
    (``messaging.system: kafka``, the topic, the method), is encoded once."""
    if not attributes:
        return b""
    out = []
    for key, value in attributes.items():
        kind = type(value)
        if (kind is str or kind is bool) and key not in _UNCACHED:
            pair = (tag, key, value, kind)
            encoded = _PAIRS.get(pair)
            if encoded is None:
                encoded = _field(tag, _key_value(key, value))
                if len(_PAIRS) < MAX_CACHED:
                    _PAIRS[pair] = encoded
            out.append(encoded)
        elif kind is int:  # (offsets, sizes, attempts: the rest of the proxy's) written inline
            number = _varint(value)
            field = _key(key) + b"\x12" + _BYTES[len(number) + 1] + b"\x18" + number
            out.append(tag + _varint(len(field)) + field)
        else:
            out.append(_field(tag, _key_value(key, value)))
    return b"".join(out)


def _span(span: ReadableSpan) -> bytes:
    context = span.context
    assert context is not None  # a finished SDK span has one
    parent = span.parent
    status = span.status
    return span_bytes(
        context.trace_id,
        context.span_id,
        context.trace_state,
        None if parent is None else parent.span_id,
        parent is not None and parent.is_remote,
        span.name,
        span.kind.value,
        span.start_time or 0,
        span.end_time or 0,
        span.attributes,
        span.dropped_attributes,
        [(e.timestamp, e.name, e.attributes, e.dropped_attributes) for e in span.events],
        span.dropped_events,
        [
            (
                link.context.trace_id,
                link.context.span_id,
                link.context.is_remote,
                link.attributes,
                link.dropped_attributes,
            )
            for link in span.links
        ],
        span.dropped_links,
        status.status_code.value,
        status.description,
    )


Event = tuple[int, str, Mapping[str, Any] | None, int]
"""A span event: its time (ns since the epoch), name, attributes, attributes dropped."""
LinkTo = tuple[int, int, bool, Mapping[str, Any] | None, int]
"""A span link: trace id, span id, whether the linked context is remote, attributes, dropped."""


def span_bytes(
    trace_id: int,
    span_id: int,
    state: TraceState | None,
    parent_id: int | None,
    remote_parent: bool,
    name: str,
    kind: int,
    start: int,
    end: int,
    attributes: Mapping[str, Any] | None,
    dropped_attributes: int,
    events: Sequence[Event],
    dropped_events: int,
    links: Sequence[LinkTo],
    dropped_links: int,
    status_code: int,
    status_text: str | None,
) -> bytes:
    """An OTLP ``Span`` message's fields (``kind`` the SDK's: INTERNAL..CONSUMER 0..4)."""
    parts = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
    if state:
        parts.append(_text(b"\x1a", ",".join(f"{k}={v}" for k, v in state.items())))
    if parent_id is not None:
        parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
    encoded_name = _NAMES.get(name)
    if encoded_name is None:
        encoded_name = _text(b"\x2a", name)
        if len(_NAMES) < MAX_CACHED:
            _NAMES[name] = encoded_name  # (the proxy's: a topic's, a method's)
    parts += (
        encoded_name,
        b"\x30",
        _BYTES[kind + 1],  # OTLP's SPAN_KIND_INTERNAL..CONSUMER are 1..5
        b"\x39",
        _FIXED64(start),
        b"\x41",
        _FIXED64(end),
        _attributes(b"\x4a", attributes),
    )
    if dropped_attributes:
        parts += (b"\x50", _varint(dropped_attributes))
    for timestamp, event_name, event_attributes, event_dropped in events:
        body = b"\x09" + _FIXED64(timestamp) + _text(b"\x12", event_name)
        body += _attributes(b"\x1a", event_attributes)
        if event_dropped:
            body += b"\x20" + _varint(event_dropped)
        parts.append(_field(b"\x5a", body))
    if dropped_events:
        parts += (b"\x60", _varint(dropped_events))
    for linked_trace, linked_span, linked_remote, link_attributes, link_dropped in links:
        body = (
            b"\x0a\x10"
            + linked_trace.to_bytes(16, "big")
            + b"\x12\x08"
            + linked_span.to_bytes(8, "big")
            + _attributes(b"\x22", link_attributes)
        )
        if link_dropped:
            body += b"\x28" + _varint(link_dropped)
        body += b"\x35" + (_FLAGS_REMOTE if linked_remote else _FLAGS_LOCAL)
        parts.append(_field(b"\x6a", body))
    if dropped_links:
        parts += (b"\x70", _varint(dropped_links))
    body = _text(b"\x12", status_text) if status_text else b""
    if status_code:
        body += b"\x18" + _varint(status_code)
    parts.append(_field(b"\x7a", body))
    parts += (b"\x85\x01", _FLAGS_REMOTE if remote_parent else _FLAGS_LOCAL)
    return b"".join(parts)


# The pieces of a span that ``span_bytes`` writes, for an encoder that writes a span of a known
# shape straight from its record (``otel._OwnProcess.encoded``, ``otel._OwnCall.encoded``):
# the same bytes, with what repeats from span to span encoded once by the caller.


def name_and_kind(name: str, kind: int) -> bytes:
    """A span's ``name`` and ``kind`` fields (``kind`` the SDK's, as in ``span_bytes``)."""
    return _text(b"\x2a", name) + b"\x30" + _BYTES[kind + 1]


def span_head(trace_id: int, span_id: int, name_kind: bytes, start: int, end: int) -> bytes:
    """A root span's fields up to its attributes (no tracestate, no parent): ids,
    ``name_and_kind``, times."""
    return b"".join(
        (
            b"\x0a\x10",
            trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            span_id.to_bytes(8, "big"),
            name_kind,
            b"\x39",
            _FIXED64(start),
            b"\x41",
            _FIXED64(end),
        )
    )


def span_attributes(attributes: Mapping[str, Any]) -> bytes:
    """A span's ``attributes`` fields, as ``span_bytes`` writes them."""
    return _attributes(b"\x4a", attributes)


def attribute_key(key: str) -> bytes:
    """An attribute's key field, for ``int_attribute``."""
    return _text(b"\x0a", key)


def int_attribute(key: bytes, value: int) -> bytes:
    """A span attribute of an int value (``key``: ``attribute_key``'s), as ``span_bytes``
    writes it."""
    number = _varint(value)
    field = key + b"\x12" + _BYTES[len(number) + 1] + b"\x18" + number
    return b"\x4a" + _varint(len(field)) + field


def local_link(trace_id: int, span_id: int) -> bytes:
    """A span's link to a local span (no attributes), as ``span_bytes`` writes it."""
    return b"".join(
        (
            b"\x6a\x21\x0a\x10",  # (33 bytes: ids, flags)
            trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            span_id.to_bytes(8, "big"),
            b"\x35",
            _FLAGS_LOCAL,
        )
    )


def root_tail(status_code: int, status_text: str | None) -> bytes:
    """A root span's fields after its attributes, events and links: its status and flags."""
    body = _text(b"\x12", status_text) if status_text else b""
    if status_code:
        body += b"\x18" + _varint(status_code)
    return _field(b"\x7a", body) + b"\x85\x01" + _FLAGS_LOCAL


_RESOURCES: dict[int, tuple[Any, bytes]] = {}
_SCOPES: dict[int, tuple[InstrumentationScope | None, bytes]] = {}


def _resource(resource: Any) -> bytes:
    cached = _RESOURCES.get(id(resource))
    if cached is not None and cached[0] is resource:
        return cached[1]
    encoded = _field(b"\x0a", _attributes(b"\x0a", resource.attributes))
    if len(_RESOURCES) < MAX_CACHED:
        _RESOURCES[id(resource)] = (resource, encoded)  # (kept: its id is not reused)
    return encoded


def _scope(scope: InstrumentationScope | None) -> bytes:
    cached = _SCOPES.get(id(scope))
    if cached is not None and cached[0] is scope:
        return cached[1]
    body = b""
    if scope is not None:
        body = _text(b"\x0a", scope.name) if scope.name else b""
        if scope.version:
            body += _text(b"\x12", scope.version)
        body += _attributes(b"\x1a", scope.attributes)
    encoded = _field(b"\x0a", body)
    if len(_SCOPES) < MAX_CACHED:
        _SCOPES[id(scope)] = (scope, encoded)
    return encoded


Encoded = tuple[Any, InstrumentationScope | None, bytes]
"""A finished span as the exporter keeps it: its resource, its scope and its encoded body."""


def encode_span(span: ReadableSpan) -> Encoded:
    """``span`` encoded as it ends: the bytes are all an export needs of it, so the span (its
    attributes, events, links) is garbage at once instead of waiting for the export."""
    return (span.resource, span.instrumentation_scope or None, _span(span))


def encode_request(spans: Sequence[ReadableSpan]) -> bytes:
    """``spans`` as an encoded ``ExportTraceServiceRequest`` (see ``request_of``)."""
    return request_of([encode_span(span) for span in spans])


def request_of(entries: Sequence[Encoded]) -> bytes:
    """Encoded spans as an ``ExportTraceServiceRequest``: grouped by resource, then by
    instrumentation scope, in the order first seen (as the exporter's encoder does)."""
    # By identity: hashing a resource or a scope serialises its attributes, and the proxy's
    # spans share one of each.
    grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for resource, scope, encoded_span in entries:
        _, scopes = grouped.setdefault(id(resource), (resource, {}))
        scopes.setdefault(id(scope), (scope, []))[1].append(encoded_span)
    out = []
    for resource, scopes in grouped.values():
        body = [_resource(resource)]
        for scope, encoded in scopes.values():
            scope_spans = _scope(scope) + b"".join(_field(b"\x12", s) for s in encoded)
            if scope is not None and scope.schema_url:
                scope_spans += _text(b"\x1a", scope.schema_url)
            body.append(_field(b"\x12", scope_spans))
        if resource.schema_url:
            body.append(_text(b"\x1a", resource.schema_url))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)
