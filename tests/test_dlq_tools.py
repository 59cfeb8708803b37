"""DLQ tooling end to end: ``dlq inspect|report|merge|purge`` on a real broker and real Spark.

One local Spark session (``spark`` fixture) serves the whole module: the commands run
in-process through ``main()`` and reuse it, since starting Spark costs far more than any job
here.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from consumer_proxy.cli import main
from consumer_proxy.config import KafkaConfig, ProxyConfig
from consumer_proxy.core import records as dlq_records
from consumer_proxy.tools import commands, render
from consumer_proxy.tools import spark as tool_spark
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    unique_name,
    value_of,
)
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

ROOT = Path(__file__).resolve().parent.parent
HOUR_MS = 3_600_000
# Record times: a few hours back, on the hour, well inside the test broker's 24 h retention.
BASE_MS = (int(time.time() * 1000) // HOUR_MS - 6) * HOUR_MS


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local Spark session for the module; the commands under test reuse it."""
    run = tool_spark.start_spark(tool_spark.SparkOptions(master="local[2]"), lambda _line: None)
    assert run.owned
    yield run.spark
    run.spark.stop()
    if run.console_log is not None:
        run.console_log.unlink(missing_ok=True)


@pytest.fixture(scope="module", autouse=True)
def _group_coordinator_ready(kafka: Broker) -> None:
    # On a fresh broker the first group lookups answer NOT_COORDINATOR while
    # __consumer_offsets is being created; wait that out once rather than in every helper.
    def ready() -> bool:
        try:
            committed_offsets(kafka.bootstrap, unique_name("warm-up"), "__consumer_offsets")
        except KafkaException:
            return False
        return True

    wait_until(ready, timeout=60, message="the group coordinator to answer")


def write_config(path: Path, config: ProxyConfig) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


def group_config(bootstrap: str, tmp_path: Path, group: str) -> Path:
    """A config file naming ``group`` (its DLQ and redrive topics take the default names)."""
    config = make_config(bootstrap, group, [f"{group}.source"], ["127.0.0.1:1"])
    return write_config(tmp_path / f"{group}.yaml", config)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def merge_marks(bootstrap: str, group: str) -> dict[int, int]:
    committed = committed_offsets(bootstrap, f"{group}.dlq-merge", f"{group}.dlq")
    return {p: offset for p, (offset, _meta) in committed.items()}


def dead_letter(
    i: int,
    *,
    status: str,
    value: bytes | None,
    key: bytes | None,
    ts: int,
    attempt: int = 1,
    reason: str = "cannot parse",
    original_partition: int = 0,
    partition: int | None = None,
) -> dict[str, Any]:
    """A DLQ record as the proxy writes it: user headers, then the cp-* headers."""
    origin = dlq_records.Origin("orders", original_partition, 1000 + i, ts - 5000, attempt)
    headers = dlq_records.dlq_headers(
        [("trace", f"t{i}".encode())],
        origin,
        attempt=attempt,
        status=status,
        reason=reason,
        endpoint="10.0.0.1:50051",
        group="g",
        now_ms=ts,
    )
    record = {"key": key, "value": value, "headers": headers, "timestamp": ts}
    if partition is not None:
        record["partition"] = partition
    return record


def dlq_json(
    capsys: pytest.CaptureFixture[str], path: Path, group: str
) -> Callable[..., dict[str, Any]]:
    """``run(*args)``: ``consumer-proxy dlq ARGS --json`` on ``group``; its summary (exit 0)."""

    def run(*args: str) -> dict[str, Any]:
        code, out, err = cli(capsys, "dlq", *args, "--config", path, "--group", group, "--json")
        assert code == 0, err
        result: dict[str, Any] = json.loads(out)
        return result

    return run


def cp_of(message: Any) -> dict[str, str]:
    return dlq_records.split_headers(message.headers())[1]


# -- merge back through the real proxy, then purge --------------------------------------------


async def test_merged_poison_pills_reach_the_fixed_service_with_original_coordinates(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _merge_round_trip(kafka.bootstrap, tmp_path, capsys)


async def _merge_round_trip(
    bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 120 messages over 2 partitions, 8 of them poison pills the service rejects
    topic, group = unique_name("dlqm"), unique_name("dlqm")
    dlq_topic, redrive = f"{group}.dlq", f"{group}.redrive"
    create_topic(bootstrap, topic, partitions=2)
    records: list[dict[str, Any]] = [
        {
            "key": f"k{i}",
            "value": f"pill {i}" if i % 15 == 0 else f"m{i}",
            "headers": [("trace", f"t{i}".encode())],
        }
        for i in range(120)
    ]
    await asyncio.to_thread(produce, bootstrap, topic, records)
    fixed = False

    def behaviour(msg: Any, _n: int) -> Behaviour:
        if msg.value.startswith(b"pill") and not fixed:
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="cannot parse")
        return Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(bootstrap, group, [topic], [service.address])
        path = write_config(tmp_path / "proxy.yaml", config)
        proxy, task = start_proxy(config)
        try:
            # ... dead-lettered by the proxy
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
            dead = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
            assert sorted(value_of(m) for m in dead) == sorted(
                r["value"].encode() for r in records if r["value"].startswith("pill")
            )
            # When the service is fixed and the DLQ is merged while the proxy runs
            fixed = True
            code = await asyncio.to_thread(
                main, ["dlq", "merge", "--config", str(path), "--group", group, "--yes", "--json"]
            )
            out, err = capsys.readouterr()
            assert code == 0, err
            summary = json.loads(out)
            assert (summary["in_range"], summary["selected"], summary["merged"]) == (8, 8, 8)
            assert "selected 8 of 8 records" in err and "writing 8 records" in err  # progress

            # Then every pill comes back once from the redrive topic and is acked
            def redriven() -> list[Any]:
                return [d for d in service.deliveries if d.source == "redrive"]

            await async_wait_until(
                lambda: sum(d.outcome == "ACK" for d in redriven()) == 8, timeout=60
            )
            await async_wait_until(lambda: caught_up(bootstrap, group, redrive), timeout=60)
        finally:
            await proxy.shutdown()
            await task

    # ... with its original coordinates, key, value, user headers and the attempt carried on
    by_origin = {
        (
            cp[dlq_records.H_TOPIC],
            int(cp[dlq_records.H_PARTITION]),
            int(cp[dlq_records.H_OFFSET]),
        ): m
        for m in dead
        if (cp := cp_of(m))
    }
    assert sorted(d.coordinates for d in redriven()) == sorted(by_origin)
    for d in redriven():
        original = by_origin[d.coordinates]
        assert (d.key, d.value) == (original.key(), original.value())
        assert d.headers == tuple(dlq_records.split_headers(original.headers())[0])
        assert d.attempt == int(cp_of(original)[dlq_records.H_ATTEMPT]) + 1 == 2
        assert service.count(*d.coordinates) == 2  # first delivery + the redrive, no more
    ends = end_offsets(bootstrap, dlq_topic)
    assert sum(ends.values()) == 8  # nothing went back to the DLQ
    assert merge_marks(bootstrap, group) == ends

    # When merge runs again, it merges nothing
    code, out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group, "--yes")
    assert code == 0, err
    assert out.startswith("merged 0 of 0 records"), out
    assert sum(end_offsets(bootstrap, redrive).values()) == 8

    # And inspect shows the records, all merged
    code, out, err = cli(capsys, "dlq", "inspect", "--config", path, "--group", group, "--json")
    assert code == 0, err
    seen = json.loads(out)
    assert (seen["total"], seen["not_merged"]) == (8, 0)
    assert {p["partition"]: p["merged_to"] for p in seen["partitions"]} == ends
    assert {r["value"] for r in seen["sample"]} == {value_of(m).decode() for m in dead}
    assert all(r["cp"][dlq_records.H_STATUS] == "INVALID_ARGUMENT" for r in seen["sample"])

    # When the merged range is purged
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--merged", "--yes")  # fmt: skip
    assert code == 0, err
    assert "deleted 8 records" in out

    # Then the DLQ is empty and inspect says so, the marks still in place
    assert consume_all(bootstrap, dlq_topic) == []
    code, out, err = cli(capsys, "dlq", "inspect", "--config", path, "--group", group)
    assert code == 0, err
    assert out.startswith(f"DLQ {dlq_topic} of group {group}: 0 records, 0 not merged yet")
    for p, end in ends.items():
        line = f"partition {p}: 0 records (offsets {end}..{end}) purged to {end}, merged to {end}"
        assert line in out


# -- selection: --status, --where, --since/--until --------------------------------------------

STATUSES = ["INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"]
COLOURS = ["red", "blue", "green", "light blue"]


@pytest.fixture
def mixed_dlq(kafka: Broker, tmp_path: Path) -> dict[str, Any]:
    """A DLQ of 90 records over 3 partitions: statuses, values, attempts and times mixed."""
    group = unique_name("dlqsel")
    create_topic(kafka.bootstrap, f"{group}.dlq", partitions=3)
    create_topic(kafka.bootstrap, f"{group}.redrive", partitions=2)
    records = []
    for i in range(90):
        records.append(
            dead_letter(
                i,
                status=STATUSES[i % 3],
                value=f"{COLOURS[i % 4]} #{i}".encode() if i % 17 else b"\xff\xfe" + bytes([i]),
                key=None if i % 10 == 0 else f"k{i % 7}".encode(),
                ts=BASE_MS + i * 60_000,
                attempt=1 + i % 5,
                original_partition=i % 4,
                partition=i % 3,
            )
        )
    produce(kafka.bootstrap, f"{group}.dlq", records)
    path = group_config(kafka.bootstrap, tmp_path, group)
    return {"group": group, "config": path, "records": records, "bootstrap": kafka.bootstrap}


def _matches(i: int, record: dict[str, Any], case: str) -> bool:
    value: bytes = record["value"] or b""
    timestamp: int = record["timestamp"]
    return {
        "status": STATUSES[i % 3] == "INVALID_ARGUMENT",
        "statuses": STATUSES[i % 3] in ("DEADLINE_EXCEEDED", "FAILED_PRECONDITION"),
        "where-value": b"blue" in value,
        "where-columns": 1 + i % 5 >= 3 and i % 4 == 1 and record["key"] is not None,
        "time": BASE_MS + 20 * 60_000 <= timestamp < BASE_MS + 50 * 60_000,
    }[case]


@pytest.mark.parametrize(
    ("case", "args"),
    [
        ("status", ["--status", "INVALID_ARGUMENT"]),
        ("statuses", ["--status", "DEADLINE_EXCEEDED,FAILED_PRECONDITION"]),
        ("where-value", ["--where", "value LIKE '%blue%'"]),
        ("where-columns",
         ["--where", "attempt >= 3 AND original_partition = 1 AND key IS NOT NULL"]),
        # ISO-8601 and epoch ms
        ("time", ["--since", render.format_ms(BASE_MS + 20 * 60_000),
                  "--until", str(BASE_MS + 50 * 60_000)]),
    ],
)  # fmt: skip
def test_a_dry_run_counts_exactly_the_selected_records_and_writes_nothing(
    mixed_dlq: dict[str, Any],
    spark: Any,
    capsys: pytest.CaptureFixture[str],
    case: str,
    args: list[str],
) -> None:
    group, path = mixed_dlq["group"], mixed_dlq["config"]
    expected = sum(_matches(i, r, case) for i, r in enumerate(mixed_dlq["records"]))
    assert 0 < expected < 90

    code, out, err = cli(
        capsys, "dlq", "merge", "--config", path, "--group", group, "--dry-run", "--json", *args
    )

    assert code == 0, err
    summary = json.loads(out)
    assert (summary["in_range"], summary["selected"], summary["merged"]) == (90, expected, 0)
    assert sum(end_offsets(mixed_dlq["bootstrap"], f"{group}.redrive").values()) == 0
    assert merge_marks(mixed_dlq["bootstrap"], group) == {}


def test_merge_writes_exactly_the_selected_records_unchanged(
    mixed_dlq: dict[str, Any], spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    bootstrap, group, path = mixed_dlq["bootstrap"], mixed_dlq["group"], mixed_dlq["config"]
    records = mixed_dlq["records"]
    # Given the INVALID_ARGUMENT records whose value mentions blue
    wanted = {
        1000 + i
        for i, r in enumerate(records)
        if _matches(i, r, "status") and _matches(i, r, "where-value")
    }
    assert 0 < len(wanted) < 30

    # When they are merged
    code, out, err = cli(
        capsys, "dlq", "merge", "--config", path, "--group", group, "--yes",
        "--status", "INVALID_ARGUMENT", "--where", "value LIKE '%blue%'",
    )  # fmt: skip

    # Then exactly they are in the redrive topic, byte for byte as in the DLQ
    assert code == 0, err
    assert out.startswith(f"merged {len(wanted)} of 90 records into {group}.redrive"), out
    written = consume_all(bootstrap, f"{group}.redrive")
    assert sorted(int(cp_of(m)[dlq_records.H_OFFSET]) for m in written) == sorted(wanted)
    source = {
        int(cp_of(m)[dlq_records.H_OFFSET]): m for m in consume_all(bootstrap, f"{group}.dlq")
    }
    for m in written:
        original = source[int(cp_of(m)[dlq_records.H_OFFSET])]
        assert (m.key(), m.value(), m.headers()) == (
            original.key(), original.value(), original.headers()
        )  # fmt: skip
    # and the mark records exactly them: purge --merged would delete only up to the first
    # record left out, here the very first one (i = 0)
    assert merge_marks(bootstrap, group) == {0: 0}  # all of them are in partition 0
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--merged", "--dry-run", "--json")  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["to_delete"], plan["merged_kept"]) == (0, len(wanted))

    # When records before a time are purged
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--until", str(BASE_MS + 30 * 60_000), "--yes", "--json")  # fmt: skip

    # Then each partition starts at its first record at or after that time
    assert code == 0, err
    assert json.loads(out)["deleted"] == 30
    left = consume_all(bootstrap, f"{group}.dlq")
    assert min(m.timestamp()[1] for m in left) == BASE_MS + 30 * 60_000 and len(left) == 60


# -- report -----------------------------------------------------------------------------------


def test_report_counts_match_a_direct_count_and_the_chart_is_a_png(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a DLQ of 100k records written fast, the proxy's way (cp-* headers)
    bootstrap, group, n = kafka.bootstrap, unique_name("dlqrep"), 100_000
    create_topic(bootstrap, f"{group}.dlq", partitions=4)
    rng = random.Random(11)
    hot = [(f"hot-{j}".encode(), 3000 - 100 * j) for j in range(10)]  # distinct top counts
    keys: list[bytes | None] = [k for k, c in hot for _ in range(c)] + [None] * 1500
    keys += [f"u{i}".encode() for i in range(n - len(keys))]
    rng.shuffle(keys)
    statuses = ["INVALID_ARGUMENT", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "DATA_LOSS"]

    # Reasons that carry values: nearly every one is unique, four kinds of them
    def reason() -> str:
        kind = rng.randrange(4)
        if kind == 0:
            return f"cannot parse field 'f{rng.randrange(40)}'"
        if kind == 1:
            hexed = f"{rng.getrandbits(128):032x}"
            uid = "-".join([hexed[:8], hexed[8:12], hexed[12:16], hexed[16:20], hexed[20:]])
            return f"order {uid} not found"
        if kind == 2:
            return (
                f"gave up after {rng.randrange(1, 6)} attempts: timeout after {rng.random():.3f}s"
            )
        return "schema mismatch"

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "acks": "all",
                         "compression.type": "lz4", "enable.idempotence": True})  # fmt: skip
    direct: dict[str, Counter[Any]] = {
        "status": Counter(), "reason": Counter(), "origin": Counter(), "hour": Counter(),
        "key": Counter(), "template": Counter(),
    }  # fmt: skip
    for i, key in enumerate(keys):
        status, why = rng.choice(statuses), reason()
        origin, ts = rng.randrange(6), BASE_MS + rng.randrange(5 * HOUR_MS)
        headers: list[tuple[str, str | bytes | None]] = [
            (dlq_records.H_TOPIC, b"orders"), (dlq_records.H_PARTITION, str(origin).encode()),
            (dlq_records.H_OFFSET, str(i).encode()), (dlq_records.H_ATTEMPT, b"1"),
            (dlq_records.H_STATUS, status.encode()), (dlq_records.H_REASON, why.encode()),
            (dlq_records.H_DEAD_LETTERED_AT, str(ts).encode()),
        ]  # fmt: skip
        while True:
            try:
                producer.produce(f"{group}.dlq", value=b"x" * 20, key=key, headers=headers,
                                 timestamp=ts)  # fmt: skip
                break
            except BufferError:
                producer.poll(0.1)
        direct["status"][status] += 1
        direct["reason"][why] += 1
        direct["template"][render.reason_template(why)] += 1
        direct["origin"][origin] += 1
        direct["hour"][render.format_hour(ts - ts % HOUR_MS)] += 1
        direct["key"][key] += 1
    assert producer.flush(60) == 0
    assert sum(end_offsets(bootstrap, f"{group}.dlq").values()) == n
    path = group_config(bootstrap, tmp_path, group)
    out_dir = tmp_path / "out"

    # When the report runs
    code, out, err = cli(capsys, "dlq", "report", "--config", path, "--group", group,
                         "--out", out_dir)  # fmt: skip

    # Then its counts are the direct counts
    assert code == 0, err
    report = json.loads((out_dir / f"{group}-dlq-report.json").read_text())
    assert report["total"] == n
    assert {s["status"]: s["count"] for s in report["by_status"]} == direct["status"]
    assert report["reasons_distinct"] == len(direct["reason"]) > 20_000
    assert len(report["by_reason"]) == 20
    assert all(direct["reason"][r["reason"]] == r["count"] for r in report["by_reason"])
    # and reasons group by their template (Spark's masks are Python's), with an example each
    templates = {t["template"]: t for t in report["by_reason_template"]}
    assert {k: t["count"] for k, t in templates.items()} == direct["template"]
    assert set(templates) == {
        "cannot parse field '<v>'", "order <id> not found", "schema mismatch",
        "gave up after <n> attempts: timeout after <n>s",
    }  # fmt: skip
    for template, entry in templates.items():
        assert render.reason_template(entry["example"]) == template
        distinct = {r for r in direct["reason"] if render.reason_template(r) == template}
        assert entry["distinct"] == len(distinct)
    assert {(o["topic"], o["partition"]): o["count"] for o in report["by_original_partition"]} == {
        ("orders", p): c for p, c in direct["origin"].items()
    }
    assert {h["hour"]: h["count"] for h in report["by_hour"]} == direct["hour"]
    assert [(k["key"], k["count"]) for k in report["top_keys"]] == [(k.decode(), c) for k, c in hot]
    assert sum(p["count"] for p in report["by_dlq_partition"]) == n
    # and the terminal shows the summary tables
    assert out.startswith(f"DLQ {group}.dlq of group {group}: {n} records")
    top_status, top_count = direct["status"].most_common(1)[0]
    assert f"  {top_status:<46} {top_count:>10}" in out
    assert "hot-0" in out and str(out_dir / f"{group}-dlq-report.png") in out
    assert "by cp-reason (4 kinds of" in out and "  order <id> not found" in out
    assert "    e.g. order " in out
    # and the chart is a PNG that an image library reads
    png = out_dir / f"{group}-dlq-report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 900
    assert pixels.std() > 0.05  # not a blank canvas


# -- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_dlq(kafka: Broker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A group with 6 dead letters and an empty redrive topic; a group with no DLQ at all."""
    group, empty = unique_name("dlqbad"), unique_name("dlqnone")
    create_topic(kafka.bootstrap, f"{group}.dlq", partitions=2)
    create_topic(kafka.bootstrap, f"{group}.redrive")
    produce(kafka.bootstrap, f"{group}.dlq", [
        dead_letter(i, status="INVALID_ARGUMENT", value=b"v", key=b"k", ts=BASE_MS + i)
        for i in range(6)
    ])  # fmt: skip
    directory = tmp_path_factory.mktemp("bad")
    config = make_config(kafka.bootstrap, group, [f"{group}.source"], ["127.0.0.1:1"])
    config = config.model_copy(
        update={
            "groups": [
                *config.groups,
                config.groups[0].model_copy(update={"name": empty}),
            ]
        }
    )
    path = write_config(directory / "proxy.yaml", config)
    return {"group": group, "empty": empty, "config": path, "bootstrap": kafka.bootstrap}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["merge", "--group", "no-such-group", "--yes"], "unknown group 'no-such-group'"),
        (["merge", "--group", "{empty}", "--yes"], "DLQ topic {empty}.dlq does not exist"),
        (["report", "--group", "{empty}"], "DLQ topic {empty}.dlq does not exist"),
        (["merge", "--group", "{group}", "--yes", "--where", "status = = 'X'"],
         "bad --where \"status = = 'X'\": [PARSE_SYNTAX_ERROR]"),
        (["merge", "--group", "{group}", "--yes", "--where", "value"],
         "bad --where 'value': [DATATYPE_MISMATCH.FILTER_NOT_BOOLEAN]"),
        (["merge", "--group", "{group}", "--yes", "--where", "colour = 'blue'"],
         "bad --where \"colour = 'blue'\": [UNRESOLVED_COLUMN"),
        (["merge", "--group", "{group}", "--yes", "--since", "2026-01-02", "--until",
          "2026-01-01T00:00:00Z"],
         "--since 2026-01-02T00:00:00.000+00:00 is after --until 2026-01-01T00:00:00.000+00:00"),
        (["merge", "--group", "{group}", "--yes", "--rate", "0"],
         "--rate must be more than 0 records per second, got 0"),
        (["merge", "--group", "{group}", "--yes", "--to", "no such topic"],
         "--to 'no such topic' is not a valid topic name"),
        (["merge", "--group", "{group}", "--yes", "--to", "{group}.dlq"],
         "--to {group}.dlq: that is the DLQ itself"),
        (["merge", "--group", "{group}"], "refusing to merge without confirmation"),
        (["purge", "--group", "{group}", "--all"],
         "refusing to delete records without confirmation: stdin is not a terminal; pass --yes"),
        (["inspect", "--group", "{group}", "--limit", "2000000"],
         "--limit must be 0 to 100,000 records, got 2000000"),
    ],
    ids=["unknown-group", "no-dlq-merge", "no-dlq-report", "where-syntax", "where-not-boolean",
         "where-column",
         "since-after-until", "rate-zero", "to-bad-name", "to-the-dlq", "merge-no-tty",
         "purge-no-tty", "inspect-limit-too-big"],
)  # fmt: skip
def test_bad_input_is_a_clear_error_with_exit_2_and_writes_nothing(
    small_dlq: dict[str, Any],
    spark: Any,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    names = {"group": small_dlq["group"], "empty": small_dlq["empty"]}
    bootstrap, group = small_dlq["bootstrap"], small_dlq["group"]
    before = end_offsets(bootstrap, f"{group}.dlq")

    code, out, err = cli(
        capsys, "dlq", args[0], "--config", small_dlq["config"],
        *[a.format(**names) for a in args[1:]],
    )  # fmt: skip

    assert code == 2
    assert message.format(**names) in err, err
    assert out == ""
    assert sum(end_offsets(bootstrap, f"{group}.redrive").values()) == 0
    assert merge_marks(bootstrap, group) == {}
    assert len(consume_all(bootstrap, f"{group}.dlq")) == 6 and before == end_offsets(
        bootstrap, f"{group}.dlq"
    )


def test_purge_on_a_terminal_asks_first_and_a_no_deletes_nothing(
    kafka: Broker, tmp_path: Path
) -> None:
    # Given a DLQ of 5 records and purge run on a terminal (a pseudo-terminal here)
    group = unique_name("dlqtty")
    create_topic(kafka.bootstrap, f"{group}.dlq")
    produce(kafka.bootstrap, f"{group}.dlq", [
        dead_letter(i, status="INTERNAL", value=b"v", key=None, ts=BASE_MS + i) for i in range(5)
    ])  # fmt: skip
    path = group_config(kafka.bootstrap, tmp_path, group)

    def purge_answering(answer: bytes) -> subprocess.CompletedProcess[str]:
        controller, terminal = pty.openpty()
        try:
            os.write(controller, answer)  # typed ahead; read when the prompt comes
            return subprocess.run(
                [sys.executable, "-m", "consumer_proxy", "dlq", "purge", "--config", str(path),
                 "--group", group, "--all"],
                stdin=terminal, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
            )  # fmt: skip
        finally:
            os.close(controller)
            os.close(terminal)

    # When the operator answers no, then yes
    declined = purge_answering(b"n\n")
    kept = end_offsets(kafka.bootstrap, f"{group}.dlq")
    left_after_no = len(consume_all(kafka.bootstrap, f"{group}.dlq"))
    accepted = purge_answering(b"y\n")

    # Then the first deleted nothing and exited 1, the second deleted everything
    assert declined.returncode == 1, declined.stderr
    assert f"delete 5 records from {group}.dlq? This cannot be undone. [y/N]" in declined.stdout
    assert "aborted: nothing deleted" in declined.stdout
    assert (kept, left_after_no) == ({0: 5}, 5)
    assert accepted.returncode == 0, accepted.stderr
    assert "deleted 5 records; partitions now start at 0:5" in accepted.stdout
    assert consume_all(kafka.bootstrap, f"{group}.dlq") == []


def test_purge_merged_deletes_nothing_under_a_merge_mark_past_the_end_of_the_log(
    kafka: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a DLQ partition of 60 records that no merge sent back, under a merge mark that
    # says 100 were (the log was cut below it, or the merge group's offsets were set by hand)
    bootstrap, group = kafka.bootstrap, unique_name("dlqpast")
    dlq_topic = f"{group}.dlq"
    create_topic(bootstrap, dlq_topic)
    produce(bootstrap, dlq_topic, [
        dead_letter(i, status="INTERNAL", value=b"v", key=None, ts=BASE_MS + i) for i in range(60)
    ])  # fmt: skip
    marker = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{group}.dlq-merge"})
    try:
        marker.commit(offsets=[TopicPartition(dlq_topic, 0, 100)], asynchronous=False)
    finally:
        marker.close()
    path = group_config(bootstrap, tmp_path, group)

    # When the merged records are purged
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--merged", "--yes")  # fmt: skip

    # Then nothing is deleted, and the operator is told why and what sends them back
    assert code == 0, err
    assert "nothing to delete" in out
    assert "partition 0: the merge mark goes past the end 60" in out
    assert "dlq merge --from-start" in out
    assert len(consume_all(bootstrap, dlq_topic)) == 60


@pytest.mark.parametrize("command", ["report", "merge"])
def test_without_pyspark_report_and_merge_say_how_to_install_it(
    small_dlq: dict[str, Any], command: str
) -> None:
    # PySpark made unimportable in a fresh interpreter, as when the extra is not installed
    code = (
        "import sys; sys.modules['pyspark'] = None; from consumer_proxy.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    args = ["dlq", command, "--config", str(small_dlq["config"]), "--group", small_dlq["group"]]
    result = subprocess.run(
        [sys.executable, "-c", code, *args, *(["--yes"] if command == "merge" else [])],
        capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "pip install 'consumer-proxy[pipeline]'" in result.stderr
    assert f"dlq {command} runs on Spark and needs PySpark" in result.stderr


# -- pure logic: times and the Java client's settings ------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1767225600000", 1_767_225_600_000),
        ("2026-01-01T00:00:00Z", 1_767_225_600_000),
        ("2026-01-01T01:30:00+01:30", 1_767_225_600_000),
        ("2026-01-01", 1_767_225_600_000),  # no offset: UTC
    ],
)
def test_times_are_iso_8601_or_epoch_ms(text: str, expected: int) -> None:
    assert commands.parse_time(text) == expected


def test_a_bad_time_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dlq", "merge", "--config", "x.yaml", "--group", "g", "--since", "yesterday"])
    assert exited.value.code == 2
    assert "'yesterday' is neither ISO-8601" in capsys.readouterr().err


def test_librdkafka_security_settings_become_the_java_clients(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_text("CERT")
    key.write_text("KEY")
    kafka = KafkaConfig(
        bootstrap_servers="broker:9093",
        client={
            "security.protocol": "sasl_ssl", "sasl.mechanisms": "SCRAM-SHA-512",
            "sasl.username": "proxy", "sasl.password": 'se"cret',
            "ssl.ca.location": "/etc/ca.pem", "ssl.certificate.location": str(cert),
            "ssl.key.location": str(key),
        },
    )  # fmt: skip

    options = tool_spark.java_kafka_options(kafka)

    assert options == {
        "kafka.bootstrap.servers": "broker:9093",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
        'required username="proxy" password="se\\"cret";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/ca.pem",
        "kafka.ssl.keystore.type": "PEM",
        "kafka.ssl.keystore.certificate.chain": "CERT",
        "kafka.ssl.keystore.key": "KEY",
    }


# -- per-record merge mark: merge by one status, then another, then purge ----------------------


def _held_offsets(bootstrap: str, topic: str) -> list[int]:
    """cp-original-offset of every record still in ``topic``."""
    return sorted(int(cp_of(m)[dlq_records.H_OFFSET]) for m in consume_all(bootstrap, topic))


def test_merge_by_status_then_another_then_purge_never_deletes_an_unmerged_record(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 120 dead letters over 2 partitions, three statuses interleaved
    bootstrap, group = kafka.bootstrap, unique_name("dlqmark")
    dlq_topic, redrive = f"{group}.dlq", f"{group}.redrive"
    create_topic(bootstrap, dlq_topic, partitions=2)
    create_topic(bootstrap, redrive)
    status_of = {1000 + i: STATUSES[(i // 2 + i % 2) % 3] for i in range(120)}
    produce(bootstrap, dlq_topic, [
        dead_letter(i, status=status_of[1000 + i], value=f"v{i}".encode(), key=f"k{i}".encode(),
                    ts=BASE_MS + i * 1000, partition=i % 2)
        for i in range(120)
    ])  # fmt: skip
    path = group_config(bootstrap, tmp_path, group)
    by_status = Counter(status_of.values())

    run = dlq_json(capsys, path, group)

    # When the INVALID_ARGUMENT records are merged and the merged records purged
    merged = run("merge", "--status", "INVALID_ARGUMENT", "--yes")
    purged = run("purge", "--merged", "--yes")

    # Then exactly they were sent back, and no record that was not is gone from the DLQ
    assert merged["merged"] == by_status["INVALID_ARGUMENT"] == 40
    held = _held_offsets(bootstrap, dlq_topic)
    assert {o for o, s in status_of.items() if s != "INVALID_ARGUMENT"} <= set(held)
    assert purged["deleted"] == 120 - len(held) < 40  # only the merged prefix went
    assert purged["merged_kept"] == 40 - purged["deleted"]

    # When the FAILED_PRECONDITION records are merged next, and purged
    merged = run("merge", "--status", "FAILED_PRECONDITION", "--yes")
    run("purge", "--merged", "--yes")

    # Then every one of them is found, though the first merge's range went past them
    assert merged["merged"] == by_status["FAILED_PRECONDITION"] == 40
    held = _held_offsets(bootstrap, dlq_topic)
    assert {o for o, s in status_of.items() if s == "DEADLINE_EXCEEDED"} <= set(held)

    # When the rest is merged, the merge rerun and everything merged purged
    merged = run("merge", "--yes")
    still_held_merged = sum(1 for o in held if status_of[o] != "DEADLINE_EXCEEDED")
    rerun = run("merge", "--yes")
    purged = run("purge", "--merged", "--yes")

    # Then the rest went back once, the merged ones skipped; the rerun sent nothing
    assert merged["merged"] == by_status["DEADLINE_EXCEEDED"] == 40
    assert merged["skipped_merged"] == still_held_merged
    assert (rerun["selected"], rerun["merged"]) == (0, 0)
    assert purged["merged_kept"] == 0 and _held_offsets(bootstrap, dlq_topic) == []
    # and across the three merges every dead letter was sent back exactly once
    sent = Counter(int(cp_of(m)[dlq_records.H_OFFSET]) for m in consume_all(bootstrap, redrive))
    assert sent == Counter(list(status_of))


def test_a_merge_whose_filter_answers_differently_each_time_marks_exactly_what_it_wrote(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 200 dead letters in one partition
    bootstrap, group = kafka.bootstrap, unique_name("dlqrand")
    dlq_topic, redrive = f"{group}.dlq", f"{group}.redrive"
    create_topic(bootstrap, dlq_topic)
    create_topic(bootstrap, redrive)
    offsets = [1000 + i for i in range(200)]
    produce(bootstrap, dlq_topic, [
        dead_letter(i, status=STATUSES[0], value=f"v{i}".encode(), key=None, ts=BASE_MS + i)
        for i in range(200)
    ])  # fmt: skip
    path = group_config(bootstrap, tmp_path, group)

    run = dlq_json(capsys, path, group)

    # When a canary merge sends back a random half (a filter that gives another answer each
    # time it is read), then a merge of everything else
    canary = run("merge", "--where", "rand() < 0.5", "--yes")
    rest = run("merge", "--yes")
    sent = Counter(int(cp_of(m)[dlq_records.H_OFFSET]) for m in consume_all(bootstrap, redrive))

    # Then the canary wrote what it counted, and every dead letter went back exactly once:
    # none marked merged without being written (skipped by the second merge, and deleted by
    # purge --merged), none written without being marked (sent again)
    assert 0 < canary["merged"] < 200
    assert canary["merged"] + rest["merged"] == 200
    assert sent == Counter(offsets)
    run("purge", "--merged", "--yes")
    assert _held_offsets(bootstrap, dlq_topic) == []


# -- the write as a controlled job: --rate and --to --------------------------------------------


def test_merge_rate_caps_the_write_and_to_copies_elsewhere_without_merging(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 600 dead letters over 3 partitions
    bootstrap, group, rate, n = kafka.bootstrap, unique_name("dlqrate"), 150, 600
    other = create_topic(bootstrap, unique_name("replay"), partitions=2)
    create_topic(bootstrap, f"{group}.dlq", partitions=3)
    create_topic(bootstrap, f"{group}.redrive")
    produce(bootstrap, f"{group}.dlq", [
        dead_letter(i, status=STATUSES[i % 3], value=b"v", key=None, ts=BASE_MS + i,
                    partition=i % 3)
        for i in range(n)
    ])  # fmt: skip
    path = group_config(bootstrap, tmp_path, group)

    # When they are sent to another topic at --rate 150
    code, out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group,
                         "--to", other, "--rate", str(rate), "--yes", "--json")  # fmt: skip

    # Then all of them are there, written at 150/s within 10 %, measured on the records' own
    # (produce-time) timestamps, so Spark's start-up is not part of it
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["selected"], summary["written"], summary["merged"]) == (n, n, 0)
    stamps = sorted(m.timestamp()[1] for m in consume_all(bootstrap, other))
    assert len(stamps) == n
    measured = (n - 1) / ((stamps[-1] - stamps[0]) / 1000)
    assert abs(measured - rate) <= 0.10 * rate, measured
    # and no second of it held more than a second's worth (plus the pacer's 5 % tolerance)
    busiest = max(
        sum(1 for t in stamps[i : i + rate * 2] if t < start + 1000)
        for i, start in enumerate(stamps)
    )
    assert busiest <= rate * 1.1, busiest
    with capsys.disabled():  # the figure for the record, shown with -s
        print(f"\nrate cap {rate}/s: measured {measured:.1f}/s, busiest second {busiest} records")
    # and progress was shown while it wrote
    assert f"writing {n} records to {other} at most {rate}/s" in err
    assert "written " in err and f" of {n} (" in err

    # And --to does not count as merged: the mark did not move, a merge still finds them all
    assert merge_marks(bootstrap, group) == {}
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--merged", "--yes")  # fmt: skip
    assert code == 0, err
    assert "nothing merged yet: nothing to delete" in out
    code, out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group,
                         "--dry-run", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["selected"] == n
    assert sum(end_offsets(bootstrap, f"{group}.redrive").values()) == 0


# -- more bad input --------------------------------------------------------------------------


def test_a_bad_where_is_an_error_even_with_nothing_to_merge(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    group = unique_name("dlqwhere")
    create_topic(kafka.bootstrap, f"{group}.dlq")
    create_topic(kafka.bootstrap, f"{group}.redrive")
    path = group_config(kafka.bootstrap, tmp_path, group)

    code, out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group, "--yes",
                         "--where", "colour = 'blue'")  # fmt: skip

    assert code == 2, (out, err)
    assert "bad --where \"colour = 'blue'\": [UNRESOLVED_COLUMN" in err
    assert out == ""


def test_inspect_json_keeps_headers_as_an_ordered_list_with_repeated_keys(
    kafka: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a dead letter whose user headers repeat a key
    group = unique_name("dlqhdr")
    create_topic(kafka.bootstrap, f"{group}.dlq")
    record = dead_letter(0, status="INTERNAL", value=b"v", key=b"k", ts=BASE_MS)
    ours = [h for h in record["headers"] if h[0].startswith(dlq_records.CP_PREFIX)]
    record["headers"] = [("trace", b"a"), ("tag", b"x"), ("trace", b"b"), *ours]
    produce(kafka.bootstrap, f"{group}.dlq", [record])
    path = group_config(kafka.bootstrap, tmp_path, group)

    code, out, err = cli(capsys, "dlq", "inspect", "--config", path, "--group", group, "--json")

    assert code == 0, err
    (sample,) = json.loads(out)["sample"]
    assert sample["headers"] == [
        {"key": "trace", "value": "a"}, {"key": "tag", "value": "x"},
        {"key": "trace", "value": "b"},
    ]  # fmt: skip
    assert sample["cp"][dlq_records.H_STATUS] == "INTERNAL"


def test_an_unreachable_broker_is_one_line_naming_it_and_exit_1(tmp_path: Path) -> None:
    # Given a config whose bootstrap server is a free port nothing listens on
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    path = group_config(address, tmp_path, "nobody")
    commands_run = {
        "inspect": ["inspect"],
        "report": ["report", "--out", str(tmp_path)],
        "merge": ["merge", "--yes"],
        "purge": ["purge", "--all", "--yes"],
        "inspect-debug": ["inspect", "--log-level", "debug"],
    }

    # When every DLQ command runs against it (at once: each waits out the client's timeout)
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumer_proxy",
                "dlq",
                args[0],
                "--config",
                str(path),
                "--group",
                "nobody",
                *args[1:],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        for name, args in commands_run.items()
    }
    results = {
        name: (*proc.communicate(timeout=120), proc.returncode) for name, proc in procs.items()
    }

    # Then each says in one line which servers it could not reach and what failed, exit 1
    for name in ("inspect", "report", "merge", "purge"):
        out, err, code = results[name]
        assert code == 1, (name, err)
        lines = err.splitlines()
        assert len(lines) == 1, (name, lines[:5], len(lines))
        assert lines[0].startswith(f"consumer-proxy: Kafka at {address}: "), lines[0]
        assert "nobody.dlq failed" in lines[0] and out == ""
    # and the client's own lines show only at debug level
    out, err, code = results["inspect-debug"]
    assert code == 1
    assert "Connect to ipv4#" in err and f"consumer-proxy: Kafka at {address}: " in err


def test_a_merge_whose_mark_would_overflow_writes_what_fits_and_loses_nothing(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given 20,000 dead letters in one partition, two statuses at random: merging one of
    # them leaves ~5,000 separate stretches, more than the mark's 4,000 characters record
    bootstrap, group, n = kafka.bootstrap, unique_name("dlqfull"), 20_000
    rng = random.Random(5)
    status_of = {1000 + i: rng.choice(["INVALID_ARGUMENT", "DATA_LOSS"]) for i in range(n)}
    create_topic(bootstrap, f"{group}.dlq")
    create_topic(bootstrap, f"{group}.redrive")
    produce(bootstrap, f"{group}.dlq", [
        dead_letter(i, status=status_of[1000 + i], value=b"v", key=None, ts=BASE_MS + i)
        for i in range(n)
    ])  # fmt: skip
    path = group_config(bootstrap, tmp_path, group)
    counts = Counter(status_of.values())

    def merge(status: str) -> tuple[dict[str, Any], str]:
        code, out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group,
                             "--status", status, "--yes", "--json")  # fmt: skip
        assert code == 0, err
        return json.loads(out), err

    # When INVALID_ARGUMENT is merged
    first, err = merge("INVALID_ARGUMENT")

    # Then it writes as much as the mark can record, says so, and the mark fits Kafka's limit
    assert first["selected"] == counts["INVALID_ARGUMENT"]
    assert 0 < first["deferred"] < first["selected"]
    assert first["written"] + first["deferred"] == first["selected"]
    assert f"the merge mark has room for {first['written']} of them" in err
    (_offset, metadata), *_ = committed_offsets(
        bootstrap, f"{group}.dlq-merge", f"{group}.dlq"
    ).values()
    assert 3000 < len(metadata or "") <= 4000

    # When DATA_LOSS is merged (filling the stretches between), then INVALID_ARGUMENT again
    second, _ = merge("DATA_LOSS")
    third, _ = merge("INVALID_ARGUMENT")

    # Then everything went back exactly once, and purge --merged may delete it all
    assert second["written"] == counts["DATA_LOSS"] and second["deferred"] == 0
    assert third["written"] == first["deferred"] and third["deferred"] == 0
    sent = Counter(
        int(cp_of(m)[dlq_records.H_OFFSET]) for m in consume_all(bootstrap, f"{group}.redrive")
    )
    assert sent == Counter(list(status_of))
    code, out, err = cli(capsys, "dlq", "purge", "--config", path, "--group", group,
                         "--merged", "--dry-run", "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["to_delete"] == n


def _dead_letter(i: int, key: bytes, value: bytes) -> dict[str, Any]:
    """A dead letter as the proxy writes it (its cp-* headers), to produce to a DLQ."""
    origin = dlq_records.Origin("orders", 0, 1000 + i, BASE_MS, 1)
    headers = dlq_records.dlq_headers(
        [], origin, attempt=1, status="INVALID_ARGUMENT", reason="r", endpoint="e",
        group="g", now_ms=BASE_MS + i,
    )  # fmt: skip
    return {"key": key, "value": value, "headers": headers, "timestamp": BASE_MS + i}


MIB = 1024 * 1024
BIG_TOPIC = {"max.message.bytes": str(16 * MIB)}
BIG_PRODUCER = {"message.max.bytes": 16 * MIB}


@pytest.mark.parametrize("rate", [None, "100"], ids=["spark-sink", "paced-writer"])
def test_a_dead_letter_over_1_mb_is_merged_back(
    kafka: Broker, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    rate: str | None,
) -> None:  # fmt: skip
    # Given a DLQ and redrive topic that allow 16 MiB records (as ensure_topics creates them
    # for a source topic that does), holding a small dead letter and one of 2 MiB (the proxy's
    # DLQ writer writes it: its producer allows 64 MiB)
    bootstrap, group = kafka.bootstrap, unique_name("bigm")
    create_topic(bootstrap, f"{group}.dlq", config=BIG_TOPIC)
    create_topic(bootstrap, f"{group}.redrive", config=BIG_TOPIC)
    big = b"\x07" * (2 * MIB)
    letters = [_dead_letter(0, b"a", b"small"), _dead_letter(1, b"b", big)]
    produce(bootstrap, f"{group}.dlq", letters, BIG_PRODUCER)
    path = group_config(bootstrap, tmp_path, group)

    # When they are merged back
    args = ["--rate", rate] if rate else []
    code, _out, err = cli(capsys, "dlq", "merge", "--config", path, "--group", group, "--yes",
                          *args)  # fmt: skip

    # Then the merge succeeds and both are in the redrive topic, the big one whole
    assert code == 0, err[-600:]
    assert [m.value() for m in consume_all(bootstrap, f"{group}.redrive")] == [b"small", big]
