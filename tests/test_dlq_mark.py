"""Pure logic of the DLQ tools: the per-record merge mark, the write pacer, reason templates."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer_proxy.config import KafkaConfig
from consumer_proxy.core.codec import AckState
from consumer_proxy.errors import KafkaUnavailableError
from consumer_proxy.tools.kafka_ops import mark_past_end, time_bounds
from consumer_proxy.tools.mark import MergeMark, fit_islands
from consumer_proxy.tools.pacing import Pacer
from consumer_proxy.tools.render import reason_template
from tests.support.clock import Clock

# -- the merge mark ---------------------------------------------------------------------------


def test_a_merge_of_the_first_records_moves_the_prefix_and_one_above_it_does_not() -> None:
    mark = MergeMark.empty().with_merged([(0, 3), (5, 7)])

    assert mark.prefix == 3
    assert mark.merged_runs() == [(5, 7)]
    assert [o for o in range(10) if mark.is_merged(o)] == [0, 1, 2, 5, 6]
    # When the gap is merged too, the prefix runs through the next run
    assert mark.with_merged([(3, 5)]) == MergeMark(AckState(7))


def test_the_mark_round_trips_through_commit_metadata() -> None:
    mark = MergeMark.empty(10).with_merged([(12, 13), (20, 40)])

    assert MergeMark.from_commit(mark.prefix, mark.metadata()) == mark
    assert mark.merged_between(0, 100) == 10 + 1 + 20
    assert mark.merged_between(11, 21) == 2


@pytest.mark.parametrize(
    "metadata",
    [None, "", json.dumps({"merged_at": 1, "records": 5}), "cp1rgarbage"],
    ids=["none", "empty", "json-before-per-record-marks", "corrupt"],
)
def test_foreign_metadata_reads_as_the_prefix_only(metadata: str | None) -> None:
    # What marks meant before they were per record: everything below the offset was merged
    mark = MergeMark.from_commit(42, metadata)

    assert (mark.prefix, mark.merged_runs()) == (42, [])


def test_metadata_of_another_offset_is_not_trusted() -> None:
    written = MergeMark.empty(10).with_merged([(12, 13)])

    assert MergeMark.from_commit(11, written.metadata()) == MergeMark.empty(11)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 15)), max_size=8), max_size=6),
    st.integers(0, 20),
)
def test_merges_in_any_order_mark_exactly_the_offsets_sent_back(
    batches: list[list[tuple[int, int]]], start: int
) -> None:
    # Given a mark starting at some prefix, and merges of arbitrary intervals
    mark = MergeMark.empty(start)
    sent = set(range(start))
    for batch in batches:
        mark = mark.with_merged((s, s + n) for s, n in batch)
        sent.update(o for s, n in batch for o in range(s, s + n))
        mark = MergeMark.from_commit(mark.prefix, mark.metadata())  # through Kafka and back

        # Then the mark holds exactly what was sent back, the prefix is the first gap
        assert all(mark.is_merged(o) == (o in sent) for o in range(240))
        assert mark.prefix == min(set(range(240)) - sent)
        assert mark.merged_between(0, 240) == len(sent)


def test_a_merge_that_would_overflow_the_metadata_takes_a_prefix_that_fits() -> None:
    # Given thousands of scattered selected records (random gaps: deflate cannot shrink them)
    rng = random.Random(7)
    islands, at = [], 1
    for _ in range(5000):
        start = at + rng.randrange(1, 20)
        at = start + rng.randrange(1, 20)
        islands.append((start, at))

    taken = fit_islands(MergeMark.empty(), islands, budget_chars=1000)

    # Then a prefix of them fits the budget, and one more island would not
    assert 0 < taken < len(islands)
    assert MergeMark.empty().with_merged(islands[:taken]).fits(1000)
    assert not MergeMark.empty().with_merged(islands[: taken + 1]).fits(1000)
    assert fit_islands(MergeMark.empty(), islands[:10], 1000) == 10


def test_a_mark_that_goes_past_the_end_of_the_log_is_told() -> None:
    # A mark of merges up to 100 (or one run up to 80) on a log that now ends at 60 (cut
    # below it, or made anew) is not of this log; up to the end, or below it, it is
    assert mark_past_end(MergeMark.empty(100), 60)
    assert mark_past_end(MergeMark.empty(10).with_merged([(50, 80)]), 60)
    assert not mark_past_end(MergeMark.empty(60), 60)
    assert not mark_past_end(MergeMark.empty(10).with_merged([(50, 60)]), 60)
    assert not mark_past_end(MergeMark.empty(), 0)


def test_purge_by_time_fails_whole_when_one_partitions_lookup_failed() -> None:
    # Given offsets_for_times' answer: partition 0 holds records at or after the time from
    # offset 10, partition 1 none that late, partition 2's lookup failed (its leader moving)
    kafka = KafkaConfig(bootstrap_servers="k:9092")
    found = [(0, 10, None), (1, -1, None), (2, -1, "Broker: Not leader for partition")]
    high = {0: 1000, 1: 1000, 2: 1000}
    # Then the purge fails, naming the partition and saying nothing was deleted (read as "no
    # record that late", the failed lookup would delete all of partition 2)
    with pytest.raises(
        KafkaUnavailableError, match=r"partition 2: Broker: Not leader.*nothing deleted"
    ):
        time_bounds(kafka, "g.dlq", found, high)
    # and without the failure, a partition with no record that late is deleted to its end
    assert time_bounds(kafka, "g.dlq", found[:2], high) == {0: 10, 1: 1000}


# -- the pacer --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_the_pacer_holds_the_rate_and_no_second_goes_over(seed: int) -> None:
    # Given a writer that oversleeps by up to 3 ms and sometimes stalls for 300 ms
    rng, clock, rate = random.Random(seed), Clock(1000.0), 200.0
    pacer = Pacer(rate, clock)
    sent = []
    for _ in range(2000):
        wait = pacer.delay()
        if wait:
            clock.now += wait + rng.uniform(0, 0.003)
        if rng.random() < 0.002:
            clock.now += 0.3
        sent.append(clock.now)
        pacer.sent()
        clock.now += 0.0001  # the send itself

    # Then no one-second window holds more than the rate plus the tolerance
    busiest = max(
        sum(1 for t in sent[i : i + 400] if t < start + 1.0) for i, start in enumerate(sent)
    )
    assert busiest <= rate * (1 + pacer.tolerance_s) + 1
    # and jitter does not cost throughput (only the stalls do)
    stalls = sum(1 for a, b in itertools.pairwise(sent) if b - a > 0.25)
    elapsed = sent[-1] - sent[0] - stalls * 0.3
    assert (len(sent) - 1) / elapsed >= rate * 0.97


def test_a_pacer_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError, match="rate must be positive"):
        Pacer(0, Clock(1000.0))


# -- reason templates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "template"),
    [
        ("order 1234 not found", "order <n> not found"),
        ("bad field 'price' in \"v2\" payload", "bad field '<v>' in \"<v>\" payload"),
        ("user 3f2a9c1e-0b1d-4c8e-9a5e-1234567890ab missing", "user <id> missing"),
        ("key ab12cd34ef rejected after 2.5s", "key <id> rejected after <n>s"),
        ("cannot parse", "cannot parse"),
        ("token sk_live-4eC39Hq, retry", "token <id>, retry"),
        # a service's 1 KiB of hyphenated tokens: one id, and numbers (each word boundary of
        # such a run once cost a scan to its end: quadratic)
        ("a-1-" * 250, "<id>"),
        ("0-" * 500, "<n>-" * 500),
        (None, None),
    ],
    ids=lambda v: None if v is None or len(v) < 60 else f"{v[:8]}...",
)
def test_reasons_of_one_kind_share_a_template(reason: str | None, template: str | None) -> None:
    assert reason_template(reason) == template


# -- layering ---------------------------------------------------------------------------------


def test_the_tools_import_the_core_never_the_proxys_runtime() -> None:
    # In a fresh interpreter: every tools module, and what they pulled in
    code = (
        "import sys, pkgutil, importlib, consumer_proxy.tools as t\n"
        "for m in pkgutil.iter_modules(t.__path__):\n"
        "    importlib.import_module(f'{t.__name__}.{m.name}')\n"
        "print(' '.join(sorted(n for n in sys.modules if n.startswith(('consumer_', 'pyspark')))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()

    assert "consumer_proxy.tools.commands" in loaded and "consumer_proxy.core.codec" in loaded
    runtime = {
        f"consumer_proxy.{m}" for m in ("proxy", "group", "fetcher", "dispatcher", "flow", "dlq")
    }
    assert runtime.isdisjoint(loaded)
    assert not any(m.startswith("pyspark") for m in loaded)  # Spark only inside the jobs
