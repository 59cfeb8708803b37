"""Seeded random schedules driving the real core (PartitionSet, decide, Breaker, Classifier).

One member of a group works a topic of a few partitions while the schedule produces records
(with gaps), rebalances (graceful revoke and re-assign to the same member), restarts (with a
different metadata budget: pods of a config roll), crashes, truncates logs, takes the
service down (UNAVAILABLE or hung) and the DLQ. Half the schedules push in batch mode
(``core.batching``: batches taken from the ready messages up to a count and a byte cap, answers
with per-message results and statuses, failed calls, UNIMPLEMENTED, wrong-length answers,
one breaker record per call). Invariants are checked at every step:

- a commit never passes an offset whose record is not done, nor marks one done in metadata;
- commits never go backwards for an owned partition (except after a detected log reset);
- nothing acked is delivered again unless a crash (or a state over the metadata budget at a
  graceful hand-over) allowed it;
- no message is dead-lettered because of an outage (only poison ones, and ones that time out
  several times while the service answers others, or, with retry tiers, that failed past the
  last tier); no message moves to a retry tier because of an outage (only counted failures:
  its own, or a deadline charged while the service answered others);
- with retry tiers (half the seeds of ordering none; tier writes fail while the DLQ is down):
  a source offset is done only once its tier record is written (the commit invariant above,
  since the message counts as done only then), and every tier record is done in the end;
- in-flight offsets and bytes stay within their bounds, and each partition's byte count is
  exactly the sum of the messages still held for it (ready, in a call, in a DLQ or tier
  write, waiting for a retry or a due time, or behind its key): a message that leaves by any
  path gives its bytes back;
- the positions given to ``skip_unfetchable`` are the shell's: re-read now and then, not
  after every fetch, so they may predate a log cut (a reading numbered as the shell does);
- an unclean leader election may cut a log while the partition changes hands; librdkafka
  does not tell the member (it seeks back silently), so the new owner restores an ack state
  that describes records that are gone;
- a third of the seeds with retry tiers wait far longer (a minute, an hour) than the run:
  with a healthy service the source partitions still drain within the drain limit, and the
  tiers once their records are due;
- in batch mode a few messages make any batch answer have the wrong length: they end in the
  DLQ (counted failures once alone), never in an endless uncounted loop;
- with ``delivery.ordering`` key or partition (a third of the seeds each): no two messages of
  one key (lane) are in flight at once, and a message is pushed only when every earlier
  message of its key in its partition is done (so per-key push order is offset order, a
  redelivery of the same offset after a crash or rebalance allowed); every tracked, pending
  offset is in the partition's gate (out or waiting), so none is forgotten there;
- liveness: after the schedule, with a healthy service, every partition drains (its commit
  reaches the log end) within a bounded virtual time.

Replay a failing seed with ``python -m tests.sim --seed N``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from consumer_proxy.config import (
    BackoffConfig,
    CircuitBreakerConfig,
    DeadLetterGuardConfig,
    DeliveryConfig,
    RetryTopicConfig,
)
from consumer_proxy.core.batching import (
    BatchLimits,
    take,
)
from consumer_proxy.core.codec import decode
from consumer_proxy.core.decision import Action, Decision
from consumer_proxy.core.ordering import ORDERINGS, Ordering
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.core.partitions import Delivery, PartitionSet
from consumer_proxy.core.records import CP_PREFIX, retry_headers
from consumer_proxy.flow import Breaker
from tests.sim.world import (
    ACKED,
    TP,
    Consumer,
    Log,
    Msg,
    service_answer,
    service_batch_call,
    service_unary_call,
)
from tests.support.clock import Clock, Timer

TOPIC = "t"
REDRIVE = "g.redrive"
TIMEOUT_S = 1.0
DRAIN_LIMIT_S = 600.0
BYTE_BUDGET = 1024  # the smallest max_in_flight_bytes the config allows


class InvariantViolation(AssertionError):
    """An invariant failed; the message names the seed and step."""


@dataclass
class Stats:
    """What a run did (to see that schedules exercise what they should)."""

    steps: int = 0
    produced: int = 0
    acked: int = 0
    dead_lettered: int = 0
    rebalances: int = 0
    restarts: int = 0
    crashes: int = 0
    truncations: int = 0
    outages: int = 0
    pauses: int = 0
    resets: int = 0
    held_back: int = 0  # steps at which the ordering gate held messages back
    batch_schedules: int = 0
    batch_calls: int = 0
    batched_messages: int = 0
    protocol_errors: int = 0
    tier_schedules: int = 0
    tier_writes: int = 0
    unblocks: int = 0
    unblocks_in_outage: int = 0
    stale_readings: int = 0  # fetches whose positions were an older reading (as the shell's)
    silent_truncations: int = 0  # cuts the member was not told of (librdkafka seeks silently)
    handover_truncations: int = 0  # ... while a restored ack state described the cut range
    long_tier_schedules: int = 0
    garbled: int = 0  # messages that make any batch answer have the wrong length
    bad_deploys: int = 0  # spells of a service that rejects every message (INVALID_ARGUMENT)
    guard_trips: int = 0
    guard_held: int = 0  # dead-letter decisions the guard held
    guard_releases: int = 0  # by an operator (a probe's ack releases it too)


@dataclass
class Truth:
    """Ground truth about every message."""

    behaviour: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)  # acked, dropped or confirmed in the DLQ
    acked: set[int] = field(default_factory=set)
    dlq: list[int] = field(default_factory=list)
    dup_ok: set[int] = field(default_factory=set)  # may be delivered again (crash, budget)
    attempts: dict[int, int] = field(default_factory=dict)
    rejected: set[int] = field(default_factory=set)  # rejected by a bad deploy at least once
    released: set[int] = field(default_factory=set)  # held, then sent to the DLQ by an operator


class Member:
    """One proxy process: the core, a breaker and the calls it has under way."""

    def __init__(self, sim: Simulation, budget: int) -> None:
        self.sim = sim
        self.ready: deque[Delivery] = deque()
        self.calls: dict[tuple[Delivery, ...], Timer] = {}  # one entry per call
        self.dlq_writes: dict[Delivery, Timer] = {}
        self.breaker = Breaker(
            "g", CircuitBreakerConfig(failure_threshold=5, reset_timeout_s=2.0), clock=sim.clock
        )
        config = DeliveryConfig(
            max_in_flight=sim.max_in_flight,
            max_in_flight_bytes=BYTE_BUDGET,
            max_attempts=5,
            metadata_budget_bytes=budget,
            backoff=BackoffConfig(initial_ms=10, max_ms=500),
            ordering=sim.ordering,
            retry_topics=[RetryTopicConfig(delay_ms=d) for d in sim.tier_delays_ms],
            in_memory_attempts=sim.in_memory_attempts,
            head_block_ms=sim.head_block_ms,
            max_unblock_per_minute=sim.max_unblock,
        )
        guard = DeadLetterGuardConfig(min_messages=20, window_ms=10_000, probe_interval_ms=500)
        self.core = PartitionSet(
            "g",
            config,
            REDRIVE,
            self.breaker,
            emit=self.ready.append,
            schedule=sim.clock.call_later,
            rng=random.Random(sim.rng.random()),
            retry_topics=[f"g.retry.{n}" for n in range(1, len(sim.tier_delays_ms) + 1)],
            clock=sim.clock,
            guard=guard,
        )


class Simulation:
    """One seeded schedule."""

    def __init__(self, seed: int, partitions: int = 3, ordering: Ordering | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        # Ordering and keys come from their own streams, so the schedule of a seed is the same
        # whatever its ordering.
        self.ordering: Ordering = ordering or ORDERINGS[seed % len(ORDERINGS)]
        self.key_rng = random.Random(f"keys:{seed}")
        self.keys: list[bytes | None] = [b"k%d" % i for i in range(self.key_rng.choice([1, 3, 8]))]
        self.keys.append(None)  # the no-key lane
        # Per (tp, lane): the (offset, ident) of its messages in the log, and the index of
        # the first one not known done (done only grows, except by log truncation).
        self.lanes: dict[tuple[TP, object], list[tuple[int, int]]] = {}
        self.lane_head: dict[tuple[TP, object], int] = {}
        self.clock = Clock()
        self.classifier = Classifier()
        self.truth = Truth()
        self.stats = Stats()
        self.max_in_flight = self.rng.choice([4, 8, 32, 256])
        self.concurrency = self.rng.choice([1, 3, 8])
        # Its own generator, so the unary schedules of every seed stay what they were.
        mode = random.Random(seed * 7919 + 13)
        self.batch: BatchLimits | None = (
            BatchLimits(mode.choice([1, 2, 5, 50]), mode.choice([16, 60, 1000]))
            if mode.random() < 0.5
            else None
        )
        self.stats.batch_schedules = self.batch is not None
        self.tps: list[TP] = [(TOPIC, p) for p in range(partitions)]
        # Retry tiers from their own generator too (ordering none only: config rejects both).
        tiers = random.Random(f"tiers:{seed}")
        self.tier_delays_ms: list[int] = []
        self.in_memory_attempts = 1
        self.head_block_ms: int | None = None
        self.max_unblock = 10
        if self.ordering == "none" and tiers.random() < 0.5:
            # A third wait far longer than the run: their records sit in the tiers' budget.
            self.tier_delays_ms = tiers.choice(
                [[300], [100, 800], [50, 200, 1000], [60_000], [500, 3_600_000], [600_000]]
            )
            self.in_memory_attempts = tiers.choice([1, 2])
            self.head_block_ms = tiers.choice([None, 300, 1500])
            self.max_unblock = tiers.choice([1, 10])
        self.stats.tier_schedules = bool(self.tier_delays_ms)
        self.stats.long_tier_schedules = max(self.tier_delays_ms, default=0) >= 60_000
        # Values: small, or large enough that a few messages fill the byte budget.
        self.value_max = random.Random(f"values:{seed}").choice([40, 300])
        # The shell's position readings (re-read every so often, numbered from 1).
        self.reading = 0
        self.positions: dict[TP, int] = {}
        self.tier_tps: list[TP] = [
            (f"g.retry.{n}", p)
            for n in range(1, len(self.tier_delays_ms) + 1)
            for p in range(partitions)
        ]
        self.all_tps = [*self.tps, *self.tier_tps]
        self.root: dict[int, int] = {}  # a tier record's ident -> the produced message's
        self.logs = {tp: Log() for tp in self.all_tps}
        self.commits: dict[TP, tuple[int, str]] = {}
        self.last_commit: dict[TP, int] = {}
        self.consumer = Consumer(self.logs, self.commits)
        self.outage: str | None = None  # None | "unavailable" | "hung" | "unimplemented"
        self.bad_deploy = False  # the service rejects every message (it answers)
        self.dlq_down = False
        self.next_ident = 0
        self.step_no = 0
        self.member = Member(self, self.rng.choice([64, 4000]))
        self._assign(self.all_tps)

    # -- checks ------------------------------------------------------------------------

    def fail(self, what: str) -> None:
        raise InvariantViolation(
            f"seed {self.seed}, step {self.step_no}, t={self.clock.now:.3f}s: {what} "
            f"(replay: python -m tests.sim --seed {self.seed})"
        )

    def check_commit(self, tp: TP, offset: int, metadata: str) -> None:
        log = self.logs[tp]
        truth = self.truth
        for o, msg in log.records.items():
            if o < offset and msg.ident not in truth.done:
                self.fail(f"commit {tp}@{offset} passes offset {o} (message {msg.ident} not done)")
        if metadata:
            state = decode(metadata)
            for o in range(state.base, state.end):
                found = log.records.get(o)
                if (
                    state.is_done(o)
                    and found is not None
                    and found.ident not in truth.done
                    # A record written after a cut has a later leader epoch than the state:
                    # a reader drops the state when it fetches it (``saw_epoch``).
                    and not (state.epoch is not None and log.epochs[o] > state.epoch)
                ):
                    self.fail(
                        f"commit metadata of {tp} marks offset {o} done (message {found.ident})"
                    )
        if offset < self.last_commit.get(tp, 0) and tp not in self.reset_tps:
            self.fail(f"commit of {tp} goes back from {self.last_commit[tp]} to {offset}")
        self.last_commit[tp] = offset
        self.reset_tps.discard(tp)

    reset_tps: set[TP] = set()

    def _lane(self, tp: TP, key: bytes | None) -> tuple[TP, object]:
        return (tp, key if self.ordering == "key" else "*")

    def check_order(self, delivery: Delivery, ident: int, batch: Sequence[Delivery] = ()) -> None:
        """Before a push: nothing else of its key in flight (in other calls, or in the same
        batch), every earlier one of it done."""
        if self.ordering == "none":
            return
        tp = delivery.part.tp
        lane = self._lane(tp, delivery.key)
        in_flight = [d for call in self.member.calls for d in call]
        for other in [*in_flight, *batch]:
            if (
                not other.stale
                and other.part.tp == tp
                and self._lane(tp, other.key) == lane
                and other.offset != delivery.offset
            ):
                self.fail(
                    f"{tp}@{delivery.offset} (key {delivery.key!r}) pushed while "
                    f"@{other.offset} of its key is in flight ({self.ordering} ordering)"
                )
        entries = self.lanes.get(lane, [])
        head = self.lane_head.get(lane, 0)
        done = self.truth.done
        while head < len(entries) and entries[head][1] in done:
            head += 1
        self.lane_head[lane] = head
        if head < len(entries) and entries[head][0] < delivery.offset:
            first = entries[head]
            self.fail(
                f"{tp}@{delivery.offset} (key {delivery.key!r}) pushed before @{first[0]} "
                f"(message {first[1]}) of its key is done ({self.ordering} ordering)"
            )

    def check_bytes(self) -> None:
        """Each owned partition's byte count is exactly the sum of the messages still held
        for it, wherever they are; each budget is the sum of its partitions' counts."""
        member = self.member
        core = member.core
        held: dict[int, Delivery] = {}
        places: list[Sequence[Delivery]] = [
            member.ready,
            # (a call whose message was moved aside goes on, but the message is the write's)
            [d for call in member.calls for d in call if not d.moved],
            list(member.dlq_writes),
        ]
        for part in core.parts.values():
            places.append([d for d, _ in part.retrying.values()])
            places.append([d for d, _ in part.due.values()])
            places.append([held.delivery for held in part.held.values()])
            if part.gate is not None:
                places.append(list(part.gate.waiting_items()))
        for place in places:
            for delivery in place:
                held[id(delivery)] = delivery
        sums: dict[int, int] = {}
        for delivery in held.values():
            sums[id(delivery.part)] = sums.get(id(delivery.part), 0) + delivery.size
        budgets = {id(budget): 0 for budget in core.budgets}
        for part in core.parts.values():
            if part.bytes != sums.get(id(part), 0):
                self.fail(
                    f"{part.tp} counts {part.bytes} bytes but its messages still held add up "
                    f"to {sums.get(id(part), 0)} (a message left without giving them back)"
                )
            budgets[id(part.budget)] += part.bytes
        if any(budget.held != budgets[id(budget)] for budget in core.budgets):
            self.fail(f"the budgets ({core.bytes} bytes) are not the sum of their partitions'")

    def check_bounds(self) -> None:
        core = self.member.core
        for part in core.parts.values():
            if part.tracker is not None and part.tracker.in_flight > self.max_in_flight:
                self.fail(f"{part.tp} holds {part.tracker.in_flight} offsets in flight")
        # Each budget may be passed by the message that crossed it (keys, values, the id).
        slack = self.value_max + 16
        for budget in core.budgets:
            if budget.held > BYTE_BUDGET + slack:
                self.fail(f"{budget.held} bytes held over the {BYTE_BUDGET}-byte budget")
        self.check_bytes()
        if len(self.member.calls) > self.concurrency:
            self.fail(f"{len(self.member.calls)} calls over concurrency {self.concurrency}")
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

    # -- the group protocol --------------------------------------------------------------

    def _assign(self, tps: list[TP]) -> None:
        for tp, committed, meta in self.consumer.assign(tps):
            self.member.core.assign(tp[0], tp[1], committed, meta)

    def _revoke(self, tps: list[TP], graceful: bool = True) -> None:
        member = self.member
        core = member.core
        parts = core.owned(tps)
        core.leave(parts)
        # The revoke grace (longer than the call timeout): in-flight calls finish.
        deadline = self.clock.now + TIMEOUT_S + 0.5
        while (
            any(d.part in parts for call in member.calls for d in call)
            and self.clock.now < deadline
        ):
            due = self.clock.next_due()
            if due is None:
                break
            self.clock.run_until(min(due, deadline))
        for delivery, timer in list(member.dlq_writes.items()):
            if delivery.part in parts:
                timer.cancel()
                del member.dlq_writes[delivery]
                core.dead_letter_abandoned(delivery)
        for part in parts:
            final = core.final_commit(part) if graceful else None
            if final is not None:
                self.check_commit(part.tp, final.offset, final.metadata)
                self.consumer.commit(part.tp, final.offset, final.metadata)
                _, complete = part.tracker.metadata(core._budget) if part.tracker else ("", True)
                if not complete:
                    self._allow_dups(part.tp)
            core.forget(part)
        self.consumer.revoke(tps)

    def _allow_dups(self, tp: TP) -> None:
        for msg in self.logs[tp].records.values():
            if msg.ident in self.truth.acked:
                self.truth.dup_ok.add(msg.ident)

    # -- events --------------------------------------------------------------------------

    def produce(self) -> None:
        r = self.rng.random
        for _ in range(self.rng.randint(1, 12)):
            tp = self.rng.choice(self.tps)
            x = r()
            behaviour = (
                "poison"
                if x < 0.03
                else f"timeout:{self.rng.randint(1, 8)}"
                if x < 0.04
                else "drop"
                if x < 0.05
                else f"flaky:{self.rng.randint(1, 3)}"
                if x < 0.12
                else "ok"
            )
            if self.batch is not None and behaviour == "ok" and r() < 0.01:
                behaviour = "garbled"  # any batch answer with it has one result too few
                self.stats.garbled += 1
            # No keys in none mode: its schedules stay those of the seeds before ordering
            # existed (a key's bytes count towards the byte budget, which moves pauses).
            key = self.key_rng.choice(self.keys) if self.ordering != "none" else None
            value = b"v" * self.rng.randint(0, self.value_max)
            msg = Msg(self.next_ident, behaviour, key=key, value=value)
            self.truth.behaviour[msg.ident] = behaviour
            self.next_ident += 1
            self.logs[tp].append(msg, gap=1 if r() < 0.05 else 0)
            self.lanes.setdefault(self._lane(tp, key), []).append(
                (self.logs[tp].end - 1, msg.ident)
            )
            self.stats.produced += 1

    def fetch(self) -> None:
        core = self.member.core
        core.intake_batch(self.consumer.fetch(self.rng, 5))
        # The shell re-reads positions every so often (right after a fetch), not after each.
        if self.rng.random() < 0.4 or not self.reading:
            self.reading += 1
            self.positions = {tp: self.consumer.position[tp] for tp in self.consumer.assigned}
        else:
            self.stats.stale_readings += 1
        core.skip_unfetchable(self.positions, self.reading)
        for delivery, decision in core.unblock(self.clock.now):
            self.stats.unblocks += 1
            ident = int(dict(delivery.headers)["id"])
            behaviour = self.truth.behaviour[ident]
            if self.outage is not None and not behaviour.startswith(("flaky:", "timeout:")):
                # (the outage rule: only while the service answers others, i.e. at most at
                # the very start of a hang, for a call that began before it)
                self.stats.unblocks_in_outage += 1
            self._decided(delivery, ident, decision)
        plan = core.pause_plan()
        self.stats.pauses += len(plan.pause)
        self.consumer.set_paused(plan.pause, plan.resume)

    def dispatch(self) -> None:
        member = self.member
        while member.ready and len(member.calls) < self.concurrency:
            allowed, probe = member.breaker.try_acquire()
            if not allowed:
                return
            if self.batch is not None:
                batch = take(member.ready, self.batch, member.core.drop_stale)
                began = [d for d in batch if member.core.begin(d)]
                if not began:
                    if probe:
                        member.breaker.abandon_probe()
                    continue
                self._push_batch(began, probe)
                continue
            delivery = member.ready.popleft()
            if not member.core.begin(delivery):
                if probe:
                    member.breaker.abandon_probe()
                continue
            self._push(delivery, probe)

    def _pushed(self, delivery: Delivery, batch: Sequence[Delivery] = ()) -> int:
        ident = int(dict(delivery.headers)["id"])
        truth = self.truth
        if ident in truth.acked and ident not in truth.dup_ok:
            self.fail(f"message {ident} pushed again after it was acked")
        self.check_order(delivery, ident, batch)
        root = self.root.get(ident, ident)
        truth.attempts[root] = truth.attempts.get(root, 0) + 1
        return ident

    def _tries(self, ident: int) -> int:
        """Attempts of the produced message (across its tier records)."""
        return self.truth.attempts[self.root.get(ident, ident)]

    def _push_batch(self, batch: list[Delivery], probe: bool) -> None:
        """One HandleMessageBatch call: the service answers per message (statuses included),
        or fails the call, or answers the wrong number of results."""
        idents = [self._pushed(d, batch) for d in batch]
        count = len(batch)
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
        member = self.member
        key = tuple(batch)
        self.stats.batch_calls += 1
        self.stats.batched_messages += count

        def done() -> None:
            if self.member is not member:
                return  # the process that made the call is gone
            del member.calls[key]
            if outcome.breaker is None:
                if probe:
                    member.breaker.abandon_probe()
            else:
                member.breaker.record(outcome.breaker, probe)
            if member.core.finish_acked(batch, outcome.results):
                for delivery, ident in zip(batch, idents, strict=True):
                    self._decided(delivery, ident, ACKED)
                return
            for delivery, ident, result in zip(batch, idents, outcome.results, strict=True):
                self._decided(delivery, ident, member.core.finish(delivery, result, probe))

        member.calls[key] = self.clock.call_later(latency, done)

    def _behave(self, ident: int) -> tuple[grpc.StatusCode, int]:
        """The service's answer for one message: (status, action); a bad deploy rejects every
        message while the service is up."""
        if self.bad_deploy and self.outage not in ("unavailable", "hung"):
            self.truth.rejected.add(ident)
            return grpc.StatusCode.INVALID_ARGUMENT, 0
        return service_answer(self.truth.behaviour[ident], self._tries(ident), self.outage)

    def _decided(self, delivery: Delivery, ident: int, decision: Decision | None) -> None:
        truth = self.truth
        if decision is None:
            return
        action = decision.action
        if action is Action.ACK:
            truth.acked.add(ident)
            truth.done.add(ident)
            self.stats.acked += 1
            guard = self.member.core.guard
            if delivery.guard_probe and guard is not None and guard.held and not guard.by_operator:
                self.fail(f"message {ident}, a probe of the guard, was acked: still held")
        elif action is Action.DROP:
            truth.done.add(ident)
        elif action is Action.HOLD:
            self.stats.guard_held += 1
        elif action is Action.DEAD_LETTER:
            guard = self.member.core.guard
            if guard is not None and guard.held:
                self.fail(f"message {ident} dead-lettered while the dead-letter guard holds")
            past_tiers = bool(self.tier_delays_ms) and (
                "last retry tier" in decision.reason or "blocked the head" in decision.reason
            )
            # A garbled message's broken answer, once alone, is its own counted failure (its
            # last one may be a deadline charged at the start of a hang, as a timeout's).
            if not (
                truth.behaviour[ident].startswith(("poison", "timeout:", "garbled"))
                or (past_tiers and truth.behaviour[ident].startswith("flaky:"))
                or ident in truth.rejected  # by a bad deploy, before the guard tripped
            ):
                self.fail(f"message {ident} ({truth.behaviour[ident]}) dead-lettered")
            self._write_dlq(delivery, ident)
        elif action is Action.TIER:
            if not self.tier_delays_ms or not decision.counted:
                self.fail(f"message {ident} moved to tier {decision.tier} ({decision})")
            # A deadline charged while the service answered others is the message's attempt
            # (guarantee 2), also at the start of a hang; nothing else moves a good message.
            charged_deadline = (
                decision.reason == "deadline" or "blocked the head" in decision.reason
            )
            if not truth.behaviour[ident].startswith(("flaky:", "timeout:", "garbled")) and not (
                charged_deadline
            ):
                self.fail(f"message {ident} ({truth.behaviour[ident]}) moved to a retry tier")
            self._write_tier(delivery, ident, decision.tier)

    def _push(self, delivery: Delivery, probe: bool) -> None:
        ident = self._pushed(delivery)
        result, latency = service_unary_call(
            self.classifier, self.rng, self.outage, self._behave(ident), TIMEOUT_S
        )
        member = self.member

        def done() -> None:
            if self.member is not member:
                return  # the process that made the call is gone
            del member.calls[(delivery,)]
            member.breaker.record(result.service_failure, probe)
            self._decided(delivery, ident, member.core.finish(delivery, result, probe))

        member.calls[(delivery,)] = self.clock.call_later(latency, done)

    def _only_real_poison_held(self) -> bool:
        """Every message the guard holds fails on its own next time too: no probe can
        release it (an operator must)."""
        for part in self.member.core.parts.values():
            for held in part.held.values():
                ident = int(dict(held.delivery.headers)["id"])
                behaviour = self.truth.behaviour[ident]
                if behaviour.startswith(("poison", "garbled")):
                    continue
                if behaviour.startswith(("flaky:", "timeout:")) and self._tries(ident) < int(
                    behaviour.split(":")[1]
                ):
                    continue
                return False
        return True

    def operator_release(self) -> None:
        """An operator releases a held guard: the held messages go to the DLQ."""
        released = self.member.core.guard_release()
        self.stats.guard_releases += bool(released)
        for held in released:
            ident = int(dict(held.delivery.headers)["id"])
            self.truth.released.add(ident)
            self._write_dlq(held.delivery, ident)

    def _write_dlq(self, delivery: Delivery, ident: int) -> None:
        member = self.member

        def attempt() -> None:
            if self.member is not member or delivery not in member.dlq_writes:
                return
            if self.dlq_down:
                member.dlq_writes[delivery] = self.clock.call_later(0.2, attempt)
                return
            del member.dlq_writes[delivery]
            self.truth.dlq.append(ident)
            self.truth.done.add(ident)
            self.stats.dead_lettered += 1
            member.core.dead_lettered(delivery)

        member.dlq_writes[delivery] = self.clock.call_later(self.rng.uniform(0.001, 0.02), attempt)

    def _write_tier(self, delivery: Delivery, ident: int, tier: int) -> None:
        """The tier write: like a DLQ write (it fails while the DLQ is down), then the record
        is in the tier's log under a new ident and only then is the source message done."""
        member = self.member

        def attempt() -> None:
            if self.member is not member or delivery not in member.dlq_writes:
                return
            if self.dlq_down:
                member.dlq_writes[delivery] = self.clock.call_later(0.2, attempt)
                return
            del member.dlq_writes[delivery]
            headers = retry_headers(
                [],
                delivery.origin,
                attempt=delivery.attempt,
                status="INTERNAL",
                reason="sim",
                endpoint="sim",
                group="g",
                tier=tier,
                due_at_ms=delivery.due_at_ms,
            )
            extra = tuple(
                (k, v) for k, v in headers if k.startswith(CP_PREFIX) and isinstance(v, bytes)
            )
            new = self.next_ident
            self.next_ident += 1
            self.root[new] = self.root.get(ident, ident)
            self.truth.behaviour[new] = self.truth.behaviour[ident]
            behaviour = self.truth.behaviour[ident]
            msg = Msg(new, behaviour, key=delivery.key, value=delivery.value, extra=extra)
            self.logs[(f"g.retry.{tier}", delivery.origin.partition)].append(msg)
            self.truth.done.add(ident)
            self.stats.tier_writes += 1
            member.core.tier_written(delivery)

        member.dlq_writes[delivery] = self.clock.call_later(self.rng.uniform(0.001, 0.02), attempt)

    def commit(self) -> None:
        core = self.member.core
        plan, _ = core.commit_plan()
        for c in plan:
            self.check_commit(c.part.tp, c.offset, c.metadata)
            self.consumer.commit(c.part.tp, c.offset, c.metadata)
        core.committed(plan)

    def rebalance(self) -> None:
        owned = sorted(self.consumer.assigned)
        if not owned:
            self._assign(self.all_tps)
            return
        tps = self.rng.sample(owned, self.rng.randint(1, len(owned)))
        self._revoke(tps)
        self._assign(tps)  # cooperative-sticky: the same member gets them back
        self.stats.rebalances += 1
        self._maybe_cut_at_handover(tps)

    def _maybe_cut_at_handover(self, tps: Sequence[TP]) -> None:
        """An unclean election while the partition changes hands: its new owner restores
        an ack state that may describe records that are gone (it is not told)."""
        if self.rng.random() < 0.3:
            tp = self.rng.choice([tp for tp in tps if tp in self.tps] or self.tps)
            committed, meta = self.commits.get(tp, (0, ""))
            cut = None
            top = min(decode(meta).end, self.logs[tp].end) - 1 if meta else committed
            if top > committed:  # cut inside the range the restored state describes
                cut = self.rng.randint(committed + 1, top)
            if self.truncate(tp, cut):
                self.stats.handover_truncations += 1

    def restart(self, crash: bool) -> None:
        if crash:
            for ident in self.truth.acked:
                self.truth.dup_ok.add(ident)
            self.stats.crashes += 1
        else:
            self._revoke(sorted(self.consumer.assigned))
            self.stats.restarts += 1
        for timer in [*self.member.calls.values(), *self.member.dlq_writes.values()]:
            timer.cancel()
        self.consumer = Consumer(self.logs, self.commits)  # a new process: no pause flags
        self._count_trips()
        self.member = Member(self, self.rng.choice([64, 4000]))
        self.reading = 0  # ... and its own position readings
        self.positions = {}
        self._assign(self.all_tps)
        self._maybe_cut_at_handover(self.tps)

    def truncate(self, tp: TP | None = None, cut: int | None = None) -> bool:
        """An unclean leader election cuts ``tp``'s log (at ``cut``, or anywhere at or above
        its commit); False when there is nothing above the commit to cut."""
        tp = tp or self.rng.choice(self.tps)
        log = self.logs[tp]
        floor = self.commits.get(tp, (0, ""))[0]
        if log.end <= floor:
            return False
        if cut is None or not floor <= cut < log.end:
            cut = self.rng.randint(floor, log.end - 1)
        for msg in log.truncate(cut):
            self.truth.done.discard(msg.ident)  # gone: no longer owed to anyone
        for lane, entries in self.lanes.items():
            if lane[0] == tp:
                entries[:] = [e for e in entries if e[0] < cut]
                self.lane_head[lane] = 0
        self.consumer.truncated(tp, cut)
        self._allow_dups(tp)  # the ack state above the fetch position is dropped
        part = self.member.core.parts.get(tp)
        if part is None or cut >= part.received_end:
            # librdkafka validates the position against the new leader's epochs and seeks
            # back without telling the application: the member learns of the cut from the
            # leader epochs (and offsets) of the records it fetches there.
            self.stats.silent_truncations += 1
        else:
            # A cut below what the member received: told here, as the shell's
            # _LOG_TRUNCATION path (the position is read then).
            self.member.core.truncated(tp, self.consumer.position.get(tp))
        self.reset_tps.add(tp)
        self.stats.truncations += 1
        return True

    # -- schedule ------------------------------------------------------------------------

    def step(self) -> None:
        self.step_no += 1
        x = self.rng.random()
        if x < 0.25:
            self.produce()
        elif x < 0.50:
            self.fetch()
        elif x < 0.55:
            self.commit()
        elif x < 0.565:
            self.rebalance()
        elif x < 0.57:
            self.restart(crash=self.rng.random() < 0.3)
        elif x < 0.572:
            self.truncate()
        elif x < 0.58:
            outages = ["unavailable", "hung"] + (["unimplemented"] if self.batch else [])
            self.outage = None if self.outage else self.rng.choice(outages)
            self.stats.outages += self.outage is not None
        elif x < 0.585:
            self.dlq_down = not self.dlq_down
        elif x < 0.588:
            self.bad_deploy = not self.bad_deploy
            self.stats.bad_deploys += self.bad_deploy
        elif x < 0.5885:
            self.operator_release()
        else:
            self.clock.run_until(self.clock.now + self.rng.uniform(0.0, 0.3))
        self.dispatch()
        self.check_bounds()

    def _drained(self, tps: Sequence[TP]) -> bool:
        return all(self.commits.get(tp, (0, ""))[0] >= self.logs[tp].end for tp in tps)

    def _lag(self) -> dict[TP, tuple[int, int]]:
        return {tp: (self.commits.get(tp, (0, ""))[0], self.logs[tp].end) for tp in self.all_tps}

    def drain(self) -> None:
        """Heal everything and require every partition to drain in bounded virtual time: the
        source partitions within DRAIN_LIMIT_S whatever the retry tiers hold (records waiting
        an hour for their due time must not hold the source back), the tiers once their
        records are due too. While nothing is under way the clock jumps to the next timer."""
        self.outage = None
        self.dlq_down = False
        self.bad_deploy = False  # rolled back: a probe's ack releases a held guard
        if not self.consumer.assigned:
            self._assign(self.all_tps)
        operator_at = self.clock.now + 60.0  # ... unless every held one is real poison
        recoverable_since: float | None = None
        source_deadline = self.clock.now + DRAIN_LIMIT_S
        # (a message may go through every tier after the source drained)
        deadline = source_deadline + sum(self.tier_delays_ms) / 1000.0 + DRAIN_LIMIT_S
        sources_drained = False
        while self.clock.now < deadline:
            self.fetch()
            self.dispatch()
            self.commit()
            if self._drained(self.all_tps):
                break
            guard = self.member.core.guard
            if guard is not None and guard.held and not self._only_real_poison_held():
                # It holds a message the service now acks: a probe (every 0.5 s) releases
                # the guard within seconds.
                recoverable_since = recoverable_since or self.clock.now
                if self.clock.now - recoverable_since >= 30.0:
                    self.fail("the dead-letter guard still holds 30 s after the service recovered")
            else:
                recoverable_since = None
                if self.clock.now >= operator_at:
                    self.operator_release()
            if not sources_drained:
                sources_drained = self._drained(self.tps)
                if not sources_drained and self.clock.now >= source_deadline:
                    self.fail(
                        f"source partitions did not drain in {DRAIN_LIMIT_S:.0f}s "
                        f"(tier delays {self.tier_delays_ms} ms): (committed, end) {self._lag()}"
                    )
            step = 0.05
            member = self.member
            if not (member.ready or member.calls or member.dlq_writes):
                due = self.clock.next_due()
                if due is not None:
                    step = max(step, min(due - self.clock.now, 60.0))
            self.clock.run_until(self.clock.now + step)
            self.check_bounds()
        else:
            self.fail(f"partitions did not drain in time: (committed, end) {self._lag()}")
        for tp, log in self.logs.items():
            for o, msg in log.records.items():
                if msg.ident not in self.truth.done:
                    self.fail(f"message {msg.ident} at {tp}@{o} was never done")
        self.stats.resets = self.member.core.counters.resets
        self._count_trips()

    def _count_trips(self) -> None:
        guard = self.member.core.guard
        self.stats.guard_trips += guard.trips if guard is not None else 0


def run(seed: int, steps: int) -> Stats:
    """One schedule of ``steps`` events, then the drain; raises InvariantViolation."""
    sim = Simulation(seed)
    sim.reset_tps = set()
    for _ in range(steps):
        sim.step()
    sim.drain()
    sim.stats.steps = steps
    return sim.stats
