"""Peer benchmark: this project (pipeline and sync mode) against TRL's GRPOTrainer, side by side.

    .venv/bin/python -m bench.peer_trl [--job examples/tiny-cpu.yaml] [--rounds 3] [--steps 500]
        [--trl-steps 1000] [--gains 10 20 30] [--sides pipeline sync trl trl-parity] [--band 5 15]
        [--lrs 1e-4 1.5e-4 3e-4] [--name peer_trl]

The same warm-started model, task, held-out set, samples per step, prompts per step, learning
rate and schedule, sampling temperature and completion budget, on the same machine, rounds
alternated (pipeline, sync, TRL; then again). TRL is the current PyPI release, installed in
the benchmark's own environment (`.cache/bench-trl`, from `bench/trl-requirements.txt`) and
configured as TRL documents it: `GRPOConfig` + `GRPOTrainer` with Hugging Face `generate` (no
vLLM server), on the CPU, with both cores (`--trl-threads 2`); this project gets the same two
cores, one for the generator and one for the trainer (`--pin-cores`, as `make run`). The task's
problems reach TRL as a dataset of `prompt`/`answer` rows (the training stream, in order), the
reward as `examples/trl/rewards.py:exact_answer`, TRL's reward-function signature, the same
exact-match rule as the task's own reward. Where the sides differ is how each trains by
default (the table in bench/README.md), which is the point.

Held-out accuracy is measured offline for every side alike (as benchmark 1 does): every
`--eval-interval` versions each side writes its weights, and after the run each is evaluated
greedily on the same `--eval-problems` held-out problems, timed when its version existed (TRL:
the end of its optimizer step, the time spent writing weights taken off its clock). Rounds,
seeds, the learning-rate sweep, the contention guard and the band-median headline on three
clocks follow the method of bench/analysis.py (bench/README.md, "The method"). `trl-parity` is
TRL with the project's objective as near as TRL's options go; `trl-k2`, `trl-k4` and `trl-k8`
are TRL with `steps_per_generation` k (one generation batch of k steps' samples, then k
optimizer steps on its slices: TRL's form of conventional RL with k steps per phase). Reported
per side: trained samples/s, seconds per step, start-up, steps and seconds to the warm start's
accuracy + each `--gains` (pooled rounds), where a step's time goes; then the headline of each
pair (each TRL side / pipeline and / sync), with pooled ratios beside it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.analysis import bootstrap_interval, pooled_ratio, time_to_target, train_start
from bench.common import (
    add_method_args,
    add_results_args,
    gather_runs,
    method_flags,
    print_headlines,
    save_runs,
    save_sweep,
    summary,
    table,
)
from bench.pipeline_vs_sync import JOB, evaluate_exports, one_run
from pipelinerl.spec import PipelineRLJob, load_job
from pipelinerl.tasks import make_task
from pipelinerl.tiny_model import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
TRL_ENV = ROOT / ".cache" / "bench-trl"
TRL_REQUIREMENTS = ROOT / "bench" / "trl-requirements.txt"
TRL_SCRIPT = ROOT / "bench" / "trl_grpo.py"
REWARD = ROOT / "examples" / "trl" / "rewards.py"
DEFAULT_SIDES = ("pipeline", "sync", "trl", "trl-parity")
TRL_K = {"trl-k2": 2, "trl-k4": 4, "trl-k8": 8}  # side: GRPOConfig.steps_per_generation
SIDES = (*DEFAULT_SIDES, *TRL_K)
# TRL with the project's objective as near as TRL's options go: advantages not divided by the
# group's standard deviation, and Dr. GRPO's loss (a constant normaliser, not each completion's
# length), so that the ratio against it measures asynchrony rather than objective.
PARITY = ['scale_rewards="none"', 'loss_type="dr_grpo"']


def trl_python() -> Path:
    """The TRL environment's interpreter: made once per requirements file, with their exact
    versions and nothing resolved (as scripts/setup.sh makes .venv)."""
    python, stamp = TRL_ENV / "bin" / "python", TRL_ENV / ".stamp"
    want = hashlib.sha256(TRL_REQUIREMENTS.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return python
    print(f"setting up TRL's environment in {TRL_ENV} (once, ~1 minute) ...", flush=True)
    subprocess.run([os.environ.get("PYTHON", "python3.11"), "-m", "venv", "--clear", str(TRL_ENV)], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "-r",
            str(TRL_REQUIREMENTS),
        ],
        check=True,
    )
    stamp.write_text(want)
    return python


def write_rows(job: PipelineRLJob, count: int, path: Path) -> None:
    """The job's first `count` training problems as TRL dataset rows (`prompt`, `answer`)."""
    task = make_task(job.spec.task.name, job.spec.task.params, seed=job.spec.task.seed)
    with open(path, "w") as f:
        for i in range(count):
            p = task.train_problem(i)
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")


def trl_run(args, tag: str, root: Path, seed: int | None = None, lr: float | None = None, side="trl") -> dict:
    job = load_job(args.job)
    spec, out = job.spec, root / f"{side}-{tag}"
    seed = spec.trainer.seed if seed is None else seed
    lr = lr or spec.trainer.learning_rate
    rows = root / "trl-train.jsonl"
    if not rows.exists():
        write_rows(job, args.trl_steps * spec.groups_per_step, rows)
    cmd = [
        str(trl_python()),
        str(TRL_SCRIPT),
        "--model",
        resolve_model_path(spec.model.path),
        "--train",
        str(rows),
        "--reward",
        f"{REWARD}:exact_answer",
        "--out",
        str(out),
        "--steps",
        str(args.trl_steps),
        "--prompts",
        str(spec.groups_per_step),
        "--generations",
        str(spec.rl.attempts),
        "--max-tokens",
        str(spec.generator.sampling.max_tokens),
        "--temperature",
        str(spec.generator.sampling.temperature),
        "--lr",
        str(lr),
        "--warmup",
        str(spec.trainer.warmup_steps),
        "--seed",
        str(seed),
        "--threads",
        str(args.trl_threads),
        "--export-interval",
        str(args.eval_interval),
        *(item for field in PARITY if side == "trl-parity" for item in ("--set", field)),
        *(("--set", f"steps_per_generation={TRL_K[side]}") if side in TRL_K else ()),
    ]
    out.mkdir(parents=True)
    t0, launched = time.monotonic(), time.time()
    with open(out / "trl.log", "w") as log:  # bounded: 30 s a step is 10x the slowest seen here
        code = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=600 + 30 * args.trl_steps,
        ).returncode
    wall = time.monotonic() - t0
    if code:
        raise SystemExit(f"TRL run failed ({code}); its log: {out / 'trl.log'}")
    rows_ = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    steps = [{**r, "train_seconds": r["seconds"]} for r in rows_]  # train_start(steps) = 0, TRL's clock
    evals = evaluate_exports(out / "export", steps, args.eval_problems, job)
    span = steps[-1]["time"]
    samples = spec.trainer.samples_per_step
    began = json.loads((out / "clock.json").read_text())["train_begin"]
    x = {
        "seed": seed,
        "learning_rate": lr,
        "steps_log": steps,
        "evals": evals,
        # On TRL's clock (0: training began); its first step generates at once.
        "clock_origins": {"launch": launched - began, "first_token": 0.0},
        "steps": len(steps),
        "wall_seconds": wall,
        "startup_seconds": wall - span,
        "samples_per_second": samples * len(steps) / span,
        "seconds_per_step": span / len(steps),
        "warm_start_accuracy": evals[0]["accuracy"],
        "final_accuracy": evals[-1]["accuracy"],
    }
    print(
        f"  {out.name.rsplit('-', 1)[0]} round {tag}: {x['samples_per_second']:.1f} samples/s, "
        f"{x['seconds_per_step']:.2f} s/step, accuracy {x['warm_start_accuracy']:.3f} -> {x['final_accuracy']:.3f}",
        flush=True,
    )
    return x


def project_run(mode: str, args, tag: str, root: Path, seed: int | None = None, lr: float | None = None) -> dict:
    x = one_run(mode, args, tag, root, seed, lr)
    x["startup_seconds"] = x["wall_seconds"] - (x["steps_log"][-1]["time"] - train_start(x["steps_log"]))
    return x


def where_time_goes(side: str, xs: list[dict], attempts: int) -> dict[str, float]:
    """Mean seconds per step, by phase (steps after the first, whose period holds start-up)."""
    rows = [r for x in xs for r in x["steps_log"][1:]]
    mean = lambda key: statistics.fmean(r[key] or 0.0 for r in rows)  # noqa: E731
    if side.startswith("trl"):
        return {
            k.removesuffix("_seconds"): mean(k)
            for k in (
                "generate_seconds",
                "reward_seconds",
                "score_other_seconds",
                "forward_seconds",
                "backward_seconds",
                "optimizer_other_seconds",
            )
        }
    periods = [b["time"] - a["time"] for x in xs for a, b in zip(x["steps_log"], x["steps_log"][1:])]
    out = {
        "period": statistics.fmean(periods),
        "trainer_compute": mean("train_seconds"),
        "of_which_optimizer": mean("optimizer_seconds"),
        "weight_sync": mean("weight_sync_seconds"),
    }
    out["trainer_waits_for_data"] = out["period"] - out["trainer_compute"] - out["weight_sync"]
    out["generator_busy_fraction"] = statistics.fmean(x.get("generator_busy_fraction", 0.0) for x in xs)
    out["groups_generated_per_step"] = statistics.fmean(
        r["samples"] / attempts + (r["groups_filtered"] or 0) for r in rows
    )
    return out


def report(runs: dict[str, list[dict]], args) -> dict:
    job = load_job(args.job)
    result: dict = {"args": vars(args), "runs": runs, "sides": {}, "ratios": {}}
    rows = []
    for side, xs in runs.items():
        agg = result["sides"][side] = {
            "samples_per_second": summary([x["samples_per_second"] for x in xs]),
            "seconds_per_step": summary([x["seconds_per_step"] for x in xs]),
            "startup_seconds": summary([x["startup_seconds"] for x in xs]),
            "warm_start_accuracy": statistics.fmean(x["warm_start_accuracy"] for x in xs),
            "final_accuracy": statistics.fmean(x["final_accuracy"] for x in xs),
            "steps_run": len(xs[0]["steps_log"]),
            "time_to_target_s": {f"+{g:g}": time_to_target(xs, g) for g in args.gains},
            "steps_to_target": {f"+{g:g}": time_to_target(xs, g, "version") for g in args.gains},
            "time_to_target_per_round_s": {f"+{g:g}": [time_to_target([x], g) for x in xs] for g in args.gains},
            "where_time_goes": where_time_goes(side, xs, job.spec.rl.attempts),
        }
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        rows.append(
            [
                side,
                agg["samples_per_second"]["median"],
                agg["seconds_per_step"]["median"],
                agg["startup_seconds"]["median"],
                f"{agg['warm_start_accuracy']:.3f}",
                f"{agg['final_accuracy']:.3f} ({agg['steps_run']})",
                *(
                    f"{fmt(agg['steps_to_target'][f'+{g:g}'])} / {fmt(agg['time_to_target_s'][f'+{g:g}'])}"
                    for g in args.gains
                ),
            ]
        )
    print(
        table(
            [
                "side",
                "samples/s",
                "s/step",
                "start-up s",
                "warm start",
                "final (steps)",
                *(f"+{g:g}: steps / s" for g in args.gains),
            ],
            rows,
        )
    )
    for side in runs:
        print(
            f"  {side}, mean per step: "
            + ", ".join(f"{k} {v:.3f}" for k, v in result["sides"][side]["where_time_goes"].items())
        )
    pairs = [(f, b) for b in runs if b.startswith("trl") for f in ("pipeline", "sync") if f in runs]
    for fast, base in pairs:
        key = f"{base}/{fast}"
        result["ratios"][key] = {"headline": print_headlines(fast, base, runs, args), "pooled": {}}
        for g in args.gains:
            r = pooled_ratio(runs[fast], runs[base], g)
            ci = bootstrap_interval(runs[fast], runs[base], g)
            result["ratios"][key]["pooled"][f"+{g:g}"] = {"pooled": None if math.isnan(r) else r, "interval": ci}
        print(
            f"  beside it, {key} on the pooled curves (90% bootstrap interval over rounds): "
            + ", ".join(
                f"+{g:g}: {describe(result['ratios'][key]['pooled'][f'+{g:g}'], runs, fast, base, g)}"
                for g in args.gains
            )
        )
    return result


def describe(ratio: dict, runs: dict, fast: str, base: str, gain: float) -> str:
    r, ci = ratio["pooled"], ratio["interval"]
    if r is None:
        return "neither reached it"
    if r == math.inf:  # TRL missed it: the ratio is at least its shortest run over our time
        bound = min(x["steps_log"][-1]["time"] for x in runs[base]) / time_to_target(runs[fast], gain)
        return f"{base} never reached it in its run (> {bound:.2f}x)"
    if r == 0:
        return f"{fast} never reached it"
    return f"{r:.2f}x ({ci['p5']:.2f}-{ci['p95']:.2f})" if ci["p5"] is not None else f"{r:.2f}x"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default=str(JOB), help="the job (default: the tiny example)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=500, help="optimizer steps of this project's runs")
    ap.add_argument("--trl-steps", type=int, default=1000, help="optimizer steps of TRL's runs")
    ap.add_argument(
        "--gains",
        type=float,
        nargs="+",
        default=[10, 20, 30],
        help="targets: the warm start's accuracy + these many points",
    )
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES))
    ap.add_argument("--eval-interval", type=int, default=10, help="versions between weights evaluated offline")
    ap.add_argument("--eval-problems", type=int, default=1000)
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (cores here: 2)")
    add_method_args(ap)
    add_results_args(ap, "peer_trl")
    args = ap.parse_args(argv)
    # What pipeline_vs_sync.one_run reads beyond these options: the project's sides run as
    # `make run` does, the generator and the trainer on a core each (sync too).
    args.set, args.pipeline_set, args.gain, args.sync_cores = [], [], args.gains[0], "split"
    return args


def main() -> None:
    args = parse_args()

    def sides(tmp: Path) -> dict:
        return {
            side: functools.partial(trl_run, args, root=tmp, side=side)
            if side.startswith("trl")
            else functools.partial(project_run, side, args, root=tmp)
            for side in args.sides
        }

    runs, sweep = gather_runs(args, sides, args.sides)
    command = (
        f"python -m bench.peer_trl --rounds {args.rounds} --steps {args.steps} --trl-steps {args.trl_steps} "
        f"--gains {' '.join(f'{g:g}' for g in args.gains)}"
    )
    command += "" if Path(args.job).resolve() == JOB else f" --job {args.job}"
    command += "" if args.sides == list(DEFAULT_SIDES) else " --sides " + " ".join(args.sides)
    command += "" if args.eval_problems == 1000 else f" --eval-problems {args.eval_problems}"
    command += "" if args.eval_interval == 10 else f" --eval-interval {args.eval_interval}"
    command += method_flags(args)
    if not args.rounds:
        return save_sweep(args, sweep, command)
    save_runs(args, report(runs, args) | {"sweep": sweep}, command)


if __name__ == "__main__":
    sys.exit(main())
