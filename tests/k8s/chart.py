"""The Helm chart rendered for real (helm-python-sdk, Helm's Go library)."""

from __future__ import annotations

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


def operator_metric_relabelling() -> list[dict]:
    """The chart's ServiceMonitor's metricRelabelings for the operator, as a plain Prometheus's
    `metric_relabel_configs` spells them."""
    objects = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{snake.get(k, k): v for k, v in r.items()} for r in monitor["spec"]["endpoints"][0]["metricRelabelings"]]
