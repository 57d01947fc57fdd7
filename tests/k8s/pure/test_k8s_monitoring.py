"""The chart's monitoring parts: the PrometheusRule is the plain rules file, and the series a real
run cannot show (tests/e2e/test_watched_run.py checks the rest against a real Prometheus) are
defined where they come from: the chart's kube-state-metrics config and the operator's registry."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from chart import render
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


def test_the_job_state_series_are_those_the_charts_kube_state_metrics_config_defines():
    ksm = next(
        o
        for o in render({"metrics": {"kubeStateMetrics": {"enabled": True}}})
        if o["metadata"]["name"].endswith("-ksm-config")
    )
    resource = yaml.safe_load(ksm["data"]["pipelinerl.yaml"])["spec"]["resources"][0]
    defined = {f"{resource['metricNamePrefix']}_{m['name']}" for m in resource["metrics"]}
    used = {s for s in queried_series() if s.startswith("pipelinerl_job_")}
    assert used and used <= defined, used - defined
    # ...with the labels the panels filter and group by.
    assert set(resource["labelsFromPath"]) == {"name", "namespace"}


def test_the_operator_series_are_in_the_operators_registry():
    from pipelinerl_operator import metrics

    metrics.reconciling("team-a")  # labelled series exist once a job of the namespace is reconciled
    metrics.record_phase("team-a", "demo", "Running")
    exported = {s.name for family in metrics.REGISTRY.collect() for s in family.samples}
    used = {s for s in queried_series() if s.startswith("pipelinerl_operator_")}
    assert used and used <= exported, used - exported
    metrics.record_phase("team-a", "demo", None)
