"""The chart's monitoring parts: the PrometheusRule is the plain rules file, and the series a real
run cannot show (tests/e2e/test_watched_run.py checks the rest against a real Prometheus) are
defined where they come from: the operator's registry (the jobs' state and its own)."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from chart import operator_metric_relabelling, render
from prometheus_server import DASHBOARD, RULES, alert_rules, vector_selectors


def test_the_prometheus_rule_is_the_rules_file_and_off_by_default():
    assert not [o for o in render({}) if o["kind"] == "PrometheusRule"]
    objects = render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}})
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())  # the alert templates ({{ $labels }}) left to Prometheus


def test_the_rule_labels_must_be_label_shaped():
    with pytest.raises(Exception, match="invalid propertyName 'bad key!'"):
        render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"bad key!": "x"}}}})
    with pytest.raises(Exception, match="prometheusRule"):
        render({"metrics": {"prometheusRule": {"enabled": "yes"}}})


def queried_series() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    exprs += [r["expr"] for r in alert_rules()]
    return {re.match(r"[\w:]+", s).group(0) for e in exprs for s in vector_selectors(e)}


def test_the_job_state_and_operator_series_are_in_the_operators_registry():
    from pipelinerl_operator import metrics

    metrics.reconciling("team-a")  # labelled series exist once a job of the namespace is reconciled
    status = {
        "phase": "Running",
        "conditions": [{"type": t, "status": "False", "reason": "Waiting"} for t in ("Ready", "Degraded")],
        "progress": {"step": 3, "version": 3, "reward": 0.5, "lagMean": 0.4, "tokensPerSecond": 900.0},
        "roles": {"generator": {"ready": 1}},
        "failures": 0,
    }
    metrics.JOBS.record("team-a", "demo", status)
    try:
        samples = [s for family in metrics.REGISTRY.collect() for s in family.samples]
    finally:
        metrics.JOBS.record("team-a", "demo", None)
    exported = {s.name for s in samples}
    used = {s for s in queried_series() if s.startswith(("pipelinerl_operator_", "pipelinerl_job_"))}
    assert used and used <= exported, used - exported
    # ...with the labels the panels filter and group by (the chart's ServiceMonitor keeps the
    # job's namespace in `namespace`: test_k8s_operator_alerts.py scrapes through it).
    assert all({"namespace", "name"} <= set(s.labels) for s in samples if s.name.startswith("pipelinerl_job_"))


def test_a_jobs_series_say_what_its_status_says_and_lapse_when_no_pass_renews_them():
    from pipelinerl_operator.metrics import JobStates, job_samples

    status = {
        "phase": "Failed",
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"},
            {"type": "Ready", "status": "False", "reason": "Failed"},
            {"type": "WeightSyncReady", "status": "Unknown", "reason": "NoReport"},
        ],
        "progress": {"step": 7},
        "failures": 3,
    }
    samples = {(name, tuple(sorted(labels.items()))): v for name, labels, v in job_samples(status)}
    assert [k[1] for k, v in samples.items() if k[0] == "pipelinerl_job_phase" and v == 1] == [(("phase", "Failed"),)]
    assert sum(k[0] == "pipelinerl_job_phase" for k in samples) == 5  # a StateSet: every phase, one at 1
    assert samples["pipelinerl_job_condition", (("reason", "BackoffLimitExceeded"), ("type", "Failed"))] == 1
    assert samples["pipelinerl_job_condition", (("reason", "Failed"), ("type", "Ready"))] == 0
    assert not any(dict(k[1]).get("type") == "WeightSyncReady" for k in samples)  # Unknown: no sample
    assert samples["pipelinerl_job_progress_step", ()] == 7 and samples["pipelinerl_job_failures", ()] == 3
    assert ("pipelinerl_job_progress_reward", ()) not in samples  # not in the status: no sample

    jobs = JobStates()
    jobs.stale_after_s = 45
    jobs.record("team-a", "demo", status, now=100.0)
    jobs.record("team-b", "other", {"phase": "Running"}, now=130.0)
    assert set(jobs.fresh(now=145.0)) == {("team-a", "demo"), ("team-b", "other")}
    assert set(jobs.fresh(now=146.0)) == {("team-b", "other")}  # three resyncs without a pass
    jobs.record("team-b", "other", None)
    assert not jobs.fresh(now=146.0)


def test_the_docs_plain_prometheus_relabelling_is_the_service_monitors():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md").read_text()
    block = docs[docs.index("```yaml\nmetric_relabel_configs:") + len("```yaml\n") :]
    documented = yaml.safe_load(block[: block.index("```")])["metric_relabel_configs"]
    # the chart's (action replace is Prometheus' default)
    assert documented == [{k: v for k, v in r.items() if k != "action"} for r in operator_metric_relabelling()]


def test_the_nats_volume_series_are_the_volume_stats_sidecars_and_it_is_scraped(tmp_path):
    from pipelinerl_operator.volume_stats import VolumeCollector, volume_bytes

    used = {s for s in queried_series() if s.startswith("pipelinerl_nats_volume_")}
    families = list(VolumeCollector(tmp_path).collect())
    assert used and used <= {f.name for f in families}
    # statvfs of the mount, as the kubelet reads it: what an unprivileged writer may still use
    st = os.statvfs(tmp_path)
    assert volume_bytes(tmp_path) == (st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)
    assert 0 < volume_bytes(tmp_path)[1] <= volume_bytes(tmp_path)[0]

    objects = render({"metrics": {"serviceMonitor": {"enabled": True}}, "nats": {"volumeStatsPort": 7788}})
    (nats,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-pipelinerl-nats"]
    pod = nats["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    sidecar, server = containers["volume-stats"], containers["nats"]
    (operator,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "rl-pipelinerl-operator"
    ]
    assert sidecar["image"] == operator["spec"]["template"]["spec"]["containers"][0]["image"]
    assert sidecar["command"] == ["python", "-m", "pipelinerl_operator.volume_stats"]
    assert sidecar["args"] == ["--path", "/data", "--port", "7788"]
    data = next(m for m in server["volumeMounts"] if m["name"] == "data")
    assert sidecar["volumeMounts"] == [{"name": "data", "mountPath": data["mountPath"], "readOnly": True}]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] and sidecar["resources"]["limits"]
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "rl-pipelinerl-nats"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert sidecar["ports"] == [{"name": endpoint["port"], "containerPort": 7788, "protocol": "TCP"}]
    # No NATS of the chart's: nothing to scrape.
    objects = render(
        {
            "metrics": {"serviceMonitor": {"enabled": True}},
            "nats": {"enabled": False, "externalUrl": "nats://nats.example:4222"},
            "acknowledgeInsecure": True,
        }
    )
    assert not [o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"] == "rl-pipelinerl-nats"]
