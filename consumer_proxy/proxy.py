"""The proxy process: one GroupRunner per onboarded group, health, metrics and signals.

``Proxy.run`` starts every group and returns after the full shutdown of all of them; a group
that fails stops the others. See ``group.py`` for what one group does, and
docs/architecture.md for how the pieces fit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from .adapters import RealEdges
from .config import ProxyConfig
from .console import Console, console_admin_paths
from .dlq import SharedProducers
from .group import GroupRunner
from .health import ProxyHealth, group_verdict
from .metrics import Answer, HttpEndpoint, ProxyMetrics, text_answer
from .tracing import start_tracing


class Proxy:
    """All groups of one configuration in one process; ``run()`` returns after full shutdown."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics | None = None,
        consumer_overrides: dict[str, Any] | None = None,
        config_path: Path | None = None,
    ) -> None:
        """``config_path``: the file ``config`` was read from (the console's DLQ actions run
        the CLI's commands with it)."""
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        # One DLQ producer for every group (per distinct producer configuration): an idle
        # group then holds no producer client, threads or connections of its own.
        self.producers = SharedProducers()
        # Off (the default): None, and nothing of OpenTelemetry is imported.
        self.tracing = start_tracing(config.tracing)
        edges = RealEdges(
            config.kafka, self.metrics, consumer_overrides, self.producers, self.tracing
        )
        self.runners = [
            GroupRunner(g, self.metrics, edges, config.shutdown_grace_s) for g in config.groups
        ]
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self.http: HttpEndpoint | None = None
        self.health = ProxyHealth(self.runners)
        for runner in self.runners:
            runner.on_health_change = self.health.changed
        self.console: Console | None = None
        if config.console.enabled:
            self.console = Console(
                config.console,
                config.kafka,
                self.runners,
                group_verdict,
                admin=config.admin.token is not None,
                config_path=config_path,
            )

    def ready(self) -> tuple[bool, str]:
        """Ready when every group serves: consumer up, Kafka reachable, breaker closed."""
        return self.health.ready()

    async def admin(self, action: str, query: str = "") -> Answer:
        """An operator action, already authorised: ``groups/<group>/guard/<release|hold>``,
        or the console's (``console/check``, ``groups/<group>/dlq/<merge|purge>``)."""
        console_parts = console_admin_paths(action)
        if console_parts is not None and self.console is not None:
            return await self.console.action(console_parts, query)
        parts = action.split("/")
        if len(parts) != 4 or parts[0] != "groups" or parts[2] != "guard":
            return text_answer(
                "404 Not Found", "unknown action; use groups/<group>/guard/<release|hold>"
            )
        name, verb = parts[1], parts[3]
        runner = next((r for r in self.runners if r.name == name), None)
        if runner is None:
            return text_answer("404 Not Found", "no such group in this proxy")
        if not runner.guard.enabled:
            return text_answer("409 Conflict", f"group {name}: the dead-letter guard is disabled")
        if verb == "release":
            count = runner.guard.release()
            return text_answer(
                "200 OK", f"group {name}: guard released; {count} held messages go to the DLQ"
            )
        if verb == "hold":
            changed = runner.guard.hold()
            return text_answer(
                "200 OK", f"group {name}: guard held" + ("" if changed else " (already)")
            )
        return text_answer("404 Not Found", "unknown guard action; use release or hold")

    async def run(self) -> None:
        """Start every group and run until ``shutdown()`` or a group fails."""
        if self.config.metrics.enabled:
            http = self.config.metrics
            self.http = HttpEndpoint(
                self.metrics,
                self.ready,
                http.host,
                http.port,
                max_connections=http.max_connections,
                request_timeout_s=http.request_timeout_ms / 1000,
                admin=self.admin,
                pod_ready=self.health.pod_ready,
                admin_token=(
                    self.config.admin.token.get_secret_value()
                    if self.config.admin.token is not None
                    else None
                ),
                pages=self.console.page if self.console is not None else None,
            )
            await self.http.start()
            if self.console is not None:
                await self.console.start()
        if self.config.health.grpc_port is not None:
            try:
                await self.health.start(self.config.health.host, self.config.health.grpc_port)
            except BaseException:
                if self.http is not None:
                    await self.http.close()
                raise
        health = asyncio.create_task(self.health.run(), name="health")
        tasks = [asyncio.create_task(r.run(), name=f"group:{r.name}") for r in self.runners]
        stop = asyncio.create_task(self._stop.wait())
        try:
            _done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.health.shutting_down()  # probes see NOT_SERVING while the groups drain
            for runner in self.runners:
                runner.stop()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stop.cancel()
            health.cancel()
            await asyncio.gather(health, return_exceptions=True)
            await self.health.close()
            if self.http is not None:
                await self.http.close()
            if self.console is not None:
                await self.console.close()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)  # exports what is queued
            self._finished.set()
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures and not isinstance(failures[0], asyncio.CancelledError):
            raise failures[0]

    async def shutdown(self) -> None:
        """Request shutdown and wait for it (idempotent)."""
        self._stop.set()
        await self._finished.wait()

    def request_shutdown(self) -> None:
        """Request shutdown without waiting (signal handlers)."""
        self._stop.set()

    async def __aenter__(self) -> Proxy:
        self._run_task = asyncio.create_task(self.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await self._run_task
