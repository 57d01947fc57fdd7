"""The generators' decode cost fitted to a measured sync generation phase (bench/calibrate_cpu.py):
along a line of calibrations (a decode base, a per-sequence slope), the one whose simulated sync
generation phase equals the measured one, by bisection; through the engine benchmark's point,
or from two step sizes at once (`fit_split`). Pure: it runs only the planner's simulation."""

from __future__ import annotations

from collections.abc import Callable

from pipelinerl.planner.calibration import Calibration
from pipelinerl.planner.simulation import simulate

MIN_BASE = 1e-6  # decode_base_s must be > 0
SIM_STEPS = 300  # simulated sync steps per phase estimate


def sync_gen_phase(calib: Calibration, job, mean_row_tokens: float, seed: int = 0) -> float:
    """The simulated sync step less its training and weight update: the generation phase."""
    spec = job.spec
    r = simulate(
        "sync",
        1,
        1,
        0,
        spec.trainer.samples_per_step,
        spec.rl.attempts,
        calib,
        spec.generator.sampling.max_tokens,
        steps=SIM_STEPS,
        warmup=1,
        seed=seed,
    )
    train = calib.train_s(mean_row_tokens, 1) + calib.optimizer_step_s
    return r.step_s - train - max(calib.weight_sync_s, calib.pause_s)


def fit_line(
    line: Callable[[float], Calibration], job, rows: float, target: float, lo: float, hi: float
) -> Calibration | None:
    """The calibration `line(x)`, x >= lo, whose simulated sync generation phase is `target`
    (the phase grows with x along each line used here); None if even line(lo) is slower."""

    def gap(x: float) -> float:
        return sync_gen_phase(line(x), job, rows) - target

    if gap(lo) > 0:
        return None
    while gap(hi) < 0:
        hi *= 2
    for _ in range(30):  # bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return line((lo + hi) / 2)


def fit_base(calib: Calibration, job, rows: float, target: float, per_seq: float, hi: float) -> Calibration | None:
    """decode_per_seq_s fixed, decode_base_s solved."""
    return fit_line(
        lambda b: calib.model_copy(update={"decode_base_s": b, "decode_per_seq_s": per_seq}),
        job,
        rows,
        target,
        MIN_BASE,
        hi,
    )


def fit_decode(calib: Calibration, job, rows: float, target: float, step_at: float, batch: int) -> Calibration:
    """Through the engine benchmark's point (`batch` sequences per step take `step_at`):
    per_seq = (step_at - base) / batch. If even a flat cost (base = step_at) is too fast for
    the phase, the point cannot hold: the base alone then. If even its slope alone (base ~0)
    is too slow (the engine has become faster per sequence than when benchmarked), the
    slope alone, solved."""
    if sync_gen_phase(calib.model_copy(update={"decode_base_s": step_at, "decode_per_seq_s": 0.0}), job, rows) < target:
        return fit_base(calib, job, rows, target, 0.0, step_at)
    through_point = fit_line(
        lambda b: calib.model_copy(update={"decode_base_s": b, "decode_per_seq_s": (step_at - b) / batch}),
        job,
        rows,
        target,
        MIN_BASE,
        step_at,
    )
    if through_point is not None:
        return through_point
    slope_only = fit_line(
        lambda k: calib.model_copy(update={"decode_base_s": MIN_BASE, "decode_per_seq_s": k}),
        job,
        rows,
        target,
        0.0,
        step_at / batch,
    )
    if slope_only is None:
        raise SystemExit(f"the sync generation phase ({target:.3f} s) is too short for any decode cost")
    return slope_only


def fit_split(calib: Calibration, job, rows: float, target: float, other: tuple, hi: float) -> Calibration | None:
    """Base and slope both, from the sync generation phases at two step sizes: along the pairs
    that give `target` for `job`, the base that also gives the phase of `other` (job, row
    tokens, phase), a step of another size. (More base lengthens a small step's phase more,
    its batch being smaller.) None where no pair with base >= MIN_BASE and slope >= 0 fits."""
    job2, rows2, target2 = other

    def on_line(b: float) -> Calibration:  # the slope for base b (0 once b alone is as slow)
        return fit_line(
            lambda k: calib.model_copy(update={"decode_base_s": b, "decode_per_seq_s": k}), job, rows, target, 0.0, hi
        ) or calib.model_copy(update={"decode_base_s": b, "decode_per_seq_s": 0.0})

    def gap(b: float) -> float:
        return sync_gen_phase(on_line(b), job2, rows2) - target2

    flat = fit_base(calib, job, rows, target, 0.0, hi)  # the largest base: no slope
    if flat is None or gap(MIN_BASE) > 0 or gap(flat.decode_base_s) < 0:
        return None
    lo, hi_b = MIN_BASE, flat.decode_base_s
    for _ in range(25):  # bisection
        mid = (lo + hi_b) / 2
        lo, hi_b = (mid, hi_b) if gap(mid) < 0 else (lo, mid)
    return on_line((lo + hi_b) / 2)
