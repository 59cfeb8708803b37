"""What the broker says about a group: committed offsets and members."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from tests.support.kafka import partitions_of


def committed_sum(bootstrap: str, group: str, topic: str) -> int:
    """Sum over the topic's partitions of the group's committed offsets (0 where none)."""
    with CommittedReader(bootstrap, group, topic) as reader:
        return reader.sum()


_COORDINATOR_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


class CommittedReader:
    """:func:`committed_sum` again and again on one client: one read is a round trip
    (~1 ms), where a new client per read (~0.1-0.2 s) made "every offset committed" late by
    up to that much, i.e. 2-3 % of a 7 s run."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        self._wanted = [TopicPartition(topic, p) for p in partitions_of(bootstrap, topic)]

    def sum(self) -> int:
        """The sum now; retried for up to 30 s while the group's coordinator is not known yet
        (a new group's first read may answer NOT_COORDINATOR)."""
        deadline = time.monotonic() + 30.0
        while True:
            try:
                found = self._consumer.committed(self._wanted, timeout=30)
                return sum(max(tp.offset, 0) for tp in found)
            except KafkaException as exc:
                err = exc.args[0]
                if time.monotonic() > deadline or not (
                    err.retriable() or err.code() in _COORDINATOR_NOT_READY
                ):
                    raise
                time.sleep(0.05)

    def __enter__(self) -> CommittedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._consumer.close()


def group_members(bootstrap: str, group: str) -> list[dict[str, list[int]]]:
    """The group's members as the broker sees them: {topic: [partitions]} each."""
    from confluent_kafka.admin import AdminClient

    client = AdminClient({"bootstrap.servers": bootstrap})
    description = client.describe_consumer_groups([group])[group].result(timeout=30)
    members = []
    for member in description.members:
        owned: dict[str, list[int]] = {}
        for tp in member.assignment.topic_partitions:
            owned.setdefault(tp.topic, []).append(tp.partition)
        members.append({t: sorted(ps) for t, ps in sorted(owned.items())})
    return members
