"""What the services' and the operator's /metrics say, from what they know: the series the chart's
alerts and dashboard read (their names are checked against a real Prometheus in
tests/e2e/test_watched_run.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest


def value(name: str, labels: dict | None = None, registry=REGISTRY) -> float | None:
    return registry.get_sample_value(name, labels or {})


STEP_METRICS = {
    "reward": 0.25,
    "lag_mean": 0.5,
    "lag_max": 2.0,
    "ess": 0.93,
    "kl": 0.01,
    "entropy": 1.7,
    "trainer_tokens_per_second": 1234.0,
    "weight_updates": 1,
    "weight_sync_seconds": 0.2,
    "samples": 16,
    "samples_stale": 4,
    "dropped_for_lag": 6,  # 4 stale (the preprocessor's) + 2 the trainer dropped
    "tokens": 300,
    "tokens_lag_0": 200,
    "tokens_lag_2": 100,
}


def test_a_step_sets_the_trainer_gauges_and_counts_samples_and_tokens_by_lag():
    from pipelinerl_trainer import metrics as prom

    prom.started(max_steps=50, step=7, max_lag=3)
    assert value("pipelinerl_trainer_max_steps") == 50 and value("pipelinerl_trainer_step") == 7
    # Every lag up to the budget has a series from the start, at 0 where nothing was trained yet.
    before = {lag: value("pipelinerl_trainer_tokens_total", {"lag": str(lag)}) for lag in range(4)}
    assert all(v is not None for v in before.values())
    samples = value("pipelinerl_trainer_samples_total")
    dropped = value("pipelinerl_trainer_samples_dropped_total")
    syncs = value("pipelinerl_weight_sync_seconds_count")
    prom.reported(STEP_METRICS, alarm=True)
    assert value("pipelinerl_trainer_ess") == 0.93 and value("pipelinerl_trainer_kl") == 0.01
    assert value("pipelinerl_trainer_entropy") == 1.7 and value("pipelinerl_trainer_lag_max") == 2.0
    assert value("pipelinerl_trainer_learning_alarm") == 1
    # Samples given to the step: those that reached it and those the preprocessor dropped as stale.
    assert value("pipelinerl_trainer_samples_total") - samples == 20
    assert value("pipelinerl_trainer_samples_dropped_total") - dropped == 6
    assert value("pipelinerl_weight_sync_seconds_count") - syncs == 1
    after = {lag: value("pipelinerl_trainer_tokens_total", {"lag": str(lag)}) for lag in range(4)}
    assert {lag: after[lag] - before[lag] for lag in range(4)} == {0: 200, 1: 0, 2: 100, 3: 0}
    prom.reported(STEP_METRICS | {"weight_updates": 0, "weight_sync_seconds": 0.0}, alarm=False)
    assert value("pipelinerl_trainer_learning_alarm") == 0
    assert value("pipelinerl_weight_sync_seconds_count") - syncs == 1  # a step inside a phase sent nothing


def test_each_step_moves_the_progress_time():
    from pipelinerl_trainer import metrics as prom

    started = value("pipelinerl_trainer_progress_timestamp_seconds")
    assert 0 < started <= time.time()  # set when the trainer process started, before any step
    prom.stepped(8)
    assert value("pipelinerl_trainer_step") == 8
    assert started <= value("pipelinerl_trainer_progress_timestamp_seconds") <= time.time()


def test_weight_sync_failures_count_what_is_new_since_the_last_look():
    from pipelinerl_trainer import metrics as prom

    gauges = prom.WeightGroupGauges()
    before = value("pipelinerl_trainer_weight_sync_failures_total")
    gauges.update(generators_in_group=2, weight_epoch=1, failures=0)
    gauges.update(generators_in_group=1, weight_epoch=2, failures=2)
    gauges.update(generators_in_group=1, weight_epoch=2, failures=2)  # looked again: nothing new
    gauges.update(generators_in_group=2, weight_epoch=3, failures=3)
    assert value("pipelinerl_trainer_weight_sync_failures_total") - before == 3
    assert value("pipelinerl_trainer_generators_in_group") == 2 and value("pipelinerl_trainer_weight_epoch") == 3


def test_a_generator_exports_its_busy_time_queue_and_newest_evaluation_when_scraped():
    from pipelinerl_generator.metrics import BusyClock, Scraped

    registry = CollectorRegistry()
    scraped = Scraped()
    registry.register(scraped)
    assert generate_latest(registry) == b""  # no generator yet: nothing
    clock = BusyClock()
    evaluator = SimpleNamespace(newest=None)
    generator = SimpleNamespace(busy=clock, admission=SimpleNamespace(queued=3), evaluator=evaluator)
    scraped.generator = generator
    clock.enter()
    time.sleep(0.05)
    # A spell still going counts (a generator kept busy all run long would otherwise show 0).
    busy = value("pipelinerl_generator_busy_seconds_total", registry=registry)
    assert 0.04 < busy < 1.0
    assert value("pipelinerl_generator_queued_groups", registry=registry) == 3
    # No evaluation yet: no accuracy series (a 0 would read as an accuracy).
    assert value("pipelinerl_generator_eval_accuracy", registry=registry) is None
    evaluator.newest = {"version": 4, "accuracy": 0.31, "reward": 0.4, "problems": 16, "seconds": 1.0}
    assert value("pipelinerl_generator_eval_accuracy", registry=registry) == 0.31
    assert value("pipelinerl_generator_eval_version", registry=registry) == 4


def test_every_preprocessor_outcome_has_a_series_from_the_start():
    from pipelinerl_preprocessor.main import OUTCOMES

    assert set(OUTCOMES) == {"accepted", "filtered", "stale", "dead_lettered"}
    for outcome in OUTCOMES:
        assert value("pipelinerl_preprocessor_groups_total", {"outcome": outcome}) is not None, outcome


def test_a_reconciled_namespace_has_a_reconcile_error_series_at_zero():
    from pipelinerl_operator import metrics

    assert value("pipelinerl_operator_reconcile_errors_total", {"namespace": "ns-x"}, metrics.REGISTRY) is None
    metrics.reconciling("ns-x")
    assert value("pipelinerl_operator_reconcile_errors_total", {"namespace": "ns-x"}, metrics.REGISTRY) == 0
    metrics.RECONCILE_ERRORS.labels("ns-x").inc()
    metrics.reconciling("ns-x")  # again: the count stays
    assert value("pipelinerl_operator_reconcile_errors_total", {"namespace": "ns-x"}, metrics.REGISTRY) == 1
