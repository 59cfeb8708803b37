"""The ordering gate (core/ordering.py) and its hooks in PartitionSet, without a broker.

The gate alone is checked against a reference model over random operation sequences
(Hypothesis); the PartitionSet examples follow single messages through retries, dead letters,
pauses, revokes and log cuts in key and partition mode. The same decisions run under the
seeded schedules of tests/sim (tests/test_simulation.py) with the order invariants checked at
every step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from consumer_proxy.config import BackoffConfig, DeliveryConfig
from consumer_proxy.core.decision import Action
from consumer_proxy.core.ordering import KeyGate
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.partitions import Delivery, backlog_bound
from consumer_proxy.core.records import H_ORDERING, Origin, dlq_headers
from consumer_proxy.proto.v1 import handler_pb2
from tests.sim.world import Msg, Record
from tests.support.core import CoreRig

CLASSIFIER = Classifier()
ACK = CLASSIFIER.from_response(handler_pb2.HandleMessageResponse())
FLAKY = CLASSIFIER.from_status(grpc.StatusCode.INTERNAL, "flaky")
POISON = CLASSIFIER.from_status(grpc.StatusCode.INVALID_ARGUMENT, "poison")

# --------------------------------------------------------------------------- the gate alone


@st.composite
def gate_ops(draw: Any) -> list[tuple[str, int]]:
    """admit(key) / release the item out for key / prune items with an odd id."""
    ops = st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 4)),
        st.tuples(st.just("release"), st.integers(0, 4)),
        st.tuples(st.just("prune"), st.just(0)),
    )
    result: list[tuple[str, int]] = draw(st.lists(ops, max_size=80))
    return result


@given(gate_ops())
@settings(max_examples=400, deadline=None)
def test_the_gate_lets_one_item_per_key_out_in_arrival_order(ops: list[tuple[str, int]]) -> None:
    gate: KeyGate[int] = KeyGate()
    model: dict[int, deque[int]] = {}  # key -> items not finished, the first one out
    out: dict[int, int] = {}  # what the gate said is out
    went_out: dict[int, list[int]] = {}
    pruned: set[int] = set()
    next_id = 0
    for op, key in ops:
        if op == "admit":
            item = next_id
            next_id += 1
            lane = model.setdefault(key, deque())
            lane.append(item)
            if gate.admit(key, item):
                assert len(lane) == 1, "went out while another item of its key was out"
                out[key] = item
                went_out.setdefault(key, []).append(item)
        elif op == "release":
            lane = model.get(key) or deque()
            if not lane:
                assert gate.release(key, -1) is None
                continue
            item = lane.popleft()
            nxt = gate.release(key, item)
            assert nxt == (lane[0] if lane else None)
            if nxt is not None:
                out[key] = nxt
                went_out.setdefault(key, []).append(nxt)
            else:
                out.pop(key, None)
        else:
            dropped, promoted = gate.prune(lambda i: i % 2 == 1)
            for key_, lane in model.items():
                head_gone = bool(lane) and lane[0] % 2 == 1
                kept = deque(i for i in lane if i % 2 == 0)
                model[key_] = kept
                if head_gone and kept:
                    assert kept[0] in promoted
                    went_out.setdefault(key_, []).append(kept[0])
            pruned |= set(dropped)
            assert all(i % 2 == 1 for i in dropped)
        # At every step: the gate's item out per key is the head of the model's lane.
        for key_, lane in model.items():
            assert gate.out(key_) == (lane[0] if lane else None)
            assert gate.waiting(key_) == max(0, len(lane) - 1)
        assert gate.held == sum(max(0, len(lane) - 1) for lane in model.values())
    # Per key, items went out in arrival (admit) order.
    for items in went_out.values():
        assert items == sorted(items)


def test_the_gate_backlog_counts_keys_and_the_longest() -> None:
    gate: KeyGate[str] = KeyGate()
    for item in ["a1", "a2", "a3", "b1", "b2", "c1"]:
        gate.admit(item[0], item)
    assert gate.backlog() == (2, 2)  # a waits with 2, b with 1, c has none waiting
    assert gate.keys_out == 3 and gate.held == 3
    assert gate.release("a", "a1") == "a2"
    assert gate.release("a", "a1") is None  # not the one out: ignored
    assert gate.backlog() == (2, 1)


# --------------------------------------------------------------------------- PartitionSet


class Harness(CoreRig):
    """One PartitionSet with a virtual clock; ``ready`` is what it emitted to the workers."""

    def __init__(self, ordering: str, max_in_flight: int = 100, partitions: int = 1) -> None:
        super().__init__(
            DeliveryConfig(
                max_in_flight=max_in_flight,
                backoff=BackoffConfig(initial_ms=100, max_ms=100, jitter=0.0),
                ordering=ordering,
            ),
            tps=[("t", p) for p in range(partitions)],
        )
        self.next = [0] * partitions

    def produce(self, keys: str, partition: int = 0) -> None:
        """One record per character; '-' is a record without a key."""
        for ch in keys:
            key = None if ch == "-" else ch.encode()
            offset = self.next[partition]
            self.next[partition] += 1
            self.core.intake(Record("t", partition, offset, Msg(offset, "ok", key=key), 0))

    def take(self) -> list[Delivery]:
        """Every delivery emitted so far, each begun (a worker took it)."""
        taken = list(self.ready)
        self.ready.clear()
        for delivery in taken:
            assert self.core.begin(delivery)
        return taken

    def finish(self, delivery: Delivery, result: Classification) -> Action | None:
        decision = self.core.finish(delivery, result, probe=False)
        return None if decision is None else decision.action


def names(deliveries: list[Delivery]) -> list[str]:
    return [f"{(d.key or b'-').decode()}{d.offset}" for d in deliveries]


def test_none_emits_everything_at_once() -> None:
    h = Harness("none")
    h.produce("aab-")
    assert names(h.take()) == ["a0", "a1", "b2", "-3"]


def test_key_mode_lets_one_per_key_out_and_the_next_after_the_ack() -> None:
    # Given key-ordered delivery and records a a b a - -
    h = Harness("key")
    h.produce("aaba--")
    # Then the first of each key (and of the no-key lane) goes out, in parallel
    first = h.take()
    assert names(first) == ["a0", "b2", "-4"]
    # When a's first message is acked, its second goes out; nothing else does
    h.finish(first[0], ACK)
    assert names(h.take()) == ["a1"]
    assert h.core.key_backlog().keys == 2  # a (a3) and the no-key lane (-5) still wait
    # and b's ack frees nothing (b has no more)
    h.finish(first[1], ACK)
    assert h.take() == []


def test_a_retry_holds_back_its_key_and_only_its_key() -> None:
    # Given a0 a1 b2 b3 out in key mode
    h = Harness("key")
    h.produce("aabb")
    a0, b2 = h.take()
    # When a0 fails and waits for its retry, and b2 is acked
    assert h.finish(a0, FLAKY) is Action.RETRY
    h.finish(b2, ACK)
    # Then b3 goes out while a1 keeps waiting behind a0's retry
    assert names(h.take()) == ["b3"]
    h.clock.run_until(h.clock.now + 1.0)
    assert names(h.take()) == ["a0"]  # the retry itself, not a1
    h.finish(a0, ACK)
    assert names(h.take()) == ["a1"]


def test_a_dead_letter_releases_its_key_only_once_the_dlq_write_is_confirmed() -> None:
    h = Harness("key")
    h.produce("aab")
    a0, b2 = h.take()
    assert h.finish(a0, POISON) is Action.DEAD_LETTER
    h.finish(b2, ACK)
    assert h.take() == []  # a1 waits while the DLQ write is pending
    assert h.core.key_backlog().longest == 1
    h.core.dead_lettered(a0)
    assert names(h.take()) == ["a1"]


def test_an_abandoned_dlq_write_keeps_its_key_held() -> None:
    h = Harness("key")
    h.produce("aa")
    (a0,) = h.take()
    h.finish(a0, POISON)
    h.core.dead_letter_abandoned(a0)
    assert h.take() == []  # not done: the next owner dead-letters it first


def test_partition_mode_is_one_message_per_partition_in_offset_order() -> None:
    h = Harness("partition", partitions=2)
    h.produce("ab-a", partition=0)
    h.produce("cc", partition=1)
    order = []
    while True:
        out = h.take()
        if not out:
            break
        assert len({d.part.partition for d in out}) == len(out), "two of a partition out"
        for delivery in out:
            order.append((delivery.part.partition, delivery.offset))
            h.finish(delivery, ACK)
    assert [o for p, o in order if p == 0] == [0, 1, 2, 3]
    assert [o for p, o in order if p == 1] == [0, 1]


def test_a_window_full_of_one_keys_backlog_pauses_the_partition() -> None:
    # Given a window of 4 and a hot key
    h = Harness("key", max_in_flight=4)
    h.produce("h" * (4 + backlog_bound(4)))
    # Then one message is out, three wait in the window, the rest is backlog (at its bound):
    # paused
    out = h.take()
    assert names(out) == ["h0"]
    assert h.core.key_backlog().held == 3
    plan = h.core.pause_plan()
    assert plan.pause == [("t", 0)]
    # And acks drain it in order
    seen = []
    while out:
        for delivery in out:
            seen.append(delivery.offset)
            h.finish(delivery, ACK)
        out = h.take()
    assert seen == list(range(4 + backlog_bound(4)))
    assert h.core.pause_plan().resume == [("t", 0)]


def test_a_revoked_partition_restarts_its_keys_from_the_first_not_done() -> None:
    # Given a0 acked, a1 in flight, a2 waiting
    h = Harness("key")
    h.produce("aaa")
    (a0,) = h.take()
    h.finish(a0, ACK)
    (a1,) = h.take()
    part = h.core.parts[("t", 0)]
    commit = h.core.final_commit(part)
    assert commit is not None and commit.offset == 1
    # When the partition is revoked (a1's late result is ignored) and assigned again
    h.core.forget(part)
    assert h.finish(a1, ACK) is None
    h.core.assign("t", 0, commit.offset, commit.metadata)
    h.next[0] = 1
    h.produce("aa")
    # Then a1 is delivered again before a2
    assert names(h.take()) == ["a1"]


def test_a_log_cut_below_a_waiting_message_forgets_it_and_frees_its_key() -> None:
    h = Harness("key")
    h.produce("aab")
    a0, _b2 = h.take()
    h.finish(a0, ACK)
    (a1,) = h.take()  # a1 out, in flight
    # When the log is cut at offset 1 (an unclean leader election) and refilled
    h.core.truncated(("t", 0), 1)
    h.next[0] = 1
    h.produce("a")
    # Then the new record at offset 1 goes out: the cut a1 no longer holds key a back
    assert names(h.take()) == ["a1"]
    assert h.finish(a1, ACK) is None  # the old a1's result is stale
    assert h.core.key_backlog().held == 0


def test_cp_ordering_is_on_dlq_records_of_ordered_groups_only() -> None:
    origin = Origin("t", 0, 5, 1, 0)
    common: dict[str, Any] = dict(attempt=1, status="S", reason="r", endpoint="e", group="g")
    keyed = dict(dlq_headers([], origin, ordering="key", **common))
    assert keyed[H_ORDERING] == b"key"
    assert H_ORDERING not in dict(dlq_headers([], origin, ordering="none", **common))
    assert H_ORDERING not in dict(dlq_headers([], origin, **common))


def test_ordering_is_none_by_default_and_checked() -> None:
    assert DeliveryConfig().ordering == "none"
    assert DeliveryConfig(ordering="partition").ordering == "partition"
    with pytest.raises(ValidationError):
        DeliveryConfig(ordering="keys")
