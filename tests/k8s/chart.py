"""The Helm chart rendered for real (helm-python-sdk, Helm's Go library)."""

from __future__ import annotations

import functools
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "pipelinerl"


def render(values: dict, name: str = "rl", namespace: str = "team-a") -> list[dict]:
    """The chart's objects for `values` (release `name` in `namespace`), NOTES.txt left out."""
    out = helm.Chart.load(str(CHART)).render(values, name=name, namespace=namespace)
    return [
        doc for path, text in out.items() if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc
    ]


def static_crds() -> list[dict]:
    """The CRDs of the chart's crds/ folder: Helm installs them before it resolves any template's
    kind (and never upgrades them)."""
    return [doc for crd in helm.Chart.load(str(CHART)).crds for doc in yaml.safe_load_all(crd["data"]) if doc]


def operator_metric_relabelling() -> list[dict]:
    """The chart's ServiceMonitor's metricRelabelings for the operator, as a plain Prometheus's
    `metric_relabel_configs` spells them."""
    objects = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{snake.get(k, k): v for k, v in r.items()} for r in monitor["spec"]["endpoints"][0]["metricRelabelings"]]


@functools.cache
def operator_rules() -> tuple[dict, ...]:
    """Every RBAC rule the chart grants the operator, in either install (one namespace, or
    cluster-wide), with the rules of two replicas (kopf peering)."""
    rules = []
    for values in ({"operator": {"replicas": 2}}, {"operator": {"replicas": 2}, "clusterWide": True}):
        for obj in render(values):
            if obj["kind"] in ("Role", "ClusterRole") and obj["metadata"]["name"].startswith("rl-pipelinerl-operator"):
                rules += obj["rules"]
    return tuple(rules)


def not_granted(calls: set[tuple[str, str, str, str | None]]) -> list[tuple[str, str, str, str | None]]:
    """The calls (API group, resource, verb, name) no rule of the chart grants the operator."""

    def granted(group: str, resource: str, verb: str, name: str | None) -> bool:
        return any(
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and (not rule.get("resourceNames") or name in rule["resourceNames"])
            for rule in operator_rules()
        )

    return sorted(call for call in calls if not granted(*call))
