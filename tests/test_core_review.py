"""Five schedules a review of the core found (issue 28), each at the fastest level that shows
it: two losses around log truncation, two stalls of the byte budget, and a batch protocol
error retried for ever; plus the review's smaller findings (uncapped tier waits, a stale
retry timer). The same rules run under the seeded schedules of tests/sim, which now produce
each of these situations at random (tests/test_simulation.py)."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import grpc
import pytest

from consumer_proxy import wire
from consumer_proxy.config import (
    BackoffConfig,
    DeliveryConfig,
    RetryTopicConfig,
)
from consumer_proxy.core.batching import PROTOCOL_ERROR, BatchLimits, classify_batch, take
from consumer_proxy.core.codec import AckState, decode, encode
from consumer_proxy.core.decision import Action, Evidence, Policy, decide
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.records import Origin, dlq_headers, retry_headers
from consumer_proxy.core.tracker import PartitionTracker
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.core import ACK, WALL_CLOCK_START, CoreRig
from tests.support.records import Rec, foreign_ack_state

C = grpc.StatusCode
CLASSIFY = Classifier()
FAIL = CLASSIFY.from_status(C.INTERNAL, "flaky")
BACKOFF = BackoffConfig(initial_ms=10, max_ms=100, jitter=0.0)
HOUR_MS = 3_600_000


class Rig(CoreRig):
    """A PartitionSet on a virtual clock whose emitted messages wait in ``ready``."""

    def __init__(self, tiers_ms: tuple[int, ...] = (), **delivery: Any) -> None:
        self.tier_topics = [f"g.retry.{n}" for n in range(1, len(tiers_ms) + 1)]
        super().__init__(
            DeliveryConfig(
                max_attempts=5,
                backoff=BACKOFF,
                retry_topics=[RetryTopicConfig(delay_ms=d) for d in tiers_ms],
                **delivery,
            ),
            tps=[("t", 0)] + [(topic, 0) for topic in self.tier_topics],
            retry_topics=self.tier_topics,
            start=WALL_CLOCK_START,  # tier due times are wall-clock
        )

    def push(self, result: Classification = ACK) -> Any:
        return self.finish_next(result)[1]

    def ack_all(self) -> None:
        while self.ready:
            self.push(ACK)

    def committable(self, topic: str = "t") -> int:
        tracker = self.core.parts[(topic, 0)].tracker
        assert tracker is not None
        return tracker.committable()

    def held_bytes(self) -> int:
        """What the core holds: the bytes of every message not yet given back."""
        return sum(p.bytes for p in self.core.parts.values())


# -- bug 1: positions read before a cut -------------------------------------------------------


def test_a_position_read_before_a_log_cut_never_moves_the_commit_past_the_cut() -> None:
    # Given a partition fetched, acked and positioned at 100 (the shell's reading no. 1)
    rig = Rig()
    for offset in range(100):
        rig.core.intake(Rec("t", offset, epoch=5))
    rig.ack_all()
    rig.core.skip_unfetchable({("t", 0): 100}, reading=1)
    assert rig.committable() == 100
    # When an unclean election cuts the log at 60 (librdkafka seeks back silently) and the
    # records written at 60.. in the new epoch are fetched and acked
    for offset in range(60, 70):
        rig.core.intake(Rec("t", offset, epoch=6))
    rig.ack_all()
    # ... while the shell still holds the positions it read before the cut (reading 1)
    rig.core.skip_unfetchable({("t", 0): 100}, reading=1)
    # Then the commit stops after what was fetched since the cut: 70..99 are not skipped
    assert rig.committable() == 70
    # And a position read after the cut is believed again (markers skipped at 70..71)
    rig.core.skip_unfetchable({("t", 0): 72}, reading=2)
    assert rig.committable() == 72


def test_a_position_read_before_an_assignment_is_not_believed_for_it() -> None:
    # Given a reading taken while the partition was owned before (position 100)
    rig = Rig()
    rig.core.skip_unfetchable({("t", 0): 100}, reading=3)
    # When the partition is assigned again at its committed offset 40
    rig.core.assign("t", 0, 40, "")
    rig.core.skip_unfetchable({("t", 0): 100}, reading=3)
    # Then that old reading does not move the commit; the next reading does
    assert rig.committable() == 40
    rig.core.skip_unfetchable({("t", 0): 41}, reading=4)
    assert rig.committable() == 41


# -- bug 2: a restored ack state across an unclean election ----------------------------------


def test_a_restored_ack_state_never_commits_past_offsets_not_fetched_again() -> None:
    # Given member A's commit at 100 with [100 pending][101..200 done] in leader epoch 5
    state = AckState(100, (1, 100), epoch=5)
    tracker = PartitionTracker(100, 1000, state)
    # When member B re-fetches 100..149 (epoch 5; an unclean election cut the log at 150 and
    # wrote new records there in epoch 6) and acks 100
    for offset in range(100, 150):
        tracker.saw_epoch(offset, 5)
        assert tracker.track(offset) is (offset == 100)
    tracker.done(100)
    # Then the commit stops at what was fetched: 150.. may hold records no one has seen
    assert tracker.committable() == 150
    # And the record at 150, written in epoch 6, drops the state and is delivered
    tracker.saw_epoch(150, 6)
    assert tracker.track(150) is True
    assert tracker.committable() == 150


def test_a_restored_ack_state_still_travels_in_the_metadata_until_fetched_again() -> None:
    # (a second rebalance soon after the first forgets no ack)
    state = AckState(100, (1, 100), epoch=5)
    tracker = PartitionTracker(100, 1000, state)
    tracker.saw_epoch(100, 5)
    tracker.track(100)
    tracker.done(100)
    meta, whole = tracker.metadata()
    assert whole and tracker.committable() == 101
    # (101 itself is done: the state starts with an empty pending run)
    carried = decode(meta)
    assert carried.base == 101 and carried.runs == (0, 100) and carried.epoch == 5
    assert all(carried.is_done(o) for o in range(101, 201)) and not carried.is_done(201)
    assert PartitionTracker(101, 1000, carried).track(101) is False


# -- bug 3: bytes of messages a cut made stale -----------------------------------------------


def test_messages_a_cut_makes_stale_in_the_ready_queue_give_their_bytes_back() -> None:
    # Given ten ready messages holding the group's whole byte budget
    rig = Rig(max_in_flight_bytes=1024)
    for offset in range(10):
        rig.core.intake(Rec("t", offset, value=b"v" * 103))
    assert rig.core.bytes == 1030 and len(rig.ready) == 10
    # When the log is cut at 0 and a new record is fetched there
    rig.core.intake(Rec("t", 0, epoch=1, value=b"v" * 103))
    stale = [rig.ready.popleft() for _ in range(10)]
    # Then the workers skip the stale ones (unary: begin; batch: take) and every byte of
    # theirs comes back: the group is not over budget, nothing stays paused
    for delivery in stale[:5]:
        assert not rig.core.begin(delivery)
    batch = take(deque(stale[5:]), BatchLimits(50, 1000), rig.core.drop_stale)
    assert batch == []
    assert rig.core.bytes == 0 == rig.held_bytes()
    assert rig.core.pause_plan().paused == 0  # the new record waited in the backlog
    rig.push(ACK)
    assert rig.core.bytes == 0 and rig.committable() == 1


def test_messages_waiting_for_a_retry_when_the_log_is_cut_give_their_bytes_back_at_once() -> None:
    rig = Rig(head_block_ms=1000)
    for offset in range(3):
        rig.core.intake(Rec("t", offset))
    assert rig.push(FAIL).action is Action.RETRY  # offset 0 waits for its retry (10 ms)
    rig.clock.run_until(rig.clock.now + 0.005)
    # When the log is cut at 0 and a new message arrives at 0 and fails too
    rig.core.intake(Rec("t", 0, epoch=1))
    assert rig.core.bytes == 3  # the stale retry was given back at once
    _, _, new = rig.ready
    rig.ready.clear()
    rig.ready.append(new)
    rig.push(FAIL)
    # Then the new message's retry entry stays its own after the stale timer's time
    rig.clock.run_until(rig.clock.now + 0.007)
    part = rig.core.parts[("t", 0)]
    assert part.retrying[0][0] is new


# -- bug 4: retry tier records waiting for their due time ------------------------------------


def _tier_record(offset: int, due_at_ms: int, topic: str = "g.retry.1") -> Rec:
    headers = retry_headers(
        [],
        Origin("t", 0, offset, 1000, 0),
        attempt=1,
        status="INTERNAL",
        reason="flaky",
        endpoint="e",
        group="g",
        tier=1,
        due_at_ms=due_at_ms,
    )
    return Rec(topic, offset, headers=headers, value=b"x" * 256)


def test_tier_records_waiting_for_their_due_time_never_hold_the_source_back() -> None:
    # Given a one-hour tier whose fetched records fill max_in_flight_bytes (1 KiB)
    rig = Rig(tiers_ms=(HOUR_MS,), max_in_flight_bytes=1024)
    due = int(rig.clock.now * 1000) + HOUR_MS
    for offset in range(10):
        rig.core.intake(_tier_record(offset, due))
    assert rig.ready == deque()
    # When source records arrive
    for offset in range(20):
        rig.core.intake(Rec("t", offset))
    # Then they are delivered and committed at their normal pace; only the tier waits
    plan = rig.core.pause_plan()
    assert ("t", 0) not in plan.pause and ("g.retry.1", 0) in plan.pause
    rig.ack_all()
    assert rig.committable() == 20


def test_tier_records_have_a_byte_budget_of_their_own() -> None:
    rig = Rig(tiers_ms=(HOUR_MS,), max_in_flight_bytes=1024)
    due = int(rig.clock.now * 1000) + HOUR_MS
    for offset in range(10):
        rig.core.intake(_tier_record(offset, due))
    # The tier holds at most its budget; the rest waits in the backlog, its partition paused
    tier = rig.core.parts[("g.retry.1", 0)]
    assert tier.bytes == 1024 and len(tier.backlog) == 6


def test_a_retry_after_beyond_the_last_tier_delay_is_capped_by_it() -> None:
    policy = Policy(max_attempts=9, backoff=BACKOFF, tiers_ms=(2000, 5000))
    huge = CLASSIFY.from_response(
        handler_pb2.HandleMessageResponse(
            action=handler_pb2.HandleMessageResponse.RETRY, retry_after_ms=2**63 - 1
        )
    )
    decision = decide(0, 0, huge, Evidence(), policy, random.Random(1))
    assert decision.action is Action.TIER and decision.delay_s == 5.0


def test_a_forged_due_time_waits_at_most_the_last_tier_delay() -> None:
    rig = Rig(tiers_ms=(2000,))
    rig.core.intake(_tier_record(0, 2**62))  # a cp-due-at millions of years ahead
    rig.clock.run_until(rig.clock.now + 2.0)
    assert len(rig.ready) == 1


_ORIGIN = {
    "cp-original-topic": b"t",
    "cp-original-partition": b"0",
    "cp-original-offset": b"5",
    "cp-original-timestamp": b"1000",
    "cp-attempt": b"1",
}


@pytest.mark.parametrize(
    ("topic", "forged"),
    [
        ("g.redrive", {"cp-attempt": b"2147483647"}),
        ("g.redrive", {"cp-original-partition": b"2147483648"}),
        ("g.redrive", {"cp-original-offset": b"9223372036854775808"}),
        ("g.redrive", {"cp-original-timestamp": b"9223372036854775808"}),
        ("g.redrive", {"cp-original-offset": b"-1"}),
        ("g.retry.1", {"cp-attempt": b"2147483647", "cp-due-at": b"0"}),
        ("g.retry.1", {"cp-due-at": b"9" * 400}),
        ("g.retry.1", {"cp-due-at": b"-9" + b"9" * 400}),
    ],
    ids=[
        "attempt-int32-max",
        "partition-over-int32",
        "offset-over-int64",
        "timestamp-over-int64",
        "offset-negative",
        "tier-attempt-int32-max",
        "tier-due-at-400-digits",
        "tier-due-at-minus-400-digits",
    ],
)
def test_forged_origin_headers_out_of_range_are_delivered_never_raised_on(
    topic: str, forged: dict[str, bytes]
) -> None:
    # Given a record on the redrive or a tier topic whose cp-* headers a producer forged with
    # numbers no Kafka coordinate or protobuf field holds
    rig = CoreRig(
        DeliveryConfig(max_attempts=5, retry_topics=[RetryTopicConfig(delay_ms=2000)]),
        tps=[("t", 0), ("g.redrive", 0), ("g.retry.1", 0)],
        retry_topics=["g.retry.1"],
        start=WALL_CLOCK_START,
    )
    headers = list({**_ORIGIN, **forged}.items())
    # When it is taken in (and waits out a tier's delay, at most the last tier's)
    rig.core.intake(Rec(topic, 0, headers=headers))
    rig.clock.run_until(rig.clock.now + 2.0)
    # Then it is handed over for delivery, and its request builds, unary and in a batch
    (delivery,) = rig.ready
    unary = wire.unary_request(delivery, "g")
    batch = handler_pb2.HandleMessageBatchRequest.FromString(wire.batch_request([delivery], "g"))
    assert unary.message == batch.messages[0]
    assert 1 <= delivery.attempt < 2**31


def test_commit_metadata_of_more_runs_than_a_window_holds_is_not_restored() -> None:
    # Given a partition committed at 100 whose metadata someone else wrote: a valid state of
    # 400,000 runs (offset 101 done, 102 not, ...) in under 4 KiB, far more than a window of
    # 1,000 offsets makes
    rig = CoreRig(DeliveryConfig(max_in_flight=1000), tps=[], start=WALL_CLOCK_START)
    bomb = foreign_ack_state(100, [1] * 400_000)
    assert len(bomb) < 4096
    # When it is assigned, and the record at 101 is fetched
    rig.core.assign("t", 0, 100, bomb)
    rig.core.intake(Rec("t", 101))
    # Then the state was not restored (its runs never built): 101 is delivered, not skipped
    assert [d.offset for d in rig.ready] == [101]


# -- bug 5: a batch answer of the wrong length ----------------------------------------------


def test_a_message_whose_batch_answer_always_has_the_wrong_length_is_dead_lettered() -> None:
    # Given a service whose answer has one result too few whenever message 0 is in the batch
    rig = Rig()
    for offset in range(5):
        rig.core.intake(Rec("t", offset))
    limits = BatchLimits(50, 10_000)
    dead: list[str] = []
    for _ in range(50):
        rig.clock.run_until(rig.clock.now + 1.0)  # retry timers
        batch = take(rig.ready, limits, rig.core.drop_stale)
        if not batch:
            break
        assert all(rig.core.begin(d) for d in batch)
        bad = any(d.offset == 0 for d in batch)
        answers = [handler_pb2.HandleMessageResponse() for _ in batch[: len(batch) - bad]]
        outcome = classify_batch(
            CLASSIFY, handler_pb2.HandleMessageBatchResponse(results=answers), len(batch)
        )
        for delivery, result in zip(batch, outcome.results, strict=True):
            decision = rig.core.finish(delivery, result, probe=False)
            if decision is not None and decision.action is Action.DEAD_LETTER:
                dead.append(decision.reason)
                rig.core.dead_lettered(delivery)
    # Then its batch was split: the others were acked, and it went alone, where the wrong
    # answer counted against it, until max_attempts sent it to the DLQ
    assert len(dead) == 1 and "answered 0 results for 1 message" in dead[0]
    assert rig.committable() == 5 and rig.core.bytes == 0


def test_a_wrong_length_answer_for_a_batch_of_one_is_that_messages_counted_failure() -> None:
    outcome = classify_batch(
        CLASSIFY,
        handler_pb2.HandleMessageBatchResponse(results=[handler_pb2.HandleMessageResponse()] * 2),
        1,
    )
    [result] = outcome.results
    assert result.counted and not result.service_failure and result.status == PROTOCOL_ERROR
    assert outcome.breaker is None  # it still says nothing about the service's health


def test_a_restored_ack_state_over_the_budget_keeps_fetching_its_range() -> None:
    # Given a partition whose committed ack state has many holes (written by a pod with a
    # large metadata budget: every other run of offsets is done)
    rng = random.Random(1)
    runs = tuple(rng.randint(1, 3) for _ in range(100))  # pending, done, pending, done, ...
    state = encode(AckState(0, runs))
    assert len(state) > 64
    # When a pod with a 64-byte budget takes it over and commits before fetching anything
    rig = Rig(metadata_budget_bytes=64)
    rig.core.assign("t", 1, 0, state)
    rig.core.commit_plan()
    part = rig.core.parts[("t", 1)]
    assert part.meta_over_budget and part.tracker is not None and part.tracker.restoring
    # Then it is not paused for its ack state, also once it fetched part of the range: only
    # fetching the restored range again can shrink that state (a stall the simulation found)
    for offset in range(3):
        rig.core.intake(Rec("t", offset, partition=1))
        rig.core.pause_plan()
        assert not part.paused, rig.core.views()


def test_a_group_consuming_another_groups_dlq_sees_the_dead_letters_cp_headers() -> None:
    # Given group g consuming "billing.dlq" as a source topic, which the config allows
    # (ProxyConfig._topics_of_one_group lets a DLQ topic be another group's source), holding a
    # dead letter of group billing
    from consumer_proxy.config import ProxyConfig

    ProxyConfig.model_validate({
        "kafka": {"bootstrap_servers": "k:9092"},
        "groups": [
            {"name": "billing", "topics": ["trips"], "service": {"endpoints": ["a:1"]}},
            {"name": "g", "topics": ["billing.dlq"], "service": {"endpoints": ["b:1"]}},
        ],
    })  # fmt: skip
    rig = CoreRig(
        DeliveryConfig(
            max_attempts=5, backoff=BackoffConfig(initial_ms=100, max_ms=1000, jitter=0.0)
        ),
        tps=(("billing.dlq", 0),),
    )
    headers = dlq_headers(
        [("user", b"x")], Origin("t", 0, 9, 1000, 0), attempt=3, status="INVALID_ARGUMENT",
        reason="bad schema", endpoint="e", group="billing",
    )  # fmt: skip
    rig.core.intake(Rec("billing.dlq", 0, headers=headers))

    # When it is delivered to g's service
    [delivery] = rig.ready

    # Then the record's headers reach the service as they are in the topic: the reason,
    # status and origin group billing wrote are g's data, not g's own metadata
    assert delivery.headers == [
        (k, v if isinstance(v, bytes) else (v or "").encode()) for k, v in headers
    ]
