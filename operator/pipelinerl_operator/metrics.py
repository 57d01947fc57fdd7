"""Operator Prometheus metrics: jobs by phase, reconcile errors and durations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pipelinerl.crd import PHASES

REGISTRY = CollectorRegistry()
JOBS = Gauge("pipelinerl_operator_jobs", "PipelineRLJobs by phase", ["namespace", "phase"], registry=REGISTRY)
RECONCILE_ERRORS = Counter(
    "pipelinerl_operator_reconcile_errors_total", "Failed reconciliations", ["namespace"], registry=REGISTRY
)
RECONCILE_SECONDS = Histogram(
    "pipelinerl_operator_reconcile_duration_seconds",
    "Reconciliation time",
    registry=REGISTRY,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
JOB_STEP = Gauge("pipelinerl_job_step", "Trainer step of a job", ["namespace", "job"], registry=REGISTRY)

_phases: dict[tuple[str, str], str] = {}


def reconciling(namespace: str) -> None:
    """A job of `namespace` is being reconciled: its error counter exists from now on, at 0, so
    that the first error is an increase (a series born at 1 shows none to `increase()`)."""
    RECONCILE_ERRORS.labels(namespace)


def record_phase(namespace: str, job: str, phase: str | None) -> None:
    """Track one job's phase (None: the job is gone) and refresh the per-phase gauges."""
    if phase is None:
        _phases.pop((namespace, job), None)
        try:
            JOB_STEP.remove(namespace, job)
        except KeyError:
            pass
    else:
        _phases[(namespace, job)] = phase
    namespaces = {ns for ns, _ in _phases} | {namespace}
    for ns in namespaces:
        for p in PHASES:
            JOBS.labels(ns, p).set(sum(1 for (n, _), ph in _phases.items() if n == ns and ph == p))


def serve(port: int) -> None:
    start_http_server(port, registry=REGISTRY)
