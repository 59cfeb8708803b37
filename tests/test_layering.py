"""The layering: the pure core imports no I/O, and nothing in the core reaches back up."""

from __future__ import annotations

import ast
from pathlib import Path

import consumer_proxy.core as core

CORE = Path(core.__file__).parent
FORBIDDEN = {"asyncio", "confluent_kafka", "grpc_health", "socket", "threading", "subprocess"}
UP = {"group", "proxy", "fetcher", "dispatcher", "dlq", "flow", "health", "metrics", "cli"}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] if node.module else [f"{base}{a.name}" for a in node.names]
    return names


def test_the_core_imports_no_io_and_nothing_above_it() -> None:
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) >= 8
    for path in modules:
        for name in _imports(path):
            top = name.lstrip(".").split(".")[0]
            assert top not in FORBIDDEN, f"{path.name} imports {name}"
            if name.startswith(".."):  # consumer_proxy.<x>: only config, errors and protos
                assert top in {"config", "errors", "proto"}, f"{path.name} imports {name}"
            if name.startswith("consumer_proxy."):
                assert name.split(".")[1] in {"config", "errors", "core", "proto"}, name
            assert top not in UP or name.startswith("."), f"{path.name} imports {name}"


def test_grpc_is_used_in_the_core_for_its_status_codes_only() -> None:
    for path in CORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        uses = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "grpc"
        }
        assert uses <= {"StatusCode"}, f"{path.name} uses grpc.{uses}"
