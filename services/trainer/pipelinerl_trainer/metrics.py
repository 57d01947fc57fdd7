"""The trainer's Prometheus metrics (its `/metrics`), and what each step sets them to.

The chart's alerting rules and dashboard read these names (`charts/pipelinerl/files/alerts.yaml`,
`dashboards/pipelinerl.json`); an end-to-end test checks every one of their queries against a real
Prometheus scraping a real run. Counters of a step are counted once, by rank 0 (its metrics are
all ranks' together); gauges every rank knows (step, progress time) are set on every rank.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

STEP = Gauge("pipelinerl_trainer_step", "Optimizer steps taken (= policy version)")
MAX_STEPS = Gauge("pipelinerl_trainer_max_steps", "Steps the job trains (spec.trainer.maxSteps)")
PROGRESS_TIME = Gauge(
    "pipelinerl_trainer_progress_timestamp_seconds",
    "Unix time of the last optimizer step (before the first: of the start)",
)
PROGRESS_TIME.set_to_current_time()  # the process's start: a trainer stuck loading its model is stalled too
REWARD = Gauge("pipelinerl_trainer_reward", "Mean reward of the samples the last step took, trained or filtered")
LAG = Gauge("pipelinerl_trainer_lag_mean", "Mean token lag of the last step")
LAG_MAX = Gauge("pipelinerl_trainer_lag_max", "Largest token lag trained in the last step")
ESS = Gauge("pipelinerl_trainer_ess", "Effective sample size of the last step, in (0, 1] (1: on-policy)")
KL = Gauge("pipelinerl_trainer_kl", "Mean KL to the reference model over the last step's tokens (0 without one)")
ENTROPY = Gauge("pipelinerl_trainer_entropy", "Mean policy entropy over the last step's tokens")
TOKENS_PER_S = Gauge("pipelinerl_trainer_tokens_per_second", "Trainer throughput of the last step")
SYNC_S = Histogram(
    "pipelinerl_weight_sync_seconds",
    "Duration of weight updates (broadcast + all generators loaded)",
    buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
)
SAMPLES = Counter(
    "pipelinerl_trainer_samples_total",
    "Samples given to steps: trained, or dropped for lag (by the preprocessor as stale, or by the trainer)",
)
SKIPPED_STEPS = Counter(
    "pipelinerl_trainer_steps_skipped_total",
    "Optimizer steps that applied no update (non-finite gradients, or an fp16 loss-scale overflow)",
)
DROPPED = Counter("pipelinerl_trainer_samples_dropped_total", "Samples dropped for exceeding max lag")
REJECTED = Counter(
    "pipelinerl_trainer_samples_rejected_total", "Samples the model cannot take (dead-lettered, not trained)"
)
TOKENS_BY_LAG = Counter(
    "pipelinerl_trainer_tokens_total",
    "Tokens trained, by lag (the step's version minus the version of the weights that sampled the token)",
    ["lag"],
)
EMPTY_STEPS = Counter("pipelinerl_trainer_steps_without_tokens_total", "Steps that trained no tokens")
ALARM = Gauge("pipelinerl_trainer_learning_alarm", "1 while the newest steps show no learning (see the log)")
IN_GROUP = Gauge("pipelinerl_trainer_generators_in_group", "Generators in the weight group's current epoch (rank 0)")
WEIGHT_EPOCH = Gauge(
    "pipelinerl_trainer_weight_epoch", "Weight-group epochs opened: one per join, leave or drop (rank 0)"
)
SYNC_FAILURES = Counter(
    "pipelinerl_trainer_weight_sync_failures_total",
    "Weight updates that failed (rank 0): a generator dropped (no join, no confirmation in time, a failed load) "
    "or a broadcast broken",
)


def started(max_steps: int, step: int, max_lag: int) -> None:
    """At start (or restart, from a checkpoint at `step`): every series the rules read exists."""
    MAX_STEPS.set(max_steps)
    STEP.set(step)
    for lag in range(max_lag + 1):  # a lag with no tokens yet is a 0, not a missing series
        TOKENS_BY_LAG.labels(str(lag))


def stepped(version: int) -> None:
    """Every rank, after its optimizer step."""
    STEP.set(version)
    PROGRESS_TIME.set(time.time())


def reported(metrics: dict, alarm: bool) -> None:
    """Rank 0: a step's metrics (all ranks' together), as `Trainer._report` has them."""
    REWARD.set(metrics["reward"])
    LAG.set(metrics["lag_mean"])
    LAG_MAX.set(metrics["lag_max"])
    ESS.set(metrics["ess"])
    KL.set(metrics["kl"])
    ENTROPY.set(metrics["entropy"])
    TOKENS_PER_S.set(metrics["trainer_tokens_per_second"])
    if metrics["weight_updates"]:  # conventional k: once per phase
        SYNC_S.observe(metrics["weight_sync_seconds"])
    SAMPLES.inc(metrics["samples"] + metrics["samples_stale"])
    DROPPED.inc(metrics["dropped_for_lag"])
    EMPTY_STEPS.inc(metrics["tokens"] == 0)
    SKIPPED_STEPS.inc(metrics.get("step_skipped", 0))
    for key, count in metrics.items():
        if key.startswith("tokens_lag_"):
            TOKENS_BY_LAG.labels(key.removeprefix("tokens_lag_")).inc(count)
    ALARM.set(alarm)


class WeightGroupGauges:
    """Rank 0: the weight group as the sender sees it. Its failures are a running count of this
    process; the counter takes what is new since the last look."""

    def __init__(self) -> None:
        self.failures = 0

    def update(self, generators_in_group: int, weight_epoch: int, failures: int) -> None:
        IN_GROUP.set(generators_in_group)
        WEIGHT_EPOCH.set(weight_epoch)
        SYNC_FAILURES.inc(max(0, failures - self.failures))
        self.failures = max(self.failures, failures)
