"""The Helm chart (helm/consumer-proxy), its values schema, its dashboard, and the Dockerfile.

Helm comes from scripts/helm, which builds it with `go install` the first time and caches the
binary (minutes once, milliseconds after); a failed build fails these tests, it never skips
them. Rendered manifests are validated offline against the Kubernetes OpenAPI schemas shipped
by the kubernetes-validate package, in strict mode (unknown fields are errors), for the oldest
Kubernetes the chart supports and the newest the package knows. No Docker engine exists here,
so the Dockerfile is checked statically.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from consumer_proxy.config import GroupConfig, KafkaConfig, TracingConfig, load_config
from consumer_proxy.health import KafkaLink, ProxyHealth
from consumer_proxy.metrics import HttpEndpoint, ProxyMetrics
from tests.support.scrape import http_get

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "consumer-proxy"
EXAMPLE_VALUES = ROOT / "helm" / "values-example.yaml"
DASHBOARD = CHART / "dashboards" / "consumer-proxy.json"
# The chart's kubeVersion floor and the newest release kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.27.0", "1.37.0")
# Kinds that are not part of Kubernetes itself: their schemas come with their CRDs, which are
# not available offline. They are still rendered and checked for shape by the tests below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
RELEASE, NAMESPACE = "payments-proxy", "payments"
HELM_TIMEOUT_S = 120

# The first test to ask for helm may wait for its build (minutes on two cores, once); every
# helm call below has its own timeout, so a hang is still caught. ``slow``: left out of
# ``make test-fast``.
pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

Manifests = list[dict[str, Any]]


@dataclass(frozen=True)
class Helm:
    """The helm binary scripts/helm provides, with the chart's usual invocations."""

    binary: str

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, *args],
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
            cwd=ROOT,
        )

    def template(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)

    def render(self, *args: str) -> Manifests:
        """Render the chart; fail the test with helm's message if it does not render."""
        proc = self.template(*args)
        assert proc.returncode == 0, f"helm template {shlex.join(args)} failed:\n{proc.stderr}"
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="session")
def helm() -> Helm:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "helm")],
        capture_output=True,
        text=True,
        timeout=1700,
        check=False,
    )
    assert proc.returncode == 0, f"scripts/helm could not provide helm:\n{proc.stderr}"
    binary = proc.stdout.strip()
    assert os.access(binary, os.X_OK), f"scripts/helm printed {binary!r}, not an executable"
    return Helm(binary)


@pytest.fixture(scope="session")
def default_manifests(helm: Helm) -> Manifests:
    return helm.render()


@pytest.fixture(scope="session")
def example_manifests(helm: Helm) -> Manifests:
    return helm.render("-f", str(EXAMPLE_VALUES))


def one(manifests: Manifests, kind: str, name_suffix: str = "") -> dict[str, Any]:
    """The single manifest of a kind (whose name ends with name_suffix)."""
    found = [
        m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)
    ]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
    return found[0]


def proxy_config_text(manifests: Manifests) -> str:
    return str(one(manifests, "ConfigMap", "consumer-proxy")["data"]["proxy.yaml"])


def proxy_container(manifests: Manifests) -> dict[str, Any]:
    containers = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["proxy"]
    return dict(containers[0])


def checksum(manifests: Manifests) -> str:
    annotations = one(manifests, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    return str(annotations["checksum/config"])


def values_file(tmp_path: Path, values: dict[str, Any], name: str = "values.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return str(path)


def materialise_config(manifests: Manifests, root: Path) -> Path:
    """Write the rendered onboarding config where the proxy could read it, with its TLS files.

    The config names TLS files inside the pod's Secret mounts, and `validate` checks that they
    exist. Each named file must lie under a Secret volume the Deployment mounts; it is created
    (empty) under root, and the mount paths in the config are moved there.
    """
    text = proxy_config_text(manifests)
    data = yaml.safe_load(text)
    deployment = one(manifests, "Deployment")["spec"]["template"]["spec"]
    secret_volumes = {v["name"] for v in deployment.get("volumes", []) if "secret" in v}
    mounts = [
        m["mountPath"].rstrip("/") + "/"
        for m in proxy_container(manifests).get("volumeMounts", [])
        if m["name"] in secret_volumes
    ]
    files = [v for k, v in data["kafka"].get("client", {}).items() if k.endswith(".location")]
    for group in data["groups"]:
        tls = group["service"].get("tls") or {}
        files += [tls[k] for k in ("ca_file", "cert_file", "key_file") if tls.get(k)]
    for file in files:
        assert any(file.startswith(m) for m in mounts), f"{file} is in no Secret mount {mounts}"
        (root / file.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / file.lstrip("/")).touch()
    for mount in mounts:
        text = text.replace(mount, f"{root}{mount}")
    path = root / "proxy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# -- lint and render ----------------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["-f", str(EXAMPLE_VALUES)]], ids=["defaults", "example"])
def test_helm_lint_passes_in_strict_mode(helm: Helm, values: list[str]) -> None:
    # When the chart is linted with warnings treated as errors
    proc = helm.run("lint", str(CHART), "--strict", *values)

    # Then it passes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


FEATURES = [
    "--set",
    "autoscaling.enabled=true,workers=3,grpcHealth.port=9090,dashboard.enabled=true",
    "--set",
    "podDisruptionBudget.minAvailable=1,metrics.serviceMonitor.enabled=true",
]


@pytest.mark.parametrize(
    ("values", "kinds"),
    [
        ([], {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"}),
        (
            ["-f", str(EXAMPLE_VALUES)],
            {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"},
        ),
        (FEATURES, {"ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"}),
    ],
    ids=["defaults", "example", "every-option"],
)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(
    helm: Helm, values: list[str], kinds: set[str]
) -> None:
    # Given the chart rendered with a set of values
    manifests = helm.render("--kube-version", K8S_VERSIONS[-1], *values)
    assert kinds <= {m["kind"] for m in manifests}

    # When every manifest is validated strictly against each supported Kubernetes version
    validated = []
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRD_KINDS:
            # A CRD kind (ServiceMonitor): no schema offline. Its shape is checked by
            # test_probes_and_metrics_ports_follow_the_workers.
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{manifest['kind']} invalid for Kubernetes {version}: {path}: {exc}")
        validated.append(manifest["kind"])

    # Then all of them passed, and every kind but the CRDs was validated
    assert set(validated) == {m["kind"] for m in manifests} - {k for _, k in CRD_KINDS}


def test_kubernetes_schema_validation_catches_a_misspelt_field(
    default_manifests: Manifests,
) -> None:
    # Given the rendered Deployment with a field name Kubernetes does not know
    deployment = json.loads(json.dumps(one(default_manifests, "Deployment")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFileSystem"] = True

    # When it is validated strictly, then it is rejected: the validation above has teeth
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# -- the onboarding config ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("manifests_fixture", "groups"),
    [("default_manifests", ["example"]), ("example_manifests", ["billing", "refunds"])],
    ids=["defaults", "example"],
)
def test_rendered_onboarding_config_passes_consumer_proxy_validate(
    request: pytest.FixtureRequest, tmp_path: Path, manifests_fixture: str, groups: list[str]
) -> None:
    # Given the onboarding config from the rendered ConfigMap, written to a file
    manifests: Manifests = request.getfixturevalue(manifests_fixture)
    config = materialise_config(manifests, tmp_path)

    # When the proxy's own offline check reads it
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_PROXY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", "validate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )

    # Then it is accepted, with the groups of the values
    assert proc.returncode == 0, proc.stderr
    noun = "group" if len(groups) == 1 else "groups"
    assert f"OK ({len(groups)} {noun}: {', '.join(groups)})" in proc.stdout


def test_config_reaches_the_proxy_where_the_pod_reads_it(example_manifests: Manifests) -> None:
    # Given the rendered Deployment and ConfigMap
    deployment = one(example_manifests, "Deployment")["spec"]["template"]["spec"]
    container = proxy_container(example_manifests)
    args = container["args"]

    # Then the proxy runs with --config pointing into the ConfigMap's volume, with the workers
    config_path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in deployment["volumes"] if v["name"] == "config")
    assert args[0] == "run"
    assert config_path.parent == Path(mount["mountPath"])
    assert (
        volume["configMap"]["name"]
        == one(example_manifests, "ConfigMap", "proxy")["metadata"]["name"]
    )
    assert config_path.name in one(example_manifests, "ConfigMap", "proxy")["data"]
    assert args[args.index("--workers") + 1] == "2"


def test_consumer_proxy_validate_runs_before_the_proxy_and_in_helm_test(
    example_manifests: Manifests, tmp_path: Path
) -> None:
    # Given the example's Deployment and its helm test Pod
    pod = one(example_manifests, "Deployment")["spec"]["template"]["spec"]
    proxy = proxy_container(example_manifests)
    [init] = pod["initContainers"]
    test_pod = one(example_manifests, "Pod")
    [test] = test_pod["spec"]["containers"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["restartPolicy"] == "Never"
    assert {v["name"] for v in test_pod["spec"]["volumes"]} == {v["name"] for v in pod["volumes"]}

    # Then both run `consumer-proxy validate` on the proxy's config, in the proxy's image,
    # with its environment (the Secret's credentials) and its mounts (the TLS files)
    for check in (init, test):
        config = proxy["args"][proxy["args"].index("--config") + 1]
        assert check["args"] == ["validate", "--config", config]
        assert check["image"] == proxy["image"]
        assert check["env"] == proxy["env"]
        assert check["volumeMounts"] == proxy["volumeMounts"]
        assert check["securityContext"] == proxy["securityContext"]
        assert check["terminationMessagePolicy"] == "FallbackToLogsOnError"

    # When a TLS file the config names is missing from its Secret (only the pod can know)
    config_path = materialise_config(example_manifests, tmp_path)
    missing = next(tmp_path.rglob("tls.key"))
    missing.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_PROXY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", *init["args"][:2], str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )

    # Then the check fails (the pod stops in its init container) naming the field
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "groups.1(refunds).service.tls.key_file" in proc.stderr
    assert str(missing) in proc.stderr


def test_the_config_checks_can_be_switched_off(helm: Helm) -> None:
    manifests = helm.render(
        "--set", "validateConfig.initContainer=false,validateConfig.testHook=false"
    )
    assert "initContainers" not in one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert "Pod" not in {m["kind"] for m in manifests}


def test_kafka_credentials_come_from_the_secret_and_reach_kafka_client(
    example_manifests: Manifests, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the example values: SASL credentials in an existing Secret
    values = yaml.safe_load(EXAMPLE_VALUES.read_text(encoding="utf-8"))
    env = proxy_container(example_manifests)["env"]

    # Then no Secret object is rendered and no secret is written into the ConfigMap
    assert "Secret" not in {m["kind"] for m in example_manifests}
    assert "sasl.password" not in proxy_config_text(example_manifests)
    # and each secret property is an environment variable referencing the existing Secret
    by_name = {e["name"]: e for e in env}
    for prop, key in values["kafka"]["secretProperties"].items():
        entry = by_name[f"CONSUMER_PROXY_KAFKA__CLIENT__{prop}"]
        assert "value" not in entry
        assert entry["valueFrom"]["secretKeyRef"] == {
            "name": values["kafka"]["existingSecret"],
            "key": key,
        }

    # When the proxy loads the rendered config with those variables set as the kubelet would
    config_path = materialise_config(example_manifests, tmp_path)
    for name in by_name:
        if name.startswith("CONSUMER_PROXY_KAFKA__CLIENT__"):
            monkeypatch.setenv(name, f"from-secret:{name.rsplit('__', 1)[1]}")
    config = load_config(config_path)

    # Then the credentials land in kafka.client, beside the non-secret properties
    assert config.kafka.client["sasl.password"] == "from-secret:sasl.password"
    assert config.kafka.client["sasl.username"] == "from-secret:sasl.username"
    assert config.kafka.client["security.protocol"] == "SASL_SSL"


def test_the_admin_token_comes_from_an_existing_secret_and_reaches_the_proxy(
    helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the admin token in an existing Secret
    values = {"admin": {"existingSecret": "proxy-admin", "tokenKey": "admin-token"}}
    manifests = helm.render("-f", values_file(tmp_path, values))
    # Then the proxy's environment references it (never a value), and no Secret is rendered
    by_name = {e["name"]: e for e in proxy_container(manifests)["env"]}
    entry = by_name["CONSUMER_PROXY_ADMIN__TOKEN"]
    assert "value" not in entry
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "proxy-admin", "key": "admin-token"}
    assert "Secret" not in {m["kind"] for m in manifests}
    # and the proxy loads it as admin.token, as the kubelet would set it
    config_path = materialise_config(manifests, tmp_path)
    monkeypatch.setenv("CONSUMER_PROXY_ADMIN__TOKEN", "a-token-from-the-secret")
    token = load_config(config_path).admin.token
    assert token is not None and token.get_secret_value() == "a-token-from-the-secret"
    # Without a Secret there is no such variable (admin actions are off)
    default_env = proxy_container(helm.render()).get("env") or []
    assert "CONSUMER_PROXY_ADMIN__TOKEN" not in {e["name"] for e in default_env}


def test_tracing_values_reach_the_proxys_config_and_its_otel_environment(
    helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given tracing turned on in the values, with an OTEL_* variable for the container
    values = {
        "tracing": {
            "enabled": True,
            "endpoint": "http://otel-collector.observability:4317",
            "sample_ratio": 0.01,
            "env": {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"},
        }
    }
    manifests = helm.render("-f", values_file(tmp_path, values))
    # Then the container has the variable (a plain value) ...
    by_name = {e["name"]: e for e in proxy_container(manifests)["env"]}
    assert by_name["OTEL_RESOURCE_ATTRIBUTES"]["value"] == "deployment.environment=prod"
    # ... and the proxy loads the rendered config with tracing on, as the values say
    tracing = load_config(materialise_config(manifests, tmp_path)).tracing
    assert tracing.enabled
    assert tracing.endpoint == "http://otel-collector.observability:4317"
    assert tracing.sample_ratio == 0.01
    # By default tracing is off, and no OTEL_* variable is set
    defaults = helm.render()
    (tmp_path / "default").mkdir()
    assert not load_config(materialise_config(defaults, tmp_path / "default")).tracing.enabled
    default_env = proxy_container(defaults).get("env") or []
    assert not [e for e in default_env if e["name"].startswith("OTEL_")]


def test_tls_material_is_mounted_read_only_from_existing_secrets(
    example_manifests: Manifests,
) -> None:
    # Given the example's Kafka CA and a group's mTLS files in two Secrets
    spec = one(example_manifests, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in proxy_container(example_manifests)["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}

    # Then each is a read-only mount of the named Secret, readable by the pod's group only
    assert {n: s["secretName"] for n, s in secrets.items()} == {
        "kafka-ca": "kafka-ca",
        "refunds-mtls": "refunds-mtls",
    }
    for name, secret in secrets.items():
        assert mounts[name]["readOnly"] is True
        assert secret["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


# -- values schema --------------------------------------------------------------------------

GROUP = {"name": "billing", "topics": ["trips"], "service": {"endpoints": ["billing:50051"]}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicas": -1}, "at '/replicas': minimum: got -1, want 0"),
        ({"replicas": "two"}, "at '/replicas': got string, want integer"),
        ({"workers": 0}, "at '/workers': minimum: got 0, want 1"),
        (
            {"groups": [{"name": "billing", "topics": ["trips"], "service": {}}]},
            "at '/groups/0/service': missing property 'endpoints'",
        ),
        (
            {"groups": [{**GROUP, "service": {"endpoints": []}}]},
            "at '/groups/0/service/endpoints': minItems: got 0, want 1",
        ),
        ({"groups": []}, "at '/groups': minItems: got 0, want 1"),
        ({"groups": [{**GROUP, "topics": []}]}, "at '/groups/0/topics': minItems: got 0"),
        (
            {"groups": [{**GROUP, "delivery": {"concurency": 10}}]},
            "at '/groups/0/delivery': additional properties 'concurency' not allowed",
        ),
        ({"groups": [{**GROUP, "delivery": {"concurrency": 0}}]}, "/groups/0/delivery/concurrency"),
        ({"replica": 3}, "additional properties 'replica' not allowed"),
        ({"tracing": {"endpoint": "collector:4317"}}, "at '/tracing/endpoint'"),
        ({"tracing": {"sample_ratio": 2}}, "at '/tracing/sample_ratio': maximum"),
        (
            {"tracing": {"env": {"PATH": "/tmp"}}},  # (Helm misplaces a propertyNames path)
            "'PATH' does not match pattern '^OTEL_[A-Z0-9_]+$'",
        ),
        ({"kafka": {"bootstrap_servers": ""}}, "at '/kafka/bootstrap_servers': minLength"),
        ({"shutdown": {"graceSeconds": -5}}, "at '/shutdown/graceSeconds': minimum"),
        (
            {"shutdown": {"graceSeconds": 600}},
            "shutdown.graceSeconds (600) leaves less than 30000 ms of kafka.client "
            "max.poll.interval.ms (300000 ms)",
        ),
        (
            {"groups": [{**GROUP, "delivery": {"revoke_grace_ms": 290000}}]},
            "groups[0].delivery.revoke_grace_ms (290000) leaves less than 30000 ms",
        ),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
        (
            {"kafka": {"client": {"sasl.password": "hunter2"}}},
            "kafka.client.sasl.password holds a secret and would be written into the ConfigMap",
        ),
        (
            {"kafka": {"secretProperties": {"sasl.password": "password"}}},
            "kafka.secretProperties is set but kafka.existingSecret is empty",
        ),
        (
            {"workers": 2, "grpcHealth": {"port": 9465}},
            "grpcHealth.port 9465 clashes with the metrics ports 9464-9465",
        ),
        (
            {"secretMounts": [{"name": "x", "secretName": "x", "mountPath": "/tmp/x"}]},
            "overlaps the chart's own mounts",
        ),
        (
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
            "autoscaling.minReplicas (5) is above autoscaling.maxReplicas (2)",
        ),
        (
            {"workers": 3, "grpcHealth": {"port": 9462}},
            "grpcHealth.port 9462 clashes with the metrics ports 9464-9466",
        ),
        (
            {
                "metrics": {
                    "serviceMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "1m"}
                }
            },
            "metrics.serviceMonitor.scrapeTimeout (1m) is longer than "
            "metrics.serviceMonitor.interval (30s)",
        ),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_bad_values_fail_at_render_time_with_a_clear_message(
    helm: Helm, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    # When the chart is rendered (as helm install would) with a bad value
    proc = helm.template("-f", values_file(tmp_path, values))

    # Then it fails before anything is rendered, naming the value and what is wrong
    assert proc.returncode != 0, f"accepted {values}"
    assert message in proc.stderr
    assert proc.stdout == ""


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Follow $ref and drop the null branch of Optional, as pydantic writes them."""
    if "$ref" in node:
        return _resolve(defs[node["$ref"].rsplit("/", 1)[1]], defs)
    branches = [b for b in node.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) == 1:
        return _resolve(branches[0], defs)
    return node


def _compare(chart: dict[str, Any], model: dict[str, Any], defs: dict[str, Any], at: str) -> None:
    model = _resolve(model, defs)
    if "properties" not in model:
        for bound in ("minimum", "maximum", "exclusiveMinimum", "minItems"):
            if bound in model:
                assert chart.get(bound) == model[bound], f"{at}: {bound} differs from the model"
        return
    assert chart.get("additionalProperties") is False, f"{at}: unknown keys must be rejected"
    assert set(chart["properties"]) == set(model["properties"]), f"{at}: fields differ"
    assert set(chart.get("required", [])) == set(model.get("required", [])), f"{at}: required"
    for name, sub in model["properties"].items():
        _compare(chart["properties"][name], sub, defs, f"{at}.{name}")


def test_values_schema_mirrors_the_onboarding_models() -> None:
    # Given the chart's schema for a group and for kafka, and the proxy's pydantic models
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    group_model = _model_schema(GroupConfig)

    # Then they name the same fields, require the same ones and share every numeric bound,
    # so the schema rejects at install time what the proxy would reject at start-up
    _compare(schema["properties"]["groups"]["items"], group_model, group_model["$defs"], "group")
    kafka = schema["properties"]["kafka"]["properties"]
    assert set(KafkaConfig.model_fields) <= set(kafka)
    tracing_model = _model_schema(TracingConfig)
    chart_tracing = schema["properties"]["tracing"]
    chart_only = {
        "properties": {k: v for k, v in chart_tracing["properties"].items() if k != "env"}
    }
    _compare(
        {**chart_tracing, **chart_only}, tracing_model, tracing_model.get("$defs", {}), "tracing"
    )
    assert schema["properties"]["replicas"] == {
        "type": "integer",
        "description": schema["properties"]["replicas"]["description"],
        "minimum": 0,
    }


# -- pod behaviour --------------------------------------------------------------------------


def test_checksum_annotation_is_the_hash_of_the_config_and_follows_it(
    helm: Helm, tmp_path: Path, default_manifests: Manifests
) -> None:
    # Given the default render
    before = checksum(default_manifests)

    # Then the pods' checksum/config annotation is the hash of the rendered config
    config_text = proxy_config_text(default_manifests).removesuffix("\n")
    assert before == hashlib.sha256(config_text.encode()).hexdigest()

    # When a group changes, the hash changes (the pods roll)
    changed_group = helm.render(
        "-f", values_file(tmp_path, {"groups": [{**GROUP, "topics": ["trips", "rides"]}]})
    )
    assert checksum(changed_group) != before
    # and when the drain grace changes too, since the proxy reads it from the config
    assert checksum(helm.render("--set", "shutdown.graceSeconds=40")) != before
    # but scaling alone leaves the config and so the hash unchanged
    assert checksum(helm.render("--set", "replicas=7")) == before


def test_pod_runs_non_root_with_a_read_only_root_filesystem(default_manifests: Manifests) -> None:
    # Given the rendered pod spec
    pod = one(default_manifests, "Deployment")["spec"]["template"]["spec"]
    container = proxy_container(default_manifests)
    pod_sc, sc = pod["securityContext"], container["securityContext"]

    # Then the pod and the container run as a non-root user
    assert pod_sc["runAsNonRoot"] is True and sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] > 0 and sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # with a read-only root filesystem, no privilege escalation and no capabilities
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # and only /tmp writable, from an emptyDir
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    assert writable == ["/tmp"]
    # and no Kubernetes API token, which the proxy never uses
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("set_values", "grace_s"), [([], 25), (["--set-json", "shutdown.graceSeconds=90.5"], 90.5)]
)
def test_termination_grace_covers_the_proxy_drain(
    helm: Helm, set_values: list[str], grace_s: float
) -> None:
    # Given the chart rendered with a drain grace
    manifests = helm.render(*set_values)
    config = yaml.safe_load(proxy_config_text(manifests))
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    # Then the proxy drains for that long, and the kubelet waits that long plus the margin for
    # the final commit and leaving the group before it kills the pod
    assert config["shutdown_grace_s"] == grace_s
    assert pod["terminationGracePeriodSeconds"] > config["shutdown_grace_s"]
    margin = values["shutdown"]["terminationMarginSeconds"]
    assert pod["terminationGracePeriodSeconds"] == math.ceil(grace_s) + margin


def test_probes_and_metrics_ports_follow_the_workers(helm: Helm) -> None:
    # Given three workers per pod and a ServiceMonitor
    manifests = helm.render("--set", "workers=3,metrics.serviceMonitor.enabled=true")
    container = proxy_container(manifests)
    config = yaml.safe_load(proxy_config_text(manifests))
    port = config["metrics"]["port"]

    # Then worker i's metrics port (metrics.port + i) is declared, served and scraped
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": port, "metrics-1": port + 1, "metrics-2": port + 2}
    service = one(manifests, "Service", "-metrics")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert service["spec"]["publishNotReadyAddresses"] is True
    monitor = one(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == list(ports)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # and the probes ask worker 0 whether it is alive and ready
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz/pod", "port": "metrics"}


def test_every_worker_declares_its_grpc_health_port(helm: Helm) -> None:
    # Given three workers per pod serving gRPC health
    manifests = helm.render("--set", "workers=3,grpcHealth.port=9090")
    container = proxy_container(manifests)
    config = yaml.safe_load(proxy_config_text(manifests))

    # Then worker i's health port (grpcHealth.port + i, as `run --workers` binds it) is declared
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config["health"]["grpc_port"] == 9090
    assert {n: p for n, p in ports.items() if n.startswith("grpc-health")} == {
        "grpc-health": 9090,
        "grpc-health-1": 9091,
        "grpc-health-2": 9092,
    }
    assert len(set(ports.values())) == len(ports) == 6
    assert all(len(name) <= 15 for name in ports)  # an IANA_SVC_NAME


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035: Services
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize(
    "release",
    ["a", "r" * 42, "r" * 53, "7th-proxy", "pay.ments", "payments-consumer-proxy", "x" * 52 + "1"],
)
def test_object_names_fit_kubernetes_limits_for_every_release_name_helm_accepts(
    helm: Helm, release: str
) -> None:
    # Given a release name Helm accepts (53 characters at most, dots, a digit first)
    proc = helm.run(
        "template",
        release,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--set",
        "metrics.serviceMonitor.enabled=true,dashboard.enabled=true,autoscaling.enabled=true",
    )
    assert proc.returncode == 0, proc.stderr
    manifests = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]

    # Then every object's name is one Kubernetes accepts for its kind: a Service or a Pod an
    # RFC 1035 label (63 characters), everything else a DNS subdomain, and labels are valid
    assert {m["kind"] for m in manifests} >= {"Service", "Pod", "Deployment", "ServiceMonitor"}
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        if manifest["kind"] in {"Service", "Pod"}:
            assert len(name) <= 63 and DNS_LABEL.match(name), f"{manifest['kind']} {name!r}"
        else:
            assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), f"{manifest['kind']} {name!r}"
        for value in manifest["metadata"].get("labels", {}).values():
            assert len(value) <= 63 and LABEL_VALUE.match(value), f"label {value!r} of {name}"
    # and the metrics Service keeps its suffix
    assert one(manifests, "Service")["metadata"]["name"].endswith("-metrics")


def test_autoscaler_owns_the_replica_count_when_enabled(helm: Helm) -> None:
    # Given autoscaling on
    manifests = helm.render("--set", "autoscaling.enabled=true,replicas=5")
    deployment = one(manifests, "Deployment")
    hpa = one(manifests, "HorizontalPodAutoscaler")

    # Then the Deployment leaves replicas to the autoscaler, which targets it
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_disruption_budget_lets_not_ready_pods_be_evicted(default_manifests: Manifests) -> None:
    # Given the default PodDisruptionBudget
    pdb = one(default_manifests, "PodDisruptionBudget")["spec"]
    deployment = one(default_manifests, "Deployment")["spec"]

    # Then it covers the proxy's pods, and an outage (pods not ready) cannot block a drain
    assert pdb["selector"] == deployment["selector"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# -- dashboard ------------------------------------------------------------------------------


def _exported_metric_names() -> set[str]:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {
        family.name + suffix
        for family in ProxyMetrics().registry.collect()
        for suffix in suffixes[family.type]
    }


def _panel_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_dashboard_charts_the_proxy_metrics(helm: Helm, default_manifests: Manifests) -> None:
    # Given the chart with its dashboard enabled
    manifests = helm.render("--set", "dashboard.enabled=true")
    configmap = one(manifests, "ConfigMap", "-dashboard")
    dashboard = json.loads(configmap["data"]["consumer-proxy.json"])

    # Then the ConfigMap carries the dashboard file, labelled for the Grafana sidecar
    assert dashboard == json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    # with the panels the operators asked for
    titles = {title for title, _ in _panel_exprs(dashboard)}
    for wanted in (
        "Throughput by outcome",
        "Push latency",
        "Lag by group",
        "Uncommitted window",
        "Circuit breaker",
    ):
        assert wanted in titles
    # and every metric a panel queries is one the proxy exports
    exported = _exported_metric_names()
    queried = {
        name
        for _, expr in _panel_exprs(dashboard)
        for name in re.findall(r"\bconsumer_proxy_[a-z_]+\b", expr)
    }
    assert queried, "the dashboard queries no consumer_proxy metric"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    assert any("by (outcome)" in expr for _, expr in _panel_exprs(dashboard))
    # and it is off by default
    assert not [m for m in default_manifests if m["metadata"]["name"].endswith("-dashboard")]


# -- the image ------------------------------------------------------------------------------


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions (continuations joined), grouped by build stage."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    logical = re.sub(r"\\\n", " ", text)
    stages: list[list[tuple[str, str]]] = [[]]
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def _dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps path out of the build context (last match wins)."""
    ignored = False
    for raw in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/").removeprefix("**/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch(p, pattern) for p in prefixes) or fnmatch(parts[-1], pattern):
            ignored = not negate
    return ignored


def test_dockerfile_builds_a_slim_non_root_image_without_dev_tools() -> None:
    # Given the Dockerfile's stages
    header, *stages = _dockerfile_stages()
    final = stages[-1]
    everything = " ".join(rest for stage in stages for _, rest in stage).lower()

    # Then it is a multi-stage build on the slim Python 3.11 image
    assert len(stages) >= 2
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in header
    assert all(
        stage[0] in {("FROM", "${PYTHON_IMAGE}"), ("FROM", "${PYTHON_IMAGE} AS build")}
        for stage in stages
    )
    # whose final stage runs consumer-proxy as a fixed non-root UID (the chart's runAsUser)
    users = [rest for instruction, rest in final if instruction == "USER"]
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root UID"
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert int(uid) == values["securityContext"]["runAsUser"]
    assert ("ENTRYPOINT", '["consumer-proxy"]') in final
    # and it installs the package with the tracing extra only (OpenTelemetry, so tracing is
    # a matter of configuration): no dev tools, no PySpark, no Java
    installs = [rest for stage in stages for i, rest in stage if i == "RUN" and "pip" in rest]
    assert any(re.search(r"pip install [^&]*\.(\[tracing\])?\"?(\s|$)", rest) for rest in installs)
    assert not re.search(r"\.\[(?!tracing\])|\[dev|pipeline|pyspark", everything)
    for tool in ("openjdk", "default-jre", "java", "spark", "gcc", "build-essential", "maven"):
        assert tool not in everything, f"{tool} has no place in the image"


def test_dockerignore_sends_only_the_package_to_the_build() -> None:
    # Given the files the Dockerfile copies, and what must never reach a build context
    copied = [
        src
        for stage in _dockerfile_stages()
        for instruction, rest in stage
        if instruction == "COPY" and not rest.startswith("--from")
        for src in rest.split()[:-1]
    ]
    assert copied

    # Then .dockerignore keeps every copied source and drops the rest
    for src in copied:
        assert not _dockerignored(src.rstrip("/")), f"{src} is copied but ignored"
        assert (ROOT / src).exists()
    for path in (".venv", ".git", ".kafka", "tests", "helm", "bench", "consumer_proxy/__pycache__"):
        assert _dockerignored(path), f"{path} would be sent to the build context"


def test_cached_helm_needs_no_go_toolchain(helm: Helm) -> None:
    # Given helm already built (the fixture), when scripts/helm runs without any go command
    env = dict(os.environ, GO="/nonexistent/go", PATH="/usr/bin:/bin")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "helm")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )

    # Then it still answers, with the same cached binary, which is a v3 helm
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == helm.binary
    version = helm.run("version", "--short")
    assert version.stdout.startswith("v3."), version.stdout + version.stderr


def _group_whose_service_is_down(name: str, down: bool = True) -> SimpleNamespace:
    """A running group (consumer up, Kafka reachable) whose service fails (breaker open)."""
    started = asyncio.Event()
    started.set()
    state = "open" if down else "closed"
    return SimpleNamespace(
        name=name,
        started=started,
        breaker=SimpleNamespace(is_open=down, state=state),
        kafka_link=KafkaLink(),  # (not attached: Kafka's reachability not in question here)
        writer=None,
    )


async def test_another_teams_outage_does_not_freeze_rollouts(helm: Helm) -> None:
    # Given the chart's Deployment (one pod replaced at a time, maxUnavailable 0) and a proxy
    # whose pods, Kafka and group payments are fine while group refunds' service is down
    deployment = one(helm.render(), "Deployment")
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    probe = proxy_container([deployment])["readinessProbe"]["httpGet"]
    groups = [_group_whose_service_is_down("payments", down=False)]
    groups.append(_group_whose_service_is_down("refunds"))
    health = ProxyHealth(groups)
    http = HttpEndpoint(ProxyMetrics(), health.ready, "127.0.0.1", 0, pod_ready=health.pod_ready)
    await http.start()
    try:
        # When the kubelet asks the readiness probe's path, and a person asks /readyz
        probed = await http_get(http.port, probe["path"])
        asked = await http_get(http.port, "/readyz")
        health.shutting_down()
        stopping = await http_get(http.port, probe["path"])
    finally:
        await http.close()
    # Then the pod is Ready (an old pod can be replaced: the rollout goes on), while /readyz
    # still says which group's service fails; a pod shutting down is not Ready
    assert probed == (200, "pod ready\n")
    assert asked[0] == 503 and "refunds: circuit open" in asked[1]
    assert stopping == (503, "shutting down\n")


def test_init_container_refuses_a_kafka_tls_file_missing_from_its_secret(
    helm: Helm,
    tmp_path: Path,
) -> None:
    # Given the example values: Kafka's CA from the Secret kafka-ca, referenced by
    # kafka.client ssl.ca.location, and the init container that runs `consumer-proxy validate`
    manifests = helm.render("-f", str(EXAMPLE_VALUES))
    init = one(manifests, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    config_path = materialise_config(manifests, tmp_path)

    # When the Secret lacks the CA file the config names (say it was created with key ca.pem)
    missing = next(tmp_path.rglob("kafka/ca.crt"))
    missing.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_PROXY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "consumer_proxy", *init["args"][:2], str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )

    # Then the check fails, so the new pod stops in Init:Error naming the field
    # (docs/kubernetes.md: "What only the pod can know (a TLS file missing from its Secret ...)
    # is checked by consumer-proxy validate itself ... in an init container"); the proxy itself
    # would fail at start with librdkafka's "ssl.ca.location failed" and crash-loop instead
    assert proc.returncode == 2, f"validate exit {proc.returncode}: {proc.stdout}{proc.stderr}"
    assert "ssl.ca.location" in proc.stderr
