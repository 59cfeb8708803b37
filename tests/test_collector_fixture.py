"""The tests' OpenTelemetry Collector fixture starts on ports of its own, never on a taken one."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import collector


def test_a_port_taken_before_the_collector_binds_it_is_never_mistaken_for_the_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given another process that listens on the port the fixture chose first (taken between
    # the fixture's probe and the collector's bind)
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = int(thief.getsockname()[1])
        free_ports = collector._free_ports
        chosen: list[list[int]] = []

        def first_taken(count: int) -> list[int]:
            ports = free_ports(count)
            chosen.append([taken, *ports[1:]] if not chosen else ports)
            return chosen[-1]

        monkeypatch.setattr(collector, "_free_ports", first_taken)

        # When the fixture starts the collector
        with collector.Collector.start(tmp_path) as started:
            # Then it started again on fresh ports, and the collector process itself listens
            # on the ports it reports (a connect would have reached the thief)
            assert len(chosen) == 2
            assert started.otlp_grpc == f"http://127.0.0.1:{chosen[1][0]}"
            assert collector._listening(started.process.pid, chosen[1][0])
            assert collector._listening(started.process.pid, chosen[1][1])
            assert not collector._listening(started.process.pid, taken)
