"""A delivery ledger: proves that no produced message is lost and counts the duplicates.

Every message a test produces through the ledger carries a unique id in the header
``ledger-id``. At the end the test hands the ledger what the services saw (their recorded
deliveries) and what the DLQ holds (read by id: a DLQ record keeps the user headers), and the
ledger classifies each id:

- acked once, or acked more than once (the service answered ACK/DROP more than once: a
  duplicate the service processed twice);
- dead-lettered (never acked, found in the DLQ);
- missing (neither): must be zero.

``check(max_duplicates=..., bound=...)`` asserts that and states the bound used. Every checked
ledger is registered, and ``tests/conftest.py`` prints them all in pytest's terminal summary.

    ledger = Ledger("kill -9 the proxy x5")
    produce(bootstrap, topic, ledger.records(3000, partitions=4))
    ...  # run, with faults
    ledger.observe(service.deliveries)
    ledger.observe_dlq(consume_all(bootstrap, dlq_topic))
    ledger.check(max_duplicates=5 * 4 * 100, bound="kills x partitions x max_in_flight")
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

ID_HEADER = "ledger-id"
ACKED = frozenset({"ACK", "DROP"})  # the service's answers that finish a message


class _Delivery(Protocol):
    @property
    def headers(self) -> tuple[tuple[str, bytes], ...]: ...

    @property
    def outcome(self) -> str: ...


@dataclass
class Summary:
    """The classification of one ledger; ``line()`` is what the terminal summary prints."""

    name: str
    produced: int
    acked_once: int
    acked_more: int
    dead_lettered: int
    missing: int
    duplicate_acks: int  # ACK/DROP answers beyond the first per id
    dlq_duplicates: int  # DLQ records beyond the first per id
    deliveries: int  # calls the services received for the ledger's ids, any outcome
    max_duplicates: int | None = None
    bound: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def duplicates(self) -> int:
        """Messages processed more than once: extra acks plus extra DLQ records."""
        return self.duplicate_acks + self.dlq_duplicates

    def line(self) -> str:
        bound = ""
        if self.max_duplicates is not None:
            bound = f" (bound {self.max_duplicates}" + (f" = {self.bound}" if self.bound else "")
            bound += ")"
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return (
            f"{self.name}: produced {self.produced}, acked once {self.acked_once}, "
            f"acked more than once {self.acked_more}, dead-lettered {self.dead_lettered}, "
            f"missing {self.missing}; duplicates {self.duplicates}{bound}; "
            f"deliveries {self.deliveries}{extra}"
        )


SUMMARIES: list[Summary] = []
"""Every ledger checked in this session, in order (printed by the terminal summary hook)."""


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class Ledger:
    """Ids of produced messages and what became of each one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._prefix = uuid.uuid4().hex[:8]
        self.ids: list[str] = []
        self._acks: dict[str, int] = {}
        self._deliveries: dict[str, int] = {}
        self._dlq: dict[str, int] = {}
        self.notes: list[str] = []

    def new_id(self) -> str:
        """A fresh id, remembered as produced."""
        ident = f"{self._prefix}-{len(self.ids)}"
        self.ids.append(ident)
        return ident

    def records(
        self,
        n: int,
        *,
        partitions: int | None = None,
        value: Any = None,
        headers: Sequence[tuple[str, bytes | str | None]] = (),
        key: Any = None,
    ) -> list[dict[str, Any]]:
        """``n`` records for ``tests.support.kafka.produce``, each carrying a new id.

        ``value``/``key`` are a bytes value or a function of (index, id); by default the value
        is the id. ``partitions`` spreads them round robin; else the producer's partitioner.
        """
        out: list[dict[str, Any]] = []
        for i in range(n):
            ident = self.new_id()
            record: dict[str, Any] = {
                "value": value(i, ident) if callable(value) else (value or ident.encode()),
                "headers": [*headers, (ID_HEADER, ident.encode())],
            }
            if key is not None:
                record["key"] = key(i, ident) if callable(key) else key
            if partitions:
                record["partition"] = i % partitions
            out.append(record)
        return out

    def tag(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``record`` (a produce() dict) with a new id appended to its headers."""
        tagged = dict(record)
        headers = list(tagged.get("headers") or [])
        tagged["headers"] = [*headers, (ID_HEADER, self.new_id().encode())]
        return tagged

    @staticmethod
    def id_of(headers: Iterable[tuple[str, bytes | str | None]] | None) -> str | None:
        """The ledger id among ``headers`` (the last one, should a record carry several)."""
        found = None
        for key, value in headers or ():
            if key == ID_HEADER:
                found = _text(value)
        return found

    def observe(self, deliveries: Iterable[_Delivery]) -> None:
        """Count the deliveries a service recorded (tests.support.service.Delivery)."""
        for delivery in deliveries:
            ident = self.id_of(delivery.headers)
            if ident is None:
                continue
            self._deliveries[ident] = self._deliveries.get(ident, 0) + 1
            if delivery.outcome in ACKED:
                self._acks[ident] = self._acks.get(ident, 0) + 1

    def observe_dlq(self, messages: Iterable[Any]) -> None:
        """Count DLQ records (confluent_kafka Messages) by the id they carried over."""
        for message in messages:
            ident = self.id_of(message.headers())
            if ident is not None:
                self._dlq[ident] = self._dlq.get(ident, 0) + 1

    def note(self, text: str) -> None:
        """A remark printed with the summary (e.g. how many faults were injected)."""
        self.notes.append(text)

    def acked(self) -> set[str]:
        return {i for i, n in self._acks.items() if n}

    def dead_lettered(self) -> set[str]:
        return {i for i, n in self._dlq.items() if n}

    def summary(self) -> Summary:
        produced = set(self.ids)
        acks = {i: n for i, n in self._acks.items() if i in produced}
        dlq = {i: n for i, n in self._dlq.items() if i in produced}
        dead_only = set(dlq) - set(acks)
        return Summary(
            name=self.name,
            produced=len(produced),
            acked_once=sum(1 for n in acks.values() if n == 1),
            acked_more=sum(1 for n in acks.values() if n > 1),
            dead_lettered=len(dead_only),
            missing=len(produced - set(acks) - set(dlq)),
            duplicate_acks=sum(n - 1 for n in acks.values()),
            # A message acked and also dead-lettered was processed twice, too.
            dlq_duplicates=sum(n - 1 for n in dlq.values()) + len(set(dlq) & set(acks)),
            deliveries=sum(n for i, n in self._deliveries.items() if i in produced),
            notes=list(self.notes),
        )

    def check(self, *, max_duplicates: int, bound: str = "") -> Summary:
        """Register the summary, then assert: nothing missing, duplicates within the bound."""
        summary = self.summary()
        summary.max_duplicates = max_duplicates
        summary.bound = bound
        SUMMARIES.append(summary)
        print(f"\nledger {summary.line()}")
        produced = set(self.ids)
        missing = sorted(produced - self.acked() - self.dead_lettered())
        assert not missing, f"{len(missing)} messages lost, e.g. {missing[:10]}: {summary.line()}"
        assert summary.duplicates <= max_duplicates, f"too many duplicates: {summary.line()}"
        return summary
