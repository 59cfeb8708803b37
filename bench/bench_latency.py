#!/usr/bin/env python3
"""Latency the proxy adds: produce -> handler, the proxy against a bare loop (issue 34, item 2).

Records are produced open loop (``linger.ms`` 0, so a record's timestamp is taken when it is
handed to the client) into a fresh one-partition topic at 1,000 msg/s, unary and batch, and at
10,000 msg/s, batch. Latency = the handler's receipt (wall clock) minus the record's
timestamp, first attempts only, one machine clock. The handler service is the Go bench handler
(``bench/gohandler``, a few microseconds per call) unless ``--handler python``.

- **floor**: ``bench.floors`` ``latency``: a bare Python loop that consumes the same records
  (the first with a blocking wait, then what librdkafka already holds) and makes the same
  call to the same service as soon as a record is there: ``HandleMessage`` per record (a
  poll's records in flight together) or one ``HandleMessageBatch`` of up to 100 (the proxy's
  default ``max_messages``); no tracking, auto commit in the background.
- **proxy**: ``consumer-proxy run`` with its delivery defaults: ``batch: off`` for unary, the
  default (``auto``: batches, since the service serves them) for batch.

Paired rounds: in each round the floor and the proxy read the same records at the same time
(a fresh topic; each its own group, process and handler service), so a load spike from the
neighbours on this shared machine falls on both (run one after the other, the floor's own p99
moved between 12 and 250 ms from one run to the next). Each round is warmed up with 20
records before its window. Reported per load: p50 / p99 / p99.9 of the floor and of the proxy
(medians over rounds), and the p99 the proxy adds (median over rounds of proxy p99 - floor
p99 of the same round). Target: **p99 added <= 1 ms** at 1,000 msg/s in both modes. Also CPU
microseconds per message of the floor and the proxy over the window (all their threads).

``--stages``: the proxy runs under ``bench.profiling``'s staged wrapper and each side prints
where its latency goes: p50 / p99 at each stage, the proxy's garbage collections in the window,
and for the 1% of records latest when their call was sent, what each stage added after the
floor's consume returned the same record, with the share of records whose poll began only
after the floor had them (``--keep-stages DIR`` keeps the stamps). ``--baseline-root DIR``
adds the proxy of another checkout to every round (its own group and handler service), so a
change is compared in the same rounds as the floor.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.floors import FloorProcess
from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, percentile
from bench.options import ROOT, BenchOptions, broker, client_settings
from bench.producing import produce_at_rate
from bench.profiling import STAGES
from bench.proxy import BenchProxy, bench_config
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(handler=True, proxy_client=True)

BASELINE = "baseline"  # the proxy of another checkout (--baseline-root)
LOADS = (("unary", 1000.0), ("batch", 1000.0), ("batch", 10000.0))
TARGET_ADDED_P99_MS = 1.0
BATCH_MAX_MESSAGES = 100  # the proxy's default batch.max_messages
WARM_UP = 20
FLOOR_BEHIND_MS = 50.0
"""A floor whose median p50 is over this did not keep up with the load (a bare loop's p50 was
1.7-3.5 ms at 1,000 and 10,000 msg/s on these machines): the machine could not carry it. On a
machine 4.3 x slower (2026-11-27) the floor alone kept up (p50 2.7-2.8 ms) and so did the
proxy alone (5.6-9.3 ms), but both at once fell 0.5-2 s behind, alike."""


def floor_behind(floor_p50_ms: float) -> bool:
    """The floor, at this median p50 over rounds, fell behind the load
    (:data:`FLOOR_BEHIND_MS`): the proxy's added latency then measures the machine's backlog,
    not the proxy."""
    return floor_p50_ms > FLOOR_BEHIND_MS


def added_target(per_s: float, floor_p50_ms: float) -> float | None:
    """The target the p99 added is judged by at ``per_s``: :data:`TARGET_ADDED_P99_MS` at
    1,000 msg/s or less, none above it, and none when the floor fell behind (the run says
    nothing of the proxy then, so it neither meets nor misses the target)."""
    if per_s > 1000 or floor_behind(floor_p50_ms):
        return None
    return TARGET_ADDED_P99_MS


def consumer_for(
    who: str,
    mode: str,
    bootstrap: str,
    topic: str,
    handler: HandlerServer,
    client: dict[str, str],
    stages: Path | None = None,
    baseline_root: Path | None = None,
) -> BenchProxy | FloorProcess:
    """The proxy, the floor or the baseline (the proxy of ``baseline_root``), not started yet,
    for one run; ``stages``: where it writes when each record passed each of its stages."""
    group = unique_name(f"bench-lat-{who}")
    if who != "floor":
        delivery = {"batch": "off" if mode == "unary" else "auto"}
        config = bench_config(bootstrap, group, [topic], [handler.address], delivery, client)
        root = baseline_root if who == BASELINE and baseline_root is not None else ROOT
        if stages is None:
            return BenchProxy(config, root=root)
        return BenchProxy(config, profile="stages", profile_out=stages, root=root)
    args = ["--bootstrap", bootstrap, "--topic", topic, "--group", group]
    args += ["--address", handler.address, "--mode", mode]
    if stages is not None:
        args += ["--stages", str(stages)]
    return FloorProcess("latency", *args, "--max-messages", str(BATCH_MAX_MESSAGES))


def paired_run(
    bootstrap: str,
    handlers: dict[str, HandlerServer],
    mode: str,
    per_s: float,
    seconds: float,
    client: dict[str, str] | None = None,
    stages: bool = False,
    keep: Path | None = None,
    baseline_root: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """One window of ``per_s`` records for ``seconds``, read by the floor and the proxy at
    the same time (each its own group and its own handler service). ``stages``: also where
    each side's latency goes (:func:`stage_figures`), its stamps kept under ``keep`` if
    given."""
    topic = create_topic(bootstrap, unique_name("bench-lat"), partitions=1)
    stage_dir = Path(tempfile.mkdtemp(prefix="cp-bench-stages-", dir=keep))
    stage_files = {who: stage_dir / f"{who}.json" if stages else None for who in handlers}
    with contextlib.ExitStack() as stack:
        if keep is None:
            stack.callback(shutil.rmtree, stage_dir, ignore_errors=True)
        processes: dict[str, BenchProxy | FloorProcess] = {}
        for who, handler in handlers.items():
            processes[who] = consumer_for(
                who, mode, bootstrap, topic, handler, client or {}, stage_files[who], baseline_root
            )
            stack.enter_context(processes[who])
        for handler in handlers.values():
            handler.reset()
        warm = produce_at_rate(bootstrap, topic, 100.0, WARM_UP / 100.0)  # groups up, calls warm
        for handler in handlers.values():
            handler.wait_seen(WARM_UP, 60)
            handler.reset()
        cpu = {who: process.cpu_seconds() for who, process in processes.items()}
        n = produce_at_rate(bootstrap, topic, per_s, seconds)
        found, stats = {}, {}
        for who, handler in handlers.items():
            handler.wait_seen(n, 120, interval_s=0.02)
            cpu[who] = processes[who].cpu_seconds() - cpu[who]
            processes[who].check_alive()
            stats[who] = handler.stats()
            found[who] = figures(who, n, stats[who], cpu[who])
        for who in handlers:
            if who != "floor":
                found[who]["per_record"] = per_record_added(stats["floor"], stats[who])
        for process in processes.values():  # the stage files are written on the way out
            if isinstance(process, FloorProcess):
                process.terminate()
            else:
                process.stop()
        for who, path in stage_files.items():
            if path is not None:
                floor = stage_files["floor"] if who != "floor" else None
                found[who].update(stage_figures(path, found[who], floor, warm))
    return found


def stage_figures(path: Path, run: dict[str, Any], floor: Path | None, warm: int) -> dict[str, Any]:
    """Where a side's latency goes: p50 / p99 at each stage it wrote (the ``warm`` records of
    the warm-up left out) and at the handler; for a proxy, also the collections in the window
    and the tail (:func:`tail_figures`, against the floor's ``floor`` stamps of the same
    records)."""
    stamps = json.loads(path.read_text())
    pauses = stamps.pop("gc", [])
    produced = dict(stamps.pop("produced", []))
    at = {stage: {o: ms for o, ms in pairs if o >= warm} for stage, pairs in stamps.items()}
    found: dict[str, Any] = {
        "stages": {
            stage: {
                "p50": percentile(list(v.values()), 50),
                "p99": percentile(list(v.values()), 99),
            }
            for stage, v in at.items()
            if v
        }
    }
    found["stages"]["handler"] = {"p50": run["p50"], "p99": run["p99"]}
    window = [ts for o, ts in produced.items() if o >= warm]
    if window:
        start, end = min(window), max(window) + 1000.0  # (ms, wall clock)
        taken = [(ms, gen) for t, ms, gen in pauses if start <= t <= end]
        found["gc"] = {
            "collections": len(taken),
            "by_generation": [sum(1 for _, g in taken if g == gen) for gen in (0, 1, 2)],
            "longest_ms": max((ms for ms, _ in taken), default=0.0),
            "total_ms": sum(ms for ms, _ in taken),
        }
    if floor is not None and at.get("asked"):
        consumed = {o: ms for o, ms in json.loads(floor.read_text())["consumed"]}
        found["tail"] = tail_figures(at, consumed)
    return found


def tail_figures(at: dict[str, dict[int, float]], floor: dict[int, float]) -> dict[str, Any]:
    """For the 1% of records latest when their call was sent, the mean milliseconds each
    stage of the proxy added, from the floor's consume returning the same record; and the
    share of all records whose poll began only after the floor had them (they waited in
    librdkafka while the proxy's consumer thread waited for its next call)."""
    order = [s for s in STAGES if s not in ("submitted", "asked", "answered") and at.get(s)]
    offsets = [o for o in at[order[-1]] if o in floor and all(o in at[s] for s in order)]
    if not offsets:
        return {}
    last = at[order[-1]]
    worst = sorted(offsets, key=lambda o: -last[o])[: max(1, len(offsets) // 100)]
    added: dict[str, float] = {}
    for o in worst:
        before = floor[o]
        for stage in order:
            added[stage] = added.get(stage, 0.0) + at[stage][o] - before
            before = at[stage][o]
    asked = at["asked"]
    late = sum(1 for o in offsets if o in asked and asked[o] > floor[o])
    return {
        "worst_mean_added_ms": {stage: ms / len(worst) for stage, ms in added.items()},
        "polled_late_share": late / len(offsets),
    }


def per_record_added(floor: dict[str, Any], side: dict[str, Any]) -> dict[str, float]:
    """Percentiles of what a side added to each record: its latency minus the floor's for the
    same record (same offset of the one partition, read by both at the same time). A stall
    upstream (producer, broker, the machine) delays a record for both alike and drops out,
    where it decides both sides' own p99 (the floor's moved between 12 and 800 ms from one
    round to the next on this machine)."""
    floor_at = dict(zip(floor["latency_offsets"], floor["latency_ms"], strict=True))
    added = [
        ms - floor_at[offset]
        for offset, ms in zip(side["latency_offsets"], side["latency_ms"], strict=True)
        if offset in floor_at
    ]
    if not added:
        raise RuntimeError("no record seen by both the floor and the side")
    found: dict[str, float] = {}
    for q in (50, 99, 99.9):
        value = percentile(added, q)
        assert value is not None
        found[f"p{q:g}".replace(".", "")] = value
    return found


def figures(who: str, n: int, stats: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    """Percentiles of one side's latencies, its CPU per message, its calls."""
    lat = stats["latency_ms"]
    if len(lat) < n:
        raise RuntimeError(f"{who}: {len(lat)} latencies for {n} records")
    return {
        "n": n,
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "p999": percentile(lat, 99.9),
        "max": max(lat),
        "cpu_us_per_msg": 1e6 * cpu_s / n,
        "calls": stats["calls"],
        "batch_calls": sum(stats["sizes"].values()),
        "mean_batch": n / max(stats["calls"], 1),
    }


def print_stages(run: dict[str, Any]) -> None:
    """A side's stage figures (``--stages``), under its line."""
    for stage, at in run.get("stages", {}).items():
        print(f"      {stage:<16} p50 {at['p50'] or 0:8.2f} ms  p99 {at['p99'] or 0:8.2f} ms")
    if "gc" in run:
        gc = run["gc"]
        print(
            f"      GC in the window: {gc['collections']} collections (by generation "
            f"{gc['by_generation']}), {gc['total_ms']:.1f} ms in all, longest "
            f"{gc['longest_ms']:.2f} ms"
        )
    tail = run.get("tail")
    if tail:
        added = ", ".join(f"{s} +{ms:.2f}" for s, ms in tail["worst_mean_added_ms"].items())
        print(f"      worst 1% (ms after the floor's consume): {added}")
        print(
            f"      polled only after the floor had the record: "
            f"{100 * tail['polled_late_share']:.0f}% of records",
            flush=True,
        )


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds per load")
    parser.add_argument("--seconds", type=float, default=5.0, help="window per round")
    parser.add_argument(
        "--stages", action="store_true", help="also where each side's latency goes (stamps)"
    )
    parser.add_argument("--keep-stages", type=Path, help="--stages: keep the stamps here")
    parser.add_argument(
        "--baseline-root",
        type=Path,
        help="also the proxy of this checkout in every round (its own group and handler)",
    )
    parser.add_argument(
        "--loads", nargs="+", choices=[f"{m}_{r:.0f}" for m, r in LOADS], help="a subset"
    )
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    client = client_settings(args.proxy_client)
    seconds = 3.0 if args.quick else args.seconds
    result = Result(
        "bench_latency",
        params={
            "rounds": rounds,
            "seconds": seconds,
            "handler": args.handler,
            "client": client,
            "baseline_root": str(args.baseline_root or ""),
        },
    )
    spec = HandlerSpec(latency=True)
    med = statistics.median
    sides = ("floor", "proxy") + ((BASELINE,) if args.baseline_root else ())
    with broker(args.bootstrap) as bootstrap, contextlib.ExitStack() as stack:
        handlers = {who: stack.enter_context(HandlerServer(spec, args.handler)) for who in sides}
        for mode, per_s in LOADS:
            name = f"{mode}_{per_s:.0f}"
            if args.loads and name not in args.loads:
                continue
            runs: dict[str, list[dict[str, Any]]] = {who: [] for who in sides}
            for round_ in range(rounds):
                paired = paired_run(
                    bootstrap,
                    handlers,
                    mode,
                    per_s,
                    seconds,
                    client,
                    args.stages,
                    args.keep_stages,
                    args.baseline_root,
                )
                for who, run in paired.items():
                    runs[who].append(run)
                    print(
                        f"  {name} round {round_ + 1} {who:<8}: p50 {run['p50']:.2f} ms, "
                        f"p99 {run['p99']:.2f}, p99.9 {run['p999']:.2f}, max {run['max']:.1f}; "
                        f"{run['calls']} calls ({run['batch_calls']} batches) for {run['n']}; "
                        f"CPU {run['cpu_us_per_msg']:.0f} us/msg",
                        flush=True,
                    )
                    if "per_record" in run:
                        each = run["per_record"]
                        print(
                            f"      added per record (its latency - the floor's): p50 "
                            f"{each['p50']:+.2f} ms, p99 {each['p99']:+.2f}, "
                            f"p99.9 {each['p999']:+.2f}"
                        )
                    print_stages(run)
            for who in sides:
                for q in ("p50", "p99", "p999"):
                    result.figure(f"{name}.{who}_{q}_ms", med(r[q] for r in runs[who]), "ms")
                result.figure(
                    f"{name}.{who}_cpu_us_per_msg",
                    med(r["cpu_us_per_msg"] for r in runs[who]),
                    "us",
                )
            for who in sides[1:]:
                for q in ("p50", "p99", "p999"):
                    result.figure(
                        f"{name}.{who}_per_record_added_{q}_ms",
                        med(r["per_record"][q] for r in runs[who]),
                        "ms",
                    )
            added = [p["p99"] - f["p99"] for f, p in zip(runs["floor"], runs["proxy"], strict=True)]
            result.figures[f"{name}.p99_added_ms_per_round"] = [round(a, 3) for a in added]
            result.figures[f"{name}.runs"] = runs
            floor_p50 = med(r["p50"] for r in runs["floor"])
            target = added_target(per_s, floor_p50)
            result.ratio(f"{name}.p99_added_ms", med(added), target, higher_is_better=False)
            result.ratio(
                f"{name}.per_record_p99_added_ms",
                med(r["per_record"]["p99"] for r in runs["proxy"]),
                higher_is_better=False,
            )
            result.ratio(
                f"{name}.proxy_p99_over_floor_p99",
                med(p["p99"] / f["p99"] for f, p in zip(runs["floor"], runs["proxy"], strict=True)),
            )
            result.figures[f"{name}.floor_behind"] = floor_behind(floor_p50)
            if floor_behind(floor_p50):
                print(
                    f"  WARNING {name}: the floor itself fell behind (median p50 {floor_p50:.0f} "
                    "ms): this machine did not carry the load (both sides run at once, with their "
                    "handlers, the producer and the broker: when their CPU exceeds the cores "
                    "every record comes late to both), and the figures above say nothing about "
                    "the proxy",
                    flush=True,
                )
            if args.baseline_root:  # the same rounds: what the change moved
                base = [
                    b["p99"] - f["p99"] for f, b in zip(runs["floor"], runs[BASELINE], strict=True)
                ]
                result.figures[f"{name}.baseline_p99_added_ms_per_round"] = [
                    round(a, 3) for a in base
                ]
                result.ratio(f"{name}.baseline_p99_added_ms", med(base), higher_is_better=False)
                for q in ("p50", "p99"):
                    result.ratio(
                        f"{name}.proxy_{q}_over_baseline_{q}",
                        med(
                            p[q] / b[q] for b, p in zip(runs[BASELINE], runs["proxy"], strict=True)
                        ),
                        higher_is_better=False,
                    )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
