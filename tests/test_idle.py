"""The idle cost of many groups (issue 13): what a process shares, and what wakes an idle group.

Real broker, real gRPC service. The figures (CPU, memory, threads of 40 idle groups against
40 bare consumers) are measured by ``bench/bench_idle.py``, not here; these tests pin the
behaviour the figures rest on: one DLQ producer serves every group and still reports each
group's refusals as its own, and a consumer's long idle wait gives way to any other call at
once, so shutdown and commits never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from confluent_kafka import TopicPartition

from consumer_proxy.config import KafkaConfig, ProxyConfig
from consumer_proxy.dlq import DeadLetterWriter
from consumer_proxy.fetcher import CONSUME_CHUNK_S, Fetcher, consumer_config
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    produce,
    unique_name,
)
from tests.support.proxy import FAST_CONSUMER, caught_up, config_dict, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka


async def test_the_groups_of_a_process_share_one_dlq_producer_and_dead_letter_their_own(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given three groups in one process, each with a poison pill in its topic
    names = [unique_name("shared") for _ in range(3)]
    for name in names:
        create_topic(bootstrap, name, partitions=2)
        await asyncio.to_thread(produce, bootstrap, name, ["a", f"poison {name}", "b"])

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value.startswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.FAILED_PRECONDITION, details="cannot parse")
        return Behaviour()

    async with TestService(behaviour) as service:
        raw = config_dict(bootstrap, names[0], [names[0]], [service.address])
        template = raw["groups"][0]
        raw["groups"] = [{**template, "name": name, "topics": [name]} for name in names]
        proxy, task = start_proxy(ProxyConfig(**raw))
        # When every group has dead-lettered its pill
        for name in names:
            await async_wait_until(functools.partial(caught_up, bootstrap, name, name), timeout=90)
        # Then one producer (and its one polling thread) served all of them
        writers = [r.writer for r in proxy.runners]
        assert all(isinstance(w, DeadLetterWriter) for w in writers)
        shared = {w.producer for w in writers if isinstance(w, DeadLetterWriter)}
        assert len(shared) == 1 and proxy.producers.active() == 1
        (producer,) = shared
        assert producer.users == 3 and producer.session.poller.is_alive()
        await proxy.shutdown()
        await task
    # and each group's DLQ holds exactly its own pill, and the producer stopped with the last
    for name in names:
        dead = await asyncio.to_thread(consume_all, bootstrap, f"{name}.dlq")
        assert [m.value() for m in dead] == [f"poison {name}".encode()]
    assert proxy.producers.active() == 0 and producer.closed
    assert not producer.session.poller.is_alive()  # joined by the last writer's close


class _Assignments:
    """A rebalance listener that only records what it is told (the runner's part is not
    under test here)."""

    def __init__(self) -> None:
        self.assigned: list[TopicPartition] = []

    async def partitions_assigned(self, committed: Sequence[TopicPartition]) -> None:
        self.assigned += committed

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        return []

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        return None


@contextlib.asynccontextmanager
async def _owning_fetcher(bootstrap: str, name: str) -> AsyncIterator[tuple[Fetcher, str]]:
    """A ``Fetcher`` whose consumer owns the one (empty) partition of a new topic; closed
    at the end."""
    topic = unique_name(name)
    create_topic(bootstrap, topic, partitions=1)
    conf = consumer_config(KafkaConfig(bootstrap_servers=bootstrap), unique_name(name))
    conf.update(FAST_CONSUMER)
    listener = _Assignments()
    fetcher = Fetcher(conf, [topic], listener, asyncio.get_running_loop())
    await fetcher.start()
    try:
        deadline = time.monotonic() + 60
        while not listener.assigned and time.monotonic() < deadline:
            assert await fetcher.consume(1, 1.0) == []
        assert listener.assigned
        yield fetcher, topic
    finally:
        await fetcher.close()


async def test_a_long_idle_wait_gives_way_to_a_queued_call_and_ends_on_a_new_record(
    kafka: Broker,
) -> None:
    bootstrap = kafka.bootstrap
    # Given a consumer that owns its (empty) partition
    async with _owning_fetcher(bootstrap, "idlewait") as (fetcher, topic):
        long_wait = 120.0
        # When a call is queued behind a two-minute wait for records
        waiting = asyncio.ensure_future(fetcher.consume(1, long_wait))
        await asyncio.sleep(0)  # the consume task runs first: its wait is queued first
        started = time.monotonic()
        await fetcher.set_paused([], [(topic, 0)])  # a resume: any call queued behind it
        # Then the call gets its turn after at most one chunk of the wait, not two minutes
        assert await waiting == []
        assert time.monotonic() - started < long_wait / 4, "the queued call waited for the wait"
        # When a record arrives during another long wait
        waiting = asyncio.ensure_future(fetcher.consume(1, long_wait))
        started = time.monotonic()
        await asyncio.to_thread(produce, bootstrap, topic, ["late"])
        # Then the wait ends with it
        messages = await waiting
        assert [m.value() for m in messages] == [b"late"]
        assert time.monotonic() - started < long_wait / 4
        assert long_wait / 4 > CONSUME_CHUNK_S  # the bounds above are chunks, not timings


async def test_a_busy_groups_short_wait_gives_way_to_a_queued_call_at_once(
    kafka: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The commit after a group's last ack is queued behind the intake's short wait for more
    # records; served in one piece, that wait held the commit up by up to 200 ms. The chunks
    # of a wait and the short waits are made a minute long here, so a call left behind the
    # whole wait would not get its turn within the test.
    monkeypatch.setattr("consumer_proxy.fetcher.CONSUME_CHUNK_S", 60.0)
    monkeypatch.setattr("consumer_proxy.fetcher.SLICED_WAIT_S", 60.0)
    # Given a consumer that owns its (empty) partition
    async with _owning_fetcher(kafka.bootstrap, "shortwait") as (fetcher, topic):
        # When a call is queued behind a busy group's wait for records (a minute here)
        waiting = asyncio.ensure_future(fetcher.consume(1, 60.0))
        await asyncio.sleep(0)  # the consume task runs first: its wait is queued first
        resumed = asyncio.ensure_future(fetcher.set_paused([], [(topic, 0)]))
        # Then the wait gives way within a slice of it, long before its first chunk would end
        await async_wait_until(resumed.done, timeout=30)
        assert await waiting == []


async def test_a_group_that_goes_idle_commits_before_its_long_wait(
    kafka: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A commit queued behind an idle wait waits for the wait's chunk to end; the chunks are
    # made 120 s long here, so a commit left behind one would not happen within the test.
    monkeypatch.setattr("consumer_proxy.fetcher.CONSUME_CHUNK_S", 120.0)
    monkeypatch.setattr("consumer_proxy.core.cadence.IDLE_FETCH_WAIT_S", 120.0)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("idlecommit"), unique_name("idlecommit")
    create_topic(bootstrap, topic, partitions=1)
    async with TestService() as service:
        proxy, task = start_proxy(
            ProxyConfig(**config_dict(bootstrap, group, [topic], [service.address]))
        )
        runner = proxy.runners[0]
        await async_wait_until(lambda: proxy.ready()[0], timeout=60)
        fetcher = runner.fetcher
        assert isinstance(fetcher, Fetcher)
        calls: list[float] = []
        uncommitted_at_long_wait: list[list[tuple[int | None, int]]] = []
        consume = fetcher.consume

        async def watched(max_messages: int, timeout_s: float) -> list[object]:
            # Instrumentation only: the real consume runs; what the group's own books said
            # when the intake began a long wait is recorded (but for a commit already sent,
            # whose answer the wait serves).
            calls.append(timeout_s)
            if timeout_s >= 120.0 and not runner.committer.answering:
                behind = [
                    (p.last_commit[0] if p.last_commit else None, p.tracker.committable())
                    for p in runner.partitions.parts.values()
                    if p.tracker is not None
                    and (p.last_commit is None or p.last_commit[0] != p.tracker.committable())
                ]
                if behind:
                    uncommitted_at_long_wait.append(behind)
            return await consume(max_messages, timeout_s)

        monkeypatch.setattr(fetcher, "consume", watched)
        # Given the committer held up (the test holds its lock) while the last messages are acked
        async with runner.committer.lock:
            await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(20)])
            await async_wait_until(lambda: len(service.counts) == 20, timeout=60)
            # When the intake has polled a few times with nothing held (a long wait, if it
            # began one, is the third)
            seen = len(calls)
            await async_wait_until(
                lambda: len(calls) >= seen + 4 or any(t >= 120.0 for t in calls[seen:]),
                timeout=60,
            )
        # Then every message is committed soon after the committer is free again, and the
        # intake never began a long wait with done messages left to commit
        await async_wait_until(functools.partial(caught_up, bootstrap, group, topic), timeout=30)
        # and it begins one once everything is committed
        await async_wait_until(lambda: 120.0 in calls, timeout=30)
        assert uncommitted_at_long_wait == []
        # and a commit's answer is served inside a long wait, not after it
        await async_wait_until(lambda: not runner.committer.answering, timeout=30)
        parts = runner.partitions.parts.values()
        assert [p.last_commit[0] for p in parts if p.last_commit is not None] == [20]
        # (a new record ends the 120 s wait at once, so the shutdown need not wait for it; the
        # chunks are 2 s again for the long wait that may begin before the shutdown: a busy
        # group's short waits give way to its commits, so it is quiet again within ~50 ms)
        monkeypatch.setattr("consumer_proxy.fetcher.CONSUME_CHUNK_S", 2.0)
        await asyncio.to_thread(produce, bootstrap, topic, ["wake"])
        await async_wait_until(lambda: len(service.counts) == 21, timeout=60)
        await proxy.shutdown()
        await task


async def test_a_groups_last_partition_to_go_idle_is_committed_at_once_not_after_the_gap(
    kafka: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Commits are at least a gap apart; the one after the first partition to go idle used to
    # hold up the last partition's commit for the rest of its gap (a group's last commit up to
    # 100 ms late). The gap and the commit interval are made a minute long here, so a commit
    # that waited for either would not happen within the test.
    monkeypatch.setattr("consumer_proxy.core.cadence.IDLE_COMMIT_GAP_S", 60.0)
    bootstrap = kafka.bootstrap
    topic, group = unique_name("lastidle"), unique_name("lastidle")
    create_topic(bootstrap, topic, partitions=3)
    holds = {1: asyncio.Event(), 2: asyncio.Event()}

    def behaviour(message: handler_pb2.Message, _n: int) -> Behaviour:
        return Behaviour(hold=holds.get(message.partition))

    async def first_committed() -> bool:
        offsets = await asyncio.to_thread(committed_offsets, bootstrap, group, topic)
        return offsets.get(0, (None,))[0] == 1

    async with TestService(behaviour) as service:
        config = config_dict(
            bootstrap, group, [topic], [service.address], delivery={"commit_interval_ms": 60_000}
        )
        proxy, task = start_proxy(ProxyConfig(**config))
        try:
            runner = proxy.runners[0]
            parts = runner.partitions.parts
            await async_wait_until(lambda: all((topic, p) in parts for p in range(3)), timeout=60)
            # Given partition 0's message acked and committed while the service holds those
            # of partitions 1 and 2 (the committer is in its gap after that commit)
            records = [{"value": f"m{p}", "partition": p} for p in range(3)]
            await asyncio.to_thread(produce, bootstrap, topic, records)
            await async_wait_until(first_committed, timeout=60)
            await async_wait_until(lambda: len(service.deliveries) == 3, timeout=60)
            # and partition 1's acked during the gap, the group still busy with partition 2
            holds[1].set()
            await async_wait_until(lambda: len(service.finished()) == 2, timeout=60)
            # When partition 2's message is acked: the group holds nothing any more
            holds[2].set()
            # Then it is committed at once, not when the gap ends a minute later
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=30)
        finally:
            await proxy.shutdown()
            await task
