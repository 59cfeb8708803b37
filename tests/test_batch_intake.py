"""A consume() batch handled a partition's run at a time (``PartitionSet.intake_batch``) and a
call's plain acks finished together (``PartitionSet.finish_acked``): the same state and the
same messages, in the same order, as record by record and message by message. What it saves:
``bench/bench_throughput.py``.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from confluent_kafka import Message
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st

from consumer_proxy.batch_push import BatchPush
from consumer_proxy.cli import YOUNG_GC_THRESHOLD
from consumer_proxy.config import DeliveryConfig
from consumer_proxy.core.batching import BatchLimits, take
from consumer_proxy.core.decision import Decision
from consumer_proxy.core.outcomes import Classification, Outcome
from consumer_proxy.core.partitions import (
    SOURCE_PRIMARY,
    SOURCE_REDRIVE,
    TP,
    Delivery,
    PartitionState,
    Ready,
    Record,
    Run,
    expand,
)
from consumer_proxy.core.records import H_ATTEMPT, H_TOPIC, Origin, UserHeaders
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.push import OpenCall
from consumer_proxy.readyq import ReadyDeque, take_all
from consumer_proxy.wire import batch_request, message
from tests.support.core import ACK, CoreRig
from tests.support.records import Rec

RETRY = Classification(Outcome.RETRY, "UNKNOWN")
DROP = Classification(Outcome.DROP, "DROPPED")
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=300)


class Rig(CoreRig):
    """A core with two partitions of topic t; the ready messages in ``ready``, and each
    ``emit_batch`` call's size in ``emits``."""

    def __init__(self, window: int = 1000, budget: int = 64 * 1024 * 1024) -> None:
        self.emits: list[int] = []
        self.idle = 0
        super().__init__(
            DeliveryConfig(max_in_flight=window, max_in_flight_bytes=budget),
            tps=(("t", 0), ("t", 1)),
            pause_plan=True,
            on_idle=self._idle,
            emit_batch=self._emit_batch,
        )

    def _emit_batch(self, deliveries: list[Delivery]) -> None:
        self.emits.append(len(deliveries))
        self.ready.extend(deliveries)

    def _idle(self) -> None:
        self.idle += 1

    def take(self, n: int) -> list[Delivery]:
        taken = [self.ready.popleft() for _ in range(n)]
        assert self.core.begin_batch(taken) == taken
        return taken

    def state(self) -> list[object]:
        """Everything intake decides, per partition: the window, the backlog, the bytes."""
        out: list[object] = []
        for part in self.core.parts.values():
            tracker = part.tracker
            assert tracker is not None
            out.append(
                (
                    part.tp,
                    tracker.committable(),
                    tracker.in_flight,
                    tracker.pending,
                    tracker.epoch,
                    [r.offset() for r in part.backlog],
                    part.backlog_bytes,
                    part.bytes,
                    part.received_end,
                    part.epoch,
                )
            )
        budget = self.core.budgets[0]
        out.append((budget.held, budget.waiting, self.core.counters.resets))
        return out

    def emitted(self) -> list[tuple[object, ...]]:
        return [
            (d.part.tp, d.offset, d.epoch, d.size, d.key, d.value, d.headers, d.origin)
            for d in self.by_partition()
        ]

    def by_partition(self) -> list[Delivery]:
        """The ready messages, a partition after another, each partition's in ready order
        (``finish_acked`` drains each partition's backlog once, after all of its acks, where
        ``finish`` drains after each ack: the partitions' messages may interleave otherwise,
        each partition's come in the same order)."""
        return sorted(self.ready, key=lambda d: d.part.tp)  # (stable: ready order kept)


def test_a_run_of_one_partition_goes_out_in_one_emit() -> None:
    # Given a core with room for everything
    rig = Rig()
    # When one consume() batch brings 5 records of partition 0, then 3 of partition 1
    records = [Rec("t", o) for o in range(5)] + [Rec("t", o, partition=1) for o in range(3)]
    rig.core.intake_batch(records)
    # Then each run went out in one emit, in fetch order, and the windows and bytes count it
    assert rig.emits == [5, 3]
    assert [(d.part.partition, d.offset) for d in rig.ready] == [(0, o) for o in range(5)] + [
        (1, o) for o in range(3)
    ]
    windows = [(p.tracker.in_flight, p.bytes) for p in rig.core.parts.values() if p.tracker]
    assert windows == [(5, 5), (3, 3)]


def test_what_the_window_has_no_room_for_waits_in_the_backlog() -> None:
    # Given a window of 4
    rig = Rig(window=4)
    # When a batch brings 10 records of one partition
    rig.core.intake_batch([Rec("t", o) for o in range(10)])
    # Then 4 go out at once and the other 6 wait in the backlog, as record by record
    assert rig.emits == [4]
    part = rig.core.parts[("t", 0)]
    assert [r.offset() for r in part.backlog] == list(range(4, 10))


TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEADERS: list[list[tuple[str, bytes]] | None] = [
    None,
    [("h", b"x" * 3)],
    [("traceparent", TRACEPARENT), ("cp-mine", b"u")],  # (a user's own cp- name)
    [(H_TOPIC, b"src"), ("h", b"y"), (H_ATTEMPT, b"2")],  # (the proxy's names: data here)
    [(H_ATTEMPT, b"2")],  # (only one of the proxy's names)
]
"""A record's headers in ``records_strategy``: none, the user's, the proxy's names among them
(on a source topic, the producer's data: kept as they are)."""

records_strategy = st.lists(
    st.tuples(
        st.integers(0, 1),  # partition
        st.integers(-3, 4),  # offset step from the previous record of the partition
        st.integers(0, 300),  # value bytes
        st.integers(0, 2),  # leader epoch: 2 bumped; 1 after a step back: the log's again
        st.integers(0, len(HEADERS) - 1),  # its headers (``HEADERS``)
        st.sampled_from([None, b"", b"k"]),  # key
        st.sampled_from([-1, 0, 7, 1_764_000_000_000]),  # timestamp (-1: none)
    ),
    max_size=60,
)


@relaxed
@example(  # an offset reset inside one batch reads a lower leader epoch again
    steps=[(0, 1, 0, 0, 0, None, 7), (0, 1, 0, 2, 0, None, 7), (0, -1, 0, 1, 0, None, 7)],
    cuts=[],
    window=8,
    budget=1024,
    acks=0,
)
@example(  # two partitions' backlogs drained by one call's acks: they interleave otherwise
    steps=[(1, 0, 0, 0, 0, None, -1), (0, 0, 0, 0, 0, None, -1)]
    + [(p, 1, 0, 0, 0, None, -1) for p in (1, 1, 0, 0, 1)],
    cuts=[7],
    window=2,
    budget=1024,
    acks=3,
)
@given(
    steps=records_strategy,
    cuts=st.lists(st.integers(1, 10), max_size=6),
    window=st.integers(1, 8),
    budget=st.integers(1024, 2500),
    acks=st.integers(0, 5),
)
def test_batch_intake_is_record_by_record_intake(
    steps: list[tuple[int, int, int, int, int, bytes | None, int]],
    cuts: list[int],
    window: int,
    budget: int,
    acks: int,
) -> None:
    # Given fetched records with gaps, duplicates, resets (a step back), epochs, headers,
    # keys and timestamps, cut into consume() batches
    batches = _batches(steps, cuts)
    one, many = Rig(window, budget), Rig(window, budget)
    setattr(one.core, "_plain", lambda _part: False)  # noqa: B010 (every record on its own)
    for batch in batches:
        # When one core takes each record on its own and the other each batch at once
        for record in batch:
            one.core.intake(record)
        many.core.intake_batch(batch)
        # Then both hold the same state and emitted the same messages, each partition's in
        # the same order, which go out in the same request (built from the run's fields in
        # ``many``, from each message's Origin in ``one``)
        assert many.state() == one.state()
        assert batch_request(many.by_partition(), "g") == batch_request(one.by_partition(), "g")
        assert many.emitted() == one.emitted()
        # (and some acks in between make room and drain backlogs: one by one, and the same
        # messages together)
        taken = [one.ready.popleft() for _ in range(min(acks, len(one.ready)))]
        for d in [d for d in taken if one.core.begin(d)]:
            one.core.finish(d, ACK, probe=False)
        ready = {(d.part.tp, d.offset, d.epoch): d for d in many.ready}
        together = [ready[(d.part.tp, d.offset, d.epoch)] for d in taken]
        for d in together:
            many.ready.remove(d)
        began = many.core.begin_batch(together)
        if not many.core.finish_acked(began, [ACK] * len(began)):
            for d in began:
                many.core.finish(d, ACK, probe=False)
        assert many.state() == one.state()  # (the acks drained the backlogs alike)
        rig_pause = [r.core.pause_plan() for r in (one, many)]
        assert rig_pause[0] == rig_pause[1]


class RunRig(Rig):
    """A ``Rig`` whose core hands out ``Run`` items (batch mode's fast path), in ``items``."""

    def __init__(self, window: int, budget: int, runs: bool) -> None:
        self.decisions: list[tuple[int, int, Decision | None]] = []
        CoreRig.__init__(
            self,
            DeliveryConfig(max_in_flight=window, max_in_flight_bytes=budget),
            tps=(("t", 0), ("t", 1)),
            pause_plan=True,
            emit_batch=lambda items: self.ready.extend(items),
            runs=runs,
        )
        self.items: deque[Ready] = cast("deque[Ready]", self.ready)  # (and retries: ``emit``)
        self.emits, self.idle = [], 0
        self.drop: Callable[[Ready], bool] = (
            self.core.drop_ready(self.items)
            if runs
            else lambda item: self.core.drop_stale(cast(Delivery, item))
        )

    def call(self, limits: BatchLimits, answers: list[Classification] | None) -> bytes:
        """One call as ``BatchPush`` makes it: take, begin, the request, then the answers
        (None: all plain acks) finished together or message by message; returns the request."""
        began = self.core.begin_batch(take(self.items, limits, self.drop))
        payload = batch_request(began, "g")
        count = sum(item.count for item in began)
        results = [ACK] * count if answers is None else (answers * count)[:count]
        if not self.core.finish_acked(began, results):
            for d, result in zip(expand(began), results, strict=True):
                decision = self.core.finish(d, result, probe=False)
                self.decisions.append((d.part.partition, d.offset, decision))
        return payload

    def commits(self) -> list[tuple[int, int, str, int | None]]:
        plan, _ = self.core.commit_plan()
        return [(c.part.partition, c.offset, c.metadata, c.epoch) for c in plan]


@relaxed
@example(  # a run holding records with headers (``HEADERS``), split, retried, acked
    steps=[(0, 1, 10, 0, h, None, 7) for h in (0, 2, 3, 1, 4, 0)],
    cuts=[],
    window=8,
    budget=2500,
    calls=[(2, 700, "acks"), (3, 700, "one retry"), (6, 700, "acks")],
)
@given(
    steps=records_strategy,
    cuts=st.lists(st.integers(1, 10), max_size=6),
    window=st.integers(1, 8),
    budget=st.integers(1024, 2500),
    calls=st.lists(
        st.tuples(
            st.integers(1, 6),  # max_messages
            st.integers(1, 700),  # max_bytes
            st.sampled_from(["acks", "retry", "one retry", "drop", "cut", "leave"]),
        ),
        max_size=8,
    ),
)
def test_ready_runs_are_message_by_message(
    steps: list[tuple[int, int, int, int, int, bytes | None, int]],
    cuts: list[int],
    window: int,
    budget: int,
    calls: list[tuple[int, int, str]],
) -> None:
    # Given the fetched records of the test above, cut into consume() batches
    batches = _batches(steps, cuts)
    messages, runs = RunRig(window, budget, False), RunRig(window, budget, True)
    for batch in batches:
        # When one core hands out each message on its own and the other runs of them
        messages.core.intake_batch(batch)
        runs.core.intake_batch(batch)
        assert runs.state() == messages.state()
        # ... and calls of random caps take them, answered with acks, retries, drops, after
        # a partition's log is cut or it begins leaving
        for max_messages, max_bytes, what in calls:
            limits = BatchLimits(max_messages, max_bytes)
            if what == "cut":
                for rig in (messages, runs):
                    rig.core.truncated(("t", 0), 2)
            if what == "leave" and ("t", 1) in runs.core.parts:
                for rig in (messages, runs):
                    rig.core.leave(rig.core.owned([("t", 1)]))
            answers = {"retry": [RETRY], "one retry": [ACK, RETRY], "drop": [DROP]}.get(what)
            # Then each call's request is the same bytes, each message decided alike, and
            # the windows, backlogs, bytes, commits and counters are the same after it
            assert runs.call(limits, answers) == messages.call(limits, answers)
            assert runs.decisions == messages.decisions
            assert runs.state() == messages.state()
            assert runs.commits() == messages.commits()
            assert runs.core.counters == messages.core.counters
            for rig in (messages, runs):
                rig.clock.advance(60.0)  # (the retries are ready again)
            assert expand(runs.items) == [] or [
                (d.part.tp, d.offset, d.size, d.key, d.value, d.headers, d.origin)
                for d in expand(runs.items)
            ] == [
                (d.part.tp, d.offset, d.size, d.key, d.value, d.headers, d.origin)
                for d in expand(messages.items)
            ]
    # (and what is left goes out as one request per call, the same)
    while messages.items or runs.items:
        assert runs.call(BatchLimits(4, 10_000), None) == messages.call(
            BatchLimits(4, 10_000), None
        )
    assert runs.commits() == messages.commits()
    assert [p.calls for p in runs.core.parts.values()] == [
        p.calls for p in messages.core.parts.values()
    ]


def _batches(
    steps: list[tuple[int, int, int, int, int, bytes | None, int]], cuts: list[int]
) -> list[list[Rec]]:
    """The records of ``records_strategy``'s steps: offsets stepping from the previous
    record of the partition, leader epochs bumped (or read again lower after a step back, as
    an offset reset reads the log again), headers, keys, values, timestamps; in consume()
    batches ending where ``cuts`` say (each a length)."""
    records: list[Rec] = []
    last = {0: -1, 1: -1}
    epoch = {0: 0, 1: 0}
    seen: dict[tuple[int, int], int] = {}  # the epoch each (partition, offset) was read in
    for partition, step, size, bump, header, key, timestamp_ms in steps:
        offset = max(0, last[partition] + step)
        if offset <= last[partition] and bump == 1:  # an offset reset reads the log again
            epoch[partition] = seen.get((partition, offset), epoch[partition])
        last[partition] = offset
        epoch[partition] += bump == 2
        seen[(partition, offset)] = epoch[partition]
        records.append(
            Rec(
                "t",
                offset,
                partition=partition,
                epoch=epoch[partition],
                headers=HEADERS[header],
                key=key,
                value=b"v" * size,
                timestamp_ms=timestamp_ms,
            )
        )
    batches = []
    for cut in cuts:
        batches.append(records[:cut])
        records = records[cut:]
    return [*batches, records]


def test_a_run_taken_record_makes_its_origin_only_when_asked() -> None:
    # Given a run of two records taken in at once, one without a timestamp
    rig = Rig()
    rig.core.intake_batch([Rec("t", 0, timestamp_ms=-1), Rec("t", 1, timestamp_ms=9)])
    first, second = rig.ready
    # Then neither made an Origin (an object per message less for the collector)
    assert first.given_origin is None and second.given_origin is None
    # When one is asked for / Then it is the record's own coordinates, made once
    assert second.origin == Origin("t", 0, 1, 9, 0) and second.origin is second.origin
    assert first.origin == Origin("t", 0, 0, 0, 0)


def test_a_call_mixing_runs_and_given_origins_encodes_as_message_by_message() -> None:
    # Given run-taken messages of two partitions (keys, headers, timestamps), one of them
    # on its third attempt, and a redriven message that carries its original coordinates
    rig = Rig()
    rig.core.intake_batch(
        [
            Rec("t", 0, key=b"a", timestamp_ms=5),
            Rec("t", 1, headers=[("h", b"x")], value=None),
            Rec("t", 4, partition=1, key=b"", timestamp_ms=-1),
            Rec("t", 2, timestamp_ms=1_764_000_000_000),
        ]
    )
    p0a, p0b, p1, p0c = rig.ready
    p0c.attempt = 3
    part = rig.core.parts[("t", 1)]
    redriven = Delivery(
        part, 0, 9, b"r", b"v", [], Origin("src", 7, 70, 11, 2), 2, SOURCE_REDRIVE, 3
    )
    batch = [p0a, p0b, redriven, p1, p0c]
    # When they go out in one call
    encoded = batch_request(batch, "g")
    # Then the request is what the unary path's message builder makes of each (the messages'
    # own Origins are made only now, by ``message``)
    expected = handler_pb2.HandleMessageBatchRequest()
    for d in batch:
        one = message(d, "g")
        one.attempt = d.attempt
        expected.messages.append(one)
    assert encoded == expected.SerializeToString()
    decoded = handler_pb2.HandleMessageBatchRequest.FromString(encoded).messages
    assert [(m.topic, m.partition, m.offset, m.attempt, m.source) for m in decoded] == [
        ("t", 0, 0, 1, 1),
        ("t", 0, 1, 1, 1),
        ("src", 7, 70, 3, 2),
        ("t", 1, 4, 1, 1),
        ("t", 0, 2, 3, 1),
    ]


binary = st.binary(max_size=40)
TPS = [("t", 0), ("t", 1), ("tøpic/ü", 2**31 - 1)]
run_records = st.lists(
    st.tuples(
        st.integers(1, 2**40),  # offset step from the run's previous record
        st.one_of(st.none(), st.just(b""), binary),  # key
        st.one_of(st.none(), st.just(b""), binary),  # value
        st.one_of(  # user headers
            st.none(), st.lists(st.tuples(st.text(max_size=8), binary), min_size=1, max_size=3)
        ),
        st.one_of(  # timestamp: none, zero, negative, positive, big
            st.sampled_from([-1, 0]), st.integers(-(2**40), 2**62)
        ),
    ),
    min_size=1,
    max_size=12,
)


@relaxed
@given(
    runs=st.lists(
        st.tuples(
            st.sampled_from(TPS),  # its partition
            st.integers(0, 2**63 - 2**46),  # its first offset
            run_records,
            st.sampled_from(["", "redriven", "retried"]),  # a ``Delivery`` after it
            st.sampled_from(TPS),  # the partition of a retried one
        ),
        min_size=1,
        max_size=4,
    ),
    group=st.text(max_size=12),
)
def test_a_runs_messages_encode_as_protobuf_encodes_each_message(
    runs: list[tuple[tuple[str, int], int, list[tuple[int, Any, Any, Any, int]], str, TP]],
    group: str,
) -> None:
    # Given runs of real fetched records (keys and values None, empty or binary, user
    # headers, offsets up to 2**63, timestamps none, zero, negative or big) of partitions
    # that repeat or not, and redriven or retried messages between them
    parts = {tp: PartitionState(*tp) for tp in TPS}
    batch: list[Ready] = []
    for tp, first, steps, after, retried_tp in runs:
        records: list[Record] = []
        offsets: list[int] = []
        heads: list[UserHeaders] = []
        offset = first
        for step, key, value, headers, timestamp_ms in steps:
            offset += step
            records.append(
                Message(
                    topic=tp[0],
                    partition=tp[1],
                    offset=offset,
                    key=key,
                    value=value,
                    headers=headers,
                    timestamp=(0 if timestamp_ms == -1 else 1, timestamp_ms),
                )
            )
            offsets.append(offset)
            heads.append(headers or [])
        sizes = [0] * len(offsets)
        has_headers = any(heads)
        batch.append(Run(parts[tp], 0, records, offsets, sizes, 0, heads if has_headers else None))
        if after == "redriven":
            origin = Origin("src", 7, 2**62, 11, 2)
            batch.append(Delivery(parts[tp], 0, 9, None, b"r", [], origin, 1, SOURCE_REDRIVE, 3))
        elif after == "retried":  # (a source record's: its partition's shared fields)
            retried = Delivery(
                parts[retried_tp], 0, 5, b"k", None, [], None, 1, SOURCE_PRIMARY, 2, 9
            )
            batch.append(retried)
    # When they go out in one call
    encoded = batch_request(batch, group)
    # Then the request is the bytes protobuf encodes of each message as the unary path
    # builds it (field by field, from each message's Origin)
    expected = handler_pb2.HandleMessageBatchRequest()
    for d in expand(batch):
        one = message(d, group)
        one.attempt = d.attempt
        expected.messages.append(one)
    assert encoded == expected.SerializeToString()


def test_a_calls_plain_acks_finish_together() -> None:
    # Given 6 messages of two partitions out in one call
    rig = Rig()
    rig.core.intake_batch(
        [Rec("t", o) for o in range(3)] + [Rec("t", o, partition=1) for o in range(3)]
    )
    batch = rig.take(6)
    # When the answer acks every one
    assert rig.core.finish_acked(batch, [ACK] * 6)
    # Then they are done: the commit passes them, their bytes are back, the acks counted,
    # and the committer heard once per partition that it holds nothing more
    plan, _ = rig.core.commit_plan()
    assert sorted((c.part.partition, c.offset) for c in plan) == [(0, 3), (1, 3)]
    assert (rig.core.bytes, rig.core.counters.ack, rig.idle) == (0, 6, 2)
    assert all(p.calls == 0 for p in rig.core.parts.values())


def test_an_answer_that_is_not_all_plain_acks_changes_nothing() -> None:
    # Given 3 messages out in one call, and one more whose partition was cut since
    rig = Rig()
    rig.core.intake_batch([Rec("t", o) for o in range(4)])
    batch = rig.take(4)
    before = rig.state()
    # When one answer is a retry, or all are (one classification repeated) / Then
    # finish_acked leaves them all to finish
    assert not rig.core.finish_acked(batch[:3], [ACK, RETRY, ACK])
    assert not rig.core.finish_acked(batch[:3], [RETRY] * 3)
    assert rig.state() == before and rig.core.counters.ack == 0
    # When one message is stale (its log was cut below it) / Then the same
    rig.core.truncated(("t", 0), 3)
    after_cut = rig.state()
    assert not rig.core.finish_acked(batch, [ACK] * 4)
    assert rig.state() == after_cut
    # When one is a guard probe / Then the same
    batch[0].guard_probe = True
    assert not rig.core.finish_acked(batch[:2], [ACK] * 2)
    assert rig.state() == after_cut


def test_an_answer_for_a_partition_revoked_meanwhile_is_not_finished_together() -> None:
    # Given a call with messages of partition 0, then partition 1, then partition 0 again
    rig = Rig()
    rig.core.intake_batch([Rec("t", o) for o in range(2)])
    rig.core.intake_batch([Rec("t", 0, partition=1)])
    rig.core.intake_batch([Rec("t", 2)])
    batch = rig.take(4)
    # When partition 1 is revoked while the call is out
    rig.core.forget(rig.core.parts[("t", 1)])
    before = rig.state()
    # Then its plain acks are not finished together (each goes to ``finish``, which finds
    # partition 1's stale), and nothing changed
    assert not rig.core.finish_acked(batch, [ACK] * 4)
    assert rig.state() == before and rig.core.counters.ack == 0


def test_a_calls_messages_begin_together_but_for_the_stale_and_the_leaving() -> None:
    # Given 3 messages of partition 0 and 2 of partition 1 ready
    rig = Rig()
    records = [Rec("t", o) for o in range(3)] + [Rec("t", o, partition=1) for o in range(2)]
    rig.core.intake_batch(records)
    batch = list(rig.ready)
    # When partition 0 is cut at offset 2 and partition 1 is being revoked
    rig.core.truncated(("t", 0), 2)
    rig.core.leave(rig.core.owned([("t", 1)]))
    # Then the call begins with offsets 0 and 1 only: each counted as a call under way
    began = rig.core.begin_batch(batch)
    assert [(d.part.partition, d.offset) for d in began] == [(0, 0), (0, 1)]
    assert [p.calls for p in rig.core.parts.values()] == [2, 0]
    assert all(d.successes_mark == 0 for d in began)


def _young_passes_while_churning(threshold: int, held: int = 30_000, polls: int = 20) -> int:
    """Young collector passes while a core with ``held`` messages in its windows takes in
    ``polls`` consume() batches of 5,000 records and acks as many (``run``'s setting:
    ``threshold``)."""
    rig = Rig(window=held)
    value = b"v" * 100

    def poll(partition: int, start: int) -> list[Message]:
        return [
            Message(topic="t", partition=partition, offset=o, value=value, timestamp=(1, 7))
            for o in range(start, start + 5000)
        ]

    ends = [0, 0]
    for partition in (0, 1):  # the windows fill up
        while ends[partition] < held // 2:
            rig.core.intake_batch(poll(partition, ends[partition]))
            ends[partition] += 5000
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, *saved[1:])
    try:
        before: int = gc.get_stats()[0]["collections"]
        for i in range(polls):  # then as many acked as taken in, a poll at a time
            partition = i % 2
            rig.core.intake_batch(poll(partition, ends[partition]))
            ends[partition] += 5000
            batch = rig.take(5000)
            assert rig.core.finish_acked(batch, [ACK] * 5000)
        after: int = gc.get_stats()[0]["collections"]
        return after - before
    finally:
        gc.set_threshold(*saved)


def test_a_busy_groups_full_windows_run_almost_no_young_collector_passes() -> None:
    # Given the collector set as ``consumer-proxy run`` sets it, and a busy group whose
    # windows hold 30,000 messages
    # When 100,000 more are taken in, 5,000 a poll, and as many acked
    passes = _young_passes_while_churning(YOUNG_GC_THRESHOLD)
    # Then the collector hardly walks the held messages again (each poll allocates and frees
    # as many as a young pass at 10,000 waited for: one or two passes a poll, 3.3 ms each
    # in the bench)
    assert passes <= 2
    assert _young_passes_while_churning(10_000) >= 10


def _young_passes_while_filling(threshold: int, windows: int = 4, window: int = 20_000) -> int:
    """Young collector passes while ``windows`` partitions' windows of ``window`` fill from
    empty and as many records again wait in their backlogs, in consume() batches of 5,000
    (``bench_throughput``'s proxy: 4 windows of 20,000), with ``run``'s ``threshold``."""
    rig = RunRig(window, 1 << 30, runs=True)
    for partition in range(2, windows):
        rig.core.assign("t", partition, 0, "")
    rig.core.pause_plan()
    value = b"v" * 100
    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, *saved[1:])
    try:
        before: int = gc.get_stats()[0]["collections"]
        for start in range(0, int(1.5 * window), 5000):
            for partition in range(windows):
                rig.core.intake_batch(
                    [
                        Message(topic="t", partition=partition, offset=o, value=value)
                        for o in range(start, start + 5000)
                    ]
                )
        after: int = gc.get_stats()[0]["collections"]
        assert sum(len(p.backlog) for p in rig.core.parts.values()) == windows * window // 2
        return after - before
    finally:
        gc.set_threshold(*saved)


def test_the_windows_filling_up_run_no_young_collector_pass() -> None:
    # Given the collector set as ``consumer-proxy run`` sets it
    # When a fresh group's 4 windows of 20,000 fill and 40,000 more records wait in their
    # backlogs (bench_throughput's proxy: a young pass walks every record held, 6-15 ms)
    passes = _young_passes_while_filling(YOUNG_GC_THRESHOLD)
    # Then the collector never walked them (at 50,000 it did, twice)
    assert passes == 0
    assert _young_passes_while_filling(50_000) >= 2


def test_a_run_holds_records_with_headers() -> None:
    # Given a core handing out runs
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    # When a batch brings 5 records of partition 0, the third with a user header, the fourth
    # with a trace context, a user's own cp- header and the proxy's (as a record re-produced
    # from a dead-letter topic onto a primary one has), then 2 of partition 1
    headers = {
        2: [("h", b"x")],
        3: [("traceparent", TRACEPARENT), (H_TOPIC, b"src"), ("cp-mine", b"u")],
    }
    records = [Rec("t", o, headers=headers.get(o)) for o in range(5)]
    rig.core.intake_batch(records + [Rec("t", o, partition=1) for o in range(2)])
    # Then each partition's records are one run, and the windows and bytes count every
    # message and all its headers (on a source topic the proxy's names are the producer's
    # data, kept as record by record keeps them)
    items = list(rig.items)
    assert [item.offsets if isinstance(item, Run) else [item.offset] for item in items] == [
        [0, 1, 2, 3, 4],
        [0, 1],
    ]
    user = [("traceparent", TRACEPARENT), (H_TOPIC, b"src"), ("cp-mine", b"u")]
    third = 11 + len(TRACEPARENT) + len(H_TOPIC) + 3 + 8
    windows = [(p.tracker.in_flight, p.bytes) for p in rig.core.parts.values() if p.tracker]
    assert windows == [(5, 5 + 2 + third), (2, 2)]
    # ... and a run becomes the messages the record-by-record path makes, headers and all
    first, second = items
    assert isinstance(first, Run) and isinstance(second, Run) and second.headers is None
    assert [(d.offset, d.size, d.headers, d.origin) for d in first.deliveries()] == [
        (0, 1, [], Origin("t", 0, 0, 7, 0)),
        (1, 1, [], Origin("t", 0, 1, 7, 0)),
        (2, 3, [("h", b"x")], Origin("t", 0, 2, 7, 0)),
        (3, 1 + third, user, Origin("t", 0, 3, 7, 0)),
        (4, 1, [], Origin("t", 0, 4, 7, 0)),
    ]


def test_a_run_with_headers_goes_out_as_message_by_message() -> None:
    # Given the same records with headers taken as runs and as messages
    records = [
        Rec("t", o, headers=HEADERS[o % len(HEADERS)], key=b"k" if o % 2 else None)
        for o in range(12)
    ]
    runs, messages = RunRig(100, 1 << 20, True), RunRig(100, 1 << 20, False)
    for rig in (runs, messages):
        rig.core.intake_batch(records)
    assert [type(item).__name__ for item in runs.items] == ["Run"]
    # When calls of 5 messages take them (the run split twice, its headers with it)
    for _ in range(3):
        # Then each request is the same bytes: every message's user headers, in order
        assert runs.call(BatchLimits(5, 1 << 20), None) == messages.call(
            BatchLimits(5, 1 << 20), None
        )
    assert not runs.items and runs.commits() == messages.commits() == [(0, 12, "", None)]
    # (and the requests carry them)
    again = RunRig(100, 1 << 20, True)
    again.core.intake_batch(records)
    decoded = handler_pb2.HandleMessageBatchRequest.FromString(
        again.call(BatchLimits(12, 1 << 20), None)
    ).messages
    assert [[(h.key, h.value) for h in m.headers] for m in decoded][1:4] == [
        [("h", b"xxx")],
        [("traceparent", TRACEPARENT), ("cp-mine", b"u")],
        [(H_TOPIC, b"src"), ("h", b"y"), (H_ATTEMPT, b"2")],
    ]


def _makes_a_run_with_headers(
    steps: list[tuple[int, int, int, int, int, bytes | None, int]],
) -> bool:
    rig = RunRig(8, 2500, True)
    rig.core.intake_batch(_batches(steps, [])[0])
    return any(isinstance(i, Run) and i.count > 1 and i.headers for i in rig.items)


def test_the_property_tests_records_make_runs_with_headers() -> None:
    # Given the records of the property tests above / Then some make a run holding records
    # with headers (their headers compared with message by message there)
    assert _makes_a_run_with_headers(find(records_strategy, _makes_a_run_with_headers))


def test_a_partition_without_a_committed_offset_takes_its_first_batch_as_a_run() -> None:
    # Given a partition assigned without a committed offset (a new group) in a core handing
    # out runs, and the same in a core taking each record on its own
    runs, one = RunRig(window=100, budget=1 << 20, runs=True), Rig()
    setattr(one.core, "_plain", lambda _part: False)  # noqa: B010 (every record on its own)
    for rig in (runs, one):
        rig.core.assign("t", 2, None, "")
    # When its first batch brings 4 records
    records = [Rec("t", o, partition=2) for o in range(10, 14)]
    runs.core.intake_batch(records)
    for record in records:
        one.core.intake(record)
    # Then the first record made the window and went alone, the other three as a run, and
    # the windows, backlogs and bytes are those of record by record
    assert [(type(d).__name__, d.count) for d in runs.items] == [("Delivery", 1), ("Run", 3)]
    assert [d.offset for d in expand(runs.items)] == [10, 11, 12, 13]
    assert runs.state() == one.state()


def test_a_run_is_begun_and_finished_as_one() -> None:
    # Given a run of 4 messages taken into one call
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    rig.core.intake_batch([Rec("t", o) for o in range(4)])
    began = rig.core.begin_batch(take(rig.items, BatchLimits(10, 1000), rig.drop))
    # Then it is one item, counted as 4 calls' messages under way, with the breaker's marks
    # its messages take if they leave the fast path
    assert len(began) == 1 and rig.core.parts[("t", 0)].calls == 4
    assert [(d.openings_mark, d.successes_mark) for d in expand(began)] == [(0, 0)] * 4
    # When every answer is a plain ack / Then all 4 are done together
    assert rig.core.finish_acked(began, [ACK] * 4)
    assert rig.commits() == [(0, 4, "", None)]
    assert (rig.core.bytes, rig.core.counters.ack, rig.core.parts[("t", 0)].calls) == (0, 4, 0)


def test_a_run_with_a_failed_answer_is_decided_message_by_message() -> None:
    # Given a run of 3 messages out in one call
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    rig.core.intake_batch([Rec("t", o) for o in range(3)])
    # When the second answer is a retry / Then the acks are done, the retry waits, and the
    # commit stops before it
    rig.call(BatchLimits(10, 1000), [ACK, RETRY, ACK])
    assert [(offset, d.action.value if d else None) for _, offset, d in rig.decisions] == [
        (0, "ack"),
        (1, "retry"),
        (2, "ack"),
    ]
    assert rig.commits() == [(0, 1, rig.commits()[0][2], None)]
    assert rig.core.parts[("t", 0)].calls == 0
    # ... and the retried message comes back as a message of its own, on its second attempt
    rig.clock.advance(60.0)
    (again,) = rig.items
    assert isinstance(again, Delivery) and (again.offset, again.attempt) == (1, 2)


def test_a_run_of_a_cut_or_leaving_partition_leaves_the_fast_path() -> None:
    # Given runs of partitions 0 and 1 ready
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    rig.core.intake_batch([Rec("t", o) for o in range(4)])
    rig.core.intake_batch([Rec("t", o, partition=1) for o in range(2)])
    # When partition 0's log is cut at offset 2 and partition 1 begins leaving
    rig.core.truncated(("t", 0), 2)
    rig.core.leave(rig.core.owned([("t", 1)]))
    # Then a call takes partition 0's messages below the cut only, each a message of its
    # own, and begins none of partition 1's
    began = rig.core.begin_batch(take(rig.items, BatchLimits(10, 1000), rig.drop))
    assert [(type(d).__name__, d.part.partition, d.offset) for d in expand(began)] == [
        ("Delivery", 0, 0),
        ("Delivery", 0, 1),
    ]
    assert all(isinstance(d, Delivery) for d in began)
    assert [p.calls for p in rig.core.parts.values()] == [2, 0]


def test_the_ready_deque_counts_a_runs_messages() -> None:
    # Given a ready deque holding a run of 3 messages and a message
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    rig.core.intake_batch([Rec("t", o) for o in range(3)] + [Rec("t", 0, partition=1)])
    ready = ReadyDeque()
    ready.put_batch(list(rig.items))
    # Then it holds 4 messages, not 2 items
    assert not ready.fewer_than(4) and ready.fewer_than(5)
    # ... and shutdown empties it as messages
    assert [(d.part.partition, d.offset) for d in take_all(ready)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
    ]


def test_an_open_call_of_a_run_shows_its_first_offset() -> None:
    # Given a batch call under way for 10 s with a run of partition 0 (offsets 3-5) and a
    # message of partition 1
    rig = RunRig(window=100, budget=1 << 20, runs=True)
    rig.core.intake_batch([Rec("t", o) for o in range(3, 6)] + [Rec("t", 7, partition=1)])
    push = object.__new__(BatchPush)  # (only its open calls and clock are read)
    push.open = {OpenCall(cast(Any, None), 5.0): list(rig.items)}
    push._clock = lambda: 15.0
    # Then the operator's picture shows each partition's oldest offset out and its age
    assert push.oldest() == {("t", 0): (3, 10.0, ""), ("t", 1): (7, 10.0, "")}
