"""Calibration from a pilot run (pure): the costs a short run measured on the user's hardware.

`pipelinerl plan JOB --gpus N --calibrate-from RUN` reads a `pipelinerl run` folder or a job's
streams (the I/O: `pipelinerl_cli.calibrate_from`) and hands their content here:

- the trainer's per-step metrics rows (`metrics.jsonl`, or the METRICS stream): training cost
  per token, optimizer step, weight sync and the engines' pause, prompt length, the share of
  groups filtered as zero-variance, the step period;
- the run's summary (`summary.json`, local runs only): the generators' busy fraction;
- the completion lengths of the trained samples (the micro-batches the BATCHES stream keeps).

`derive_calibration` turns them into a `Calibration` and says where each number came from
(`Taken`). What a pilot cannot show (the split of the decode cost between the per-step and
per-sequence terms, the scaling of training with more devices, the engine's batch and KV
cache) is kept from a base calibration, and the base's decode costs are scaled together so that
the pilot's run, simulated, decodes as fast per busy second as the real one did.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from pipelinerl.planner.calibration import Calibration, Lengths, parse_calibration
from pipelinerl.planner.sim_params import wave_groups
from pipelinerl.planner.simulation import simulate
from pipelinerl.spec import PipelineRLJob

MIN_STEPS = 3  # train rows a pilot needs: the first step (start-up) is left out
DECODE_FIT_ROUNDS = 8  # secant steps of the decode scale at most (each a simulation of the pilot)
DECODE_FIT_TOLERANCE = 0.01  # ... until the pilot, simulated, decodes within 1% of the run
SCALES = (1e-3, 1e3)  # the decode scales tried, of the base's: beyond them the base is not this hardware's


class PilotError(ValueError):
    """A pilot run that cannot calibrate: the message says what is missing, and where."""


@dataclass(frozen=True)
class Taken:
    """One calibration field and where its value came from."""

    field: str
    value: float | int | str
    source: str


def train_rows(metrics_jsonl: str, where: str = "metrics.jsonl") -> list[dict]:
    """The trainer's rows of a run's metrics.jsonl (one JSON object a line; other kinds skipped)."""
    rows = []
    for n, line in enumerate(metrics_jsonl.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PilotError(f"{where}:{n}: not JSON ({err.msg})") from None
        if isinstance(row, dict) and row.get("kind") == "train":
            rows.append(row)
    return rows


def completion_lengths(batches: list, rows: list[dict] | None = None) -> list[int]:
    """Completion lengths of the samples packed into micro-batches (`MicroBatch`: `lengths` per
    packed sample, `mask` marking the generated tokens); sentinels and prompts count nothing.
    With the trainer's `rows`, only the steps they trained (the preprocessor may have packed
    the next ones already)."""
    trained = None if rows is None else {int(r["step"]) - 1 for r in rows}  # rows count steps from 1
    out = []
    for mb in batches:
        if trained is not None and mb.step not in trained:
            continue
        at = 0
        for n in mb.lengths:
            generated = sum(mb.mask[at : at + n])
            if generated:
                out.append(int(generated))
            at += n
    return out


def _require(rows: list[dict], key: str, where: str) -> list[float]:
    values = [r.get(key) for r in rows]
    if any(v is None for v in values):
        raise PilotError(f"{where}: train rows lack '{key}' (a run of an older version?)")
    return [float(v) for v in values]  # type: ignore[arg-type]


def devices(job: PipelineRLJob) -> tuple[int, int]:
    """(generator devices, trainer devices) of a job: CPU processes count one each."""
    spec = job.spec
    return spec.generator.replicas * max(spec.generator.gpus, 1), spec.trainer_ranks


def derive_calibration(
    rows: list[dict],
    pilot: PipelineRLJob,
    base: Calibration,
    lengths: list[int] | None = None,
    summary: dict | None = None,
    where: str = "the pilot run",
    name: str | None = None,
) -> tuple[Calibration, list[Taken]]:
    """The calibration a pilot run measured: `rows` its trainer metrics rows, `pilot` the job it
    ran, `base` the calibration whose unmeasurable costs are kept, `lengths` the completion
    lengths of its trained samples (None: a lognormal of the measured mean with the base's
    sigma), `summary` its summary.json (None: from a stream, no generator busy time)."""
    if len(rows) < MIN_STEPS:
        raise PilotError(f"{where}: {len(rows)} trained step(s); a pilot needs at least {MIN_STEPS}")
    ordered = sorted(rows, key=lambda r: r.get("step", 0))
    steady = ordered[1:]  # step 1 carries the start-up
    spec = pilot.spec
    n_gen, n_train = devices(pilot)
    taken: list[Taken] = []

    def take(field: str, value, source: str):
        taken.append(Taken(field, value, source))
        return value

    samples = sum(_require(steady, "samples", where))
    tokens = sum(_require(steady, "tokens", where))
    row_tokens = sum(_require(steady, "row_tokens", where))
    train_s = _require(steady, "train_seconds", where)
    opt_s = [float(r.get("optimizer_seconds") or 0.0) for r in steady]
    if not samples or not tokens:
        raise PilotError(f"{where}: its steps trained no samples")
    src = f"{where}: {len(steady)} steps after the first"

    optimizer = take("optimizer_step_s", float(np.mean(opt_s)), f"{src}, mean optimizer_seconds")
    # train_s(tokens, n) = tokens · per_token / (n · scaling^log2 n): inverted at the pilot's n.
    per_token = (sum(train_s) - sum(opt_s)) / row_tokens * n_train * base.train_scaling ** math.log2(n_train)
    take(
        "train_s_per_token",
        per_token,
        f"{src}, (train_seconds - optimizer_seconds) / row_tokens on {n_train} trainer device(s)",
    )
    sync = take(
        "weight_sync_s",
        float(np.mean(_require(steady, "weight_sync_seconds", where))),
        f"{src}, mean weight_sync_seconds",
    )
    pauses = [float(r["weight_pause_max_seconds"]) for r in steady if r.get("weight_pause_max_seconds") is not None]
    pause = (
        take("pause_s", float(np.mean(pauses)), f"{src}, mean weight_pause_max_seconds")
        if pauses
        else take("pause_s", sync, f"{where}: no weight_pause_max_seconds; the weight sync's")
    )
    prompt = take(
        "lengths.prompt_tokens", round((row_tokens - tokens) / samples), f"{src}, (row_tokens - tokens) / samples"
    )
    filtered_groups = sum(float(r.get("groups_filtered") or 0) for r in steady)
    kept_groups = samples / spec.rl.attempts
    filtered = take(
        "filtered_fraction",
        filtered_groups / (filtered_groups + kept_groups),
        f"{src}, groups_filtered / (groups_filtered + samples / attempts)",
    )
    mean_len = tokens / samples
    if lengths:
        dist = Lengths(distribution="empirical", values=lengths, prompt_tokens=prompt)
        take(
            "lengths",
            f"empirical, {len(lengths)} values, mean {np.mean(lengths):.1f}",
            f"{where}: the stored micro-batches",
        )
    else:
        dist = Lengths(mean_tokens=mean_len, sigma=base.lengths.sigma, prompt_tokens=prompt)
        take(
            "lengths",
            f"lognormal, mean {mean_len:.1f}, sigma {base.lengths.sigma}",
            f"{src}, tokens / samples; sigma: {base.name}",
        )

    calib = base.model_copy(
        update=dict(
            name=name or f"{base.name}, calibrated from {where}",
            train_s_per_token=per_token,
            optimizer_step_s=optimizer,
            weight_sync_s=sync,
            pause_s=pause,
            filtered_fraction=min(filtered, 0.99),
            lengths=dist,
        )
    )

    # Decode: one pilot cannot tell the per-step from the per-sequence cost, so the base's
    # decode costs are scaled together until the pilot, simulated, decodes as many tokens per
    # busy generator-second as the run did: summary.json's generated tokens/s over its busy
    # fraction, both over the run's steady window (every token the generators made, the filtered
    # groups' and evaluations' too). Busy as the run counts it while a generator holds a group:
    # its prefill, each request's own cost (the base's, kept) and the update pauses in it (the
    # run's also holds its evaluations and publishing, which the simulation has not).
    busy = (summary or {}).get("generator_busy_fraction")
    rate = (summary or {}).get("generated_tokens_per_second")
    if busy and rate:
        measured = rate / busy
        scale = _fit_decode_scale(pilot, calib, measured, where, base.name)
        calib = _scaled(calib, scale)
        take(
            "decode_*, prefill_s_per_token",
            f"{base.name}'s x {scale:.3g}",
            f"{where}: {measured:,.0f} tokens per busy generator-second (summary.json generated_tokens_per_second "
            f"{rate:,.0f} / generator_busy_fraction {busy:.2f}); the pilot, simulated with them, decodes as fast",
        )
    else:
        take("decode_*, prefill_s_per_token", f"{base.name}'s", f"{where}: no generator busy time (summary.json)")
    for kept in ("max_batch", "kv_cache_tokens", "train_scaling", "gpus_per_engine", "contention", "tensor_parallel"):
        value = getattr(calib, kept)
        shown = "none" if value is None else "given" if kept == "tensor_parallel" else value
        take(kept, shown, f"{base.name} (a pilot cannot measure it)")
    source = f"calibrated from {where} on base {base.name}: " + "; ".join(f"{t.field} <- {t.source}" for t in taken)
    return parse_calibration(calib.model_dump() | {"source": source}, where), taken


def _fit_decode_scale(pilot: PipelineRLJob, calib: Calibration, measured: float, where: str, base: str) -> float:
    """The scale of `calib`'s decode costs at which the pilot, simulated, decodes `measured`
    tokens per busy generator-second (within DECODE_FIT_TOLERANCE). A busy second's time per
    token is about linear in the scale (the decode part scales; each request's own cost and the
    pauses do not): secant steps on it, from the base and a proportional guess. PilotError where
    no scale in SCALES reproduces the run (its fixed part alone is slower than the run)."""
    target = 1 / measured

    def per_token(scale: float) -> float:
        got = _simulate_pilot(pilot, _scaled(calib, scale)).gen_tokens_per_held_s
        return 1 / got if got else math.inf

    s0, y0 = 1.0, per_token(1.0)
    if not math.isfinite(y0):
        raise PilotError(f"{where}: the pilot, simulated on {base}'s costs, decodes nothing")
    s1, y1 = target / y0, y0
    for _ in range(DECODE_FIT_ROUNDS):
        if abs(y0 / target - 1) <= DECODE_FIT_TOLERANCE:
            return s0
        if not SCALES[0] < s1 < SCALES[1]:
            break
        y1 = per_token(s1)
        if y1 == y0 or not math.isfinite(y1):
            s0, y0 = s1, y1
            break
        s0, y0, s1 = s1, y1, s1 + (target - y1) * (s1 - s0) / (y1 - y0)
    if abs(y0 / target - 1) <= DECODE_FIT_TOLERANCE:
        return s0
    raise PilotError(
        f"{where}: its generators decoded {measured:,.0f} tokens per busy second; with {base}'s per-request "
        f"costs and the pauses measured, no decode cost from x{SCALES[0]:g} to x{SCALES[1]:g} of {base}'s "
        "reproduces that: give a base without per-request costs, or one of this hardware"
    )


def _scaled(calib: Calibration, scale: float) -> Calibration:
    return calib.model_copy(
        update={
            "decode_base_s": calib.decode_base_s * scale,
            "decode_per_seq_s": calib.decode_per_seq_s * scale,
            "decode_per_token_s": calib.decode_per_token_s * scale,
            "prefill_s_per_token": calib.prefill_s_per_token * scale,
        }
    )


def _simulate_pilot(pilot: PipelineRLJob, calib: Calibration):
    spec = pilot.spec
    n_gen, n_train = devices(pilot)
    pipeline = spec.mode == "pipeline"
    return simulate(
        "pipeline" if pipeline else "sync",
        n_gen,
        n_train,
        spec.max_lag if pipeline else 0,
        spec.trainer.samples_per_step,
        spec.rl.attempts,
        calib,
        spec.generator.sampling.max_tokens,
        wave_groups=wave_groups(pilot, n_train, calib.lengths) if pipeline else 0,
        # As `plan` simulates each mode: only the pipeline caps its groups in flight; a phased
        # pilot generates k steps' samples a phase.
        max_inflight=spec.generator.max_inflight_groups if pipeline else None,
        steps_per_generation=spec.steps_per_generation,
        filtered=calib.filtered_fraction if spec.rl.filter_zero_variance else 0.0,
    )


def format_taken(taken: list[Taken]) -> str:
    """What came from where, one field a line (printed by `pipelinerl plan --calibrate-from`)."""
    width = max(len(t.field) for t in taken)
    lines = []
    for t in taken:
        value = f"{t.value:.4g}" if isinstance(t.value, float) else str(t.value)
        lines.append(f"  {t.field.ljust(width)}  {value:>12}  <- {t.source}")
    return "\n".join(lines)
