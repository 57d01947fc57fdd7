"""The generated CRD: in sync with the spec models, structurally valid, defaults as pydantic's,
printer columns evaluated by kubectl's own JSONPath. What it refuses: test_k8s_corpus.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from k8s_schema import program, admit, all_rules, apply_defaults, undeclared_fields
from pipelinerl.crd import crd_manifest, crd_yaml
from pipelinerl.spec import JobSpec, parse_job

ROOT = Path(__file__).resolve().parents[3]
CRD = crd_manifest()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def job(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": spec,
    }


def test_committed_crd_is_generated_from_the_spec() -> None:
    assert (ROOT / "crds" / "pipelinerl.dev_pipelinerljobs.yaml").read_text() == crd_yaml(), (
        "run: pipelinerl crd > crds/pipelinerl.dev_pipelinerljobs.yaml"
    )


def test_crd_validates_and_is_structural() -> None:
    kubernetes_validate.validate(CRD, "1.33", strict=True)

    def walk(node: dict[str, Any], path: str) -> None:
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        assert node.get("additionalProperties") is not False, path
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(SCHEMA, "")
    version = CRD["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert "prl" in CRD["spec"]["names"]["shortNames"]


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_empty(v) for k, v in value.items() if v not in ({}, [])}
    return value


def test_schema_defaults_equal_pydantic_defaults() -> None:
    stored = apply_defaults(SCHEMA, job())
    # Empty maps/lists (pydantic default factories) are no API-server default: compare the rest.
    pydantic = JobSpec().model_dump(mode="json", by_alias=True, exclude_none=True)
    assert _drop_empty(_drop_empty(stored["spec"])) == _drop_empty(_drop_empty(pydantic))


@pytest.mark.parametrize(
    "path",
    [p for p in sorted((ROOT / "examples").glob("**/*.yaml")) if "kind: PipelineRLJob" in p.read_text()],
    ids=lambda p: p.name,
)
def test_examples_are_admitted(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    parse_job(manifest)  # pydantic agrees
    _, errors = admit(CRD, manifest)
    assert errors == []


def test_every_cel_rule_compiles() -> None:
    # (test_k8s_corpus.py checks that each one refuses a manifest of the corpus)
    rules = all_rules(SCHEMA)
    assert len(rules) >= 20
    for _, rule, _ in rules:
        program(rule)


def test_every_field_a_cel_rule_reads_is_declared_in_the_schema() -> None:
    """The API server types each rule by the schema as the CRD is written, and refuses the CRD
    where a rule reads a field the schema does not declare (a free-form object's, kept with
    x-kubernetes-preserve-unknown-fields, has none): before, the podTemplate and egress rules read
    such fields, and the CRD could not be installed."""

    def walk(node: dict[str, Any], path: str) -> list[str]:
        found = [
            f"{path or '<root>'}: {field} in {r['rule'][:80]!r}"
            for r in node.get("x-kubernetes-validations", [])
            for field in undeclared_fields(node, r["rule"], root=node is SCHEMA)
        ]
        for key, sub in node.get("properties", {}).items():
            found += walk(sub, f"{path}.{key}" if path else key)
        if "items" in node:
            found += walk(node["items"], f"{path}[]")
        return found

    assert walk(SCHEMA, "") == []
    # The check itself: it finds what a free-form object hides, and follows macros' variables.
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert undeclared_fields(free, "!has(self.spec) || self.spec.x") == ["self.spec", "self.spec"]
    listed = {"type": "array", "items": {"type": "object", "properties": {"to": {"type": "array"}}}}
    assert undeclared_fields(listed, "self.all(r, has(r.to) && has(r.ports))") == ["r.ports"]


def test_printer_columns_with_kubectl_jsonpath(tmp_path: Path) -> None:
    cols = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    assert all("[-1:]" not in c["jsonPath"] for c in cols)
    manifest = job()
    manifest["metadata"]["creationTimestamp"] = "2026-11-22T00:00:00Z"
    manifest["status"] = {
        "phase": "Running",
        "generatorsReady": "3/4",
        "progress": {"step": 12, "version": 11, "reward": 0.41, "lagMean": 1.5},
        "conditions": [  # Ready is deliberately not last
            {"type": "Ready", "status": "True", "reason": "AllComponentsReady"},
            {"type": "Degraded", "status": "True", "reason": "GeneratorsMissing"},
            {"type": "Suspended", "status": "False", "reason": "NotSuspended"},
        ],
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(manifest))
    template = "|".join("{" + c["jsonPath"] + "}" for c in cols)
    out = subprocess.run(
        ["kubectl", "patch", "--local", "-f", str(path), "--type", "merge", "-p", "{}", "-o", f"jsonpath={template}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    values = dict(zip((c["name"] for c in cols), out.stdout.split("|")))
    assert values == {
        "Ready": "True",
        "Reason": "AllComponentsReady",
        "Phase": "Running",
        "Step": "12",
        "Version": "11",
        "Generators": "3/4",
        "Reward": "0.41",
        "Lag": "1.5",
        "Age": "2026-11-22T00:00:00Z",
    }


def test_scale_subresource_points_at_real_fields() -> None:
    scale = CRD["spec"]["versions"][0]["subresources"]["scale"]

    def has(path: str) -> bool:
        node = SCHEMA
        for part in path.strip(".").split("."):
            node = node.get("properties", {}).get(part)
            if node is None:
                return False
        return True

    assert has(scale["specReplicasPath"]) and has(scale["statusReplicasPath"]) and has(scale["labelSelectorPath"])
    assert SCHEMA["properties"]["spec"]["properties"]["generator"]["properties"]["replicas"]["type"] == "integer"
