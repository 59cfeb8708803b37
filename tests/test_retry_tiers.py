"""Retry tiers in the pure core, without a broker: which tier, the due time, tier vs memory vs
DLQ (core/decision.py), a tier write holding the source offset until confirmed, and a retry
tier record held until due with its partition paused (core/partitions.py). The same decisions
run under the seeded schedules of tests/sim (tests/test_simulation.py)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from consumer_proxy import cli
from consumer_proxy.config import (
    BackoffConfig,
    DeliveryConfig,
    GroupConfig,
    RetryTopicConfig,
)
from consumer_proxy.core.decision import Action, Evidence, Policy, decide, unblock
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.partitions import SOURCE_REDRIVE, SOURCE_RETRY, Delivery, backlog_bound
from consumer_proxy.core.records import (
    H_ATTEMPT,
    H_DUE_AT,
    H_RETRY_TIER,
    Origin,
    dlq_headers,
    due_at_from_headers,
    origin_from_headers,
    retry_headers,
    split_headers,
)
from consumer_proxy.handler import Message
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.core import WALL_CLOCK_START, CoreRig
from tests.support.records import Rec

C = grpc.StatusCode
CLASSIFY = Classifier()
FAIL = CLASSIFY.from_status(C.INTERNAL, "flaky")
POISON = CLASSIFY.from_status(C.INVALID_ARGUMENT, "poison")
OUTAGE = CLASSIFY.from_status(C.UNAVAILABLE, "down")
ACK = CLASSIFY.from_response(handler_pb2.HandleMessageResponse())
HEALTHY = Evidence(service_answered=True)
BACKOFF = BackoffConfig(initial_ms=100, max_ms=1000, jitter=0.0)
TIERS = Policy(max_attempts=10, backoff=BACKOFF, tiers_ms=(2000, 5000), in_memory_attempts=2)


def retry_after(ms: int) -> Classification:
    response = handler_pb2.HandleMessageResponse(
        action=handler_pb2.HandleMessageResponse.RETRY, retry_after_ms=ms
    )
    return CLASSIFY.from_response(response)


def _decide(counted: int, result: Classification, policy: Policy = TIERS, tier: int = 0) -> Any:
    return decide(counted, 0, result, HEALTHY, policy, random.Random(1), tier)


# ----------------------------------------------------------------------------- the decision


def test_in_memory_attempts_come_first_then_the_first_tier() -> None:
    # Given in_memory_attempts 2: attempt 1 fails -> retried from memory
    first = _decide(0, FAIL)
    assert first.action is Action.RETRY and first.counted
    # When attempt 2 fails too, Then the message moves to tier 1 with its delay
    second = _decide(1, FAIL)
    assert second.action is Action.TIER and second.tier == 1 and second.delay_s == 2.0


def test_each_further_failure_goes_to_the_next_tier_then_the_dlq() -> None:
    from_tier_1 = _decide(2, FAIL, tier=1)
    assert from_tier_1.action is Action.TIER and from_tier_1.tier == 2
    assert from_tier_1.delay_s == 5.0
    after_last = _decide(3, FAIL, tier=2)
    assert after_last.action is Action.DEAD_LETTER and "last retry tier" in after_last.reason


def test_max_attempts_comes_first_when_it_is_lower() -> None:
    policy = Policy(max_attempts=3, backoff=BACKOFF, tiers_ms=(1000, 2000, 3000))
    assert _decide(1, FAIL, policy, tier=1).action is Action.TIER
    assert _decide(2, FAIL, policy, tier=2).action is Action.DEAD_LETTER


def test_the_due_delay_is_the_larger_of_the_tier_delay_and_retry_after() -> None:
    longer = _decide(1, retry_after(4_000))  # not capped by backoff.max_ms (1 s)
    assert longer.action is Action.TIER and longer.delay_s == 4.0
    # ... but by the longest tier delay (5 s here)
    assert _decide(1, retry_after(60_000)).delay_s == 5.0
    shorter = _decide(1, retry_after(10))
    assert shorter.delay_s == 2.0
    # In memory, retry_after stays capped by backoff.max_ms
    in_memory = _decide(0, retry_after(60_000))
    assert in_memory.action is Action.RETRY and in_memory.delay_s == 1.0


def test_an_outage_never_moves_a_message_to_a_tier() -> None:
    for tier in (0, 1, 2):
        decision = decide(5, 3, OUTAGE, HEALTHY, TIERS, random.Random(1), tier)
        assert decision.action is Action.RETRY and not decision.counted
    # Nor does a deadline while nothing else answers (the outage rule)
    deadline = CLASSIFY.from_status(C.DEADLINE_EXCEEDED, "slow")
    silent = Evidence(service_answered=False)
    decision = decide(1, 0, deadline, silent, TIERS, random.Random(1), 1)
    assert decision.action is Action.RETRY and not decision.counted


def test_a_poison_pill_goes_straight_to_the_dlq_and_without_tiers_nothing_changes() -> None:
    assert _decide(0, POISON).action is Action.DEAD_LETTER
    plain = Policy(max_attempts=3, backoff=BACKOFF)
    assert _decide(0, FAIL, plain).action is Action.RETRY
    assert _decide(2, FAIL, plain).action is Action.DEAD_LETTER


# ----------------------------------------------------------------------------- the headers


def test_retry_headers_carry_the_dlq_headers_the_tier_and_the_due_time() -> None:
    origin = Origin("orders", 3, 42, 1000, 0)
    headers = retry_headers(
        [("user", b"x")],
        origin,
        attempt=2,
        status="INTERNAL",
        reason="flaky",
        endpoint="e",
        group="g",
        tier=1,
        due_at_ms=123456,
        now_ms=5,
    )
    user, ours = split_headers(headers)
    assert user == [("user", b"x")]
    assert ours[H_RETRY_TIER] == "1" and ours[H_DUE_AT] == "123456" and ours[H_ATTEMPT] == "2"
    assert origin_from_headers(ours) == Origin("orders", 3, 42, 1000, 2)
    assert due_at_from_headers(ours) == 123456
    assert due_at_from_headers({H_DUE_AT: "x"}) == 0 == due_at_from_headers({})


# ----------------------------------------------------------------------------- PartitionSet


class TierRecord:
    """A fetched record of any topic with explicit headers."""

    def __init__(self, topic: str, offset: int, headers: Any = None) -> None:
        self._topic = topic
        self._offset = offset
        self._headers = headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return b"k"

    def value(self) -> bytes | None:
        return b"v"

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 7)

    def leader_epoch(self) -> int | None:
        return None


class Rig(CoreRig):
    """A PartitionSet with tiers of 2 s and 5 s, in_memory_attempts 1, on a virtual clock."""

    def __init__(self, **delivery: Any) -> None:
        super().__init__(
            DeliveryConfig(
                **{
                    "max_attempts": 5,
                    "backoff": BACKOFF,
                    "retry_topics": [
                        RetryTopicConfig(delay_ms=2000),
                        RetryTopicConfig(delay_ms=5000),
                    ],
                    **delivery,
                }
            ),
            tps=(("t", 0), ("g.retry.1", 0)),
            retry_topics=["g.retry.1", "g.retry.2"],
            start=WALL_CLOCK_START,  # tier due times are wall-clock
        )

    def push(self, result: Classification) -> Any:
        return self.finish_next(result)

    def committable(self, topic: str) -> int:
        tracker = self.core.parts[(topic, 0)].tracker
        assert tracker is not None
        return tracker.committable()


def test_a_tier_write_holds_the_source_offset_until_it_is_confirmed() -> None:
    rig = Rig()
    for offset in range(3):
        rig.core.intake(TierRecord("t", offset))
    # When the first message fails and the other two are acked
    delivery, decision = rig.push(FAIL)
    rig.push(ACK)
    rig.push(ACK)
    # Then it moves to tier 1, due 2 s from now, and the commit waits for the write
    assert decision.action is Action.TIER and decision.tier == 1
    assert delivery.due_at_ms == int((rig.clock.now + 2.0) * 1000)
    assert delivery.attempt == 1  # cp-attempt: the attempts made so far
    assert rig.committable("t") == 0
    # When the write is confirmed, Then the source commit passes it at once (no waiting)
    rig.core.tier_written(delivery)
    assert rig.committable("t") == 3
    assert rig.core.counters.tier == 1


def test_an_abandoned_tier_write_leaves_the_offset_pending() -> None:
    rig = Rig()
    rig.core.intake(TierRecord("t", 0))
    delivery, _ = rig.push(FAIL)
    rig.core.tier_abandoned(delivery)
    assert rig.committable("t") == 0


def _tier_record(offset: int, due_at_ms: int, attempt: int = 1) -> TierRecord:
    origin = Origin("t", 0, 9, 1000, 0)
    headers = retry_headers(
        [],
        origin,
        attempt=attempt,
        status="INTERNAL",
        reason="flaky",
        endpoint="e",
        group="g",
        tier=1,
        due_at_ms=due_at_ms,
    )
    return TierRecord("g.retry.1", offset, headers)


def test_a_tier_record_waits_until_due_with_its_partition_paused() -> None:
    rig = Rig()
    rig.core.pause_plan()
    now_ms = int(rig.clock.now * 1000)
    # Given a record of tier 1 due in 2 s
    rig.core.intake(_tier_record(0, now_ms + 2000))
    # Then it is not emitted yet and its partition pauses
    assert not rig.ready
    plan = rig.core.pause_plan()
    assert plan.pause == [("g.retry.1", 0)]
    # When its due time comes (a timer, no polling), Then it is emitted with its origin
    rig.clock.run_until(rig.clock.now + 1.999)
    assert not rig.ready
    rig.clock.run_until(rig.clock.now + 0.002)
    [delivery] = rig.ready
    assert delivery.source == SOURCE_RETRY and delivery.attempt == 2 and delivery.tier == 1
    assert (delivery.origin.topic, delivery.origin.offset) == ("t", 9)
    assert rig.core.pause_plan().resume == [("g.retry.1", 0)]
    # When it fails again, Then it moves to tier 2 (in-memory attempts are the source's)
    _, decision = rig.push(FAIL)
    assert decision.action is Action.TIER and decision.tier == 2


def test_a_partition_waiting_for_a_due_time_does_not_make_the_intake_poll_often() -> None:
    # Given a tier partition paused because its record is due in an hour
    rig = Rig(max_in_flight=2)
    rig.core.pause_plan()
    rig.core.intake(_tier_record(0, int(rig.clock.now * 1000) + 3_600_000))
    plan = rig.core.pause_plan()
    # Then it is paused, but not waiting for room: no poll frees it (the intake polls every
    # 5 ms only for partitions the workers' progress resumes; found by the simulation's
    # hour-long tiers)
    assert plan.paused == 1 and plan.waiting == 0
    # When the source partition's window (2) and backlog (its bound: 10 windows) fill up, Then
    # that one is waiting for room
    for offset in range(2 + backlog_bound(2)):
        rig.core.intake(TierRecord("t", offset))
    plan = rig.core.pause_plan()
    assert plan.paused == 2 and plan.waiting == 1


def test_a_due_tier_record_goes_at_once_and_the_last_tier_leads_to_the_dlq() -> None:
    rig = Rig()
    rig.core.assign("g.retry.2", 0, 0, "")
    rig.core.intake(_tier_record(0, 0, attempt=2))
    [delivery] = rig.ready
    rig.ready.clear()
    assert delivery.attempt == 3
    # A record read from the last tier that fails goes to the DLQ
    headers = retry_headers(
        [],
        Origin("t", 0, 9, 1, 0),
        attempt=2,
        status="INTERNAL",
        reason="r",
        endpoint="e",
        group="g",
        tier=2,
        due_at_ms=0,
    )
    rig.core.intake(TierRecord("g.retry.2", 0, headers))
    _, decision = rig.push(FAIL)
    assert decision.action is Action.DEAD_LETTER


def test_a_revoked_tier_partition_drops_its_waiting_records() -> None:
    rig = Rig()
    rig.core.intake(_tier_record(0, int(rig.clock.now * 1000) + 5000))
    rig.core.forget(rig.core.parts[("g.retry.1", 0)])
    rig.clock.run_until(rig.clock.now + 10)
    assert not rig.ready


# ----------------------------------------------------------------------------- unblocking


def test_a_hung_head_moves_to_the_next_tier_after_head_block_ms() -> None:
    # Given a partition whose first message hangs while the two behind it are acked
    rig = Rig(head_block_ms=2000)
    for offset in range(3):
        rig.core.intake(TierRecord("t", offset))
    hung = rig.ready.popleft()
    assert rig.core.begin(hung)
    rig.push(ACK)
    rig.push(ACK)
    # When the commit has not moved for less than head_block_ms, Then nothing moves
    assert rig.core.unblock(100.0) == []
    assert rig.core.unblock(101.9) == []
    # When it has not moved for head_block_ms, Then the head moves to tier 1 as a failed
    # attempt, and its late result is ignored
    [(moved, decision)] = rig.core.unblock(102.0)
    assert moved is hung and decision.action is Action.TIER and decision.tier == 1
    assert "blocked the head" in decision.reason and moved.counted_here == 1
    assert rig.core.finish(hung, ACK, probe=False) is None
    assert rig.committable("t") == 0  # the tier write is not confirmed yet
    rig.core.tier_written(hung)
    assert rig.committable("t") == 3
    assert rig.core.counters.unblocks == 1


def test_nothing_moves_while_nothing_above_the_head_is_done() -> None:
    rig = Rig(head_block_ms=1000)
    rig.core.intake(TierRecord("t", 0))
    rig.core.intake(TierRecord("t", 1))
    for delivery in list(rig.ready):
        assert rig.core.begin(delivery)
    rig.core.unblock(0.0)
    assert rig.core.unblock(50.0) == []  # a slow partition, not a blocked one


def test_a_head_waiting_for_an_in_memory_retry_moves_and_its_timer_is_cancelled() -> None:
    rig = Rig(
        head_block_ms=1000,
        in_memory_attempts=3,
        backoff=BackoffConfig(initial_ms=60_000, max_ms=60_000),
    )
    rig.core.intake(TierRecord("t", 0))
    rig.core.intake(TierRecord("t", 1))
    _, retry = rig.push(FAIL)
    assert retry.action is Action.RETRY
    rig.push(ACK)
    rig.core.unblock(0.0)
    [(moved, decision)] = rig.core.unblock(1.0)
    assert decision.action is Action.TIER and moved.offset == 0
    rig.clock.run_until(rig.clock.now + 120)
    assert not rig.ready  # the in-memory retry does not come any more


def test_a_hung_head_during_an_outage_never_moves() -> None:
    # Given a hung head and an acked message behind it, then the service stops answering
    rig = Rig(head_block_ms=1000)
    rig.core.intake(TierRecord("t", 0))
    hung = rig.ready.popleft()
    assert rig.core.begin(hung)
    rig.core.intake(TierRecord("t", 1))
    rig.core.intake(TierRecord("t", 2))
    late = rig.ready.popleft()
    assert rig.core.begin(late)  # the service hangs from here on: nothing answers
    rig.core.finish(late, ACK, probe=False)  # (an answer the breaker did not count)
    rig.core.unblock(0.0)
    assert rig.core.unblock(60.0) == []
    # When the breaker opens, still nothing moves, even once another call succeeds
    for _ in range(30):
        rig.breaker.record(True, probe=False)
    assert rig.breaker.is_open
    assert rig.core.unblock(120.0) == []


def test_unblocking_is_bounded_per_partition_per_minute() -> None:
    rig = Rig(head_block_ms=1000, max_unblock_per_minute=1)
    for offset in range(4):
        rig.core.intake(TierRecord("t", offset))
    first, second = rig.ready.popleft(), rig.ready.popleft()
    assert rig.core.begin(first) and rig.core.begin(second)
    rig.push(ACK)
    rig.push(ACK)
    rig.core.unblock(0.0)
    [(moved, _)] = rig.core.unblock(1.0)
    rig.core.tier_written(moved)
    # The next head is blocked as well, but one move per minute is the limit
    rig.core.unblock(1.5)
    assert rig.core.unblock(30.0) == []
    [(again, _)] = rig.core.unblock(61.0)
    assert again is second


def test_the_last_tier_or_max_attempts_sends_a_blocking_head_to_the_dlq() -> None:
    policy = Policy(max_attempts=5, backoff=BACKOFF, tiers_ms=(1000,))
    assert unblock(0, 0, policy, 3.0).action is Action.TIER
    assert unblock(1, 1, policy, 3.0).action is Action.DEAD_LETTER
    assert unblock(4, 0, policy, 3.0).action is Action.DEAD_LETTER


# ----------------------------------------------------------------------------- config


def _group(**delivery: Any) -> GroupConfig:
    return GroupConfig.model_validate(
        {"name": "g", "topics": ["t"], "service": {"endpoints": ["127.0.0.1:1"]}, **delivery}
    )


def test_tier_topics_are_named_after_the_group_in_config_order() -> None:
    group = _group(delivery={"retry_topics": [{"delay_ms": 5000}, {"delay_ms": 60000}]})
    assert group.retry_topics == ["g.retry.1", "g.retry.2"]
    assert group.delivery.in_memory_attempts == 1
    assert _group().retry_topics == []


@pytest.mark.parametrize(
    "delivery",
    [
        {"retry_topics": [{"delay_ms": 0}]},
        {"retry_topics": [{}]},
        {"in_memory_attempts": 0},
        {"retry_topics": [{"delay_ms": 10}], "ordering": "key"},
        {"head_block_ms": 1000},
        {"retry_topics": [{"delay_ms": 10}], "head_block_ms": 1},
    ],
    ids=[
        "zero-delay",
        "no-delay",
        "no-memory-attempt",
        "with-ordering",
        "unblock-without-tiers",
        "unblock-too-soon",
    ],
)
def test_bad_tier_settings_are_rejected(delivery: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        _group(delivery=delivery)


def test_the_core_source_value_is_the_protos() -> None:
    assert SOURCE_RETRY == handler_pb2.DELIVERY_SOURCE_RETRY


def test_validate_names_a_bad_tier_field_and_accepts_good_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a config whose unblocking has no tiers to move to
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kafka: {bootstrap_servers: 'localhost:9092'}\n"
        "groups:\n"
        "  - name: g\n"
        "    topics: [t]\n"
        "    service: {endpoints: ['127.0.0.1:5']}\n"
        "    delivery: {head_block_ms: 1000, retry_topics: [{delay_ms: -1}]}\n"
    )
    # When validated, Then exit 2 and one line naming the field
    assert cli.main(["validate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "groups.0(g).delivery.retry_topics.0.delay_ms" in err
    good = tmp_path / "good.yaml"
    good.write_text(bad.read_text().replace("-1", "5000"))
    assert cli.main(["validate", "--config", str(good)]) == 0


def test_the_handler_sdk_reads_and_writes_the_retry_source() -> None:
    wire = handler_pb2.Message(topic="t", source=handler_pb2.DELIVERY_SOURCE_RETRY, attempt=3)
    message = Message.from_proto(wire)
    assert (message.source, message.attempt) == ("retry", 3)
    assert message.to_proto().source == handler_pb2.DELIVERY_SOURCE_RETRY
    unknown = handler_pb2.Message(topic="t", source=99)  # type: ignore[arg-type]
    assert Message.from_proto(unknown).source == "primary"


def test_a_head_moved_from_an_in_memory_retry_wait_is_charged_no_attempt_it_did_not_make() -> None:
    # Given max_attempts 2, in_memory_attempts 2 and head_block_ms: the head message fails
    # its first attempt (counted) and waits for its in-memory retry; the message behind it
    # is acked
    rig = Rig(
        head_block_ms=1000,
        max_attempts=2,
        in_memory_attempts=2,
        backoff=BackoffConfig(initial_ms=60_000, max_ms=60_000),
    )
    rig.core.intake(TierRecord("t", 0))
    rig.core.intake(TierRecord("t", 1))
    head, retry = rig.push(FAIL)
    assert retry.action is Action.RETRY and head.counted_here == 1
    rig.push(ACK)
    # When head-of-line unblocking moves it aside (nothing is under way for it: no call of it
    # is abandoned)
    rig.core.unblock(0.0)
    [(moved, decision)] = rig.core.unblock(1.0)
    assert moved is head
    # Then it is charged only the one attempt it made: with max_attempts 2 it still has one
    # left, so it goes to a tier, not to the DLQ "after 2 attempts", and the attempt it
    # carries (cp-attempt: attempts made so far) is 1
    assert decision.action is Action.TIER, (decision.action, decision.reason, moved.counted_here)
    assert moved.attempt == 1 and moved.counted_here == 1


def test_a_head_moved_from_an_in_memory_retry_wait_carries_the_attempts_it_made() -> None:
    # Given max_attempts 10: the head fails its first attempt and waits for its retry
    rig = Rig(
        head_block_ms=1000,
        max_attempts=10,
        in_memory_attempts=3,
        backoff=BackoffConfig(initial_ms=60_000, max_ms=60_000),
    )
    rig.core.intake(TierRecord("t", 0))
    rig.core.intake(TierRecord("t", 1))
    rig.push(FAIL)
    rig.push(ACK)
    rig.core.unblock(0.0)
    # When it is moved to tier 1
    [(moved, decision)] = rig.core.unblock(1.0)
    assert decision.action is Action.TIER
    # Then its tier record says one attempt was made (the handler saw attempt 1 only; read
    # back, the next delivery is attempt 2, not 3), and one attempt of the budget is spent
    assert (moved.attempt, moved.counted_here) == (1, 1)


REDRIVE_BACKOFF = BackoffConfig(initial_ms=100, max_ms=1000, jitter=0.0)
REDRIVE_ORIGIN = Origin("t", 0, 9, 1000, 0)


def _redriven_dead_letter(attempt: int) -> list[Any]:
    """A DLQ record's headers as the proxy writes them (merge copies them unchanged)."""
    return dlq_headers(
        [("user", b"x")], REDRIVE_ORIGIN, attempt=attempt, status="INTERNAL", reason="gave up",
        endpoint="e", group="g",
    )  # fmt: skip


def _tier_record_of(delivery: Delivery, tier: int) -> Rec:
    """The tier record the proxy writes for ``delivery`` (parking._write_tier's headers)."""
    headers = retry_headers(
        delivery.headers, delivery.origin, attempt=delivery.attempt, status="INTERNAL",
        reason="flaky", endpoint="e", group="g", tier=tier, due_at_ms=0,
        counted=delivery.counted_here,
    )  # fmt: skip
    return Rec(f"g.retry.{tier}", 0, headers=headers)


def _failures_until_dlq_without_tiers(rig: CoreRig) -> int:
    n = 0
    while True:
        if not rig.ready:
            rig.clock.run_until(rig.clock.now + 60)
        _, decision = rig.finish_next(FAIL)
        n += 1
        assert decision is not None
        if decision.action is Action.DEAD_LETTER:
            return n


def test_a_redriven_dead_letter_gets_the_same_attempts_with_retry_tiers_as_without() -> None:
    # Given a dead letter that used up max_attempts (5), merged back to the redrive topic
    redriven = Rec("g.redrive", 0, headers=_redriven_dead_letter(attempt=5))

    # When it keeps failing in a group without tiers
    plain = CoreRig(
        DeliveryConfig(max_attempts=5, backoff=REDRIVE_BACKOFF),
        tps=(("g.redrive", 0),),
        start=WALL_CLOCK_START,
    )
    plain.core.intake(redriven)
    assert plain.ready[0].source == SOURCE_REDRIVE and plain.ready[0].attempt == 6
    # Then it gets max_attempts attempts again before it goes back to the DLQ
    assert _failures_until_dlq_without_tiers(plain) == 5

    # When the same record keeps failing in a group with two retry tiers (2 s, 5 s)
    tiers = [RetryTopicConfig(delay_ms=2000), RetryTopicConfig(delay_ms=5000)]
    rig = CoreRig(
        DeliveryConfig(max_attempts=5, backoff=REDRIVE_BACKOFF, retry_topics=tiers),
        tps=(("g.redrive", 0), ("g.retry.1", 0), ("g.retry.2", 0)),
        retry_topics=["g.retry.1", "g.retry.2"],
        start=WALL_CLOCK_START,
    )
    rig.core.intake(redriven)
    delivery, first = rig.finish_next(FAIL)
    assert first is not None and first.action is Action.TIER and first.tier == 1
    rig.core.tier_written(delivery)
    rig.core.intake(_tier_record_of(delivery, 1))
    delivery, second = rig.finish_next(FAIL)

    # Then it goes through its tiers like any message (tier 2 next), not back to the DLQ
    # after two attempts as "gave up after 7 attempts" of a max_attempts of 5
    assert second is not None
    assert (second.action, second.tier, second.reason) == (Action.TIER, 2, "flaky")
