"""The ``cli`` fixture's type: run ``consumer-proxy ARGS`` in-process."""

from __future__ import annotations

from collections.abc import Callable

Cli = Callable[..., tuple[int, str, str]]
"""``cli(*args)`` -> (exit code, stdout, stderr)."""
