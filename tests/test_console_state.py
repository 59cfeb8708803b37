"""The console's pure parts: the core's read-only partition views (pause reasons, windows,
ack state) and the DLQ page's filter (what reaches a command line). The console itself, in a
browser against a running proxy: tests/test_console.py."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from consumer_proxy.config import CircuitBreakerConfig, DeliveryConfig, ProxyConfig
from consumer_proxy.console.dlq import Filter
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.core.partitions import (
    PAUSE_REASONS,
    Delivery,
    PartitionSet,
    PartitionView,
    backlog_bound,
)
from consumer_proxy.flow import Breaker
from consumer_proxy.metrics import HttpEndpoint
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.proxy import Proxy
from tests.support.core import CoreRig
from tests.support.proxy import config_dict
from tests.support.records import Rec
from tests.support.scrape import http_get

ACK = Classifier().from_response(handler_pb2.HandleMessageResponse())


def _core(window: int) -> tuple[PartitionSet, Breaker, deque[Delivery]]:
    rig = CoreRig(
        DeliveryConfig(max_in_flight=window),
        tps=(("t", 0), ("t", 1)),
        breaker=CircuitBreakerConfig(failure_threshold=1),
    )
    return rig.core, rig.breaker, rig.ready


def _view(core: PartitionSet, partition: int) -> PartitionView:
    return next(v for v in core.views() if v.partition == partition)


def test_a_full_window_shows_its_size_backlog_and_why_it_is_paused() -> None:
    # Given a window of 4 and 6 records fetched on partition 0, none on partition 1
    core, _breaker, _ready = _core(window=4)
    for offset in range(6):
        core.intake(Rec("t", offset))
    core.pause_plan()
    # Then partition 0 shows its full window and the backlog beyond it, and keeps fetching
    view = _view(core, 0)
    assert (view.window, view.window_max, view.pending, view.backlog) == (4, 4, 4, 2)
    assert not view.paused and view.reasons == ()
    # When its backlog reaches its bound (ten windows)
    for offset in range(6, 4 + backlog_bound(4)):
        core.intake(Rec("t", offset))
    plan = core.pause_plan()
    # Then it is paused because of its backlog
    view = _view(core, 0)
    assert view.backlog == 40 and view.paused and view.reasons == ("backlog",)
    assert ("t", 0) in plan.pause
    # And partition 1 fetches, with no reason to pause
    assert not _view(core, 1).paused and _view(core, 1).reasons == ()


def test_an_open_breaker_is_the_reason_of_a_partition_that_holds_messages() -> None:
    core, breaker, _ready = _core(window=100)
    core.intake(Rec("t", 0))
    # When the breaker opens (one service failure with threshold 1)
    breaker.record(True, probe=False)
    core.pause_plan()
    # Then the partition holding a message is paused for the breaker; the empty one fetches
    assert _view(core, 0).reasons == ("breaker",)
    assert _view(core, 1).reasons == ()


def test_a_commit_shows_the_committed_offset_and_the_ack_state_size() -> None:
    core, _breaker, ready = _core(window=100)
    for offset in range(5):
        core.intake(Rec("t", offset))
    # When offsets 0, 1 and 3 are acked (2 and 4 still out) and the plan is committed
    for delivery in list(ready):
        core.begin(delivery)
        if delivery.offset in (0, 1, 3):
            core.finish(delivery, ACK, probe=False)
    plan, _over = core.commit_plan()
    core.committed(plan)
    # Then the view shows the commit at 2 and the bytes of its ack state (3 acked above)
    view = _view(core, 0)
    assert view.committed == 2 and view.ack_state_bytes > 0
    assert view.window == 3 and view.pending == 2 and view.calls == 2
    assert set(PAUSE_REASONS) >= set(view.reasons)


def test_the_filter_lets_only_status_names_and_times_reach_the_merge_command() -> None:
    flt = Filter.parse({"status": ["INVALID_ARGUMENT,DEAD_LETTER"], "since": ["1700000000000"]})
    command = flt.merge_command("billing", Path("/etc/proxy/conf.yaml"))
    assert command == (
        "consumer-proxy dlq merge --config /etc/proxy/conf.yaml --group billing "
        "--status INVALID_ARGUMENT --status DEAD_LETTER --since 1700000000000 --dry-run"
    )
    for bad in ({"status": ["X; rm -rf /"]}, {"since": ["yesterday"]}, {"until": ["-1"]}):
        with pytest.raises(ValueError):
            Filter.parse(bad)
    # A reason filters the page only: it never becomes a --where (Spark SQL)
    assert "--where" not in Filter.parse({"reason": ["x' OR 1=1"]}).merge_command("g", None)


def test_a_console_without_the_http_endpoint_is_bad_config(
    tmp_path: Path, cli: Callable[..., tuple[int, str, str]]
) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(
        "kafka: {bootstrap_servers: 'localhost:9092'}\n"
        "metrics: {enabled: false}\n"
        "console: {enabled: true}\n"
        "groups: [{name: g, topics: [t], service: {endpoints: ['127.0.0.1:50051']}}]\n"
    )
    code, _out, err = cli("validate", "--config", str(config))
    assert code == 2
    assert str(config) in err and "console.enabled" in err and "metrics" in err


async def test_the_console_is_off_unless_enabled() -> None:
    raw = config_dict("127.0.0.1:9", "g", ["t"], ["127.0.0.1:9"], metrics_port=0)
    # Given the default configuration: no console, and the HTTP endpoint does not serve one
    proxy = Proxy(ProxyConfig(**raw))
    assert proxy.console is None
    endpoint = HttpEndpoint(proxy.metrics, proxy.ready, "127.0.0.1", 0, pages=None)
    await endpoint.start()
    try:
        assert (await http_get(endpoint.port, "/console/"))[0] == 404
        assert (await http_get(endpoint.port, "/console/api/overview"))[0] == 404
    finally:
        await endpoint.close()
    # And with console.enabled the proxy has one
    assert Proxy(ProxyConfig(**{**raw, "console": {"enabled": True}})).console is not None


@pytest.mark.parametrize("job", ["%C2%B2", "9" * 5000, "-1", "1e3"])
async def test_a_job_id_that_is_no_number_is_a_404_and_logs_nothing(
    job: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a console on its HTTP endpoint (no token: these reads need none)
    raw = config_dict("127.0.0.1:9", "g", ["t"], ["127.0.0.1:9"], metrics_port=0)
    proxy = Proxy(ProxyConfig(**{**raw, "console": {"enabled": True}}))
    assert proxy.console is not None
    endpoint = HttpEndpoint(proxy.metrics, proxy.ready, "127.0.0.1", 0, pages=proxy.console.page)
    await endpoint.start()
    caplog.set_level(logging.DEBUG)
    try:
        # When anyone asks for a job whose id str.isdigit() takes ("²") or int() refuses
        status, _body = await http_get(endpoint.port, f"/console/api/jobs/{job}")
    finally:
        await endpoint.close()
    # Then the answer is "no such job", and nothing above debug is logged
    assert status == 404
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG] == []
