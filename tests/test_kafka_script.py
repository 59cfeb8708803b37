"""scripts/kafka and the tests/support/kafka.py helpers, against the real broker."""

from __future__ import annotations

import os
import socket
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from tests.support.kafka import (
    SASL_CLIENT_CONFIG,
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    java_pids_mentioning,
    pid_alive,
    produce,
    run_script,
    start_broker,
    stop_broker,
    unique_name,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka


def test_records_round_trip_through_the_session_broker(kafka: Broker) -> None:
    # Given a topic with three partitions
    topic = create_topic(kafka.bootstrap, unique_name("round-trip"), partitions=3)
    records = [
        {"key": f"k{i}", "value": f"v{i}".encode(), "headers": [("n", str(i))], "partition": i % 3}
        for i in range(30)
    ]

    # When the records are produced, as dicts, tuples and a bare value
    delivered = produce(kafka.bootstrap, topic, records)
    delivered += produce(kafka.bootstrap, topic, [(b"tk", b"tuple", {"h": b"1"}, 1), b"bare"])

    # Then reading the topic back returns exactly them, in partition order
    messages = consume_all(kafka.bootstrap, topic, timeout=30)
    assert len(delivered) == 32
    assert end_offsets(kafka.bootstrap, topic) == dict(Counter(p for p, _ in delivered))
    by_value = {m.value() or b"": m for m in messages}
    assert sorted(by_value) == sorted([f"v{i}".encode() for i in range(30)] + [b"tuple", b"bare"])
    assert all(by_value[f"v{i}".encode()].partition() == i % 3 for i in range(30))
    assert by_value[b"v7"].key() == b"k7"
    assert by_value[b"v7"].headers() == [("n", b"7")]
    assert by_value[b"tuple"].headers() == [("h", b"1")]
    assert [(m.partition(), m.offset()) for m in messages] == sorted(delivered)


def test_committed_offsets_carry_commit_metadata(kafka: Broker) -> None:
    # Given a topic and a group that committed an offset with metadata on one partition
    topic = create_topic(kafka.bootstrap, unique_name("commits"), partitions=2)
    produce(kafka.bootstrap, topic, [(None, b"x", None, 0)] * 5)
    group = unique_name("group")
    consumer = Consumer(
        {"bootstrap.servers": kafka.bootstrap, "group.id": group, "enable.auto.commit": False}
    )
    try:
        consumer.commit(
            offsets=[TopicPartition(topic, 0, 3, metadata="v1:acked=4")], asynchronous=False
        )
    finally:
        consumer.close()

    # Then the helper reports that partition only, metadata included
    assert committed_offsets(kafka.bootstrap, group, topic) == {0: (3, "v1:acked=4")}


def test_stop_leaves_no_process_and_a_restart_keeps_the_data(tmp_path: Path) -> None:
    # Given a broker of our own, with a SASL listener too, and one record in it
    directory = tmp_path / "broker"
    broker = start_broker(directory, sasl_port=0, watch_pid=os.getpid())
    try:
        pid = int((directory / "kafka.pid").read_text())
        status = run_script("status", "--dir", str(directory))
        expected = f"running pid={pid} bootstrap={broker.bootstrap}"
        expected += f" sasl_bootstrap={broker.sasl_bootstrap}"
        assert (status.returncode, status.stdout.strip()) == (0, expected)
        assert start_broker(directory, port=None) == broker  # already running: same broker
        topic = create_topic(broker.bootstrap, unique_name("durable"))
        assert broker.sasl_bootstrap is not None
        produce(broker.sasl_bootstrap, topic, [(b"k", b"before-stop")], config=SASL_CLIENT_CONFIG)
        assert sasl_error(broker.sasl_bootstrap, password="wrong") == KafkaError._AUTHENTICATION

        # When it is stopped
        stop_broker(directory)

        # Then no process is left, and stopping again is harmless
        assert not pid_alive(pid)
        assert java_pids_mentioning(directory) == []
        status = run_script("status", "--dir", str(directory))
        assert (status.returncode, status.stdout.strip()) == (3, "not running")
        stop_broker(directory)

        # When it starts again from the same directory, watching a process this time
        owner = subprocess.Popen(["sleep", "120"])
        try:
            again = start_broker(directory, port=None, watch_pid=owner.pid)

            # Then it is back on the recorded port with the data written before the stop
            assert again == broker
            assert [m.value() for m in consume_all(again.bootstrap, topic)] == [b"before-stop"]
            pid = int((directory / "kafka.pid").read_text())
        finally:
            owner.kill()
            owner.wait()

        # And once the watched process is gone, the broker stops by itself
        wait_until(lambda: not pid_alive(pid), timeout=45, message="the watcher to stop the broker")
    finally:
        stop_broker(directory)
    assert java_pids_mentioning(directory) == []


def sasl_error(bootstrap: str, password: str) -> int:
    """The first error code a producer reports when it logs in with ``password``."""
    errors: list[KafkaError] = []
    config = {**SASL_CLIENT_CONFIG, "sasl.password": password, "error_cb": errors.append}
    producer = Producer({"bootstrap.servers": bootstrap, **config})

    def reported() -> list[KafkaError]:
        producer.poll(0.1)  # serves error_cb
        return errors

    return wait_until(reported, message="the client to report an error")[0].code()


def test_start_fails_fast_when_the_port_is_taken(tmp_path: Path) -> None:
    # Given a port someone already listens on
    directory = tmp_path / "broker"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        # When a broker is started on it
        result = run_script("start", "--dir", str(directory), "--port", str(port))

    # Then it fails with one line naming the port, before it touched DIR or started a JVM
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"port {port} " in result.stderr
    assert not directory.exists()
    assert java_pids_mentioning(directory) == []
