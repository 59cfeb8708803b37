"""Commit-metadata codec: the ack state above the committed offset, as a short ASCII string.

Kafka stores a free-form metadata string next to each committed offset (at most
``offset.metadata.max.bytes``, 4096 by default). The proxy commits only the contiguous done
prefix, so the acks recorded *above* the committed offset would be lost on a rebalance or a
restart; carrying them in the metadata is what keeps acked messages from being redelivered.

Wire format, version 1::

    metadata := "cp1" FLAG PAYLOAD
    FLAG     := "r"  (body stored as is) | "z" (body compressed with raw DEFLATE, RFC 1951)
    PAYLOAD  := base85 (RFC 1924 alphabet, unpadded) of CRC32(body) [4 bytes, big endian]
                followed by the stored body
    body     := uvarint(base) uvarint(end - base) uvarint(run_1) ... uvarint(run_n)

Run lengths alternate pending, done, pending, ... starting with a pending run at the
committed offset. Only that first run may be empty: the committed offset itself is done when
it is an ack restored from an earlier state and not fetched again yet (the commit never
passes an offset not fetched again: the log may have been cut there). Readers before this
rule refuse such a state (and redeliver, which is safe). The encoder picks whichever FLAG
gives the shorter string.

Base85 rather than base64: 5 characters per 4 bytes instead of 4 per 3 (about 6% shorter) and
its alphabet has no quote, backslash, comma, colon or space. The CRC lets the decoder tell our
metadata from anything else that happens to start with the prefix, because a wrong decode
could mark a pending message done and lose it; a refused decode only costs redeliveries.
"""

from __future__ import annotations

import base64
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate

from consumer_proxy.errors import ConsumerProxyError

__all__ = ["MAX_OFFSET_END", "PREFIX", "AckState", "CodecError", "decode", "encode"]

PREFIX = "cp1"
"""Magic and version of the current format; every encoded string starts with it."""

MAX_OFFSET_END = 2**63
"""Kafka offsets are signed 64-bit, so a state may end at most one past the largest offset."""

_FLAG_RAW = "r"
_FLAG_DEFLATE = "z"
# Upper case: the body starts with the leader epoch. Older readers refuse these flags, which
# makes them redeliver above the committed offset (safe) during a rolling upgrade.
_FLAG_RAW_EPOCH = "R"
_FLAG_DEFLATE_EPOCH = "Z"
_HEADER_LEN = len(PREFIX) + 1
_CRC_LEN = 4
# Ten 7-bit groups cover 64 bits; refusing longer varints keeps garbage from turning into
# arbitrarily large integers.
_MAX_VARINT_BYTES = 10
# A body is about one byte per run, and a run covers at least one offset, so this admits
# windows of millions of offsets while bounding what a malicious DEFLATE stream can inflate to.
_MAX_BODY_BYTES = 8 * 1024 * 1024


class CodecError(ConsumerProxyError, ValueError):
    """The metadata is not a consumer-proxy ack state this version can read.

    Callers ignore the metadata and redeliver everything above the committed offset, which is
    always safe (at-least-once).
    """


@dataclass(frozen=True, slots=True)
class AckState:
    """Which offsets in ``[base, end)`` are done, as alternating pending/done run lengths.

    ``runs[0]`` is the pending run starting at ``base``, ``runs[1]`` the done run after it,
    and so on; every run is at least one offset long, but for ``runs[0]``, which is empty when
    ``base`` itself is done, and ``end = base + sum(runs)``. Offsets below ``base`` are
    committed (done); offsets at or above ``end`` are not known to be done.
    """

    base: int
    runs: tuple[int, ...] = ()
    epoch: int | None = None
    """The highest leader epoch among the records the state describes, when known. A record
    fetched later in ``[base, end)`` with a higher epoch was written after a log truncation
    reused its offset: the state does not describe it."""
    end: int = field(init=False)
    # Absolute end offset of each run, so is_done() is one bisect per re-fetched message.
    _bounds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Validate the runs and derive ``end`` and the run boundaries."""
        if not 0 <= self.base < MAX_OFFSET_END:
            raise ValueError(f"base {self.base} is not a Kafka offset")
        runs = tuple(self.runs)
        for index, run in enumerate(runs):
            # A zero-length run would make encodings non-unique; only the first (pending)
            # run may be empty, and only before a done run.
            if run < 1 and not (index == 0 and run == 0 and len(runs) > 1):
                raise ValueError(f"run lengths must be positive, got {run}")
        bounds = tuple(accumulate(runs, initial=self.base))[1:]
        end = bounds[-1] if bounds else self.base
        if end > MAX_OFFSET_END:
            raise ValueError(f"state ends at {end}, past the largest Kafka offset")
        object.__setattr__(self, "runs", runs)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "_bounds", bounds)

    def is_done(self, offset: int) -> bool:
        """Return True if ``offset`` was committed or acked, False if it must be delivered."""
        if offset < self.base:
            return True
        if offset >= self.end:
            return False
        # Runs alternate pending (even index) and done (odd index).
        return bisect_right(self._bounds, offset) % 2 == 1

    def next_pending(self, offset: int) -> int:
        """Return the smallest offset at or above ``offset`` that is not done."""
        if offset >= self.end:
            return offset
        offset = max(offset, self.base)
        run = bisect_right(self._bounds, offset)
        # Inside a done run, the next pending run starts where it ends (or the state does).
        return self._bounds[run] if run % 2 == 1 else offset


def _put_uvarint(buf: bytearray, value: int) -> None:
    while value >= 0x80:
        buf.append((value & 0x7F) | 0x80)
        value >>= 7
    buf.append(value)


def _body(state: AckState) -> bytes:
    buf = bytearray()
    if state.epoch is not None:
        _put_uvarint(buf, state.epoch)
    _put_uvarint(buf, state.base)
    _put_uvarint(buf, state.end - state.base)
    for run in state.runs:
        _put_uvarint(buf, run)
    return bytes(buf)


def _deflate(body: bytes) -> bytes:
    # Raw DEFLATE (negative wbits): the zlib header and Adler-32 would cost 6 bytes, and the
    # CRC already covers integrity.
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
    return compressor.compress(body) + compressor.flush()


def encode(state: AckState) -> str:
    """Encode ``state`` as commit metadata; ``decode(encode(state)) == state``."""
    body = _body(state)
    crc = zlib.crc32(body).to_bytes(_CRC_LEN, "big")
    deflated = _deflate(body)
    if len(deflated) < len(body):
        flag, stored = _FLAG_DEFLATE, deflated
    else:
        flag, stored = _FLAG_RAW, body
    if state.epoch is not None:
        flag = flag.upper()
    return PREFIX + flag + base64.b85encode(crc + stored).decode("ascii")


def _inflate(stored: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(-15)
    try:
        body = decompressor.decompress(stored, limit)
    except zlib.error as exc:
        raise CodecError(f"corrupt compressed ack state: {exc}") from exc
    if decompressor.unconsumed_tail:
        raise CodecError(f"compressed ack state inflates past {limit} bytes")
    if not decompressor.eof or decompressor.unused_data:
        raise CodecError("corrupt compressed ack state")
    return body


def _parse_body(body: bytes, with_epoch: bool, max_values: int) -> AckState:
    values: list[int] = []
    value = shift = count = 0
    for byte in body:
        value |= (byte & 0x7F) << shift
        count += 1
        if byte & 0x80:
            if count == _MAX_VARINT_BYTES:
                raise CodecError("varint too long")
            shift += 7
            continue
        values.append(value)
        if len(values) > max_values:
            raise CodecError(f"more runs than the {max_values - 3} a window holds")
        value = shift = count = 0
    if count:
        raise CodecError("truncated varint")
    epoch = values.pop(0) if with_epoch and values else None
    if len(values) < 2:
        raise CodecError("ack state header is missing")
    base, length, *runs = values
    if sum(runs) != length:
        raise CodecError(f"run lengths add up to {sum(runs)}, header says {length}")
    try:
        return AckState(base, tuple(runs), epoch)
    except ValueError as exc:
        raise CodecError(f"invalid ack state: {exc}") from exc


def decode(metadata: str | None, max_runs: int | None = None) -> AckState:
    """Decode commit metadata written by :func:`encode`.

    Raises :class:`CodecError` for anything else: no metadata, an empty string, metadata
    written by another tool, another format version, or corrupted text; and, with
    ``max_runs``, a state of more runs (another writer's: 4 KiB of DEFLATE inflate to
    millions, hundreds of MB as a state), refused while inflating, before any is held.
    """
    if not metadata:
        raise CodecError("no commit metadata")
    if not metadata.startswith(PREFIX):
        if metadata.startswith(PREFIX[:-1]) and len(metadata) > 2 and metadata[2].isdigit():
            raise CodecError(f"unsupported ack state version {metadata[2]!r}")
        raise CodecError("not consumer-proxy commit metadata")
    flag = metadata[len(PREFIX) : _HEADER_LEN]
    if flag not in (_FLAG_RAW, _FLAG_DEFLATE, _FLAG_RAW_EPOCH, _FLAG_DEFLATE_EPOCH):
        raise CodecError(f"unknown ack state encoding flag {flag!r}")
    text = metadata[_HEADER_LEN:]
    try:
        payload = base64.b85decode(text)
    except ValueError as exc:
        raise CodecError(f"ack state is not base85: {exc}") from exc
    # base85 decoding tolerates some variation in a trailing partial group; insisting on the
    # canonical spelling means we accept exactly the strings encode() produces.
    if base64.b85encode(payload).decode("ascii") != text:
        raise CodecError("ack state is not canonical base85")
    if len(payload) < _CRC_LEN:
        raise CodecError("ack state is too short")
    crc, stored = payload[:_CRC_LEN], payload[_CRC_LEN:]
    # The epoch, the base and the length, then the runs: each value at most a varint's bytes.
    max_values = _MAX_BODY_BYTES if max_runs is None else max_runs + 3
    if flag in (_FLAG_DEFLATE, _FLAG_DEFLATE_EPOCH):
        body = _inflate(stored, min(_MAX_BODY_BYTES, max_values * _MAX_VARINT_BYTES))
    else:
        body = stored
    if zlib.crc32(body).to_bytes(_CRC_LEN, "big") != crc:
        raise CodecError("ack state checksum mismatch")
    return _parse_body(body, flag.isupper(), max_values)
