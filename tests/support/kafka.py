"""The real local Kafka broker for tests (through scripts/kafka) and small Kafka helpers.

Everything here is synchronous and blocking: call it from test bodies and fixtures, or through
``asyncio.to_thread`` from async tests.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]

from .waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kafka"
ADMIN_TIMEOUT_S = 30.0

Record = Mapping[str, Any] | tuple[Any, ...] | bytes | str


class BrokerError(RuntimeError):
    """scripts/kafka failed; the message carries what it printed."""


# Client settings for the optional SASL_PLAINTEXT listener (start_broker(..., sasl_port=0)).
SASL_CLIENT_CONFIG = {
    "security.protocol": "SASL_PLAINTEXT",
    "sasl.mechanism": "PLAIN",
    "sasl.username": "proxy",
    "sasl.password": "proxy-secret",
}


@dataclass(frozen=True)
class Broker:
    """A broker started by scripts/kafka: its bootstrap address and its directory.

    ``sasl_bootstrap`` is the SASL_PLAINTEXT listener (see SASL_CLIENT_CONFIG), if started.
    """

    bootstrap: str
    dir: Path
    sasl_bootstrap: str | None = None

    @property
    def port(self) -> int:
        return int(self.bootstrap.rpartition(":")[2])


def run_script(*args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Run scripts/kafka with this interpreter and return the finished process (any exit)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def start_broker(
    dir: Path,
    port: int | None = 0,
    *,
    sasl_port: int | None = None,
    watch_pid: int | None = None,
    timeout_s: float = 120.0,
) -> Broker:
    """Start (or find running) the broker of ``dir`` and return it.

    ``port`` 0 picks a free port; None reuses the port ``dir`` recorded on its last start.

    ``watch_pid`` makes the broker stop by itself when that process exits, so a test session
    killed before its teardown leaves no broker behind. Raises BrokerError on failure.
    """
    args = ["start", "--dir", str(dir), "--timeout", str(timeout_s)]
    if port is not None:
        args += ["--port", str(port)]
    if sasl_port is not None:
        args += ["--sasl-port", str(sasl_port)]
    if watch_pid is not None:
        args += ["--watch-pid", str(watch_pid)]
    try:
        result = run_script(*args, timeout_s=timeout_s + 120.0)  # + a first-run Maven fetch
    except subprocess.TimeoutExpired as exc:
        stop_broker(dir)  # the script was killed mid-start: do its clean-up
        raise BrokerError(f"scripts/kafka start --dir {dir} hung for {exc.timeout:g}s") from exc
    lines = [line for line in result.stdout.splitlines() if line.startswith("bootstrap=")]
    if result.returncode != 0 or len(lines) != 1:
        raise BrokerError(
            f"scripts/kafka start --dir {dir} failed (exit {result.returncode}):\n"
            f"{result.stderr.strip()}\n{result.stdout.strip()}".rstrip()
        )
    bootstrap = lines[0].partition("=")[2]
    sasl_port_file = Path(dir) / "sasl_port"
    sasl_bootstrap = None
    if sasl_port_file.exists():
        sasl_bootstrap = f"{bootstrap.rpartition(':')[0]}:{int(sasl_port_file.read_text())}"
    return Broker(bootstrap=bootstrap, dir=Path(dir), sasl_bootstrap=sasl_bootstrap)


def stop_broker(dir: Path) -> None:
    """Stop the broker of ``dir`` (idempotent). Raises BrokerError on failure."""
    result = run_script("stop", "--dir", str(dir), timeout_s=60.0)
    if result.returncode != 0:
        raise BrokerError(
            f"scripts/kafka stop --dir {dir} failed (exit {result.returncode}):\n"
            f"{result.stderr.strip()}"
        )


def unique_name(prefix: str) -> str:
    """A topic or group name no other test uses: ``prefix-<10 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def admin(bootstrap: str) -> AdminClient:
    """A plain AdminClient for the broker."""
    return AdminClient({"bootstrap.servers": bootstrap})


def partitions_of(bootstrap: str, topic: str) -> list[int]:
    """The topic's partition ids; KafkaException when the topic does not exist."""
    metadata = admin(bootstrap).list_topics(topic, timeout=ADMIN_TIMEOUT_S).topics[topic]
    if metadata.error is not None:
        raise KafkaException(metadata.error)
    return sorted(metadata.partitions)


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
) -> str:
    """Create a topic and return its name once every partition has a leader."""
    client = admin(bootstrap)
    new = NewTopic(name, num_partitions=partitions, config=dict(config or {}))
    client.create_topics([new], request_timeout=ADMIN_TIMEOUT_S)[name].result()

    def ready() -> bool:
        metadata = client.list_topics(name, timeout=ADMIN_TIMEOUT_S).topics[name]
        return (
            metadata.error is None
            and len(metadata.partitions) == partitions
            and all(p.leader >= 0 for p in metadata.partitions.values())
        )

    wait_until(ready, timeout=ADMIN_TIMEOUT_S, message=f"topic {name} to have leaders")
    return name


def _fields(record: Record) -> dict[str, Any]:
    """Normalise a dict / (key, value, headers, partition) tuple / bare value to kwargs."""
    if isinstance(record, bytes | str):
        return {"value": record}
    if isinstance(record, Mapping):
        unknown = set(record) - {"key", "value", "headers", "partition", "timestamp"}
        if unknown:
            raise ValueError(f"unknown record fields {sorted(unknown)} in {record!r}")
        fields = dict(record)
    else:
        if len(record) > 4:
            raise ValueError(f"a record tuple is (key, value, headers, partition): {record!r}")
        fields = dict(zip(("key", "value", "headers", "partition"), record, strict=False))
    headers = fields.get("headers")
    if isinstance(headers, Mapping):
        fields["headers"] = list(headers.items())
    return {k: v for k, v in fields.items() if v is not None}


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[Record],
    config: Mapping[str, Any] | None = None,
) -> list[tuple[int, int]]:
    """Produce records (acks=all), flush, and return their (partition, offset) in order.

    A record is a dict with any of key / value / headers / partition / timestamp, a tuple
    (key, value, headers, partition) that may stop early, or a bare value. Raises
    KafkaException when any delivery failed. ``config`` adds or overrides producer settings.

    Not idempotent by default: librdkafka holds a new idempotent producer back ~0.5 s before
    its first send, and one local broker rarely makes a producer retry (and duplicate).
    """
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            **(config or {}),
        }
    )
    results: list[tuple[int, int] | None] = []
    errors: list[str] = []

    def on_delivery(index: int, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(f"record #{index}: {err}")
        else:
            results[index] = (msg.partition() or 0, msg.offset() or 0)

    for index, record in enumerate(records):
        results.append(None)
        fields = _fields(record)
        while True:
            try:
                producer.produce(topic, on_delivery=functools.partial(on_delivery, index), **fields)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)
        producer.poll(0)
    left = producer.flush(ADMIN_TIMEOUT_S)
    if left:
        errors.append(f"{left} record(s) still undelivered after {ADMIN_TIMEOUT_S:g}s")
    if errors:
        raise KafkaException(f"producing to {topic} failed: " + "; ".join(errors[:10]))
    return [r for r in results if r is not None]


def end_offsets(bootstrap: str, topic: str, *, committed_only: bool = False) -> dict[int, int]:
    """{partition: end offset}: the high watermark, or the last stable offset if committed_only."""
    client = admin(bootstrap)
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    specs = {TopicPartition(topic, p): latest for p in partitions_of(bootstrap, topic)}
    isolation = IsolationLevel.READ_COMMITTED if committed_only else IsolationLevel.READ_UNCOMMITTED
    futures = client.list_offsets(specs, isolation_level=isolation, request_timeout=ADMIN_TIMEOUT_S)
    return {tp.partition: future.result().offset for tp, future in futures.items()}


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, str | None]]:
    """{partition: (committed offset, commit metadata)} for the partitions ``group`` committed."""
    return {tp.partition: (tp.offset, tp.metadata) for tp in committed(bootstrap, group, topic)}


def committed(bootstrap: str, group: str, topic: str) -> list[TopicPartition]:
    """The commits of ``group`` on ``topic``'s partitions (offset, metadata, leader epoch).

    Retried for a while when the group coordinator is not ready (a broker just started or
    restarted answers NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS for a few seconds).
    """
    transient = {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError._TIMED_OUT,
    }
    deadline = time.monotonic() + ADMIN_TIMEOUT_S
    while True:
        # The consumer's committed() carries commit metadata, as the proxy itself reads it.
        consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        try:
            wanted = [TopicPartition(topic, p) for p in partitions_of(bootstrap, topic)]
            found = consumer.committed(wanted, timeout=ADMIN_TIMEOUT_S)
            errors = [tp.error for tp in found if tp.error is not None]
        except KafkaException as exc:
            found, errors = [], [exc.args[0]]
        finally:
            consumer.close()
        if not errors:
            break
        code = errors[0].code() if isinstance(errors[0], KafkaError) else None
        if code not in transient or time.monotonic() >= deadline:
            raise KafkaException(errors[0])
        time.sleep(0.2)
    return [tp for tp in found if tp.offset >= 0]


def value_of(message: Message) -> bytes:
    """A consumed record's value; fails on a tombstone (the client types it optional)."""
    value = message.value()
    assert isinstance(value, bytes), f"expected a value, got {value!r}"
    return value


def headers_of(message: Message) -> dict[str, bytes]:
    """A consumed record's headers as a dict (the last of repeated keys; none is ``{}``)."""
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return {key: value for key, value in pairs if isinstance(value, bytes)}


def consume_all(bootstrap: str, topic: str, timeout: float = 30.0) -> list[Message]:
    """Every committed record of ``topic`` up to its current end, sorted by (partition, offset).

    Reads by assignment from the beginning with a throwaway group id that never joins nor
    commits, so it disturbs no consumer group. Raises AssertionError after ``timeout`` seconds.
    """
    targets = end_offsets(bootstrap, topic, committed_only=True)
    pending = {p for p, end in targets.items() if end > 0}
    if not pending:
        return []
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("consume-all"),
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    messages: list[Message] = []
    deadline = time.monotonic() + timeout
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(pending)])
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"consume_all({topic}) timed out after {timeout:g}s: partitions "
                    f"{sorted(pending)} not read up to {targets} ({len(messages)} read)"
                )
            for msg in consumer.consume(500, timeout=min(remaining, 0.5)):
                err = msg.error()
                partition, offset = msg.partition(), msg.offset()
                # Both are set on consumed messages and on partition-EOF events.
                assert partition is not None and offset is not None
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(err)
                    if offset >= targets[partition]:
                        pending.discard(partition)
                    continue
                if offset < targets[partition]:
                    messages.append(msg)
                if offset >= targets[partition] - 1:
                    pending.discard(partition)
    finally:
        consumer.close()
    return sorted(messages, key=lambda m: (m.partition(), m.offset()))


def java_pids_mentioning(text: str | os.PathLike[str]) -> list[int]:
    """Live java processes whose command line mentions ``text`` (e.g. a broker's dir)."""
    needle = os.fsencode(str(text))
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        args = cmdline.split(b"\0")
        if args and args[0].endswith(b"java") and needle in cmdline:
            pids.append(int(proc.name))
    return pids


def pid_alive(pid: int) -> bool:
    """True for a live process; a zombie awaiting its reaper counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def alter_topic(bootstrap: str, topic: str, config: Mapping[str, str]) -> None:
    """Set topic configs (incrementally) and wait for the change to be accepted."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        ResourceType,
    )

    resource = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in config.items()
        ],
    )
    client = admin(bootstrap)  # keep it alive until the futures resolve
    for future in client.incremental_alter_configs([resource]).values():
        future.result(timeout=ADMIN_TIMEOUT_S)
