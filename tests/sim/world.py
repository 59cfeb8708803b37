"""A deterministic world for the simulation: Kafka, the service and the DLQ.

The simulated consumer keeps librdkafka's behaviour where it matters to the core:
- a pause flag survives revoke and re-assign of the same partition (librdkafka issue 1849);
- on assign the position is the committed offset (earliest when there is none);
- fetches skip offsets that are not in the log (compaction, transaction markers), and the
  consumer's position moves past them;
- an unclean leader election can truncate a partition's log below the consumer's position,
  and new records then reuse the truncated offsets;
- commits carry metadata and are stored per partition.

Everything runs on one virtual clock; randomness comes from one seeded ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import grpc

from consumer_proxy.core.batching import BatchOutcome, classify_batch, classify_failed_call
from consumer_proxy.core.decision import Action, Decision
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.proto.v1 import handler_pb2

TP = tuple[str, int]


@dataclass(frozen=True)
class Msg:
    """One record in a simulated log; ``ident`` is unique across the whole run."""

    ident: int
    behaviour: str  # ok | flaky:N | poison | timeout:N (N deadlines, then ok) | drop
    key: bytes | None = None
    value: bytes | None = b"v"
    extra: tuple[tuple[str, bytes], ...] = ()  # more headers (a retry tier record's cp-*)
    headed: bool = True
    """Its id is in an ``id`` header; else the record has no header of its own and its value
    begins with the id (``ident_value``): batch mode takes such records as ``Run`` items."""


def ident_value(ident: int, rest: bytes) -> bytes:
    """The value of a record produced without headers: its id, ``;``, then ``rest``."""
    return b"%d;%s" % (ident, rest)


def ident_of(headers: Iterable[tuple[str, bytes]] | None, value: bytes | None) -> int:
    """A message's id wherever it went (a push, the DLQ, a retry tier): its ``id`` header,
    else the head of its value (``ident_value``)."""
    for key, raw in headers or ():
        if key == "id":
            return int(raw)
    if value is None or b";" not in value:
        raise AssertionError(f"a message without its id: headers {headers!r}, value {value!r}")
    return int(value.split(b";", 1)[0])


class Record:
    """A fetched record with confluent_kafka.Message's accessors."""

    __slots__ = ("_epoch", "_msg", "_offset", "_partition", "_topic")

    def __init__(self, topic: str, partition: int, offset: int, msg: Msg, epoch: int) -> None:
        self._topic = topic
        self._partition = partition
        self._offset = offset
        self._msg = msg
        self._epoch = epoch

    @property
    def msg(self) -> Msg:
        return self._msg

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._msg.key

    def value(self) -> bytes | None:
        return self._msg.value

    def headers(self) -> Any:
        msg = self._msg
        if msg.headed:
            return [("id", str(msg.ident).encode()), *msg.extra]
        return list(msg.extra) or None  # (confluent_kafka's: None for a record without any)

    def timestamp(self) -> tuple[int, int]:
        return (1, 0)

    def error(self) -> None:
        return None

    def leader_epoch(self) -> int:
        return self._epoch


@dataclass
class Log:
    """One partition's log: offset -> message (missing offsets are gaps)."""

    records: dict[int, Msg] = field(default_factory=dict)
    end: int = 0  # the next offset to be written
    epoch: int = 0  # the leader epoch new records are written in
    epochs: dict[int, int] = field(default_factory=dict)
    done_below: int = 0
    """Every record below this offset is done (the simulation's check of commits)."""

    def append(self, msg: Msg, gap: int = 0) -> None:
        self.end += gap  # offsets skipped: compaction or transaction markers
        self.records[self.end] = msg
        self.epochs[self.end] = self.epoch
        self.end += 1

    def truncate(self, offset: int) -> list[Msg]:
        """An unclean leader election: the new leader's log ends at ``offset`` and it writes
        in a new epoch."""
        gone = [m for o, m in self.records.items() if o >= offset]
        self.records = {o: m for o, m in self.records.items() if o < offset}
        self.epochs = {o: e for o, e in self.epochs.items() if o < offset}
        self.end = offset
        self.epoch += 1
        self.done_below = min(self.done_below, offset)
        return gone

    def epoch_end(self, epoch: int) -> int:
        """Where leader ``epoch`` ends in this log (the first record of a later epoch, or the
        end): what a leader answers a KIP-320 OffsetsForLeaderEpoch request with."""
        later = [o for o, e in self.epochs.items() if e > epoch]
        return min(later) if later else self.end


class Consumer:
    """One member's consumer of a simulated cluster (one topic, several partitions)."""

    def __init__(
        self,
        logs: dict[TP, Log],
        commits: dict[TP, tuple[int, str]],
        epochs: dict[TP, int] | None = None,
    ) -> None:
        self.logs = logs
        self.commits = commits  # shared: the group coordinator's committed offsets
        self.epochs = {} if epochs is None else epochs  # ... and their leader epochs
        self.assigned: set[TP] = set()
        self.paused: set[TP] = set()  # survives revoke and re-assign, like librdkafka's flag
        self.position: dict[TP, int] = {}

    def assign(self, tps: list[TP]) -> list[tuple[TP, int | None, str, int | None]]:
        """Take ``tps`` on: each with its committed offset, metadata and leader epoch (what
        librdkafka's ``committed()`` reads)."""
        out = []
        for tp in tps:
            self.assigned.add(tp)
            committed = self.commits.get(tp)
            position = committed[0] if committed else 0
            epoch = self.epochs.get(tp)
            if committed and epoch is not None:
                # librdkafka validates a committed offset that has a leader epoch (KIP-320):
                # when the log was cut below it, it seeks back to the cut, silently.
                position = min(position, self.logs[tp].epoch_end(epoch))
            self.position[tp] = position
            out.append(
                (
                    tp,
                    committed[0] if committed else None,
                    committed[1] if committed else "",
                    epoch if committed else None,
                )
            )
        return out

    def revoke(self, tps: list[TP]) -> None:
        for tp in tps:
            self.assigned.discard(tp)
            self.position.pop(tp, None)

    def set_paused(self, pause: list[TP], resume: list[TP]) -> None:
        for tp in pause:
            if tp in self.assigned:
                self.paused.add(tp)
        for tp in resume:
            if tp in self.assigned:
                self.paused.discard(tp)

    def truncated(self, tp: TP, offset: int) -> None:
        """The leader's log was cut at ``offset``: a position past it goes back to it."""
        if tp in self.position and self.position[tp] > offset:
            self.position[tp] = offset

    def fetch(
        self, rng: random.Random, max_records: int, among: Set[TP] | None = None
    ) -> list[Record]:
        """Up to ``max_records`` fetchable records (of the partitions ``among`` only, if
        given), partition by partition in a random order."""
        out: list[Record] = []
        tps = sorted((self.assigned if among is None else self.assigned & among) - self.paused)
        rng.shuffle(tps)
        for tp in tps:
            log = self.logs[tp]
            pos = self.position[tp]
            while pos < log.end and len(out) < max_records:
                msg = log.records.get(pos)
                if msg is not None:
                    out.append(Record(tp[0], tp[1], pos, msg, log.epochs[pos]))
                pos += 1
            self.position[tp] = pos
        return out

    def commit(self, tp: TP, offset: int, metadata: str, epoch: int | None = None) -> None:
        if tp in self.assigned:
            self.commits[tp] = (offset, metadata)
            if epoch is None:
                self.epochs.pop(tp, None)
            else:
                self.epochs[tp] = epoch


ACKED = Decision(Action.ACK)
"""What ``finish`` decides for each message ``PartitionSet.finish_acked`` finished at once."""

# -- the service -------------------------------------------------------------------------
# The shell simulation answers with this model: a message's behaviour ("ok", "poison",
# "drop", "flaky:N", "timeout:N", and its own kinds) and the service's outage
# ("unavailable", "hung", "unimplemented" for batch calls).


def service_answer(behaviour: str, tries: int, outage: str | None) -> tuple[grpc.StatusCode, int]:
    """The service's answer to one message on its ``tries``-th attempt: (status, action)."""
    if outage == "unavailable":
        return grpc.StatusCode.UNAVAILABLE, 0
    if behaviour.startswith("timeout:") and tries <= int(behaviour[8:]):
        # The service's own per-message deadline (in a batch, a slow message does not hold
        # its call): the same status as a unary deadline.
        return grpc.StatusCode.DEADLINE_EXCEEDED, 0
    if behaviour == "poison":
        return grpc.StatusCode.INVALID_ARGUMENT, 0
    if behaviour == "drop":
        return grpc.StatusCode.OK, handler_pb2.HandleMessageResponse.DROP
    if behaviour.startswith("flaky:") and tries <= int(behaviour[6:]):
        return grpc.StatusCode.INTERNAL, 0
    return grpc.StatusCode.OK, 0


def service_unary_call(
    classifier: Classifier,
    rng: random.Random,
    outage: str | None,
    answer: tuple[grpc.StatusCode, int],
    timeout_s: float,
) -> tuple[Classification, float]:
    """One HandleMessage call answering ``answer`` (``service_answer``'s): its result as the
    proxy classifies it and how long it takes (a hung service, or a deadline: the timeout)."""
    code, action = answer
    latency = rng.uniform(0.001, 0.05)  # drawn in every case: the schedule's draws stay aligned
    if outage == "hung" or code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # the proxy's own deadline: its reason is the one a failed batch call's has
        deadline = grpc.StatusCode.DEADLINE_EXCEEDED
        return classifier.from_status(deadline, "deadline"), timeout_s
    if outage == "unavailable":
        latency = 0.001
    if code != grpc.StatusCode.OK:
        return classifier.from_status(code, code.name), latency
    response = handler_pb2.HandleMessageResponse(action=action)  # type: ignore[arg-type]
    return classifier.from_response(response), latency


def service_batch_call(
    classifier: Classifier,
    rng: random.Random,
    outage: str | None,
    idents: Sequence[int],
    answer: Callable[[int], tuple[grpc.StatusCode, int]],
    timeout_s: float,
    garbled: Callable[[int], bool] = lambda ident: False,
) -> tuple[BatchOutcome, float, bool]:
    """One HandleMessageBatch call: the service fails the call (an outage), or answers each
    message (``answer``), now and then with one result too few or too many (a glitch), and
    always so for a batch holding a ``garbled`` message. Returns the outcome, the call's
    latency and whether the answer had the wrong length."""
    count = len(idents)
    latency = max(rng.uniform(0.001, 0.05) for _ in idents)
    if outage == "hung":
        code = grpc.StatusCode.DEADLINE_EXCEEDED
        return classify_failed_call(classifier, code, "deadline", count), timeout_s, False
    if outage == "unimplemented":
        code = grpc.StatusCode.UNIMPLEMENTED
        return classify_failed_call(classifier, code, "no batch", count), 0.001, False
    if outage == "unavailable" and rng.random() < 0.5:
        code = grpc.StatusCode.UNAVAILABLE
        return classify_failed_call(classifier, code, "down", count), 0.001, False
    answers = []
    for ident in idents:
        code, action = answer(ident)
        answers.append(
            handler_pb2.HandleMessageResponse(
                status_code=code.value[0] if code != grpc.StatusCode.OK else 0,
                action=action,  # type: ignore[arg-type]
                reason=code.name,
            )
        )
    wrong = False
    if count > 1 and rng.random() < 0.03:  # a glitch: one result too few or too many
        if rng.random() < 0.5:
            answers.pop()
        else:
            answers.append(handler_pb2.HandleMessageResponse())
        wrong = True
    elif any(garbled(ident) for ident in idents):
        answers.pop()  # a message the service's batch code always mishandles
        wrong = True
    response = handler_pb2.HandleMessageBatchResponse(results=answers)
    return classify_batch(classifier, response, count), latency, wrong
