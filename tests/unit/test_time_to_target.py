"""The benchmarks' analysis (bench/analysis.py): time to target read off an isotonic fit of the
held-out curve, so one lucky evaluation does not decide when a target is reached; pooled ratios, their
bootstrap interval, the per-version gap; and the jobs it runs."""

import math
import os
from pathlib import Path

import pytest

from bench.analysis import accuracy_gap, bootstrap_interval, crossing_time, isotonic, pooled_ratio, time_to_target
from bench.pipeline_vs_sync import MODES, cores_for, job_for, steps_per_generation


def test_isotonic_pools_adjacent_violators():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert isotonic([5, 1, 1, 1]) == [2, 2, 2, 2]
    assert isotonic([0.1, 0.2, 0.3]) == [0.1, 0.2, 0.3]  # already monotone: unchanged
    fit = isotonic([0.3, 0.5, 0.2, 0.4, 0.6, 0.5])
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(0.3 + 0.5 + 0.2 + 0.4 + 0.6 + 0.5)  # least squares keeps the mean


def test_crossing_time_interpolates_on_the_fit_not_the_first_lucky_point():
    # A spike at t=10 reaches 0.5 alone; the fit averages it with its lower successors.
    points = [(10, 0.5), (20, 0.3), (30, 0.4), (40, 0.6)]
    assert crossing_time(points, 0.5) == pytest.approx(30 + 10 * (0.5 - 0.4) / (0.6 - 0.4))
    assert crossing_time(points, 0.39) == 10  # the pooled first block (0.4) is already above
    assert crossing_time(points, 0.7) is None
    assert crossing_time(list(reversed(points)), 0.5) == crossing_time(points, 0.5)  # order-free


def run(warm, curve):
    return {
        "steps_log": [{"time": 1.0, "train_seconds": 1.0}],
        "evals": [{"version": 0, "time": 0.0, "accuracy": warm}]
        + [{"version": 10 * (i + 1), "time": t, "accuracy": a} for i, (t, a) in enumerate(curve)],
    }


def test_time_to_target_pools_rounds_and_counts_from_the_start_of_training():
    a = run(0.30, [(10, 0.35), (20, 0.50)])
    b = run(0.30, [(10, 0.45), (20, 0.40)])
    assert time_to_target([a], 10) == pytest.approx(13.333, abs=1e-3)  # +10 points = 0.40
    # Reached before the first evaluation: interpolated from the warm start at the start of
    # training (fit .30 .425 .425), not taken as the first evaluation's time.
    assert time_to_target([b], 10) == pytest.approx(8.0)
    # Pooled: (0, .30) (0, .30) (10, .35) (10, .45) (20, .40) (20, .50) -> fit .30 .30 .35 .425 .425 .5
    assert time_to_target([a, b], 10) == pytest.approx(10.0)
    assert time_to_target([a, b], 25) is None


def test_pooled_ratio_in_time_or_steps_and_when_a_mode_misses():
    fast = run(0.30, [(10, 0.40), (20, 0.50)])  # +10 at t=10, version 10
    slow = run(0.30, [(30, 0.35), (60, 0.40)])  # +10 at t=60, version 20
    assert pooled_ratio([fast], [slow], 10) == pytest.approx(6.0)
    assert pooled_ratio([fast], [slow], 10, axis="version") == pytest.approx(2.0)
    assert pooled_ratio([slow], [fast], 15) == 0.0  # only the pipeline misses +15
    assert pooled_ratio([fast], [slow], 15) == math.inf  # only sync misses it
    assert math.isnan(pooled_ratio([slow], [slow], 30))


def test_bootstrap_interval_brackets_the_pooled_ratio_and_is_reproducible():
    pipe = [run(0.30, [(10, 0.35 + d), (20, 0.45 + d)]) for d in (0.0, 0.02, -0.02, 0.04)]
    sync = [run(0.30, [(20, 0.35 + d), (40, 0.45 + d)]) for d in (0.01, -0.01, 0.03, 0.0)]
    ci = bootstrap_interval(pipe, sync, 10, resamples=200, seed=3)
    assert ci["p5"] <= pooled_ratio(pipe, sync, 10) <= ci["p95"]
    assert 1.3 < ci["p5"] and ci["p95"] < 3.0  # the sync curves are about the pipeline's, twice as slow
    assert ci == bootstrap_interval(pipe, sync, 10, resamples=200, seed=3)
    one = bootstrap_interval(pipe[:1], sync[:1], 10, resamples=50)
    assert one["p5"] == one["p95"] == pytest.approx(pooled_ratio(pipe[:1], sync[:1], 10))
    # Runs pooled from several files need not pair up: each side is resampled on its own.
    unpaired = bootstrap_interval(pipe[:3], sync[:2], 10, resamples=200, seed=3)
    assert unpaired["p5"] <= pooled_ratio(pipe[:3], sync[:2], 10) <= unpaired["p95"]


def test_accuracy_gap_compares_mean_accuracy_at_equal_version_in_points():
    runs = {
        "pipeline": [run(0.30, [(5, 0.40), (10, 0.50)]), run(0.30, [(5, 0.42), (10, 0.46)])],
        "sync": [run(0.30, [(9, 0.45), (20, 0.47)])],
    }
    assert accuracy_gap(runs) == pytest.approx({0: 0.0, 10: -4.0, 20: 1.0})


def test_job_for_changes_only_the_pipelines_spec():
    pipe = job_for("pipeline", 20, 5, "t", ["rl.maxLag=2", "rl.importanceWeights=token", "trainer.seed=7"])
    assert (pipe.spec.rl.max_lag, pipe.spec.rl.importance_weights, pipe.spec.trainer.seed) == (2, "token", 7)
    assert (pipe.spec.trainer.max_steps, pipe.spec.trainer.export_interval, pipe.spec.eval.interval) == (20, 5, 0)
    sync = job_for("sync", 20, 5, "t", ["rl.maxLag=2"])  # the baseline is never changed
    assert sync.spec.mode == "sync" and sync.spec.max_lag == 0 and sync.spec.trainer.seed != 7
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        job_for("pipeline", 20, 5, "t", ["rl.maxLag"])
    # A value is read as kubectl reads YAML: 5e-05 (what f"{lr}" gives) is a number, not a string.
    assert job_for("pipeline", 20, 5, "t", ["trainer.learningRate=5e-05"]).spec.trainer.learning_rate == 5e-05


def test_job_for_changes_both_modes_with_both_set():
    pipe, sync = (
        job_for(mode, 20, 5, "t", ["rl.maxLag=2"], both_set=["trainer.samplesPerStep=64", "rl.maxLag=3"])
        for mode in ("pipeline", "sync")
    )
    assert pipe.spec.trainer.samples_per_step == sync.spec.trainer.samples_per_step == 64
    assert (pipe.spec.max_lag, sync.spec.max_lag) == (2, 0)  # the pipeline's own setting wins; sync stays sync


def test_sync_baseline_generates_its_whole_step_at_once():
    # A job that caps the pipeline's groups in flight below a step's: sync does not keep the cap.
    job = Path(__file__).resolve().parents[2] / "examples" / "long-tail-cpu.yaml"
    pipe, sync = (
        job_for(mode, 20, 5, "t", job=job, both_set=["generator.maxInflightGroups=8"]) for mode in ("pipeline", "sync")
    )
    assert pipe.spec.generator.max_inflight_groups < pipe.spec.groups_per_step
    assert sync.spec.generator.max_inflight_groups >= sync.spec.groups_per_step


def test_the_conventional_baseline_with_k_steps_per_phase_and_its_cores():
    k4 = job_for("sync-k4", 20, 5, "t", ["rl.maxLag=2"])
    assert (k4.spec.mode, k4.spec.steps_per_generation, k4.spec.max_lag) == ("sync", 4, 3)
    assert job_for("sync", 20, 5, "t").spec.steps_per_generation == 1
    assert job_for("pipeline", 20, 5, "t").spec.steps_per_generation == 1
    assert [steps_per_generation(m) for m in MODES] == [1, 1, 2, 4, 8, 16, 32]
    # The pipeline's stages run at once, each on its own core; the baseline's phases as asked.
    assert cores_for("pipeline", "colocated") == "split"
    assert cores_for("sync-k4", "colocated") == "colocated" and cores_for("sync", "split") == "split"


def test_the_colocated_baseline_generates_on_an_engine_per_core():
    from types import SimpleNamespace

    from bench.pipeline_vs_sync import colocated_engines

    assert job_for("sync-k8", 20, 5, "t", engines=2).spec.generator.replicas == 2
    assert job_for("pipeline", 20, 5, "t", engines=2).spec.generator.replicas == 1  # the pipeline's own split
    assert colocated_engines(SimpleNamespace(colocated_engines=0)) == len(os.sched_getaffinity(0))
    assert colocated_engines(SimpleNamespace(colocated_engines=1)) == 1  # benchmark 11 before 2026-12-02
