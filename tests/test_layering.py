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


PACKAGE = CORE.parent
SHELL_OBJECTS = {
    "push",
    "batch_push",
    "stream",
    "intake",
    "committer",
    "parking",
    "guarding",
    "handover",
    "snapshot",
}
"""The group shell's jobs (and the console's read-only picture of a group): each is given the
callbacks and ports it needs, so none imports the runner, the process, or a concrete adapter
(those are built by ``adapters`` and handed in)."""
ABOVE_THE_OBJECTS = {"group", "proxy", "cli", "adapters", "fetcher", "dispatcher", "dlq"}


def _package_imports(path: Path) -> set[str]:
    """The package's modules ``path`` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1 and path.parent == PACKAGE and node.module:
            names.add(node.module.split(".")[0])
        elif node.level == 1 and path.parent == PACKAGE:
            names |= {alias.name for alias in node.names}
    return names


def test_the_shell_objects_import_neither_the_runner_nor_an_adapter() -> None:
    for name in sorted(SHELL_OBJECTS | {"ports"}):
        path = PACKAGE / f"{name}.py"
        assert path.exists(), name
        imported = _package_imports(path)
        assert not imported & ABOVE_THE_OBJECTS, f"{name}.py imports {imported & ABOVE_THE_OBJECTS}"
    # and the poll and commit cadences they follow are pure core
    assert (CORE / "cadence.py").exists()


def test_the_package_has_no_import_cycle() -> None:
    graph = {
        path.stem: _package_imports(path) & {p.stem for p in PACKAGE.glob("*.py")}
        for path in PACKAGE.glob("*.py")
    }
    done: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in trail, " -> ".join((*trail, module))
        if module in done:
            return
        for imported in graph[module]:
            visit(imported, (*trail, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_the_runner_and_the_shell_objects_stay_small() -> None:
    # A newcomer reads GroupRunner in ten minutes (issue 35): each module of the group shell
    # under about 300 lines
    for name in sorted(SHELL_OBJECTS | {"group"}):
        lines = len((PACKAGE / f"{name}.py").read_text().splitlines())
        assert lines <= 300, f"{name}.py has {lines} lines"
