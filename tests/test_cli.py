"""The ``consumer-proxy`` command line: help, version, validate, status, dlq inspect, run.

Where the process boundary matters (exit codes of the real console entry, logs on stderr,
signals) the command runs as ``python -m consumer_proxy`` in a subprocess; the rest calls
``main()`` in-process.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from consumer_proxy import __version__
from consumer_proxy.cli import YOUNG_GC_THRESHOLD, main
from consumer_proxy.config import ProxyConfig
from consumer_proxy.core import records as dlq_records
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    unique_name,
)
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, ThreadedService
from tests.support.waiting import async_wait_until, wait_until

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "consumer_proxy"]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def write_config(path: Path, config: ProxyConfig) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return path


# -- help, version, usage errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], ["run", "validate", "status", "dlq", "examples:", "CONSUMER_PROXY_"]),
        (["run"], ["--config", "--workers", "--log-level", "--log-format"]),
        (["validate"], ["--config", "FILE|DIR"]),
        (["status"], ["--config", "--group", "--json"]),
        (["dlq", "inspect"], ["--config", "--group", "--json", "--limit"]),
    ],
    ids=["top", "run", "validate", "status", "dlq-inspect"],
)
def test_help_describes_each_command(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*args, "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert all(word in out for word in expected), out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"consumer-proxy {__version__}"


@pytest.mark.parametrize(
    "args",
    [["launch"], ["validate"], ["run", "--config"], ["status", "--config", "x", "--bogus"]],
    ids=["unknown command", "no config", "config without value", "unknown option"],
)
def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert "usage: consumer-proxy" in capsys.readouterr().err


def test_validate_exits_0_on_a_good_config_and_2_on_a_bad_one(tmp_path: Path) -> None:
    good = write_config(
        tmp_path / "good.yaml", make_config("localhost:9092", "g", ["t"], ["127.0.0.1:1"])
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("max_attempts: 5", "max_attempts: -1"))

    ok = run_cli("validate", "--config", str(good))
    failed = run_cli("validate", "--config", str(bad))

    assert (ok.returncode, ok.stdout.strip()) == (0, f"{good}: OK (1 group: g)")
    assert failed.returncode == 2 and failed.stdout == ""
    assert failed.stderr.strip() == (
        f"{bad}: groups.0(g).delivery.max_attempts: Input should be greater than or equal "
        "to 1 (got -1)"
    )


def test_run_with_a_bad_config_exits_2_before_connecting(tmp_path: Path) -> None:
    # Given a "broker" that records any connection, and a config with one mistake
    with socket.socket() as broker:
        broker.bind(("127.0.0.1", 0))
        broker.listen(8)
        address = f"127.0.0.1:{broker.getsockname()[1]}"
        config = make_config(address, "g", ["t"], ["127.0.0.1:1"])
        path = write_config(tmp_path / "proxy.yaml", config)
        path.write_text(path.read_text().replace("timeout_ms: 5000", "timeout_ms: 0"))

        # When the proxy is run with it
        result = run_cli("run", "--config", str(path))

        # Then it exits 2 naming the problem, and never connected to Kafka
        assert result.returncode == 2, result.stderr
        assert "groups.0(g).service.timeout_ms" in result.stderr
        broker.setblocking(False)
        with pytest.raises(BlockingIOError):
            broker.accept()


def test_run_freezes_start_up_and_collects_young_objects_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a proxy whose run only records how the collector is set when it starts
    seen: list[tuple[int, int]] = []

    class Proxy:
        def __init__(self, config: ProxyConfig, config_path: Path) -> None:
            pass

        def request_shutdown(self) -> None:
            pass

        async def run(self) -> None:
            seen.append((gc.get_threshold()[0], gc.get_freeze_count()))

    monkeypatch.setattr("consumer_proxy.proxy.Proxy", Proxy)
    config = make_config("localhost:9092", "g", ["t"], ["127.0.0.1:1"])
    path = write_config(tmp_path / "proxy.yaml", config)
    threshold = gc.get_threshold()
    try:
        # When the proxy is run
        code = main(["run", "--config", str(path)])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    # Then what start-up made is out of the collector's passes, and a young pass waits for
    # YOUNG_GC_THRESHOLD allocations (the messages held at high rates: bench_throughput.py)
    assert code == 0
    [(young, frozen)] = seen
    assert young == YOUNG_GC_THRESHOLD > threshold[0]
    assert frozen > 0


def test_run_refuses_worker_ports_that_overlap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given metrics on 9464 and gRPC health on 9465: worker 1 would need both for itself
    config = make_config("127.0.0.1:1", "g", ["t"], ["127.0.0.1:1"], metrics_port=9464)
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {**config.model_dump(mode="json", exclude_none=True), "health": {"grpc_port": 9465}}
        )
    )

    code = main(["run", "--config", str(path), "--workers", "2"])

    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"{path}: health.grpc_port: with --workers 2, ports 9465-9466 overlap the metrics "
        "ports 9464-9465; move one of them at least 2 apart"
    )


def test_run_refuses_worker_ports_past_65535(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given metrics on the last port: worker 1 would need 65536
    config = make_config("127.0.0.1:1", "g", ["t"], ["127.0.0.1:1"], metrics_port=65535)
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))

    # When it is run with two workers
    code = main(["run", "--config", str(path), "--workers", "2"])

    # Then it is refused before any worker starts, naming the field
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"{path}: metrics.port: with --workers 2, worker 1 would bind port 65536, past 65535; "
        "lower metrics.port or --workers"
    )


# -- against the real broker ------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(kafka: Broker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A group that has consumed 30 messages, 3 of them dead-lettered, and stopped."""
    topic, group = unique_name("cli"), unique_name("cli")
    create_topic(kafka.bootstrap, topic, partitions=2)
    values = [f"m{i}" if i % 10 else f"poison {i}" for i in range(30)]
    produce(
        kafka.bootstrap,
        topic,
        [
            {"key": f"k{i}", "value": v, "headers": [("trace-id", f"t{i}")]}
            for i, v in enumerate(values)
        ],
    )

    def behaviour(msg: handler_pb2.Message, _n: int) -> Behaviour:
        if msg.value.startswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="cannot parse")
        return Behaviour()

    async def consume(address: str) -> None:
        proxy, task = start_proxy(make_config(kafka.bootstrap, group, [topic], [address]))
        try:
            await async_wait_until(lambda: caught_up(kafka.bootstrap, group, topic), timeout=60)
        finally:
            await proxy.shutdown()
            await task

    with ThreadedService(behaviour) as service:
        asyncio.run(consume(service.address))
    config = make_config(kafka.bootstrap, group, [topic], ["127.0.0.1:1"])
    path = write_config(tmp_path_factory.mktemp("cli") / "proxy.yaml", config)
    return {"topic": topic, "group": group, "config": path, "bootstrap": kafka.bootstrap}


@pytest.mark.kafka
def test_status_json_reads_offsets_lag_and_dlq_depth_from_kafka(
    finished_run: dict[str, Any],
) -> None:
    topic, group = finished_run["topic"], finished_run["group"]

    result = run_cli("status", "--config", str(finished_run["config"]), "--json")

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (entry,) = report["groups"]
    assert entry["group"] == group
    assert (entry["total_lag"], entry["dlq_topic"], entry["dlq_depth"]) == (0, f"{group}.dlq", 3)
    ends = end_offsets(finished_run["bootstrap"], topic)
    rows = {r["partition"]: r for r in entry["partitions"] if r["topic"] == topic}
    assert {p: r["committed"] for p, r in rows.items()} == ends
    assert all(r["lag"] == 0 and r["end"] == ends[p] for p, r in rows.items())
    assert all(r["acked_above_commit"] == 0 for r in rows.values())
    assert entry["missing_topics"] == []


@pytest.mark.kafka
def test_status_prints_a_table_and_rejects_an_unknown_group(
    finished_run: dict[str, Any],
) -> None:
    config, group = str(finished_run["config"]), finished_run["group"]

    table = run_cli("status", "--config", config, "--group", group)
    unknown = run_cli("status", "--config", config, "--group", "nobody")

    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith(f"group {group}: lag 0, DLQ {group}.dlq depth 3\n")
    assert "  push: unary calls (delivery.batch off)\n" in table.stdout
    assert finished_run["topic"] in table.stdout
    assert unknown.returncode == 2
    assert "unknown group 'nobody'; configured groups: " + group in unknown.stderr


@pytest.mark.kafka
def test_dlq_inspect_json_decodes_the_cp_headers(finished_run: dict[str, Any]) -> None:
    topic, group = finished_run["topic"], finished_run["group"]

    result = run_cli(
        "dlq", "inspect", "--config", str(finished_run["config"]), "--group", group, "--json"
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["topic"], report["total"]) == (f"{group}.dlq", 3)
    assert sorted(r["value"] for r in report["sample"]) == ["poison 0", "poison 10", "poison 20"]
    for record in report["sample"]:
        cp = record["cp"]
        assert cp[dlq_records.H_TOPIC] == topic
        assert cp[dlq_records.H_STATUS] == "INVALID_ARGUMENT"
        assert cp[dlq_records.H_REASON] == "cannot parse"
        assert (cp[dlq_records.H_GROUP], cp[dlq_records.H_ATTEMPT]) == (group, "1")
        assert int(cp[dlq_records.H_OFFSET]) >= 0 and int(cp[dlq_records.H_DEAD_LETTERED_AT]) > 0
        # user headers kept apart, as an ordered list (a key may repeat)
        assert [h["key"] for h in record["headers"]] == ["trace-id"]
        assert record["headers"][0]["value"].startswith("t")
    consumed = consume_all(finished_run["bootstrap"], f"{group}.dlq")
    assert len(consumed) == 3  # inspect read without moving anything


@pytest.mark.kafka
def test_run_logs_json_lines_and_exits_0_on_sigterm(kafka: Broker, tmp_path: Path) -> None:
    # Given a config for a live topic and a service
    topic, group = unique_name("cli-run"), unique_name("cli-run")
    create_topic(kafka.bootstrap, topic)
    produce(kafka.bootstrap, topic, [f"m{i}" for i in range(10)])
    log = tmp_path / "proxy.log"
    with ThreadedService() as service:
        config = make_config(kafka.bootstrap, group, [topic], [service.address], metrics_port=0)
        path = write_config(tmp_path / "proxy.yaml", config)

        # When the proxy runs as a process with JSON logs, consumes, and gets SIGTERM
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [*COMMAND, "run", "--config", str(path), "--log-format", "json"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                cwd=ROOT,
            )
            try:
                wait_until(lambda: len(service.counts) == 10, timeout=60)
                wait_until(lambda: "assigned" in log.read_text(), timeout=30)
                process.send_signal(signal.SIGTERM)
                code = process.wait(timeout=60)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    # Then it stopped cleanly and every stderr line is a JSON log record
    assert code == 0, log.read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"ts", "level", "logger", "msg", "process"} <= set(records[0])
    messages = [r["msg"] for r in records]
    assert any(f"group {group}: assigned {topic}[0]" in m for m in messages), messages
    assert any(f"group {group}: stopped" in m for m in messages), messages
    assert {r["level"] for r in records} <= {"debug", "info", "warning"}


def test_sigterm_during_startup_exits_0_within_grace(tmp_path: Path) -> None:
    # Given a proxy whose Kafka is unreachable (nothing listens on its port), so that it is
    # stuck in its start-up metadata call (30 s), and a shutdown grace shorter than that
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    grace = 20.0
    config = make_config(dead, "starting", ["orders"], ["127.0.0.1:1"], shutdown_grace_s=grace)
    path = write_config(tmp_path / "proxy.yaml", config)
    log = tmp_path / "proxy.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [*COMMAND, "run", "--config", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=ROOT,
        )
        try:
            # When it gets SIGTERM while still starting
            wait_until(
                lambda: (
                    "starting: groups starting" in log.read_text() or process.poll() is not None
                ),
                timeout=60,
                message="the proxy to start",
            )
            assert process.poll() is None, log.read_text()
            process.send_signal(signal.SIGTERM)
            # Then it exits with 0 within the grace period (a generous bound: it needs far less)
            code = process.wait(timeout=grace)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code == 0, log.read_text()
    assert "stopped during start-up" in log.read_text()
