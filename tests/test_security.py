"""Security: the proxy over SASL through the kafka.client passthrough, and secrets kept secret.

A broker of this module's own listens on PLAINTEXT (for the test's admin calls) and on
SASL_PLAINTEXT with PLAIN (user ``proxy``, password ``proxy-secret``); the proxy only ever
gets the SASL listener. The tests grep every output a user or operator can see for the
password: the proxy's logs (debug level, librdkafka's own ``conf``/``security`` debug
included), /metrics, /readyz, the status and DLQ commands, config errors, and the output of
a run that fails on a wrong password.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from consumer_proxy.cli import main
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    SASL_CLIENT_CONFIG,
    Broker,
    consume_all,
    create_topic,
    produce,
    start_broker,
    stop_broker,
    unique_name,
)
from tests.support.ledger import Ledger
from tests.support.proxy import ProxyProcess, caught_up, write_config
from tests.support.scrape import http_get
from tests.support.service import Behaviour, ThreadedService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = SASL_CLIENT_CONFIG["sasl.password"]
WRONG_PASSWORD = "Wr0ng-pa55word-7f3c9"
KEY_PASSWORD = "ssl-key-pa55-0b1d"  # ignored by SASL_PLAINTEXT, but a secret all the same
# librdkafka's own debug output, routed through the proxy's logs: it lists every property
DEBUG = {"debug": "conf,security"}


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    directory = tmp_path_factory.mktemp("kafka-sasl")
    try:
        broker = start_broker(directory, sasl_port=0, watch_pid=os.getpid())
        assert broker.sasl_bootstrap is not None
        yield broker
    finally:
        stop_broker(directory)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer_proxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def assert_no_secret(where: str, text: str, *secrets: str) -> None:
    for secret in secrets or (PASSWORD, KEY_PASSWORD):
        assert secret not in text, f"{secret!r} shows in {where}"


def sasl_config(
    path: Path, broker: Broker, group: str, topic: str, endpoint: str, **client: Any
) -> Path:
    """A config file reaching Kafka only through the SASL listener, with metrics on."""
    assert broker.sasl_bootstrap is not None
    write_config(
        path,
        broker.sasl_bootstrap,
        group,
        [topic],
        [endpoint],
        client={
            **SASL_CLIENT_CONFIG,
            "ssl.key.password": KEY_PASSWORD,
            **DEBUG,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            **client,
        },
    )
    config = json.loads(path.read_text())
    config["metrics"] = {"enabled": True, "host": "127.0.0.1", "port": 0}
    path.write_text(json.dumps(config))
    return path


# --------------------------------------------------------------------------- end to end


async def test_the_proxy_delivers_through_sasl_and_no_output_shows_the_password(
    sasl_broker: Broker, tmp_path: Path
) -> None:
    # Given 300 ledger messages, 10 of them poison pills, and a proxy configured for SASL
    topic, group = unique_name("sasl"), unique_name("sasl")
    create_topic(sasl_broker.bootstrap, topic, partitions=2)
    ledger = Ledger("SASL_PLAINTEXT end to end")
    records = ledger.records(
        300, partitions=2, value=lambda i, ident: b"poison" if i % 30 == 0 else ident.encode()
    )
    produce(sasl_broker.bootstrap, topic, records)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value == b"poison":
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="rejected")
        return Behaviour()

    with ThreadedService(behaviour) as service:
        config = sasl_config(tmp_path / "proxy.json", sasl_broker, group, topic, service.address)
        proxy = ProxyProcess(config, tmp_path / "proxy.log", "--log-level", "debug").start()
        try:
            # When it runs until every offset is committed
            async def done_or_dead() -> bool:
                return not proxy.alive() or await caught_up(sasl_broker.bootstrap, group, topic)

            await async_wait_until(done_or_dead, timeout=120, interval=0.3)
            assert proxy.alive(), proxy.output()[-3000:]
            port = int(re.findall(r"serving /metrics.* on 127\.0\.0\.1:(\d+)", proxy.output())[0])
            metrics = await http_get(port, "/metrics")

            # Ready once the first client statistics showed Kafka reachable (every 5 s)
            async def ready_now() -> tuple[int, str] | None:
                answer = await http_get(port, "/readyz")
                return answer if answer[0] == 200 else None

            ready = await async_wait_until(ready_now, timeout=30)
            status = run_cli("status", "--config", str(config), "--json")
            inspect = run_cli("dlq", "inspect", "--config", str(config), "--group", group)
        finally:
            code = proxy.stop()
        ledger.observe(service.deliveries)
    # Then it delivered everything over SASL
    assert code == 0, proxy.output()[-3000:]
    assert metrics[0] == 200 and "consumer_proxy_messages_total" in metrics[1]
    assert ready[0] == 200, ready
    assert status.returncode == 0, status.stderr
    assert inspect.returncode == 0, inspect.stderr
    dead = consume_all(sasl_broker.bootstrap, f"{group}.dlq")
    ledger.observe_dlq(dead)
    assert len(ledger.dead_lettered()) == 10
    ledger.check(max_duplicates=0, bound="no faults: none")
    # and the password shows in none of what it printed or served
    log = proxy.output()
    assert "sasl.password" in log, "librdkafka's conf debug output was not captured"
    assert_no_secret("the proxy's log", log)
    assert_no_secret("/metrics", metrics[1])
    assert_no_secret("/readyz", ready[1])
    assert_no_secret("consumer-proxy status", status.stdout + status.stderr)
    assert_no_secret("consumer-proxy dlq inspect", inspect.stdout + inspect.stderr)


def test_a_wrong_password_fails_and_shows_neither_password(
    sasl_broker: Broker, tmp_path: Path
) -> None:
    # Given a config whose SASL password is wrong
    topic, group = unique_name("sasl-bad"), unique_name("sasl-bad")
    create_topic(sasl_broker.bootstrap, topic, partitions=1)
    config = sasl_config(
        tmp_path / "bad.json",
        sasl_broker,
        group,
        topic,
        "127.0.0.1:1",
        **{"sasl.password": WRONG_PASSWORD},
    )
    # When the proxy and the read-only commands run with it (side by side: each waits for
    # its own timeouts before giving up)
    commands = {
        "run": ["run", "--config", str(config), "--log-level", "debug"],
        "status": ["status", "--config", str(config), "--log-level", "debug"],
        "dlq inspect": ["dlq", "inspect", "--config", str(config), "--group", group],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "consumer_proxy", *args],
            cwd=ROOT,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name, args in commands.items()
    }
    outputs = {name: proc.communicate(timeout=120)[0] for name, proc in procs.items()}
    # Then each fails with exit code 1 and prints neither password (nor the key's)
    for name, proc in procs.items():
        assert proc.returncode == 1, f"{name}: {outputs[name][-3000:]}"
        assert_no_secret(name, outputs[name], WRONG_PASSWORD, PASSWORD, KEY_PASSWORD)


# --------------------------------------------------------------------------- config errors

GOOD_GROUPS = [{"name": "g", "topics": ["t"], "service": {"endpoints": ["127.0.0.1:1"]}}]


@pytest.mark.parametrize(
    ("client", "env"),
    [
        # the librdkafka string form, where a mapping is expected
        (f"security.protocol=SASL_PLAINTEXT sasl.password={PASSWORD}", {}),
        ({"sasl.password": [PASSWORD]}, {}),
        ({"sasl.password": {"value": PASSWORD}}, {}),
        ({"sasl.password": PASSWORD, "group.id": "mine"}, {}),
        ({}, {"CONSUMER_PROXY_KAFKA__CLIENT": f'"sasl.password={PASSWORD}"'}),
        ({}, {"CONSUMER_PROXY_KAFKA__CLIENT": f'{{"sasl.password": "{PASSWORD}", '}),
        ({}, {"CONSUMER_PROXY_KAFKA__CLIENT": f'{{"sasl.password": ["{PASSWORD}"]}}'}),
    ],
)
def test_config_errors_never_echo_a_secret(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    client: Any,
    env: dict[str, str],
) -> None:
    # Given a config whose Kafka client settings are wrong and hold the password
    path = tmp_path / "proxy.json"
    kafka = {"bootstrap_servers": "127.0.0.1:9092", **({"client": client} if client else {})}
    path.write_text(json.dumps({"kafka": kafka, "groups": GOOD_GROUPS}))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # When it is validated
    code = main(["validate", "--config", str(path)])
    # Then it is rejected, saying where, without the secret
    out = capsys.readouterr()
    assert code == 2, out
    assert "kafka" in out.err
    assert_no_secret("the config error", out.out + out.err)


# --------------------------------------------------------------------------- dlq purge


def test_dlq_purge_without_yes_refuses_to_run_without_a_terminal(
    sasl_broker: Broker, tmp_path: Path
) -> None:
    # Given a group whose DLQ holds records
    topic, group = unique_name("purge"), unique_name("purge")
    create_topic(sasl_broker.bootstrap, topic, partitions=1)
    dlq_topic = create_topic(sasl_broker.bootstrap, f"{group}.dlq", partitions=1)
    produce(sasl_broker.bootstrap, dlq_topic, [f"dead-{i}" for i in range(5)])
    config = sasl_config(tmp_path / "proxy.json", sasl_broker, group, topic, "127.0.0.1:1")
    # When `dlq purge` runs without --yes and with no terminal (stdin is /dev/null)
    result = run_cli("dlq", "purge", "--config", str(config), "--group", group, "--all")
    # Then it refuses with exit code 2, says to pass --yes, and purges nothing
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--yes" in result.stderr
    assert len(consume_all(sasl_broker.bootstrap, dlq_topic)) == 5
    assert_no_secret("dlq purge", result.stdout + result.stderr)
