"""The Helm chart rendered for real (helm-python-sdk, Helm's Go library)."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "pipelinerl"


def render(values: dict) -> list[dict]:
    """The chart's objects for `values` (release "rl" in namespace "team-a"), NOTES.txt left out."""
    out = helm.Chart.load(str(CHART)).render(values, name="rl", namespace="team-a")
    return [
        doc for path, text in out.items() if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc
    ]
