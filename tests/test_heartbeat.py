"""The long-running call's pure decisions (core/heartbeat.py) and its configuration."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer_proxy.config import BackoffConfig, ProxyConfig, load_config
from consumer_proxy.core.decision import Action, Evidence, Policy, decide
from consumer_proxy.core.heartbeat import (
    MAX_PROCESSING_STATUS,
    CallWatch,
    Expiry,
    Limits,
    expiry_result,
    no_result,
)
from consumer_proxy.core.outcomes import Classifier, Outcome
from consumer_proxy.errors import ConfigError

LIMITS = Limits.from_ms(6000, 60_000)
POLICY = Policy(max_attempts=3, backoff=BackoffConfig())


def test_a_call_expires_on_silence_before_the_cap() -> None:
    # Given a call begun at t=100
    watch = CallWatch(LIMITS, 100.0)
    # Then it expires 6 s later unless heard from
    assert watch.due() == (106.0, Expiry.HEARTBEAT)
    assert watch.expired(105.9) is None
    assert watch.expired(106.0) is Expiry.HEARTBEAT
    # When a heartbeat comes at t=105 with a note
    gap = watch.heard(105.0, "40%")
    # Then the gap is measured, and the silence is counted from the heartbeat
    assert gap == 5.0
    assert watch.due() == (111.0, Expiry.HEARTBEAT)
    assert watch.progress == "40%"
    assert watch.heartbeats == 1


def test_heartbeats_never_keep_a_call_past_its_cap() -> None:
    watch = CallWatch(LIMITS, 0.0)
    for t in range(2, 58, 2):
        watch.heard(float(t))
    assert watch.expired(57.9) is None
    # The last heartbeat (t=56) would allow until 62: the cap (60) comes first
    assert watch.due() == (60.0, Expiry.CAP)
    assert watch.expired(60.0) is Expiry.CAP


def test_the_service_is_asked_to_heartbeat_every_third_of_the_timeout() -> None:
    assert LIMITS.heartbeat_interval_ms == 2000
    assert Limits.from_ms(300, 1000).heartbeat_interval_ms == 100


@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=10.0), max_size=40),
    timeout_s=st.floats(min_value=0.3, max_value=8.0),
    cap_s=st.floats(min_value=1.0, max_value=100.0),
)
def test_a_call_expires_exactly_when_a_gap_or_the_total_is_too_long(
    gaps: list[float], timeout_s: float, cap_s: float
) -> None:
    # A watch checked at each heartbeat's arrival: the call survives exactly while every gap
    # stays under the timeout and the total under the cap.
    watch = CallWatch(Limits(timeout_s, cap_s), 0.0)
    now = 0.0
    for gap in gaps:
        now += gap
        expected: Expiry | None = None
        if now >= cap_s and cap_s <= watch.last_heard + timeout_s:
            expected = Expiry.CAP
        elif now >= watch.last_heard + timeout_s:
            expected = Expiry.CAP if cap_s <= watch.last_heard + timeout_s else Expiry.HEARTBEAT
        assert watch.expired(now) is expected
        if expected is not None:
            return
        watch.heard(now)
        assert watch.last_heard == now


def test_a_missed_heartbeat_is_a_deadline_under_the_outage_rule() -> None:
    # Given a call that went silent
    result = expiry_result(Expiry.HEARTBEAT, LIMITS, Classifier())
    # Then it is a deadline: a breaker failure, counted only while the service answers others
    assert result.status == "DEADLINE_EXCEEDED"
    assert result.service_failure and result.counted
    assert "6000 ms" in result.reason
    rng = random.Random(1)
    hung = Evidence(service_answered=False)
    answering = Evidence(service_answered=True)
    # A hung service (nothing answered since): retried, never counted, never dead-lettered
    for uncounted in range(50):
        decision = decide(0, uncounted, result, hung, POLICY, rng)
        assert decision.action is Action.RETRY and not decision.counted
    # While others are answered: counted, and dead-lettered at max_attempts
    assert decide(0, 0, result, answering, POLICY, rng).counted
    assert decide(2, 0, result, answering, POLICY, rng).action is Action.DEAD_LETTER
    # A probe's silence or a call in flight when the breaker opened is never charged
    assert not decide(0, 0, result, Evidence(probe=True), POLICY, rng).counted
    assert not decide(0, 0, result, Evidence(opened_during_call=True), POLICY, rng).counted


def test_a_group_override_of_deadline_exceeded_applies_to_a_missed_heartbeat() -> None:
    result = expiry_result(Expiry.HEARTBEAT, LIMITS, Classifier({"DEADLINE_EXCEEDED": "outage"}))
    assert result.service_failure and not result.counted


def test_the_cap_is_a_counted_failure_of_the_message_even_in_an_outage() -> None:
    result = expiry_result(Expiry.CAP, LIMITS, Classifier())
    assert result.status == MAX_PROCESSING_STATUS
    assert result.outcome is Outcome.RETRY
    assert result.counted and not result.service_failure  # the service was heartbeating
    rng = random.Random(1)
    decision = decide(0, 0, result, Evidence(service_answered=False), POLICY, rng)
    assert decision.action is Action.RETRY and decision.counted
    assert decide(2, 0, result, Evidence(), POLICY, rng).action is Action.DEAD_LETTER


def test_a_stream_without_a_result_is_retried_like_internal() -> None:
    result = no_result(Classifier())
    assert result.status == "INTERNAL" and result.counted and not result.service_failure


# -- configuration ---------------------------------------------------------------------------


def _config(delivery: dict[str, Any]) -> ProxyConfig:
    return ProxyConfig(
        kafka={"bootstrap_servers": "localhost:9092"},
        groups=[
            {
                "name": "g",
                "topics": ["t"],
                "service": {"endpoints": ["127.0.0.1:50051"]},
                "delivery": delivery,
            }
        ],
    )


def test_long_running_is_accepted_with_a_grace_below_the_cap() -> None:
    config = _config(
        {
            "long_running": {"heartbeat_timeout_ms": 6000, "max_processing_ms": 60_000},
            "revoke_grace_ms": 5000,
        }
    )
    long_running = config.groups[0].delivery.long_running
    assert long_running is not None and long_running.max_processing_ms == 60_000


@pytest.mark.parametrize(
    ("delivery", "where", "says"),
    [
        (
            {
                "long_running": {"heartbeat_timeout_ms": 2000, "max_processing_ms": 20_000},
                "batch": {},
            },
            "long_running",
            "cannot be combined with delivery.batch",
        ),
        (
            {
                "long_running": {"heartbeat_timeout_ms": 2000, "max_processing_ms": 20_000},
                "revoke_grace_ms": 20_000,
            },
            "revoke_grace_ms",
            "is not below long_running.max_processing_ms",
        ),
        (
            {"long_running": {"heartbeat_timeout_ms": 6000, "max_processing_ms": 6000}},
            "long_running",
            "must be above heartbeat_timeout_ms",
        ),
        (
            {"long_running": {"heartbeat_timeout_ms": 100, "max_processing_ms": 6000}},
            "long_running.heartbeat_timeout_ms",
            "greater than or equal to 300",
        ),
    ],
)
def test_validate_refuses_an_inconsistent_long_running_group(
    delivery: dict[str, Any], where: str, says: str, tmp_path: Path
) -> None:
    # Given an onboarding file with the group's delivery section
    path = tmp_path / "proxy.yaml"
    path.write_text(
        json.dumps(
            {
                "kafka": {"bootstrap_servers": "localhost:9092"},
                "groups": [
                    {
                        "name": "g",
                        "topics": ["t"],
                        "service": {"endpoints": ["127.0.0.1:50051"]},
                        "delivery": delivery,
                    }
                ],
            }
        )
    )
    # Then validation refuses it with one line naming the field
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    lines = [line for line in str(caught.value).splitlines() if says in line]
    assert len(lines) == 1, str(caught.value)
    assert f"groups.0(g).delivery.{where}" in lines[0]


def test_a_long_running_group_streams_whatever_batch_auto_would_do() -> None:
    # batch's default (auto) means off for a long-running group; a batch section is refused
    from consumer_proxy.config import GroupConfig

    base = {"name": "g", "topics": ["t"], "service": {"endpoints": ["127.0.0.1:1"]}}
    long_running = {"heartbeat_timeout_ms": 3000, "max_processing_ms": 60_000}
    for batch in ({}, {"batch": "auto"}):
        group = GroupConfig(**base, delivery={"long_running": long_running, **batch})
        assert group.delivery.batch is None
    with pytest.raises(ValueError, match=r"cannot be combined with delivery\.batch"):
        GroupConfig(**base, delivery={"long_running": long_running, "batch": {"max_messages": 5}})
