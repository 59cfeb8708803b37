"""Seeded random schedules driving the real shell: ``GroupRunner`` with its ``Intake``,
``UnaryPush``/``BatchPush``/``StreamPush``, ``Committer``, ``Parking``, ``Handover``,
``GuardControl`` and rebalance callbacks, on a virtual-time event loop (``tests.sim.vloop``)
with simulated edges (``ports``, in ``tests/sim/edges.py``):

- ``SimSource`` (``ports.MessageSource``): the world's consumer (``world.Consumer``: pause
  flags survive revoke and re-assign, as librdkafka's) behind one serial "consumer thread",
  as ``fetcher.Fetcher``: every call waits its turn; ``consume`` waits in chunks of
  ``CONSUME_CHUNK_S`` that end early only for a queued call or a rebalance, serves the
  rebalance callbacks (revoke, then assign back: cooperative-sticky; the assignment reads
  each committed offset with its metadata and leader epoch) and re-reads positions every
  ``POSITIONS_INTERVAL_S`` (so a reading may predate a log cut); a cut the consumer finds is
  handed over as a _LOG_TRUNCATION error up to ``CUT_FOUND_S`` later, among other
  partitions' records and before the cut partition's records fetched anew (``told``); a
  cancelled call still runs to its end;
- ``SimPusher`` (``ports.Pusher``): the service (ok, poison, drop, flaky, timeouts; outages:
  UNAVAILABLE, hung, UNIMPLEMENTED for batch calls; bad deploys that reject every message;
  wrong-length batch answers, always for a batch holding a "garbled" message). Under
  ``delivery.long_running`` (some unary schedules) each call is a ``HandleMessageStream``
  read by the dispatcher's own loop (``dispatcher.read_stream``: the core's ``CallWatch``
  and ``expiry_result``): heartbeats while the handler runs (long handlers, several heartbeat
  timeouts long), then the result; a hung handler (the timeouts) or a dead instance (the
  hung outage) heartbeats a while and goes silent; an endless one heartbeats until the cap;
- ``SimSink`` (``ports.DeadLetterSink``): the DLQ and the retry tiers' topics (a confirmed
  tier write appends the record to the tier's log, which the member consumes), retried while
  the DLQ is down.

The schedule produces records (half of them without any header, their id in their value: in
batch mode, with ordering none, plain runs of them are ``Run`` items, begun, split, acked and
expanded as the schedule goes; the spy counts each in ``ShellStats``), rebalances (a fifth of
them lose their partitions: no final commit; a third of the hand-overs cut the log inside the
range the restored ack state describes, which the member is not told, some of them below the
commit: the simulated consumer validates a committed leader epoch as librdkafka does, KIP-320),
restarts (graceful, or a crash: nothing is committed after it; each with another metadata
budget, as pods of a config roll; at some an operator resets a partition to its committed
offset, which leaves the commit without a leader epoch), cuts logs (told, some of them below
the commit, or silent), takes the service, the DLQ and
commits down, deploys a bad service and releases a held dead-letter guard as an operator. Half
the seeds of ordering none have 1-3 retry tiers (a third of them waiting a minute to an hour,
far longer than the run) and some head-of-line unblocking. Checked at every step:

- a commit never passes an offset whose message is not done, nor marks one done in its
  metadata; commits never go back (but after a cut); nothing acked is pushed again unless a
  crash, a loss, a cut or the metadata budget allowed it; no member is assigned at a commit
  above a cut that carries no leader epoch, unless an operator's reset left it so (what is
  written below it then is skipped by every consumer, and the check lets it be);
- no message is dead-lettered or moved to a retry tier by an outage (only poison pills and
  counted failures: its own, a deadline or silence charged while the service answered
  others, head_block_ms), none while the dead-letter guard holds, and a guard probe's ack
  releases the guard; a source offset is done only once its tier record is written;
- per-key order (``delivery.ordering``), and the key gate holds every pending offset;
- windows, bytes and concurrency within bounds, and the byte count exact: each partition's
  count is the sum of the messages held for it wherever the shell has them (the ready queue,
  a worker between the queue and its push, a call, a DLQ or tier write, a retry timer, a due
  time, the guard, the key gate);
- a due commit never waits behind an idle wait: no commit waits for the consumer thread
  longer than a normal poll (``FETCH_WAIT_S``), unless a rebalance ran on it meanwhile;
- after ``stop()`` returns no task of the group is left running and no timer is scheduled;
- a call the proxy cancelled (revoke, lost, shutdown) is never an attempt: its message goes
  out again with the attempt it had; an endless handler is dead-lettered by the cap
  (``MAX_PROCESSING_EXCEEDED``);
- liveness: healed, the source partitions drain within ``DRAIN_LIMIT_S`` whatever the tiers
  hold (no source commit stands still for ``STALL_S``), the tiers once their records are
  due, and a guard holding a message the service now acks is released within 30 s.

Same seed, same trace: ``ShellSim.digest`` hashes every push, commit, dead letter and
rebalance with its virtual time. Replay with ``python -m tests.sim --seed N``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from consumer_proxy.config import (
    BackoffConfig,
    BatchConfig,
    CircuitBreakerConfig,
    DeadLetterGuardConfig,
    DeliveryConfig,
    GroupConfig,
    LongRunningConfig,
    RetryTopicConfig,
    ServiceConfig,
)
from consumer_proxy.core.batching import BatchOutcome
from consumer_proxy.core.cadence import FETCH_WAIT_S
from consumer_proxy.core.codec import decode
from consumer_proxy.core.decision import HEAD_BLOCKED, Action, Decision
from consumer_proxy.core.heartbeat import MAX_PROCESSING_STATUS
from consumer_proxy.core.ordering import ORDERINGS, Ordering
from consumer_proxy.core.outcomes import Classification, Classifier
from consumer_proxy.core.partitions import (
    ROOM_REASONS,
    Delivery,
    PartitionSet,
    PartitionState,
    Ready,
    Run,
    expand,
)
from consumer_proxy.group import GroupRunner
from consumer_proxy.metrics import ProxyMetrics
from consumer_proxy.ports import EdgeHooks, Edges
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.readyq import ReadyDeque
from tests.sim.edges import (
    BEAT,
    GROUP,
    TIER_PREFIX,
    SimPusher,
    SimSink,
    SimSource,
    Stream,
)
from tests.sim.truth import InvariantViolation, Truth
from tests.sim.vloop import run_virtual
from tests.sim.world import (
    ACKED,
    TP,
    Log,
    Msg,
    ident_of,
    ident_value,
    service_answer,
    service_batch_call,
    service_unary_call,
)

TOPIC = "t"
TIMEOUT_S = 1.0
DRAIN_LIMIT_S = 600.0
STALL_S = 120.0
"""While draining, a source commit moves at least this often (a message's five attempts with
backoff, an endless handler's five capped calls, the guard's operator: well within it)."""
BYTE_BUDGET = 1024
WALL_EPOCH_S = 1_700_000_000.0  # the core's wall clock (tier due times) is virtual too
HEADLESS_SHARE = 0.5
"""The share of records produced without any header (their id in their value; the others
carry it in a header): in batch mode ``Run`` items hold both."""


def _ident(d: Delivery) -> int:
    """A message's id (``world.ident_of``)."""
    return ident_of(d.headers, d.value)


@dataclass
class ShellStats:
    """What a run did (to see that schedules exercise what they should)."""

    steps: int = 0
    produced: int = 0
    pushes: int = 0
    acked: int = 0
    dead_lettered: int = 0
    rebalances: int = 0
    truncations: int = 0
    silent_truncations: int = 0  # cuts the member is not told of (librdkafka seeks back)
    errors_among_records: int = 0  # consumes that handed a cut over among records
    records_after_a_cut: int = 0  # ... among them the cut partition's, fetched anew after it
    handover_truncations: int = 0  # ... while a restored ack state described the cut range
    cuts_below_commit: int = 0  # at hand-over: the next owner must seek back (KIP-320)
    told_cuts_below_commit: int = 0  # ... while the member owns the partition: it is told
    epochless_resets: int = 0  # an operator's reset left a commit without a leader epoch
    backlog_epoch_commits: int = 0  # commits whose epoch came from the backlog's first record
    hidden_by_reset: int = 0  # records a cut below such a commit hid from every consumer
    paused_at_revoke: int = 0  # partitions revoked and assigned back while paused
    restarts: int = 0
    crashes: int = 0
    outages: int = 0
    dlq_outages: int = 0
    commit_outages: int = 0
    pauses: int = 0
    commits: int = 0
    idle_polls: int = 0  # consumes allowed to wait longer than a normal poll
    stale_drops: int = 0  # ready messages a worker dropped as stale (bytes given back)
    batch_schedules: int = 0
    batch_calls: int = 0
    batched_messages: int = 0
    losses: int = 0  # rebalances that lost their partitions (no final commit)
    long_schedules: int = 0  # delivery.long_running: streaming calls kept alive by heartbeats
    heartbeats: int = 0
    silences: int = 0  # streaming calls ended by no heartbeat in time
    capped: int = 0  # streaming calls ended by max_processing_ms
    calls_cancelled: int = 0  # calls the proxy cancelled (revoke, lost, shutdown)
    tier_schedules: int = 0
    long_tier_schedules: int = 0  # a tier waits far longer (a minute, an hour) than the run
    tier_writes: int = 0
    unblocks: int = 0  # messages head_block_ms moved aside
    bad_deploys: int = 0  # spells of a service that rejects every message (INVALID_ARGUMENT)
    guard_trips: int = 0
    guard_held: int = 0  # dead-letter decisions the guard held
    guard_releases: int = 0  # by an operator (GuardControl.release; a probe's ack too)
    garbled: int = 0  # messages that make any batch answer have the wrong length
    protocol_errors: int = 0  # batch answers of the wrong length
    held_back: int = 0  # checks at which the ordering gate held messages back
    runs_made: int = 0  # batch mode's ``Run`` items made by intake
    runs_begun: int = 0  # ... begun as one
    runs_split: int = 0  # ... of them the head of a run ``take`` split
    runs_acked: int = 0  # ... finished as one (``finish_acked``)
    runs_failed: int = 0  # ... whose messages were decided one by one (a failed call)
    runs_cancelled: int = 0  # ... whose call was cancelled (its messages given back)
    run_messages_alone: int = 0  # a run's messages begun alone (the run expanded before)
    run_messages_stale: int = 0  # ... dropped as stale (the run expanded: revoke, cut)
    virtual_s: int = 0


class ShellSim:
    """One seeded schedule through the real ``GroupRunner``."""

    def __init__(self, seed: int, partitions: int = 3) -> None:
        self.seed = seed
        self.rng = random.Random(f"shell:{seed}")
        choose = random.Random(f"shell-config:{seed}")
        self.ordering: Ordering = ORDERINGS[seed % len(ORDERINGS)]
        self.keys: list[bytes | None] = [b"k%d" % i for i in range(choose.choice([1, 3, 8]))]
        self.keys.append(None)
        self.max_in_flight = choose.choice([4, 8, 32, 256])
        self.concurrency = choose.choice([1, 3, 8])
        self.budget = choose.choice([64, 4000])
        self.value_max = choose.choice([40, 300])
        self.batch: BatchConfig | None = (
            BatchConfig(
                max_messages=choose.choice([1, 2, 5, 50]),
                max_bytes=choose.choice([16, 60, 1000]),
                linger_ms=choose.choice([0, 0, 5]),
            )
            if choose.random() < 0.5
            else None
        )
        self.commit_interval_ms = choose.choice([100, 500, 1000, 5000])
        # Some unary schedules push through the streaming call (validate refuses it with
        # batch mode); drawn last, so that the other schedules keep their configuration.
        self.long_running: LongRunningConfig | None = None
        if self.batch is None and choose.random() < 0.4:
            self.long_running = LongRunningConfig(
                heartbeat_timeout_ms=choose.choice([300, 600]),
                max_processing_ms=choose.choice([2000, 4000]),
            )
        # Which records are produced without headers (their own generator: the schedule's
        # draws stay as they were).
        self.headless = random.Random(f"shell-headless:{seed}")
        self.losses = random.Random(f"shell-lost:{seed}")  # which rebalances lose
        self.handovers = random.Random(f"shell-handover:{seed}")  # cuts at hand-over
        self.handover_cuts = 0.3  # ... at this share of hand-overs
        self.below = random.Random(f"shell-below:{seed}")  # ... some below the commit
        self.below_share = 0.15
        # Some cuts the member is told of are below the commit (its own generator: the
        # schedule's draws stay as they were).
        self.told_below = random.Random(f"shell-told-below:{seed}")
        self.told_below_share = 0.2
        # At some restarts an operator resets a partition's offset to where it is committed
        # (``kafka-consumer-groups --reset-offsets --to-current``): the commit is written
        # again without a leader epoch.
        self.resets = random.Random(f"shell-reset:{seed}")
        self.reset_share = 0.3
        self.operator_epochless: set[TP] = set()  # ... until the proxy commits it again
        self.hidden: dict[TP, int] = {}  # records written below this are skipped (a cut
        # below such a commit, which the next owner could not find)
        # Where a consume hands a cut's error over among records (``SimSource``).
        self.mixing = random.Random(f"shell-mixing:{seed}")
        # A restart may bring another metadata budget (pods of a config roll).
        self.budgets = random.Random(f"shell-budget:{seed}")
        self.tps: list[TP] = [(TOPIC, p) for p in range(partitions)]
        # Retry tiers (half the seeds of ordering none: config refuses them with ordering),
        # from their own generator; a third of them wait far longer than the run.
        tiers = random.Random(f"shell-tiers:{seed}")
        self.tier_delays_ms: list[int] = []
        self.in_memory_attempts = 1
        self.head_block_ms: int | None = None
        self.max_unblock = 10
        if self.ordering == "none" and tiers.random() < 0.5:
            self.tier_delays_ms = tiers.choice(
                [[300], [100, 800], [50, 200, 1000], [60_000], [500, 3_600_000], [600_000]]
            )
            self.in_memory_attempts = tiers.choice([1, 2])
            self.head_block_ms = tiers.choice([None, 300, 1500])
            self.max_unblock = tiers.choice([1, 10])
            if self.head_block_ms is not None and self.long_running is not None:
                # (config refuses a head block within a long call's cap)
                self.head_block_ms += self.long_running.max_processing_ms
        self._topology()
        self.root: dict[int, int] = {}  # a tier record's ident -> the produced message's
        self.tiered: set[int] = set()  # produced messages moved to a tier
        self.hung_pushes: set[int] = set()  # produced messages pushed during a hang
        self.charged: set[int] = set()  # ... with a deadline or silence charged as an attempt
        self.commits: dict[TP, tuple[int, str]] = {}
        self.commit_epochs: dict[TP, int] = {}  # the leader epochs committed with them
        self.last_commit: dict[TP, int] = {}
        self.lanes: dict[tuple[TP, object], list[tuple[int, int]]] = {}
        self.lane_head: dict[tuple[TP, object], int] = {}
        self.truth = Truth()
        self.stats = ShellStats(
            batch_schedules=int(self.batch is not None),
            long_schedules=int(self.long_running is not None),
            tier_schedules=int(bool(self.tier_delays_ms)),
            long_tier_schedules=int(max(self.tier_delays_ms, default=0) >= 60_000),
        )
        self.classifier = Classifier()
        self.next_ident = 0
        self.step_no = 0
        self.outage: str | None = None
        self.bad_deploy = False  # the service rejects every message (it answers)
        self._dlq_down = False
        self._dlq_back: list[asyncio.Future[None]] = []  # writes waiting for the DLQ
        self.commits_down = False
        self.kafka_hangs = False  # commits and closes are never answered (scenarios only)
        self.crashing = False
        self.failure: InvariantViolation | None = None
        self._trace = hashlib.sha256()
        # The shell of the running member and where it holds messages outside the core.
        self.runner: GroupRunner | None = None
        self.source: SimSource | None = None
        self._run_task: asyncio.Task[None] | None = None
        self.taken: set[Delivery] = set()  # a worker took it from the ready queue
        self.calls: set[Delivery | Run] = set()  # begun, not finished
        self.parked: set[Delivery] = set()  # a DLQ write under way
        # (attempt, counted) of each call under way, and of each call given back (abandoned)
        self.began_with: dict[Delivery, tuple[int, int]] = {}
        self.run_of: dict[tuple[PartitionState, int, int], Run] = {}  # runs' messages
        self.run_left: dict[Run, int] = {}  # ... how many of them are still in its call
        self.runs_made: set[Run] = set()  # runs the core made (not split off by ``take``)
        self.given_back: dict[Delivery, tuple[int, int]] = {}
        self.cuts: dict[TP, int] = {}  # where a log was cut, until a commit comes back to it
        self.unnoticed: set[TP] = set()  # ... told to the member, which has not taken it in
        self.rebalanced_at = -1.0  # when the consumer thread last served a rebalance
        self._operator_at = float("inf")  # the drain: when an operator releases the guard
        self._recoverable_since: float | None = None

    @property
    def dlq_down(self) -> bool:
        """The DLQ (and the retry tiers' topics) cannot be written."""
        return self._dlq_down

    @dlq_down.setter
    def dlq_down(self, down: bool) -> None:
        self._dlq_down = down
        if not down:
            waiting, self._dlq_back = self._dlq_back, []
            for future in waiting:
                if not future.done():
                    future.set_result(None)

    async def dlq_back(self) -> None:
        """Return once the DLQ can be written again (at once when it can)."""
        if self._dlq_down:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._dlq_back.append(future)
            await future

    def _topology(self) -> None:
        partitions = len(self.tps)
        self.tier_tps: list[TP] = [
            (f"{TIER_PREFIX}{n}", p)
            for n in range(1, len(self.tier_delays_ms) + 1)
            for p in range(partitions)
        ]
        self.all_tps = [*self.tps, *self.tier_tps]
        self.logs = {tp: Log() for tp in self.all_tps}

    def plain(self, ordering: Ordering = "none", batch: BatchConfig | None = None) -> ShellSim:
        """This seed's schedule with a plain configuration (for scenario tests, before
        anything ran): ``ordering``, ``batch``, no long-running calls, no retry tiers, no
        cuts at hand-over."""
        self.ordering = ordering
        self.batch = batch
        self.long_running = None
        self.tier_delays_ms = []
        self.head_block_ms = None
        self.handover_cuts = 0.0
        self._topology()
        return self

    # -- the member ----------------------------------------------------------------------

    def group_config(self) -> GroupConfig:
        delivery = DeliveryConfig(
            max_in_flight=self.max_in_flight,
            max_in_flight_bytes=BYTE_BUDGET,
            concurrency=self.concurrency,
            max_attempts=5,
            metadata_budget_bytes=self.budget,
            backoff=BackoffConfig(initial_ms=10, max_ms=500),
            ordering=self.ordering,
            batch=self.batch,
            long_running=self.long_running,
            commit_interval_ms=self.commit_interval_ms,
            revoke_grace_ms=int((TIMEOUT_S + 0.5) * 1000),
            fetch_batch=5,
            retry_topics=[RetryTopicConfig(delay_ms=d) for d in self.tier_delays_ms],
            in_memory_attempts=self.in_memory_attempts,
            head_block_ms=self.head_block_ms,
            max_unblock_per_minute=self.max_unblock,
        )
        return GroupConfig(
            name=GROUP,
            topics=[TOPIC],
            service=ServiceConfig(endpoints=["127.0.0.1:1"], timeout_ms=int(TIMEOUT_S * 1000)),
            delivery=delivery,
            circuit_breaker=CircuitBreakerConfig(failure_threshold=5, reset_timeout_s=2.0),
            dead_letter_guard=DeadLetterGuardConfig(
                min_messages=20, window_ms=10_000, probe_interval_ms=500
            ),
        )

    async def _open_edges(self, group: GroupConfig, hooks: EdgeHooks) -> Edges | None:
        self.source = SimSource(self, hooks.listener)
        loop = asyncio.get_running_loop()
        return Edges(self.source, SimPusher(self), SimSink(self), loop.time)

    def start_member(self) -> None:
        loop = asyncio.get_running_loop()
        self.unnoticed.clear()  # (a new member's consumer was told nothing)
        # Every clock the runner reads is the virtual loop's (monotonic and wall time), and
        # the core's random jitter is seeded from the schedule's.
        self.registry = CollectorRegistry()
        runner = GroupRunner(
            self.group_config(),
            ProxyMetrics(self.registry),
            self._open_edges,
            5.0,
            monotonic=loop.time,
            wall=lambda: WALL_EPOCH_S + loop.time(),
            rng=random.Random(self.rng.random()),
        )
        core = runner.partitions
        self.taken, self.calls, self.parked = set(), set(), set()
        self.began_with, self.given_back = {}, {}
        self.run_of, self.run_left, self.runs_made = {}, {}, set()
        self._spy(runner, core)
        self.runner = runner
        self._run_task = loop.create_task(runner.run(), name="sim:runner")

    def _spy(self, runner: GroupRunner, core: PartitionSet) -> None:
        """Follow each message through the shell: wrap the core's calls on this instance."""

        def wrap(name: str, after: Callable[..., None]) -> None:
            call = getattr(core, name)

            def wrapped(*args: Any) -> Any:
                result = call(*args)
                after(result, *args)
                return result

            setattr(core, name, wrapped)

        def dropped(stale: bool, d: Delivery) -> None:
            if stale:
                self.taken.discard(d)
                self.stats.stale_drops += 1
                if self._run_left(d, "expanded") is not None:
                    self.stats.run_messages_stale += 1  # a run's, expanded as it went stale

        def begun(began: bool, d: Delivery) -> None:
            self.taken.discard(d)
            before = self.given_back.pop(d, None)
            if began and self._run_left(d, "expanded") is not None:
                self.stats.run_messages_alone += 1  # a run's, expanded before its call
            if began:
                if before is not None and before != (d.attempt, d.counted_here):
                    self.fail(
                        f"message {_ident(d)}: a cancelled call counted as an "
                        f"attempt (attempt, counted) {before} -> {(d.attempt, d.counted_here)}"
                    )
                self.calls.add(d)
                self.began_with[d] = (d.attempt, d.counted_here)
                self._pushed(d)

        def finished(decision: Decision | None, d: Delivery, *_: Any) -> None:
            self.calls.discard(d)
            self._run_left(d, "failed")
            self.began_with.pop(d, None)
            self._decided(d, decision)

        def begun_batch(began: list[Ready], batch: list[Ready]) -> None:
            # Those ``begin_batch`` passed to ``begin`` were seen there already (a ``Run``
            # not begun as one: its messages, one by one).
            out = set(began)
            for d in batch:
                if isinstance(d, Run):
                    if d in out:
                        self._run_begun(d)
                elif d not in out:
                    begun(False, d)
                elif d not in self.calls:
                    begun(True, d)

        def finished_acked(all_acked: bool, batch: list[Ready], *_: Any) -> None:
            if all_acked:
                for d in batch:
                    if isinstance(d, Run):
                        self.calls.discard(d)
                        self.stats.runs_acked += 1
                        for one in d.deliveries():
                            self._decided(one, ACKED)
                            self.run_of.pop(self._where(one), None)
                    else:
                        finished(ACKED, d)

        def ended(_: Any, d: Delivery) -> None:
            self.calls.discard(d)
            self._run_left(d, "cancelled")
            # (a message of a run begun as one: as ``Run.deliveries`` made it)
            before = self.began_with.pop(d, None)
            self.given_back[d] = (1, 0) if before is None else before

        def made(items: Sequence[Ready]) -> None:
            for item in items:
                if isinstance(item, Run):
                    self.stats.runs_made += 1
                    self.runs_made.add(item)
                    for offset in item.offsets:
                        self.run_of[(item.part, item.epoch, offset)] = item

        def unparked(_: Any, d: Delivery) -> None:
            self.parked.discard(d)

        def unblocked(moved: list[tuple[Delivery, Decision]], *_: Any) -> None:
            for d, decision in moved:
                self.stats.unblocks += 1
                self._decided(d, decision)

        admit_run = core._admit_run

        def admitting(items: Sequence[Ready]) -> None:
            made(items)
            admit_run(items)

        core._admit_run = admitting
        wrap("drop_stale", dropped)
        wrap("unblock", unblocked)
        wrap("begin", begun)
        wrap("finish", finished)
        wrap("finish_acked", finished_acked)
        wrap("begin_batch", begun_batch)
        wrap("abandon", ended)
        wrap("truncated", lambda _, tp, *__: self.unnoticed.discard(tp))
        for name in ("dead_lettered", "dead_letter_abandoned", "tier_written", "tier_abandoned"):
            wrap(name, unparked)
        tally = runner._tally
        park = tally._park

        def parking(d: Delivery, decision: Decision, status: str, endpoint: str) -> None:
            self.parked.add(d)
            park(d, decision, status, endpoint)

        tally._park = parking
        ready = runner.ready
        if isinstance(ready, asyncio.Queue):
            get = ready.get

            async def taking() -> Delivery:
                d = await get()
                self.taken.add(d)
                return d

            setattr(ready, "get", taking)  # noqa: B010 (an instance attribute over a method)

    async def stop_member(self, crash: bool = False) -> None:
        runner, task, source = self.runner, self._run_task, self.source
        assert runner is not None and task is not None
        if crash and source is not None:
            source.crashed = True  # nothing is committed from now on
            self.crashing = True
            self.truth.dup_ok |= self.truth.acked
        self.trace(f"stop crash={crash}")
        runner.stop()
        await task
        self.crashing = False
        guard = runner.partitions.guard
        self.stats.guard_trips += guard.trips if guard is not None else 0
        self._count_long_calls()
        self.check_nothing_left()
        self.runner = self.source = self._run_task = None

    def _count_long_calls(self) -> None:
        """The member's streaming and cancelled calls, as its metrics counted them."""
        stats, sample = self.stats, self.registry.get_sample_value
        cancelled = "consumer_proxy_calls_cancelled_total"
        stats.heartbeats += int(
            sample("consumer_proxy_heartbeat_gap_seconds_count", {"group": GROUP}) or 0
        )
        stats.silences += int(sample(cancelled, {"group": GROUP, "cause": "heartbeat"}) or 0)
        stats.capped += int(sample(cancelled, {"group": GROUP, "cause": "max_processing"}) or 0)
        for cause in ("revoke", "lost", "shutdown"):
            stats.calls_cancelled += int(sample(cancelled, {"group": GROUP, "cause": cause}) or 0)

    def check_nothing_left(self) -> None:
        """After ``stop()``: no task of the group left, no timer scheduled."""
        me = asyncio.current_task()
        left = [t.get_name() for t in asyncio.all_tasks() if t is not me]
        if left:
            self.fail(f"tasks left running after stop(): {sorted(left)}")
        loop = asyncio.get_running_loop()
        timers = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]
        if timers:
            self.fail(f"{len(timers)} timers left scheduled after stop(): {timers[:3]}")

    # -- checks --------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        now = asyncio.get_running_loop().time()
        violation = InvariantViolation(
            f"shell seed {self.seed}, step {self.step_no}, t={now:.3f}s: {what} "
            f"(replay: python -m tests.sim --seed {self.seed})"
        )
        if self.failure is None:
            self.failure = violation
        raise violation

    def trace(self, line: str) -> None:
        now = asyncio.get_running_loop().time()
        self._trace.update(f"{now:.6f} {line}\n".encode())

    @property
    def digest(self) -> str:
        return self._trace.hexdigest()

    def turn(self, what: str, queued: float) -> None:
        """A call gets its turn on the consumer thread."""
        if what != "commit" or self.source is None:
            return
        waited = asyncio.get_running_loop().time() - queued
        # A commit that falls due during an idle wait is served at the end of the wait's
        # chunk (CONSUME_CHUNK_S); one due when the wait began, or while a sent commit's
        # answer was awaited then (the next one follows the answer), must not wait behind
        # it. (A rebalance served meanwhile waits for calls: up to revoke_grace_ms.)
        late = waited > FETCH_WAIT_S + 0.05 and self.rebalanced_at < queued
        if late and self.source.idle_while_due and not self._stopping():
            self.fail(
                f"a commit due since t={queued:.3f}s waited {waited:.3f}s behind an idle "
                "wait that began while it was due (or a sent commit's answer awaited)"
            )

    def _stopping(self) -> bool:
        runner = self.runner
        return runner is None or runner._stopping.is_set()

    def committed(self, tp: TP, offset: int, metadata: str, epoch: int | None = None) -> None:
        log = self.logs[tp]
        done = self.truth.done
        # A commit with a leader epoch is read back from where that epoch ends when the log
        # was cut below it since (KIP-320): it passes only what lies below that.
        passes = offset if epoch is None else min(offset, log.epoch_end(epoch))
        # (Records below ``log.done_below`` were checked done by an earlier commit, and a
        # record that is done stays done while it is in the log.)
        records = log.records
        for o in range(log.done_below, passes):
            msg = records.get(o)
            if msg is not None and msg.ident not in done:
                self.fail(f"commit {tp}@{offset} passes offset {o} (message {msg.ident} not done)")
        log.done_below = max(log.done_below, min(passes, log.end))  # (none unwritten)
        if metadata:
            state = decode(metadata)
            for o in range(state.base, state.end):
                found = log.records.get(o)
                if (
                    state.is_done(o)
                    and found is not None
                    and found.ident not in done
                    # a record written after a cut has a later leader epoch than the state:
                    # a reader drops the state when it fetches it
                    and not (state.epoch is not None and log.epochs[o] > state.epoch)
                ):
                    self.fail(f"commit metadata of {tp} marks {o} done (message {found.ident})")
        self.operator_epochless.discard(tp)  # the proxy's commit replaces the operator's
        if epoch is not None:
            self._count_backlog_epoch(tp, offset)
        last = self.last_commit.get(tp, 0)
        cut = self.cuts.get(tp)
        # Only a commit past the end of a cut log may be followed by one further back (it
        # may have been planned before the cut, or before the member noticed it: until then
        # its commits may go back to the cut and past it again).
        if offset < last and not (cut is not None and last > cut):
            self.fail(f"commit of {tp} goes back from {last} to {offset}")
        if cut is not None and offset <= cut and tp not in self.unnoticed:
            del self.cuts[tp]
        self.last_commit[tp] = offset
        self.stats.commits += 1
        self.trace(f"commit {tp} {offset} {metadata}")

    def _count_backlog_epoch(self, tp: TP, offset: int) -> None:
        """Count a commit whose epoch only the backlog knew (the tracker knew none)."""
        runner = self.runner
        part = runner.partitions.parts.get(tp) if runner is not None else None
        # (the offset the commit was planned for: asked again, the tracker forgets nothing)
        tracker = part.tracker if part is not None and part.backlog else None
        if tracker is not None and tracker.commit_epoch(offset) is None:
            self.stats.backlog_epoch_commits += 1

    @staticmethod
    def _where(d: Delivery) -> tuple[PartitionState, int, int]:
        """A message of a ``Run`` the core made: its partition, epoch and offset
        (``Run.deliveries`` makes new ``Delivery`` objects each time)."""
        return (d.part, d.epoch, d.offset)

    def _run_begun(self, run: Run) -> None:
        """A ``Run`` begun as one: each of its messages pushed."""
        self.stats.runs_begun += 1
        if run not in self.runs_made:
            self.stats.runs_split += 1  # the head of a run ``take`` split
        self.calls.add(run)
        self.run_left[run] = len(run.offsets)
        part, epoch = run.part, run.epoch
        for one in run.deliveries():
            self.run_of[(part, epoch, one.offset)] = run  # (the head of a split: its own)
            self._pushed(one)

    def _run_left(self, d: Delivery, why: str) -> Run | None:
        """``d``, a message of a ``Run`` the core made, begun, decided or given back on its
        own: its run's call (when the run was begun as one: the call failed or was
        cancelled) no longer holds it. The run it was made in, or None."""
        run = self.run_of.pop(self._where(d), None)
        if run is None or run not in self.run_left:
            return run
        left = self.run_left[run] - 1
        if left == len(run.offsets) - 1:
            if why == "failed":
                self.stats.runs_failed += 1
            else:
                self.stats.runs_cancelled += 1
        if left:
            self.run_left[run] = left
        else:
            del self.run_left[run]
            self.calls.discard(run)
        return run

    def allow_dups(self, tp: TP) -> None:
        for msg in self.logs[tp].records.values():
            if msg.ident in self.truth.acked:
                self.truth.dup_ok.add(msg.ident)

    def _lane(self, tp: TP, key: bytes | None) -> tuple[TP, object]:
        return (tp, key if self.ordering == "key" else "*")

    def _pushed(self, d: Delivery) -> None:
        ident = _ident(d)
        truth = self.truth
        self.stats.pushes += 1
        self.trace(f"push {ident} attempt {d.attempt}")
        if ident in truth.acked and ident not in truth.dup_ok:
            self.fail(f"message {ident} pushed again after it was acked")
        root = self.root.get(ident, ident)
        truth.attempts[root] = truth.attempts.get(root, 0) + 1
        if self.outage == "hung":
            self.hung_pushes.add(root)
        if self.ordering == "none":
            return
        tp = d.part.tp
        here = self.logs[tp].records.get(d.offset)
        if here is None or here.ident != ident:
            return  # cut from the log since it was fetched (the member not told yet): gone
        lane = self._lane(tp, d.key)
        for other in expand(self.calls):  # (no ``Run`` with an ordering gate)
            if (
                other is not d
                and not other.stale
                and other.part.tp == tp
                and self._lane(tp, other.key) == lane
                and other.offset != d.offset
            ):
                self.fail(f"{tp}@{d.offset} pushed while @{other.offset} of its key is in flight")
        entries = self.lanes.get(lane, [])
        head = self.lane_head.get(lane, 0)
        while head < len(entries) and entries[head][1] in truth.done:
            head += 1
        self.lane_head[lane] = head
        if head < len(entries) and entries[head][0] < d.offset:
            self.fail(f"{tp}@{d.offset} pushed before @{entries[head][0]} of its key is done")

    def _decided(self, d: Delivery, decision: Decision | None) -> None:
        if decision is None:
            return
        ident = _ident(d)
        truth = self.truth
        action = decision.action
        self.trace(f"decided {ident} {action.value}")
        guard = self.runner.partitions.guard if self.runner is not None else None
        reason = decision.reason
        if decision.counted and (reason == "deadline" or reason.startswith("no heartbeat")):
            # a deadline or silence charged while the service answered others (guarantee 2:
            # at the start of a hang too): the message's own attempt
            self.charged.add(self._root(ident))
        if action is Action.ACK:
            truth.acked.add(ident)
            truth.done.add(ident)
            self.stats.acked += 1
            if self.crashing:
                truth.dup_ok.add(ident)
            if d.guard_probe and guard is not None and guard.held and not guard.by_operator:
                self.fail(f"message {ident}, a probe of the guard, was acked: still held")
        elif action is Action.DROP:
            truth.done.add(ident)
        elif action is Action.HOLD:
            self.stats.guard_held += 1
        elif action is Action.DEAD_LETTER:
            if guard is not None and guard.held:
                self.fail(f"message {ident} dead-lettered while the dead-letter guard holds")
            behaviour = truth.behaviour[ident]
            past_tiers = bool(self.tier_delays_ms) and (
                "last retry tier" in decision.reason or "blocked the head" in decision.reason
            )
            # A garbled message's broken answer, once alone, is its own counted failure.
            # Past the tiers: a flaky or long message, or one that went to a tier by a charge.
            root = self._root(ident)
            tiered = behaviour.startswith(("flaky:", "long:")) or root in self.tiered
            # Its own failures and charged ones (a flaky message's last ones at hang starts).
            charged = behaviour.startswith(("flaky:", "long:")) and root in self.charged
            if not (
                behaviour.startswith(("poison", "timeout:", "garbled", "endless"))
                or (past_tiers and tiered)
                or charged
                or ident in truth.rejected  # by a bad deploy, before the guard tripped
            ):
                self.fail(f"message {ident} ({behaviour}) dead-lettered ({decision.reason})")
        elif action is Action.TIER:
            if not self.tier_delays_ms or not decision.counted:
                self.fail(f"message {ident} moved to tier {decision.tier} ({decision})")
            # A deadline or a silence charged while the service answered others is the
            # message's attempt (guarantee 2), also at the start of a hang, and so is blocking
            # the head for head_block_ms; nothing else moves a good message.
            reason = decision.reason
            charged = (
                reason == "deadline"
                or "blocked the head" in reason
                or reason.startswith("no heartbeat")
            )
            behaviour = truth.behaviour[ident]
            if not behaviour.startswith(("flaky:", "timeout:", "garbled", "endless")) and not (
                charged
            ):
                self.fail(f"message {ident} ({behaviour}) moved to a retry tier ({decision})")
            self.tiered.add(self._root(ident))
        elif action is not Action.RETRY:
            self.fail(f"message {ident}: unexpected decision {decision}")

    def tier_written(self, ident: int, tp: TP, record: Msg) -> None:
        """A tier write confirmed: the record is in the tier's log under a new ident (its
        behaviour and attempts the produced message's), and only now is the source done."""
        new = self.next_ident
        self.next_ident += 1
        self.root[new] = self.root.get(ident, ident)
        behaviour = self.truth.behaviour[ident]
        self.truth.behaviour[new] = behaviour
        self.logs[tp].append(
            Msg(new, behaviour, key=record.key, value=record.value, extra=record.extra)
        )
        self.truth.done.add(ident)
        self.stats.tier_writes += 1
        self.trace(f"tier {ident} -> {new} {tp}")
        if self.source is not None:
            self.source.arrived.set()

    def dead_lettered(self, ident: int, status: str) -> None:
        # (with retry tiers, head_block_ms may move it aside first: the same limit, sooner;
        # pushed to a dead instance, its last attempt may be a silence charged at the start
        # of the hang)
        charged = ("DEADLINE_EXCEEDED",) if self._root(ident) in self.hung_pushes else ()
        if self.truth.behaviour[ident] == "endless" and status not in (
            MAX_PROCESSING_STATUS,
            HEAD_BLOCKED,
            *charged,
        ):
            self.fail(f"endless message {ident} dead-lettered as {status}, not by the cap")
        self.truth.done.add(ident)
        self.stats.dead_lettered += 1
        self.trace(f"dlq {ident}")

    def check(self) -> None:
        runner = self.runner
        if runner is None or self._stopping():
            return
        core = runner.partitions
        for part in core.parts.values():
            if part.tracker is not None and part.tracker.in_flight > self.max_in_flight:
                self.fail(f"{part.tp} holds {part.tracker.in_flight} offsets in flight")
        slack = self.value_max + 16
        for budget in core.budgets:
            if budget.held > BYTE_BUDGET + slack:
                self.fail(f"{budget.held} bytes held over the {BYTE_BUDGET}-byte budget")
        breaker_open = runner.breaker.is_open
        for part in core.parts.values():
            # pause_plan's short cut says what the reasons the console shows say
            reasons = core._pause_reasons(part, breaker_open)
            kind = 2 if not ROOM_REASONS.isdisjoint(reasons) else 1 if reasons else 0
            if core._pause_kind(part, breaker_open) != kind:
                self.fail(f"{part.tp}: pause_plan's kind disagrees with its reasons {reasons}")
        held = 0
        for part in core.parts.values():
            gate, tracker = part.gate, part.tracker
            if gate is None or tracker is None:
                continue
            held += gate.held
            if gate.keys_out + gate.held != tracker.pending:
                self.fail(
                    f"{part.tp}: {tracker.pending} offsets pending but the gate holds "
                    f"{gate.keys_out} out and {gate.held} waiting"
                )
        self.stats.held_back += held > 0
        calls = len(runner.push.pushing) if runner.push is not None else 0
        if calls > self.concurrency:
            self.fail(f"{calls} calls over concurrency {self.concurrency}")
        self.check_bytes(runner, core)

    def check_bytes(self, runner: GroupRunner, core: PartitionSet) -> None:
        """Each partition's byte count is the sum of the messages held for it, wherever the
        shell holds them; each budget is the sum of its partitions' counts."""
        ready = runner.ready
        queued = expand(ready.items) if isinstance(ready, ReadyDeque) else list(ready._queue)  # type: ignore[attr-defined]
        places: list[Sequence[Delivery]] = [
            queued,
            list(self.taken),
            expand(d for d in self.calls if isinstance(d, Run) or not d.moved),
            list(self.parked),
        ]
        for part in core.parts.values():
            places.append([d for d, _ in part.retrying.values()])
            places.append([d for d, _ in part.due.values()])
            places.append([held.delivery for held in part.held.values()])
            if part.gate is not None:
                places.append(list(part.gate.waiting_items()))
        held: dict[int, Delivery] = {}
        for place in places:
            for d in place:
                held[id(d)] = d
        sums: dict[int, int] = {}
        for d in held.values():
            sums[id(d.part)] = sums.get(id(d.part), 0) + d.size
        budgets = {id(budget): 0 for budget in core.budgets}
        for part in core.parts.values():
            budgets[id(part.budget)] += part.bytes
            if part.leaving:
                continue  # a revoke gives back what its refused messages held
            if part.bytes != sums.get(id(part), 0):
                self.fail(
                    f"{part.tp} counts {part.bytes} bytes but its messages still held add up "
                    f"to {sums.get(id(part), 0)} (a message left without giving them back)"
                )
        if any(budget.held != budgets[id(budget)] for budget in core.budgets):
            self.fail(f"the budgets ({core.bytes} bytes) are not the sum of their partitions'")
        # ... and the backlogs' bytes (records fetched, not taken in) are exactly theirs too
        waiting = {id(budget): 0 for budget in core.budgets}
        for part in core.parts.values():
            size = sum(
                len(r.key() or b"")
                + len(r.value() or b"")
                + sum(len(name) + len(data or b"") for name, data in r.headers() or ())
                for r in part.backlog
            )  # (key, value and headers: a producer's bytes may all be in its headers)
            if part.backlog_bytes != size:
                self.fail(f"{part.tp}'s backlog counts {part.backlog_bytes} bytes, holds {size}")
            waiting[id(part.budget)] += size
        if any(budget.waiting != waiting[id(budget)] for budget in core.budgets):
            self.fail("the budgets' waiting bytes are not the sum of the backlogs'")

    # -- the service ---------------------------------------------------------------------

    def _behave(self, ident: int) -> tuple[grpc.StatusCode, int]:
        """The service's answer for one message: (status, response action)."""
        if self.bad_deploy and self.outage not in ("unavailable", "hung"):
            self.truth.rejected.add(ident)
            return grpc.StatusCode.INVALID_ARGUMENT, 0
        return service_answer(self.truth.behaviour[ident], self._tries(ident), self.outage)

    def _tries(self, ident: int) -> int:
        """Attempts of the produced message (across its tier records)."""
        return self.truth.attempts.get(self._root(ident), 0)

    def _root(self, ident: int) -> int:
        """The produced message a tier record stands for (itself if produced)."""
        return self.root.get(ident, ident)

    def answer(self, ident: int) -> tuple[Classification, float]:
        """One unary call's result and how long it takes."""
        return service_unary_call(
            self.classifier, self.rng, self.outage, self._behave(ident), TIMEOUT_S
        )

    def stream(self, ident: int, interval_s: float) -> Stream:
        """One streaming call as the service plays it (``delivery.long_running``)."""
        rng = self.rng
        behaviour = self.truth.behaviour[ident]
        code, action = self._behave(ident)
        beat = interval_s * rng.uniform(0.5, 1.05)  # the SDK's pace, give or take
        if self.outage == "hung" or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # a dead instance, or a hung handler: heartbeats a while, then nothing
            return Stream([(beat, BEAT)] * rng.randint(0, 4), interval_s)
        if self.outage == "unavailable":
            return Stream([(0.001, grpc.StatusCode.UNAVAILABLE)], interval_s)
        if behaviour == "endless":
            return Stream([], beat, endless=True)
        took = float(behaviour[5:]) if behaviour.startswith("long:") else rng.uniform(0.001, 0.05)
        steps: list[tuple[float, Any]] = [(beat, BEAT)] * int(took / beat)
        last = took - beat * len(steps)
        if code != grpc.StatusCode.OK:
            steps.append((last, code))
        else:
            response = handler_pb2.HandleMessageResponse(action=action)  # type: ignore[arg-type]
            steps.append((last, handler_pb2.HandleMessageStreamEvent(result=response)))
        return Stream(steps, interval_s)

    def answer_batch(self, idents: list[int]) -> tuple[BatchOutcome, float]:
        """One batch call's outcome (per-message statuses, a failed call, a glitch)."""
        outcome, latency, wrong = service_batch_call(
            self.classifier,
            self.rng,
            self.outage,
            idents,
            self._behave,
            TIMEOUT_S,
            garbled=lambda ident: self.truth.behaviour[ident] == "garbled",
        )
        self.stats.protocol_errors += wrong
        return outcome, latency

    # -- the schedule --------------------------------------------------------------------

    def produce(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(1, 12)):
            tp = rng.choice(self.tps)
            x = rng.random()
            behaviour = (
                "poison"
                if x < 0.03
                else f"timeout:{rng.randint(1, 8)}"
                if x < 0.04
                else "drop"
                if x < 0.05
                else f"flaky:{rng.randint(1, 3)}"
                if x < 0.12
                else "ok"
            )
            if self.batch is not None and behaviour == "ok" and rng.random() < 0.01:
                behaviour = "garbled"  # any batch answer with it has one result too few
                self.stats.garbled += 1
            long_running = self.long_running
            if long_running is not None and behaviour == "ok":
                y = rng.random()
                if y < 0.15:  # several heartbeat timeouts long, within the cap
                    took = rng.uniform(0.5, 0.8) * long_running.max_processing_ms / 1000
                    behaviour = f"long:{took:.3f}"
                elif y < 0.16:
                    behaviour = "endless"
            key = rng.choice(self.keys) if self.ordering != "none" else None
            value = b"v" * rng.randint(0, 40)
            if self.value_max > 40 and rng.random() < 0.3:
                value = b"v" * rng.randint(0, 300)
            ident = self.next_ident
            if self.headless.random() < HEADLESS_SHARE:  # its id in its value: a run's record
                msg = Msg(ident, behaviour, key=key, value=ident_value(ident, value), headed=False)
            else:
                msg = Msg(ident, behaviour, key=key, value=value)
            self.truth.behaviour[msg.ident] = behaviour
            self.next_ident += 1
            log = self.logs[tp]
            log.append(msg, gap=1 if rng.random() < 0.05 else 0)
            self.lanes.setdefault(self._lane(tp, key), []).append((log.end - 1, msg.ident))
            self.stats.produced += 1
            if log.end <= self.hidden.get(tp, -1):
                self.truth.done.add(msg.ident)  # skipped (``assigned``)
                self.stats.hidden_by_reset += 1
        if self.source is not None:
            self.source.arrived.set()

    def rebalance(self) -> None:
        source = self.source
        if source is None:
            return
        owned = self.all_tps
        tps = self.rng.sample(owned, self.rng.randint(1, len(owned)))
        lost = self.losses.random() < 0.2
        source.pending.append((sorted(tps), lost))
        source.arrived.set()
        self.stats.rebalances += 1
        self.stats.losses += lost

    def truncate(self) -> None:
        """An unclean leader election cuts a log at or above its commit (a fifth of the
        times below it: ``told_below``); the member is told (a _LOG_TRUNCATION error from
        consume) when the cut is below what it received."""
        rng = self.rng
        tp = rng.choice(self.tps)
        log = self.logs[tp]
        floor = self.commits.get(tp, (0, ""))[0]
        if log.end <= floor or (self.source is not None and self.source.rebalancing):
            # Not while a revoke waits for its calls (the member hears of the cut only after
            # it, and its final commit may pass records written after the cut; the leader
            # epoch it carries makes the next owner seek back: ``cut_at_handover`` cuts
            # below commits to check that).
            return
        cut = rng.randint(floor, log.end - 1)
        if floor > 0 and self.told_below.random() < self.told_below_share:
            # Below the commit: the member received past it, so its consumer finds the cut.
            cut = self.told_below.randint(max(0, floor - 8), floor - 1)
            self.stats.told_cuts_below_commit += 1
        self.cut_log(tp, cut)

    def operator_reset(self) -> None:
        """Between two members, an operator resets a partition to its committed offset
        (``kafka-consumer-groups --reset-offsets --to-current``): the commit is written again
        with no leader epoch. A cut below it is then hidden from the next owner (KIP-320
        needs the epoch), until the proxy commits the partition again with one."""
        tps = sorted(tp for tp in self.tps if tp in self.commit_epochs)
        if not tps:
            return
        tp = self.resets.choice(tps)
        del self.commit_epochs[tp]
        self.operator_epochless.add(tp)
        self.stats.epochless_resets += 1
        self.trace(f"reset {tp} without epoch")

    def assigned(self, committed: Sequence[tuple[TP, int | None, str, int | None]]) -> None:
        """The member's consumer was assigned these committed offsets and epochs. One with no
        epoch cannot find a cut below it: the records written there since the cut, and those
        written there from now on, are skipped. Only an operator's reset may leave such a
        commit; the proxy commits with an epoch whenever it holds a record it fetched
        (``partitions._commit_epoch``)."""
        for tp, offset, _, epoch in committed:
            if offset is None or epoch is not None:
                continue
            log, done = self.logs[tp], self.truth.done
            hidden = [m.ident for o, m in log.records.items() if o < offset and m.ident not in done]
            if not hidden and log.end >= offset:
                continue
            if tp not in self.operator_epochless:
                self.fail(
                    f"{tp} is assigned at {offset} with no leader epoch, below which the log "
                    f"was cut (its end {log.end}, {len(hidden)} records not done): the next "
                    "owner skips what is written there"
                )
            done.update(hidden)  # the operator's doing: no consumer can find them
            self.stats.hidden_by_reset += len(hidden)
            if log.end < offset:
                self.hidden[tp] = offset  # ... nor those written below it from now on

    def cut_log(self, tp: TP, cut: int) -> None:
        """Cut ``tp``'s log at ``cut``; the member is told (a _LOG_TRUNCATION error from
        consume) only when it owns ``tp`` and received records at or past the cut:
        otherwise librdkafka seeks back silently."""
        log = self.logs[tp]
        self.hidden.pop(tp, None)
        for msg in log.truncate(cut):
            self.truth.done.discard(msg.ident)  # gone: no longer owed to anyone
        for lane, entries in self.lanes.items():
            if lane[0] == tp:
                entries[:] = [e for e in entries if e[0] < cut]
                self.lane_head[lane] = 0
        self.allow_dups(tp)  # the ack state above the fetch position is dropped
        self.cuts[tp] = min(cut, self.cuts.get(tp, cut))
        self.stats.truncations += 1
        self.trace(f"truncate {tp} {cut}")
        source, runner = self.source, self.runner
        if source is None or runner is None:
            return
        source.consumer.truncated(tp, cut)
        part = runner.partitions.parts.get(tp)
        if part is not None and cut < part.received_end:
            source.told(tp)
            self.unnoticed.add(tp)
        else:
            self.stats.silent_truncations += 1

    def cut_at_handover(self, tps: Sequence[TP]) -> None:
        """An unclean election while partitions change hands (served between the revoke's
        final commit and the assignment): the new owner restores an ack state that may
        describe records that are gone, and is not told."""
        rng = self.handovers
        sources = [tp for tp in tps if tp in self.tps]
        if not sources or rng.random() >= self.handover_cuts:
            return
        tp = rng.choice(sources)
        committed, meta = self.commits.get(tp, (0, ""))
        if committed > 0 and self.below.random() < self.below_share:
            # Below the commit: records written there after the cut come only if the new
            # owner's client validates the commit's leader epoch and seeks back (KIP-320).
            self.cut_log(tp, self.below.randint(max(0, committed - 8), committed - 1))
            self.stats.handover_truncations += 1
            self.stats.cuts_below_commit += 1
            return
        top = min(decode(meta).end, self.logs[tp].end) - 1 if meta else committed
        if top > committed:  # inside the range the restored state describes
            self.cut_log(tp, rng.randint(committed + 1, top))
            self.stats.handover_truncations += 1

    async def step(self) -> None:
        self.step_no += 1
        rng = self.rng
        x = rng.random()
        if x < 0.35:
            self.produce()
        elif x < 0.38:
            self.rebalance()
        elif x < 0.39:
            crash = rng.random() < 0.3
            await self.stop_member(crash)
            self.stats.crashes += crash
            self.stats.restarts += not crash
            self.budget = self.budgets.choice([64, 4000])
            if self.resets.random() < self.reset_share:
                self.operator_reset()
            self.start_member()
        elif x < 0.40:
            outages = ["unavailable", "hung"] + (["unimplemented"] if self.batch else [])
            self.outage = None if self.outage else rng.choice(outages)
            self.stats.outages += self.outage is not None
        elif x < 0.41:
            self.dlq_down = not self.dlq_down
            self.stats.dlq_outages += self.dlq_down
        elif x < 0.415:
            self.commits_down = not self.commits_down
            self.stats.commit_outages += self.commits_down
        elif x < 0.425:
            self.truncate()
        elif x < 0.43:
            self.bad_deploy = not self.bad_deploy
            self.stats.bad_deploys += self.bad_deploy
        elif x < 0.4305:
            self.operator_release()
        wait = rng.uniform(0.0, 0.25) if rng.random() < 0.95 else rng.uniform(1.0, 8.0)
        await asyncio.sleep(wait)
        self._raise_failure()
        self.check()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure
        task = self._run_task
        if task is not None and task.done():
            task.result()  # the group failed: its exception is the finding
            self.fail("the group stopped by itself")

    def operator_release(self) -> None:
        """An operator releases a held guard (``GuardControl.release``, as the admin
        endpoint): the held messages go to the DLQ."""
        runner = self.runner
        if runner is None:
            return
        held = [h.delivery for p in runner.partitions.parts.values() for h in p.held.values()]
        released = runner.guard.release()
        self.stats.guard_releases += bool(released)
        self.truth.released.update(_ident(d) for d in held)
        self.trace(f"release {released}")

    def _only_real_poison_held(self) -> bool:
        """Every message the guard holds fails on its own next time too: no probe can
        release it (an operator must)."""
        assert self.runner is not None
        for part in self.runner.partitions.parts.values():
            for held in part.held.values():
                ident = _ident(held.delivery)
                behaviour = self.truth.behaviour[ident]
                if behaviour.startswith(("poison", "garbled", "endless")):
                    continue
                if behaviour.startswith(("flaky:", "timeout:")) and self._tries(ident) < int(
                    behaviour.split(":")[1]
                ):
                    continue
                return False
        return True

    def _watch_guard(self, now: float) -> None:
        """While draining: a guard holding a message the service now acks is released by a
        probe (every 0.5 s) within seconds; one holding only real poison by an operator."""
        guard = self.runner.partitions.guard if self.runner is not None else None
        if guard is not None and guard.held and not self._only_real_poison_held():
            self._recoverable_since = self._recoverable_since or now
            if now - self._recoverable_since >= 30.0:
                self.fail("the dead-letter guard still holds 30 s after the service recovered")
        else:
            self._recoverable_since = None
            if now >= self._operator_at:
                self.operator_release()

    def _serial_work_s(self) -> float:
        """What the long-running handlers left to do take one after another (ordering
        partition pushes them so): each long one its time, each endless one every attempt
        up to the cap."""
        if self.long_running is None:
            return 0.0
        cap_s = self.long_running.max_processing_ms / 1000
        work = 0.0
        for tp in self.tps:
            committed = self.commits.get(tp, (0, ""))[0]
            for offset, msg in self.logs[tp].records.items():
                if offset < committed:
                    continue
                if msg.behaviour.startswith("long:"):
                    work += float(msg.behaviour[5:])
                elif msg.behaviour == "endless":
                    work += 5 * (cap_s + 0.5)  # max_attempts, each with its backoff
        return work

    def _source_commits(self) -> list[int]:
        return [self.commits.get(tp, (0, ""))[0] for tp in self.tps]

    def _drained(self, tps: Sequence[TP]) -> bool:
        return all(self.commits.get(tp, (0, ""))[0] >= self.logs[tp].end for tp in tps)

    def _lag(self) -> str:
        lag = {tp: (self.commits.get(tp, (0, ""))[0], self.logs[tp].end) for tp in self.all_tps}
        paused = sorted(self.source.consumer.paused) if self.source else []
        views = self.runner.partitions.views() if self.runner is not None else []
        why = {(v.topic, v.partition): v.reasons for v in views if v.reasons}
        return f"(committed, end) {lag}; paused in the consumer: {paused}, by the core: {why}"

    async def drain(self) -> None:
        """Heal everything; the source partitions must drain within DRAIN_LIMIT_S of virtual
        time whatever the retry tiers hold (records waiting an hour for their due time must
        not hold the source back), the tiers once their records are due too."""
        self.outage = None
        self.dlq_down = False
        self.commits_down = False
        self.bad_deploy = False  # rolled back: a probe's ack releases a held guard
        loop = asyncio.get_running_loop()
        self._operator_at = loop.time() + 60.0  # ... unless every held one is real poison
        self._recoverable_since = None
        source_deadline = loop.time() + DRAIN_LIMIT_S + self._serial_work_s()
        # (a message may go through every tier after the source drained)
        deadline = source_deadline + sum(self.tier_delays_ms) / 1000.0 + DRAIN_LIMIT_S
        sources_drained = False
        progress, progress_at = self._source_commits(), loop.time()
        while not self._drained(self.all_tps):
            now = loop.time()
            if not sources_drained:
                sources_drained = self._drained(self.tps)
                if not sources_drained and now >= source_deadline:
                    self.fail(
                        f"source partitions did not drain in {DRAIN_LIMIT_S:.0f}s: {self._lag()}"
                    )
                # A stall shows long before the limit: no source commit moves for a while.
                if self._source_commits() != progress:
                    progress, progress_at = self._source_commits(), now
                elif not sources_drained and now - progress_at >= STALL_S:
                    self.fail(f"no source commit moved for {STALL_S:.0f}s: {self._lag()}")
            if now >= deadline:
                self.fail(f"partitions did not drain in time: {self._lag()}")
            self._watch_guard(now)
            # Once the source drained, only tier records waiting for their due time are left.
            await asyncio.sleep(0.5 if not sources_drained else 5.0)
            self._raise_failure()
            self.check()
        for tp, log in self.logs.items():
            for o, msg in log.records.items():
                if msg.ident not in self.truth.done:
                    self.fail(f"message {msg.ident} at {tp}@{o} was never done")

    async def run(self, steps: int) -> ShellStats:
        self.start_member()
        for _ in range(steps):
            await self.step()
        await self.drain()
        await self.stop_member()
        self.stats.steps = steps
        self.stats.virtual_s = int(asyncio.get_running_loop().time())
        return self.stats


def run_shell(seed: int, steps: int) -> tuple[ShellStats, str]:
    """One schedule through the real shell, then the drain and a graceful stop; returns its
    stats and trace digest; raises InvariantViolation."""
    sim = ShellSim(seed)
    stats = run_virtual(sim.run(steps))
    return stats, sim.digest


__all__ = ["ShellSim", "ShellStats", "run_shell"]
