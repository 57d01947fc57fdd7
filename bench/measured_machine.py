"""The machine benchmark 12 measured (`bench/decode_curve.py`), read back from its result: the
example jobs' lengths and filtered shares (their built-in calibrations), and on that machine the
bound and a conventional phase's rate for a benchmark-11 run (`bench/pipeline_vs_sync.py`), as
predictions nothing of that run was fitted to."""

from __future__ import annotations

import os
from dataclasses import replace

from bench.common import RESULTS
from bench.results_store import read_result
from pipelinerl.planner.bound import DecodeCurve, Machine, bound, phase_generation
from pipelinerl.planner.calibration import Calibration, Lengths, load_calibration

JOBS = {  # benchmark 12's jobs: their files and benchmark 11's result of their runs
    "tiny": ("examples/tiny-cpu.yaml", "conventional_k-tiny"),
    "long-tail": ("examples/long-tail-cpu.yaml", "conventional_k-long-tail"),
}
CALIBRATION_OF_JOB = {"tiny-cpu.yaml": "cpu-tiny", "long-tail-cpu.yaml": "cpu-long-tail"}  # their lengths


def saved_machine(job: str, name: str = "decode_curve") -> Machine | None:
    """The machine benchmark 12 measured (bench/results/NAME.json) for `job`, if it has run (and
    timed that job's trainer): `machine_of` its result."""
    path = RESULTS / f"{name}.json"
    key = job_key(job)
    return machine_of(read_result(path), key) if path.exists() and key is not None else None


def machine_of(data: dict, key: str) -> Machine | None:
    """The machine of benchmark 12's result `data`, with the trainer's rates on the steps of its
    job `key` (None where it did not time them): the decode curve with each request's cost on the
    rollout path (older results: the engine's), the engines side by side, the trainer beside an
    engine, the weight update's costs (older results: unmeasured, 0; a median the pairs' noise
    left below 0 counts as 0)."""
    train = data["trainer_tokens_per_s"].get(key)
    if train is None:
        return None
    curve = DecodeCurve(**data["curve"])
    rollout = data.get("rollout_path", {})
    if rollout:
        curve = replace(curve, request_s=rollout["request_s"])
    updates = rollout.get("update_costs", {})
    return Machine(
        cores=max(int(c) for c in train),
        curve=curve,
        train_tokens_per_s={int(c): s["median"] for c, s in train.items()},
        engine_scaling=data.get("engines_side_by_side", {}).get("engine_scaling", 1.0),
        trainer_beside=data.get("trainer_beside_engine", {}).get(key, {}).get("scaling", 1.0),
        update_s=updates.get("trainer_s", 0.0),
        pause_s=max(0.0, updates.get("generator_s", 0.0)),
    )


def job_key(job: str) -> str | None:
    """Benchmark 12's name of an example job (JOBS), by its file."""
    return next((key for key, (path, _) in JOBS.items() if os.path.basename(path) == os.path.basename(job)), None)


def job_calibration(job: str) -> Calibration | None:
    """An example job's built-in calibration: what it holds of the task (lengths, filtered share)."""
    name = CALIBRATION_OF_JOB.get(os.path.basename(job))
    return None if name is None else load_calibration(name)


def job_length_model(job: str) -> Lengths | None:
    """An example job's completion and prompt lengths, as its built-in calibration holds them."""
    calibration = job_calibration(job)
    return None if calibration is None else calibration.lengths


def job_filtered_fraction(job: str) -> float:
    """An example job's share of groups dropped by zero-variance filtering, as its built-in
    calibration holds it (a property of the task and model, like its lengths)."""
    calibration = job_calibration(job)
    return 0.0 if calibration is None else calibration.filtered_fraction


def sample_of(lengths: Lengths) -> tuple[list[int], int]:
    """A sample of completion lengths (the mean, for a lognormal) and the prompt tokens."""
    return lengths.values or [int(lengths.mean_tokens or 1)], lengths.prompt_tokens


def job_lengths(job: str) -> tuple[list[int], int] | None:
    """An example job's sample of completion lengths and prompt tokens (`sample_of`)."""
    lengths = job_length_model(job)
    return None if lengths is None else sample_of(lengths)


def predicted_phase_rate(job: str, engines: int, samples: int, curve: str = "decode_curve") -> float | None:
    """The tokens/s the measured curve (benchmark 12's result `curve`) predicts for a
    conventional phase that trains `samples` completions of `job` (the example's lengths, from
    its calibration) on `engines` engines, the tail and each request's cost included: its
    trained tokens over the time to generate them and the groups filtering drops (the job's
    filtered share), as a run's phases count them (`pipelinerl.phases`); None without that
    result or for a job without a calibration."""
    machine, lengths = saved_machine(job, curve), job_lengths(job)
    if machine is None or lengths is None:
        return None
    sample, prompt = lengths
    generated = round(samples / (1 - job_filtered_fraction(job)))
    gen_s, _, _ = phase_generation(replace(machine, cores=engines), sample, prompt, generated)
    trained = sum(sample[i % len(sample)] for i in range(samples))  # as phase_generation cycles them
    return trained / gen_s


def bound_with_trainer(
    job: str,
    k: int,
    samples_per_step: int,
    train_tokens_per_s: dict[int, float],
    engines: int | None = None,
    curve: str = "decode_curve",
):
    """The bound (`pipelinerl.planner.bound.bound`) on benchmark 12's decode curve and engines
    (its result `curve`), with a run's own trainer rates by cores (its rows' tokens over its
    training seconds, each side's trainer where it ran: the pipeline's beside its engine), the
    conventional phase's `engines` (None: one per core) and the job's filtered share; None where
    it cannot be formed."""
    machine, lengths = saved_machine(job, curve), job_lengths(job)
    if machine is None or lengths is None or set(train_tokens_per_s) != set(machine.train_tokens_per_s):
        return None
    machine = replace(machine, train_tokens_per_s=train_tokens_per_s, trainer_beside=1.0)
    return bound(machine, lengths[0], lengths[1], samples_per_step, k, engines, job_filtered_fraction(job))


def measured_ratios(result: str) -> dict[int, float]:
    """Benchmark 11's pipeline / conventional k samples/s (median over its rounds), by k."""
    path = RESULTS / f"{result}.json"
    if not path.exists():
        return {}
    data = read_result(path)
    out = {}
    for mode, b in data.get("baselines", {}).items():
        k = 1 if mode == "sync" else int(mode.removeprefix("sync-k"))
        out[k] = b["samples_rate_ratio"]["median"]
    return out
