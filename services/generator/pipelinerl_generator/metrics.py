"""The generator's Prometheus metrics (its `/metrics`): counters and gauges the service sets, and
what a scrape reads from the running generator (`Scraped`). The chart's alerting rules and
dashboard read these names."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GROUPS = Counter("pipelinerl_generator_groups_total", "Prompt groups published")
TOKENS = Counter("pipelinerl_generator_tokens_total", "Tokens generated")
SKIPPED = Counter(
    "pipelinerl_generator_problems_skipped_total", "Problems skipped: prompt longer than model.maxSeqLen allows"
)
VERSION = Gauge("pipelinerl_generator_policy_version", "Policy version of the engine weights")
INFLIGHT = Gauge("pipelinerl_generator_inflight_groups", "Prompt groups being generated")
UPDATE_PAUSE = Gauge("pipelinerl_generator_weight_update_pause_seconds", "Pause of the last weight update")


class Scraped:
    """What a scrape of /metrics reads from the running generator: its busy time (the rate is its
    busy share, spells still going included), its admission queue, and its newest held-out
    evaluation (generator 0's; no series before the first, rather than an accuracy of 0)."""

    def __init__(self) -> None:
        self.generator: Any = None  # the running Generator

    def collect(self):
        g = self.generator
        if g is None:
            return
        yield CounterMetricFamily(
            "pipelinerl_generator_busy_seconds", "Seconds with a group or an evaluation running", value=g.busy.seconds()
        )
        yield GaugeMetricFamily(
            "pipelinerl_generator_queued_groups",
            "Groups started and not yet consumed by a step (this generator's admission queue)",
            value=g.admission.queued,
        )
        newest = g.evaluator.newest
        if newest is not None:
            for key, doc in (
                ("accuracy", "Held-out accuracy (greedy) of the newest version evaluated"),
                ("reward", "Held-out mean reward of the newest version evaluated"),
                ("version", "The newest version evaluated"),
            ):
                yield GaugeMetricFamily(f"pipelinerl_generator_eval_{key}", doc, value=float(newest[key]))


SCRAPED = Scraped()
REGISTRY.register(SCRAPED)


class BusyClock:
    """Seconds during which at least one piece of work (a group or an evaluation) was running."""

    def __init__(self) -> None:
        self.active, self.total, self.since = 0, 0.0, 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.since = time.monotonic()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += time.monotonic() - self.since

    def seconds(self) -> float:
        return self.total + (time.monotonic() - self.since if self.active else 0.0)
