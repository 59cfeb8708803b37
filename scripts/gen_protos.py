#!/usr/bin/env python3
"""Generate the Python gRPC stubs for protos/ into consumer_proxy/proto/.

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 if the checked-in stubs are stale

grpcio-tools emits absolute imports (``from consumerproxy.v1 import handler_pb2``); they are
rewritten to relative ones so the stubs live inside the consumer_proxy package.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "consumer_proxy" / "proto"
PROTOS = ["consumerproxy/v1/handler.proto"]
BIN = Path(sys.executable).parent  # mypy-protobuf's plugins sit next to the interpreter
ABS_IMPORT = re.compile(r"^from consumerproxy\.v1 import (\w+)", re.MULTILINE)


def generate() -> dict[str, str]:
    """Run protoc into a scratch directory and return {relative path: text}."""
    from grpc_tools import protoc  # imported late: a dev-only dependency

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        files: dict[str, str] = {}
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".pyi"}:
                rel = path.relative_to(Path(tmp) / "consumerproxy").as_posix()
                files[rel] = ABS_IMPORT.sub(r"from . import \1", path.read_text())
    files["__init__.py"] = '"""Generated gRPC stubs (scripts/gen_protos.py)."""\n'
    files["v1/__init__.py"] = '"""Generated from protos/consumerproxy/v1 (do not edit)."""\n'
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    files = generate()
    stale = []
    for rel, text in files.items():
        target = OUT / rel
        current = target.read_text() if target.exists() else ""
        if current == text:
            continue
        if args.check:
            stale.append(rel)
            sys.stdout.writelines(
                difflib.unified_diff(current.splitlines(True), text.splitlines(True), rel, rel, n=1)
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run: python scripts/gen_protos.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
