"""The chart's dashboard and alerts against a real Prometheus scraping a real run: `pipelinerl run`
of a tiny job, every service's /metrics scraped on loopback with the labels the chart's PodMonitor
gives job pods (namespace, pod, pipelinerl_dev_job, pipelinerl_dev_role), the rules file loaded.
Every data-plane dashboard query (template variables substituted) must return series for the run,
every alert rule must evaluate without error, and every series an alert reads must exist.

Not from a run: the job-state panels read kube-state-metrics' view of the PipelineRLJob
(`pipelinerl_job_*`) and the operator's own series (`pipelinerl_operator_*`); no kube-state-metrics
nor API server runs here, so test_k8s_monitoring.py checks them against the chart's KSM config and
the operator's registry instead."""

from __future__ import annotations

import json
import re
import time

import pytest
from jobs import tiny_job  # tests/e2e/jobs.py

from prometheus_server import DASHBOARD, Prometheus, alert_rules, vector_selectors  # tests/prometheus_server.py
from bench.run_process import RunProcess

pytestmark = pytest.mark.slow
JOB, NAMESPACE = "watched", "local"
# Series that come from kube-state-metrics or the operator, not from a job's pods.
ELSEWHERE = re.compile(r"^(pipelinerl_job_|pipelinerl_operator_)")


def scrape_config(services: dict) -> dict:
    """One static target per service, labelled as the PodMonitor labels the job's pods."""
    return {
        "job_name": f"{NAMESPACE}/pipelinerl-jobs",
        "static_configs": [
            {
                "targets": [f"127.0.0.1:{s['http_port']}"],
                "labels": {
                    "namespace": NAMESPACE,
                    "pod": f"{JOB}-{s['role']}-{s['rank']}",
                    "pipelinerl_dev_job": JOB,
                    "pipelinerl_dev_role": s["role"],
                },
            }
            for name, s in services.items()
            if "http_port" in s
        ],
    }


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def substituted(expr: str) -> str:
    """As Grafana sends it with this run chosen in the job and namespace variables."""
    return expr.replace("$namespace", NAMESPACE).replace("$job", JOB).replace("$__rate_interval", "1m")


def test_every_dashboard_query_and_alert_series_has_data_for_a_real_run(tmp_path):
    job = tiny_job(JOB, trainer={"maxSteps": 40}, eval={"interval": 2, "problems": 16}, rl={"maxLag": 2})
    run = RunProcess(tmp_path, job, timeout_s=400)
    prometheus = None
    try:
        run.wait_until(lambda _: (run.dir / "services.json").exists(), "services.json")
        services = run.services()
        assert {s["role"] for s in services.values() if "http_port" in s} == {"generator", "preprocessor", "trainer"}
        prometheus = Prometheus(tmp_path / "prometheus", [scrape_config(services)], interval_s=1.0)
        prometheus.wait_ready()
        # A few steps, an evaluation after the first weights, then a few scrapes of all that.
        run.wait_step(4)
        time.sleep(4)
        at = time.time()
        targets = prometheus.api("targets")["activeTargets"]
        assert len(targets) == 3 and all(t["health"] == "up" for t in targets), targets

        missing = []
        checked = []
        for title, expr in dashboard_queries():
            if any(ELSEWHERE.match(s) for s in vector_selectors(expr)):
                continue
            checked.append(title)
            if not prometheus.query(substituted(expr), at):
                missing.append(f"panel {title!r}: {substituted(expr)}")
        for rule in alert_rules():
            prometheus.query(rule["expr"], at)  # evaluates (an error fails here)
            for selector in vector_selectors(rule["expr"]):
                if not ELSEWHERE.match(selector) and not prometheus.query(f"count({selector})", at):
                    missing.append(f"alert {rule['alert']}: {selector}")
        assert not missing, "no data for:\n" + "\n".join(missing)
        # Every data-plane panel was checked here (the panels not checked read KSM or the operator).
        assert {"Held-out accuracy", "ESS", "KL and entropy", "Lag of trained tokens", "Generator tokens/s"} <= set(
            checked
        )

        # The values are the run's, not zeros: it stepped, generated, evaluated and synced weights.
        def scalar(expr: str) -> float:
            (sample,) = prometheus.query(expr, at)
            return float(sample["value"][1])

        assert scalar(f'max(pipelinerl_trainer_step{{pipelinerl_dev_job="{JOB}"}})') >= 4
        assert scalar("sum(rate(pipelinerl_generator_tokens_total[1m]))") > 0
        assert 0 < scalar("max(rate(pipelinerl_generator_busy_seconds_total[1m]))") <= 1.05
        assert 0 < scalar("max(pipelinerl_trainer_ess)") <= 1
        assert scalar("max(pipelinerl_generator_eval_version)") >= 0
        assert scalar("max(pipelinerl_trainer_generators_in_group)") == 1
        assert scalar('max(pipelinerl_stream_limit_bytes{stream="ROLLOUTS"})') > 0
        assert scalar("sum(pipelinerl_weight_sync_seconds_count)") >= 4
        # Prometheus evaluated every rule on this data without error, and nothing fires for a healthy run.
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"] if r["type"] == "alerting"]
        assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert not prometheus.query('ALERTS{alertstate="firing"}', at)
    except BaseException:
        run.abandon()
        raise
    finally:
        if prometheus is not None:
            prometheus.stop()
    run.stop()
