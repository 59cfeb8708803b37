"""Onboarding config: every bad file is rejected by ``consumer-proxy validate`` with exit 2 and
one line per problem naming the file and the field; good files and directories load.

Pure logic (no broker): each case runs the real CLI entry point in-process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from consumer_proxy.config import ProxyConfig, load_config
from consumer_proxy.errors import ConfigError
from tests.support.cli import Cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

BASE: dict[str, Any] = {
    "kafka": {"bootstrap_servers": "localhost:9092"},
    "groups": [
        {
            "name": "billing",
            "topics": ["trips.completed"],
            "service": {"endpoints": ["127.0.0.1:50051"]},
        }
    ],
}


def group(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that deep-merges ``changes`` into the first group."""

    def apply(config: dict[str, Any]) -> None:
        merge(config["groups"][0], changes)

    return apply


def merge(target: dict[str, Any], changes: dict[str, Any]) -> None:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = value


def top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: merge(config, changes)


def delete(*path: str | int) -> Callable[[dict[str, Any]], None]:
    def apply(config: dict[str, Any]) -> None:
        node: Any = config
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

    return apply


def second_group(name: str, topics: tuple[str, ...]) -> Callable[..., None]:
    def apply(config: dict[str, Any]) -> None:
        config["groups"].append(
            {"name": name, "topics": list(topics), "service": {"endpoints": ["127.0.0.1:1"]}}
        )

    return apply


G = "groups.0(billing)"

# (case id, mutation of BASE, field path the line must name, words the reason must contain)
BAD_CONFIGS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("kafka missing", delete("kafka"), "kafka", "required field is missing"),
    (
        "bootstrap not host:port",
        top(kafka={"bootstrap_servers": "localhost"}),
        "kafka.bootstrap_servers",
        "is not host:port",
    ),
    (
        "bootstrap port out of range",
        top(kafka={"bootstrap_servers": "a:9092,b:70000"}),
        "kafka.bootstrap_servers",
        "port 1-65535",
    ),
    (
        "client overrides group.id",
        top(kafka={"client": {"group.id": "mine"}}),
        "kafka.client",
        "set by the proxy",
    ),
    (
        "client property nested",
        top(kafka={"client": {"sasl": {"mechanism": "PLAIN"}}}),
        "kafka.client",
        "string, number or boolean",
    ),
    ("groups missing", delete("groups"), "groups", "required field is missing"),
    ("groups empty", top(groups=[]), "groups", "at least 1 item"),
    (
        "group name has a space",
        group(name="bad name"),
        "groups.0(bad name).name",
        "letters, digits",
    ),
    (
        "group name duplicated",
        second_group("billing", ("refunds",)),
        "groups.1(billing).name",
        "already used by groups.0",
    ),
    ("topics missing", delete("groups", 0, "topics"), f"{G}.topics", "required field"),
    ("topics empty", group(topics=[]), f"{G}.topics", "at least 1 item"),
    (
        "topic name invalid",
        group(topics=["trips completed"]),
        f"{G}.topics",
        "not a valid Kafka topic name",
    ),
    ("topic listed twice", group(topics=["a", "a"]), f"{G}.topics", "listed twice"),
    ("service missing", delete("groups", 0, "service"), f"{G}.service", "required field"),
    ("no endpoints", group(service={"endpoints": []}), f"{G}.service.endpoints", "at least 1 item"),
    (
        "endpoint without port",
        group(service={"endpoints": ["localhost"]}),
        f"{G}.service.endpoints",
        "is not an endpoint",
    ),
    (
        "endpoint port too big",
        group(service={"endpoints": ["10.0.0.1:65536"]}),
        f"{G}.service.endpoints",
        "port 1-65535",
    ),
    (
        "endpoint is a URL",
        group(service={"endpoints": ["http://svc:80/path"]}),
        f"{G}.service.endpoints",
        "is not an endpoint",
    ),
    (
        "dns target without address",
        group(service={"endpoints": ["dns:///"]}),
        f"{G}.service.endpoints",
        "no address",
    ),
    (
        "endpoint twice",
        group(service={"endpoints": ["a:1", "a:1"]}),
        f"{G}.service.endpoints",
        "listed twice",
    ),
    (
        "timeout zero",
        group(service={"timeout_ms": 0}),
        f"{G}.service.timeout_ms",
        "greater than or equal to 1",
    ),
    (
        "duration without unit",
        group(service={"timeout": 5}),
        f"{G}.service.timeout",
        "unknown field (did you mean 'timeout_ms'?)",
    ),
    (
        "tls cert without key",
        group(service={"tls": {"cert_file": __file__}}),
        f"{G}.service.tls",
        "cert_file and key_file go together",
    ),
    (
        "tls CA file missing",
        group(service={"tls": {"ca_file": "/nonexistent/ca.pem"}}),
        f"{G}.service.tls.ca_file",
        "not a readable file",
    ),
    (
        "concurrency word",
        group(delivery={"concurrency": "lots"}),
        f"{G}.delivery.concurrency",
        "from 1 to 10000, or 'adaptive'",
    ),
    (
        "concurrency zero",
        group(delivery={"concurrency": 0}),
        f"{G}.delivery.concurrency",
        "from 1 to 10000",
    ),
    (
        "adaptive bounds inverted",
        group(delivery={"adaptive": {"min": 50, "max": 10}}),
        f"{G}.delivery.adaptive",
        "min <= initial <= max",
    ),
    (
        "max_attempts zero",
        group(delivery={"max_attempts": 0}),
        f"{G}.delivery.max_attempts",
        "greater than or equal to 1",
    ),
    (
        "max_in_flight negative",
        group(delivery={"max_in_flight": -5}),
        f"{G}.delivery.max_in_flight",
        "greater than or equal to 1",
    ),
    (
        "backoff max below initial",
        group(delivery={"backoff": {"initial_ms": 500, "max_ms": 100}}),
        f"{G}.delivery.backoff",
        "max_ms (100) is below initial_ms (500)",
    ),
    (
        "backoff shrinking",
        group(delivery={"backoff": {"multiplier": 0.5}}),
        f"{G}.delivery.backoff.multiplier",
        "greater than or equal to 1",
    ),
    (
        "rate limit zero",
        group(delivery={"rate_limit_per_s": 0}),
        f"{G}.delivery.rate_limit_per_s",
        "greater than 0",
    ),
    (
        "status override unknown code",
        group(delivery={"status_overrides": {"TEAPOT": "ack"}}),
        f"{G}.delivery.status_overrides.TEAPOT",
        "not a gRPC status code; use one of",
    ),
    (
        "status override lower case",
        group(delivery={"status_overrides": {"unavailable": "drop"}}),
        f"{G}.delivery.status_overrides.unavailable",
        "did you mean 'UNAVAILABLE'?",
    ),
    (
        "status override of OK",
        group(delivery={"status_overrides": {"OK": "retry"}}),
        f"{G}.delivery.status_overrides.OK",
        "OK cannot be overridden",
    ),
    (
        "status override bad outcome",
        group(delivery={"status_overrides": {"UNAVAILABLE": "skip"}}),
        f"{G}.delivery.status_overrides.UNAVAILABLE",
        "'ack', 'retry', 'dead_letter', 'drop'",
    ),
    (
        "dlq topic is a source topic",
        group(dlq={"topic": "trips.completed"}),
        f"{G}.dlq.topic",
        "'trips.completed' is also a source topic",
    ),
    (
        "default dlq topic is a source topic",
        group(topics=["billing.dlq"]),
        f"{G}.dlq.topic",
        "(the default) is also a source topic",
    ),
    (
        "redrive topic is the dlq topic",
        group(dlq={"topic": "x", "redrive_topic": "x"}),
        f"{G}.dlq.redrive_topic",
        "must differ",
    ),
    (
        "dlq topic invalid",
        group(dlq={"topic": "dead letters"}),
        f"{G}.dlq.topic",
        "not a valid Kafka topic name",
    ),
    (
        "breaker threshold zero",
        group(circuit_breaker={"failure_threshold": 0}),
        f"{G}.circuit_breaker.failure_threshold",
        "greater than or equal to 1",
    ),
    (
        "breaker timeout negative",
        group(circuit_breaker={"reset_timeout_s": -1}),
        f"{G}.circuit_breaker.reset_timeout_s",
        "greater than 0",
    ),
    (
        "unknown key in a group",
        group(deadletter={"topic": "x"}),
        f"{G}.deadletter",
        "unknown field (did you mean 'dead_letter_guard'?); allowed here: name, topics, "
        "service, delivery, dlq, circuit_breaker, dead_letter_guard",
    ),
    ("unknown top-level key", top(kafak={"x": 1}), "kafak", "unknown field"),
    (
        "metrics port too big",
        top(metrics={"port": 70000}),
        "metrics.port",
        "less than or equal to 65535",
    ),
    (
        "health port clashes with metrics",
        top(metrics={"port": 9464}, health={"grpc_port": 9464}),
        "health.grpc_port",
        "also metrics.port",
    ),
    ("grace period not a number", top(shutdown_grace_s="soon"), "shutdown_grace_s", "valid number"),
    (
        "revoke grace beyond the poll interval",
        group(delivery={"revoke_grace_ms": 290_000}),
        f"{G}.delivery.revoke_grace_ms",
        "max.poll.interval.ms (300000 ms)",
    ),
    (
        # The consumer is not polled while the calls drain: past the poll interval librdkafka
        # leaves the group, and the drain's acks can no longer be committed
        "shutdown grace beyond the poll interval",
        top(shutdown_grace_s=600),
        "shutdown_grace_s",
        "max.poll.interval.ms (300000 ms)",
    ),
    ("group is not a mapping", top(groups=["billing"]), "groups.0", "valid dictionary"),
]


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [case[1:] for case in BAD_CONFIGS],
    ids=[case[0] for case in BAD_CONFIGS],
)
def test_a_bad_config_exits_2_naming_the_file_and_the_field(
    tmp_path: Path, cli: Cli, mutate: Callable[[dict[str, Any]], None], field: str, reason: str
) -> None:
    # Given a good config with one thing wrong
    config = copy.deepcopy(BASE)
    mutate(config)
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    # When it is validated
    code, out, err = cli("validate", "--config", str(path))

    # Then the exit code is 2 and one line names the file, the field and the reason
    assert code == 2, out
    lines = err.splitlines()
    assert lines and all(line.startswith(f"{path}: ") for line in lines), err
    matching = [line for line in lines if line.startswith(f"{path}: {field}: ")]
    assert matching, f"no line names {field!r}:\n{err}"
    assert any(reason in line for line in matching), f"{reason!r} not in:\n{err}"
    assert out == ""


def test_there_are_at_least_25_bad_config_cases() -> None:
    assert len({case[0] for case in BAD_CONFIGS}) == len(BAD_CONFIGS) >= 25


def test_every_problem_is_reported_on_its_own_line(tmp_path: Path, cli: Cli) -> None:
    # Given a group with three independent mistakes
    config = copy.deepcopy(BASE)
    group(
        service={"endpoints": ["nohost"], "timeout_ms": -1},
        delivery={"status_overrides": {"TEAPOT": "ack", "UNAVAILABLE": "skip"}},
    )(config)
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))

    code, _, err = cli("validate", "--config", str(path))

    assert code == 2
    fields = sorted(line.split(": ")[1] for line in err.splitlines())
    assert fields == [
        f"{G}.delivery.status_overrides.TEAPOT",
        f"{G}.delivery.status_overrides.UNAVAILABLE",
        f"{G}.service.endpoints",
        f"{G}.service.timeout_ms",
    ]


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("kafka:\n  bootstrap_servers: [localhost:9092\ngroups: []\n", 3, "YAML syntax error"),
        (
            "kafka: {bootstrap_servers: a:1}\ngroups:\n- name: x\n  topics: [t]\n\tservice: {}\n",
            5,
            "YAML syntax error",
        ),
        (
            "kafka: {bootstrap_servers: a:1}\nmetrics: {port: 1}\n"
            "kafka: {bootstrap_servers: b:1}\n",
            3,
            "key 'kafka' is given twice (first on line 1)",
        ),
    ],
    ids=["unclosed bracket", "tab indentation", "duplicate key"],
)
def test_a_yaml_error_names_the_line(
    tmp_path: Path, cli: Cli, text: str, line: int, what: str
) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(text)

    code, _, err = cli("validate", "--config", str(path))

    assert code == 2
    assert err.startswith(f"{path}: line {line}, column "), err
    assert what in err


def test_a_file_that_is_not_a_mapping_is_rejected(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("- kafka\n- groups\n")
    code, _, err = cli("validate", "--config", str(path))
    assert code == 2
    assert err.strip() == f"{path}: (top level): must be a mapping of settings, got list"


def test_a_missing_path_is_rejected(tmp_path: Path, cli: Cli) -> None:
    code, _, err = cli("validate", "--config", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert err.strip() == f"{tmp_path / 'nope.yaml'}: no such file or directory"


# -- good configurations ---------------------------------------------------------------------


@pytest.mark.parametrize("example", ["proxy.yaml", "conf.d"])
def test_the_examples_validate(cli: Cli, example: str) -> None:
    code, out, err = cli("validate", "--config", str(EXAMPLES / example))
    assert (code, err) == (0, "")
    assert out.startswith(f"{EXAMPLES / example}: OK")


def test_the_example_file_and_directory_describe_the_same_deployment() -> None:
    single = load_config(EXAMPLES / "proxy.yaml")
    directory = load_config(EXAMPLES / "conf.d")
    assert single.kafka == directory.kafka
    assert {g.name: g for g in single.groups} == {g.name: g for g in directory.groups}


def test_a_minimal_group_gets_defaults_a_team_can_run_with(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(BASE))

    config = load_config(path)

    billing = config.group("billing")
    assert billing.dlq_topic == "billing.dlq"
    assert billing.redrive_topic == "billing.redrive"
    assert billing.service.timeout_ms == 5000
    assert billing.delivery.max_attempts == 5
    assert (billing.delivery.backoff.initial_ms, billing.delivery.backoff.max_ms) == (100, 30000)
    assert billing.delivery.metadata_budget_bytes < 4096
    assert config.metrics.port == 9464
    assert config.health.grpc_port is None


def test_the_models_are_frozen_and_document_every_field() -> None:
    config = ProxyConfig(**BASE)
    with pytest.raises(pydantic.ValidationError):
        config.groups[0].delivery.max_attempts = 9

    def walk(model: type[pydantic.BaseModel], seen: set[type]) -> Iterator[tuple[str, Any]]:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            yield f"{model.__name__}.{name}", field
            for sub in _models_in(field.annotation):
                yield from walk(sub, seen)

    fields = dict(walk(ProxyConfig, set()))
    assert len(fields) > 40
    undocumented = [name for name, field in fields.items() if not field.description]
    assert undocumented == []
    durations = [
        name
        for name in fields
        if any(word in name for word in ("timeout", "interval", "grace", "delay"))
    ]
    assert durations and all(name.endswith(("_ms", "_s")) for name in durations)


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


# -- a directory of files --------------------------------------------------------------------


def _write(directory: Path, name: str, data: Any) -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(data))
    return path


def _service(name: str, topic: str) -> dict[str, Any]:
    return {"groups": [{"name": name, "topics": [topic], "service": {"endpoints": ["a:1"]}}]}


def test_a_directory_adds_the_groups_of_every_file(tmp_path: Path, cli: Cli) -> None:
    # Given the cluster in one file, one file per service and a file that is not YAML
    _write(tmp_path, "kafka.yaml", {"kafka": {"bootstrap_servers": "k:9092"}})
    _write(tmp_path, "billing.yaml", _service("billing", "trips"))
    _write(tmp_path, "refunds.yml", _service("refunds", "refund.requests"))
    (tmp_path / "README.md").write_text("not config")

    config = load_config(tmp_path)
    code, out, _ = cli("validate", "--config", str(tmp_path))

    assert [g.name for g in config.groups] == ["billing", "refunds"]
    assert config.kafka.bootstrap_servers == "k:9092"
    assert code == 0 and "2 groups" in out


def test_a_problem_in_a_directory_names_the_file_of_the_group(tmp_path: Path, cli: Cli) -> None:
    _write(tmp_path, "a-kafka.yaml", {"kafka": {"bootstrap_servers": "k:9092"}})
    _write(tmp_path, "billing.yaml", _service("billing", "trips"))
    refunds = _service("refunds", "refund.requests")
    refunds["groups"][0]["delivery"] = {"max_attempts": 0}
    bad = _write(tmp_path, "refunds.yaml", refunds)

    code, _, err = cli("validate", "--config", str(tmp_path))

    assert code == 2
    assert err.strip().startswith(f"{bad}: groups.1(refunds).delivery.max_attempts: ")


def test_a_group_name_used_in_two_files_names_both(tmp_path: Path, cli: Cli) -> None:
    _write(tmp_path, "kafka.yaml", {"kafka": {"bootstrap_servers": "k:9092"}})
    first = _write(tmp_path, "billing.yaml", _service("billing", "trips"))
    second = _write(tmp_path, "billing-v2.yaml", _service("billing", "trips.v2"))

    code, _, err = cli("validate", "--config", str(tmp_path))

    # billing-v2.yaml sorts first, so billing.yaml holds the duplicate
    assert code == 2
    assert err.startswith(f"{first}: groups.1(billing).name: group name 'billing' is already used")
    assert f"(groups.0 is in {second})" in err


def test_kafka_set_in_two_files_is_rejected(tmp_path: Path, cli: Cli) -> None:
    first = _write(tmp_path, "a.yaml", {"kafka": {"bootstrap_servers": "k:9092"}})
    second = _write(
        tmp_path, "b.yaml", {"kafka": {"bootstrap_servers": "k:9093"}, **_service("x", "t")}
    )

    code, _, err = cli("validate", "--config", str(tmp_path))

    assert code == 2
    assert err.strip() == (
        f"{second}: kafka: already set in {first}; set each top-level section in one file only"
    )


def test_every_broken_file_of_a_directory_is_reported(tmp_path: Path, cli: Cli) -> None:
    one = tmp_path / "one.yaml"
    one.write_text("kafka: {bootstrap_servers: k:1\n")
    two = tmp_path / "two.yaml"
    two.write_text("groups:\n  name: billing\n")

    code, _, err = cli("validate", "--config", str(tmp_path))

    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{one}: line 2, column 1: YAML syntax error")
    assert lines[1].startswith(f"{two}: groups: must be a list of groups")


def test_an_empty_directory_is_rejected(tmp_path: Path, cli: Cli) -> None:
    code, _, err = cli("validate", "--config", str(tmp_path))
    assert code == 2
    assert err.strip() == f"{tmp_path}: no .yaml or .yml files in this directory"


# -- environment overrides -------------------------------------------------------------------


def test_the_environment_overrides_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a file with a bootstrap address and a client property
    config = copy.deepcopy(BASE)
    config["kafka"]["client"] = {"security.protocol": "SSL"}
    path = _write(tmp_path, "proxy.yaml", config)

    # When the environment overrides the address and the metrics port
    monkeypatch.setenv("CONSUMER_PROXY_KAFKA__BOOTSTRAP_SERVERS", "broker-1:9093,broker-2:9093")
    monkeypatch.setenv("CONSUMER_PROXY_METRICS__PORT", "9999")
    loaded = load_config(path)

    # Then the overridden values win and the rest of the file stays
    assert loaded.kafka.bootstrap_servers == "broker-1:9093,broker-2:9093"
    assert loaded.kafka.client == {"security.protocol": "SSL"}
    assert loaded.metrics.port == 9999
    assert loaded.groups[0].name == "billing"


def test_a_bad_override_names_the_variable(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, "proxy.yaml", BASE)
    monkeypatch.setenv("CONSUMER_PROXY_KAFKA__BOOTSTRAP_SERVERS", "no-port")

    code, _, err = cli("validate", "--config", str(path))

    assert code == 2
    assert err.startswith(
        "environment variable CONSUMER_PROXY_KAFKA__BOOTSTRAP_SERVERS: "
        "kafka.bootstrap_servers: 'no-port' is not host:port"
    )


def test_an_override_that_is_not_json_is_a_config_error(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, "proxy.yaml", BASE)
    monkeypatch.setenv("CONSUMER_PROXY_KAFKA", "{not json")

    code, _, err = cli("validate", "--config", str(path))

    assert code == 2
    assert err.startswith("environment: ") and 'field "kafka"' in err


def test_load_config_raises_config_error_with_the_problems(tmp_path: Path) -> None:
    config = copy.deepcopy(BASE)
    group(delivery={"max_attempts": 0})(config)
    path = _write(tmp_path, "proxy.yaml", config)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems == [
        f"{path}: {G}.delivery.max_attempts: Input should be greater than or equal to 1 (got 0)"
    ]


def test_the_config_reference_in_the_docs_is_current() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "config_reference.py"),
            "--check",
            str(ROOT / "docs" / "operating.md"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("written", "mode"),
    [
        (None, "auto"),  # not written: the default
        ("batch: auto", "auto"),
        ("batch: off", None),  # YAML 1.1 reads off as false
        ("batch: 'off'", None),
        ("batch: null", None),
        ("batch: {}", "always"),  # a section, as before: batches always
        ("batch: {max_messages: 10}", "always"),
        ("batch: {mode: auto, max_messages: 10}", "auto"),
        ("batch: always", "always"),
    ],
)
def test_delivery_batch_is_auto_by_default_and_keeps_the_old_forms(
    tmp_path: Path, written: str | None, mode: str | None
) -> None:
    # Given a group whose delivery section says (or does not say) batch, as YAML reads it
    path = _with_delivery(tmp_path, written)
    # When it is loaded
    batch = load_config(path).groups[0].delivery.batch
    # Then the batch mode is as written, and auto has the section's limits
    assert (batch.mode if batch is not None else None) == mode
    if batch is not None and "max_messages" not in (written or ""):
        assert (batch.max_messages, batch.max_bytes, batch.linger_ms) == (100, 1024 * 1024, 0)


@pytest.mark.parametrize("written", ["batch: on", "batch: 'yes please'", "batch: 3"])
def test_a_bad_batch_form_is_refused(tmp_path: Path, written: str) -> None:
    with pytest.raises(ConfigError, match="batch"):
        load_config(_with_delivery(tmp_path, written))


def _with_delivery(tmp_path: Path, written: str | None) -> Path:
    config = copy.deepcopy(BASE)
    if written is not None:
        config["groups"][0]["delivery"] = yaml.safe_load(written)
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("written", ["batch: off", "batch: auto", "batch: {}"])
def test_a_dumped_config_loads_back_with_the_same_batch_mode(tmp_path: Path, written: str) -> None:
    # Given a loaded configuration, dumped as tools do (None values left out)
    config = load_config(_with_delivery(tmp_path, written))
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    # When it is loaded again, then "off" is still off (absent would mean auto)
    assert load_config(dumped).groups[0].delivery.batch == config.groups[0].delivery.batch


def test_head_block_within_a_long_calls_cap_is_refused(tmp_path: Path) -> None:
    # Given a long-running group with retry tiers whose head_block_ms is below the cap of a
    # long call: a call still heartbeating would be moved aside as a failed attempt and
    # pushed again from a tier while the first one runs
    group = {
        "name": "g",
        "topics": ["t"],
        "service": {"endpoints": ["127.0.0.1:1"]},
        "delivery": {
            "long_running": {"heartbeat_timeout_ms": 5000, "max_processing_ms": 600_000},
            "retry_topics": [{"delay_ms": 1000}],
            "head_block_ms": 60_000,
        },
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump({"kafka": {"bootstrap_servers": "k:9092"}, "groups": [group]}))
    # When it is loaded, Then it is refused naming the field and why
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [problem] = caught.value.problems
    assert f"{path}: groups.0(g).delivery.head_block_ms: 60000 ms is not above" in problem
    assert "max_processing_ms (600000 ms)" in problem
