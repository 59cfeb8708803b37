"""Building proxy configurations and running the proxy in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from confluent_kafka import KafkaException

from consumer_proxy.config import ProxyConfig
from consumer_proxy.proxy import Proxy

from .kafka import committed_offsets, end_offsets
from .waiting import async_wait_until


def config_dict(
    bootstrap: str,
    group: str,
    topics: Sequence[str],
    endpoints: Sequence[str],
    *,
    delivery: dict[str, Any] | None = None,
    service: dict[str, Any] | None = None,
    client: dict[str, Any] | None = None,
    metrics_port: int | None = None,
    shutdown_grace_s: float = 5.0,
    fast_delivery: bool = True,
    **group_extra: Any,
) -> dict[str, Any]:
    """A one-group configuration as the YAML file holds it; the one builder behind
    :func:`make_config`, :func:`write_config` and the benches.

    Test-friendly defaults: unary delivery (``batch: off``, unless ``delivery`` says
    otherwise), a 5 s service deadline, and with ``fast_delivery`` commits every
    200 ms and a 20-200 ms backoff (``delivery`` overrides each). ``client`` is the librdkafka
    passthrough; metrics are off unless ``metrics_port`` is given. ``group_extra`` adds group
    sections (``dlq``, ``circuit_breaker``, ...).
    """
    kafka: dict[str, Any] = {"bootstrap_servers": bootstrap}
    # The tests written for unary delivery keep it: delivery.batch defaults to auto, which
    # sends batches to every service here that serves them (TestService does). The batch
    # tests say `batch` in ``delivery``.
    off = {"batch": "off"}
    if client is not None:
        kafka["client"] = client
    fast = {"commit_interval_ms": 200, "backoff": {"initial_ms": 20, "max_ms": 200}}
    return {
        "kafka": kafka,
        "metrics": {
            "enabled": metrics_port is not None,
            "port": metrics_port or 0,
            "host": "127.0.0.1",
        },
        "shutdown_grace_s": shutdown_grace_s,
        "groups": [
            {
                "name": group,
                "topics": list(topics),
                "service": {"endpoints": list(endpoints), "timeout_ms": 5000, **(service or {})},
                "delivery": {**off, **(fast if fast_delivery else {}), **(delivery or {})},
                **group_extra,
            }
        ],
    }


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
    """:func:`config_dict` validated, for a proxy run in the test's event loop."""
    return ProxyConfig(
        **config_dict(
            bootstrap,
            group,
            topics,
            endpoints,
            delivery=delivery,
            service=service,
            metrics_port=metrics_port,
            shutdown_grace_s=shutdown_grace_s,
            dlq=dlq or {},
            circuit_breaker=breaker or {},
        )
    )


# Short session timeouts so that a test's rebalances are quick.
FAST_CONSUMER = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
# For members that never die, in tests that allow no duplicate: a broker that stalls a few
# seconds on a loaded machine does not expire their sessions (all three members of the
# 20,000-message key-order test lost their partitions at once on 2026-11-27, 6 s without an
# answer from the coordinator, and 6,198 messages were delivered again). Graceful leaves and
# joins do not wait for the session timeout, so the test takes no longer.
STEADY_CONSUMER = {"session.timeout.ms": 45000, "heartbeat.interval.ms": 500}


def start_proxy(config: ProxyConfig, **kwargs: Any) -> tuple[Proxy, asyncio.Task[None]]:
    """Run a proxy in the current loop; returns it and the task running it."""
    kwargs.setdefault("consumer_overrides", FAST_CONSUMER)
    proxy = Proxy(config, **kwargs)
    return proxy, asyncio.create_task(proxy.run(), name="proxy")


def caught_up_now(bootstrap: str, group: str, topic: str) -> bool:
    """True once the group's committed offsets equal the topic's end offsets everywhere (the
    tests' one such check: ``caught_up`` is it for a loop, ``wait_until`` takes this)."""
    try:
        ends = end_offsets(bootstrap, topic)
        committed = committed_offsets(bootstrap, group, topic)
    except KafkaException:  # e.g. the group coordinator of a fresh broker is still loading
        return False
    return all(committed.get(p, (None,))[0] == end for p, end in ends.items() if end > 0)


async def caught_up(bootstrap: str, group: str, topic: str) -> bool:
    """``caught_up_now`` off the event loop."""
    return await asyncio.to_thread(caught_up_now, bootstrap, group, topic)


class Members:
    """Proxies of one group started one after another in the current loop (each start is a
    rebalance), shut down in that order when the ``async with`` block ends."""

    def __init__(self) -> None:
        self.proxies: list[Proxy] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, config: ProxyConfig) -> Proxy:
        """One more member."""
        proxy, task = start_proxy(config)
        self.proxies.append(proxy)
        self._tasks.append(task)
        return proxy

    @staticmethod
    async def owned(proxy: Proxy, topic: str, timeout: float = 60) -> list[int]:
        """Waits until ``proxy`` owns partitions of ``topic``; returns them."""

        def found() -> list[int]:
            return sorted(p for t, p in proxy.runners[0].assignment() if t == topic)

        await async_wait_until(found, timeout=timeout)
        return found()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proxy, task in zip(self.proxies, self._tasks, strict=True):
            await proxy.shutdown()
            await task


def revoke_took(records: Sequence[logging.LogRecord], group: str) -> tuple[float, float]:
    """From the one line of a member of ``group`` that revoked one partition: when the revoke
    began (wall time, as ``LogRecord.created``) and how long it took, in seconds."""
    [line] = [r for r in records if r.getMessage().startswith(f"group {group}: revoked 1 ")]
    took = float(re.findall(r"after ([0-9.]+)s", line.getMessage())[0])
    return line.created - took, took


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
    """Write :func:`config_dict` as a file for ``consumer-proxy run`` (JSON, which is YAML).

    ``client`` is the librdkafka passthrough; by default it carries FAST_CONSUMER, so a member
    that dies is noticed within seconds. Returns ``path``.
    """
    config = config_dict(
        bootstrap,
        group,
        topics,
        endpoints,
        delivery=delivery,
        client=FAST_CONSUMER if client is None else client,
        shutdown_grace_s=shutdown_grace_s,
        **group_extra,
    )
    path.write_text(json.dumps(config, indent=2))
    return path


class ProxyProcess:
    """``python -m consumer_proxy run --config F ARGS`` as a child process, its output in a file.

    The one process harness of the tests and the benches (bench/proxy.py extends it with
    profiling and CPU accounting). ``command`` replaces ``python -m consumer_proxy`` (a
    profiling wrapper, say); ``env`` is added to the environment.
    """

    def __init__(
        self,
        config: Path,
        log: Path,
        *args: str,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config = config
        self.log = log
        self.args = args
        self.command = list(command or [sys.executable, "-m", "consumer_proxy"])
        self.env = None if env is None else {**os.environ, **env}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> Self:
        with open(self.log, "ab") as out:  # the child keeps its own descriptor
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                [*self.command, "run", "--config", str(self.config), *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise if the proxy exited on its own."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {self.proc.returncode}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no commit, no leaving the group."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the graceful shutdown); returns the exit code (SIGKILL after timeout_s,
        and the timeout is raised). None when it was never started."""
        if self.proc is None:
            return None
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

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the output ("" before there is any)."""
        with contextlib.suppress(OSError):
            return "\n".join(self.output().splitlines()[-lines:])
        return ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
