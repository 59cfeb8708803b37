"""The operator console in a real browser (Playwright driving Chromium) against a running proxy
(a child process, ``consumer-proxy run``) on the real broker, with a real gRPC service and
traffic. One proxy, service and browser serve the whole module; each test leaves the group
drained (nothing in flight, nothing lagging) for the next."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from confluent_kafka import KafkaException
from playwright.sync_api import Browser, Page

from consumer_proxy.console import CSP
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.browser import axe_violations, chromium, tab
from tests.support.kafka import Broker, create_topic, end_offsets, produce, unique_name
from tests.support.proxy import FAST_CONSUMER, ProxyProcess, config_dict
from tests.support.service import DEAD_LETTER, RETRY, Behaviour, ThreadedService
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka

TOKEN = "console-token-for-the-browser-tests"
Cli = Callable[..., tuple[int, str, str]]
SCRIPT = "<script>window.__xss = 1</script> poison"
IMAGE = '<img src="x" onerror="window.__xss = 2"> poison'
BINARY_KEY = b"\x00\xff\x10k"


@dataclass
class World:
    bootstrap: str
    topic: str
    group: str
    config: Path
    url: str
    service: ThreadedService
    proxy: ProxyProcess
    slow_s: float = 0.0
    down: bool = False
    hold_tier: bool = False

    def behaviour(self, msg: handler_pb2.Message, _n: int) -> Behaviour:
        if msg.source == handler_pb2.DELIVERY_SOURCE_REDRIVE:
            return Behaviour()  # merged back after a fix: acked
        if msg.value == b"tiered" and msg.source != handler_pb2.DELIVERY_SOURCE_RETRY:
            return Behaviour(action=RETRY)  # to retry tier 1
        if self.down or (self.hold_tier and msg.value == b"tiered"):
            return Behaviour(status=grpc.StatusCode.UNAVAILABLE, details="down for the test")
        if msg.value.endswith(b"poison"):
            text = msg.value.decode(errors="replace")
            return Behaviour(
                status=grpc.StatusCode.INVALID_ARGUMENT, details=f"cannot parse {text}"
            )
        if msg.value == b"refused":
            return Behaviour(action=DEAD_LETTER, reason="refused <b>by rule</b> 42")
        return Behaviour(delay_s=self.slow_s)

    def dlq_depth(self) -> int:
        try:
            return sum(end_offsets(self.bootstrap, f"{self.group}.dlq").values())
        except KafkaException:  # not created yet (the proxy creates it as the group starts)
            return -1

    def drained(self, cli: Cli) -> bool:
        status = json.loads(cli("status", "--config", str(self.config), "--json")[1])
        return bool(status["groups"][0]["total_lag"] == 0)


def _post(url: str, path: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"{url}{path}", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def world(kafka: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    bootstrap = kafka.bootstrap
    topic, group = unique_name("console"), unique_name("console")
    create_topic(bootstrap, topic, partitions=2)
    directory = tmp_path_factory.mktemp("console")
    holder: list[World] = []
    with ThreadedService(lambda msg, n: holder[0].behaviour(msg, n)) as service:
        raw = config_dict(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 4, "max_in_flight": 8, "retry_topics": [{"delay_ms": 500}]},
            metrics_port=0,
            client=FAST_CONSUMER,
        )
        raw["console"] = {"enabled": True}
        raw["groups"][0]["circuit_breaker"] = {"failure_threshold": 3, "reset_timeout_s": 1.0}
        config = directory / "proxy.json"
        config.write_text(json.dumps(raw))
        log = directory / "proxy.log"
        proxy = ProxyProcess(config, log, env={"CONSUMER_PROXY_ADMIN__TOKEN": TOKEN}).start()
        try:
            found: list[str] = []

            def serving() -> bool:
                proxy.check_alive()
                found[:] = re.findall(r"serving /metrics.* on 127\.0\.0\.1:(\d+)", proxy.output())
                return bool(found)

            wait_until(serving, timeout=60)
            world = World(
                bootstrap, topic, group, config, f"http://127.0.0.1:{found[0]}", service, proxy
            )
            holder.append(world)
            # Given traffic: 30 good records, two poison pills holding markup and one the
            # service refuses with a reason (binary key)
            records: list[Any] = [
                {"value": f"good-{i}".encode(), "partition": i % 2} for i in range(30)
            ]
            records += [
                {"value": SCRIPT.encode(), "partition": 0},
                {"value": IMAGE.encode(), "partition": 1},
                {"key": BINARY_KEY, "value": b"refused", "partition": 1},
            ]
            produce(bootstrap, topic, records)
            wait_until(lambda: world.dlq_depth() == 3, timeout=60, message="three dead letters")
            yield world
        finally:
            proxy.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


def _cells(page: Page, table: str, key: str) -> list[str]:
    row = page.locator(f'#{table} tbody tr[data-key="{key}"]')
    if row.count() == 0:
        return []
    return [c.strip() for c in row.locator("th, td").all_inner_texts()]


def _int(text: str) -> int | None:
    digits = text.replace(",", "")
    return int(digits) if digits.isdigit() else None


def test_the_overview_shows_what_status_says(world: World, browser: Browser, cli: Cli) -> None:
    # Given the group drained, three records in its DLQ; when a record goes to retry tier 1
    # and its service fails it there (the breaker opens), and 25 more records arrive while
    # the service is down: the lag (25 + 1 in the tier) and the tier's depth stand still
    wait_until(lambda: world.drained(cli), timeout=60, message="the group caught up")
    world.hold_tier = world.down = True
    try:
        produce(world.bootstrap, world.topic, [b"tiered"])
        produce(world.bootstrap, world.topic, [{"value": f"later-{i}".encode()} for i in range(25)])
        with tab(browser, f"{world.url}/console/") as opened:
            page = opened.page

            # Then the overview's lag and depths equal `consumer-proxy status --json` now
            def same() -> bool:
                cells = _cells(page, "groups", world.group)
                status = json.loads(cli("status", "--config", str(world.config), "--json")[1])
                g = status["groups"][0]
                tier = g["retry_tiers"][0]["depth"]
                return (
                    len(cells) == 8
                    and cells[1].startswith("breaker")
                    and _int(cells[3]) == g["total_lag"] == 26
                    and _int(cells[6]) == g["dlq_depth"] == 3
                    and cells[7] == f"tier 1: {tier}" == "tier 1: 1"
                )

            wait_until(same, timeout=30, message="the overview to equal status --json")
            # And once the service is back, the group runs and its lag is gone
            world.hold_tier = world.down = False
            wait_until(
                lambda: _cells(page, "groups", world.group)[1:4:2] == ["running", "0"],
                timeout=30,
                message="running, lag 0",
            )
            assert opened.errors == []
    finally:
        world.hold_tier = world.down = False
    wait_until(lambda: world.drained(cli), timeout=60, message="the group caught up")


def test_a_lagging_partition_shows_its_lag_growing_and_why_it_is_paused(
    world: World, browser: Browser, cli: Cli
) -> None:
    # Given a slow service (1 s per message) and a window of 8 on partition 0, and more
    # records than the window and its backlog (ten windows) hold
    world.slow_s = 1.0
    try:
        produce(world.bootstrap, world.topic, [{"value": b"slow", "partition": 0}] * 90)
        with tab(browser, f"{world.url}/console/#/group/{world.group}") as opened:
            page = opened.page
            page.evaluate("window.__loaded = 'once'")
            key = f"{world.topic}/0"

            def lag() -> int:
                cells = _cells(page, "partitions", key)
                return (_int(cells[3]) or 0) if cells else 0

            # Then the partition shows a lag, why it is paused and its oldest open call
            wait_until(
                lambda: lag() > 0 and "backlog" in _cells(page, "partitions", key)[6],
                timeout=30,
                message="partition 0 paused with its backlog at its bound",
            )
            first = lag()
            assert _cells(page, "partitions", key)[5] != "-"

            # And `status --proxy` shows partition 0's oldest open call (issue 30)
            def oldest_call() -> float:
                code, out, err = cli(
                    "status", "--config", str(world.config), "--proxy", world.url, "--json"
                )
                assert code == 0, err
                rows = json.loads(out)["groups"][0]["partitions"]
                row = next(r for r in rows if (r["topic"], r["partition"]) == (world.topic, 0))
                assert 1 <= row["in_flight"] <= 8
                return float(row["oldest_call_age_s"] or 0.0)

            wait_until(lambda: oldest_call() > 0, timeout=20, message="an open call's age")
            code, out, err = cli("status", "--config", str(world.config), "--proxy", world.url)
            assert code == 0 and "oldest call" in out, err
            # When more records arrive, the lag shown grows without a reload
            produce(world.bootstrap, world.topic, [{"value": b"slow", "partition": 0}] * 30)
            wait_until(lambda: lag() > first, timeout=30, message="the lag to grow")
            assert page.evaluate("window.__loaded") == "once"
            assert opened.errors == []
    finally:
        world.slow_s = 0.0
    wait_until(lambda: world.drained(cli), timeout=90, message="the group caught up")


def _inspect(world: World, cli: Cli) -> list[dict[str, Any]]:
    code, out, err = cli(
        "dlq",
        "inspect",
        "--config",
        str(world.config),
        "--group",
        world.group,
        "--limit",
        "100",
        "--json",
    )
    assert code == 0, err
    sample: list[dict[str, Any]] = json.loads(out)["sample"]
    return sample


def test_the_dead_letters_page_lists_the_poison_records_as_text(
    world: World, browser: Browser, cli: Cli
) -> None:
    sample = _inspect(world, cli)
    with tab(browser, f"{world.url}/console/#/dlq/{world.group}") as opened:
        page = opened.page
        rows = page.locator("#records tbody tr")
        wait_until(lambda: rows.count() == 3, timeout=30, message="three DLQ records listed")
        # Then each row names the record's origin and the service's reason
        shown = {r.locator("td").nth(0).inner_text(): r for r in rows.all()}
        for record in sample:
            cp = record["cp"]
            where = f"[{cp['cp-original-partition']}]@{cp['cp-original-offset']}"
            origin = cp["cp-original-topic"] + where
            assert origin in shown, (origin, list(shown))
            cells = [c.strip() for c in shown[origin].locator("td").all_inner_texts()]
            assert cells[3] == cp["cp-reason"] and cells[2] == cp["cp-status"]
        values = page.locator("#records tbody td.value").all_inner_texts()
        # And markup in values and reasons is text: nothing ran, no element was made of it
        assert SCRIPT in values and IMAGE in values
        assert page.evaluate("window.__xss") is None
        assert page.locator("main img, main script, main b").count() == 0
        assert any(v.startswith("hex:") for v in values)  # the binary key, as hex
        # When filtered by status, the count is what `dlq inspect` shows for that status
        expected = sum(1 for r in sample if r["cp"]["cp-status"] == "INVALID_ARGUMENT")
        page.goto(f"{world.url}/console/#/dlq/{world.group}?status=INVALID_ARGUMENT")
        wait_until(
            lambda: (
                page.locator("#dlq-summary").get_attribute("data-matching") == str(expected)
                and rows.count() == expected
            ),
            timeout=30,
            message=f"{expected} INVALID_ARGUMENT records",
        )
        assert expected == 2
        command = page.locator("#merge-command").inner_text()
        assert command == (
            f"consumer-proxy dlq merge --config {world.config} --group {world.group} "
            "--status INVALID_ARGUMENT --dry-run"
        )
        assert opened.errors == []


def test_without_the_token_every_action_is_refused_and_none_is_shown(
    world: World, browser: Browser
) -> None:
    group = world.group
    actions = [
        "/admin/console/check",
        f"/admin/groups/{group}/dlq/merge?dry_run=1",
        f"/admin/groups/{group}/dlq/merge",
        f"/admin/groups/{group}/dlq/purge?bound=all",
        f"/admin/groups/{group}/dlq/purge?bound=all&dry_run=1",
    ]
    # The page and its API come with a strict content security policy
    for path in ("/console/", "/console/static/console.js", "/console/api/overview"):
        with urllib.request.urlopen(f"{world.url}{path}", timeout=10) as answer:
            assert answer.headers["Content-Security-Policy"] == CSP, path
            assert answer.headers["X-Content-Type-Options"] == "nosniff", path
    for path in actions:
        assert _post(world.url, path, None) == 403, path
        assert _post(world.url, path, "a-wrong-token-of-enough-length") == 403, path
    with tab(browser, f"{world.url}/console/#/dlq/{group}") as opened:
        page = opened.page
        wait_until(lambda: page.locator("#records tbody tr").count() == 3, timeout=30)
        assert page.locator("#signin").is_visible() and not page.locator("#who").is_visible()
        assert page.locator("#actions button, #dry-run, #merge, #purge").count() == 0
        assert opened.errors == []
    assert world.dlq_depth() == 3


def _sign_in(page: Page) -> None:
    page.locator("#token").fill(TOKEN)
    page.locator("#signin button").click()
    page.locator("#who").wait_for(state="visible")


def test_with_the_token_a_merge_shows_the_cli_dry_run_count_asks_and_merges(
    world: World, browser: Browser, cli: Cli
) -> None:
    # (the CLI in a process of its own, as an operator runs it: Spark's JVM is started by a
    # fork, which in this process would share it with the test service's gRPC threads; one
    # such start lost the JVM's stdin, and the JVM exited at once)
    dry = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", "dlq", "merge", "--config", str(world.config),
         "--group", world.group, "--status", "INVALID_ARGUMENT", "--dry-run", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    summary = json.loads(dry.stdout)
    expected = summary["selected"] - summary["deferred"]
    assert expected == 2
    with tab(browser, f"{world.url}/console/#/dlq/{world.group}?status=INVALID_ARGUMENT") as opened:
        page = opened.page
        _sign_in(page)
        # When the operator asks for a merge, the page runs its dry run first
        page.locator("#merge").click()
        page.locator("#confirm").wait_for(state="visible", timeout=240_000)
        # Then the count it shows and asks about is the CLI's
        job = page.locator("#job")
        assert job.get_attribute("data-count") == str(expected)
        assert f"would merge {expected} of" in job.inner_text()
        question = page.locator("#confirm-text").inner_text()
        assert question == f"Merge {expected} records into {world.group}.redrive?"
        assert world.dlq_depth() == 3 and _redriven(world) == []  # nothing written yet
        # When confirmed, the merge runs (its progress shown) and the records come back
        page.locator("#confirm-yes").click()
        wait_until(lambda: f"Merged {expected} records" in job.inner_text(), timeout=240)
        wait_until(lambda: sorted(_redriven(world)) == sorted([SCRIPT, IMAGE]), timeout=60)
        assert opened.errors == []
    assert world.dlq_depth() == 3  # a merge copies; purge deletes
    inspect = json.loads(
        cli("dlq", "inspect", "--config", str(world.config), "--group", world.group, "--json")[1]
    )
    assert inspect["not_merged"] == 1


def _redriven(world: World) -> list[str]:
    """The values the service was given again from the redrive topic."""
    deliveries = world.service.deliveries
    return [d.value.decode() for d in deliveries if d.source == "redrive" and d.value is not None]


def _screenshot(page: Page, name: str) -> None:
    """With CONSUMER_PROXY_SCREENSHOTS=DIR, save the page (the README's pictures: docs/img)."""
    directory = os.environ.get("CONSUMER_PROXY_SCREENSHOTS")
    if directory:
        page.screenshot(path=str(Path(directory) / name), full_page=True)


def _low(world: World) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": world.bootstrap, "group.id": "console-test-low"})
    try:
        topic = f"{world.group}.dlq"
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[0] for p in parts
        )
    finally:
        consumer.close()


def test_keyboard_navigation_and_no_serious_accessibility_violation(
    world: World, browser: Browser
) -> None:
    with tab(browser, f"{world.url}/console/") as opened:
        page = opened.page
        link = page.locator(f'#groups a[href="#/group/{world.group}"]')
        link.wait_for()
        _screenshot(page, "console-overview.png")
        assert axe_violations(page) == []
        # When the operator tabs to the group's link and presses Enter
        for _ in range(30):
            page.keyboard.press("Tab")
            if (
                page.evaluate(
                    "document.activeElement && document.activeElement.getAttribute('href')"
                )
                == f"#/group/{world.group}"
            ):
                break
        else:
            pytest.fail("the group's link is not reachable with Tab")
        page.keyboard.press("Enter")
        page.locator("h1", has_text=f"Group {world.group}").wait_for()
        page.locator("#partitions tbody tr").first.wait_for()
        page.locator("#chart polyline").wait_for(state="attached")
        _screenshot(page, "console-group.png")
        assert axe_violations(page) == []
        for _ in range(30):
            page.keyboard.press("Tab")
            if (
                page.evaluate("document.activeElement && document.activeElement.textContent")
                == f"Dead letters of {world.group}"
            ):
                break
        else:
            pytest.fail("the dead letters link is not reachable with Tab")
        page.keyboard.press("Enter")
        page.locator("h1", has_text="Dead letters").wait_for()
        page.locator("#dlq-summary").filter(has_text="records held").wait_for()
        page.locator("#records tbody tr").first.wait_for()
        _screenshot(page, "console-dead-letters.png")
        assert axe_violations(page) == []
        assert opened.errors == []


def test_purge_asks_with_the_count_and_deletes(world: World, browser: Browser) -> None:
    with tab(browser, f"{world.url}/console/#/dlq/{world.group}") as opened:
        page = opened.page
        _sign_in(page)
        page.locator("#purge-bound").select_option("all")
        page.locator("#purge").click()
        dialog = page.locator("#confirm")
        dialog.wait_for(state="visible", timeout=60_000)
        assert "Delete 3 records" in page.locator("#confirm-text").inner_text()
        assert world.dlq_depth() == 3 and _low(world) == 0  # nothing deleted before the answer
        page.locator("#confirm-yes").click()
        wait_until(lambda: _low(world) == 3, timeout=60, message="the DLQ purged")
        wait_until(lambda: "deleted 3 records" in page.locator("#job").inner_text(), timeout=30)
        assert opened.errors == []
