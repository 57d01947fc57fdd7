"""Pipeline vs the conventional baseline's learning speed: the same job, seed and hardware in
`mode: pipeline` and `mode: sync` with k optimizer steps per generation phase (`sync` is k = 1,
`sync-k4` k = 4: `rl.stepsPerGeneration`), runs alternated P S P S …. The pipeline's generator
and trainer each have their own core (`--cores split`); the baseline's phases run with the same
split (`--sync-cores split`, benchmarks 1 and 10) or each on the whole machine
(`--sync-cores colocated`, benchmark 11: the conventional baseline as the paper runs it, every
core generating the phase, one engine per core: `--colocated-engines`, then every core training).

    .venv/bin/python -m bench.pipeline_vs_sync [--rounds 5] [--steps 150] [--gain 15]
        [--job examples/tiny-cpu.yaml] [--pipeline-set rl.maxLag=2 ...]
        [--modes pipeline sync sync-k2 sync-k4 sync-k8] [--sync-cores colocated]
        [--band 5 15] [--lrs 5e-5 1e-4 2e-4] [--name pipeline_vs_sync]

Reports per mode: trained samples/s, seconds per step, wall time from the first training step
to a held-out accuracy `--gain` points above the warm start, generator and trainer busy
fractions, the token lag distribution, max lag and ESS; then baseline/pipeline ratios for every
baseline: the rate per round, and the band-median headline of time to target on three clocks
with its interval over rounds (rounds of independent seeds, an optional learning-rate sweep per
mode, a contention guard: the method of bench/analysis.py), pooled ratios beside it; with
several baselines, the headline against the best of them (`best_baseline`).

Held-out accuracy is measured offline: the trainer exports its weights every `--eval-interval`
versions (`trainer.exportInterval`), and after each run every export is evaluated greedily on
the same `--eval-problems` held-out problems, timed at the moment its version went live. An
evaluation inside the run would cost generator time, and unequally: sync mode can hide it
while it trains, the pipeline cannot. Per-step records are kept in the JSON (the planner is
calibrated from them).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path

from bench.analysis import (
    accuracy_gap,
    band_headline,
    best_setting,
    bootstrap_interval,
    evaluation_spread,
    has_clock,
    pooled_ratio,
    time_to_target,
    train_start,
)
from bench.common import (
    add_method_args,
    add_results_args,
    band_gains,
    gather_runs,
    method_flags,
    paired_ratios,
    estimate_text,
    print_headlines,
    ratio_text,
    save_runs,
    save_sweep,
    set_fields,
    summary,
    table,
)
from pipelinerl_cli.local import run_local
from pipelinerl.phases import decomposition
from pipelinerl.spec import PipelineRLJob, load_job, parse_job, read_manifest
from pipelinerl.tasks import make_task
from pipelinerl.tiny_model import greedy_correct, load_tokenizer, resolve_model_path

JOB = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


MODES = ("pipeline", "sync", "sync-k2", "sync-k4", "sync-k8", "sync-k16", "sync-k32")


def steps_per_generation(mode: str) -> int:
    """k of a baseline mode's name (`sync` is k = 1, `sync-k4` k = 4); 1 for the pipeline."""
    return int(mode.split("-k")[1]) if "-k" in mode else 1


def job_for(
    mode: str,
    steps: int,
    export_interval: int,
    tag: str,
    pipeline_set: list[str] = (),
    job: Path = JOB,
    both_set: list[str] = (),
    engines: int | None = None,
):
    """The job of `job` (the tiny example by default) in `mode`. "FIELD=VALUE" items (values in
    YAML, e.g. "rl.maxLag=2") change it: `both_set` for both modes (a variant of the job),
    `pipeline_set` for the pipeline only (a variant measured against the same sync baseline).
    `engines`: the baseline's generators (its phases generate on that many engines)."""
    data = read_manifest(job)
    spec = copy.deepcopy(data["spec"])
    set_fields(spec, both_set)
    spec["mode"] = "pipeline" if mode == "pipeline" else "sync"
    spec["trainer"] |= {"maxSteps": steps, "checkpointInterval": 0, "exportInterval": export_interval}
    spec["eval"] = {"interval": 0}  # evaluated offline, from the exports
    if mode != "pipeline":
        spec["rl"].pop("maxLag", None)  # the phase sets the lag: k - 1
        spec["rl"]["stepsPerGeneration"] = steps_per_generation(mode)
        # A pipeline's cap on groups in flight trades engine throughput for fresher samples;
        # sync generates its whole step at once (the baseline as users run it).
        spec.get("generator", {}).pop("maxInflightGroups", None)
        if engines:
            spec.setdefault("generator", {})["replicas"] = engines
    else:
        set_fields(spec, pipeline_set)
    return parse_job({**data, "metadata": {"name": f"bench-{mode}-{tag}"}, "spec": spec}, f"{job} ({mode})")


def colocated_engines(args) -> int:
    """The colocated baseline's engines: `--colocated-engines`, or one per core this process
    may use (a phase generates on every core, as every GPU generates in the paper's baseline)."""
    return args.colocated_engines or len(os.sched_getaffinity(0))


def cores_for(mode: str, sync_cores: str) -> str:
    """The pipeline's stages each on their own cores (they run at once); the baseline's phases
    as `--sync-cores` says (split as the pipeline, or colocated: each phase on every core)."""
    return "split" if mode == "pipeline" else sync_cores


def evaluate_exports(exports_dir: Path, steps: list[dict], problems: int, job: PipelineRLJob) -> list[dict]:
    """Greedy held-out accuracy of the warm start and of every exported version (`version-N`
    folders), each timed at the moment its version went live (the trainer's report after the
    weight update), on the job's held-out problems as its own evaluation poses them (up to
    `maxTokens` new tokens, right when it stops with the answer). Each evaluation keeps its
    per-problem results too (`correct`: "1" right, "0" not, in the problems' order; the same
    problems for every version and side), which `analysis.evaluation_spread` resamples."""
    from transformers import AutoModelForCausalLM

    spec = job.spec
    test = make_task(spec.task.name, spec.task.params, seed=spec.task.seed).test_problems(problems)
    base = Path(resolve_model_path(spec.model.path))
    tokenizer = load_tokenizer(base)
    live = {r["step"]: r["time"] for r in steps}
    exports = sorted((int(p.name.split("-")[1]), p) for p in exports_dir.glob("version-*"))
    evals = []
    for version, path in [(0, base)] + [e for e in exports if e[0] > 0]:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        right = greedy_correct(model, tokenizer, test, spec.generator.sampling.max_tokens)
        evals.append(
            {
                "version": version,
                "time": live.get(version, train_start(steps)),
                "accuracy": sum(right) / len(right),
                "correct": "".join("1" if r else "0" for r in right),
            }
        )
    return evals


def one_run(mode: str, args, tag: str, root: Path, seed: int | None = None, lr: float | None = None) -> dict:
    """One run of `mode`, with the round's `seed` and a learning rate (None: the job's)."""
    run_dir = root / f"{mode}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun (the contention guard's) starts afresh: `run` would resume
    both = [*args.set, *([f"trainer.seed={seed}"] if seed is not None else [])]
    both += [f"trainer.learningRate={lr}"] if lr else []
    cores = cores_for(mode, args.sync_cores)
    engines = colocated_engines(args) if cores == "colocated" else None
    job = job_for(mode, args.steps, args.eval_interval, tag, args.pipeline_set, Path(args.job), both, engines)
    launched = time.time()
    code = run_local(job, run_dir, quiet=True, cores=cores, restart=False)  # a restart would distort the timing
    if code:
        raise SystemExit(f"{mode} run failed ({code}); logs in {run_dir / 'logs'}")
    s = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = (
        "step",
        "time",
        "samples",
        "tokens",
        "row_tokens",
        "train_seconds",
        "optimizer_seconds",
        "micro_batches",
        "weight_sync_seconds",
        "weight_pause_max_seconds",
        "groups_filtered",
        "lag_mean",
        "lag_max",
        "ess",
    )
    steps = [{k: r.get(k) for k in keep} for r in records if r["kind"] == "train"]
    evals = evaluate_exports(run_dir / "checkpoints" / "export", steps, args.eval_problems, job)
    correct = [e.pop("correct") for e in evals]  # kept apart: in the whole record only (bench/results_store.py)
    x = {
        **s,
        "cores": cores,
        "generators": job.spec.generator.replicas,
        "steps_per_generation": job.spec.steps_per_generation,
        "seed": job.spec.trainer.seed,
        "learning_rate": job.spec.trainer.learning_rate,
        "steps_log": steps,
        "eval_correct": correct,
        "evals": evals,
        "warm_start_accuracy": evals[0]["accuracy"],
        "final_accuracy": evals[-1]["accuracy"],
        # The clocks' origins on the rows' clock (0 = when the runner started its services).
        "clock_origins": {"launch": launched - s["started_at"], "first_token": s["first_group_seconds"]},
    }
    x["time_to_target_s"] = time_to_target([x], args.gain)
    ttt = x["time_to_target_s"]
    print(
        f"  {mode} round {tag}: {s['samples_per_second']:.1f} samples/s, {s['seconds_per_step']:.2f} s/step, "
        f"to target {ttt if ttt is None else round(ttt)} s, gen busy {s.get('generator_busy_fraction', 0):.0%}, "
        f"trainer busy {s['trainer_busy_fraction']:.0%}, accuracy {x['warm_start_accuracy']:.3f} -> "
        f"{x['final_accuracy']:.3f}",
        flush=True,
    )
    return x


def print_evaluation_spread(fast: list[dict], baseline: list[dict], gains: list[float]) -> dict:
    """The held-out set's part of the rounds' spread (`evaluation_spread`), from launch and in
    samples; {} for runs saved without per-problem results."""
    out = {}
    for axis in [a for a in ("launch", "version") if all(has_clock(x, a) for x in fast + baseline)]:
        h = evaluation_spread(fast, baseline, gains, axis)
        if h is None:
            continue
        out[axis] = h
        seen = "" if h["observed_sd"] is None else f" (between rounds: {h['observed_sd']:.2f})"
        rounds = h.get("rounds_for_1.3x_with_problems") or {}
        print(
            f"  the held-out set's part of a round's spread ({'samples' if axis == 'version' else axis}): "
            f"sd {h['sd']:.2f} of its log ratio{seen}, {h['problems']} problems redrawn"
            + (
                f"; 1.3x would need {rounds['x1']} rounds at the larger of the two, {rounds['x4']} with 4x the "
                f"problems, {rounds['x16']} with 16x"
                if rounds
                else ""
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--gain", type=float, default=15.0, help="target: warm-start accuracy + this many points")
    ap.add_argument("--job", default=str(JOB), help="the job to run in both modes (default: the tiny example)")
    ap.add_argument("--eval-interval", type=int, default=10, help="versions between exports evaluated offline")
    ap.add_argument("--eval-problems", type=int, default=2000)
    ap.add_argument(
        "--set",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="change a field of the job's spec in both modes, e.g. trainer.samplesPerStep=64 (repeatable)",
    )
    ap.add_argument(
        "--pipeline-set",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="change a field of the pipeline's spec, e.g. rl.maxLag=2 (repeatable)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=["pipeline", "sync"],
        help="the sides: pipeline, and the conventional baseline with k steps per phase (sync: k = 1, "
        "sync-kK: k = K); one mode: its table, no ratios",
    )
    ap.add_argument(
        "--sync-cores",
        choices=["split", "colocated"],
        default="split",
        help="the baseline's cores: split as the pipeline's (a core each), or colocated (each phase on every core)",
    )
    ap.add_argument(
        "--colocated-engines",
        type=int,
        default=0,
        help="the colocated baseline's engines (generator.replicas); 0: one per core (benchmark 11 before "
        "2026-12-02 ran one)",
    )
    ap.add_argument(
        "--curve",
        default="decode_curve",
        help="benchmark 12's result (bench/results/NAME.json) measured on this machine: the decode curve "
        "each phase's generation and the bound are read against",
    )
    add_method_args(ap)
    add_results_args(ap, "pipeline_vs_sync")
    args = ap.parse_args()

    def sides(tmp: Path) -> dict:
        return {mode: functools.partial(one_run, mode, args, root=tmp) for mode in args.modes}

    runs, sweep = gather_runs(args, sides, args.modes)
    if not args.rounds:
        return save_sweep(args, sweep, reproduce(args, args.modes))
    if args.reanalyse:
        for xs in runs.values():
            for x in xs:
                x["time_to_target_s"] = time_to_target([x], args.gain)
    report(runs, args, sweep)


def report(runs: dict[str, list[dict]], args, sweep: dict | None = None) -> None:
    result = {"args": vars(args), "runs": runs, "sweep": sweep or {}, "modes": {}}
    rows, phase_rows = [], []
    for mode in runs:
        agg = result["modes"][mode] = mode_summary(runs[mode], args.gain)
        ttt = agg["time_to_target_s"]
        rows.append(
            [
                mode,
                runs[mode][0].get("cores", "split"),
                agg["samples_per_second"]["median"],
                agg["seconds_per_step"]["median"],
                ttt["median"] if ttt else "not reached",
                agg["pooled_steps_to_target"] or "not reached",
                f"{agg['generator_busy_fraction']['median']:.0%}",
                f"{agg['trainer_busy_fraction']['median']:.0%}",
                " ".join(f"{k}:{v}" for k, v in agg["lag_token_counts"].items()),
                agg["mean_ess"]["median"],
            ]
        )
        phase_rows.append(phase_row(mode, runs[mode][0], agg, args))
    print(
        table(
            [
                "mode",
                "cores",
                "samples/s",
                "s/step",
                "s to target",
                "steps to target (pooled)",
                "gen busy",
                "trainer busy",
                "token lags",
                "ESS",
            ],
            rows,
        )
    )
    print(
        table(
            ["mode", "engines", "generation tok/s", "the curve predicts", "waiting", "training", "updating"],
            phase_rows,
        )
    )
    print(
        "(a phase: k steps' generation, the switch and the preprocessor included (the trainer waiting), its "
        "training, the weight update; the pipeline's: its generators' tokens/s, a step's trainer starved of data)"
    )
    baselines = [mode for mode in runs if mode != "pipeline"]
    if "pipeline" in runs and baselines:
        result["baselines"] = {b: compare(runs, args, b) for b in baselines}
        if len(baselines) == 1:
            result |= result["baselines"][baselines[0]]  # where single-baseline results keep them
        else:
            best = result["best_baseline"] = best_baseline(runs, baselines, args)
            result["headline"] = result["baselines"][best]["headline"]
            print(f"\nthe best baseline (soonest to the band's targets from launch): {best}")
            print_headlines("pipeline", best, runs, args)
        print(
            f"pipeline generator busy: {result['modes']['pipeline']['generator_busy_fraction']['median']:.0%} "
            f"(target >= 90%)"
        )
    save_runs(args, result, reproduce(args, list(runs)))


def phase_row(mode: str, run: dict, agg: dict, args) -> list:
    """A mode's generation rate and where its phases' time went; for a colocated conventional
    phase, what benchmark 12's decode curve predicts for it beside (from the job's lengths)."""
    from bench.measured_machine import predicted_phase_rate

    phases = agg["phases"]
    shares = ("wait_share", "train_share", "update_share")
    share = [f"{phases[k]['median']:.0%}" if k in phases else "-" for k in shares]
    if mode == "pipeline":
        rate = agg.get("generated_tokens_per_second", {}).get("median")
        predicted = None
    else:
        rate = phases.get("tokens_per_wait_second", {}).get("median")
        k = steps_per_generation(mode)
        samples = k * load_job(args.job).spec.trainer.samples_per_step
        engines = run.get("generators", 1)
        colocated = run.get("cores") == "colocated"
        predicted = predicted_phase_rate(args.job, engines, samples, args.curve) if colocated else None
    return [mode, run.get("generators", 1), rate or "-", predicted or "-", *share]


def trainer_rate(xs: list[dict]) -> float:
    """Row tokens per training second over every step of `xs` after the first (the whole step:
    packing, log-probs, the optimizer)."""
    steps = [r for x in xs for r in x["steps_log"][1:]]
    return sum(r["row_tokens"] for r in steps) / sum(r["train_seconds"] for r in steps)


def measured_bound(runs: dict[str, list[dict]], baseline: str, args) -> dict | None:
    """The throughput bound against a colocated `baseline` with the trainer rates these runs
    measured: the pipeline's trainer on its core, the baseline's on every core and its engines."""
    from bench.measured_machine import bound_with_trainer

    base = runs[baseline]
    if base[0].get("cores") != "colocated":
        return None  # the bound's conventional phase runs on every core
    cores = len(os.sched_getaffinity(0))
    rates = {cores - 1: trainer_rate(runs["pipeline"]), cores: trainer_rate(base)}
    samples = load_job(args.job).spec.trainer.samples_per_step
    engines = base[0].get("generators", 1)
    b = bound_with_trainer(args.job, steps_per_generation(baseline), samples, rates, engines, args.curve)
    return None if b is None else {"ratio": b.ratio, "tail_share": b.tail_share, "trainer_tokens_per_s": rates}


def best_baseline(runs: dict[str, list[dict]], baselines: list[str], args) -> str:
    """The baseline mode whose rounds reach the band's targets soonest from launch (the median
    over rounds and targets; a miss counts as never): the pipeline's headline is against it."""
    return best_setting({b: runs[b] for b in baselines}, band_gains(args), axis="launch")


def reproduce(args, modes: list[str]) -> str:
    """The command that reproduces a result."""
    command = f"python -m bench.pipeline_vs_sync --rounds {args.rounds} --steps {args.steps} --gain {args.gain}"
    command += "" if Path(args.job).resolve() == JOB else f" --job {args.job}"
    command += "".join(f" --set {x}" for x in args.set)
    command += "".join(f" --pipeline-set {x}" for x in args.pipeline_set)
    command += "" if modes == ["pipeline", "sync"] else " --modes " + " ".join(modes)
    command += "" if args.sync_cores == "split" else f" --sync-cores {args.sync_cores}"
    command += "" if args.curve == "decode_curve" else f" --curve {args.curve}"
    command += f" --colocated-engines {args.colocated_engines}" if args.colocated_engines else ""
    command += "" if args.name == "pipeline_vs_sync" else f" --name {args.name}"
    command += "" if args.eval_problems == 2000 else f" --eval-problems {args.eval_problems}"
    command += "" if args.eval_interval == 10 else f" --eval-interval {args.eval_interval}"
    return command + method_flags(args)


def mode_summary(xs: list[dict], gain: float) -> dict:
    def col(key: str) -> list[float]:
        return [x[key] for x in xs if x.get(key) is not None]

    lag: dict[str, int] = {}
    for x in xs:
        for k, v in x["lag_token_counts"].items():
            lag[k] = lag.get(k, 0) + v
    agg = {
        k: summary(col(k))
        for k in (
            "samples_per_second",
            "seconds_per_step",
            "generator_busy_fraction",
            "trainer_busy_fraction",
            "mean_ess",
        )
        if col(k)
    }
    ttt = col("time_to_target_s")
    agg["time_to_target_s"] = summary(ttt) if ttt else None
    # where a phase's time went (pipelinerl.phases), and the generators' rate while generating
    per_phase = [decomposition(x["steps_log"], x.get("steps_per_generation", 1)) for x in xs if x.get("steps_log")]
    per_phase = [p for p in per_phase if p]
    agg["phases"] = {
        k: summary([p[k] for p in per_phase if p[k] is not None])
        for k in ("wait_share", "train_share", "update_share", "tokens_per_wait_second")
        if any(p[k] is not None for p in per_phase)
    }
    if col("generated_tokens_per_second"):
        agg["generated_tokens_per_second"] = summary(col("generated_tokens_per_second"))
    agg["pooled_steps_to_target"] = time_to_target(xs, gain, axis="version")
    agg["lag_token_counts"] = lag
    return agg


def compare(runs: dict[str, list[dict]], args, baseline: str = "sync") -> dict:
    """Pipeline/`baseline` ratios: rate per round, time to target per round and pooled (with its
    bootstrap interval and nearby targets), and what per-step learning keeps of the rate."""
    out = {}
    rate = out["samples_rate_ratio"] = paired_ratios(
        [x["samples_per_second"] for x in runs["pipeline"]], [x["samples_per_second"] for x in runs[baseline]]
    )
    print(
        f"pipeline/{baseline} trained-samples rate: {rate['median']:.2f}x (spread {rate['min']:.2f}-{rate['max']:.2f}; "
        f"target >= 1.6x)"
    )
    out["bound"] = measured_bound(runs, baseline, args)
    if out["bound"]:
        share = rate["median"] / out["bound"]["ratio"]
        print(
            f"  the decode curve's bound (benchmark 12's curve and engines, this run's trainers): "
            f"{out['bound']['ratio']:.2f}x; measured {share:.0%} of it"
            + (" (above: the phases generate slower than the curve, by costs it does not hold)" if share > 1 else "")
        )
    out["headline"] = print_headlines("pipeline", baseline, runs, args)
    # The paper's two factors apart, per round: samples/s (above) and learning per sample, the
    # baseline's samples to each target over the pipeline's (steps: both train samplesPerStep a step).
    per_sample = out["samples_to_target"] = band_headline(runs["pipeline"], runs[baseline], band_gains(args), "version")
    print(
        f"{baseline}/pipeline samples to target (learning per sample), over the band: "
        + estimate_text(per_sample)
        + "; per round "
        + ", ".join(map(ratio_text, per_sample["per_round"]))
    )
    out["evaluation_spread"] = print_evaluation_spread(runs["pipeline"], runs[baseline], band_gains(args))
    print("beside the headline (one target, rounds pooled or each alone):")
    pairs = [
        (s["time_to_target_s"], p["time_to_target_s"])
        for p, s in zip(runs["pipeline"], runs[baseline])
        if p["time_to_target_s"] and s["time_to_target_s"]
    ]
    out["time_to_target_ratio"] = summary([s / p for s, p in pairs]) if pairs else None
    if pairs:
        t = out["time_to_target_ratio"]
        print(
            f"{baseline}/pipeline time to target: {t['median']:.2f}x (spread {t['min']:.2f}-{t['max']:.2f}; "
            f"target >= 1.5x; {len(pairs)} of {args.rounds} rounds reached it in both modes)"
        )
    pooled = out["pooled_time_to_target_s"] = {m: time_to_target(runs[m], args.gain) for m in ("pipeline", baseline)}
    out["pooled_time_to_target_ratio"] = pooled[baseline] / pooled["pipeline"] if all(pooled.values()) else None
    if out["pooled_time_to_target_ratio"]:
        print(
            f"{baseline}/pipeline time to target on the rounds pooled: "
            f"{out['pooled_time_to_target_ratio']:.2f}x ({pooled[baseline]:.0f} s / {pooled['pipeline']:.0f} s)"
        )
    else:
        print("time to target on the rounds pooled: not reached by " + " and ".join(m for m in pooled if not pooled[m]))
    ci = out["pooled_time_to_target_interval"] = bootstrap_interval(runs["pipeline"], runs[baseline], args.gain)
    print(
        f"  90% bootstrap interval over rounds: {ci['p5']:.2f}-{ci['p95']:.2f}x (median {ci['p50']:.2f}x)"
        if ci["p5"] is not None
        else "  90% bootstrap interval over rounds: no resample reached the target in both modes"
    )
    # time ratio = rate ratio x steps ratio: how much of the speed the per-step learning keeps
    steps = pooled_ratio(runs["pipeline"], runs[baseline], args.gain, axis="version")
    out["pooled_steps_to_target_ratio"] = steps if math.isfinite(steps) else None
    gap = out["accuracy_gap_points"] = accuracy_gap({"pipeline": runs["pipeline"], "sync": runs[baseline]})
    later = [g for v, g in gap.items() if v > 0]
    print(
        f"  {baseline}/pipeline steps to target (pooled): {steps:.2f}; pipeline minus {baseline} held-out "
        f"accuracy at equal version: {sum(later) / max(len(later), 1):+.1f} points on average, behind at "
        f"{sum(g < 0 for g in later)} of {len(later)} versions"
    )
    # The same figure for nearby targets: a ratio that holds only at one gain would be luck.
    gains = out["pooled_time_to_target_ratio_by_gain"] = {}
    for gain in (args.gain - 5, args.gain - 2.5, args.gain, args.gain + 2.5):
        t = {m: time_to_target(runs[m], gain) for m in ("pipeline", baseline)}
        gains[f"{gain:+g}"] = t[baseline] / t["pipeline"] if t[baseline] and t["pipeline"] else None
    print(
        "  by target gain (points): "
        + ", ".join(f"{g}: {'not reached' if r is None else f'{r:.2f}x'}" for g, r in gains.items())
    )
    return out


if __name__ == "__main__":
    main()
