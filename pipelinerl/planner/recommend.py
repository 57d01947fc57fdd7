"""Planner recommendation: the best split of the devices and max lag for a job (`plan`).

Simulates pipeline mode over the splits of the devices between trainers and generators, then
over the max lags at the best split; and the conventional baseline, k optimizer steps per
generation phase for k = 1, 2, 4, … up to `max_k`, both split (each k at its best split) and
colocated (every device generates, then every device trains). Then formats the comparison
(`format_plan`): the pipeline against k = 1 and against the best k, each named by its baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pipelinerl.planner.calibration import Calibration, Lengths, at_tensor_parallel
from pipelinerl.planner.sim_params import CLIMB_LIFETIMES, WINDOW_LIFETIMES, SimResult, wave_groups
from pipelinerl.planner.simulation import simulate
from pipelinerl.spec import PipelineRLJob

LAGS = (1, 2, 4, 8, 16, 32, 64)
# Recommend the smallest max lag whose throughput is within this fraction of the best one:
# fresher data is worth a little throughput.
LAG_TOLERANCE = 0.03
# The conventional baseline's k is searched over powers of two up to this (the PipelineRL
# paper's baseline: k = 32, the largest that trained stably there).
MAX_K = 32
# Inputs a team rarely knows before a run, so the ratios against the best k are also simulated
# under variants of them, at the configurations chosen for the calibration (what the team would
# deploy), and reported as a range: completion lengths (the mean halved and doubled, the spread,
# a lognormal's sigma, halved and 1.5x) and, where the calibration says how its costs scale,
# tensor parallelism (engines of half and twice its devices, at the nearest split they allow).
LENGTH_VARIANTS = {"mean x0.5": (0.5, 1.0), "mean x2": (2.0, 1.0), "sigma x0.5": (1.0, 0.5), "sigma x1.5": (1.0, 1.5)}
TP_FACTORS = (0.5, 2.0)


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
    lag_sweep: tuple[SimResult, ...]  # pipeline at its best split, one per max lag in LAGS
    conventional: tuple[SimResult, ...]  # split: each k (1, 2, 4, …) at its best split
    colocated: tuple[SimResult, ...]  # each k, every device generating then training
    filtered: float = 0.0  # share of generated groups dropped by zero-variance filtering
    max_running: int | None = None  # cap on running sequences per engine, if any
    baseline_logprob_pass: float = 0.0  # the conventional baseline's own log-prob pass (`SimParams`)
    # the pipeline / best k (split, colocated) ratios under each variant (`variants_of`)
    variants: dict[str, dict[str, float]] | None = None

    def ratio_range(self, baseline: str) -> tuple[float, float]:
        """The lowest and highest pipeline / `baseline` ratio ("best_split", "best_colocated")
        over the calibration's inputs and their variants."""
        point = self.vs(self.best_split if baseline == "best_split" else self.best_colocated)
        values = [point, *(v[baseline] for v in (self.variants or {}).values())]
        return min(values), max(values)

    @property
    def sync(self) -> SimResult:
        """This project's sync mode: conventional k = 1, split."""
        return self.conventional[0]

    @property
    def best_split(self) -> SimResult:
        return _fastest(self.conventional)

    @property
    def best_colocated(self) -> SimResult:
        return _fastest(self.colocated)

    @property
    def recommended(self) -> SimResult:
        """The freshest of the modes this project runs (the pipeline, or conventional k split;
        colocated phases are a baseline only) within LAG_TOLERANCE of the fastest of them."""
        runs = (self.pipeline, *self.conventional)
        top = max(r.useful_samples_per_s for r in runs)
        return min(
            (r for r in runs if r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * top),
            key=lambda r: (r.lag_mean, -r.useful_samples_per_s),
        )

    def vs(self, baseline: SimResult) -> float:
        """The pipeline's useful throughput over a baseline's."""
        return self.pipeline.useful_samples_per_s / baseline.useful_samples_per_s

    @property
    def speedup(self) -> float:
        """Against conventional k = 1, split (this project's sync mode)."""
        return self.vs(self.sync)

    @property
    def speedup_vs_colocated(self) -> float:
        """Against conventional k = 1, colocated."""
        return self.vs(self.colocated[0])

    @property
    def speedup_vs_best_split(self) -> float:
        return self.vs(self.best_split)

    @property
    def speedup_vs_best_colocated(self) -> float:
        return self.vs(self.best_colocated)

    def speedups(self) -> dict[str, float]:
        """Each ratio by its baseline's name (the JSON report's)."""
        return {
            "speedup": self.speedup,
            "speedup_vs_colocated": self.speedup_vs_colocated,
            "speedup_vs_best_split": self.speedup_vs_best_split,
            "speedup_vs_best_colocated": self.speedup_vs_best_colocated,
        }


def _fastest(results: tuple[SimResult, ...]) -> SimResult:
    return max(results, key=lambda r: (r.useful_samples_per_s, -r.steps_per_generation))


def ks(max_k: int) -> tuple[int, ...]:
    """The k searched: powers of two up to max_k (1 included)."""
    if max_k < 1:
        raise ValueError(f"max_k ({max_k}) must be >= 1")
    out = [1]
    while out[-1] * 2 <= max_k:
        out.append(out[-1] * 2)
    return tuple(out)


def splits(gpus: int, trainer_granularity: int, gpus_per_engine: int) -> list[int]:
    """Trainer device counts to try: whole trainer pods, the rest whole generator engines."""
    return [
        t
        for t in range(trainer_granularity, gpus, trainer_granularity)
        if (gpus - t) >= gpus_per_engine and (gpus - t) % gpus_per_engine == 0
    ]


def _probe(grid: list[int], run: Callable[[int], SimResult]) -> tuple[Callable[[int], float], dict[int, SimResult]]:
    """A split's useful samples/s by its index in `grid`, each simulated once (the results kept)."""
    cache: dict[int, SimResult] = {}

    def f(i: int) -> float:
        if i not in cache:
            cache[i] = run(grid[i])
        return cache[i].useful_samples_per_s

    return f, cache


def _best(grid: list[int], run: Callable[[int], SimResult]) -> SimResult:
    """Maximise useful samples/s over the splits by golden-section search: throughput is
    unimodal in the split (too few trainers starve on training, too few generators on
    generation), and each probe is reused by the next, so 128 choices cost ~10 simulations."""
    f, cache = _probe(grid, run)
    lo, hi = 0, len(grid) - 1
    while hi - lo > 3:
        d = round((hi - lo) * 0.382)
        a, b = lo + d, hi - d
        if f(a) < f(b):
            lo = a
        else:
            hi = b
    return cache[max(range(lo, hi + 1), key=lambda i: (f(i), -i))]


def _climb(grid: list[int], start: int, run: Callable[[int], SimResult]) -> SimResult:
    """The best split near `start` (a neighbouring k's best): hill-climb one grid step at a
    time while throughput rises (the optimum moves little from k to 2k)."""
    f, cache = _probe(grid, run)
    i = min(range(len(grid)), key=lambda j: abs(grid[j] - start))
    for step in (-1, 1):
        while 0 <= i + step < len(grid) and f(i + step) > f(i):
            i += step
    f(i)
    return cache[i]


def plan(
    job: PipelineRLJob,
    gpus: int,
    calib: Calibration,
    lengths: Lengths | None = None,
    seed: int = 0,
    max_k: int = MAX_K,
    max_running: int | None = None,
    baseline_logprob_pass: float = 0.0,
) -> Plan:
    """Best pipeline config (split, then the smallest max lag within LAG_TOLERANCE of the best
    throughput) and the conventional baseline for each k (split at its best split, and
    colocated), for `gpus` devices. `max_running`: a cap on running sequences per engine in
    every mode (the reference implementation's llm_max_rollouts). `baseline_logprob_pass`: the
    share of its training cost the conventional baseline adds to recompute the old policy's
    log-probs (a peer's trainer: `SimParams.logprob_pass`; 0 for this project's sync mode)."""
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
        max_running=max_running,
    )

    # The split at the largest lag (least constrained), then the lag at that split. Only the
    # pipeline caps its groups in flight (fresher samples); a conventional phase runs at once.
    # Each mode's simulation at the calibration's inputs, or with a variant's `change`.
    def pipeline(t: int, lag: int, probe: bool = False, **change: Any) -> SimResult:
        # The search's probes measure over one lifetime (they only rank the splits).
        lifetimes = 1.0 if probe else None
        at = common | change
        return simulate(
            "pipeline",
            gpus - t,
            t,
            lag,
            wave_groups=wave_groups(job, t, at["lengths"] or at["calib"].lengths),
            max_inflight=spec.generator.max_inflight_groups,
            window_lifetimes=lifetimes or WINDOW_LIFETIMES,
            climb_lifetimes=lifetimes or CLIMB_LIFETIMES,
            **at,
        )

    best = _best(grid, lambda t: pipeline(t, LAGS[-1], probe=True))
    sweep = tuple(pipeline(best.trainers, lag) for lag in LAGS)
    top = max(r.useful_samples_per_s for r in sweep)
    chosen = next(r for r in sweep if r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * top)

    baseline = common | {"logprob_pass": baseline_logprob_pass}

    def conventional(t: int, k: int, **change: Any) -> SimResult:
        return simulate("sync", gpus - t, t, 0, steps_per_generation=k, **(baseline | change))

    def colocated_k(k: int, **change: Any) -> SimResult:
        return simulate("sync", gpus, gpus, 0, steps_per_generation=k, colocated=True, **(baseline | change))

    split: list[SimResult] = []
    for k in ks(max_k):
        if not split:
            split.append(_best(grid, lambda t: conventional(t, k)))
        else:
            split.append(_climb(grid, split[-1].trainers, lambda t: conventional(t, k)))
    colocated = tuple(colocated_k(k) for k in ks(max_k))
    best_split, best_colocated = _fastest(tuple(split)), _fastest(colocated)
    variants = {}
    for name, change in variants_of(lengths or calib.lengths, calib).items():
        # The splits chosen, or the nearest an engine of the variant's devices allows.
        grid_at = splits(gpus, max(spec.trainer.gpus, 1), change.get("calib", calib).gpus_per_engine)
        if not grid_at:
            continue

        def near(trainers: int) -> int:
            return min(grid_at, key=lambda g: (abs(g - trainers), g))

        pipe = pipeline(near(chosen.trainers), chosen.max_lag, **change)
        k_split = conventional(near(best_split.trainers), best_split.steps_per_generation, **change)
        k_col = colocated_k(best_colocated.steps_per_generation, **change)
        variants[name] = {
            "best_split": pipe.useful_samples_per_s / k_split.useful_samples_per_s,
            "best_colocated": pipe.useful_samples_per_s / k_col.useful_samples_per_s,
        }
    return Plan(
        job=job.name,
        model=spec.model.path,
        gpus=gpus,
        calibration=calib.name,
        samples_per_step=spec.trainer.samples_per_step,
        attempts=spec.rl.attempts,
        max_tokens=spec.generator.sampling.max_tokens,
        pipeline=chosen,
        lag_sweep=sweep,
        conventional=tuple(split),
        colocated=colocated,
        filtered=filtered,
        max_running=max_running,
        baseline_logprob_pass=baseline_logprob_pass,
        variants=variants,
    )


def variants_of(lengths: Lengths, calib: Calibration) -> dict[str, dict[str, Any]]:
    """Each variant's name and what it changes of the simulation's inputs (pure): LENGTH_VARIANTS
    of `lengths`, and TP_FACTORS of the calibration's devices per engine where it says how its
    costs scale (a TP whose engines cannot hold the model is left out)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (mean_x, sigma_x) in LENGTH_VARIANTS.items():
        varied = vary(lengths, mean_x, sigma_x)
        if varied is not None:
            out[name] = {"lengths": varied}
    if calib.tensor_parallel is not None:
        for factor in TP_FACTORS:
            tp = round(calib.gpus_per_engine * factor)
            if tp >= 1 and tp != calib.gpus_per_engine:
                try:
                    out[f"TP {tp}"] = {"calib": at_tensor_parallel(calib, tp)}
                except ValueError:
                    continue
    return out


def vary(lengths: Lengths, mean_x: float, sigma_x: float) -> Lengths | None:
    """The lengths with their mean scaled by `mean_x` and a lognormal's sigma by `sigma_x`; an
    empirical list has its values scaled (no sigma to change: None for a sigma variant)."""
    if lengths.distribution == "empirical":
        if sigma_x != 1.0:
            return None
        return lengths.model_copy(update={"values": [max(1, round(v * mean_x)) for v in lengths.values]})
    assert lengths.mean_tokens is not None  # a lognormal's, validated
    return lengths.model_copy(update={"mean_tokens": lengths.mean_tokens * mean_x, "sigma": lengths.sigma * sigma_x})


def _devices(r: SimResult) -> str:
    return f"{r.generators} devices, colocated" if r.colocated else f"{r.generators} + {r.trainers}"


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
        "lag max",
        "dropped %",
        "gen idle %",
        "batch fill %",
        "train idle %",
    )
    rows = []
    for r in (*p.lag_sweep, *p.conventional, *p.colocated):
        rows.append(
            (
                "*" if r is p.recommended else "",
                r.label,
                str(r.generators),
                str(r.trainers),
                str(r.max_lag) if r.mode == "pipeline" else "-",
                f"{r.samples_per_s:.3g}",
                f"{r.step_s:.3g}",
                f"{r.lag_mean:.2f}",
                f"{r.lag_p95:.0f}",
                str(r.lag_max),
                f"{100 * r.dropped:.1f}",
                f"{100 * (1 - r.gen_busy):.0f}",
                f"{100 * r.gen_fill:.0f}",
                f"{100 * (1 - r.train_busy):.0f}",
            )
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    filtered = f", {100 * p.filtered:.0f}% of groups filtered as zero-variance" if p.filtered else ""
    capped = f", at most {p.max_running} sequences running per engine" if p.max_running else ""
    share = 100 * p.baseline_logprob_pass
    recomputes = f", the conventional baseline recomputing log-probs (+{share:.0f}% training)" if share else ""
    lines = [
        f"{p.job}: {p.model}, {p.samples_per_step} samples/step ({p.attempts} attempts{filtered}), "
        f"maxTokens {p.max_tokens}, {p.gpus} devices{capped}{recomputes}, calibration {p.calibration}",
        "",
    ]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    r, pipe = p.recommended, p.pipeline
    lines += [
        "",
        f"recommendation: {r.label}"
        + (f", maxLag {r.max_lag}" if r.mode == "pipeline" else "")
        + f", {r.generators} generator + {r.trainers} trainer devices: {r.samples_per_s:.3g} samples/s",
        f"pipeline (maxLag {pipe.max_lag}, {_devices(pipe)}), useful samples/s against conventional RL "
        "(k optimizer steps per generation phase):",
    ]
    for what, base in (
        ("k = 1", p.sync),
        ("k = 1", p.colocated[0]),
        ("best k", p.best_split),
        ("best k", p.best_colocated),
    ):
        lines.append(f"  vs {what:6s} {base.label} ({_devices(base)}): {p.vs(base):.2f}x")
    if p.variants:
        ranges = {b: p.ratio_range(b) for b in ("best_split", "best_colocated")}
        lines.append(
            f"  over the inputs a team rarely knows ({', '.join(p.variants)}): vs best k split "
            f"{ranges['best_split'][0]:.2f}-{ranges['best_split'][1]:.2f}x, vs best k colocated "
            f"{ranges['best_colocated'][0]:.2f}-{ranges['best_colocated'][1]:.2f}x"
        )
    return "\n".join(lines)
