"""Untrusted data stays data: producers' headers, services' reasons, operators' passwords.

Each test is named after the promise it checks and tries one kind of hostile input (the table
in docs/operating.md, "Security", lists them): user headers named like the proxy's, passwords
that JAAS quoting would mangle (read back by the Kafka client's own parser), and record values
or service reasons carrying terminal control sequences.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from consumer_proxy import dlq
from consumer_proxy.config import KafkaConfig
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.tools import spark as tool_spark
from tests.support.kafka import Broker, consume_all, create_topic, produce, run_script, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

# --------------------------------------------------------------------------- user cp- headers


@pytest.mark.kafka
async def test_user_headers_named_cp_arrive_at_the_service_and_in_the_dlq_copy(
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

    # Then the service saw the user's headers, cp-tenant included, in order, and none of the
    # forged ones
    assert not service.errors
    assert len(service.deliveries) == 2
    for delivery in service.deliveries:
        assert delivery.headers == (*user_headers, ("verdict", delivery.key))
        assert delivery.attempt == 1
    # and the DLQ copy keeps them, with the proxy's own cp-attempt and cp-reason only
    [dead] = await asyncio.to_thread(consume_all, bootstrap, dlq_topic)
    headers = dead.headers()
    assert isinstance(headers, list)
    user, ours = dlq.split_headers(headers)
    assert user == [*user_headers, ("verdict", b"poison")]
    assert [v for k, v in headers if k == dlq.H_ATTEMPT] == [b"1"]
    assert [v for k, v in headers if k == dlq.H_REASON] == [b"rejected"]
    assert ours[dlq.H_STATUS] == "INVALID_ARGUMENT"


def test_only_the_proxys_own_header_names_are_taken_out_of_a_record() -> None:
    # Given a record with every name the proxy owns and user names sharing its prefix
    user = [("cp-tenant", b"acme"), ("CP-Attempt", b"x"), ("cp-", b""), ("cp-originaltopic", b"y")]
    proxy_owned = [(name, b"1") for name in sorted(dlq.PROXY_HEADERS)]

    # When it is split
    got_user, got_ours = dlq.split_headers([*user, *proxy_owned])

    # Then the user's stay the user's, and only the proxy's names are the proxy's
    assert got_user == user
    assert set(got_ours) == dlq.PROXY_HEADERS


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
