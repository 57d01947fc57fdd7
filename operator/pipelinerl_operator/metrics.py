"""Operator Prometheus metrics: reconcile errors and durations, and every job's state as the
operator's last pass wrote it into the job's status (`pipelinerl_job_*`, labelled `namespace`
and `name`): its phase, conditions, progress and pod failures, which the dashboard's job panels
and the job-status alerts read. The operator exports them itself, so that no kube-state-metrics
custom-resource config is needed, and a job whose pods die before any scrape is still seen.

A job's series stand as long as the operator keeps passing over it (the resync timer, every
RESYNC_SECONDS): a standby replica, or one whose passes fail, lets them lapse after
`stale_after_s`, so that two replicas never both speak for a job with different values (a
missing operator has its own alert). The chart's ServiceMonitor gives `pipelinerl_job_*` the
job's namespace as `namespace` (the operator's own series keep the job's as `exported_namespace`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipelinerl.crd import PHASES

REGISTRY = CollectorRegistry()
RECONCILE_ERRORS = Counter(
    "pipelinerl_operator_reconcile_errors_total", "Failed reconciliations", ["namespace"], registry=REGISTRY
)
RECONCILE_SECONDS = Histogram(
    "pipelinerl_operator_reconcile_duration_seconds",
    "Reconciliation time",
    registry=REGISTRY,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# name: help, and the path of a number in the status (the phase and conditions are sets of labels)
PROGRESS = {
    "pipelinerl_job_progress_step": ("Trainer step", ("progress", "step")),
    "pipelinerl_job_progress_version": ("Policy version", ("progress", "version")),
    "pipelinerl_job_progress_reward": (
        "Mean reward of the samples the last step took, trained or filtered",
        ("progress", "reward"),
    ),
    "pipelinerl_job_progress_lag_mean": ("Mean policy lag of trained tokens", ("progress", "lagMean")),
    "pipelinerl_job_progress_tokens_per_second": ("Trainer tokens per second", ("progress", "tokensPerSecond")),
    "pipelinerl_job_generators_ready": ("Ready generator replicas", ("roles", "generator", "ready")),
    "pipelinerl_job_failures": ("Pod failures the operator counted (runPolicy.backoffLimit)", ("failures",)),
}
HELP = {
    "pipelinerl_job_phase": "Job phase (1 for the current one)",
    "pipelinerl_job_condition": "Job conditions by type and reason (1 when True, 0 when False)",
} | {name: text for name, (text, _) in PROGRESS.items()}


def _number(status: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = status
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def job_samples(status: Mapping[str, Any]) -> list[tuple[str, dict[str, str], float]]:
    """A job's series from its status (pure): (name, labels beyond namespace and name, value).
    A condition of status Unknown, and a number the status does not hold, have no sample."""
    out: list[tuple[str, dict[str, str], float]] = [
        ("pipelinerl_job_phase", {"phase": p}, float(status.get("phase") == p)) for p in PHASES
    ]
    for c in status.get("conditions") or []:
        if c.get("status") in ("True", "False"):
            labels = {"type": c["type"], "reason": c.get("reason") or ""}
            out.append(("pipelinerl_job_condition", labels, float(c["status"] == "True")))
    for name, (_, path) in PROGRESS.items():
        value = _number(status, path)
        if value is not None:
            out.append((name, {}, value))
    return out


class JobStates(Collector):
    """The jobs' statuses as last recorded, exported at scrape time while fresh."""

    def __init__(self) -> None:
        self.stale_after_s = 45.0  # set by the operator from its resync interval
        self._jobs: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()  # the handlers record, the HTTP server's thread collects

    def record(self, namespace: str, name: str, status: dict[str, Any] | None, now: float | None = None) -> None:
        """The job's status as the operator just wrote it; None: the job is gone."""
        with self._lock:
            if status is None:
                self._jobs.pop((namespace, name), None)
            else:
                self._jobs[(namespace, name)] = (time.monotonic() if now is None else now, status)

    def clear(self) -> None:
        with self._lock:
            self._jobs.clear()

    def fresh(self, now: float | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return {key: s for key, (at, s) in self._jobs.items() if now - at <= self.stale_after_s}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fresh = self.fresh()
        families = {name: GaugeMetricFamily(name, text, labels=None) for name, text in HELP.items()}
        for (namespace, name), status in sorted(fresh.items()):
            for metric, labels, value in job_samples(status):
                families[metric].add_sample(metric, {"namespace": namespace, "name": name, **labels}, value)
        jobs = GaugeMetricFamily("pipelinerl_operator_jobs", "PipelineRLJobs by phase", labels=["namespace", "phase"])
        counts = collections.Counter((ns, s.get("phase")) for (ns, _), s in fresh.items())
        for namespace in sorted({ns for ns, _ in fresh}):
            for p in PHASES:
                jobs.add_metric([namespace, p], counts[namespace, p])
        yield from families.values()
        yield jobs


JOBS = JobStates()
REGISTRY.register(JOBS)


def reconciling(namespace: str) -> None:
    """A job of `namespace` is being reconciled: its error counter exists from now on, at 0, so
    that the first error is an increase (a series born at 1 shows none to `increase()`)."""
    RECONCILE_ERRORS.labels(namespace)


_server: list = []  # the HTTP server serving /metrics, while the operator runs


def serve(port: int) -> None:
    server, _thread = start_http_server(port, registry=REGISTRY)
    _server.append(server)


def stop_serving() -> None:
    """The operator stops: so does its /metrics (what a scraper sees of an operator gone), and
    its view of the jobs."""
    JOBS.clear()
    while _server:
        server = _server.pop()
        server.shutdown()
        server.server_close()
