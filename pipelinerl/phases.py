"""Where a run's time went, from the trainer's step rows (pure): every run's summary, benchmark
11 and the planner's CPU calibration (its sync phase) read it.

A conventional run with k steps per generation phase alternates: the generators generate the
phase (the trainer waits for it, the switch to the new weights included), the trainer trains its
k steps, then sends the weights once. A phase's span runs from the previous phase's last row to
its own last row, so

    span = waiting (generation, the switch, the preprocessor) + training + the update + the rest

where the rest (saving an export, reporting) is small and counted with the wait. In pipeline
mode every step is a phase of one, and the wait is the trainer starved of data. The first phase
is left out: its span holds the run's start-up.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    steps: int
    samples: int
    tokens: int  # completion tokens trained (groups filtered out were generated too: not counted)
    span_s: float
    train_s: float  # the trainer's compute and optimizer steps
    update_s: float  # the weight update after the phase

    @property
    def wait_s(self) -> float:
        return max(0.0, self.span_s - self.train_s - self.update_s)  # (rounding: never below 0)


def phases(rows: list[dict], steps_per_phase: int) -> list[Phase]:
    """The phases of the trainer's step rows (`step`, `time`, `samples`, `tokens`,
    `train_seconds`, `weight_sync_seconds`), the first left out; a phase cut short by the run's
    end is kept."""
    by_step = {r["step"]: r for r in rows}  # a replayed step's row: the newest
    ordered = [by_step[s] for s in sorted(by_step)]
    out, prev_end, current = [], None, []
    for i, row in enumerate(ordered):
        current.append(row)
        if row["step"] % steps_per_phase and i < len(ordered) - 1:
            continue
        if prev_end is not None:
            out.append(
                Phase(
                    steps=len(current),
                    samples=sum(r["samples"] for r in current),
                    tokens=sum(r["tokens"] for r in current),
                    span_s=row["time"] - prev_end,
                    train_s=sum(r["train_seconds"] for r in current),
                    update_s=sum(r.get("weight_sync_seconds") or 0.0 for r in current),
                )
            )
        prev_end, current = row["time"], []
    return out


def decomposition(rows: list[dict], steps_per_phase: int) -> dict | None:
    """Per phase, the median seconds waiting, training and updating, their shares of the time,
    and the tokens trained per second the trainer waited (a conventional phase's generation
    rate of what it trains, the switch included); None before two phases."""
    ps = phases(rows, steps_per_phase)
    if not ps:
        return None
    span = sum(p.span_s for p in ps)
    wait = sum(p.wait_s for p in ps)
    return {
        "phases": len(ps),
        "steps_per_phase": steps_per_phase,
        "wait_seconds": statistics.median(p.wait_s for p in ps),
        "train_seconds": statistics.median(p.train_s for p in ps),
        "update_seconds": statistics.median(p.update_s for p in ps),
        "wait_share": wait / span,
        "train_share": sum(p.train_s for p in ps) / span,
        "update_share": sum(p.update_s for p in ps) / span,
        # (a trainer that never waited: no generation rate to read)
        "tokens_per_wait_second": sum(p.tokens for p in ps) / wait if wait > 1e-3 * span else None,
    }
