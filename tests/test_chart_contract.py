"""The chart refuses what the proxy refuses: one source of truth for the onboarding config.

Every value below was once accepted by `helm install` and then refused by the proxy at
start-up, so the pods crash-looped. Each is rendered here with `helm template` and with
`helm install --dry-run=client` (the same schema validation and template checks as a real
install, without a cluster) and must be refused with a message naming the field; the same
config given straight to the proxy must be refused by `consumer-proxy validate` too, so the
two stay in step. The good values must render and pass `consumer-proxy validate`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from consumer_proxy.config import (
    GroupConfig,
    KafkaConfig,
    TracingConfig,
    check_endpoint,
    load_config,
)
from consumer_proxy.errors import ConfigError
from tests.support.kube_api import discovery_only_api

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "consumer-proxy"
EXAMPLE_VALUES = ROOT / "helm" / "values-example.yaml"
RELEASE, NAMESPACE = "payments-proxy", "payments"
HELM_TIMEOUT_S = 120

# The first test to ask for helm may wait for its build (minutes on two cores, once).
pytestmark = pytest.mark.timeout(1800)

GROUP: dict[str, Any] = {
    "name": "billing",
    "topics": ["trips"],
    "service": {"endpoints": ["billing:50051"]},
}

OTHER: dict[str, Any] = {
    "name": "refunds",
    "topics": ["rides"],
    "service": {"endpoints": ["refunds:50051"]},
}
TIER = [{"delay_ms": 1000}]
LONG = {"heartbeat_timeout_ms": 5000, "max_processing_ms": 30_000}


def group(**changes: Any) -> dict[str, Any]:
    """Values with one group: GROUP with ``changes`` merged in (one level deep)."""
    merged = copy.deepcopy(GROUP)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return {"groups": [merged]}


@dataclass(frozen=True)
class Bad:
    """A value the proxy refuses: the values, the field helm must name, the proxy's field."""

    values: dict[str, Any]
    helm_field: str
    proxy_field: str | None = None  # None: refused by `run --workers`, not by `validate`
    tls_files: list[str] = field(default_factory=list)


BAD: dict[str, Bad] = {
    "endpoint-without-port": Bad(
        group(service={"endpoints": ["svc"]}),
        "/groups/0/service/endpoints/0",
        "groups.0(billing).service.endpoints",
    ),
    "endpoint-port-out-of-range": Bad(
        group(service={"endpoints": ["svc:99999"]}),
        "/groups/0/service/endpoints/0",
        "groups.0(billing).service.endpoints",
    ),
    "dns-target-without-name": Bad(
        group(service={"endpoints": ["dns:///"]}),
        "/groups/0/service/endpoints/0",
        "groups.0(billing).service.endpoints",
    ),
    "bootstrap-without-port": Bad(
        {"kafka": {"bootstrap_servers": "kafka"}},
        "/kafka/bootstrap_servers",
        "kafka.bootstrap_servers",
    ),
    "client-sets-group-id": Bad(
        {"kafka": {"client": {"group.id": "mine"}}}, "kafka.client.group.id", "kafka.client"
    ),
    "client-sets-auto-commit": Bad(
        {"kafka": {"client": {"enable.auto.commit": True}}},
        "kafka.client.enable.auto.commit",
        "kafka.client",
    ),
    "duplicate-group-name": Bad(
        {"groups": [GROUP, {**GROUP, "topics": ["rides"]}]},
        "groups[1].name",
        "groups.1(billing).name",
    ),
    "topic-dot": Bad(group(topics=["."]), "/groups/0/topics/0", "groups.0(billing).topics"),
    "group-name-dot-dot": Bad(group(name=".."), "/groups/0/name", "groups.0(..).name"),
    "backoff-max-below-initial": Bad(
        group(delivery={"backoff": {"initial_ms": 500, "max_ms": 100}}),
        "groups[0].delivery.backoff.max_ms",
        "groups.0(billing).delivery.backoff",
    ),
    "adaptive-min-above-max": Bad(
        group(delivery={"concurrency": "adaptive", "adaptive": {"min": 50, "max": 10}}),
        "groups[0].delivery.adaptive",
        "groups.0(billing).delivery.adaptive",
    ),
    "dlq-topic-is-a-source": Bad(
        group(topics=["trips", "trips.dead"], dlq={"topic": "trips.dead"}),
        "groups[0].dlq.topic",
        "groups.0(billing).dlq.topic",
    ),
    "default-dlq-topic-is-a-source": Bad(
        group(topics=["trips", "billing.dlq"]),
        "groups[0].dlq.topic",
        "groups.0(billing).dlq.topic",
    ),
    "dlq-topic-is-the-redrive-topic": Bad(
        group(dlq={"topic": "billing.again", "redrive_topic": "billing.again"}),
        "groups[0].dlq.redrive_topic",
        "groups.0(billing).dlq.redrive_topic",
    ),
    "retry-tiers-with-key-ordering": Bad(
        group(delivery={"ordering": "key", "retry_topics": TIER}),
        "groups[0].delivery.retry_topics",
        "groups.0(billing).delivery",
    ),
    "head-block-without-retry-tiers": Bad(
        group(delivery={"head_block_ms": 1000}),
        "groups[0].delivery.head_block_ms",
        "groups.0(billing).delivery",
    ),
    "long-running-cap-below-heartbeat-timeout": Bad(
        group(delivery={"long_running": {"heartbeat_timeout_ms": 5000, "max_processing_ms": 4000}}),
        "groups[0].delivery.long_running",
        "groups.0(billing).delivery.long_running",
    ),
    "long-running-with-a-batch-section": Bad(
        group(delivery={"long_running": LONG, "batch": {"max_messages": 10}}),
        "groups[0].delivery.long_running",
        "groups.0(billing).delivery",
    ),
    "revoke-grace-past-long-running-cap": Bad(
        group(delivery={"long_running": LONG, "revoke_grace_ms": 60_000}),
        "groups[0].delivery.revoke_grace_ms",
        "groups.0(billing).delivery",
    ),
    "head-block-within-long-running-cap": Bad(
        group(delivery={"long_running": LONG, "retry_topics": TIER, "head_block_ms": 30_000}),
        "groups[0].delivery.head_block_ms",
        "groups.0(billing).delivery.head_block_ms",
    ),
    "dlq-topic-is-a-retry-tier": Bad(
        group(delivery={"retry_topics": TIER}, dlq={"topic": "billing.retry.1"}),
        "groups[0].dlq.topic",
        "groups.0(billing).dlq.topic",
    ),
    "redrive-topic-is-a-retry-tier": Bad(
        group(delivery={"retry_topics": TIER}, dlq={"redrive_topic": "billing.retry.1"}),
        "groups[0].dlq.redrive_topic",
        "groups.0(billing).dlq.redrive_topic",
    ),
    "retry-tier-is-a-source": Bad(
        group(topics=["trips", "billing.retry.1"], delivery={"retry_topics": TIER}),
        "groups[0].delivery.retry_topics",
        "groups.0(billing).delivery.retry_topics",
    ),
    "two-groups-share-a-redrive-topic": Bad(
        {
            "groups": [
                {**GROUP, "dlq": {"redrive_topic": "shared.redrive"}},
                {**OTHER, "dlq": {"redrive_topic": "shared.redrive"}},
            ]
        },
        "groups[1].dlq.redrive_topic",
        "groups.1(refunds).dlq.redrive_topic",
    ),
    "two-groups-share-a-dlq-topic": Bad(
        {"groups": [GROUP, {**OTHER, "dlq": {"topic": "billing.dlq"}}]},
        "groups[1].dlq.topic",
        "groups.1(refunds).dlq.topic",
    ),
    "a-source-is-another-groups-redrive-topic": Bad(
        {"groups": [GROUP, {**OTHER, "topics": ["rides", "billing.redrive"]}]},
        "groups[1].topics",
        "groups.1(refunds).topics",
    ),
    "tls-cert-without-key": Bad(
        group(service={"endpoints": ["billing:50051"], "tls": {"cert_file": "/tls/tls.crt"}}),
        "groups[0].service.tls",
        "groups.0(billing).service.tls",
        tls_files=["/tls/tls.crt"],
    ),
    "grpc-health-overlaps-worker-metrics": Bad(
        {"workers": 2, "grpcHealth": {"port": 9463}}, "grpcHealth.port"
    ),
}


@dataclass(frozen=True)
class Helm:
    """The helm binary, run against a discovery-only API server (no cluster exists here)."""

    binary: str
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, *args],
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
            cwd=ROOT,
            env={**os.environ, **self.env},
        )

    def deploy(self, how: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`helm template`, or `helm install --dry-run=client` (the real install path)."""
        verb = (
            ["template"]
            if how == "template"
            else ["install", "--dry-run=client", "--disable-openapi-validation"]
        )
        return self.run(*verb, RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "helm")],
        capture_output=True,
        text=True,
        timeout=1700,
        check=False,
    )
    assert proc.returncode == 0, f"scripts/helm could not provide helm:\n{proc.stderr}"
    with discovery_only_api(tmp_path_factory.mktemp("kube")) as env:
        yield Helm(proc.stdout.strip(), env)


def write_values(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return str(path)


def proxy_config(values: dict[str, Any], root: Path) -> dict[str, Any]:
    """The onboarding config the proxy would read for these values (chart defaults under)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    kafka = {**defaults["kafka"], **values.get("kafka", {})}
    groups = copy.deepcopy(values.get("groups", defaults["groups"]))
    for item in groups:
        tls = item["service"].get("tls") or {}
        for key, path in tls.items():  # TLS files exist in the pod (secretMounts): here too
            tls[key] = str(root / path.lstrip("/"))
    return {
        "kafka": {k: kafka[k] for k in ("bootstrap_servers", "client") if k in kafka},
        "groups": groups,
    }


@pytest.mark.parametrize("how", ["template", "install"])
@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_values_the_proxy_refuses_are_refused_at_install_naming_the_field(
    helm: Helm, tmp_path: Path, case: Bad, how: str
) -> None:
    # Given values that the proxy would refuse at start-up
    values = write_values(tmp_path, case.values)

    # When the chart is rendered or installed (client-side dry run: no cluster here)
    proc = helm.deploy(how, "-f", values)

    # Then helm refuses, renders nothing, and names the field
    assert proc.returncode != 0, f"helm {how} accepted {case.values}"
    assert proc.stdout == ""
    assert case.helm_field in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "case",
    [c for c in BAD.values() if c.proxy_field],
    ids=[k for k, c in BAD.items() if c.proxy_field],
)
def test_the_proxy_refuses_the_same_values(
    tmp_path: Path, case: Bad, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the config the chart would have rendered (TLS files present, as in the pod)
    for name in list(os.environ):
        if name.startswith("CONSUMER_PROXY_"):
            monkeypatch.delenv(name)
    for file in case.tls_files:
        (tmp_path / file.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file.lstrip("/")).touch()
    path = tmp_path / "proxy.yaml"
    # (through JSON: values that share a dict would be dumped as YAML anchors, which
    # onboarding files refuse)
    plain = json.loads(json.dumps(proxy_config(case.values, tmp_path)))
    path.write_text(yaml.safe_dump(plain), encoding="utf-8")

    # When the proxy validates it, then it is refused naming the same field
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert any(f": {case.proxy_field}" in line for line in caught.value.problems), (
        caught.value.problems
    )


def _rendered_config(stdout: str) -> str:
    for doc in yaml.safe_load_all(stdout):
        if doc and doc["kind"] == "ConfigMap" and "proxy.yaml" in doc.get("data", {}):
            return str(doc["data"]["proxy.yaml"])
    raise AssertionError("no ConfigMap with proxy.yaml was rendered")


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE_VALUES)]], ids=["defaults", "example"])
def test_good_values_install_and_pass_consumer_proxy_validate(
    helm: Helm, tmp_path: Path, values: list[str]
) -> None:
    # Given the default and the example values, installed (client-side dry run)
    proc = helm.deploy("install", *values)
    assert proc.returncode == 0, proc.stderr

    # When the rendered config is validated by the proxy (TLS files where the pod mounts them)
    text = _rendered_config(proc.stdout.split("\nMANIFEST:\n", 1)[-1].split("\nNOTES:\n")[0])
    for file in re.findall(r"/etc/consumer-proxy/tls/\S+", text):
        (tmp_path / file.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file.lstrip("/")).touch()
    text = text.replace("/etc/consumer-proxy/tls/", f"{tmp_path}/etc/consumer-proxy/tls/")
    config = tmp_path / "proxy.yaml"
    config.write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_PROXY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", "validate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )

    # Then the proxy accepts it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK (" in proc.stdout


# -- the generated schema agrees with the validators it was generated from -----------------


def _chart_schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text(encoding="utf-8")))


def _schema_accepts(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft7Validator(schema).is_valid(value)


def _validator_accepts(check: Callable[[str], object], value: str) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


def _endpoint_samples() -> list[str]:
    ports = [str(n) for n in range(70_000)] + [f"{n:05d}" for n in range(0, 70_000, 7)]
    ports += ["000000", "0065535", "123456", "", "-1"]
    hosts = ["svc", "svc.ns.svc.cluster.local", "10.0.0.1", "[::1]", "[fe80::1%eth0]", "a b"]
    schemes = [
        f"{scheme}:{rest}"
        for scheme in ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "http")
        for rest in ("", "/", "///", "///svc:50051", "svc", "/tmp/s.sock", "//x/")
    ]
    return [f"svc:{p}" for p in ports] + [f"{h}:50051" for h in hosts] + hosts + schemes


def _bootstrap(value: str) -> object:
    return KafkaConfig(bootstrap_servers=value)


def test_endpoint_and_bootstrap_patterns_accept_exactly_what_the_proxy_accepts() -> None:
    # Given the generated schema of an endpoint and of bootstrap_servers
    schema = _chart_schema()
    endpoint = schema["properties"]["groups"]["items"]["properties"]["service"]["properties"][
        "endpoints"
    ]["items"]
    bootstrap = schema["properties"]["kafka"]["properties"]["bootstrap_servers"]

    # Then for every port 0-69999 and a spread of hosts and schemes, the schema and the
    # proxy's own validators agree on every endpoint
    samples = _endpoint_samples()
    differ = [
        s for s in samples if _schema_accepts(endpoint, s) != _validator_accepts(check_endpoint, s)
    ]
    assert not differ, differ[:20]
    assert sum(_schema_accepts(endpoint, s) for s in samples) > 60_000  # not all refused
    # and on bootstrap server lists
    servers = [
        "kafka:9092",
        "kafka",
        "kafka:0",
        "kafka:99999",
        "a:1,b:2",
        " a:1 , b:2 ",
        "a:1,",
        ",a:1",
        "SASL_SSL://a:9093,PLAINTEXT://b:9092",
        "://a:1",
        "a:1,b",
        "[::1]:9092",
        "",
    ]
    differ = [
        s for s in servers if _schema_accepts(bootstrap, s) != _validator_accepts(_bootstrap, s)
    ]
    assert not differ, differ


def test_topic_and_group_name_rules_match_the_proxy() -> None:
    # Given the generated schemas of a topic, a DLQ topic and a group name
    group = _chart_schema()["properties"]["groups"]["items"]
    topic = group["properties"]["topics"]["items"]
    dlq_topic = group["properties"]["dlq"]["properties"]["topic"]
    name = group["properties"]["name"]
    base = {"topics": ["t"], "service": {"endpoints": ["h:1"]}}

    # Then each agrees with the proxy's model on every sample
    samples = [".", "..", "...", "a", "a.b", "_-.", "a b", "ü", "x" * 200, "x" * 241, "x" * 250, ""]
    for sample in samples:
        as_topic = _validator_accepts(
            lambda s: GroupConfig(name="g", topics=[s], service={"endpoints": ["h:1"]}),
            sample,
        )
        assert _schema_accepts(topic, sample) == as_topic, sample
        assert _schema_accepts(dlq_topic, sample) == as_topic, sample
        as_name = _validator_accepts(lambda s: GroupConfig(name=s, **base), sample)
        assert _schema_accepts(name, sample) == as_name, sample
    assert _schema_accepts(dlq_topic, None)


def _nullable_fields(model: dict[str, Any], defs: dict[str, Any], at: str) -> Iterator[str]:
    """The dotted paths of a model's fields that accept None (Optional), nested models too."""
    if "$ref" in model:
        model = defs[model["$ref"].rsplit("/", 1)[1]]
    for name, sub in model.get("properties", {}).items():
        branches = sub.get("anyOf", [])
        if {"type": "null"} in branches:
            yield f"{at}.{name}"
        for inner in [sub, *branches]:
            if "$ref" in inner:
                yield from _nullable_fields(inner, defs, f"{at}.{name}")


def _chart_node(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for name in path.split(".")[1:]:
        node = node["properties"][name]
    return node


@pytest.mark.parametrize(
    ("root", "model"), [("groups", GroupConfig), ("tracing", TracingConfig)], ids=str
)
def test_a_field_the_proxy_lets_be_null_may_be_null_in_the_values(
    root: str, model: type[BaseModel]
) -> None:
    # Given each field of the proxy's model that accepts None (an explicit `field: null` in
    # a values file, as a user writes to unset a chart default)
    schema = _chart_schema()["properties"][root]
    schema = schema["items"] if root == "groups" else schema
    model_schema = model.model_json_schema()
    paths = list(_nullable_fields(model_schema, model_schema.get("$defs", {}), root))
    assert len(paths) >= 2, paths

    # Then the chart's schema accepts null there too (an enum of choices lists null as one)
    refused = [p for p in paths if not _schema_accepts(_chart_node(schema, p), None)]
    assert not refused, f"the chart refuses null where the proxy accepts it: {refused}"


def _random_group(rng: random.Random, name: str) -> dict[str, Any]:
    """A group whose cross-field rules hold or not (about half of the time), from small pools."""
    clash = rng.random() < 0.2  # a default DLQ or redrive topic among the sources
    pool = ["trips", "other", "rides"] + ([f"{name}.dlq", f"{name}.redrive"] if clash else [])
    group: dict[str, Any] = {
        "name": name,
        "topics": rng.sample(pool, k=2),
        "service": {"endpoints": [rng.choice(["svc:1", "dns:///svc:50051", "[::1]:9"])]},
        "delivery": {},
        "dlq": {},
    }

    def bounds(keys: list[str], pool: list[int]) -> dict[str, int]:
        # Ordered as the proxy wants them, shuffled now and then; some left to the defaults.
        chosen = sorted(rng.sample(pool, k=len(keys)))
        if rng.random() < 0.25:
            rng.shuffle(chosen)
        return {k: v for k, v in zip(keys, chosen, strict=True) if rng.random() < 0.7}

    if rng.random() < 0.5:
        group["delivery"]["backoff"] = bounds(["initial_ms", "max_ms"], [50, 100, 30_000, 40_000])
    if rng.random() < 0.5:
        group["delivery"]["adaptive"] = bounds(["min", "initial", "max"], [1, 10, 20, 500, 600])
    for key in ("topic", "redrive_topic"):
        if rng.random() < 0.3:
            group["dlq"][key] = rng.choice(
                [None, "trips", "elsewhere", "again", f"{name}.dlq", f"{name}.redrive"]
            )
    if rng.random() < 0.3:
        group["service"]["tls"] = {
            k: f"/etc/consumer-proxy/tls/{k}"
            for k in rng.sample(["ca_file", "cert_file", "key_file"], k=rng.randint(0, 3))
        }
    return group


@pytest.mark.parametrize("seed", range(40))
def test_chart_and_proxy_agree_on_random_groups(helm: Helm, tmp_path: Path, seed: int) -> None:
    # Given values with one or two random groups (seeded: a failure replays with its seed)
    rng = random.Random(seed)
    names = rng.choice([["billing"], ["billing", "refunds"], ["billing"], ["billing", "billing"]])
    values = {"groups": [_random_group(rng, name) for name in names]}

    # When the chart renders them and the proxy validates the same config
    proc = helm.deploy("template", "-f", write_values(tmp_path, values), "--skip-tests")
    config = proxy_config(values, tmp_path)
    for group in config["groups"]:
        for path in (group["service"].get("tls") or {}).values():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).touch()
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    try:
        load_config(path)
        proxy_accepts, problems = True, []
    except ConfigError as exc:
        proxy_accepts, problems = False, exc.problems

    # Then both accept, or both refuse
    assert (proc.returncode == 0) == proxy_accepts, (values, proc.stderr, problems)
