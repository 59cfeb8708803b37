"""The development harness itself: one config builder behind the tests' and the benches' configs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.bench_latency import TARGET_ADDED_P99_MS, added_target, floor_behind, per_record_added
from bench.bench_throughput import PROXY_DELIVERY, floor_client
from bench.measure import rotated
from bench.profiling import item_latencies
from bench.proxy import bench_config
from consumer_proxy.config import ProxyConfig, load_config
from consumer_proxy.core.partitions import Run
from tests.support.cache import KEEP_S, prune, used
from tests.support.proxy import FAST_CONSUMER, ProxyProcess, config_dict, make_config, write_config
from tests.support.records import Rec
from tests.test_batch_intake import RunRig

ARGS = ("127.0.0.1:9092", "orders", ["orders"], ["127.0.0.1:50051"])


def test_the_file_for_a_child_proxy_is_the_config_a_test_proxy_gets(tmp_path: Path) -> None:
    # Given the same group written as a file and built as a model
    path = write_config(tmp_path / "proxy.json", *ARGS, delivery={"concurrency": 4})
    model = make_config(*ARGS, delivery={"concurrency": 4})

    # Then the file loads (as consumer-proxy run loads it) into that model, plus the fast
    # session timeouts a child process needs to be noticed when killed
    loaded = load_config(path)
    assert loaded.groups == model.groups
    assert loaded.kafka.client == FAST_CONSUMER
    assert loaded.groups[0].delivery.concurrency == 4
    assert loaded.groups[0].delivery.commit_interval_ms == 200


def test_the_bench_config_keeps_the_proxys_delivery_defaults() -> None:
    bench = ProxyConfig(**bench_config(*ARGS, delivery={"concurrency": 100}))
    tests = make_config(*ARGS)
    defaults = ProxyConfig(**config_dict(*ARGS, fast_delivery=False))

    assert (
        bench.groups[0].delivery.commit_interval_ms
        == defaults.groups[0].delivery.commit_interval_ms
    )
    assert tests.groups[0].delivery.commit_interval_ms == 200
    assert bench.groups[0].service.timeout_ms == 30000
    assert bench.shutdown_grace_s == 10
    assert not bench.metrics.enabled


def test_the_throughput_floor_consumes_with_the_proxys_librdkafka_settings() -> None:
    # Given the throughput bench's proxy, with a librdkafka setting from --proxy-client
    config = bench_config(*ARGS, PROXY_DELIVERY, {"fetch.queue.backoff.ms": "10"})

    # When the floor's consumer settings are derived from it
    settings = dict(pair.split("=", 1) for pair in floor_client(config))

    # Then the floor fetches as the proxy does: its prefetch bound, a batch group's short
    # fetch long-poll, the passthrough; but joins and commits as the bare loop it is
    assert settings["queued.max.messages.kbytes"] == "16384"
    assert settings["fetch.wait.max.ms"] == "20"
    assert settings["fetch.queue.backoff.ms"] == "10"
    assert settings["enable.partition.eof"] == "false"
    assert not {"group.id", "bootstrap.servers", "enable.auto.commit"} & settings.keys()


def test_a_proxy_process_that_was_never_started_stops_as_a_no_op(tmp_path: Path) -> None:
    proxy = ProxyProcess(tmp_path / "proxy.json", tmp_path / "proxy.log")

    assert proxy.stop() is None
    assert not proxy.alive()
    assert proxy.log_tail() == ""


def test_the_latency_a_side_added_is_taken_record_by_record_against_the_floor() -> None:
    # Given a floor and a side that read the same records, a stall upstream delaying records
    # 10..19 by 100 ms for both, and the side 1 ms behind the floor on every record but one
    offsets = list(range(200))
    stall = [100.0 if 10 <= o < 20 else 0.0 for o in offsets]
    floor = {"latency_offsets": offsets, "latency_ms": [2.0 + s for s in stall]}
    late = {o: 1.0 for o in offsets} | {150: 40.0}
    side = {
        "latency_offsets": offsets[::-1],  # the order each side's handler saw them in
        "latency_ms": [2.0 + stall[o] + late[o] for o in offsets[::-1]],
    }
    # Then what it added is the side's own delay, not the stall both saw
    added = per_record_added(floor, side)
    assert added["p50"] == 1.0
    assert added["p99"] == 1.0
    assert added["p999"] == 40.0


def test_interleaved_rounds_let_each_contender_run_first_once_in_as_many_rounds() -> None:
    # Given three contenders over three rounds (and a warm-up round, numbered -1)
    orders = [rotated(["floor", "proxy", "defaults"], r) for r in range(-1, 3)]
    # Then each round runs all of them, and each runs first once in the three counted rounds
    assert all(sorted(order) == ["defaults", "floor", "proxy"] for order in orders)
    assert sorted(order[0] for order in orders[1:]) == ["defaults", "floor", "proxy"]


def test_builds_of_other_source_versions_unused_for_a_week_are_pruned(tmp_path: Path) -> None:
    now = time.time()
    current = tmp_path / "bench-gohandler-0123456789abcdef"
    old = tmp_path / "bench-gohandler-fedcba9876543210"
    old_dir = tmp_path / "bench-gohandler-fedcba98765432aa"  # (the collector's are directories)
    recent = tmp_path / "bench-gohandler-00000000000000aa"
    half_written = tmp_path / "bench-gohandler-0123456789abcdef.123.tmp"
    other_command = tmp_path / "bench-gohandler-x-fedcba9876543210"
    old_dir.mkdir()
    (old_dir / "otelcol").write_bytes(b"binary")
    for path in (current, old, recent, half_written, other_command):
        path.write_bytes(b"binary")
    for path in (current, old, old_dir, half_written, other_command):
        os.utime(path, (now - 2 * KEEP_S, now - 2 * KEEP_S))
    used(recent)

    assert sorted(prune(current, now)) == sorted([old, old_dir])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (current, recent, half_written, other_command)
    )


def test_the_latency_stages_stamp_each_message_of_a_ready_run() -> None:
    # Given batch mode's ready items: a message alone (as a retry is), then a run
    rig = RunRig(window=100, budget=1_000_000, runs=True)
    rig.core.intake_batch([Rec("t", offset, timestamp_ms=1_000 + offset) for offset in range(4)])
    (run,) = rig.items
    assert isinstance(run, Run)
    items = [*run.split(1).deliveries(), run]
    # When bench_latency --stages stamps them / Then each message once, by its own timestamp
    assert item_latencies(items, 2_000.0) == [(o, 1_000.0 - o) for o in range(4)]


def test_a_latency_run_says_when_the_floor_itself_fell_behind_the_load() -> None:
    # Given a floor that delivered at a median p50 of a few ms (28 ms on a loaded machine at
    # 10,000 msg/s), and one that fell seconds behind (a slow machine at 1,000 msg/s)
    # Then only the latter is said to be behind
    assert not floor_behind(3.4) and not floor_behind(28.0)
    assert floor_behind(427.0)
    # ... and the p99 added is judged by the target only where the floor kept up at 1,000
    # msg/s (a run on a saturated machine printed "MET" beside its WARNING before)
    assert added_target(1000.0, 3.4) == TARGET_ADDED_P99_MS
    assert added_target(1000.0, 427.0) is None and added_target(10000.0, 3.4) is None
