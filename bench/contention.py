"""A contention guard for the benchmarks: a round that shared the cores with another program is
rerun, not kept, and a benchmark does not start on a busy machine.

The machine's busy CPU time comes from /proc/stat; the benchmark's own from getrusage (itself,
and every process it started once waited for: run_local's services, TRL's script). What is left
is other programs' load, in cores (`foreign_cores`). Two threads of a TRL process suffer more
from a stray load than two pinned processes, so a contended round would bias the ratio.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

LIMIT_CORES = 0.25  # other programs' mean load above which a round is not kept
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    machine_busy: float  # CPU seconds every core spent busy, since boot
    own: float  # CPU seconds of this process and its waited-for children
    wall: float  # monotonic seconds


def sample() -> CpuSample:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    busy = sum(fields[:3]) + sum(fields[5:8])
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    return CpuSample(busy / TICK, own, time.monotonic())


def foreign_cores(before: CpuSample, after: CpuSample) -> float:
    """Mean cores used by other programs between two samples (never below 0: the two clocks
    tick at different granularity)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    return max(0.0, (after.machine_busy - before.machine_busy) - (after.own - before.own)) / wall


def wait_until_quiet(limit: float = LIMIT_CORES, probe_s: float = 3.0, patience_s: float = 600.0) -> float:
    """Wait (up to `patience_s`) until other programs use less than `limit` cores over `probe_s`;
    their load then. A machine that stays busy stops the benchmark: its figures would not hold."""
    deadline = time.monotonic() + patience_s
    while True:
        before = sample()
        time.sleep(probe_s)
        load = foreign_cores(before, sample())
        if load < limit:
            return load
        if time.monotonic() > deadline:
            raise SystemExit(
                f"other programs use {load:.2f} cores (limit {limit:.2f}) and did not stop in {patience_s:.0f} s: "
                "a benchmark run now would not hold; stop them (top shows which) and run it again"
            )
        print(f"  waiting: other programs use {load:.2f} cores", flush=True)


def guarded(run, what: str, reruns: int = 2, limit: float = LIMIT_CORES) -> dict:
    """One side's round (`run()` returns its record) on a quiet machine, rerun up to `reruns`
    times while other programs used more than `limit` cores during it. The record keeps the
    load it ran beside (`foreign_cores`) and that of the tries thrown away."""
    thrown: list[float] = []
    for _ in range(reruns + 1):
        wait_until_quiet(limit)
        before = sample()
        record = run()
        load = foreign_cores(before, sample())
        if load < limit:
            return record | {"foreign_cores": load, "contended_tries": thrown}
        print(f"  {what}: other programs used {load:.2f} cores during the round: not kept, rerun", flush=True)
        thrown.append(load)
    raise SystemExit(f"{what}: every try ran beside other programs ({', '.join(f'{x:.2f}' for x in thrown)} cores)")
