"""The operator console: one web page of a proxy's groups and their dead letters.

Served on the proxy's HTTP endpoint (``metrics.HttpEndpoint``: its connection cap, request
timeout and size limits hold for the console too) when ``console.enabled``:

- ``GET /console/`` the page, ``/console/static/...`` its one script and one style sheet
  (files of this package: no CDN, no build), under a strict content security policy;
- ``GET /console/api/overview``, ``/console/api/groups/<g>``, ``/console/api/groups/<g>/dlq``
  and ``/console/api/jobs/<id>``: the JSON the page polls (read-only, no token);
- ``POST /admin/console/check``, ``/admin/groups/<g>/dlq/merge`` and ``.../purge``: the
  actions, behind ``admin.token`` like every admin request (``Proxy.admin`` routes them here).

Reads come from what the proxy knows (``GroupRunner.snapshot``: the core's partitions, the
breaker, the guard, the instances) plus, every ``SAMPLE_S``, the end offsets of the groups'
partitions and DLQs from Kafka (one consumer that never joins a group) and a 15-minute history
of each group's breaker, concurrency limit and rate. The DLQ page reads Kafka with bounded
reads (``console.dlq``); merge and purge run the CLI's commands (``console.jobs``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ..config import ConsoleConfig, GroupConfig, KafkaConfig
from ..metrics import Answer
from ..tools import kafka_ops
from .dlq import Filter, browse
from .jobs import Busy, Jobs

log = logging.getLogger(__name__)

SAMPLE_S = 2.0
"""How often the console samples the groups (rate, history) and reads end offsets."""
HISTORY_S = 15 * 60
STATE_LINES = 30
"""Recent state lines kept per group."""
DLQ_CACHE_S = 3.0
DLQ_WAIT_S = 3.5
"""How long one request waits for a DLQ read (it goes on; the page's next poll gets it)."""
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
ASSETS = {
    "/console/": ("index.html", "text/html; charset=utf-8"),
    "/console/static/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/static/console.css": ("console.css", "text/css; charset=utf-8"),
    "/console/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
_BREAKER_CODE = {"closed": 0, "half-open": 1, "open": 2}
_JOB_ID = re.compile(r"[0-9]{1,9}")


class Runner(Protocol):
    """What the console reads of a group (``group.GroupRunner``)."""

    name: str
    group: GroupConfig

    def snapshot(self) -> dict[str, Any]: ...


def answer_json(status: str, data: Any) -> Answer:
    """A JSON answer with the console's security headers."""
    body = json.dumps(data, separators=(",", ":")).encode()
    return Answer(status, "application/json", body, SECURITY_HEADERS)


class StateLines(logging.Handler):
    """The proxy's log lines about each group (state changes: breaker, guard, rebalances,
    ejections, ...), the last ``STATE_LINES`` per group, for the group page."""

    _GROUP = re.compile(r"\bgroup ([^\s:,;()]+)")

    def __init__(self, groups: Sequence[str]) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, deque[tuple[float, str, str]]] = {
            g: deque(maxlen=STATE_LINES) for g in groups
        }

    def recent(self, group: str) -> list[tuple[float, str, str]]:
        """The group's lines, oldest first (appended from any thread: read under the lock)."""
        self.acquire()
        try:
            return list(self.lines[group])
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 (a bad log call must not break the console)
            return
        found = self._GROUP.search(message[:200])
        lines = self.lines.get(found.group(1)) if found else None
        if lines is not None:
            lines.append((record.created, record.levelname.lower(), message[:500]))


class Console:
    """The console's state and routes; ``start()`` begins sampling, ``close()`` ends it."""

    def __init__(
        self,
        config: ConsoleConfig,
        kafka: KafkaConfig,
        runners: Sequence[Runner],
        verdict: Callable[[Any], tuple[bool, str]],
        *,
        admin: bool,
        config_path: Path | None,
    ) -> None:
        """``verdict`` is a group's health (serving, why); ``admin``: a token is configured;
        ``config_path``: the file the proxy was started with (the actions' commands read it)."""
        self._config = config
        self._kafka = kafka
        self._runners = {r.name: r for r in runners}
        self._verdict = verdict
        self._admin = admin
        self._config_path = config_path
        self.jobs = Jobs()
        self._lines = StateLines(list(self._runners))
        self._history: dict[str, deque[tuple[float, int, int, float]]] = {
            name: deque(maxlen=int(HISTORY_S / SAMPLE_S)) for name in self._runners
        }
        self._finished: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}
        self._ends: dict[tuple[str, int], tuple[int, int]] = {}  # (topic, p) -> (low, high)
        self._dlq_ends: dict[str, list[tuple[int, int]]] = {}
        self._kafka_error = ""
        self._consumer: Consumer | None = None
        self._consumer_lock = threading.Lock()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._dlq_reads: dict[tuple[str, Filter], asyncio.Task[dict[str, Any]]] = {}
        self._dlq_cache: dict[tuple[str, Filter], tuple[float, dict[str, Any]]] = {}

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin sampling; the state lines are collected from now on."""
        logging.getLogger("consumer_proxy").addHandler(self._lines)
        self._task = asyncio.create_task(self._sample_loop(), name="console-sampler")
        log.info("console: serving /console/ (%s)", "actions on" if self._admin else "read-only")

    async def close(self) -> None:
        """Stop sampling, end a running job and the DLQ reads, close the Kafka consumer."""
        logging.getLogger("consumer_proxy").removeHandler(self._lines)
        tasks = [t for t in (self._task, *self._dlq_reads.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        await self.jobs.close()
        await asyncio.to_thread(self._close_consumer)

    def _close_consumer(self) -> None:
        # Under the lock: a cancelled sample's thread may still be reading with it.
        with self._consumer_lock:
            self._closed = True
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                consumer.close()

    # -- sampling -------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        while True:
            try:
                await self._sample()
            except Exception:
                # The console must never take delivery down; the next round retries.
                log.exception("console: sampling failed")
            await asyncio.sleep(SAMPLE_S)

    async def _sample(self) -> None:
        now = time.time()
        topics: list[tuple[str, int]] = []
        for name, runner in self._runners.items():
            snap = runner.snapshot()
            c = snap["counters"]
            finished = c["ack"] + c["drop"] + c["dead_letter"] + c["tier"]
            before = self._finished.get(name)
            if before is not None and now > before[0]:
                self._rate[name] = max(0.0, (finished - before[1]) / (now - before[0]))
            self._finished[name] = (now, finished)
            code = _BREAKER_CODE.get(snap["breaker"]["state"], 0)
            self._history[name].append((now, code, snap["limit"], self._rate.get(name, 0.0)))
            topics += [(p["topic"], p["partition"]) for p in snap["partitions"]]
        groups = [r.group for r in self._runners.values()]
        try:
            self._ends, self._dlq_ends = await asyncio.to_thread(self._read_ends, topics, groups)
            self._kafka_error = ""
        except KafkaException as exc:
            self._kafka_error = str(exc)[:500]

    def _read_ends(
        self, parts: list[tuple[str, int]], groups: list[GroupConfig]
    ) -> tuple[dict[tuple[str, int], tuple[int, int]], dict[str, list[tuple[int, int]]]]:
        """(low, high) of the owned partitions and of each group's DLQ partitions (blocking)."""
        with self._consumer_lock:
            if self._closed:
                return {}, {}
            return self._read_ends_locked(parts, groups)

    def _read_ends_locked(
        self, parts: list[tuple[str, int]], groups: list[GroupConfig]
    ) -> tuple[dict[tuple[str, int], tuple[int, int]], dict[str, list[tuple[int, int]]]]:
        if self._consumer is None:
            conf = kafka_ops.plain_conf(self._kafka)
            conf.update({"group.id": "consumer-proxy-console", "enable.auto.commit": False})
            self._consumer = Consumer(conf)
        consumer = self._consumer
        ends = {tp: consumer.get_watermark_offsets(TopicPartition(*tp), timeout=5) for tp in parts}
        dlqs: dict[str, list[tuple[int, int]]] = {}
        for group in groups:
            meta = consumer.list_topics(group.dlq_topic, timeout=5).topics.get(group.dlq_topic)
            if meta is None or meta.error is not None:
                continue
            dlqs[group.name] = [
                consumer.get_watermark_offsets(TopicPartition(group.dlq_topic, p), timeout=5)
                for p in sorted(meta.partitions)
            ]
        return ends, dlqs

    # -- the JSON views -------------------------------------------------------------------

    def _group_state(self, runner: Runner, snap: dict[str, Any]) -> tuple[str, str]:
        ok, why = self._verdict(runner)
        guard = snap["guard"]
        if not snap["started"]:
            return "starting", why
        if guard is not None and guard["held"]:
            return "guard held", why
        if snap["breaker"]["state"] != "closed":
            return f"breaker {snap['breaker']['state']}", why
        return ("running" if ok else "outage"), why

    def _partition_rows(self, snap: dict[str, Any]) -> list[dict[str, Any]]:
        rows = []
        for p in snap["partitions"]:
            low, high = self._ends.get((p["topic"], p["partition"]), (None, None))
            committed = p["committed"]
            if high is None or high < 0:
                lag = None
            else:
                base = committed if committed is not None else (low or 0)
                lag = max(0, high - base)
                if p["tier"]:  # a tier's depth, as ``status`` counts it
                    lag = max(0, high - max(low or 0, base))
            rows.append({**p, "end": high, "lag": lag})
        return rows

    def group_summary(self, runner: Runner) -> dict[str, Any]:
        """One group's overview row (and the head of its page)."""
        snap = runner.snapshot()
        rows = self._partition_rows(snap)
        state, why = self._group_state(runner, snap)
        group = runner.group
        reasons: dict[str, int] = {}
        for row in rows:
            for reason in row["reasons"]:
                reasons[reason] = reasons.get(reason, 0) + 1
        dlq = self._dlq_ends.get(runner.name)
        tiers = []
        for n, topic in enumerate(group.retry_topics, start=1):
            mine = [r for r in rows if r["topic"] == topic]
            due = [r["next_due_ms"] for r in mine if r["next_due_ms"]]
            tiers.append(
                {
                    "tier": n,
                    "topic": topic,
                    "delay_ms": group.delivery.retry_topics[n - 1].delay_ms,
                    "depth": sum(r["lag"] or 0 for r in mine) if mine else None,
                    "next_due_ms": min(due) if due else None,
                }
            )
        return {
            "name": runner.name,
            "state": state,
            "detail": why[:500],
            "breaker": snap["breaker"],
            "guard": snap["guard"],
            "msg_per_s": round(self._rate.get(runner.name, 0.0), 1),
            "lag": sum(r["lag"] or 0 for r in rows),
            "in_flight": sum(r["calls"] for r in rows),
            "window": sum(r["window"] for r in rows),
            "paused": sum(1 for r in rows if r["paused"]),
            "pause_reasons": reasons,
            "partitions": len(rows),
            "dlq_topic": group.dlq_topic,
            "dlq_depth": sum(max(0, h - lo) for lo, h in dlq) if dlq is not None else None,
            "tiers": tiers,
            "_rows": rows,
            "_snap": snap,
        }

    def overview(self) -> dict[str, Any]:
        """Every group's summary."""
        groups = []
        for runner in self._runners.values():
            summary = self.group_summary(runner)
            del summary["_rows"], summary["_snap"]
            groups.append(summary)
        return {
            "time": time.time(),
            "admin": self._admin,
            "kafka_error": self._kafka_error,
            "groups": groups,
        }

    def group_page(self, runner: Runner) -> dict[str, Any]:
        """One group in detail."""
        summary = self.group_summary(runner)
        rows, snap = summary.pop("_rows"), summary.pop("_snap")
        return {
            **summary,
            "time": time.time(),
            "admin": self._admin,
            "limit": snap["limit"],
            "adaptive": snap["adaptive"],
            "counters": snap["counters"],
            "instances": snap["instances"],
            "rows": rows,
            "history": list(self._history[runner.name]),
            "lines": self._lines.recent(runner.name),
        }

    # -- routes ---------------------------------------------------------------------------

    async def page(self, path: str, query: str) -> Answer | None:
        """A GET under /console (None: not the console's path)."""
        if path == "/console":
            return Answer("301 Moved Permanently", "text/plain", b"", (("Location", "/console/"),))
        if path in ASSETS:
            name, ctype = ASSETS[path]
            body = resources.files(__package__).joinpath("static", name).read_bytes()
            return Answer("200 OK", ctype, body, SECURITY_HEADERS)
        if not path.startswith("/console/api/"):
            return None
        parts = [unquote(p) for p in path[len("/console/api/") :].split("/")]
        if parts == ["overview"]:
            return answer_json("200 OK", self.overview())
        if len(parts) == 2 and parts[0] == "jobs":
            # (str.isdigit takes "²", and int() refuses over 4,300 digits)
            job = self.jobs.get(int(parts[1])) if _JOB_ID.fullmatch(parts[1]) else None
            if job is None:
                return answer_json("404 Not Found", {"error": "no such job"})
            return answer_json("200 OK", job.view())
        if len(parts) in (2, 3) and parts[0] == "groups":
            runner = self._runners.get(parts[1])
            if runner is None:
                return answer_json("404 Not Found", {"error": "no such group in this proxy"})
            if len(parts) == 2:
                return answer_json("200 OK", self.group_page(runner))
            if parts[2] == "dlq":
                return await self._dlq(runner, query)
        return answer_json("404 Not Found", {"error": "no such console API"})

    async def _dlq(self, runner: Runner, query: str) -> Answer:
        try:
            flt = Filter.parse(parse_qs(query, max_num_fields=20))
        except ValueError as exc:
            return answer_json("400 Bad Request", {"error": str(exc)})
        key = (runner.name, flt)
        cached = self._dlq_cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < DLQ_CACHE_S:
            return answer_json("200 OK", cached[1])
        task = self._dlq_reads.get(key)
        if task is None:
            if len(self._dlq_reads) >= 2:  # bounded: a page's filters, one or two at a time
                return answer_json("200 OK", {"pending": "busy reading another filter"})
            task = asyncio.create_task(self._read_dlq(runner, flt, key))
            self._dlq_reads[key] = task
        try:
            async with asyncio.timeout(DLQ_WAIT_S):
                data = await asyncio.shield(task)
        except TimeoutError:
            # A poll answer, not an error: the page asks again and gets the cached read.
            return answer_json("200 OK", {"pending": "still reading the DLQ"})
        except Exception as exc:  # noqa: BLE001 (Kafka unreachable: said on the page)
            return answer_json("200 OK", {"error": str(exc)[:500]})
        return answer_json("200 OK", data)

    async def _read_dlq(
        self, runner: Runner, flt: Filter, key: tuple[str, Filter]
    ) -> dict[str, Any]:
        try:
            data = await asyncio.to_thread(
                browse, self._kafka, runner.group, self._config.dlq_scan_records, flt
            )
        finally:
            self._dlq_reads.pop(key, None)
        data["merge_command"] = flt.merge_command(runner.name, self._config_path)
        data["merge_filters_reason"] = flt.reason is not None
        data["actions"] = self._admin and self._config_path is not None
        self._dlq_cache = {k: v for k, v in self._dlq_cache.items() if k[0] != runner.name}
        self._dlq_cache[key] = (time.monotonic(), data)
        return data

    async def action(self, parts: list[str], query: str) -> Answer:
        """An authorised console action: ``console/check``, or ``groups/<g>/dlq/<merge|purge>``
        (query: the page's filter, ``dry_run=1``; purge: ``bound=merged|all|until``)."""
        if parts == ["console", "check"]:
            return answer_json("200 OK", {"ok": True})
        runner = self._runners.get(parts[1]) if len(parts) == 4 else None
        if runner is None or parts[2] != "dlq" or parts[3] not in ("merge", "purge"):
            return answer_json("404 Not Found", {"error": "unknown console action"})
        if self._config_path is None:
            return answer_json(
                "409 Conflict",
                {"error": "the proxy was not started from a file: run the CLI by hand"},
            )
        args = parse_qs(query, max_num_fields=20)
        dry_run = (args.get("dry_run") or ["0"])[0] == "1"
        try:
            flt = Filter.parse(args)
        except ValueError as exc:
            return answer_json("400 Bad Request", {"error": str(exc)})
        if parts[3] == "merge":
            argv = flt.merge_args(runner.name, self._config_path)
        else:
            bound = (args.get("bound") or [""])[0]
            if bound == "until" and flt.until_ms is not None:
                extra = ["--until", str(flt.until_ms)]
            elif bound in ("merged", "all"):
                extra = [f"--{bound}"]
            else:
                return answer_json("400 Bad Request", {"error": "bound: merged, all or until"})
            argv = ["dlq", "purge", "--config", str(self._config_path), "--group", runner.name]
            argv += extra
        argv.append("--dry-run" if dry_run else "--yes")
        kind = parts[3] + (" dry run" if dry_run else "")
        try:
            job = self.jobs.start(runner.name, kind, argv)
        except Busy as exc:
            return answer_json("409 Conflict", {"error": str(exc)})
        return answer_json("202 Accepted", job.view())


def console_admin_paths(action: str) -> list[str] | None:
    """The parts of an admin path that is the console's (None: not the console's)."""
    parts = action.split("/")
    if parts == ["console", "check"]:
        return parts
    if len(parts) == 4 and parts[0] == "groups" and parts[2] == "dlq":
        return parts
    return None
