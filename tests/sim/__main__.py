"""``python -m tests.sim``: run seeded schedules through the real shell (a soak, or one seed
to replay)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields

from tests.sim.shell import ShellStats, run_shell
from tests.sim.truth import InvariantViolation


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
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # the shell logs state changes; a soak has thousands
    seeds = [args.seed] if args.seed is not None else range(args.first_seed, 2**31)
    total = ShellStats()
    started = time.monotonic()
    runs = 0
    for seed in seeds:
        try:
            stats = run_shell(seed, args.steps)[0]
        except InvariantViolation as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        runs += 1
        for field in fields(total):
            name = field.name
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        if total.steps >= args.total_steps:
            break
        if runs % 10 == 0:
            elapsed = time.monotonic() - started
            print(
                f"{runs} schedules, {total.steps:,} steps, {elapsed:.0f}s "
                f"({total.steps / elapsed:.0f} steps/s)",
                flush=True,
            )
    elapsed = time.monotonic() - started
    print(
        f"passed: {runs} schedules, {total.steps:,} steps, {elapsed:.0f}s "
        f"({total.steps / max(elapsed, 1e-9):.0f} steps/s); {vars(total)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
