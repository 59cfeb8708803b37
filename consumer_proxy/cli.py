"""The ``consumer-proxy`` command line.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .config import ProxyConfig, load_config
from .errors import ConfigError, ConsumerProxyError
from .tools.render import printable

log = logging.getLogger("consumer_proxy")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
YOUNG_GC_THRESHOLD = 200_000
"""Allocations between two of the collector's young passes in ``run`` (Python's default: 700).
Every message held is a few container objects (the fetched ``confluent_kafka.Message`` is
one) that live until it is acked, thousands at a time at high rates: by default a young pass
ran every ~230 messages and walked them again, about 1 us of the proxy's ~4.5 us per message
(``bench/bench_throughput.py``). The count is of allocations less deallocations, so once a
busy group's windows are full (as many messages acked as taken in) passes almost stop; what
is left are the passes while the windows fill, each walking the messages taken in since the
last one: at 10,000, 37 young passes (3.3 ms each) and 3 older ones (23 ms) in a 1.4 s run of
the bench; at 50,000, two passes of 6-15 ms a 200,000-record drain (the windows and backlogs
hold up to ~120,000 records there), 0.1-0.15 us a message of the event loop's CPU and 0.05-0.1
of the consumer thread's; at 200,000, none. The bound: garbage cycles wait for a pass until
this many objects were allocated and not freed (200,000 objects of small cycles: ~18 MB; the
proxy makes few: its per-message objects are freed by their counts), and what a group holds
is bounded by its windows."""

_EPILOG = """\
examples:
  consumer-proxy validate --config proxy.yaml
  consumer-proxy run --config proxy.yaml --workers 2
  consumer-proxy status --config proxy.yaml --group billing --json
  consumer-proxy guard release --config proxy.yaml --group billing
  consumer-proxy dlq inspect --config proxy.yaml --group billing --limit 5
  consumer-proxy dlq merge --config proxy.yaml --group billing --status INVALID_ARGUMENT --yes
  consumer-proxy dlq purge --config proxy.yaml --group billing --merged --yes

Environment overrides: CONSUMER_PROXY_KAFKA__BOOTSTRAP_SERVERS=broker:9092 and the like
(prefix CONSUMER_PROXY_, '__' between nested names).
"""


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _TextFormatter(logging.Formatter):
    """One line per record: a message carries data of other teams (a service's reason, a
    header), so its control characters are escaped (``tools.render.printable``) and it can
    neither send terminal sequences nor print lines of its own. Our tracebacks stay as they
    are."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def setup_logging(level: str, fmt: str) -> None:
    """Log to stderr as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _common(parser: argparse.ArgumentParser, *, group: bool = False, as_json: bool = False) -> None:
    parser.add_argument(
        "--config",
        required=True,
        type=Path,
        metavar="FILE|DIR",
        help="onboarding YAML file, or a directory of them (one per service)",
    )
    if group:
        parser.add_argument("--group", metavar="NAME", help="only this group (default: all)")
    if as_json:
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="log line format"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used to render help in the README)."""
    parser = argparse.ArgumentParser(
        prog="consumer-proxy",
        description="Kafka consumer push proxy: consumes Kafka for your consumer groups and "
        "pushes every message to your gRPC service, with out-of-order commits, retries, a DLQ "
        "and a circuit breaker.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"consumer-proxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the proxy for every configured group")
    _common(run)
    run.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes sharing the groups' partitions (default 1); worker i serves "
        "metrics on metrics.port + i",
    )

    validate = sub.add_parser("validate", help="check the configuration offline; exit 2 if bad")
    _common(validate)

    status = sub.add_parser(
        "status", help="committed offsets, lag, ack state and DLQ depth, read from Kafka"
    )
    _common(status, group=True, as_json=True)
    status.add_argument(
        "--proxy",
        metavar="URL",
        help="also ask the running proxy at URL (its HTTP endpoint, console.enabled) what it "
        "knows per partition: the window in flight and the oldest call under way",
    )

    guard = sub.add_parser(
        "guard",
        help="release or hold a running proxy's dead-letter guard (needs admin.token)",
        description="Operator actions on the dead-letter guard of a running proxy, through its "
        "HTTP endpoint (POST /admin/groups/<group>/guard/<action>, with the admin token). "
        "'release': the held dead letters are real, write them to the DLQ. 'hold': hold the "
        "group's dead letters by hand (an incident); only 'release' ends such a hold.",
    )
    guard.add_argument("action", choices=["release", "hold"], help="what to do")
    _common(guard)
    guard.add_argument("--group", required=True, metavar="NAME", help="the consumer group")
    guard.add_argument(
        "--url",
        metavar="URL",
        help="the proxy's HTTP endpoint (default: http://127.0.0.1:<metrics.port>)",
    )
    guard.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="the proxy runs N worker processes: ask each (ports metrics.port .. + N-1)",
    )
    guard.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="read the admin token from FILE (default: CONSUMER_PROXY_ADMIN__TOKEN or "
        "admin.token of the configuration)",
    )

    from .tools.commands import add_dlq_commands  # the DLQ tools are their own package

    add_dlq_commands(sub, _common)
    return parser


def _check_worker_ports(path: Path, config: ProxyConfig, workers: int) -> None:
    """Worker i binds metrics.port + i and health.grpc_port + i: the two ranges must not meet."""
    metrics = config.metrics.port if config.metrics.enabled else 0
    health = config.health.grpc_port or 0
    for field, port in (("metrics.port", metrics), ("health.grpc_port", health)):
        if port and port + workers - 1 > 65535:
            raise ConfigError(
                [
                    f"{path}: {field}: with --workers {workers}, worker {workers - 1} would "
                    f"bind port {port + workers - 1}, past 65535; lower {field} or --workers"
                ]
            )
    if metrics and health and abs(metrics - health) < workers:
        raise ConfigError(
            [
                f"{path}: health.grpc_port: with --workers {workers}, ports {health}-"
                f"{health + workers - 1} overlap the metrics ports {metrics}-"
                f"{metrics + workers - 1}; move one of them at least {workers} apart"
            ]
        )


KAFKA_FILE_PROPERTIES = (
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.crl.location",
    "ssl.keystore.location",
)
"""librdkafka properties naming a file the clients read when they are built."""


def _check_kafka_files(path: Path, config: ProxyConfig) -> None:
    """The TLS files kafka.client names exist here (in a pod: its Secret mounts), as the
    service TLS files of the groups must; librdkafka would otherwise refuse every client at
    start-up. ssl.ca.location may also be a directory or 'probe'."""
    problems = []
    for prop in KAFKA_FILE_PROPERTIES:
        value = config.kafka.client.get(prop)
        if not isinstance(value, str) or (prop == "ssl.ca.location" and value == "probe"):
            continue
        where = Path(value)
        if where.is_file() or (prop == "ssl.ca.location" and where.is_dir()):
            continue
        problems.append(f"{path}: kafka.client.{prop}: {value!r} is not a readable file")
    if problems:
        raise ConfigError(problems)


def _run_workers(args: argparse.Namespace, config: ProxyConfig) -> int:
    if args.workers == 1:
        return _run_one(args.config, args.log_level, args.log_format, 0)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(str(args.config), args.log_level, args.log_format, i),
            name=f"consumer-proxy-worker-{i}",
        )
        for i in range(args.workers)
    ]
    for proc in procs:
        proc.start()
    log.info("started %d workers: %s", len(procs), ", ".join(str(p.pid) for p in procs))

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = False
    while any(p.is_alive() for p in procs):
        for proc in procs:
            proc.join(timeout=0.2)
            if proc.exitcode not in (None, 0) and not failed:
                failed = True
                log.error("worker %s exited with %s; stopping the others", proc.name, proc.exitcode)
                forward(signal.SIGTERM, None)
    return EXIT_FAILURE if failed or any(p.exitcode for p in procs) else EXIT_OK


def _worker_main(config_path: str, level: str, fmt: str, index: int) -> None:
    setup_logging(level, fmt)
    sys.exit(_run_one(Path(config_path), level, fmt, index))


def _run_one(config_path: Path, level: str, fmt: str, index: int) -> int:
    from .proxy import Proxy  # heavy imports only for run

    config = load_config(config_path)
    if index and config.metrics.port:
        metrics = config.metrics.model_copy(update={"port": config.metrics.port + index})
        config = config.model_copy(update={"metrics": metrics})
    if index and config.health.grpc_port:
        health = config.health.model_copy(update={"grpc_port": config.health.grpc_port + index})
        config = config.model_copy(update={"health": health})

    async def main() -> None:
        proxy = Proxy(config, config_path=config_path)
        # What start-up made (modules, the config, the OpenTelemetry SDK with tracing on)
        # lives as long as the process: out of the collector's full passes, which would walk
        # it each time (with tracing on, ~40 ms a pass at 1 % sampling, one every few seconds).
        gc.collect()
        gc.freeze()
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, proxy.request_shutdown)
        log.info(
            "consumer-proxy %s starting: groups %s, Kafka at %s",
            __version__,
            ", ".join(g.name for g in config.groups),
            config.kafka.bootstrap_servers,
        )
        await proxy.run()

    try:
        asyncio.run(main())
    except ConsumerProxyError as exc:
        log.error("%s", exc)  # noqa: TRY400 (a known failure: its message says it all)
        return EXIT_FAILURE
    except Exception:
        log.exception("the proxy failed")
        return EXIT_FAILURE
    return EXIT_OK


def _status(args: argparse.Namespace, config: ProxyConfig) -> int:
    from .status import add_open_calls, collect_status, render_status

    groups = [config.group(args.group)] if args.group else list(config.groups)
    report = collect_status(config.kafka, groups)
    if args.proxy:
        add_open_calls(report, args.proxy)
    print(json.dumps(report, indent=2) if args.json else render_status(report))
    return EXIT_OK


def _guard(args: argparse.Namespace, config: ProxyConfig) -> int:
    import urllib.error
    import urllib.request

    config.group(args.group)  # a ConfigError (exit 2) for a group the file does not name
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(
                [f"{args.token_file}: cannot read the admin token: {reason or exc}"]
            ) from None
        if not token or not token.isascii() or not token.isprintable() or " " in token:
            # (never echoed: it is the secret, or most of it)
            raise ConfigError(
                [
                    f"{args.token_file}: the admin token must be one line of printable ASCII "
                    "without spaces (the proxy's admin.token)"
                ]
            )
    elif config.admin.token is not None:
        token = config.admin.token.get_secret_value()
    else:
        raise ConfigError(
            [
                f"{args.config}: admin.token: not set; give --token-file or set "
                "CONSUMER_PROXY_ADMIN__TOKEN (the token the proxy was started with)"
            ]
        )
    if args.workers < 1:
        raise ConfigError(["--workers must be at least 1"])
    if args.url:
        urls = [args.url.rstrip("/")]
    else:
        base = config.metrics.port
        urls = [f"http://127.0.0.1:{base + i}" for i in range(args.workers)]
    failed = False
    for url in urls:
        request = urllib.request.Request(
            f"{url}/admin/groups/{args.group}/guard/{args.action}",
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                print(f"{url}: {answer.read().decode(errors='replace').strip()}")
        except urllib.error.HTTPError as exc:
            failed = True
            body = exc.read().decode(errors="replace").strip()
            print(f"{url}: refused ({exc.code}): {body}", file=sys.stderr)
        except OSError as exc:
            failed = True
            print(f"{url}: cannot reach the proxy: {exc}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    started = time.monotonic()
    try:
        config = load_config(args.config)
        if args.command in ("validate", "run"):
            _check_kafka_files(args.config, config)
        if args.command == "validate":
            groups = ", ".join(g.name for g in config.groups)
            count = len(config.groups)
            print(f"{args.config}: OK ({count} group{'s' if count != 1 else ''}: {groups})")
            return EXIT_OK
        if args.command == "run":
            if args.workers < 1:
                parser.error("--workers must be at least 1")
            _check_worker_ports(args.config, config, args.workers)
            return _run_workers(args, config)
        if args.command == "status":
            return _status(args, config)
        if args.command == "guard":
            return _guard(args, config)
        if args.command == "dlq":
            from .tools.commands import run_dlq_command

            return run_dlq_command(args, config)
    except ConfigError as exc:
        for problem in exc.problems:
            # Keys, group names and file names of a team's file: data, not terminal sequences.
            print(printable(problem), file=sys.stderr)
        return EXIT_USAGE
    except ConsumerProxyError as exc:
        print(f"consumer-proxy: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
    finally:
        log.debug("%s took %.2fs", args.command, time.monotonic() - started)
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE  # pragma: no cover (parser.error exits)
