"""`pipelinerl plan --calibrate-from`: the costs a pilot run measured, from its files' content
(pure: `pipelinerl.planner.pilot`), and the command on a run folder written here. A real
`pipelinerl run` folder: tests/e2e/test_local_run.py (`test_plan_calibrates_from_a_local_run_folder`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipelinerl.messages import MicroBatch
from pipelinerl.planner.calibration import load_calibration
from pipelinerl.planner.pilot import (
    PilotError,
    completion_lengths,
    derive_calibration,
    devices,
    format_taken,
    train_rows,
)
from pipelinerl.planner.sim_params import wave_groups
from pipelinerl.planner.simulation import simulate
from pipelinerl.spec import parse_job
from pipelinerl_cli.main import main

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
BASE = load_calibration("cpu-tiny")


def pilot_job():
    return parse_job(yaml.safe_load(TINY.read_text()), str(TINY))


def metrics_jsonl(steps: int = 5) -> str:
    """A pilot's metrics.jsonl as `pipelinerl run` writes it: an evaluation, then one train row
    a step (128 samples of 4 completion tokens after 8-token prompts, 8 groups filtered)."""
    rows = [{"kind": "eval", "source": "generator-0", "time": 1.0, "version": 0, "accuracy": 0.2}]
    for step in range(1, steps + 1):
        rows.append(
            {
                "kind": "train",
                "source": "trainer",
                "time": 10.0 + 2.0 * step,
                "step": step,
                "samples": 128,
                "tokens": 512,
                "row_tokens": 1536,
                "train_seconds": 0.6 if step > 1 else 5.0,  # the first step carries the start-up
                "optimizer_seconds": 0.05,
                "weight_sync_seconds": 0.03,
                "weight_pause_max_seconds": 0.02,
                "groups_filtered": 8,
            }
        )
    return "\n".join(json.dumps(r) for r in rows) + "\n"


# 384 tokens/s at busy 0.5: 768 tokens per busy generator-second
SUMMARY = {
    "mode": "pipeline",
    "generator_busy_fraction": 0.5,
    "generated_tokens_per_second": 384.0,
    "samples_per_second": 64.0,
}


def test_train_rows_keeps_the_trainers_rows_and_names_a_bad_line():
    rows = train_rows(metrics_jsonl())
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    with pytest.raises(PilotError, match=r"run/metrics.jsonl:2: not JSON"):
        train_rows('{"kind": "train"}\n{oops\n', "run/metrics.jsonl")


def test_the_measured_costs_come_from_the_steps_after_the_first():
    calib, taken = derive_calibration(train_rows(metrics_jsonl()), pilot_job(), BASE, [4, 4, 5], SUMMARY, where="run")
    # 4 steady steps: (0.6 - 0.05) s over 1536 row tokens on one trainer device.
    assert calib.train_s_per_token == pytest.approx(0.55 / 1536)
    assert (calib.optimizer_step_s, calib.weight_sync_s, calib.pause_s) == pytest.approx((0.05, 0.03, 0.02))
    assert calib.lengths.prompt_tokens == 8 and calib.lengths.values == [4, 4, 5]
    assert calib.filtered_fraction == pytest.approx(32 / (32 + 4 * 128 / 8))
    # What a pilot cannot measure is the base's, and said so.
    assert (calib.max_batch, calib.train_scaling) == (BASE.max_batch, BASE.train_scaling)
    sources = {t.field: t.source for t in taken}
    assert "mean optimizer_seconds" in sources["optimizer_step_s"]
    assert "stored micro-batches" in sources["lengths"]
    assert "cannot measure" in sources["max_batch"]
    assert calib.source.startswith("calibrated from run on base cpu-tiny")
    text = format_taken(taken)
    assert "train_s_per_token" in text and "<- run: 4 steps after the first" in text


def test_the_decode_cost_is_scaled_until_the_pilot_decodes_as_fast_as_it_did():
    job = pilot_job()
    calib, _ = derive_calibration(train_rows(metrics_jsonl()), job, BASE, [4, 4, 5], SUMMARY)
    # summary.json: the generators' tokens per second over their busy fraction, the same window.
    measured = SUMMARY["generated_tokens_per_second"] / SUMMARY["generator_busy_fraction"]
    n_gen, n_train = devices(job)
    sim = simulate(
        "pipeline",
        n_gen,
        n_train,
        job.spec.max_lag,
        job.spec.trainer.samples_per_step,
        job.spec.rl.attempts,
        calib,
        job.spec.generator.sampling.max_tokens,
        wave_groups=wave_groups(job, n_train, calib.lengths),
        max_inflight=job.spec.generator.max_inflight_groups,
    )
    assert sim.gen_tokens_per_held_s == pytest.approx(measured, rel=0.03)
    scale = calib.decode_base_s / BASE.decode_base_s
    assert calib.decode_per_seq_s / BASE.decode_per_seq_s == pytest.approx(scale)
    assert scale > 1  # the pilot's engine is slower than the built-in's


def test_a_conventional_pilot_is_simulated_with_its_k_steps_a_phase():
    """A sync pilot with k = 4 generated 4 steps' samples a phase: the decode cost is fitted to
    that, as `plan` simulates conventional k (no cap on groups in flight), not to k = 1, which
    decodes far fewer tokens per busy second (short phases, the batch draining each step)."""
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["mode"] = "sync"
    doc["spec"]["rl"]["stepsPerGeneration"] = 4
    doc["spec"]["rl"].pop("maxLag", None)
    doc["spec"]["eval"]["interval"] = 48
    job = parse_job(doc, str(TINY))
    calib, _ = derive_calibration(train_rows(metrics_jsonl()), job, BASE, [4, 4, 5], SUMMARY | {"mode": "sync"})
    measured = SUMMARY["generated_tokens_per_second"] / SUMMARY["generator_busy_fraction"]
    n_gen, n_train = devices(job)
    common = (n_gen, n_train, 0, job.spec.trainer.samples_per_step, job.spec.rl.attempts, calib, 8)
    k4 = simulate("sync", *common, steps_per_generation=4)
    assert k4.gen_tokens_per_held_s == pytest.approx(measured, rel=0.03)
    assert simulate("sync", *common).gen_tokens_per_held_s < 0.9 * measured


def test_a_pilot_faster_than_its_bases_request_costs_allow_is_refused():
    """Each request's own cost (the base's) is not scaled: where it alone takes longer than the
    run's busy time per token, no decode cost reproduces the run, and the planner says so."""
    slow_requests = BASE.model_copy(update={"request_s": 0.5})
    with pytest.raises(
        PilotError, match="cpu-tiny's per-request costs and the pauses measured, no decode cost from x0.001 to x1000"
    ):
        derive_calibration(train_rows(metrics_jsonl()), pilot_job(), slow_requests, [4, 4, 5], SUMMARY, where="run")


def test_the_decode_cost_fitted_leaves_room_for_what_each_request_costs_beside_it():
    """A generator's busy time holds each request's own cost too (the base's, which a pilot
    cannot tell apart): the same run against a base whose requests cost more leaves less of its
    busy time to decoding, so its decode costs come out lower, not the same."""
    rows, job = train_rows(metrics_jsonl()), pilot_job()
    plain, _ = derive_calibration(rows, job, BASE, [4, 4, 5], SUMMARY)
    costly, _ = derive_calibration(rows, job, BASE.model_copy(update={"request_s": 0.002}), [4, 4, 5], SUMMARY)
    assert costly.decode_base_s < 0.9 * plain.decode_base_s
    n_gen, n_train = devices(job)
    waves = wave_groups(job, n_train, costly.lengths)
    cap = job.spec.generator.max_inflight_groups
    sim = simulate("pipeline", n_gen, n_train, job.spec.max_lag, 128, 8, costly, 8, wave_groups=waves, max_inflight=cap)
    assert sim.gen_tokens_per_held_s == pytest.approx(768, rel=0.02)  # converged
    # The order the rows come in does not matter.
    again, _ = derive_calibration(list(reversed(rows)), job, BASE, [4, 4, 5], SUMMARY)
    assert again == plain


def test_without_the_runs_files_the_base_fills_in_and_says_so():
    calib, taken = derive_calibration(train_rows(metrics_jsonl()), pilot_job(), BASE, None, None)
    sources = {t.field: t.source for t in taken}
    assert calib.decode_base_s == BASE.decode_base_s
    assert "no generator busy time" in sources["decode_*, prefill_s_per_token"]
    assert calib.lengths.distribution == "lognormal" and calib.lengths.mean_tokens == pytest.approx(4.0)
    assert calib.lengths.sigma == BASE.lengths.sigma and "sigma: cpu-tiny" in sources["lengths"]


def test_a_pilot_too_short_or_without_the_trainers_fields_is_refused():
    with pytest.raises(PilotError, match="2 trained step"):
        derive_calibration(train_rows(metrics_jsonl(2)), pilot_job(), BASE, where="run")
    rows = [{k: v for k, v in r.items() if k != "row_tokens"} for r in train_rows(metrics_jsonl())]
    with pytest.raises(PilotError, match="lack 'row_tokens'"):
        derive_calibration(rows, pilot_job(), BASE, where="run")


def test_completion_lengths_are_the_generated_tokens_of_each_packed_sample():
    # Two samples of 3 + 2 and 2 + 4 tokens (prompt + completion), then a sentinel row.
    mb = MicroBatch(
        step=0,
        rank=0,
        index=0,
        tokens=[1] * 11,
        positions=[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5],
        mask=[0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1],
        advantages=[0.0] * 11,
        logprobs=[0.0] * 11,
        versions=[0] * 11,
        weights=[1.0] * 11,
        lengths=[5, 6],
        rewards=[1.0, 0.0],
    )
    sentinel = MicroBatch(
        step=0,
        rank=1,
        index=0,
        tokens=[0],
        positions=[0],
        mask=[0],
        advantages=[0.0],
        logprobs=[0.0],
        versions=[0],
        weights=[0.0],
        lengths=[1],
        rewards=[0.0],
    )
    assert completion_lengths([mb, sentinel]) == [2, 4]
    # Only the steps the trainer reported (rows count steps from 1): step 0 here.
    assert completion_lengths([mb], [{"step": 1}]) == [2, 4] and completion_lengths([mb], [{"step": 2}]) == []


def run_folder(path: Path, with_summary: bool = True) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text(metrics_jsonl())
    (path / "job.yaml").write_text(TINY.read_text())
    if with_summary:
        (path / "summary.json").write_text(json.dumps(SUMMARY))
    return path


def test_cli_plans_from_a_run_folder_and_says_what_came_from_where(tmp_path, capsys):
    run = run_folder(tmp_path / "pilot")
    args = ["plan", str(TINY), "--gpus", "2", "--max-k", "2", "--calibrate-from", str(run)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert f"calibration from {run} (pilot job 'tiny-arith')" in err
    for field in ("train_s_per_token", "optimizer_step_s", "weight_sync_s", "filtered_fraction", "decode_*"):
        assert field in err
    assert "summary.json generated_tokens_per_second 384 / generator_busy_fraction 0.50" in err
    assert f"calibration cpu-tiny, calibrated from {run}" in out and "recommendation:" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["calibration"].startswith("cpu-tiny, calibrated from")


def test_cli_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(TINY), "--gpus", "2", "--calibrate-from", str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
