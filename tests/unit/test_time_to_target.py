"""Benchmark 1's time-to-target estimator (bench/pipeline_vs_sync.py): an isotonic fit of the
held-out curve, so one lucky evaluation does not decide when a target is reached."""

import pytest

from bench.pipeline_vs_sync import crossing_time, isotonic, time_to_target


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
    return {"steps_log": [{"time": 1.0, "train_seconds": 1.0}],
            "evals": [{"version": 0, "time": 0.0, "accuracy": warm}]
            + [{"version": 10 * (i + 1), "time": t, "accuracy": a} for i, (t, a) in enumerate(curve)]}


def test_time_to_target_pools_rounds_and_counts_from_the_start_of_training():
    a = run(0.30, [(10, 0.35), (20, 0.50)])
    b = run(0.30, [(10, 0.45), (20, 0.40)])
    assert time_to_target([a], 10) == pytest.approx(13.333, abs=1e-3)  # +10 points = 0.40
    assert time_to_target([b], 10) == 10
    # Pooled: points (10, .35) (10, .45) (20, .40) (20, .50) -> fit .35 .425 .425 .5
    assert time_to_target([a, b], 10) == pytest.approx(10.0)
    assert time_to_target([a, b], 25) is None
