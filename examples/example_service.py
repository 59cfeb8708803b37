"""An example consumer-proxy service, built on the handler SDK.

    python examples/example_service.py --port 50051 [--latency-ms 5] [--jitter-ms 20] \
        [--poison-marker poison] [--host 127.0.0.1] [-v]

It acks every message after a simulated bit of work (``latency-ms`` plus up to ``jitter-ms``
at random), and rejects a message whose value contains the poison marker with
``PoisonPill``, so the proxy dead-letters it. Run several on different ports and list them
all as the group's ``service.endpoints``. ``--port 0`` picks a free port; the address is
logged as ``serving on HOST:PORT``. SIGINT or SIGTERM stops it gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time

from consumer_proxy import handler as cp

log = logging.getLogger("example_service")


class ExampleService:
    """Acks after a random latency; dead-letters poison; reports a count every few seconds."""

    def __init__(
        self, latency_ms: float, jitter_ms: float, poison_marker: str, report_every_s: float = 5.0
    ) -> None:
        self.latency_ms = latency_ms
        self.jitter_ms = jitter_ms
        self.poison = poison_marker.encode()
        self.report_every_s = report_every_s
        self.handled = 0
        self.poisoned = 0
        self._last_report = time.monotonic()

    async def handle(self, message: cp.Message) -> cp.Result | None:
        log.debug(
            "%s[%d]@%d attempt %d (%s)",
            message.topic,
            message.partition,
            message.offset,
            message.attempt,
            message.source,
        )
        if self.poison and message.value is not None and self.poison in message.value:
            self.poisoned += 1
            self._maybe_report()
            raise cp.PoisonPill(f"value contains {self.poison.decode()!r}")
        # The "work": a real service would write to a database or call another service here.
        await asyncio.sleep((self.latency_ms + random.uniform(0, self.jitter_ms)) / 1000)
        self.handled += 1
        self._maybe_report()
        return None  # None means ack (the same as returning cp.ack())

    def _maybe_report(self) -> None:
        # Reported from the handler itself, so an idle service stays quiet.
        now = time.monotonic()
        if now - self._last_report >= self.report_every_s:
            self._last_report = now
            log.info("handled %d messages, %d poison", self.handled, self.poisoned)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen everywhere")
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--jitter-ms", type=float, default=20.0)
    parser.add_argument("--poison-marker", default="poison", help="'' disables poison pills")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every message")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.verbose:  # only this service's debug lines, not gRPC's
        log.setLevel(logging.DEBUG)
    service = ExampleService(args.latency_ms, args.jitter_ms, args.poison_marker)
    cp.run(service, port=args.port, host=args.host)  # returns after a graceful shutdown


if __name__ == "__main__":
    main()
