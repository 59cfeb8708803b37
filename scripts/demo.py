#!/usr/bin/env python3
"""The whole story on one machine: `make demo`.

Starts a local Kafka broker (scripts/kafka), three instances of the example service with
different latencies, and the proxy (`consumer-proxy run`); produces sample traffic with a few
poison pills; shows a live progress line; and ends with an account: every produced message
was acked or dead-lettered, and the committed offsets reached the end of every partition.

    python scripts/demo.py [--messages 5000] [--partitions 6] [--batch] [--keep]

--batch turns on batch push (delivery.batch: HandleMessageBatch calls of up to 100 messages,
8 calls in flight) and the account adds the calls made and the messages they carried.

Everything lives under .demo/ (broker data, config, logs). With --keep the broker, services
and proxy keep running after the account so you can try `consumer-proxy status` and
`consumer-proxy dlq inspect` (the commands are printed); without it everything is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
TOPIC = "demo.orders"
GROUP = "demo-billing"
SERVICES = [(3, 5), (10, 20), (25, 50)]  # (latency ms, jitter ms) of each instance


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def say(text: str) -> None:
    print(text, flush=True)


class DemoError(Exception):
    """A failure told as one message (no traceback), exit code 1."""


def start_kafka(keep: bool) -> str:
    say("• starting Kafka (first run downloads the broker jars from Maven Central) ...")
    started = time.monotonic()
    cmd = [sys.executable, str(ROOT / "scripts" / "kafka"), "start", "--dir", str(DEMO / "kafka")]
    cmd += ["--port", "0"]
    if not keep:  # the broker goes with the demo, however the demo ends (kill, SIGKILL)
        cmd += ["--watch-pid", str(os.getpid())]
    # stderr is scripts/kafka's word to the user (Maven fetch, java not found, the broker's
    # last log lines): shown, never swallowed.
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise DemoError(f"could not start Kafka (scripts/kafka exit {proc.returncode}; see above)")
    out = proc.stdout
    bootstrap = next(
        line.split("=", 1)[1] for line in out.splitlines() if line.startswith("bootstrap=")
    )
    say(f"  Kafka at {bootstrap} ({time.monotonic() - started:.1f}s), data in .demo/kafka")
    return bootstrap


def reset_topics(bootstrap: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [TOPIC, f"{GROUP}.dlq", f"{GROUP}.redrive"]
    existing = admin.list_topics(timeout=10).topics
    old = [n for n in names if n in existing]
    if old:
        for future in admin.delete_topics(old, operation_timeout=30).values():
            future.result()
        while any(n in admin.list_topics(timeout=10).topics for n in old):
            time.sleep(0.2)
    with contextlib.suppress(KafkaException):  # the group may not exist yet
        admin.delete_consumer_groups([GROUP])[GROUP].result()
    for future in admin.create_topics([NewTopic(TOPIC, partitions, 1)]).values():
        future.result()
    say(f"• topic {TOPIC} with {partitions} partitions (fresh)")


def start_services(logs: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, endpoints = [], []
    for latency, jitter in SERVICES:
        port = free_port()
        log = open(logs / f"service-{port}.log", "wb")  # noqa: SIM115 (lives as long as the process)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "examples" / "example_service.py"),
                    "--port",
                    str(port),
                    "--latency-ms",
                    str(latency),
                    "--jitter-ms",
                    str(jitter),
                    "--poison-marker",
                    "poison",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        endpoints.append(f"127.0.0.1:{port}")
    say(
        f"• example service instances at {', '.join(endpoints)} "
        f"(latency {', '.join(f'{lat}±{jit}ms' for lat, jit in SERVICES)}); "
        "messages containing 'poison' are poison pills"
    )
    return procs, endpoints


def write_config(
    bootstrap: str, endpoints: list[str], metrics_port: int, batch: bool = False
) -> Path:
    config = DEMO / "proxy.yaml"
    eps = ", ".join(f'"{e}"' for e in endpoints)
    config.write_text(f"""# Written by scripts/demo.py
kafka:
  bootstrap_servers: {bootstrap}
metrics: {{host: 127.0.0.1, port: {metrics_port}}}
shutdown_grace_s: 10
groups:
  - name: {GROUP}
    topics: [{TOPIC}]
    service:
      endpoints: [{eps}]
      timeout_ms: 2000
    delivery:
      max_in_flight: 1000
      concurrency: {8 if batch else 200}{BATCH_LINE if batch else ""}
      max_attempts: 3
      commit_interval_ms: 500
      backoff: {{initial_ms: 50, max_ms: 1000}}
    circuit_breaker: {{failure_threshold: 20, reset_timeout_s: 5}}
""")
    return config


BATCH_LINE = "\n      batch: {max_messages: 100}"


def produce(bootstrap: str, count: int, poison_every: int, seconds: float) -> int:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 10})
    poison = 0
    started = time.monotonic()
    for i in range(count):
        is_poison = poison_every and i % poison_every == poison_every // 2
        poison += bool(is_poison)
        value = f'{{"order": {i}, "amount": {i % 97}.50{", poison" if is_poison else ""}}}'
        while True:
            try:
                producer.produce(
                    TOPIC, key=f"customer-{i % 300}", value=value, headers=[("source", b"demo")]
                )
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
        ahead = started + seconds * (i + 1) / count - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    producer.flush(30)
    return poison


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "consumer_proxy_messages_total":
                key = sample.labels["outcome"]
            elif sample.name in (
                "consumer_proxy_lag_messages",
                "consumer_proxy_in_flight",
                "consumer_proxy_batch_size_messages_count",
                "consumer_proxy_batch_size_messages_sum",
            ):
                key = sample.name.removeprefix("consumer_proxy_")
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def offsets(bootstrap: str) -> tuple[dict[int, int], dict[int, int]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": GROUP})
    try:
        parts = sorted(consumer.list_topics(TOPIC, timeout=10).topics[TOPIC].partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=10)[1]
            for p in parts
        }
        committed = {
            tp.partition: tp.offset
            for tp in consumer.committed([TopicPartition(TOPIC, p) for p in parts], timeout=10)
        }
    finally:
        consumer.close()
    return ends, committed


def dlq_count(bootstrap: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "demo-account"})
    try:
        topic = f"{GROUP}.dlq"
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            max(0, hi - lo)
            for lo, hi in (
                consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts
            )
        )
    finally:
        consumer.close()


def _interrupted(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000, help="messages to produce")
    parser.add_argument("--partitions", type=int, default=6, help="partitions of the topic")
    parser.add_argument("--poison-every", type=int, default=100, help="one poison pill per N")
    parser.add_argument("--seconds", type=float, default=5.0, help="spread production over")
    parser.add_argument("--keep", action="store_true", help="leave everything running")
    parser.add_argument(
        "--batch", action="store_true", help="push with HandleMessageBatch (delivery.batch)"
    )
    args = parser.parse_args()
    # SIGTERM (kill, timeout, a CI cancel) and SIGHUP (the terminal closed) stop the demo as
    # Ctrl-C does: through the cleanup below, which stops the services, the proxy and Kafka.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    logs = DEMO / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    kafka_started = False
    try:
        bootstrap = start_kafka(args.keep)
        kafka_started = True
        reset_topics(bootstrap, args.partitions)
        services, endpoints = start_services(logs)
        procs += services
        metrics_port = free_port()
        config = write_config(bootstrap, endpoints, metrics_port, args.batch)
        proxy_log = open(logs / "proxy.log", "wb")  # noqa: SIM115
        proxy = subprocess.Popen(
            [sys.executable, "-m", "consumer_proxy", "run", "--config", str(config)],
            stdout=proxy_log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proxy)
        say(
            f"• proxy running (config .demo/proxy.yaml, log .demo/logs/proxy.log, "
            f"metrics http://127.0.0.1:{metrics_port}/metrics)"
        )

        result: dict[str, int] = {}
        producer = threading.Thread(
            target=lambda: result.update(
                poison=produce(bootstrap, args.messages, args.poison_every, args.seconds)
            ),
            daemon=True,
        )
        say(
            f"• producing {args.messages} messages over {args.seconds:.0f}s "
            f"(1 in {args.poison_every} is a poison pill)\n"
        )
        started = time.monotonic()
        producer.start()
        last = (started, 0.0)
        deadline = started + 120
        done = False
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if proxy.poll() is not None:
                say(f"\nthe proxy exited with {proxy.returncode}; see .demo/logs/proxy.log")
                return 1
            try:
                m = scrape(metrics_port)
            except OSError:
                continue
            acked, dead = m.get("ack", 0), m.get("dead_letter", 0)
            delivered = acked + dead + m.get("retry", 0) + m.get("drop", 0)
            now = time.monotonic()
            rate = (acked + dead - last[1]) / max(now - last[0], 1e-6)
            last = (now, acked + dead)
            sys.stdout.write(
                f"\r  delivered {delivered:>6.0f}  acked {acked:>6.0f}  dead-lettered {dead:>4.0f}"
                f"  retries {m.get('retry', 0):>4.0f}  {rate:>6.0f} msg/s  "
                f"in flight {m.get('in_flight', 0):>4.0f}  lag {m.get('lag', 0):>6.0f}   "
            )
            sys.stdout.flush()
            if not producer.is_alive() and acked + dead >= args.messages:
                ends, committed = offsets(bootstrap)
                if all(committed.get(p) == end for p, end in ends.items()):
                    done = True
                    break
        elapsed = time.monotonic() - started
        say("")
        ends, committed = offsets(bootstrap)
        m = scrape(metrics_port)
        in_dlq = dlq_count(bootstrap)
        poison = result.get("poison", 0)
        acked = int(m.get("ack", 0))
        say("\n── account ─────────────────────────────────────────────")
        say(f"  produced            {args.messages}")
        say(f"  acked               {acked}")
        say(f"  dead-lettered       {in_dlq}  (poison pills produced: {poison})")
        say(f"  retries             {int(m.get('retry', 0))}")
        if args.batch:
            calls = int(m.get("batch_size_messages_count", 0))
            carried = int(m.get("batch_size_messages_sum", 0))
            say(f"  batch calls         {calls} carrying {carried} messages")
        for p in sorted(ends):
            mark = "✓" if committed.get(p) == ends[p] else "✗"
            say(f"  partition {p}: committed {committed.get(p)} / end {ends[p]} {mark}")
        ok = done and acked + in_dlq == args.messages and in_dlq == poison
        say(f"  time                {elapsed:.1f}s")
        say(
            "  RESULT: every message acked or dead-lettered, commits at the end"
            if ok
            else "  RESULT: INCOMPLETE — see .demo/logs/"
        )
        cfg = config.relative_to(ROOT)
        if args.keep:
            say(
                "\nTry:\n"
                f"  .venv/bin/consumer-proxy status --config {cfg}\n"
                f"  .venv/bin/consumer-proxy dlq inspect --config {cfg} --group {GROUP} --limit 3"
            )
            say(
                "\n(--keep: still running; stop with: scripts/kafka stop --dir .demo/kafka and "
                f"kill {' '.join(str(p.pid) for p in procs)})"
            )
            procs.clear()
            kafka_started = False
        return 0 if ok else 1
    except DemoError as exc:
        say(f"\ndemo: {exc}")
        return 1
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if kafka_started:
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "kafka"),
                    "stop",
                    "--dir",
                    str(DEMO / "kafka"),
                ],
                check=False,
                capture_output=True,
            )


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
