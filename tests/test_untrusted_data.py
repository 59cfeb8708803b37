"""Untrusted data stays data: producers' headers, services' reasons, operators' passwords.

Each test is named after the promise it checks and tries one kind of hostile input (the table
in docs/operating.md, "Security", lists them): user headers named like the proxy's, passwords
that JAAS quoting would mangle (read back by the Kafka client's own parser), and record values
or service reasons carrying terminal control sequences.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from confluent_kafka import Producer

from consumer_proxy.cli import main, setup_logging
from consumer_proxy.config import KafkaConfig
from consumer_proxy.core import records as dlq_records
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.tools import commands, render
from consumer_proxy.tools import spark as tool_spark
from consumer_proxy.tools.reports import (
    DlqReport,
    Island,
    OriginCount,
    ReasonTemplate,
    StatusCount,
)
from tests.support.kafka import Broker, consume_all, create_topic, produce, run_script, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy, write_config
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

# --------------------------------------------------------------------------- user cp- headers


@pytest.mark.kafka
async def test_user_headers_named_cp_and_forged_ones_arrive_at_the_service_and_in_the_dlq_copy(
    kafka: Broker,
) -> None:
    # Given records with a user header named like the proxy's (cp-tenant) and forged values
    # for two names the proxy owns (cp-attempt, cp-reason)
    bootstrap, topic, group = kafka.bootstrap, unique_name("cphdr"), unique_name("cphdr")
    create_topic(bootstrap, topic)
    dlq_topic = create_topic(bootstrap, f"{group}.dlq")
    user_headers = [("cp-tenant", b"acme"), ("trace", b"t1"), ("cp-tenant", b"globex")]
    forged = [("cp-attempt", b"99"), ("cp-reason", b"forged")]
    records = [
        {"key": verdict, "value": b"v", "headers": [*user_headers, *forged, ("verdict", verdict)]}
        for verdict in (b"ack", b"poison")
    ]
    await asyncio.to_thread(produce, bootstrap, topic, records)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.key == b"poison":
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="rejected")
        return Behaviour()

    # When the proxy delivers one and dead-letters the other
    async with TestService(behaviour) as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task

    # Then the service saw every header as the producer wrote it, in order: cp-tenant, and
    # the values forged for the proxy's names too (a source topic's headers are the
    # producer's data; the attempt the service is told is the proxy's own, 1)
    assert not service.errors
    assert len(service.deliveries) == 2
    for delivery in service.deliveries:
        assert delivery.headers == (*user_headers, *forged, ("verdict", delivery.key))
        assert delivery.attempt == 1
    # and the DLQ copy keeps them, followed by the proxy's block, which alone is read back as
    # the proxy's (its cp-attempt 1 and cp-reason, not the forged ones before it)
    [dead] = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    headers = dead.headers()
    assert isinstance(headers, list)
    user, ours = dlq_records.split_headers(headers)
    assert user == [*user_headers, *forged, ("verdict", b"poison")]
    assert [v for k, v in headers if k == dlq_records.H_ATTEMPT] == [b"99", b"1"]
    assert (ours[dlq_records.H_ATTEMPT], ours[dlq_records.H_REASON]) == ("1", "rejected")
    assert ours[dlq_records.H_STATUS] == "INVALID_ARGUMENT"


def test_only_the_proxys_own_header_names_are_taken_out_of_a_record() -> None:
    # Given a record with every name the proxy owns and user names sharing its prefix
    user = [("cp-tenant", b"acme"), ("CP-Attempt", b"x"), ("cp-", b""), ("cp-originaltopic", b"y")]
    proxy_owned = [(name, b"1") for name in sorted(dlq_records.PROXY_HEADERS)]

    # When it is split
    got_user, got_ours = dlq_records.split_headers([*user, *proxy_owned])

    # Then the user's stay the user's, and only the proxy's names are the proxy's
    assert got_user == user
    assert set(got_ours) == dlq_records.PROXY_HEADERS

    # When the proxy's names come before the user's last header too (a producer's forged
    # values, kept as data in a DLQ copy), Then only the block the proxy appended is its
    forged = [("cp-attempt", b"99"), ("cp-original-offset", b"7")]
    got_user, got_ours = dlq_records.split_headers([*forged, *user, *proxy_owned])
    assert got_user == [*forged, *user]
    assert got_ours[dlq_records.H_ATTEMPT] == "1"
    # ... a name twice in the trailing run: the earlier one is the user's
    got_user, got_ours = dlq_records.split_headers([*user, ("cp-attempt", b"9"), *proxy_owned])
    assert got_user == [*user, ("cp-attempt", b"9")] and got_ours[dlq_records.H_ATTEMPT] == "1"
    # ... and on a source topic (take_ours False) every header is the user's
    everything = [*forged, *user, *proxy_owned]
    assert dlq_records.split_headers(everything, take_ours=False) == (everything, {})


# --------------------------------------------------------------------------- JAAS quoting

JAAS_PROBE = """
import java.nio.charset.StandardCharsets;
import java.util.Base64;
import java.util.Map;
import javax.security.auth.login.AppConfigurationEntry;
import org.apache.kafka.common.config.types.Password;
import org.apache.kafka.common.security.JaasContext;

// Reads base64 JAAS lines (one per argument) the way a Kafka client reads sasl.jaas.config,
// and prints each login module's username and password, base64.
public class JaasProbe {
    public static void main(String[] args) {
        Base64.Encoder out = Base64.getEncoder();
        for (String arg : args) {
            String line = new String(Base64.getDecoder().decode(arg), StandardCharsets.UTF_8);
            JaasContext context = JaasContext.loadClientContext(
                Map.of("sasl.jaas.config", new Password(line)));
            AppConfigurationEntry entry = context.configurationEntries().get(0);
            Map<String, ?> options = entry.getOptions();
            System.out.println(encoded(out, options, "username") + " "
                + encoded(out, options, "password"));
        }
    }

    static String encoded(Base64.Encoder out, Map<String, ?> options, String name) {
        return out.encodeToString(((String) options.get(name)).getBytes(StandardCharsets.UTF_8));
    }
}
"""

HOSTILE_SECRETS = [
    "plain",
    "a\\nb",  # a backslash and an n, not a newline
    "ends with a backslash\\",
    "\\",
    "\\\\two",
    'a "quoted" word',
    'escaped \\" quote',
    "octal \\101 and \\0",
    "a real\nnewline and a\rreturn",
    "tab\there",
    "semicolon; and = and /* not */ and // a comment",
    "p\u00e4ssw\u00f6rd \u2603",
    "",
]


def _kafka_clients_classpath() -> str:
    # The broker's classpath (kafka-clients included), fetched from Maven Central by
    # scripts/kafka the same way the broker is.
    result = run_script("fetch", timeout_s=600)
    assert result.returncode == 0, result.stderr
    listing = result.stdout.strip().rpartition("classpath=")[2]
    return Path(listing).read_text().strip()


def test_sasl_credentials_reach_the_kafka_client_exactly_as_configured(tmp_path: Path) -> None:
    # Given the Kafka client's own JAAS parser (kafka-clients from Maven Central, run by Java)
    javac, java = shutil.which("javac"), shutil.which("java")
    assert javac and java, "needs a JDK 17+ (javac and java on PATH), as the broker does"
    classpath = _kafka_clients_classpath()
    (tmp_path / "JaasProbe.java").write_text(JAAS_PROBE)
    compiled = subprocess.run(
        [javac, "-cp", classpath, "-d", str(tmp_path), str(tmp_path / "JaasProbe.java")],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    # and the JAAS line the DLQ tools give Spark for each hostile username and password
    lines = []
    for secret in HOSTILE_SECRETS:
        kafka = KafkaConfig(
            bootstrap_servers="broker:9093",
            client={"sasl.mechanisms": "PLAIN", "sasl.username": secret, "sasl.password": secret},
        )
        lines.append(tool_spark.java_kafka_options(kafka)["kafka.sasl.jaas.config"])

    # When the Kafka client parses them
    parsed = subprocess.run(
        [java, "-cp", f"{tmp_path}:{classpath}", "JaasProbe"]
        + [base64.b64encode(line.encode()).decode() for line in lines],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip

    # Then it reads back every username and password exactly
    assert parsed.returncode == 0, parsed.stderr
    got = [
        tuple(base64.b64decode(field).decode() for field in row.split(" "))
        for row in parsed.stdout.splitlines()
    ]
    assert got == [(secret, secret) for secret in HOSTILE_SECRETS]


# ------------------------------------------------------------------- the operator's terminal

# A value that, printed raw, adds a DLQ row of its own and overwrites a line; a reason that
# sets the terminal's title (OSC), colours it (CSI), and reverses the text after it (bidi).
FAKE_ROW = "- [0@7] billing[0]@7 status=OK attempt=1 reason='fine'"
HOSTILE_VALUE = f"ok\n{FAKE_ROW}\rover".encode()
HOSTILE_REASON = "\x1b]0;pwned\x07\x1b[31mred 42\x1b[0m\r\nfake line \u202eesrever"
# What must never reach the terminal: controls other than the tools' own line ends, DEL, C1,
# bidi overrides and embeddings, line and paragraph separators.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]")
DEAD_LETTERS = 3


@pytest.fixture(scope="module")
def hostile_dlq(kafka: Broker, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A DLQ the real proxy wrote: a real service dead-letters records carrying terminal
    sequences in their values, with a reason carrying more."""
    bootstrap, topic, group = kafka.bootstrap, unique_name("term"), unique_name("term")
    create_topic(bootstrap, topic)
    dlq_topic = create_topic(bootstrap, f"{group}.dlq")
    produce(bootstrap, topic, [{"key": b"k", "value": HOSTILE_VALUE}] * DEAD_LETTERS)

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        return Behaviour(
            action=handler_pb2.HandleMessageResponse.DEAD_LETTER, reason=HOSTILE_REASON
        )

    async def dead_letter_all() -> None:
        async with TestService(behaviour) as service:
            proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
            await proxy.shutdown()
            await task

    asyncio.run(dead_letter_all())
    [reason] = {
        dlq_records.split_headers(m.headers())[1][dlq_records.H_REASON]
        for m in consume_all(bootstrap, dlq_topic)
    }
    assert reason == HOSTILE_REASON  # the DLQ keeps the data as it came
    path = tmp_path_factory.mktemp("term") / "proxy.json"
    return group, write_config(path, bootstrap, group, [topic], ["127.0.0.1:1"])


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local Spark session for the module; the commands under test reuse it."""
    run = tool_spark.start_spark(tool_spark.SparkOptions(master="local[2]"), lambda _line: None)
    yield run.spark
    run.spark.stop()
    if run.console_log is not None:
        run.console_log.unlink(missing_ok=True)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.kafka
def test_dlq_inspect_prints_record_values_escaped_never_as_rows_of_their_own(
    hostile_dlq: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # Given dead letters whose value holds a fake DLQ row after a newline, and a carriage return
    group, path = hostile_dlq

    # When the operator inspects the DLQ
    code, out, _ = cli(capsys, "dlq", "inspect", "--config", path, "--group", group)

    # Then each record prints as one row, its value's line ends shown escaped
    assert code == 0
    assert not RAW_CONTROL.search(out), out
    assert sum(line.startswith("- [") for line in out.splitlines()) == DEAD_LETTERS
    assert out.count(f"value=ok\\n{FAKE_ROW}\\rover") == DEAD_LETTERS


@pytest.mark.kafka
@pytest.mark.spark
def test_dlq_report_prints_service_reasons_escaped(
    hostile_dlq: tuple[str, Path], spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given dead letters whose service gave a reason with OSC, CSI, CR LF and a bidi override
    group, path = hostile_dlq

    # When the operator reports on the DLQ
    code, out, _ = cli(
        capsys, "dlq", "report", "--config", path, "--group", group, "--out", tmp_path
    )

    # Then the summary shows the reason with its control characters escaped
    assert code == 0
    assert not RAW_CONTROL.search(out), out
    assert "\\x1b]0;pwned\\x07\\x1b[31mred" in out
    assert "\\u202eesrever" in out


@pytest.mark.parametrize(
    "reason", ["bad value $\\frac{$", "x $\\sqrt[$ y", "price in $ or $x_{x_{x}}$ rejected"]
)
def test_the_report_chart_shows_a_reason_with_dollars_as_text(reason: str, tmp_path: Path) -> None:
    # Given a DLQ report whose top reason, a service's text, holds "$...$" (matplotlib reads
    # it as math: an unbalanced one failed the whole report, and a balanced one changed what
    # the reason appeared to say)
    template = render.reason_template(reason) or ""
    report = DlqReport(
        topic="orders.dlq", generated_at="now", offsets={}, total=1, by_dlq_partition=[],
        by_status=[StatusCount("$INVALID$", 1)],
        by_reason_template=[ReasonTemplate(template, 1, 1, reason)], by_reason=[],
        reasons_distinct=1,
        by_original_partition=[OriginCount("$t$", 0, 1), OriginCount("u", 1, 1)],
        by_hour=[], top_keys=[], group="billing",
    )  # fmt: skip

    # When the chart is drawn
    render.write_chart(report, tmp_path / "chart.png")

    # Then it is (its labels as text: each "$" shown, none read as math)
    assert (tmp_path / "chart.png").stat().st_size > 0
    assert render.literal(reason).count("\\$") == reason.count("$")


def test_terminal_output_escapes_every_character_that_is_not_printable() -> None:
    # Given every Unicode character
    every = "".join(map(chr, range(0x110000)))

    # When it is made printable
    shown = render.printable(every)

    # Then nothing a terminal would act on is left, and printable text is kept as it is
    assert shown.isprintable()
    assert not RAW_CONTROL.search(shown)
    assert render.printable("plain text, caf\u00e9 \u2603") == "plain text, caf\u00e9 \u2603"
    assert render.printable("a\nb\x1b[0m") == "a\\nb\\x1b[0m"


def test_a_text_log_line_escapes_what_a_service_said_and_stays_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the proxy's text log format, and a service reason that tries to forge a line
    # of its own and colour the terminal
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", "text")
        reason = "bad\n2026-11-26 00:00:00 ERROR [1] consumer_proxy: forged\x1b[31m\u202e"
        # When the proxy logs it (as a circuit-open line does), with one of its own tracebacks
        log = logging.getLogger("consumer_proxy.group")
        log.error("group g: circuit open; last failure: %s", reason)
        try:
            raise ValueError("ours")
        except ValueError:
            log.exception("group g: task failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    lines = err.splitlines()
    # Then the service's text is one escaped line: no forged line, no escape sequence
    [circuit] = [line for line in lines if "circuit open" in line]
    assert circuit.endswith(
        r"last failure: bad\n2026-11-26 00:00:00 ERROR [1] consumer_proxy: "
        r"forged\x1b[31m\u202e"
    )
    assert not any(line.startswith("2026-11-26 00:00:00") for line in lines)
    assert "\x1b" not in err and "\u202e" not in err
    # and our own traceback keeps its lines
    assert "Traceback (most recent call last):" in lines and "ValueError: ours" in lines


def test_merge_dry_run_prints_statuses_escaped() -> None:
    # Given a selection whose cp-status came from a forged record
    island = Island(partition=0, start=0, end=2, count=2, by_status={"OK\x1b[2J\r\n- x": 2})

    # When a dry run describes it
    text = commands._describe([island])

    # Then the status is one escaped label
    assert not RAW_CONTROL.search(text)
    assert "OK\\x1b[2J\\r\\n- x: 2" in text


# --------------------------------------------------------------------------- non-UTF-8 names


# confluent-kafka hands a header name that is not UTF-8 over as the text of its bytes' repr.
NON_UTF8_NAME = b"bad\xff\xfename"
NON_UTF8_SHOWN = "b'bad\\xff\\xfename'"


@pytest.mark.kafka
async def test_a_header_name_that_is_not_utf8_does_not_stop_the_intake(kafka: Broker) -> None:
    # Given a record whose header name is not UTF-8 (librdkafka's producer takes any bytes;
    # Java producers cannot write one), between two plain records
    bootstrap, topic, group = kafka.bootstrap, unique_name("nonutf8"), unique_name("nonutf8")
    create_topic(bootstrap, topic)
    dlq_topic = create_topic(bootstrap, f"{group}.dlq")
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, b"before", b"k0")
    odd = [(NON_UTF8_NAME, b"v"), ("ok", b"1")]  # confluent-kafka's stubs say names are str
    producer.produce(topic, b"odd", b"k1", headers=odd)  # type: ignore[arg-type]
    producer.produce(topic, b"after", b"k2")
    assert producer.flush(30) == 0

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.key == b"k1":
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="odd header")
        return Behaviour()

    # When the proxy consumes them, the service rejecting the odd one
    async with TestService(behaviour) as service:
        proxy, task = start_proxy(make_config(bootstrap, group, [topic], [service.address]))
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await proxy.shutdown()
        await task

    # Then the proxy went on past it: the records around it were delivered and acked
    assert not service.errors
    seen = {d.key: d.headers for d in service.deliveries}
    assert set(seen) == {b"k0", b"k1", b"k2"}
    # and the odd record reached the service and the DLQ, its name as the repr of its bytes
    shown = ((NON_UTF8_SHOWN, b"v"), ("ok", b"1"))
    assert seen[b"k1"] == shown
    [dead] = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    assert dead.key() == b"k1"
    assert tuple(dlq_records.split_headers(dead.headers())[0]) == shown
