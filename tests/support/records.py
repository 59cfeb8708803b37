"""A fetched record for tests of the pure core: what ``core.partitions.Record`` reads of a
confluent_kafka.Message, with the values a test gives it."""

from __future__ import annotations

import base64
import zlib
from typing import Any


class Rec:
    """A record at ``offset`` of ``topic`` (partition ``partition``)."""

    def __init__(
        self,
        topic: str,
        offset: int,
        *,
        partition: int = 0,
        epoch: int | None = None,
        headers: Any = None,
        key: bytes | None = None,
        value: bytes | None = b"v",
        timestamp_ms: int = 7,
    ) -> None:
        self._topic, self._offset, self._partition = topic, offset, partition
        self._epoch, self._headers, self._key, self._value = epoch, headers, key, value
        self._timestamp = (1 if timestamp_ms >= 0 else 0, timestamp_ms)

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def leader_epoch(self) -> int | None:
        return self._epoch


def foreign_ack_state(base: int, runs: list[int]) -> str:
    """Commit metadata of ``runs`` from ``base`` in the ack-state format (checksummed,
    deflated), as another writer could make it: nothing ``encode`` would refuse to write is
    checked here."""
    body = bytearray()
    for value in (base, sum(runs), *runs):
        while value >= 0x80:
            body.append((value & 0x7F) | 0x80)
            value >>= 7
        body.append(value)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
    stored = packer.compress(bytes(body)) + packer.flush()
    return "cp1z" + base64.b85encode(zlib.crc32(body).to_bytes(4, "big") + stored).decode()
