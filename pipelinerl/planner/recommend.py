"""Planner recommendation: the best split of the devices and max lag for a job (`plan`).

Simulates pipeline mode over the splits of the devices between trainers and generators, then
over the max lags at the best split, and sync mode (split, and colocated as a reference), then
formats the comparison (`format_plan`).
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass
from typing import Callable

from pipelinerl.planner.calibration import Calibration, Lengths
from pipelinerl.planner.simulation import SimResult, simulate, wave_groups
from pipelinerl.spec import PipelineRLJob

LAGS = (1, 2, 4, 8, 16)
# Recommend the smallest max lag whose throughput is within this fraction of the best one:
# fresher data is worth a little throughput.
LAG_TOLERANCE = 0.03


@dataclass(frozen=True)
class Plan:
    job: str
    model: str
    gpus: int
    calibration: str
    samples_per_step: int
    attempts: int
    max_tokens: int
    pipeline: SimResult  # best pipeline split, smallest max lag within LAG_TOLERANCE of the best
    sync: SimResult  # best split in sync mode
    colocated: SimResult  # every device generates, then every device trains (the paper's baseline)
    lag_sweep: tuple[SimResult, ...]  # pipeline at its best split, one per max lag in LAGS
    filtered: float = 0.0  # share of generated groups dropped by zero-variance filtering

    @property
    def recommended(self) -> SimResult:
        # Colocation is not something this project runs: it is a reference point only.
        return self.pipeline if self.speedup >= 1 else self.sync

    @property
    def speedup(self) -> float:
        return self.pipeline.useful_samples_per_s / self.sync.useful_samples_per_s

    @property
    def speedup_vs_colocated(self) -> float:
        return self.pipeline.useful_samples_per_s / self.colocated.useful_samples_per_s


def splits(gpus: int, trainer_granularity: int, gpus_per_engine: int) -> list[int]:
    """Trainer device counts to try: whole trainer pods, the rest whole generator engines."""
    return [
        t
        for t in range(trainer_granularity, gpus, trainer_granularity)
        if (gpus - t) >= gpus_per_engine and (gpus - t) % gpus_per_engine == 0
    ]


def _best(grid: list[int], run: Callable[[int], SimResult]) -> SimResult:
    """Maximise useful samples/s over the splits by golden-section search: throughput is
    unimodal in the split (too few trainers starve on training, too few generators on
    generation), and each probe is reused by the next, so 128 choices cost ~10 simulations."""
    cache: dict[int, SimResult] = {}

    def f(i: int) -> float:
        if i not in cache:
            cache[i] = run(grid[i])
        return cache[i].useful_samples_per_s

    lo, hi = 0, len(grid) - 1
    while hi - lo > 3:
        d = round((hi - lo) * 0.382)
        a, b = lo + d, hi - d
        if f(a) < f(b):
            lo = a
        else:
            hi = b
    return cache[max(range(lo, hi + 1), key=lambda i: (f(i), -i))]


def plan(job: PipelineRLJob, gpus: int, calib: Calibration, lengths: Lengths | None = None, seed: int = 0) -> Plan:
    """Best pipeline config (split, then the smallest max lag within LAG_TOLERANCE of the best
    throughput) and best sync split, for `gpus` devices."""
    spec = job.spec
    grid = splits(gpus, max(spec.trainer.gpus, 1), calib.gpus_per_engine)
    if not grid:
        raise ValueError(
            f"--gpus {gpus} leaves no split: need at least one trainer pod "
            f"({max(spec.trainer.gpus, 1)} devices) and one generator engine ({calib.gpus_per_engine})"
        )
    filtered = calib.filtered_fraction if spec.rl.filter_zero_variance else 0.0
    common: dict[str, Any] = dict(
        samples_per_step=spec.trainer.samples_per_step,
        attempts=spec.rl.attempts,
        calib=calib,
        max_tokens=spec.generator.sampling.max_tokens,
        lengths=lengths,
        seed=seed,
        filtered=filtered,
    )

    # The split at the largest lag (least constrained); throughput settles within a few steps,
    # so the search skips the long warm-up that lag statistics need. Then the lag at that split.
    # Only the pipeline caps its groups in flight (fresher samples); sync runs its step at once.
    def pipeline(t: int, lag: int, **kw) -> SimResult:
        return simulate(
            "pipeline",
            gpus - t,
            t,
            lag,
            wave_groups=wave_groups(job, t, lengths or calib.lengths),
            max_inflight=spec.generator.max_inflight_groups,
            **common,
            **kw,
        )

    best = _best(grid, lambda t: pipeline(t, LAGS[-1], steps=10, warmup=3))
    sweep = tuple(pipeline(best.trainers, lag) for lag in LAGS)
    top = max(r.useful_samples_per_s for r in sweep)
    chosen = next(r for r in sweep if r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * top)
    sync = _best(grid, lambda t: simulate("sync", gpus - t, t, 0, **common))
    colocated = simulate("sync", gpus, gpus, 0, **common)
    return Plan(
        job=job.name,
        model=spec.model.path,
        gpus=gpus,
        calibration=calib.name,
        samples_per_step=spec.trainer.samples_per_step,
        attempts=spec.rl.attempts,
        max_tokens=spec.generator.sampling.max_tokens,
        pipeline=chosen,
        sync=sync,
        colocated=colocated,
        lag_sweep=sweep,
        filtered=filtered,
    )


def format_plan(p: Plan) -> str:
    head = (
        "",
        "mode",
        "generators",
        "trainers",
        "max lag",
        "samples/s",
        "step s",
        "lag mean",
        "lag p95",
        "dropped %",
        "gen idle %",
        "batch fill %",
        "train idle %",
    )
    rows = []
    for label, r in [("pipeline", r) for r in p.lag_sweep] + [("sync", p.sync), ("sync colocated", p.colocated)]:
        rows.append(
            (
                "*" if r is p.recommended else "",
                label,
                str(r.generators),
                str(r.trainers),
                str(r.max_lag),
                f"{r.samples_per_s:.3g}",
                f"{r.step_s:.3g}",
                f"{r.lag_mean:.2f}",
                f"{r.lag_p95:.0f}",
                f"{100 * r.dropped:.1f}",
                f"{100 * (1 - r.gen_busy):.0f}",
                f"{100 * r.gen_fill:.0f}",
                f"{100 * (1 - r.train_busy):.0f}",
            )
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    filtered = f", {100 * p.filtered:.0f}% of groups filtered as zero-variance" if p.filtered else ""
    lines = [
        f"{p.job}: {p.model}, {p.samples_per_step} samples/step ({p.attempts} attempts{filtered}), "
        f"maxTokens {p.max_tokens}, {p.gpus} devices, calibration {p.calibration}",
        "",
    ]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    r = p.recommended
    lines += [
        "",
        f"recommendation: mode {r.mode}, {r.generators} generator + {r.trainers} trainer devices, "
        f"maxLag {r.max_lag}: {r.samples_per_s:.3g} samples/s",
        f"pipeline vs sync: {p.speedup:.2f}x (best split each); vs colocated sync "
        f"(the paper's baseline): {p.speedup_vs_colocated:.2f}x",
    ]
    return "\n".join(lines)
