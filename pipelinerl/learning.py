"""Is the run still learning? Alarms over the newest steps' metrics (pure).

A run can go on stepping while it learns nothing: every sample dropped for lag (a resume that
went wrong), every micro-batch rejected, a loss gone non-finite, every update skipped. The trainer logs the alarm
and reports it in its status (the operator turns it into the job's `Degraded` condition);
`pipelinerl run` exits non-zero when a run ends in one.
"""

from __future__ import annotations

import math

WINDOW = 10  # steps looked at
MOST_DROPPED = 0.5  # of the window's samples


def learning_alarm(steps: list[dict]) -> str | None:
    """Why the newest of `steps` (train metrics rows, oldest first) show no learning, or None."""
    window = steps[-WINDOW:]
    if not window:
        return None
    bad_loss = [r["step"] for r in window if not math.isfinite(r["loss"])]
    if bad_loss:
        return f"NonFiniteLoss: the loss of step(s) {_steps(bad_loss)} is not finite"
    # fp16's loss scale skips a few steps at a start as it falls: a whole window is no learning.
    if len(window) == WINDOW and all(r.get("step_skipped") for r in window):
        return (
            f"StepsSkipped: the optimizer applied no update at steps {window[0]['step']}–{window[-1]['step']} "
            "(their gradients were not finite)"
        )
    empty = []
    for r in reversed(window):
        if r["tokens"] > 0:
            break
        empty.append(r["step"])
    if empty:
        dropped = sum(r["dropped_for_lag"] for r in window[-len(empty) :])
        rejected = sum(r.get("samples_rejected", 0) for r in window[-len(empty) :])
        return (
            f"NoTokensTrained: step(s) {_steps(sorted(empty))} trained no tokens "
            f"({dropped} samples dropped for lag, {rejected} samples rejected)"
        )
    samples = sum(r["samples"] + r.get("samples_stale", 0) for r in window)  # stale: dropped before packing
    dropped = sum(r["dropped_for_lag"] for r in window)
    if samples and dropped / samples > MOST_DROPPED:
        return (
            f"MostSamplesDropped: {dropped} of the {samples} samples of steps {window[0]['step']}–"
            f"{window[-1]['step']} lost tokens to lag, wholly or in part (rl.maxLag)"
        )
    return None


def _steps(steps: list[int]) -> str:
    return f"{steps[0]}–{steps[-1]}" if len(steps) > 1 else str(steps[0])
