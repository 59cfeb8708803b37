"""Shared fixtures. Logic lives in tests/support/; keep this file to wiring."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.support.cli import Cli
from tests.support.kafka import Broker, BrokerError, start_broker, stop_broker


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One real Kafka broker for the whole session, on a free port. Fails, never skips."""
    directory = tmp_path_factory.mktemp("kafka")
    try:
        # watch_pid: the broker stops itself should this session die without its teardown.
        broker = start_broker(directory, watch_pid=os.getpid())
    except (BrokerError, OSError) as exc:
        pytest.fail(
            f"the Kafka test broker did not start (needs Java 17+, Maven):\n{exc}", pytrace=False
        )
    try:
        yield broker
    finally:
        stop_broker(directory)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """Run ``consumer-proxy ARGS`` in-process; returns (exit code, stdout, stderr)."""
    from consumer_proxy.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """The CLI's main() installs its own root log handler; give pytest's back afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print every delivery ledger the fault and bad-input tests checked (tests/support/ledger)."""
    from tests.support.ledger import SUMMARIES

    if SUMMARIES:
        terminalreporter.section("delivery ledgers")
        for summary in SUMMARIES:
            terminalreporter.write_line(summary.line())
