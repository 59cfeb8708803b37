"""The operator's surface: configs the proxy must refuse (exit 2, file, field and reason),
config errors that must not leak a secret or print a team's control characters, and CLI
paths that must end in a clear error rather than a traceback.

No broker, no Spark: each case runs the real CLI entry point in-process.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cli import Cli

NOWHERE = "127.0.0.1:1"
BASE: dict[str, Any] = {
    "kafka": {"bootstrap_servers": NOWHERE},
    "groups": [
        {
            "name": "billing",
            "topics": ["trips"],
            "service": {"endpoints": ["127.0.0.1:50051"]},
        }
    ],
}


def write(tmp_path: Path, config: dict[str, Any], name: str = "proxy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def with_group(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    config["groups"][0].update(changes)
    return config


def two_groups(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(BASE)
    config["groups"][0].update(first)
    config["groups"].append(
        {"name": "refunds", "topics": ["rides"], "service": {"endpoints": ["127.0.0.1:50052"]}}
        | second
    )
    return config


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.upper().startswith("CONSUMER_PROXY_"):
            monkeypatch.delenv(name)


# --- 1. topic roles that collide: dead letters re-consumed, redrive for two services ---------

TIER = {"retry_topics": [{"delay_ms": 1000}]}
COLLISIONS = [
    # The group consumes its own retry tiers (adapters.py): dead letters written to a tier
    # come straight back as retries (cp-due-at absent = due now), forever, and no DLQ keeps them.
    ("dlq topic is a retry tier", with_group(delivery=TIER, dlq={"topic": "billing.retry.1"})),
    (
        "redrive topic is a retry tier",
        with_group(delivery=TIER, dlq={"redrive_topic": "billing.retry.1"}),
    ),
    # DESIGN.md: the redrive topic is "consumed only by this group's proxy".
    (
        "two groups share a redrive topic",
        two_groups(
            {"dlq": {"redrive_topic": "shared.redrive"}},
            {"dlq": {"redrive_topic": "shared.redrive"}},
        ),
    ),
    (
        "a source topic is another group's redrive topic",
        two_groups({}, {"topics": ["rides", "billing.redrive"]}),
    ),
    # `dlq merge --group billing` would send refunds' dead letters to billing's service, and
    # `dlq purge --group billing --all` deletes refunds' dead letters.
    ("two groups share a DLQ topic", two_groups({}, {"dlq": {"topic": "billing.dlq"}})),
]


@pytest.mark.parametrize("config", [c[1] for c in COLLISIONS], ids=[c[0] for c in COLLISIONS])
def test_a_topic_used_in_two_roles_is_refused_with_exit_2(
    tmp_path: Path, cli: Cli, config: dict[str, Any]
) -> None:
    # Given a config where one topic plays two roles (DLQ, redrive, retry tier, source)
    path = write(tmp_path, config)

    # When it is validated
    code, out, err = cli("validate", "--config", str(path))

    # Then it is refused: exit 2, one line naming the file and a dlq/delivery field
    assert code == 2, out + err
    assert err.startswith(f"{path}: groups."), err


# --- 2. a misspelt or invalid librdkafka property passes validate --------------------------


@pytest.mark.parametrize(
    "client",
    [
        {"security.protocl": "SSL"},
        {"security.protocol": "SSL_PLAIN"},
        {"session.timeout.ms": "soon"},
    ],
    ids=["misspelt property", "bad enum value", "bad number"],
)
def test_a_kafka_client_property_librdkafka_refuses_fails_validate_with_exit_2(
    tmp_path: Path, cli: Cli, client: dict[str, Any]
) -> None:
    # Given kafka.client with a property librdkafka does not accept
    config = copy.deepcopy(BASE)
    config["kafka"]["client"] = client
    path = write(tmp_path, config)

    # When it is validated (the Helm chart's init container runs exactly this)
    code, out, err = cli("validate", "--config", str(path))

    # Then it is refused naming the file, the field and librdkafka's reason
    assert code == 2, f"validate accepted it: {out}"
    assert f"{path}: kafka.client" in err, err
    assert next(iter(client)) in err, err


def test_status_with_a_bad_kafka_client_property_exits_2_without_a_traceback(
    tmp_path: Path, cli: Cli
) -> None:
    # Given a config that validate accepted, with a misspelt librdkafka property
    config = copy.deepcopy(BASE)
    config["kafka"]["client"] = {"security.protocl": "SSL"}
    path = write(tmp_path, config)

    # When status runs on it
    code, out, err = cli("status", "--config", str(path))

    # Then it fails as bad config, not with librdkafka's KafkaException escaping main()
    assert code == 2, out + err


# --- 3. a secret is echoed by a config error ----------------------------------------------


def test_a_short_admin_token_is_refused_without_echoing_it(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an admin token one character too short, from the environment (a Kubernetes Secret)
    token = "s3cr3t-t0ken-15"
    monkeypatch.setenv("CONSUMER_PROXY_ADMIN__TOKEN", token)
    path = write(tmp_path, BASE)

    # When the config is validated (the init container's log, the pod's termination message)
    code, out, err = cli("validate", "--config", str(path))

    # Then it is refused naming the variable and the rule, but never the token itself
    assert code == 2, out + err
    assert "CONSUMER_PROXY_ADMIN__TOKEN: admin.token" in err, err
    assert token not in err, err


def test_guard_with_a_two_line_token_file_fails_clearly_without_echoing_the_token(
    tmp_path: Path, cli: Cli
) -> None:
    # Given a token file with a second line
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-t0ken-0123456789\nsecond line\n")
    path = write(tmp_path, BASE)

    # When guard release sends it
    with contextlib.suppress(SystemExit):
        result: Any = None
        try:
            result = cli(
                "guard", "release", "--config", str(path), "--group", "billing",
                "--url", "http://127.0.0.1:1", "--token-file", str(token_file),
            )  # fmt: skip
        except Exception as exc:
            pytest.fail(f"guard raised {exc!r}")

    # Then a clear error (exit 2), and the token is not printed
    code, out, err = result
    assert code == 2, out + err
    assert "s3cr3t" not in out + err


# --- 4. control characters of a config file reach the terminal ------------------------------


def test_a_config_error_escapes_control_characters_of_keys_and_group_names(
    tmp_path: Path, cli: Cli
) -> None:
    # Given a team's file whose unknown key and group name carry terminal escape sequences
    path = tmp_path / "evil.yaml"
    path.write_text(
        "kafka:\n"
        f"  bootstrap_servers: {NOWHERE}\n"
        '  "\\e]0;owned\\a\\e[2J": 1\n'
        "groups:\n"
        '  - name: "billing\\e[8m"\n'
        "    topics: [trips]\n"
        "    bogus: 1\n"
        "    service: {endpoints: ['127.0.0.1:50051']}\n",
        encoding="utf-8",
    )

    # When it is validated
    code, out, err = cli("validate", "--config", str(path))

    # Then it is refused, and no control character is printed as is
    assert code == 2, out + err
    assert "\x1b" not in err and "\x07" not in err, repr(err)
    assert "unknown field" in err


# --- 5. dlq report: a bad --out is found only after the whole Spark job, as a traceback ----


def test_dlq_report_refuses_an_out_that_is_a_file_before_running_the_job(
    tmp_path: Path, cli: Cli
) -> None:
    # Given --out naming an existing file
    path = write(tmp_path, BASE)
    out_file = tmp_path / "report.txt"
    out_file.write_text("not a directory")

    # When dlq report runs (against no broker: the job, were it started, would fail to reach
    # it, exit 1)
    code, out, err = cli(
        "dlq", "report", "--config", str(path), "--group", "billing", "--out", str(out_file)
    )

    # Then it is refused as a usage error naming --out, before Kafka or Spark is asked
    assert code == 2, out + err
    assert "--out" in err and "not a directory" in err


# --- 6. a prompt answered with Ctrl-D; a --proxy that is not a console ----------------------


def test_ctrl_d_at_a_confirmation_prompt_is_no(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer_proxy.tools import commands

    # Given an operator who answers a merge's or purge's [y/N] with Ctrl-D (end of input)
    def ctrl_d(prompt: str) -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", ctrl_d)
    # When asked, Then it is no (nothing is merged or deleted), not a traceback
    assert commands._confirm("Delete 10 dead letters?") is False


def test_status_proxy_answering_what_no_console_answers_is_a_clear_error() -> None:
    import http.server
    import threading

    from consumer_proxy.errors import ConsumerProxyError
    from consumer_proxy.status import add_open_calls

    # Given an address that answers JSON, but not a console's (a list)
    class Lists(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"[1, 2]")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lists)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    report = {"groups": [{"group": "billing", "partitions": [{"topic": "t", "partition": 0}]}]}
    try:
        # When status --proxy reads it, Then a clear error names the address (exit 1)
        with pytest.raises(ConsumerProxyError, match="did not answer as a consumer-proxy console"):
            add_open_calls(report, f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
