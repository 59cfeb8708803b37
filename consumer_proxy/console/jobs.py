"""The console's DLQ actions: the CLI's own commands, run as child processes.

A merge (or its dry run) and a purge from the page run ``consumer-proxy dlq merge|purge ...
--json`` against the configuration file the proxy was started with: the same code as an
operator's terminal, off the event loop, and a merge's Spark driver (a JVM) stays out of the
proxy's process. Its progress lines (stderr) are kept for the page, its JSON summary is the
result. Bounded: one job at a time, the last ``KEPT`` jobs remembered, ``PROGRESS_LINES``
lines each, an hour at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEPT = 8
PROGRESS_LINES = 40
LINE_LIMIT = 500
OUTPUT_LIMIT = 1 << 20
JOB_TIMEOUT_S = 3600.0


class Busy(Exception):
    """A job is running already."""


@dataclass
class Job:
    """One command run for the page."""

    id: int
    group: str
    kind: str  # merge, merge dry run, purge, purge dry run
    argv: list[str]
    state: str = "running"  # running, done, failed
    progress: deque[str] = field(default_factory=lambda: deque(maxlen=PROGRESS_LINES))
    result: Any = None
    error: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None

    def view(self) -> dict[str, Any]:
        """JSON for the page."""
        return {
            "id": self.id,
            "group": self.group,
            "kind": self.kind,
            "state": self.state,
            "progress": list(self.progress),
            "result": self.result,
            "error": self.error,
            "started": self.started,
            "ended": self.ended,
        }


class Jobs:
    """The console's jobs; ``close()`` ends a running one (its child is killed)."""

    def __init__(self, command: list[str] | None = None) -> None:
        """``command`` runs the CLI (default: this interpreter, ``-m consumer_proxy``)."""
        self._command = command or [sys.executable, "-m", "consumer_proxy"]
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None

    def get(self, job_id: int) -> Job | None:
        """A job still remembered."""
        return self._jobs.get(job_id)

    def start(self, group: str, kind: str, argv: list[str]) -> Job:
        """Run ``consumer-proxy ARGV --json`` (Busy while another job runs)."""
        if self._task is not None and not self._task.done():
            raise Busy("another DLQ job is running; wait for it")
        job = Job(next(self._ids), group, kind, argv)
        self._jobs[job.id] = job
        while len(self._jobs) > KEPT:
            del self._jobs[min(self._jobs)]
        self._task = asyncio.create_task(self._run(job), name=f"console-job-{job.id}")
        self._task.add_done_callback(_retrieve)
        log.info("group %s: console: %s started: %s", group, kind, " ".join(argv))
        return job

    async def _run(self, job: Job) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self._command,
            *job.argv,
            "--json",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            async with asyncio.timeout(JOB_TIMEOUT_S):
                output, _ = await asyncio.gather(
                    _read_all(proc.stdout), self._lines(proc.stderr, job)
                )
                code = await proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            job.state, job.error, job.ended = "failed", "stopped (timeout or shutdown)", time.time()
            raise
        job.ended = time.time()
        try:
            job.result = json.loads(output) if output.strip() else None
        except ValueError:
            job.result = None
        if code == 0:
            job.state = "done"
        else:
            job.state = "failed"
            job.error = f"exit code {code}" + (f": {job.progress[-1]}" if job.progress else "")
        log.info("group %s: console: %s %s", job.group, job.kind, job.state)

    @staticmethod
    async def _lines(stream: asyncio.StreamReader, job: Job) -> None:
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the reader's limit: skip it
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip()
            if text:
                job.progress.append(text[:LINE_LIMIT])

    async def close(self) -> None:
        """End a running job (its child process is killed)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _read_all(stream: asyncio.StreamReader) -> bytes:
    """The stream to its end, keeping at most ``OUTPUT_LIMIT`` bytes (the rest is drained)."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk[: max(0, OUTPUT_LIMIT - len(kept))]
    return bytes(kept)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("console job failed", exc_info=task.exception())


def config_path_known(path: Path | None) -> bool:
    """Whether the proxy was started from a file the commands can read too."""
    return path is not None and path.exists()
