#!/usr/bin/env python3
"""Generate the Go gRPC stubs for protos/ into the Go example module (examples/go).

    python scripts/gen_go.py          # regenerate examples/go/gen/consumerproxy/v1/*.pb.go
    python scripts/gen_go.py --check  # exit 1 if the checked-in stubs are stale

protoc is the one inside grpcio-tools (as for the Python stubs, scripts/gen_protos.py); its Go
plugins, protoc-gen-go and protoc-gen-go-grpc, are built with `go install` the first time into
$XDG_CACHE_HOME/consumer-proxy/bin/ (default ~/.cache), one directory per version, from the Go
module proxy. protoc-gen-go's version is the google.golang.org/protobuf version the example's
go.mod requires, so the stubs match the runtime they are built with. Once the plugins exist
this script needs neither go nor the network.

environment:
  GO               the go command (default: go on PATH, else /usr/local/go/bin/go)
  XDG_CACHE_HOME   plugins go to $XDG_CACHE_HOME/consumer-proxy/bin (default ~/.cache)
  GOMODCACHE, GOCACHE, GOPROXY   passed to go as usual

Without go and without cached plugins, --check only warns (exit 0) unless CI=true.

exit codes: 0 ok, 1 stale stubs, a failed plugin build, or no go (CI, or without --check).
"""

from __future__ import annotations

import argparse
import difflib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTOS = ["consumerproxy/v1/handler.proto"]
MODULE_DIR = ROOT / "examples" / "go"
# protoc-gen-go-grpc is its own module, versioned apart from grpc-go; pinned here.
GO_GRPC_PLUGIN = ("google.golang.org/grpc/cmd/protoc-gen-go-grpc", "v1.6.2")
GO_PLUGIN = "google.golang.org/protobuf/cmd/protoc-gen-go"
_MODULE_RE = re.compile(r"^module\s+(\S+)", re.MULTILINE)
_PROTOBUF_RE = re.compile(r"^\s*google\.golang\.org/protobuf\s+(v\S+)", re.MULTILINE)


class NoGo(RuntimeError):
    """A plugin is not cached and there is no go command to build it."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "consumer-proxy" / "bin"


def find_go() -> str | None:
    """The go command, or None."""
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def go_mod() -> tuple[str, str]:
    """The example's module path and the google.golang.org/protobuf version it requires."""
    text = (MODULE_DIR / "go.mod").read_text(encoding="utf-8")
    module, protobuf = _MODULE_RE.search(text), _PROTOBUF_RE.search(text)
    if not module or not protobuf:
        sys.exit(f"scripts/gen_go.py: {MODULE_DIR / 'go.mod'} lacks a module or protobuf line")
    return module[1], protobuf[1]


def plugin(package: str, version: str) -> Path:
    """The plugin binary, built with `go install package@version` the first time."""
    name = package.rsplit("/", 1)[1]
    target_dir = cache_dir() / f"{name}-{version}"
    binary = target_dir / name
    if os.access(binary, os.X_OK):  # the fast path: no lock, no go
        return binary
    go = find_go()
    if go is None:
        raise NoGo(f"no go command to build {name} (set GO, or put go on PATH)")
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir.parent / f".{name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time across parallel callers
        if not os.access(binary, os.X_OK):
            staging = target_dir.parent / f".build-{name}-{version}"
            shutil.rmtree(staging, ignore_errors=True)
            env = dict(os.environ, GOBIN=str(staging), CGO_ENABLED="0")
            print(f"scripts/gen_go.py: go install {package}@{version}", file=sys.stderr)
            result = subprocess.run(
                [go, "install", "-trimpath", f"{package}@{version}"], env=env, check=False
            )
            if result.returncode != 0 or not os.access(staging / name, os.X_OK):
                sys.exit(f"scripts/gen_go.py: go install {package}@{version} failed")
            os.replace(staging / name, binary)  # a rename: never a half-written binary
            shutil.rmtree(staging, ignore_errors=True)
    return binary


def generate() -> dict[Path, str]:
    """Run protoc with the Go plugins into a scratch directory; {target path: text}."""
    from grpc_tools import protoc  # imported late: a dev-only dependency

    module, protobuf_version = go_mod()
    go_plugin = plugin(GO_PLUGIN, protobuf_version)
    grpc_plugin = plugin(*GO_GRPC_PLUGIN)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--plugin=protoc-gen-go={go_plugin}",
            f"--plugin=protoc-gen-go-grpc={grpc_plugin}",
            f"--go_out={tmp}",
            f"--go_opt=module={module}",
            f"--go-grpc_out={tmp}",
            f"--go-grpc_opt=module={module}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        return {
            MODULE_DIR / path.relative_to(tmp): path.read_text(encoding="utf-8")
            for path in sorted(Path(tmp).rglob("*.go"))
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    try:
        files = generate()
    except NoGo as exc:
        if args.check and os.environ.get("CI", "").lower() not in {"1", "true", "yes"}:
            # Like the Go example's tests: skipped on a machine without Go, a failure in CI.
            print(f"scripts/gen_go.py: Go stubs not checked: {exc}", file=sys.stderr)
            return 0
        print(f"scripts/gen_go.py: {exc}", file=sys.stderr)
        return 1
    if not files:
        print("scripts/gen_go.py: protoc wrote no Go files (check go_package)", file=sys.stderr)
        return 1
    stale = []
    for target, text in files.items():
        rel = target.relative_to(ROOT).as_posix()
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if current == text:
            continue
        if args.check:
            stale.append(rel)
            sys.stdout.writelines(
                difflib.unified_diff(current.splitlines(True), text.splitlines(True), rel, rel, n=1)
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
    if stale:
        print(f"stale generated Go stubs: {', '.join(stale)}; run: python scripts/gen_go.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
