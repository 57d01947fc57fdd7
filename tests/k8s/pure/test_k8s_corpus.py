"""The manifest corpus (`manifest_corpus.yaml`) through every door a manifest comes in by.

Each invalid manifest must be refused, with a message naming the field at fault, by
`pipelinerl validate` (the CLI, `--against` the stored object for updates, `--policy` the
platform's job policy where the case gives one) and by the cluster: the CRD's schema and CEL rules
at the API server, then the operator's validating webhook (its policy from the environment, as
the chart sets it), which says it in the same words as `validate`. Each valid one must be
accepted by all of them. The API server is emulated offline
(`k8s_schema.admit`: structural defaulting, the OpenAPI schema, CEL through cel-python), since no
kube-apiserver runs here. YAML accidents never reach the API server as objects: kubectl's strict
decoding refuses them, and so does `validate`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kopf
import pytest

from k8s_schema import admit, all_rules
from pipelinerl_cli.main import main as cli
from pipelinerl.crd import crd_manifest
from pipelinerl.contracts import OperatorEnv
from pipelinerl.spec import dump_yaml, load_yaml
from pipelinerl_operator.handlers import validate_job
from pipelinerl_operator.config import CHART_DEFAULTS, DEFAULT_STORE_BYTES

# Read as kubectl reads it (and sends it as JSON): `2.0` is 2, a date a string (load_yaml).
CORPUS = load_yaml((Path(__file__).parents[1] / "manifest_corpus.yaml").read_text())
CRD = crd_manifest()
BASE = {
    "apiVersion": "pipelinerl.dev/v1alpha1",
    "kind": "PipelineRLJob",
    "metadata": {"name": "demo", "namespace": "team-a"},
    "spec": {},
}

# Invalid object cases that only the webhook refuses: CEL cannot express them (vLLM's argument
# list, quantities compared, Kubernetes' pod schema inside the free-form podTemplate). Shrink this
# set whenever a CRD rule learns one; the test fails if the CRD starts refusing one of them.
WEBHOOK_ONLY = {
    "payload-over-the-installs-nats",  # the install's NATS (the chart's nats.maxPayloadMb)
    "task-param-misspelt",  # the task's constructor (pipelinerl.tasks.param_problems)
    "task-param-huge",
    "task-param-quoted",
    "task-param-negative",
    "generator-memory-no-room-for-updates",  # the memory plan (pipelinerl.generator_memory)
    "engine-arg-misspelt",
    "engine-arg-wrong-type",
    "engine-arg-bool-type",
    "engine-arg-enum",
    "engine-arg-contradicts-tp",
    "engine-arg-owned-model",
    "engine-arg-owned-seq-len",
    "engine-arg-owned-kv-cache-bytes",
    "engine-arg-eplb",
    # added once jobs could be stored: no ratcheting on 1.29 (pipelinerl/crd.py, the CEL rules)
    "model-path-relative",
    "model-path-parent",
    "model-path-home",
    "model-path-relative-folders",
    "model-builtin-unknown",
    "requests-above-limits",
    "memory-requests-above-limits",
    "gpu-limit-without-gpus",
    "sidecar-gpu-request-without-limit",
    "sidecar-gpu-request-below-limit",
    "pod-template-container-unnamed",
    "pod-template-sidecar-without-image",
    "pod-template-typo",
    "pod-template-containers-mapping",
    "pod-template-reserved-env",
    "pod-template-tolerations-mapping",
    # hostile authors: the pod security rules beyond host namespaces and IDs (pipelinerl_operator/pod_security.py)
    "sidecar-privileged",
    "sidecar-escalation",
    "sidecar-root",
    "sidecar-sys-admin",
    "sidecar-keeps-capabilities",
    "init-container-privileged",
    "service-container-root",
    "service-container-may-be-root",
    "service-container-escalation",
    "service-container-writable-root",
    "proc-mount-unmasked",
    "container-seccomp-unconfined",
    "pod-may-be-root",
    "pod-seccomp-unconfined",
    "pod-selinux-spc",
    "pod-unsafe-sysctl",
    "windows-host-process",
    "apparmor-unconfined",
    "host-path-root",
    "nfs-volume",
    "host-port",
    "projected-service-account-token",
    "operator-service-account",
    "deprecated-service-account",
    "automount-token",
    "ephemeral-container",
    "nats-accounts-by-volume",
    "webhook-cert-by-env-from",
    "another-jobs-credentials-projected",
    # hostile authors: the platform's job policy (its allowlists are the chart's values, which the CRD
    # cannot know; and what CEL could only see by iterating over free-form lists)
    "helm-release-secret-by-volume",
    "helm-release-secret-by-env-from",
    "install-key-by-csi",
    "install-key-as-pull-secret",
    "routes-password-projected",
    "secret-not-listed",
    "secret-listed-in-another-namespace",
    "pull-secret-not-listed",
    "csi-driver-not-listed",
    "nats-store-claim",
    "another-jobs-checkpoints",
    "claim-not-listed",
    "output-claim-not-listed",
    "ephemeral-clone-of-a-claim",
    "control-plane-toleration",
    "node-label-not-in-listed-values",
    "tolerate-every-taint",
    "control-plane-node-selector",
    "node-affinity-by-name",
    "node-affinity-unlisted-label",
    "node-label-value-not-listed",
    "priority-class-not-listed",
    "scheduler-not-listed",
    "storage-class-not-listed",
    "ephemeral-storage-class-not-listed",
    "unlisted-pod-field",
    "huge-ephemeral-volume",
    "huge-empty-dir",
    "huge-run-volume",
    "unbounded-cpu",
    "unbounded-memory-in-a-sidecar",
    "unlisted-resource",
    "image-any-registry",
    "sidecar-image-any-registry",
    "registry-prefix-is-not-a-path",
    "gpus-without-asking-in-a-sidecar",
    "gpus-from-env-from",
    "supplemental-group-root",
    "supplemental-group-disk",
    "container-run-as-group-root",
    "host-users",
    "env-from-reserved-prefix",
    "env-from-without-prefix",
    "env-from-prefix-of-rank",
    "egress-metadata-ip",
    "egress-metadata-ip-port-80",
    "egress-private-network",
    "egress-other-port",
    "egress-range-ends-below-its-start",
    "egress-to-pods",
    "nats-url-to-the-metadata-ip",
    "probe-another-host",
    "pre-stop-another-host",
    "mount-propagation",
    "empty-dir-unbounded",
    "gpu-device-list-mount",
    "gpu-device-list-mount-spelt-otherwise",
    "host-ip",
    "volume-devices",
    "kueue-priority-label",
    "another-gang-label",
    "pod-affinity-other-namespace",
    "grace-period-days",
    "template-name",
    "store-hostage",  # the NATS store's size is the chart's
    "store-hostage-by-update",
    "store-share",
    "store-whole-by-default",
    "store-job-bound",
    "prompts-longer-than-context",  # the task's prompts, tokenized (pipelinerl/prompt_fit.py)
    # quantities as Kubernetes reads them, in a free-form podTemplate
    "cpu-with-spaces",
    "memory-as-json-number",
    "gpus-with-spaces",
    "hugepages-with-spaces",
    "device-plugin-resource-as-number",
    "empty-dir-with-spaces",
    "ephemeral-volume-as-number",
    "ephemeral-volume-by-limit",
    "quantity-unreadable",
    "ephemeral-claim-selected-node",
    "spread-over-control-plane",
    "pod-affinity-topology-key",
    "gpu-runtime-variable-in-a-sidecar",
    "gpu-runtime-prefix-from-env-from",
    "egress-private-as-nat64",
    "egress-private-as-ipv4-mapped",
    "egress-private-as-6to4",
    "egress-teredo",
    "egress-reserved-range",
    "egress-benchmarking-range",
    "egress-this-network",
    "multus-second-network",
    "calico-fixed-address",
    "mesh-opt-out-label",
    "autoscaler-pin-annotation",
    "karpenter-do-not-disrupt",
    "nested-past-any-pod",  # a free-form podTemplate: no schema can bound its depth
    "another-tenants-cached-image",
    "seccomp-localhost-not-vetted",
    "apparmor-localhost-not-vetted",
    "apparmor-annotation-localhost-not-vetted",
    "helm-release-record-config-map",
    "another-jobs-config",
    "install-nats-config-projected",
    "config-map-not-listed",
    "gpus-by-the-thousand",
    "pods-by-the-hundred",
    "volumes-by-the-petabyte",
    "large-job-without-a-queue",
}


def merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = merge(out.get(key), value) if key in out else copy.deepcopy(value)
    return out


def manifests(case: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    new = merge(BASE, {"metadata": case.get("metadata", {})})
    new["spec"] = merge({}, case["spec"]) if "spec" in case else {}
    new.update(case.get("top", {}))
    old = merge(BASE, {"spec": case["old"]}) if "old" in case else None
    return new, old


@pytest.fixture(autouse=True)
def chart_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The webhook's settings as the chart gives them: the default NATS store (validate assumes it)."""
    monkeypatch.setenv(OperatorEnv.NATS_STORE_BYTES, str(DEFAULT_STORE_BYTES))
    monkeypatch.setenv(OperatorEnv.NATS_MAX_PAYLOAD_MB, str(CHART_DEFAULTS["nats"]["maxPayloadMb"]))
    monkeypatch.delenv(OperatorEnv.JOB_POLICY, raising=False)


def run_validate(case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    args = ["validate", str(path)]
    if "policy" in case:
        (tmp_path / "policy.yaml").write_text(dump_yaml(case["policy"]))
        args += ["--policy", str(tmp_path / "policy.yaml")]
    if "text" in case:
        path.write_text(case["text"])
    else:
        new, old = manifests(case)
        path.write_text(dump_yaml(new))
        if old is not None:
            (tmp_path / "old.yaml").write_text(dump_yaml(old))
            args += ["--against", str(tmp_path / "old.yaml")]
    code = cli(args)
    return code, capsys.readouterr().err


def webhook_refusal(
    new: dict[str, Any], old: dict[str, Any] | None, policy: dict[str, Any] | None = None
) -> str | None:
    """The webhook's answer, with `policy` as the chart would give it to the operator."""
    with pytest.MonkeyPatch.context() as env:
        if policy is not None:
            env.setenv(OperatorEnv.JOB_POLICY, json.dumps(policy))
        return _webhook_refusal(new, old)


def _webhook_refusal(new: dict[str, Any], old: dict[str, Any] | None) -> str | None:
    try:
        validate_job(body=new, old=old, operation="UPDATE" if old else "CREATE")
    except kopf.AdmissionError as err:
        return str(err)
    return None


def by_id(cases: list[dict[str, Any]]) -> Any:
    return pytest.mark.parametrize("case", cases, ids=[c["id"] for c in cases])


def test_corpus_is_big_and_unambiguous() -> None:
    ids = [c["id"] for c in CORPUS["invalid"] + CORPUS["valid"]]
    assert len(ids) == len(set(ids))
    assert len(CORPUS["invalid"]) >= 80 and len(CORPUS["valid"]) >= 10


@by_id(CORPUS["invalid"])
def test_invalid_is_refused_everywhere(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_validate(case, tmp_path, capsys)
    assert code == 2 and case["field"] in err, err
    if "text" in case:
        return  # kubectl refuses it before the API server sees an object
    new, old = manifests(case)
    _, crd_errors = admit(CRD, new, old)
    refusal = webhook_refusal(new, old, case.get("policy"))
    assert refusal is not None and case["field"] in refusal, refusal
    # The same words at both doors: every problem validate names, the webhook names alike.
    said = [line.strip() for line in err.splitlines() if line.startswith("  ")]
    assert said and said == [line.strip() for line in refusal.splitlines() if line.startswith("  ")], (err, refusal)
    if case["id"] in WEBHOOK_ONLY:
        assert crd_errors == [], f"the CRD now refuses {case['id']}: drop it from WEBHOOK_ONLY"
    else:
        assert crd_errors, "the CRD admits it"
        leaf = [part for part in case["field"].split(".") if not part.isdigit()][-1]
        assert any(leaf in e for e in crd_errors), crd_errors


@by_id(CORPUS["valid"])
def test_valid_is_accepted_everywhere(case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_validate(case, tmp_path, capsys)
    assert code == 0, err
    new, old = manifests(case)
    assert admit(CRD, new, old)[1] == []
    assert webhook_refusal(new, old, case.get("policy")) is None


def test_crd_alone_refuses_most(capsys: pytest.CaptureFixture[str]) -> None:
    objects = [c for c in CORPUS["invalid"] if "text" not in c]
    refused = [c["id"] for c in objects if admit(CRD, *manifests(c))[1]]
    with capsys.disabled():
        print(
            f"\ncorpus: {len(CORPUS['invalid'])} invalid, {len(CORPUS['valid'])} valid; the CRD alone refuses "
            f"{len(refused)}/{len(objects)} invalid objects, the webhook the other {len(objects) - len(refused)}"
        )
    assert set(c["id"] for c in objects) - set(refused) == WEBHOOK_ONLY


def test_every_cel_rule_refuses_some_manifest() -> None:
    schema = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    said = {e for c in CORPUS["invalid"] if "text" not in c for e in admit(CRD, *manifests(c))[1]}
    assert {message for _, _, message in all_rules(schema)} - said == set()


def test_the_webhook_warns_where_validate_warns() -> None:
    new = merge(BASE, {"spec": {"model": {"maxSeqLen": 16}, "generator": {"sampling": {"maxTokens": 12}}}})
    warnings: list[str] = []
    validate_job(body=new, old=None, operation="CREATE", warnings=warnings)  # admitted
    assert len(warnings) == 1 and warnings[0].startswith("spec.generator.sampling.maxTokens: 12 tokens do not fit")
