"""Building proxy configurations and running the proxy in the test's event loop."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException

from consumer_proxy.config import ProxyConfig
from consumer_proxy.proxy import Proxy

from .kafka import committed_offsets, end_offsets


def make_config(
    bootstrap: str,
    group: str,
    topics: Sequence[str],
    endpoints: Sequence[str],
    *,
    delivery: dict[str, Any] | None = None,
    service: dict[str, Any] | None = None,
    dlq: dict[str, Any] | None = None,
    breaker: dict[str, Any] | None = None,
    metrics_port: int | None = None,
    shutdown_grace_s: float = 5.0,
) -> ProxyConfig:
    """A one-group configuration with test-friendly defaults (fast commits, short backoff)."""
    return ProxyConfig(
        kafka={"bootstrap_servers": bootstrap},
        metrics={
            "enabled": metrics_port is not None,
            "port": metrics_port or 0,
            "host": "127.0.0.1",
        },
        shutdown_grace_s=shutdown_grace_s,
        groups=[
            {
                "name": group,
                "topics": list(topics),
                "service": {"endpoints": list(endpoints), "timeout_ms": 5000, **(service or {})},
                "delivery": {
                    "commit_interval_ms": 200,
                    "backoff": {"initial_ms": 20, "max_ms": 200},
                    **(delivery or {}),
                },
                "dlq": dlq or {},
                "circuit_breaker": breaker or {},
            }
        ],
    )


# Short session timeouts so that a test's rebalances are quick.
FAST_CONSUMER = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def start_proxy(config: ProxyConfig, **kwargs: Any) -> tuple[Proxy, asyncio.Task[None]]:
    """Run a proxy in the current loop; returns it and the task running it."""
    kwargs.setdefault("consumer_overrides", FAST_CONSUMER)
    proxy = Proxy(config, **kwargs)
    return proxy, asyncio.create_task(proxy.run(), name="proxy")


async def caught_up(bootstrap: str, group: str, topic: str) -> bool:
    """True once the group's committed offsets equal the topic's end offsets everywhere."""
    try:
        ends, committed = await asyncio.gather(
            asyncio.to_thread(end_offsets, bootstrap, topic),
            asyncio.to_thread(committed_offsets, bootstrap, group, topic),
        )
    except KafkaException:  # e.g. the group coordinator of a fresh broker is still loading
        return False
    return all(committed.get(p, (None,))[0] == end for p, end in ends.items() if end > 0)


# -- the proxy as a child process (kill -9, worker storms) -----------------------------------


def write_config(
    path: Path,
    bootstrap: str,
    group: str,
    topics: Sequence[str],
    endpoints: Sequence[str],
    *,
    delivery: dict[str, Any] | None = None,
    client: dict[str, Any] | None = None,
    shutdown_grace_s: float = 5.0,
    **group_extra: Any,
) -> Path:
    """Write a one-group config file for ``consumer-proxy run`` (JSON, which is YAML).

    ``client`` is the librdkafka passthrough; by default it carries FAST_CONSUMER, so a member
    that dies is noticed within seconds. Returns ``path``.
    """
    config = {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "client": FAST_CONSUMER if client is None else client,
        },
        "metrics": {"enabled": False},
        "shutdown_grace_s": shutdown_grace_s,
        "groups": [
            {
                "name": group,
                "topics": list(topics),
                "service": {"endpoints": list(endpoints), "timeout_ms": 5000},
                "delivery": {
                    "commit_interval_ms": 200,
                    "backoff": {"initial_ms": 20, "max_ms": 200},
                    **(delivery or {}),
                },
                **group_extra,
            }
        ],
    }
    path.write_text(json.dumps(config, indent=2))
    return path


class ProxyProcess:
    """``python -m consumer_proxy run --config F`` as a child process, its output in a file."""

    def __init__(self, config: Path, log: Path, *args: str) -> None:
        self.config = config
        self.log = log
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ProxyProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "consumer_proxy",
                    "run",
                    "--config",
                    str(self.config),
                    *self.args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no commit, no leaving the group."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the graceful shutdown); returns the exit code (SIGKILL after timeout_s)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")
