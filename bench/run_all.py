#!/usr/bin/env python3
"""Run every ``bench/bench_*.py`` one after the other on one broker and summarise the ratios.

From the repository root (every bench runs as a module, ``python -m bench.NAME``, so that
``bench`` and ``tests`` import as packages):

    .venv/bin/python -m bench.run_all                 # full sizes (small: flow, dlq merge, soak)
    .venv/bin/python -m bench.run_all --quick         # smoke run: --quick wherever supported
    .venv/bin/python -m bench.run_all --only push hol # a subset (names without "bench_")

One private broker is started for the whole run (or ``--bootstrap`` is used) and passed to every
bench that takes ``--bootstrap``; ``--quick`` is passed where a bench takes it. What a bench
takes is its declared ``OPTIONS`` (``bench.options.BenchOptions``), read by importing the
module (a bench runs nothing on import); a bench that would run long even in a full run is
declared ``always_quick`` or gets small sizes from its ``run_all_args``. Each bench's output
streams through; afterwards the ratios of the JSON results each bench wrote to
``bench/results/`` during this run are printed as one table (a bench that writes no JSON shows
the tail of its output instead), and the whole summary goes to
``bench/results/run_all-<time>.json``. Exit code 1 if any bench failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.measure import RESULTS_DIR
from bench.options import ROOT, BenchOptions, broker

BENCH_DIR = Path(__file__).resolve().parent
# The order: the fast, broker-free ones first.
ORDER = [
    "bench_tracker",
    "bench_push",
    "bench_hol",
    "bench_ordering",
    "bench_workers",
    "bench_flow",
    "bench_dlq_merge",
    "bench_soak",
]


def discover() -> list[Path]:
    found = {p.stem: p for p in BENCH_DIR.glob("bench_*.py")}
    ordered = [found.pop(name) for name in ORDER if name in found]
    return ordered + sorted(found.values())


def options_of(script: Path) -> BenchOptions:
    """The bench's declared options (``OPTIONS``; none declared: no shared option)."""
    module = importlib.import_module(f"bench.{script.stem}")
    found = getattr(module, "OPTIONS", None)
    return found if isinstance(found, BenchOptions) else BenchOptions(bootstrap=False, quick=False)


def command(script: Path, bootstrap: str, quick: bool) -> list[str]:
    options = options_of(script)
    args = [sys.executable, "-m", f"bench.{script.stem}"]
    if options.bootstrap:
        args += ["--bootstrap", bootstrap]
    if options.quick and (quick or options.always_quick):
        args.append("--quick")
    else:
        args += options.run_all_args
    return args


def results_since(stem: str, since: float) -> list[dict[str, Any]]:
    found = []
    for path in sorted(RESULTS_DIR.glob(f"{stem}-*.json")):
        if path.stat().st_mtime >= since and "-profile-" not in path.name:
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            data["_file"] = str(path.relative_to(ROOT))
            found.append(data)
    return found


def run_one(script: Path, bootstrap: str, quick: bool) -> dict[str, Any]:
    try:
        args = command(script, bootstrap, quick)
    except (ImportError, SyntaxError) as exc:  # reading its OPTIONS: it cannot run either
        print(f"\n===== {script.stem}: does not import: {exc!r}", flush=True)
        return {
            "bench": script.stem,
            "command": "",
            "exit": -1,
            "seconds": 0.0,
            "results": [],
            "tail": [repr(exc)],
        }
    shown = " ".join(a if a != sys.executable else "python" for a in args)
    print(f"\n===== {script.stem}: {shown}", flush=True)
    started_wall, started = time.time(), time.monotonic()
    tail: list[str] = []
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail = [*tail[-24:], line.rstrip()]
    code = proc.wait()
    elapsed = time.monotonic() - started
    print(f"===== {script.stem}: exit {code} after {elapsed:.0f}s", flush=True)
    return {
        "bench": script.stem,
        "command": shown,
        "exit": code,
        "seconds": round(elapsed, 1),
        "results": results_since(script.stem, started_wall - 1),
        "tail": tail,
    }


def summary(runs: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'bench / ratio':<58} {'value':>10}  target"]
    for run in runs:
        status = "ok" if run["exit"] == 0 else f"FAILED (exit {run['exit']})"
        lines.append(f"{run['bench']} ({run['seconds']:.0f}s, {status})")
        ratios = {k: v for r in run["results"] for k, v in r.get("ratios", {}).items()}
        for name, ratio in ratios.items():
            target = ratio.get("target")
            verdict = (
                "" if ratio.get("meets") is None else ("  MET" if ratio["meets"] else "  NOT MET")
            )
            shown_target = "" if target is None else f"{target:g}"
            lines.append(f"  {name:<56} {ratio['value']:>10,.3f}  {shown_target}{verdict}")
        if not ratios:
            lines.append("  (no JSON ratios; last lines of its output:)")
            lines += [f"    {line}" for line in run["tail"][-12:] if line.strip()]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="use this running broker (default: a private one)")
    parser.add_argument("--quick", action="store_true", help="pass --quick to every bench")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="e.g. push hol (no bench_)")
    parser.add_argument("--skip", nargs="+", metavar="NAME", default=[], help="e.g. soak")
    args = parser.parse_args()
    scripts = discover()
    wanted = {f"bench_{n.removeprefix('bench_')}" for n in args.only or []}
    skipped = {f"bench_{n.removeprefix('bench_')}" for n in args.skip}
    scripts = [s for s in scripts if (not wanted or s.stem in wanted) and s.stem not in skipped]
    print("benches: " + ", ".join(s.stem for s in scripts), flush=True)
    runs = []
    with broker(args.bootstrap) as bootstrap:
        for script in scripts:
            runs.append(run_one(script, bootstrap, args.quick))
    lines = summary(runs)
    print("\n===== summary", flush=True)
    print("\n".join(lines), flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"run_all-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"runs": runs, "summary": lines}, indent=2, default=str))
    print(f"summary written to {out.relative_to(ROOT)}", flush=True)
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
