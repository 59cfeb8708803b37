"""Print the onboarding config reference as a Markdown table, from the pydantic models.

    .venv/bin/python scripts/config_reference.py            # to stdout
    .venv/bin/python scripts/config_reference.py --check docs/operating.md

Every field of ``ProxyConfig``: its path in the YAML, type, default, allowed range and
description, plus the environment variable that overrides it. ``--check FILE`` exits 1 when
FILE does not contain the current table (so the docs cannot drift from the code).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from consumer_proxy.config import ENV_PREFIX, ProxyConfig


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return f"map[{_type_name(args[0])} → {_type_name(args[1])}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "(section defaults)" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "**required**"
    if field.default is None:
        return "—"
    return f"`{json.dumps(field.default)}`"  # as it would be written in YAML


def _range(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, Ge):
            parts.append(f"≥ {item.ge}")
        elif isinstance(item, Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, Le):
            parts.append(f"≤ {item.le}")
        elif isinstance(item, Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, MinLen) and item.min_length > 0:
            parts.append(f"at least {item.min_length}")
        elif isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length}")
    return ", ".join(parts)


# Fields whose written forms a field validator widens beyond the annotation: (type, default).
WRITTEN_FORMS = {
    "groups[].delivery.batch": ('"auto" \\| "off" \\| section \\| null', '`"auto"`'),
}


def rows(model: type[BaseModel], prefix: str = "", env: str | None = ENV_PREFIX) -> Iterator[str]:
    """One table row per field, depth first (sections before their fields)."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _model_in(field.annotation)
        is_list = typing.get_origin(field.annotation) is list
        env_name = f"`{env}{name.upper()}`" if env is not None else "—"
        description = (field.description or "").replace("|", "\\|")
        type_name, default = WRITTEN_FORMS.get(
            path, (_type_name(field.annotation), _default(field))
        )
        yield (
            f"| `{path}` | {type_name} | {default} | {_range(field)} | {description} | {env_name} |"
        )
        if sub is not None:
            # List items (groups) cannot be overridden one by one from the environment.
            child_env = None if is_list or env is None else f"{env}{name.upper()}__"
            yield from rows(sub, f"{path}[]." if is_list else f"{path}.", child_env)


def table() -> str:
    """The whole reference table."""
    head = [
        "| Field | Type | Default | Allowed | Description | Environment override |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join([*head, *rows(ProxyConfig)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, metavar="FILE", help="fail if FILE lacks the table")
    args = parser.parse_args()
    text = table()
    if args.check is not None:
        if text not in args.check.read_text(encoding="utf-8"):
            print(f"{args.check}: the config reference is stale; regenerate it with {__file__}")
            return 1
        return 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
