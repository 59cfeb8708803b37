#!/usr/bin/env python3
"""Generate the chart's `kafka`, `tracing` and `groups` value schemas from the proxy's pydantic
models.

    python scripts/gen_values_schema.py          # rewrite the generated parts
    python scripts/gen_values_schema.py --check  # exit 1 if they are stale

The proxy's models (consumer_proxy/config.py) are the one source of truth for the onboarding
config. This script writes two files of the chart from them:

- helm/consumer-proxy/values.schema.json: `properties.kafka`, `properties.tracing` and
  `properties.groups` are replaced by the JSON Schema pydantic emits for KafkaConfig,
  TracingConfig and GroupConfig, made
  self-contained (no $ref) and strict, plus the rules pydantic cannot emit because they live
  in field validators (endpoint, topic, group-name and bootstrap syntax, proxy-owned client
  properties, status names, the concurrency range). tests/test_chart_contract.py checks that
  each of those patterns accepts exactly what the validator accepts. The rest of the file is
  the chart's own and is left as it is.
- helm/consumer-proxy/templates/_model.tpl: a group's defaults as the model fills them in,
  for the render-time checks across fields (templates/_helpers.tpl) that JSON Schema cannot
  express (backoff and adaptive bounds, DLQ topics against the source topics, ...).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package

from consumer_proxy.config import (  # noqa: E402 - needs the path above
    PROXY_OWNED_CLIENT_PROPERTIES,
    STATUS_NAMES,
    GroupConfig,
    KafkaConfig,
    TracingConfig,
)

CHART = ROOT / "helm" / "consumer-proxy"
SCHEMA = CHART / "values.schema.json"
MODEL_TPL = CHART / "templates" / "_model.tpl"

# -- the syntax rules of config.py's validators, as RE2 patterns (Go's regexp, which Helm's
# JSON Schema validator uses, and Python's re agree on these) ---------------------------------

# A port 1-65535 written with one to five digits (leading zeros allowed, as int() allows them).
PORT = (
    r"(?:[1-9][0-9]{0,3}|0[1-9][0-9]{0,2}|00[1-9][0-9]?|000[1-9]"
    r"|0(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
    r"|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
)
HOST_PORT = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):" + PORT
# config.check_endpoint: a gRPC target with a scheme and some address, or host:port.
ENDPOINT = r"^(?:(?:dns|ipv4|ipv6|unix|unix-abstract):.*[^/].*|" + HOST_PORT + r")$"
# KafkaConfig._servers_parse: host:port[,host:port...], each optionally after "scheme://".
_SERVER = r"\s*(?:[^,]*://)?" + HOST_PORT + r"\s*"
BOOTSTRAP = "^" + _SERVER + "(?:," + _SERVER + ")*$"
# config._check_topic; "." and ".." are refused separately (RE2 has no look-ahead).
TOPIC = r"^[A-Za-z0-9._-]{1,249}$"
# GroupConfig._name_chars: the name prefixes '<group>.redrive', itself a topic name.
GROUP_NAME = r"^[A-Za-z0-9._-]{1,241}$"
NOT_DOTS = {"not": {"enum": [".", ".."]}}

# The chart's own additions to `kafka`: credentials come from a Secret, never from values.
PROPERTY_NAME = r"^[a-z0-9][a-z0-9._]*$"
CHART_KAFKA = {
    "existingSecret": {
        "type": "string",
        "description": "An existing Secret holding the Kafka credentials (chart only).",
    },
    "secretProperties": {
        "type": "object",
        "description": "librdkafka property -> key in existingSecret, passed as "
        "CONSUMER_PROXY_KAFKA__CLIENT__<property> (chart only).",
        "propertyNames": {"pattern": PROPERTY_NAME},
        "additionalProperties": {"type": "string", "pattern": "^[-._a-zA-Z0-9]+$"},
    },
}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve $ref, fold Optional into a type list, drop titles and formats, recursively."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[1]])
        target.update(node)  # the field's own description wins over the model's docstring
        node = target
    node.pop("title", None)
    if node.get("format") == "path":
        node.pop("format")
    branches = node.get("anyOf")
    if branches is not None:
        others = [_inline(b, defs) for b in branches if b != {"type": "null"}]
        nullable = len(others) < len(branches)
        if all(set(b) == {"type"} for b in others):
            # A union of plain types: one type list reads better and errs more clearly.
            node.pop("anyOf")
            node["type"] = [b["type"] for b in others] + (["null"] if nullable else [])
        elif len(others) == 1 and nullable:
            node.pop("anyOf")
            inner = others[0]
            node = {**inner, **node, "type": [inner["type"], "null"]}
            if "enum" in inner:  # an enum's own list must name null too, or null is refused
                node["enum"] = [*inner["enum"], None]
    return {key: _inline(value, defs) for key, value in node.items()}


def _at(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    node = schema
    for name in path:
        node = node["properties"][name] if name != "[]" else node["items"]
    return node


def group_schema() -> dict[str, Any]:
    """The JSON Schema of one item of `groups`."""
    raw = GroupConfig.model_json_schema()
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    schema.pop("$defs", None)

    name = _at(schema, "name")
    name.update({"pattern": GROUP_NAME, **NOT_DOTS})
    name["description"] += " Letters, digits, '.', '_', '-': it names '<group>.dlq'."
    topics = _at(schema, "topics")
    topics["uniqueItems"] = True
    topics["items"].update({"pattern": TOPIC, **NOT_DOTS})
    for field in ("topic", "redrive_topic"):
        _at(schema, "dlq", field).update({"pattern": TOPIC, **NOT_DOTS})
    endpoints = _at(schema, "service", "endpoints")
    endpoints["uniqueItems"] = True
    endpoints["items"]["pattern"] = ENDPOINT
    delivery = _at(schema, "delivery")
    delivery["properties"]["concurrency"]["anyOf"] = [
        {"type": "integer", "minimum": 1, "maximum": 10_000},
        {"const": "adaptive"},
    ]
    # DeliveryConfig._batch_forms: 'auto', 'off' (YAML 1.1 reads a bare off as false),
    # 'always' or null besides the section; the section's keywords apply to objects only.
    batch = delivery["properties"]["batch"]
    batch["type"] = ["object", "string", "boolean", "null"]
    batch["pattern"] = "^(auto|off|always)$"
    batch["not"] = {"const": True}
    batch["default"] = "auto"
    overrides = delivery["properties"]["status_overrides"]
    overrides["propertyNames"] = {"enum": sorted(STATUS_NAMES - {"OK"})}
    return schema


def kafka_schema() -> dict[str, Any]:
    """The JSON Schema of `kafka`: the model's fields and the chart's Secret references."""
    raw = KafkaConfig.model_json_schema()
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    _at(schema, "bootstrap_servers")["pattern"] = BOOTSTRAP
    client = _at(schema, "client")
    client["description"] += " No secrets here: see secretProperties."
    # The proxy-owned properties are refused by a template check (_helpers.tpl), from the
    # list in _model.tpl: Helm misplaces the path of a failed propertyNames rule.
    client["propertyNames"] = {"pattern": PROPERTY_NAME}
    schema["properties"].update(copy.deepcopy(CHART_KAFKA))
    return schema


# The chart's own addition to `tracing`: standard OTEL_* variables for the proxy's container.
CHART_TRACING = {
    "env": {
        "type": "object",
        "description": "OTEL_* environment variables of the proxy's container, name -> value "
        "(chart only; a field of this block wins over its variable).",
        "propertyNames": {"pattern": r"^OTEL_[A-Z0-9_]+$"},
        "additionalProperties": {"type": "string"},
    },
}


def tracing_schema() -> dict[str, Any]:
    """The JSON Schema of `tracing`: the model's fields and the chart's OTEL_* variables."""
    raw = TracingConfig.model_json_schema()
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    _at(schema, "endpoint")["pattern"] = r"^https?://"  # TracingConfig._url
    schema["properties"].update(copy.deepcopy(CHART_TRACING))
    return schema


def values_schema(current: dict[str, Any]) -> dict[str, Any]:
    """The chart's schema with its generated parts replaced, in the file's key order."""
    schema = copy.deepcopy(current)
    groups = schema["properties"]["groups"]
    groups["items"] = group_schema()
    schema["properties"]["kafka"] = kafka_schema()
    schema["properties"]["tracing"] = tracing_schema()
    return schema


def model_tpl() -> str:
    """Named templates with the models' defaults, for the render-time checks."""
    minimal = GroupConfig(name="g", topics=["t"], service={"endpoints": ["h:1"]})  # type: ignore[arg-type]
    defaults = minimal.model_dump(mode="json", exclude={"name", "topics"})
    defaults["service"].pop("endpoints")
    owned = json.dumps(sorted(PROXY_OWNED_CLIENT_PROPERTIES))
    return (
        "{{/*\n"
        "Generated by scripts/gen_values_schema.py from consumer_proxy/config.py: do not edit.\n"
        "For the checks in _helpers.tpl: a group's defaults as the proxy fills them in, and\n"
        "the librdkafka properties the proxy sets itself (JSON).\n"
        "*/}}\n"
        '{{- define "consumer-proxy.groupDefaults" -}}\n'
        f"{json.dumps(defaults, sort_keys=True)}\n"
        "{{- end -}}\n"
        "\n"
        '{{- define "consumer-proxy.proxyOwnedClientProperties" -}}\n'
        f"{owned}\n"
        "{{- end -}}\n"
    )


def render() -> dict[Path, str]:
    current = json.loads(SCHEMA.read_text(encoding="utf-8"))
    schema = json.dumps(values_schema(current), indent=2, ensure_ascii=False) + "\n"
    return {SCHEMA: schema, MODEL_TPL: model_tpl()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args()
    stale = []
    for path, text in render().items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        rel = path.relative_to(ROOT).as_posix()
        if args.check:
            stale.append(rel)
            sys.stdout.writelines(
                difflib.unified_diff(current.splitlines(True), text.splitlines(True), rel, rel, n=1)
            )
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
    if stale:
        print(
            f"stale generated chart files: {', '.join(stale)}; "
            "run: python scripts/gen_values_schema.py"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
