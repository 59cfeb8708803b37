"""What every bench declares about its command line, and the broker it runs on.

Each ``bench/bench_*.py`` has a module-level ``OPTIONS = BenchOptions(...)`` and builds its
parser with ``OPTIONS.parser(description)``, so what ``run_all.py`` reads (by importing the
module, which runs nothing: every bench's work is under ``if __name__ == "__main__"``) and what
the bench accepts are the same declaration.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.kafka import start_broker, stop_broker

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchOptions:
    """A bench's shared options, and how ``run_all.py`` runs it.

    ``bootstrap``: takes ``--bootstrap HOST:PORT`` (a running broker; otherwise the bench
    starts a private one). ``quick``: takes ``--quick`` (smaller sizes). ``always_quick``:
    ``run_all`` passes ``--quick`` even in a full run (the bench would run for many minutes).
    ``run_all_args``: extra arguments ``run_all`` passes (small sizes for a bench without
    ``--quick``). ``handler``: takes ``--handler go|python`` (the bench handler service, Go by
    default). ``proxy_client``: takes ``--proxy-client KEY=VALUE ...`` (librdkafka properties
    for the proxy: ``client_settings(args.proxy_client)``). ``rounds``: takes ``--rounds N``
    (interleaved rounds, this many by default; 0: no such option). ``warmup``: takes
    ``--warmup N`` (rounds run first and not counted, this many by default; None: no such
    option).
    """

    bootstrap: bool = True
    quick: bool = True
    always_quick: bool = False
    run_all_args: tuple[str, ...] = ()
    handler: bool = False
    proxy_client: bool = False
    rounds: int = 0
    warmup: int | None = None

    def parser(self, description: str) -> argparse.ArgumentParser:
        """An argument parser with the declared shared options."""
        parser = argparse.ArgumentParser(description=description)
        if self.bootstrap:
            parser.add_argument(
                "--bootstrap",
                metavar="HOST:PORT",
                help="use this running broker (default: start a private one and stop it)",
            )
        if self.quick:
            parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
        if self.handler:
            parser.add_argument(
                "--handler",
                choices=["go", "python"],
                default="go",
                help="the handler service: bench/gohandler (default) or the grpc.aio one",
            )
        if self.proxy_client:
            parser.add_argument(
                "--proxy-client",
                nargs="+",
                metavar="KEY=VALUE",
                help="librdkafka properties for the proxy (kafka.client), e.g. "
                "fetch.wait.max.ms=20",
            )
        if self.rounds:
            parser.add_argument(
                "--rounds",
                type=int,
                default=self.rounds,
                help=f"interleaved rounds (default {self.rounds})",
            )
        if self.warmup is not None:
            parser.add_argument(
                "--warmup",
                type=int,
                default=self.warmup,
                help=f"rounds run first and not counted (default {self.warmup})",
            )
        return parser


def client_settings(pairs: list[str] | None) -> dict[str, str]:
    """``KEY=VALUE`` arguments as librdkafka properties (``--proxy-client``, ``--kafka-client``)."""
    found = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"librdkafka properties are KEY=VALUE, got {pair!r}")
        found[key] = value
    return found


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """Yield a bootstrap address: the given one, or a private broker started for the bench."""
    if bootstrap:
        yield bootstrap
        return
    with tempfile.TemporaryDirectory(prefix="cp-bench-kafka-") as tmp:
        print("starting a private Kafka broker ...", flush=True)
        started = time.monotonic()
        found = start_broker(Path(tmp), watch_pid=os.getpid())
        print(f"broker at {found.bootstrap} ({time.monotonic() - started:.1f}s)", flush=True)
        try:
            yield found.bootstrap
        finally:
            stop_broker(Path(tmp))
