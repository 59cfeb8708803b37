"""Building proxy configurations and running the proxy in the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

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
    ends, committed = await asyncio.gather(
        asyncio.to_thread(end_offsets, bootstrap, topic),
        asyncio.to_thread(committed_offsets, bootstrap, group, topic),
    )
    return all(committed.get(p, (None,))[0] == end for p, end in ends.items() if end > 0)
