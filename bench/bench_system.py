#!/usr/bin/env python3
"""Whole-system CPU per message against Parallel Consumer (issue 34, item 4).

The 4-partition no-op workload of issue 13 (200,000 pre-produced 100-byte records), consumed
by a fresh group in each run, three ways in the same run:

- **pc**: Confluent's Parallel Consumer (``bench/parallelconsumer``, a no-op function,
  ``UNORDERED``, ``maxConcurrency`` 16, its default; periodic asynchronous commits): the whole
  system is one JVM;
- **proxy_go**: the proxy plus ``examples/go``, the Go example service;
- **proxy_sdk**: the proxy plus a no-op handler on the Python SDK (``consumer_proxy.handler``).

The proxy runs the batch settings of ``bench_throughput.py`` (batches of 500, 4 calls, commits
every 100 ms). **CPU per message** = CPU time of every process of the system (all threads,
from /proc) from the first commit seen to every offset committed, divided by the records
committed in between: one method for all three, read from the broker (no service needs to
count). Target: **proxy + Go <= 1.0 x Parallel Consumer**. Interleaved rounds (the order rotates),
medians. Also each system's committed msg/s over the same interval, and Parallel Consumer's
own figure from its first to its n-th record processed.

``--profile-sdk`` adds one proxy + SDK run with the service under cProfile (the whole service
process, idle included) and prints where its time goes per message.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from bench.bench_throughput import PROXY_DELIVERY
from bench.measure import RESULTS_DIR, Result, rate, rotated, wait_for
from bench.offsets import CommittedReader
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk, sized_value
from bench.profiling import summarise_cprofile
from bench.proxy import BenchProxy, bench_config
from bench.services import (
    PC_VERSION,
    ParallelConsumer,
    ServiceProcess,
    go_example_service,
    pc_classpath,
    sdk_service,
)
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(rounds=3)

SYSTEMS = ("pc", "proxy_go", "proxy_sdk")
PC_CONCURRENCY = 16
TARGET_GO_OVER_PC = 1.0
PC_QUOTED_MSGS_PER_S = 35309.0  # issue 13's figure, used only when Maven cannot build PcBench


def measure(
    reader: CommittedReader,
    n: int,
    cpu: Callable[[], float],
    check_alive: Callable[[], None],
    timeout_s: float = 300.0,
) -> dict[str, float]:
    """CPU and time from the first commit seen to every offset committed."""
    deadline = time.monotonic() + timeout_s
    start: tuple[float, float, int] | None = None
    while True:
        committed = reader.sum()
        now = time.monotonic()
        if committed > 0 and start is None:
            start = (now, cpu(), committed)
        if committed >= n:
            assert start is not None
            end_cpu = cpu()
            break
        check_alive()
        if now > deadline:
            raise TimeoutError(f"{committed} of {n} committed in {timeout_s:g}s")
        time.sleep(0.01)
    t0, cpu0, c0 = start
    counted = n - c0
    if counted < n // 2:
        raise RuntimeError(f"the first commit already covered {c0} of {n}: too few to count")
    return {
        "cpu_us_per_msg": 1e6 * (end_cpu - cpu0) / counted,
        "committed_rate": rate(counted, now - t0),
        "counted": float(counted),
    }


def run_pc(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    group = unique_name("bench-sys-pc")
    with (
        CommittedReader(bootstrap, group, topic) as reader,
        ParallelConsumer(bootstrap, topic, group, n, PC_CONCURRENCY) as pc,
    ):
        found = measure(reader, n, pc.cpu_seconds, pc.check_alive)
        first, last = pc.event("first", 30), pc.event("last", 30)
    own_s = (last["nano"] - first["nano"]) / 1e9
    return {
        **found,
        "own_cpu_us_per_msg": (last["cpu_ns"] - first["cpu_ns"]) / 1e3 / n,
        "own_rate": rate(n - 1, own_s),
    }


def run_proxy(
    bootstrap: str, topic: str, n: int, service: ServiceProcess, what: str
) -> dict[str, float]:
    group = unique_name(f"bench-sys-{what}")
    config = bench_config(bootstrap, group, [topic], [service.address], PROXY_DELIVERY)
    with CommittedReader(bootstrap, group, topic) as reader, BenchProxy(config) as proxy:
        reader.sum()

        def both() -> float:
            return proxy.cpu_seconds() + service.cpu_seconds()

        return measure(reader, n, both, proxy.check_alive)


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=200_000, help="records")
    parser.add_argument("--profile-sdk", action="store_true", help="profile the SDK service")
    args = parser.parse_args()
    n = 50_000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    result = Result(
        "bench_system",
        params={"n": n, "rounds": rounds, "proxy": PROXY_DELIVERY, "pc": PC_VERSION},
    )
    systems: tuple[str, ...] = SYSTEMS
    try:
        pc_classpath()
    except RuntimeError as exc:
        result.note(
            f"Parallel Consumer could not be built ({str(exc).splitlines()[0]}): compared "
            f"with the figure quoted in issue 13 instead ({PC_QUOTED_MSGS_PER_S:,.0f} msg/s, "
            "not measured here, no CPU figure)"
        )
        systems = SYSTEMS[1:]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    med = statistics.median
    with broker(args.bootstrap) as bootstrap:
        topic = create_topic(bootstrap, unique_name("bench-sys"), partitions=4)
        produce_bulk(bootstrap, topic, n, partitions=4, value=sized_value)
        with go_example_service() as go, sdk_service() as sdk:
            for round_ in range(rounds):
                order = rotated(systems, round_)
                for system in order:
                    if system == "pc":
                        run = run_pc(bootstrap, topic, n)
                    else:
                        service = go if system == "proxy_go" else sdk
                        run = run_proxy(bootstrap, topic, n, service, system)
                    runs[system].append(run)
                    print(
                        f"  round {round_ + 1} {system:<9}: {run['cpu_us_per_msg']:.1f} us of "
                        f"CPU/msg, committed {run['committed_rate']:,.0f} msg/s",
                        flush=True,
                    )
        if args.profile_sdk:
            profile_sdk(bootstrap, topic, n, result)
    for system in systems:
        result.figure(f"{system}.cpu_us_per_msg", med(r["cpu_us_per_msg"] for r in runs[system]))
        result.figure(
            f"{system}.committed_msgs_per_s", med(r["committed_rate"] for r in runs[system])
        )
    result.figures["runs"] = runs
    if "pc" in runs:
        pc = runs["pc"]
        result.figure("pc.own_cpu_us_per_msg", med(r["own_cpu_us_per_msg"] for r in pc))
        result.figure("pc.own_msgs_per_s", med(r["own_rate"] for r in pc))
        for system in ("proxy_go", "proxy_sdk"):
            result.ratio(
                f"{system}_cpu_over_pc",
                med(
                    s["cpu_us_per_msg"] / p["cpu_us_per_msg"]
                    for p, s in zip(pc, runs[system], strict=True)
                ),
                TARGET_GO_OVER_PC if system == "proxy_go" else None,
                higher_is_better=False,
            )
            result.ratio(
                f"{system}_rate_over_pc",
                med(
                    s["committed_rate"] / p["committed_rate"]
                    for p, s in zip(pc, runs[system], strict=True)
                ),
            )
            # Parallel Consumer commits less often than it processes: against its rate from
            # its first record processed to its n-th, too.
            result.ratio(
                f"{system}_rate_over_pc_processed",
                med(
                    s["committed_rate"] / p["own_rate"]
                    for p, s in zip(pc, runs[system], strict=True)
                ),
            )
    else:
        for system in ("proxy_go", "proxy_sdk"):
            result.ratio(
                f"{system}_rate_over_pc_quoted",
                med(r["committed_rate"] for r in runs[system]) / PC_QUOTED_MSGS_PER_S,
            )
    result.write()
    return 0


def profile_sdk(bootstrap: str, topic: str, n: int, result: Result) -> None:
    """One proxy + SDK run with the service under cProfile; its hot spots per message."""
    out = RESULTS_DIR / f"bench_system-profile-sdk-{time.strftime('%Y%m%d-%H%M%S')}.prof"
    out.parent.mkdir(parents=True, exist_ok=True)
    with sdk_service(out) as sdk:
        run = run_proxy(bootstrap, topic, n, sdk, "proxy_sdk_profiled")
    wait_for(out.exists, 30, what=f"{out} to be written")
    result.figure("profiled.cpu_us_per_msg (cProfile-inflated)", run["cpu_us_per_msg"])
    lines = summarise_cprofile(out, n)
    result.figures["sdk_profile"] = lines
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
