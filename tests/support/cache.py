"""What the tests and benches build into ``~/.cache/consumer-proxy`` (the Go collector, the Go
bench handler), named ``<command>-<digest of its sources>``: one entry per source version,
since the checkouts of one machine share the cache. Each use marks an entry used; each build
removes the entries of other versions no checkout used for :data:`KEEP_S`."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

KEEP_S = 7 * 24 * 3600.0
"""How long an entry of another source version stays after its last use."""
_HEX = "0123456789abcdef"


def cache_dir() -> Path:
    """``~/.cache/consumer-proxy`` (XDG)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "consumer-proxy"


def used(entry: Path) -> Path:
    """Mark ``entry`` (a file or a directory in the cache) used now; returns it."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(entry)
    return entry


def prune(entry: Path, now: float | None = None) -> list[Path]:
    """Remove the entries beside ``entry`` of the same command (``<command>-<digest>``, a
    digest as long as its own) unused for :data:`KEEP_S`; returns what was removed. Other
    commands' entries, half-written ones and ``entry`` itself stay."""
    command, _, own = entry.name.rpartition("-")
    cutoff = (time.time() if now is None else now) - KEEP_S
    removed = []
    for other in entry.parent.glob(f"{command}-*"):
        digest = other.name[len(command) + 1 :]
        if other == entry or len(digest) != len(own) or digest.strip(_HEX):
            continue  # (another command's, or half-written)
        with contextlib.suppress(FileNotFoundError):  # (another checkout pruned it first)
            if other.stat().st_mtime >= cutoff:
                continue
            if other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
            else:
                other.unlink()
            removed.append(other)
    return removed
