"""The benchmarks' verdicts (pure): time to target on held-out accuracy curves, ratios of two
sides, and a headline a re-run reproduces.

The method, for a comparison of a fast side against a baseline (bench/README.md, "Method"):
- rounds are independent: round r runs every side with seed `round_seed(base, r)`, so rounds
  differ on every side (TRL included) and sides share the seed set;
- each round's curve gives its own time to each target (`time_to_target([run], gain)`), and
  its ratio baseline/fast at that target (`round_bound`);
- the headline is one estimator, point and interval: the geometric mean of the per-round
  medians over a band of targets (every point from +5 to +15 by default) and its 90%
  t-interval over rounds (`band_headline`, `log_t_interval`): one target or one lucky
  evaluation does not decide it. A target one side of a round never reached is censored, not
  void: its ratio is bounded by that side's last evaluation (`round_bound`: at least, or at
  most, that), and the bound enters the estimate, counted (`censored`). The rounds a ratio of
  1.3x needs to resolve at the spread seen are printed (`rounds_to_resolve`). Pooled curves
  (`pooled_ratio`) are reported beside it;
- a curve starts at the warm start, at the start of training, so a target reached before the
  first evaluation is interpolated between the two instead of taken as the first evaluation's
  time (start-up plus the evaluation interval); how many band targets were resolved that way is
  reported (`early_targets`);
- every time is read on three clocks (`CLOCKS`): from launch (start-up included), from the
  first generated token, and from the start of training;
- each side runs at its best learning rate of one grid (`best_setting`).
"""

from __future__ import annotations

import math
import random
import statistics

CLOCKS = ("launch", "first_token", "time")


def round_seed(base: int, round_index: int) -> int:
    """Round r's seed, the same on every side: rounds are independent runs, not re-timings."""
    return base + round_index


def train_start(steps: list[dict]) -> float:
    return steps[0]["time"] - steps[0]["train_seconds"]


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent
    violators). Expected held-out accuracy rises with training; single evaluations swing by
    ±5 points around it (policy noise as much as evaluation noise), so a crossing is read off
    this fit rather than off the first lucky evaluation."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def crossing_time(points: list[tuple[float, float]], target: float) -> float | None:
    """When the isotonic fit of (time, accuracy) points first reaches `target`, interpolated
    linearly between the fitted points around it (None if it never does)."""
    points = sorted(points)
    fit = isotonic([a for _, a in points])
    for i, (a, (t, _)) in enumerate(zip(fit, points)):
        if a >= target:
            if i == 0:
                return t
            a0, t0 = fit[i - 1], points[i - 1][0]
            return t0 + (t - t0) * (target - a0) / (a - a0)
    return None


def has_clock(run: dict, axis: str) -> bool:
    return axis in ("time", "version") or axis in run.get("clock_origins", {})


def clock_origin(run: dict, axis: str) -> float:
    """When `axis`'s clock starts, in the run's own time base (that of its steps and evals)."""
    if axis == "time":
        return train_start(run["steps_log"])
    if not has_clock(run, axis):
        raise SystemExit(f"a run has no {axis!r} clock (saved before clocks were recorded): only 'time' applies")
    return run["clock_origins"][axis]


def curve(run: dict, axis: str = "time") -> list[tuple[float, float]]:
    """A run's held-out curve: (seconds on the `axis` clock, accuracy) per evaluated version, or
    with axis="version" (version, accuracy). It starts with the warm start at the start of
    training (the model is the warm start until the first optimizer step), so a crossing before
    the first evaluation is interpolated from there. Clocks (`CLOCKS`): "time" from the start of
    training, "first_token" from the first token generated, "launch" from the command that
    started the run (start-up included)."""
    if axis == "version":
        return [(e["version"], e["accuracy"]) for e in run["evals"]]
    start, trained = clock_origin(run, axis), train_start(run["steps_log"])
    return [((trained if e["version"] == 0 else e["time"]) - start, e["accuracy"]) for e in run["evals"]]


def time_to_target(runs: list[dict], gain_points: float, axis: str = "time") -> float | None:
    """Seconds (axis="version": optimizer steps) to the warm start's accuracy + `gain_points` on
    the isotonic fit of the pooled curves of `runs` (one run: its own time to target)."""
    warm = sum(e["accuracy"] for x in runs for e in x["evals"] if e["version"] == 0) / len(runs)
    return crossing_time([p for x in runs for p in curve(x, axis)], warm + gain_points / 100)


def early_targets(run: dict, gains: list[float], axis: str = "time") -> list[float]:
    """The targets of `gains` this run reaches before its first evaluation after the warm start:
    their times are interpolated from the warm start, not resolved by an evaluation."""
    evaluated = [t for (t, _), e in zip(curve(run, axis), run["evals"]) if e["version"] > 0]
    first = min(evaluated, default=None)
    times = [time_to_target([run], g, axis) for g in gains]
    return [g for g, t in zip(gains, times) if t is not None and first is not None and t < first]


# One-sided 95% quantiles of Student's t (df 1..30): a two-sided 90% interval.
T95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
       1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
       1.699, 1.697]  # fmt: skip


def log_t_interval(values: list[float | None]) -> dict[str, float | None]:
    """The geometric mean of per-round ratios and its 90% t-interval (on their logs: ratios are
    multiplicative). None where it cannot be formed: fewer than two rounds, or a round whose
    ratio is unbounded (a side missed the targets) or missing."""
    if len(values) < 2 or any(v is None or not 0 < v < math.inf for v in values):
        return {"geomean": None, "low": None, "high": None, "n": len(values)}
    logs = [math.log(v) for v in values]  # type: ignore[arg-type]
    mean, n = statistics.fmean(logs), len(logs)
    half = (T95[n - 2] if n - 1 <= len(T95) else 1.645) * statistics.stdev(logs) / math.sqrt(n)
    return {"geomean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "n": n}


def pooled_ratio(pipeline: list[dict], sync: list[dict], gain_points: float, axis: str = "time") -> float:
    """Sync/pipeline time (or steps) to target on the pooled curves: inf if only sync misses the
    target, 0 if only the pipeline does, nan if both do."""
    s, p = (time_to_target(x, gain_points, axis) for x in (sync, pipeline))
    s, p = (math.inf if v is None else v for v in (s, p))
    return math.nan if s == p == math.inf else (math.inf if p == 0 else s / p)


def bootstrap_interval(
    pipeline: list[dict], baseline: list[dict], gain_points: float, resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """5th/50th/95th percentile of the pooled baseline/pipeline time-to-target ratio over rounds
    drawn with replacement (a round's runs go together: they were measured side by side). Runs
    of either side end several points apart; this says how uncertain a pooled ratio is."""
    rng = random.Random(seed)
    n, m = len(pipeline), len(baseline)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        jdx = idx if m == n else [rng.randrange(m) for _ in range(m)]  # runs pooled unpaired: each side alone
        ratios.append(pooled_ratio([pipeline[i] for i in idx], [baseline[j] for j in jdx], gain_points))
    both_missed = sum(math.isnan(r) for r in ratios)
    ratios = sorted(r for r in ratios if not math.isnan(r))
    pick = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))] if ratios else None  # noqa: E731
    return {"p5": pick(0.05), "p50": pick(0.5), "p95": pick(0.95), "resamples": resamples, "both_missed": both_missed}


def accuracy_gap(runs: dict[str, list[dict]]) -> dict[int, float]:
    """Per evaluated version: mean held-out accuracy of the pipeline runs minus the sync runs',
    in points (how much each optimizer step learns, whatever it cost in time)."""
    means = {mode: {} for mode in runs}
    for mode, xs in runs.items():
        for v in sorted({e["version"] for x in xs for e in x["evals"]}):
            accs = [e["accuracy"] for x in xs for e in x["evals"] if e["version"] == v]
            means[mode][v] = sum(accs) / len(accs)
    return {v: 100 * (means["pipeline"][v] - means["sync"][v]) for v in means["pipeline"] if v in means["sync"]}


def run_end(run: dict, axis: str = "time") -> float:
    """The run's last evaluation on `axis`'s clock: a target it never reached lies beyond."""
    return max(t for t, _ in curve(run, axis))


def round_bound(fast: dict, baseline: dict, gain_points: float, axis: str = "time") -> tuple[float | None, str]:
    """Baseline/fast time to target in one round, censored where a side never reached it: the
    ratio is then at least baseline's last evaluation / fast's time ("at least"), or at most
    baseline's time / fast's last evaluation ("at most"); (None, "missed") if neither side did."""
    f, b = (time_to_target([x], gain_points, axis) for x in (fast, baseline))
    if f is None and b is None:
        return None, "missed"
    if b is None:
        return run_end(baseline, axis) / max(f, 1e-9), "at least"
    if f is None:
        return b / run_end(fast, axis), "at most"
    return b / max(f, 1e-9), "exact"


Z80 = 0.8416  # the normal quantile of 80% power


def rounds_to_resolve(per_round: list[float | None], effect: float = 1.3) -> int | None:
    """Rounds whose 90% t-interval tells a ratio of `effect` from 1 with 80% power, at the
    spread of these rounds' log ratios; None with fewer than two finite rounds."""
    logs = [math.log(v) for v in per_round if v is not None and 0 < v < math.inf]
    return rounds_for_sd(statistics.stdev(logs), effect) if len(logs) >= 2 else None


def rounds_for_sd(sd: float, effect: float = 1.3) -> int | None:
    """Rounds whose 90% t-interval tells `effect` from 1 with 80% power at a per-round spread
    `sd` (of log ratios)."""
    for n in range(2, 100_000):
        t = T95[n - 2] if n - 1 <= len(T95) else 1.645
        if (t + Z80) * sd / math.sqrt(n) <= math.log(effect):
            return n
    return None


def round_ratio(fast: dict, baseline: dict, gains: list[float], axis: str = "time") -> float | None:
    """One round's baseline/fast ratio over the band: the median of its targets' ratios, a
    censored target at its bound (`round_bound`), targets neither side reached left out."""
    return _median([round_bound(fast, baseline, g, axis)[0] for g in gains])


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def evaluation_spread(
    fast: list[dict], baseline: list[dict], gains: list[float], axis: str = "time", resamples: int = 200, seed: int = 0
) -> dict | None:
    """How much of the rounds' spread the held-out set's sampling makes: in each round whose runs
    kept their per-problem results (`eval_correct`, aligned with `evals`), the problems drawn
    again with replacement, one draw for every evaluation of both sides (they were posed the
    same problems), and the round's ratio (`round_ratio`) read again; the spread of its log over
    the draws. Beside it the spread seen between rounds, and the rounds a 1.3x ratio would need
    with k times the problems: the set's part shrinks as 1/k, the runs' own part (the spread
    between rounds less the set's; none where the set's is larger) stays. An upper bound on the
    set's part: every round is posed the same problems, so a part of the draw common to all
    rounds does not spread them. None if no round kept per-problem results."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per_round, problems = [], 0
    for f, b in zip(fast, baseline):
        if not (f.get("eval_correct") and b.get("eval_correct")):
            continue
        sides = [(x, np.array([[c == "1" for c in row] for row in x["eval_correct"]], float)) for x in (f, b)]
        problems = sides[0][1].shape[1]
        if sides[1][1].shape[1] != problems:
            raise ValueError(
                "the sides of a round were evaluated on different problems: they cannot be redrawn together"
            )
        logs = []
        for _ in range(resamples):
            weights = np.bincount(rng.integers(0, problems, problems), minlength=problems) / problems
            redrawn = [
                x | {"evals": [e | {"accuracy": float(a)} for e, a in zip(x["evals"], m @ weights)]} for x, m in sides
            ]
            r = round_ratio(*redrawn, gains, axis)
            if r is not None and 0 < r < math.inf:
                logs.append(math.log(r))
        per_round.append(statistics.pstdev(logs) if len(logs) > 1 else None)
    known = [v for v in per_round if v is not None]
    if not known:
        return None
    sd = math.sqrt(statistics.fmean(v * v for v in known))
    seen = [round_ratio(f, b, gains, axis) for f, b in zip(fast, baseline)]
    logs = [math.log(v) for v in seen if v is not None and 0 < v < math.inf]
    observed = statistics.stdev(logs) if len(logs) >= 2 else None
    out = {"problems": problems, "sd": sd, "per_round_sd": per_round, "observed_sd": observed, "clock": axis}
    if observed is not None:
        runs_part = max(observed**2 - sd**2, 0.0)
        out["share"] = min(sd**2 / observed**2, 1.0) if observed else None
        out["rounds_for_1.3x_with_problems"] = {
            f"x{k}": rounds_for_sd(math.sqrt(runs_part + sd**2 / k)) for k in (1, 4, 16)
        }
    return out


def band_headline(fast: list[dict], baseline: list[dict], gains: list[float], axis: str = "time") -> dict:
    """baseline/fast over the band of targets `gains`: per round, the median of its ratios (a
    censored target at its bound, `round_bound`); the headline, their geometric mean and its
    90% t-interval (`log_t_interval`; rounds pair by index: same seed, run side by side). The
    median over rounds and targets is kept beside it (`median`). Targets missed by both sides
    of a round are left out and counted, censored ones counted; targets either side reached
    before its first evaluation are counted too (`early`)."""
    rounds = list(zip(fast, baseline))
    bounded = [[round_bound(f, b, g, axis) for g in gains] for f, b in rounds]
    table = [[v for v, _ in row] for row in bounded]

    per_round = [_median(row) for row in table]  # each round's `round_ratio`
    early = sum(len(early_targets(x, gains, axis)) for x in fast + baseline)
    return {
        "median": _median([v for row in table for v in row]),
        **log_t_interval(per_round),
        "censored": sum(kind in ("at least", "at most") for row in bounded for _, kind in row),
        "rounds_for_1.3x": rounds_to_resolve(per_round),
        "per_round": per_round,
        "per_round_by_gain": {f"+{g:g}": [row[i] for row in table] for i, g in enumerate(gains)},
        "both_missed": sum(kind == "missed" for row in bounded for _, kind in row),
        "early": early,
        "targets": len(gains) * len(fast + baseline),
        "rounds": len(table),
        "gains": list(gains),
        "clock": axis,
    }


def best_setting(runs_by_setting: dict[str, list[dict]], gains: list[float], axis: str = "time") -> str:
    """The setting (e.g. a learning rate) of one side whose runs reach the band's targets
    soonest: the lowest median over runs and targets of the time to target (a miss counts as
    never); ties, and settings that reach none, go to the higher final accuracy."""

    def score(setting: str) -> tuple[float, float]:
        xs = runs_by_setting[setting]
        times = [time_to_target([x], g, axis) for x in xs for g in gains]
        median = statistics.median(math.inf if t is None else t for t in times)
        return median, -statistics.fmean(x["evals"][-1]["accuracy"] for x in xs)

    return min(runs_by_setting, key=score)
