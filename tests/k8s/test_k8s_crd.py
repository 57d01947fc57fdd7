"""The generated CRD: in sync with the spec models, structurally valid, CEL rules agreeing with pydantic,
printer columns evaluated by kubectl's own JSONPath."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from k8s_schema import admit, all_rules, apply_defaults
from pipelinerl.crd import crd_manifest, crd_yaml
from pipelinerl.spec import JobSpec, SpecError, parse_job

ROOT = Path(__file__).resolve().parents[2]
CRD = crd_manifest()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def job(name: str = "demo", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob",
            "metadata": {"name": name, "namespace": "team-a"}, "spec": spec}


def test_committed_crd_is_generated_from_the_spec() -> None:
    assert (ROOT / "crds" / "pipelinerl.dev_pipelinerljobs.yaml").read_text() == crd_yaml(), \
        "run: pipelinerl crd > crds/pipelinerl.dev_pipelinerljobs.yaml"


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


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("**/*.yaml")), ids=lambda p: p.name)
def test_examples_are_admitted(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    parse_job(manifest)  # pydantic agrees
    _, errors = admit(CRD, manifest)
    assert errors == []


def test_every_cel_rule_compiles_and_is_exercised_below() -> None:
    rules = all_rules(SCHEMA)
    assert len(rules) >= 12
    messages = {m for _, _, m in rules}
    exercised = {case[1] for case in REJECTED} | {case[2] for case in TRANSITIONS if case[2]}
    assert messages - exercised == {"metadata.name must be at most 40 characters"}  # see test_schema_rejects_...


# (spec, CEL message, the field pydantic's error names). Both must reject each case.
REJECTED = [
    ({"mode": "sync", "rl": {"maxLag": 2}}, "rl.maxLag must be 0 or unset in sync mode (sync mode never trains on stale data)", "rl.maxLag"),
    ({"rl": {"loss": "ppo", "importanceWeights": "sequence"}}, "rl.importanceWeights: sequence applies to the reinforce and cispo losses", "rl.importanceWeights"),
    ({"rl": {"attempts": 3}}, "trainer.samplesPerStep must be a multiple of rl.attempts so that every step holds whole prompt groups", "trainer.samplesPerStep"),
    ({"model": {"maxSeqLen": 16}, "generator": {"sampling": {"maxTokens": 16}}}, "generator.sampling.maxTokens must be smaller than model.maxSeqLen", "generator.sampling.maxTokens"),
    ({"model": {"maxSeqLen": 8192}, "trainer": {"microBatchTokens": 4096}}, "trainer.microBatchTokens must be at least model.maxSeqLen (one sample must fit)", "trainer.microBatchTokens"),
    ({"generator": {"replicas": 0}}, "generator.replicas must be at least 1 (use spec.suspend to stop a job)", "generator.replicas"),
    ({"generator": {"env": [{"name": "RANK", "value": "3"}]}}, "env name is reserved (set by PipelineRL itself)", "generator.env"),
    ({"trainer": {"env": [{"name": "PIPELINERL_NATS_URL"}]}}, "env name is reserved (set by PipelineRL itself)", "trainer.env"),
    ({"weightSync": {"backend": "nccl"}, "trainer": {"gpus": 1}},
     "weightSync.backend: nccl needs GPUs on both sides (trainer.gpus and generator.gpus)", "weightSync.backend"),
]
ACCEPTED = [
    {"mode": "sync"},
    {"mode": "sync", "rl": {"maxLag": 0}},
    {"rl": {"attempts": 16}, "trainer": {"samplesPerStep": 256}},
    {"rl": {"loss": "cispo", "importanceWeights": "sequence"}},
    {"model": {"maxSeqLen": 4096}, "generator": {"sampling": {"maxTokens": 4095}}},
    {"generator": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}},
    {"weightSync": {"backend": "nccl"}, "trainer": {"gpus": 1}, "generator": {"gpus": 1}},
    {"trainer": {"gpus": 1}},  # backend auto: gloo, since the generators have no GPU
]


@pytest.mark.parametrize("spec,message,field", REJECTED)
def test_cel_and_pydantic_reject_alike(spec: dict, message: str, field: str) -> None:
    _, errors = admit(CRD, job(**spec))
    assert message in errors
    with pytest.raises(SpecError) as err:
        parse_job(job(**spec))
    assert field in str(err.value)


@pytest.mark.parametrize("spec", ACCEPTED)
def test_cel_and_pydantic_accept_alike(spec: dict) -> None:
    assert admit(CRD, job(**spec))[1] == []
    parse_job(job(**spec))


def test_schema_rejects_out_of_range_and_typos() -> None:
    assert admit(CRD, job(generator={"replicas": 0}))[1]
    assert admit(CRD, job(trainer={"zeroStage": 4}))[1]
    assert admit(CRD, job(trainer={"learningRate": 0}))[1]  # exclusive minimum
    assert admit(CRD, job(rl={"lossy": "x"}))[1]
    assert admit(CRD, job(storage={"size": "lots"}))[1]
    assert admit(CRD, job(name="x" * 41))[1] == ["metadata.name must be at most 40 characters"]


# (change applied to a running job, the CEL message expected or None when allowed)
TRANSITIONS = [
    ({"generator": {"replicas": 8}}, None, None),
    ({"trainer": {"learningRate": 0.001}}, None, None),
    ({"suspend": True}, None, None),
    ({"model": {"path": "/models/other"}}, "model", "model is immutable: create a new job to change it"),
    ({"mode": "sync"}, "mode", "mode is immutable: create a new job to change it"),
    ({"task": {"name": "guess"}}, "task", "task is immutable: create a new job to change it"),
    ({"trainer": {"replicas": 4}}, "trainer.replicas", "trainer.replicas is immutable: create a new job to change it"),
    ({"trainer": {"gpus": 8}}, "trainer.gpus", "trainer.gpus is immutable: create a new job to change it"),
    ({"trainer": {"zeroStage": 3}}, "trainer.zeroStage", "trainer.zeroStage is immutable: create a new job to change it"),
]


@pytest.mark.parametrize("change,field,message", TRANSITIONS)
def test_update_rules(change: dict, field: str | None, message: str | None) -> None:
    old = job()
    new = copy.deepcopy(old)
    for key, value in change.items():
        new["spec"][key] = value
    _, errors = admit(CRD, new, old)
    assert errors == ([message] if message else [])


def test_printer_columns_with_kubectl_jsonpath(tmp_path: Path) -> None:
    cols = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    assert all("[-1:]" not in c["jsonPath"] for c in cols)
    manifest = job()
    manifest["metadata"]["creationTimestamp"] = "2026-11-22T00:00:00Z"
    manifest["status"] = {
        "phase": "Running", "generatorsReady": "3/4",
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
    out = subprocess.run(["kubectl", "patch", "--local", "-f", str(path), "--type", "merge", "-p", "{}",
                          "-o", f"jsonpath={template}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    values = dict(zip((c["name"] for c in cols), out.stdout.split("|")))
    assert values == {"Ready": "True", "Reason": "AllComponentsReady", "Phase": "Running", "Step": "12",
                      "Version": "11", "Generators": "3/4", "Reward": "0.41", "Lag": "1.5", "Age": "2026-11-22T00:00:00Z"}


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
