"""Planner calibration for this machine from benchmark 1's measured runs, then its validation.

    .venv/bin/python -m bench.calibrate_cpu [--from bench/results/pipeline_vs_sync.json]
    .venv/bin/python -m bench.calibrate_cpu --job examples/long-tail-cpu.yaml \
        --from bench/results/pipeline_vs_sync-long-tail-finish-order.json --name cpu-long-tail \
        --split-with bench/results/pipeline_vs_sync-long-tail-64.json

Runs nothing but the planner (seconds). From the per-step records of `bench.pipeline_vs_sync`
(generator and trainer pinned to a core each) it derives each cost from a quantity that is not
the answer (the pipeline/sync ratio):

- training: the mean `optimizer_seconds` (`optimizer_step_s`) and the rest of `train_seconds`
  per row token (`train_s_per_token`), over the steps of both modes (results recorded before
  the trainer reported `optimizer_seconds`: least squares of `train_seconds` against
  `row_tokens`, which cannot separate the two well, the rows being all alike);
  `contention` 0 (pinned cores);
- weight update: mean `weight_sync_seconds` (`weight_sync_s`); `pause_s` the pipeline runs'
  mean `weight_pause_max_seconds` (staged updates pause only to swap the weights; results
  recorded before that field existed use `weight_sync_s`, an upper bound);
- workload: completion lengths, sampled from the warm-started model on the job's training
  prompts at its temperature (an empirical distribution; the runs' mean `tokens / samples` is
  printed beside it), prompt length, and the share of groups dropped by zero-variance filtering
  (`groups_filtered`);
- generation: the **sync** runs' generation phase (step period − `train_seconds` −
  `weight_sync_seconds`: the trainer waiting for the step's data; benchmark 1 evaluates
  offline, so no step carries evaluation work). One batch size cannot separate `decode_base_s`
  from `decode_per_seq_s`: the slope is pinned by `bench/results/engine.json` (vLLM tokens/s for this model with 128
  sequences running) and the base is then solved so that the simulated sync generation phase
  equals the measured one; or, with `--split-with` (the job's runs at another step size), both
  are solved so that the simulated phases at both step sizes equal the measured ones.

It writes `pipelinerl/calibrations/<--name>.yaml` (a plain Calibration: the built-in that
`--gpu-type <name>` uses; `cpu-tiny` for the tiny job), predicts both modes of the job on 1
generator + 1 trainer, and compares with the measurement in
`bench/results/planner_validation[-<name>].json`. Any result with pipeline and sync runs of the
job will do: benchmark 1's, or the peer benchmark's (`bench.peer_trl`); a variant of the job
(benchmark 1's `--set`/`--pipeline-set`) is read from the result.

`--calibration NAME` checks out of sample: it predicts the runs with that built-in calibration,
fitted on other runs, instead of fitting one (and writes no calibration):

    .venv/bin/python -m bench.calibrate_cpu --job examples/long-tail-cpu.yaml \
        --from bench/results/pipeline_vs_sync-long-tail-32-finish-order.json \
        --calibration cpu-long-tail --name cpu-long-tail-32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

import torch

from bench.common import RESULTS, paired_ratios, save, set_fields, table
from bench.decode_fit import MIN_BASE, fit_base, fit_decode, fit_split
from bench.results_store import read_result
from pipelinerl.phases import phases
from pipelinerl.planner.calibration import Calibration, Lengths, load_calibration
from pipelinerl.planner.recommend import plan
from pipelinerl.planner.sim_params import wave_groups
from pipelinerl.planner.simulation import simulate
from pipelinerl.spec import parse_job, read_manifest
from pipelinerl.tasks import make_task
from pipelinerl.tiny_model import load_tokenizer, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "tiny-cpu.yaml"
CALIBRATIONS = ROOT / "pipelinerl" / "calibrations"
HEADER = """\
# Measured by `python -m bench.calibrate_cpu` from the runs of {source} (the job of {job} on
# 1 generator + 1 trainer, pinned cores); `source` says how each cost was derived. To refresh it,
# run `{command}`: it writes this file.
"""
# vLLM's max_num_seqs when AsyncLLM builds its config (usage context ENGINE_CONTEXT):
# SchedulerConfig.DEFAULT_MAX_NUM_SEQS. The generator does not override it for the tiny job.
VLLM_MAX_NUM_SEQS = 128
TARGET = 0.20  # the issue: the predicted ratio within 20% of the measured one


def load(path: Path) -> dict:
    data = read_result(path)
    runs = data["runs"]
    if not runs.get("pipeline") or not runs.get("sync"):
        raise SystemExit(f"{path}: needs runs of both modes")
    return data


def variant(data: dict) -> list[str]:
    """The FIELD=VALUE changes the benchmark made to the job (`--set`, then `--pipeline-set`)."""
    return data["args"].get("set", []) + data["args"].get("pipeline_set", [])


def job_spec(path: Path, data: dict):
    """The job the pipeline runs of `data` ran: `path` with the benchmark's changes (`--set`,
    `--pipeline-set`; sync's own changes, lag 0 and no cap on groups in flight, are simulated
    by mode) and the runs' maxLag."""
    job = read_manifest(path)
    set_fields(job["spec"], variant(data))
    job["spec"]["rl"]["maxLag"] = int(data["runs"]["pipeline"][0].get("max_lag", 1))
    return parse_job(job, str(path))


def steps_of(run: dict) -> list[dict]:
    """Steps 2.. with their period (start-up is in step 1's)."""
    log = run["steps_log"]
    return [{**cur, "period": cur["time"] - prev["time"]} for prev, cur in zip(log, log[1:])]


def measured(data: dict) -> dict[str, dict]:
    """Per mode: medians over the rounds of samples/s and busy fractions (as benchmark 1 reports
    them), and over all rounds' steps s/step and the token lag (lag_mean weighted by tokens)."""
    out = {}
    for mode in ("pipeline", "sync"):
        runs = data["runs"][mode]
        steps = [s for r in runs for s in steps_of(r)]
        out[mode] = {
            "samples_per_s": float(np.median([r["samples_per_second"] for r in runs])),
            "step_s": sum(s["period"] for s in steps) / len(steps),
            "gen_busy": float(np.median([r["generator_busy_fraction"] for r in runs])),
            "train_busy": float(np.median([r["trainer_busy_fraction"] for r in runs])),
            "lag_mean": sum(s["tokens"] * s["lag_mean"] for s in steps) / sum(s["tokens"] for s in steps),
            "steps": len(steps),
        }
    return out


def fit_train(steps: list[dict]) -> tuple[float, float, str]:
    x = np.array([s["row_tokens"] for s in steps], float)
    y = np.array([s["train_seconds"] for s in steps], float)
    if all(s.get("optimizer_seconds") is not None for s in steps):
        opt = np.array([s["optimizer_seconds"] for s in steps], float)
        return (
            float((y - opt).sum() / x.sum()),
            float(opt.mean()),
            f"optimizer step measured, forward/backward per row token, over {len(x)} steps",
        )
    (per_token, fixed), *_ = np.linalg.lstsq(np.c_[x, np.ones_like(x)], y, rcond=None)
    if per_token > 0 and fixed >= 0:
        return float(per_token), float(fixed), f"least squares over {len(x)} steps ({x.min():.0f}-{x.max():.0f} tokens)"
    return (
        float(y.sum() / x.sum()),
        0.0,
        f"per token only over {len(x)} steps (least squares gave {per_token:.2e} s/token + {fixed:.3f} s)",
    )


@torch.no_grad()
def sampled_lengths(job, count: int = 512, seed: int = 0) -> list[int]:
    """Completion lengths (EOS included; `maxTokens` if it never comes) of the warm-started model
    sampled at the job's temperature on its first `count` training prompts, one per prompt."""
    from transformers import AutoModelForCausalLM

    spec = job.spec
    with torch.enable_grad():  # a built-in model not built yet is trained here (its warm start)
        path = resolve_model_path(spec.model.path)
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(path)
    task = make_task(spec.task.name, spec.task.params, seed=spec.task.seed)
    by_length: dict[int, list[list[int]]] = {}
    for i in range(count):
        ids = tok.encode(task.train_problem(i).prompt)
        by_length.setdefault(len(ids), []).append(ids)
    torch.manual_seed(seed)
    limit, lengths = spec.generator.sampling.max_tokens, []
    for group in by_length.values():
        ids = torch.tensor(group)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            top_k=0,
            temperature=spec.generator.sampling.temperature,
            max_new_tokens=limit,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        for row in out[:, ids.shape[1] :].tolist():
            lengths.append(row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else limit)
    return lengths


def calibration_yaml(calib: Calibration) -> str:
    """The Calibration's fields and nothing else (load_calibration rejects unknown keys); the
    empirical lengths as a flow list."""
    return yaml.safe_dump(calib.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=100)


def rel(path: Path) -> str:
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def sync_phase(data: dict) -> tuple[float, float]:
    """The sync runs' generation phase (a phase's wait, `pipelinerl.phases`: the step period less
    training and the update, the trainer waiting for the step's data) and their mean row tokens
    per step."""
    runs = data["runs"]["sync"]
    waits = [p.wait_s for r in runs for p in phases(r["steps_log"], 1)]
    return float(np.mean(waits)), float(np.mean([s["row_tokens"] for r in runs for s in steps_of(r)]))


def derive(data: dict, job, name: str) -> tuple[Calibration, dict]:
    """What the runs say before any decode fit: the calibration with the engine benchmark's
    per-step cost alone (where every fit starts), and the facts the report shows."""
    runs = data["runs"]
    every = [s for mode in ("pipeline", "sync") for r in runs[mode] for s in steps_of(r)]
    spec = job.spec
    attempts = spec.rl.attempts

    per_token, fixed, train_how = fit_train(every)
    weight_sync = float(np.mean([s["weight_sync_seconds"] for s in every]))
    pauses = [
        s["weight_pause_max_seconds"]
        for r in runs["pipeline"]
        for s in steps_of(r)
        if s.get("weight_pause_max_seconds") is not None
    ]
    pause = float(np.mean(pauses)) if pauses else weight_sync
    samples = sum(s["samples"] for s in every)
    mean_len = sum(s["tokens"] for s in every) / samples
    prompt = round(sum(s["row_tokens"] - s["tokens"] for s in every) / samples)
    sampled = sampled_lengths(job)
    lengths = Lengths(distribution="empirical", values=sampled, prompt_tokens=prompt)
    kept = samples / attempts
    dropped = sum(s["groups_filtered"] for s in every)
    filtered = dropped / (dropped + kept)
    rows = float(np.mean([s["row_tokens"] for s in every]))

    # The engine's batch: vLLM's max_num_seqs. (The generator's cap on groups in flight, which
    # only the pipeline runs keep, and the admission budget are simulated on their own.)
    max_batch = int(spec.generator.engine_args.get("max_num_seqs", VLLM_MAX_NUM_SEQS))

    engine = read_result(RESULTS / "engine.json")
    tok_s = engine["models"]["tiny-arith"]["vllm"]["median"]  # the built-in tiny models share one architecture
    # The retired engine benchmark (5) submitted 256 requests to one engine; max_num_seqs ran at once.
    engine_batch = min(engine["settings"]["prompts"] * engine["settings"]["samples"], max_batch)
    step_at = engine_batch / tok_s  # seconds per decode step with engine_batch sequences

    sync_steps = [s for r in runs["sync"] for s in steps_of(r)]
    gen_phase = sync_phase(data)[0]
    seqs = float(np.mean([s["samples"] + s["groups_filtered"] * attempts for s in sync_steps]))

    base0 = Calibration(
        name=name,
        gpus_per_engine=1,
        decode_base_s=step_at,
        decode_per_seq_s=0.0,
        max_batch=max_batch,
        prefill_s_per_token=0.0,
        train_s_per_token=per_token,
        train_scaling=0.9,
        optimizer_step_s=fixed,
        weight_sync_s=weight_sync,
        pause_s=pause,
        contention=0.0,
        filtered_fraction=filtered,
        lengths=lengths,
    )
    facts = {
        "train_fit": train_how,
        "mean_completion_tokens": mean_len,
        "prompt_tokens": prompt,
        "sampled_lengths_mean": sum(sampled) / len(sampled),
        "sampled_lengths_max": max(sampled),
        "mean_row_tokens": rows,
        "filtered_fraction": filtered,
        "sync_generation_phase_s": gen_phase,
        "sync_steps_used": len(sync_steps),
        "sequences_generated_per_sync_step": seqs,
        "engine_tokens_per_s": tok_s,
        "engine_batch": engine_batch,
        "engine_step_s": step_at,
        "max_batch": max_batch,
        "decode_split_from_sync_phase_s": None,
        "engine_date": engine.get("date", "?"),
        "pause_from_pipeline_runs": bool(pauses),
    }
    return base0, facts


def calibrate(data: dict, source: Path, job, name: str, other: tuple | None = None) -> tuple[Calibration, dict]:
    """`other`: (result, its job) of another step size, whose sync phase splits the decode cost
    into per-step and per-sequence terms; without it the engine benchmark's point does."""
    base0, facts = derive(data, job, name)
    rows, gen_phase, step_at = facts["mean_row_tokens"], facts["sync_generation_phase_s"], facts["engine_step_s"]
    tok_s, engine_batch = facts["engine_tokens_per_s"], facts["engine_batch"]
    split = None
    if other:
        phase2, rows2 = sync_phase(other[0])
        split = fit_split(base0, job, rows, gen_phase, (other[1], rows2, phase2), step_at)
        if split is None:
            raise SystemExit(
                f"no decode cost (base >= {MIN_BASE}, slope >= 0) gives both sync phases: "
                f"{gen_phase:.3f} s at {job.spec.trainer.samples_per_step} samples per step, "
                f"{phase2:.3f} s at {other[1].spec.trainer.samples_per_step}"
            )
    fitted = split or fit_decode(base0, job, rows, gen_phase, step_at, engine_batch)
    phase_is = f"so that the simulated sync generation phase is the measured {gen_phase:.3f} s"
    if split:
        decode_how = (
            f"base and slope solved {phase_is}, and {phase2:.3f} s at "
            f"{other[1].spec.trainer.samples_per_step} samples per step ({other[0].get('date', '?')})"
        )
    elif fitted.decode_base_s == MIN_BASE:
        decode_how = (
            f"per-sequence cost alone (engine.json's {tok_s:.0f} tok/s at {engine_batch} sequences is "
            f"slower than the runs' engine even with no per-step cost), solved {phase_is}"
        )
    else:
        decode_how = f"slope from engine.json ({tok_s:.0f} tok/s at {engine_batch} sequences), base solved {phase_is}"
    pause_source = (
        "mean weight_pause_max_seconds of the pipeline runs" if facts["pause_from_pipeline_runs"] else "the same"
    )
    calib = fitted.model_copy(
        update={
            "source": (
                f"measured: bench/calibrate_cpu.py from {source.name} ({data.get('date', '?')}, pinned cores)"
                + ("" if split else f" and engine.json ({facts['engine_date']})")
                + f". Train: {facts['train_fit']}. "
                f"Weight sync: mean weight_sync_seconds; pause: "
                f"{pause_source}. "
                "Decode: " + decode_how + ". Prefill folded into decode (chunked prefill). train_scaling unmeasured "
                "(one trainer rank)."
            ),
        }
    )
    calib = Calibration.model_validate(calib.model_dump())  # what load_calibration will see
    if split:
        facts["decode_split_from_sync_phase_s"] = {other[1].spec.trainer.samples_per_step: phase2}
    return calib, facts


def predict(calib: Calibration, job, steps: int, seed: int = 0) -> dict:
    spec = job.spec
    common = dict(
        samples_per_step=spec.trainer.samples_per_step,
        attempts=spec.rl.attempts,
        calib=calib,
        max_tokens=spec.generator.sampling.max_tokens,
        steps=steps,
        warmup=1,
        seed=seed,
    )
    # As the benchmark ran: 1 generator + 1 trainer, rates from the end of step 1 to the last.
    return {
        "pipeline": simulate(
            "pipeline",
            1,
            1,
            job.spec.max_lag,
            wave_groups=wave_groups(job, 1, calib.lengths),
            max_inflight=spec.generator.max_inflight_groups,
            **common,
        ),
        "sync": simulate("sync", 1, 1, 0, **common),
    }


def sensitivity(calib: Calibration, facts: dict, job, steps: int) -> dict[str, float | None]:
    """The predicted ratio with the decode cost split otherwise: all per step (flat), or half /
    double the fitted slope; the base re-fitted to the sync phase each time."""
    rows, target = facts["mean_row_tokens"], facts["sync_generation_phase_s"]
    out = {}
    for label, slope in (
        ("flat (per_seq 0)", 0.0),
        ("slope x0.5", 0.5 * calib.decode_per_seq_s),
        ("slope x2", 2 * calib.decode_per_seq_s),
    ):
        c = fit_base(calib, job, rows, target, slope, facts["engine_step_s"])
        if c is None:  # that slope alone decodes slower than the measured phase
            out[label] = None
            continue
        p = predict(c, job, steps)
        out[label] = p["pipeline"].samples_per_s / p["sync"].samples_per_s
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=RESULTS / "pipeline_vs_sync.json",
        help="a result with pipeline and sync runs of the job (bench.pipeline_vs_sync or bench.peer_trl)",
    )
    ap.add_argument("--job", type=Path, default=JOB, help="the job those runs ran (default: the tiny example)")
    ap.add_argument("--name", default="cpu-tiny", help="the calibration: pipelinerl/calibrations/NAME.yaml")
    ap.add_argument(
        "--split-with",
        type=Path,
        metavar="JSON",
        help="benchmark 1's runs of the job at another step size (--set trainer.samplesPerStep=N): their "
        "sync phase splits the decode cost into per-step and per-sequence (default: engine.json's point)",
    )
    ap.add_argument(
        "--calibration",
        metavar="BUILTIN",
        help="predict with this built-in calibration instead of fitting one (out of sample); writes none",
    )
    return ap.parse_args()


def reproduce(args) -> str:
    command = "python -m bench.calibrate_cpu" + (
        "" if args.name == "cpu-tiny" else f" --job {rel(args.job)} --from {rel(args.source)} --name {args.name}"
    )
    command += f" --split-with {rel(args.split_with)}" if args.split_with else ""
    return command + (f" --calibration {args.calibration}" if args.calibration else "")


def calibration_for(args, data: dict, job, command: str) -> tuple[Calibration, dict]:
    """The built-in calibration asked for (out of sample: the runs' facts for the report, no fit),
    or one fitted to the runs and written to pipelinerl/calibrations/NAME.yaml."""
    if args.calibration:
        calib, (_, facts) = load_calibration(args.calibration), derive(data, job, args.name)
        print(f"calibration: the built-in {args.calibration} ({calib.source[:60]}...)")
        return calib, facts
    other = None
    if args.split_with:
        other_data = load(args.split_with)
        other = (other_data, job_spec(args.job, other_data))
    calib, facts = calibrate(data, args.source, job, args.name, other)
    path = CALIBRATIONS / f"{args.name}.yaml"
    header = HEADER.format(source=rel(args.source), job=rel(args.job), command=command)
    path.write_text(header + calibration_yaml(calib))
    assert load_calibration(args.name) == calib, f"load_calibration({args.name!r}) must read the file just written"
    print(f"calibration -> {rel(path)}")
    return calib, facts


PRINTED = (
    "decode_base_s",
    "decode_per_seq_s",
    "max_batch",
    "prefill_s_per_token",
    "train_s_per_token",
    "optimizer_step_s",
    "weight_sync_s",
    "pause_s",
    "contention",
    "filtered_fraction",
)


def print_calibration(calib: Calibration, facts: dict) -> None:
    for k in PRINTED:
        print(f"  {k:20s} {getattr(calib, k):.4g}")
    print(
        f"  lengths              sampled from the warm start: mean {facts['sampled_lengths_mean']:.2f}, max "
        f"{facts['sampled_lengths_max']} tokens (the runs' mean: {facts['mean_completion_tokens']:.2f}), "
        f"prompt {calib.lengths.prompt_tokens}"
    )
    print(
        f"  sync generation phase {facts['sync_generation_phase_s']:.3f} s over {facts['sync_steps_used']} steps "
        f"({facts['sequences_generated_per_sync_step']:.0f} sequences generated per step)"
    )


def sim(r) -> dict:
    """What the report keeps of a simulated run."""
    keys = ("samples_per_s", "step_s", "gen_busy", "gen_fill", "train_busy", "lag_mean")
    return {k: getattr(r, k) for k in keys}


def validate(calib: Calibration, job, data: dict, steps: int) -> dict:
    """The calibration's prediction of the runs' modes (`steps` long) against what they measured,
    printed; the figures for the report."""
    pred = predict(calib, job, steps)
    meas = measured(data)
    rates = {mode: [r["samples_per_second"] for r in data["runs"][mode]] for mode in ("pipeline", "sync")}
    ratio = {
        "predicted": pred["pipeline"].samples_per_s / pred["sync"].samples_per_s,
        "measured": paired_ratios(rates["pipeline"], rates["sync"])["median"],
    }
    error = ratio["predicted"] / ratio["measured"] - 1
    rows = [
        [mode, p.samples_per_s, e["samples_per_s"], p.step_s, e["step_s"]]
        + [f"{x:.0%}" for x in (p.gen_busy, e["gen_busy"], p.train_busy, e["train_busy"])]
        for mode, p, e in ((mode, pred[mode], meas[mode]) for mode in ("pipeline", "sync"))
    ]
    head = ["mode", "pred samples/s", "meas", "pred s/step", "meas", "pred gen busy", "meas", "pred train busy", "meas"]
    print()
    print(table(head, rows))
    within = abs(error) <= TARGET
    print(
        f"\npipeline/sync ratio: predicted {ratio['predicted']:.2f}x, measured {ratio['measured']:.2f}x: "
        f"{error:+.1%} -> {'within' if within else 'NOT within'} {TARGET:.0%}"
    )
    print(f"pipeline token lag: predicted {pred['pipeline'].lag_mean:.2f}, measured {meas['pipeline']['lag_mean']:.2f}")
    return {
        "predicted": {mode: sim(r) for mode, r in pred.items()},
        "measured": meas,
        "ratio": ratio,
        "ratio_error": error,
        "target": TARGET,
        "within_target": within,
    }


def main() -> None:
    args = parse_args()
    data = load(args.source)
    job = job_spec(args.job, data)
    command = reproduce(args)
    calib, facts = calibration_for(args, data, job, command)
    print_calibration(calib, facts)
    steps = int(data["args"].get("steps", 150))
    checked = validate(calib, job, data, steps)
    sens = {} if args.calibration else sensitivity(calib, facts, job, steps)
    if sens:  # it re-fits to these runs
        print(
            "ratio if the decode cost were split otherwise: "
            + ", ".join(
                f"{k} " + ("n/a (too slow for the phase)" if v is None else f"{v:.2f}x") for k, v in sens.items()
            )
        )
    p = plan(job, 2, calib)
    print(
        f"`pipelinerl plan {rel(args.job)} --gpus 2 --gpu-type {args.calibration or args.name}`: "
        f"pipeline (maxLag {p.pipeline.max_lag}) "
        f"{p.pipeline.samples_per_s:.1f} samples/s vs sync {p.sync.samples_per_s:.1f}: {p.speedup:.2f}x"
    )
    lengths = {
        "distribution": calib.lengths.distribution,
        "mean": facts["mean_completion_tokens"],
        "prompt_tokens": calib.lengths.prompt_tokens,
    }
    save(
        "planner_validation" + ("" if args.name == "cpu-tiny" else f"-{args.name}"),
        {
            "source": rel(args.source),
            "job": rel(args.job),
            "variant": variant(data),
            "fitted_here": not args.calibration,
            "calibration": calib.model_dump(mode="json") | {"lengths": lengths},
            "derivation": facts,
            **checked,
            "ratio_sensitivity_to_decode_split": sens,
            "plan_2_devices": {
                "pipeline_max_lag": p.pipeline.max_lag,
                "pipeline": sim(p.pipeline),
                "sync": sim(p.sync),
                "speedup": p.speedup,
            },
        },
        command,
    )


if __name__ == "__main__":
    main()
