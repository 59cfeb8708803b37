"""``python -m tests.sim``: run seeded schedules through the real shell (a soak, or one seed
to replay). A soak runs ``--jobs`` processes (one per CPU by default), each its own share of
the seeds (job ``j`` of ``n`` runs seeds ``first + j``, ``first + j + n``, ...) until the
steps of all of them reach ``--total-steps``; the first failure stops every job."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import fields
from typing import Any

from tests.sim.shell import ShellStats, run_shell
from tests.sim.truth import InvariantViolation


def _job(first: int, stride: int, steps: int, budget: int, out: Any) -> None:
    """Run seeds ``first``, ``first + stride``, ... until ``budget`` steps; report each
    schedule's stats (or its failure) on ``out``."""
    logging.disable(logging.ERROR)  # the shell logs state changes; a soak has thousands
    done = 0
    seed = first
    while done < budget:
        try:
            stats = run_shell(seed, steps)[0]
        except InvariantViolation as exc:
            out.put(("failed", str(exc)))
            return
        except BaseException:  # a crash of the group: the parent must not wait for ever
            out.put(("failed", f"seed {seed}: {traceback.format_exc()}"))
            return
        done += stats.steps
        out.put(("passed", vars(stats)))
        seed += stride
    out.put(("finished", None))


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.sim",
        description="Drive the real GroupRunner on a virtual-time loop through seeded random "
        "schedules and check invariants at every step.",
    )
    parser.add_argument("--shell", action="store_true", help=argparse.SUPPRESS)  # the old replay
    parser.add_argument("--seed", type=int, help="replay this one seed")
    parser.add_argument("--first-seed", type=int, default=0, help="first seed of a soak")
    parser.add_argument("--steps", type=int, default=2000, help="events per schedule")
    parser.add_argument(
        "--total-steps", type=int, default=1_000_000, help="stop a soak after this many events"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes of a soak (default: one per CPU)",
    )
    args = parser.parse_args()
    logging.disable(logging.ERROR)
    if args.seed is not None:
        try:
            stats = run_shell(args.seed, args.steps)[0]
        except InvariantViolation as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print(f"passed: seed {args.seed}; {vars(stats)}")
        return 0
    jobs = max(1, min(args.jobs, 64))
    out: Any = multiprocessing.get_context("fork").Queue()
    share = -(-args.total_steps // jobs)
    workers = [
        multiprocessing.get_context("fork").Process(
            target=_job, args=(args.first_seed + j, jobs, args.steps, share, out), daemon=True
        )
        for j in range(jobs)
    ]
    for worker in workers:
        worker.start()
    total = ShellStats()
    started = time.monotonic()
    runs = finished = 0
    try:
        while finished < jobs:
            kind, body = out.get()
            if kind == "failed":
                print(f"FAILED: {body}", file=sys.stderr)
                return 1
            if kind == "finished":
                finished += 1
                continue
            runs += 1
            for field in fields(total):
                setattr(total, field.name, getattr(total, field.name) + body[field.name])
            if runs % 10 == 0:
                elapsed = time.monotonic() - started
                print(
                    f"{runs} schedules, {total.steps:,} steps, {elapsed:.0f}s "
                    f"({total.steps / elapsed:.0f} steps/s, {jobs} jobs)",
                    flush=True,
                )
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join()
    elapsed = time.monotonic() - started
    print(
        f"passed: {runs} schedules, {total.steps:,} steps, {elapsed:.0f}s "
        f"({total.steps / max(elapsed, 1e-9):.0f} steps/s, {jobs} jobs); {vars(total)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
