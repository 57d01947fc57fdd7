"""Pipeline vs sync learning speed: the same job, seed and hardware in `mode: pipeline` and
`mode: sync`, generator and trainer each pinned to their own core, runs alternated P S P S ….

    .venv/bin/python -m bench.pipeline_vs_sync [--rounds 2] [--steps 150] [--gain 10] [--max-lag N]

Reports per mode: trained samples/s, seconds per step, wall time from the first training step
to a held-out accuracy `--gain` points above the warm start, generator and trainer busy
fractions, the token lag distribution and ESS; then the pipeline/sync ratios per round.
Per-step records are kept in the JSON (the planner is calibrated from them).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import yaml

from bench.common import paired_ratios, save, summary, table
from pipelinerl.local import run_local
from pipelinerl.spec import parse_job

JOB = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def job_for(mode: str, steps: int, eval_interval: int, eval_problems: int, tag: str, max_lag: int | None = None):
    data = yaml.safe_load(JOB.read_text())
    spec = copy.deepcopy(data["spec"])
    spec["mode"] = mode
    spec["trainer"]["maxSteps"] = steps
    spec["trainer"]["checkpointInterval"] = 0
    spec["eval"] = {"interval": eval_interval, "problems": eval_problems}
    if mode == "sync":
        spec["rl"].pop("maxLag", None)  # sync means lag 0
    elif max_lag is not None:
        spec["rl"]["maxLag"] = max_lag
    return parse_job({**data, "metadata": {"name": f"bench-{mode}-{tag}"}, "spec": spec}, f"{JOB} ({mode})")


def train_start(steps: list[dict]) -> float:
    return steps[0]["time"] - steps[0]["train_seconds"]


def time_to_target(evals: list[dict], start: float, gain_points: float, window: int = 3) -> float | None:
    """Seconds from the start of training until the running mean of `window` consecutive
    held-out evaluations is `gain_points` above the warm start (None if never): single
    evaluations swing by a few points, the smoothed curve does not."""
    evals = sorted(evals, key=lambda r: r["version"])
    target = evals[0]["accuracy"] + gain_points / 100
    for i in range(window, len(evals) + 1):
        recent = evals[i - window:i]
        if recent[0]["version"] > 0 and sum(e["accuracy"] for e in recent) / window >= target:
            return recent[-1]["time"] - start
    return None


def pooled_curve(runs: list[dict]) -> list[dict]:
    """A mode's held-out curve averaged over its rounds: per version evaluated in every round,
    the mean accuracy and the mean time since the start of training. Single runs swing by
    ±5 points between evaluations (policy noise as well as evaluation noise); the mean of the
    rounds is a steadier estimate of when a mode reaches the target."""
    by_version: dict[int, list[tuple[float, float]]] = {}
    for x in runs:
        start = train_start(x["steps_log"])
        for e in x["evals"]:
            by_version.setdefault(e["version"], []).append((e["accuracy"], e["time"] - start))
    return [{"version": v, "accuracy": sum(a for a, _ in pts) / len(pts), "time": sum(t for _, t in pts) / len(pts)}
            for v, pts in sorted(by_version.items()) if len(pts) == len(runs)]


def one_run(mode: str, args, tag: str, root: Path) -> dict:
    run_dir = root / f"{mode}-{tag}"
    code = run_local(job_for(mode, args.steps, args.eval_interval, args.eval_problems, tag, args.max_lag), run_dir, quiet=True,
                     pin_cores=True)
    if code:
        raise SystemExit(f"{mode} run failed ({code}); logs in {run_dir / 'logs'}")
    s = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "time", "samples", "tokens", "row_tokens", "train_seconds", "weight_sync_seconds",
            "weight_pause_max_seconds", "groups_filtered", "lag_mean", "ess")
    steps = [{k: r.get(k) for k in keep} for r in records if r["kind"] == "train"]
    evals = [{k: r[k] for k in ("version", "time", "accuracy")} for r in records if r["kind"] == "eval"]
    ttt = time_to_target(evals, train_start(steps), args.gain)
    print(f"  {mode} round {tag}: {s['samples_per_second']:.1f} samples/s, {s['seconds_per_step']:.2f} s/step, "
          f"to target {ttt if ttt is None else round(ttt)} s, gen busy {s.get('generator_busy_fraction', 0):.0%}, "
          f"trainer busy {s['trainer_busy_fraction']:.0%}, accuracy {s['warm_start_accuracy']:.3f} -> "
          f"{s['final_accuracy']:.3f}", flush=True)
    return {**s, "time_to_target_s": ttt, "steps_log": steps, "evals": evals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--gain", type=float, default=10.0, help="target: warm-start accuracy + this many points")
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--eval-problems", type=int, default=500)
    ap.add_argument("--max-lag", type=int, help="the pipeline's rl.maxLag (default: the example's); results go to "
                    "pipeline_vs_sync-maxlagN.json")
    ap.add_argument("--reanalyse", metavar="JSON", nargs="+",
                    help="rebuild the report from saved results (their rounds pooled), run nothing")
    args = ap.parse_args()
    if args.reanalyse:
        runs = {"pipeline": [], "sync": []}
        for path in args.reanalyse:
            saved = json.loads(Path(path).read_text())["runs"]
            for mode in runs:
                runs[mode] += saved[mode]
        for x in runs["pipeline"] + runs["sync"]:
            x["time_to_target_s"] = time_to_target(x["evals"], train_start(x["steps_log"]), args.gain)
        args.rounds = len(runs["pipeline"])
    else:
        runs = {"pipeline": [], "sync": []}
        with tempfile.TemporaryDirectory(prefix="bench-pvs-") as tmp:
            for r in range(args.rounds):
                for mode in runs:
                    runs[mode].append(one_run(mode, args, str(r), Path(tmp)))
    report(runs, args)


def report(runs: dict[str, list[dict]], args) -> None:
    def col(mode: str, key: str) -> list[float]:
        return [x[key] for x in runs[mode] if x.get(key) is not None]

    rows, result = [], {"args": vars(args), "runs": runs, "modes": {}}
    for mode in runs:
        lag: dict[str, int] = {}
        for x in runs[mode]:
            for k, v in x["lag_token_counts"].items():
                lag[k] = lag.get(k, 0) + v
        agg = {k: summary(col(mode, k)) for k in ("samples_per_second", "seconds_per_step", "generator_busy_fraction",
                                                   "trainer_busy_fraction", "mean_ess") if col(mode, k)}
        ttt = col(mode, "time_to_target_s")
        agg["time_to_target_s"] = summary(ttt) if ttt else None
        agg["lag_token_counts"] = lag
        result["modes"][mode] = agg
        rows.append([mode, agg["samples_per_second"]["median"], agg["seconds_per_step"]["median"],
                     agg["time_to_target_s"]["median"] if ttt else "not reached",
                     f"{agg['generator_busy_fraction']['median']:.0%}", f"{agg['trainer_busy_fraction']['median']:.0%}",
                     " ".join(f"{k}:{v}" for k, v in lag.items()), agg["mean_ess"]["median"]])
    print(table(["mode", "samples/s", "s/step", "s to target", "gen busy", "trainer busy", "token lags", "ESS"], rows))
    rate = paired_ratios(col("pipeline", "samples_per_second"), col("sync", "samples_per_second"))
    result["samples_rate_ratio"] = rate
    pairs = [(s["time_to_target_s"], p["time_to_target_s"]) for p, s in zip(runs["pipeline"], runs["sync"])
             if p["time_to_target_s"] and s["time_to_target_s"]]
    result["time_to_target_ratio"] = summary([s / p for s, p in pairs]) if pairs else None
    pooled = {mode: time_to_target(pooled_curve(runs[mode]), 0.0, args.gain) for mode in runs}
    result["pooled_time_to_target_s"] = pooled
    result["pooled_time_to_target_ratio"] = (pooled["sync"] / pooled["pipeline"]
                                             if pooled["sync"] and pooled["pipeline"] else None)
    print(f"pipeline/sync trained-samples rate: {rate['median']:.2f}x (spread {rate['min']:.2f}-{rate['max']:.2f}; "
          f"target >= 1.6x)")
    if pairs:
        t = result["time_to_target_ratio"]
        print(f"sync/pipeline time to target: {t['median']:.2f}x (spread {t['min']:.2f}-{t['max']:.2f}; "
              f"target >= 1.5x; {len(pairs)} of {args.rounds} rounds reached it in both modes)")
    if result["pooled_time_to_target_ratio"]:
        print(f"sync/pipeline time to target on the curves averaged over the rounds: "
              f"{result['pooled_time_to_target_ratio']:.2f}x ({pooled['sync']:.0f} s / {pooled['pipeline']:.0f} s)")
    gen_busy = result["modes"]["pipeline"]["generator_busy_fraction"]["median"]
    print(f"pipeline generator busy: {gen_busy:.0%} (target >= 90%)")
    lag = f" --max-lag {args.max_lag}" if args.max_lag is not None else ""
    save("pipeline_vs_sync" + (f"-maxlag{args.max_lag}" if lag else ""), result,
         f"python -m bench.pipeline_vs_sync --rounds {args.rounds} --steps {args.steps} --gain {args.gain}{lag}")


if __name__ == "__main__":
    main()
