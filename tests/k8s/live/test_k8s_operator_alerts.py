"""The operator's alerts against a real Prometheus scraping the real operator (kopf against kmock's
emulator; no kube-apiserver runs here), through the chart's ServiceMonitor as the Prometheus
Operator would render it (the target's namespace; the job's as `exported_namespace`, moved back
to `namespace` on the jobs' state series by the chart's metricRelabelings): reconcile errors
while the API server fails the operator's requests, the operator absent once it stops, and a
job not ready, crash-looping, then failed. Each rule's whole expression, its window scaled to
seconds (promtool holds the thresholds: tests/monitoring), returns series under its fault and
none before it."""

from __future__ import annotations

import asyncio
import time

import pytest

from chart import operator_metric_relabelling
from operator_harness import NS, eventually, running_operator
from prometheus_server import Prometheus, held, rule_expr  # tests/prometheus_server.py
from job_views import STS, all_ready, condition, manifest, obj, status

from pipelinerl.contracts import ROLES

from pipelinerl.contracts import OperatorEnv
from pipelinerl.ports import free_port

SETTLE_S = 3  # a few 1-second scrapes


@pytest.fixture
def prometheus(cluster, tmp_path, monkeypatch):
    """A Prometheus scraping the operator (on a port of its own) as the chart's ServiceMonitor has
    it scraped: the operator pod's labels on the target, the chart's metricRelabelings on its
    series; the job `demo`'s trainer reporting step 1."""
    _, _, trainer = cluster
    trainer.reports["demo"] = {"step": 1, "version": 1, "finished": False, "weightSyncReady": True}
    port = free_port()
    monkeypatch.setenv(OperatorEnv.METRICS_PORT, str(port))
    labels = {"namespace": "pipelinerl", "pod": "rl-pipelinerl-operator-0"}  # the operator pod's
    target = {"targets": [f"127.0.0.1:{port}"], "labels": labels}
    relabel = operator_metric_relabelling()
    scrape = {"job_name": "rl-pipelinerl", "static_configs": [target], "metric_relabel_configs": relabel}
    server = Prometheus(tmp_path / "prometheus", [scrape])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def test_reconcile_errors_and_a_missing_operator_fire_their_alerts(cluster, prometheus) -> None:
    emulator, api, _ = cluster
    errors = rule_expr("PipelineRLOperatorReconcileErrors")
    assert errors.count("[10m]") == 1
    errors = errors.replace("[10m]", "[20s]")
    absent = rule_expr("PipelineRLOperatorAbsent")
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: all(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES), what="StatefulSets")
        await all_ready(api)
        scraped = "pipelinerl_operator_reconcile_duration_seconds_count"
        await eventually(lambda: prometheus.query(scraped), what="the operator scraped")
        healthy_from = time.time()
        await asyncio.sleep(SETTLE_S)
        healthy = (healthy_from, time.time())
        emulator.failing.add("pods")  # the API server fails the operator's reads of the job's pods
        failing_from = time.time()
        await asyncio.sleep(SETTLE_S + 2)
        failing = (failing_from, time.time())
        emulator.failing.clear()
    stopped_at = time.time()
    await asyncio.sleep(SETTLE_S)
    gone = (stopped_at, time.time())

    fired = held(prometheus, errors, *failing)
    assert [(s["metric"]["job"], s["metric"]["namespace"]) for s in fired] == [("rl-pipelinerl", "pipelinerl")]
    assert not held(prometheus, errors, *healthy)
    assert held(prometheus, absent, *gone)  # absent() of the operator's series: one, unlabelled
    assert not held(prometheus, absent, *healthy) and not held(prometheus, absent, *failing)


async def test_a_job_not_ready_crash_looping_then_failed_fires_its_alerts(cluster, prometheus) -> None:
    emulator, api, _ = cluster
    scaled = {
        "PipelineRLJobNotReady": rule_expr("PipelineRLJobNotReady"),
        "PipelineRLJobFailed": rule_expr("PipelineRLJobFailed"),
    }
    crash = rule_expr("PipelineRLJobCrashLooping")
    assert crash.count("[1h]") == 1
    scaled["PipelineRLJobCrashLooping"] = crash.replace("[1h]", "[2m]")  # the test's whole life
    phase = f'pipelinerl_job_phase{{namespace="{NS}", name="demo"}}'
    failures = f'pipelinerl_job_failures{{namespace="{NS}", name="demo"}}'
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())  # backoffLimit 2
        # Not ready: its StatefulSets have no ready pods yet.
        await eventually(lambda: prometheus.query(phase), what="the job's state scraped")
        not_ready_from = time.time()
        await asyncio.sleep(SETTLE_S)
        not_ready = (not_ready_from, time.time())
        await all_ready(api)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
        await asyncio.sleep(SETTLE_S)
        healthy_from = time.time()
        await asyncio.sleep(SETTLE_S)
        healthy = (healthy_from, time.time())
        # A trainer crash-looping before its first step: every restart a failure, the third past
        # backoffLimit 2.
        labels = {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer"}
        await api.create_pod("demo-prl-trainer-0", labels, restarts=0)
        await eventually(lambda: "demo-prl-trainer-0" in (status(emulator).get("podRestarts") or {}), what="seen")
        looping_from = time.time()
        for restarts in (1, 2, 3):
            await api.patch_pod_restarts("demo-prl-trainer-0", restarts)
            await eventually(lambda: status(emulator).get("failures") == restarts, what=f"failure {restarts}")
            # Scraped before the next: each failure one change (a fixed 1.5 s wait missed one
            # once, Prometheus scraping late on a loaded machine).
            await eventually(lambda: prometheus.query(f"{failures} == {restarts}"), what=f"failure {restarts} scraped")
        await eventually(lambda: status(emulator).get("phase") == "Failed", what="Failed")
        # Scraped before the window closes (a loaded machine's Prometheus scraped it too late once).
        await eventually(lambda: prometheus.query(scaled["PipelineRLJobFailed"]), what="Failed scraped")
        await asyncio.sleep(SETTLE_S)
        failed = (looping_from, time.time())
        windows = {
            "PipelineRLJobNotReady": not_ready,
            "PipelineRLJobCrashLooping": failed,
            "PipelineRLJobFailed": failed,
        }
        problems = []
        for alert, expr in scaled.items():
            fired = held(prometheus, expr, *windows[alert])
            if [(s["metric"].get("namespace"), s["metric"].get("name")) for s in fired] != [(NS, "demo")]:
                problems.append(f"{alert}: not (only) this job's series under its fault: {fired}")
            if held(prometheus, expr, *healthy):
                problems.append(f"{alert}: holds while the job is ready and running")
        assert not problems, "\n".join(problems)
        # Failed is terminal: no longer a job that is not ready.
        assert not prometheus.query(scaled["PipelineRLJobNotReady"])
