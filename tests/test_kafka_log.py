"""KafkaLogGate: librdkafka's connection failures become state changes, repeats are counted.

Pure logic with an injected clock; tests/test_faults.py counts the lines with a real broker.
"""

from __future__ import annotations

import json
import logging

from confluent_kafka import KafkaError

from consumer_proxy.kafka_log import STATS_INTERVAL_MS, KafkaLogGate, broker_states
from tests.support.clock import Clock

FAIL = (
    "FAIL [rdkafka#consumer-1] [thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: "
    "Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after %dms in state CONNECT)"
)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def _gate(**kwargs: float) -> tuple[KafkaLogGate, Clock, Lines]:
    clock, lines = Clock(1000.0), Lines()
    log = logging.getLogger(f"test_kafka_log.{id(lines)}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.addHandler(lines)
    gate = KafkaLogGate(log, "group g consumer", clock=clock, wall=lambda: 0.0, **kwargs)
    return gate, clock, lines


def _stats(state: str) -> str:
    return json.dumps({"brokers": {"127.0.0.1:9092/1": {"state": state}}})


def test_a_broker_outage_is_told_once_with_its_duration_and_the_suppressed_count() -> None:
    gate, clock, lines = _gate(remind_s=60.0)
    # Given a client that loses its broker: 10 failures a second for 19 s, by log and error_cb
    for tick in range(190):
        clock.now += 0.1
        gate.log(logging.ERROR, "%s", FAIL % tick)
        if tick % 2:
            gate.error(KafkaError(KafkaError._TRANSPORT, "127.0.0.1:9092/bootstrap: refused"))
        if tick == 5:
            gate.error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
        gate.on_stats(_stats("CONNECT"))
    # When a broker connection is up again
    gate.on_stats(_stats("UP"))
    gate.on_stats(_stats("UP"))
    # Then the log says two state changes: since when, and how long, with the count
    assert lines.messages == [
        "group g consumer: Kafka unreachable since 00:00:00 UTC: 127.0.0.1:9092/bootstrap: "
        "Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT)",
        "group g consumer: Kafka reachable again after 19 s (285 connection errors suppressed)",
    ]
    assert [r.levelno for r in lines.records] == [logging.WARNING, logging.INFO]
    assert gate.unreachable_since is None


def test_a_long_outage_is_reminded_at_most_every_remind_s() -> None:
    gate, clock, lines = _gate(remind_s=60.0)
    for _ in range(1200):  # 150 s of failures, 8 a second
        clock.now += 0.125
        gate.log(logging.ERROR, FAIL % 0)
    assert len(lines.messages) == 3
    assert lines.messages[1].startswith(
        "group g consumer: Kafka still unreachable after 60 s (480 connection errors suppressed)"
    )
    assert "after 120 s (480 connection errors suppressed)" in lines.messages[2]
    assert gate.unreachable_since == 1000.125


def test_other_repeated_lines_are_suppressed_and_counted_within_the_window() -> None:
    gate, clock, lines = _gate(window_s=60.0)
    # Given the same error 30 times in 30 s (only a number differs), and another one once
    for i in range(30):
        clock.now += 1.0
        gate.log(logging.WARNING, "%s", f"REQTMOUT [rdkafka#producer-2] timed out {i} requests")
    gate.error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not authorized"))
    # When it comes again after the window
    clock.now += 60.0
    gate.log(logging.WARNING, "%s", "REQTMOUT [rdkafka#producer-2] timed out 99 requests")
    # Then it was said twice, the second time with the count of the repeats in between
    assert lines.messages == [
        "group g consumer: REQTMOUT [rdkafka#producer-2] timed out 0 requests",
        "group g consumer: TOPIC_AUTHORIZATION_FAILED: not authorized",
        "group g consumer: REQTMOUT [rdkafka#producer-2] timed out 99 requests "
        "(and 29 identical lines suppressed in the last 89 s)",
    ]
    assert gate.suppressed_total == 29


def test_debug_lines_and_routine_disconnects_are_not_an_outage() -> None:
    gate, _clock, lines = _gate()
    gate.log(logging.DEBUG, "%s", "BROKER [rdkafka#consumer-1] added broker")
    gate.log(logging.DEBUG, "%s", "BROKER [rdkafka#consumer-1] added broker")
    gate.log(logging.INFO, "%s", "FAIL [rdkafka#producer-2] Disconnected (after 600000ms in UP)")
    assert gate.unreachable_since is None
    assert len(lines.messages) == 3


def test_attach_routes_errors_and_chains_existing_statistics_and_error_callbacks() -> None:
    gate, _clock, lines = _gate()
    seen: list[str] = []
    errors: list[KafkaError] = []
    conf = gate.attach({"stats_cb": seen.append, "error_cb": errors.append})
    assert conf["statistics.interval.ms"] == STATS_INTERVAL_MS
    refused = KafkaError(KafkaError._TRANSPORT, "refused")
    conf["error_cb"](refused)
    assert gate.unreachable_since is not None and errors == [refused]
    conf["stats_cb"](_stats("UP"))
    assert seen == [_stats("UP")]
    assert gate.unreachable_since is None
    assert "Kafka reachable again after 0 s" in lines.messages[-1]
    assert gate.attach({"statistics.interval.ms": 0})["statistics.interval.ms"] == 0


def test_a_stale_failure_right_after_the_recovery_does_not_reopen_the_outage() -> None:
    gate, clock, lines = _gate(settle_s=2.0)
    gate.log(logging.ERROR, FAIL % 0)
    clock.now += 7.0
    gate.on_stats(_stats("UP"))
    # Given a failure line served late, just after the statistics that showed the recovery
    clock.now += 0.5
    gate.log(logging.ERROR, FAIL % 0)
    assert gate.unreachable_since is None
    # but a failure after the settle time is a new outage
    clock.now += 2.0
    gate.log(logging.ERROR, FAIL % 0)
    assert gate.unreachable_since == clock.now
    assert [m.split(": ")[1][:22] for m in lines.messages] == [
        "Kafka unreachable sinc",
        "Kafka reachable again ",
        "Kafka unreachable sinc",
    ]


def test_broker_states_reads_only_the_brokers_of_the_statistics() -> None:
    raw = json.dumps(
        {
            "name": "rdkafka#consumer-1",
            "brokers": {
                "b:9092/1": {"name": "b:9092/1", "state": "UP"},
                "b:9093/2": {"state": "DOWN"},
            },
            "topics": {"t": {"partitions": {"0": {"state": "UP-LOOKING"}}}},
        }
    )
    assert broker_states(raw) == {"b:9092/1": "UP", "b:9093/2": "DOWN"}
    assert broker_states(raw) == {"b:9092/1": "UP", "b:9093/2": "DOWN"}  # read once, kept
    assert broker_states('{"name": "x"}') == {}  # no brokers yet: none is up
    assert broker_states("not json") is None
    assert broker_states('{"brokers": [1, 2]}') is None
