"""The pod security rules (pure): the operator's own pods pass; a user's podTemplate may tighten
what the operator sets (the user's value is kept) but never loosen it; each rule names its field.
The manifest corpus runs the same rules through every door (tests/k8s/pure/test_k8s_corpus.py); the
pods of every example and every manifest the doors accept are also checked by the tests' own,
independent reading of the restricted standard (k8s_schema.restricted_violations)."""

from pathlib import Path

import pytest
import yaml

from k8s_schema import restricted_violations
from pipelinerl.spec import load_job, load_yaml, parse_job
from pipelinerl_operator.job_policy import parse_policy
from pipelinerl_operator.pod_security import pod_violations
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.names import service_account_name
from pipelinerl_operator.render import RenderError, render

ROOT = Path(__file__).resolve().parents[3]
CFG = OperatorConfig(auth_key="k")
# The platform values the examples assume (a claim of models, their priority class).
EXAMPLES_CFG = OperatorConfig(
    auth_key="k", policy=parse_policy(yaml.safe_load((ROOT / "examples" / "platform-values.yaml").read_text()))
)


def pods(job, cfg: OperatorConfig = CFG) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in render(job, job.metadata.namespace or "team-a", "uid", cfg)
        if o["kind"] == "StatefulSet"
    }


def violations(pod: dict, job_name: str = "demo") -> list[str]:
    return pod_violations(pod, service_account=service_account_name(job_name, CFG))


CORPUS = load_yaml((Path(__file__).parents[1] / "manifest_corpus.yaml").read_text())  # as kubectl reads it


def example(path: Path):
    job = load_job(path)
    job.metadata.namespace = "team-a"  # where examples/platform-values.yaml lets it run
    return job


ACCEPTED = [
    (example(p), EXAMPLES_CFG)
    for p in sorted((ROOT / "examples").glob("*.yaml"))
    if "kind: PipelineRLJob" in p.read_text()
] + [
    (
        parse_job(
            {
                "metadata": {"name": "demo", "namespace": "team-a", **case.get("metadata", {})},
                "spec": case.get("spec", {}),
            }
        ),
        OperatorConfig(auth_key="k", policy=parse_policy(case.get("policy"))),
    )
    for case in CORPUS["valid"]
    if "text" not in case
]


@pytest.mark.parametrize("job,cfg", ACCEPTED, ids=lambda j: getattr(j, "name", ""))
def test_every_accepted_manifest_renders_pods_that_meet_the_restricted_standard(job, cfg):
    for name, pod in pods(job, cfg).items():
        assert violations(pod, job.name) == [], name
        assert restricted_violations(pod["spec"]) == [], name


def job(**role):
    return parse_job({"metadata": {"name": "demo"}, "spec": {"generator": role}})


def test_a_user_may_tighten_and_the_users_value_is_kept():
    pod = pods(
        job(
            podTemplate={
                "spec": {
                    "securityContext": {"runAsUser": 20000},
                    "containers": [{"name": "generator", "securityContext": {"runAsUser": 20001}}],
                }
            }
        )
    )["demo-prl-generator"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 20000
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["runAsUser"] == 20001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False  # the operator's, still there


def test_a_user_can_never_loosen_and_every_problem_is_named():
    template = {
        "spec": {
            "hostNetwork": True,
            "securityContext": {"runAsNonRoot": False},
            "containers": [
                {"name": "generator", "securityContext": {"readOnlyRootFilesystem": False}},
                {
                    "name": "miner",
                    "image": "ghcr.io/pipelinerl/miner:1",
                    "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                },
            ],
            "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
        }
    }
    with pytest.raises(RenderError) as err:
        render(job(podTemplate=template), "team-a", "uid", CFG)
    assert err.value.problems == [
        "generator.podTemplate.spec.hostNetwork: host namespaces are not allowed",
        "generator.podTemplate.spec.securityContext.runAsNonRoot: must not be false",
        "generator.podTemplate.spec.volumes[root].hostPath: hostPath volumes are not allowed "
        "(restricted: configMap, csi, downwardAPI, emptyDir, ephemeral, persistentVolumeClaim, projected, secret)",
        "generator.podTemplate.spec.containers[generator].securityContext.readOnlyRootFilesystem: must be true "
        "(write to a volume)",
        "generator.podTemplate.spec.containers[generator].securityContext.runAsNonRoot: "
        "must be true (on the pod or the container)",
        "generator.podTemplate.spec.containers[miner].securityContext.privileged: "
        "privileged containers are not allowed",
        "generator.podTemplate.spec.containers[miner].securityContext.runAsNonRoot: "
        "must be true (on the pod or the container)",
        "generator.podTemplate.spec.containers[miner].securityContext.capabilities.add: "
        "SYS_ADMIN may not be added (only NET_BIND_SERVICE)",
    ]


def test_ids_below_1000_are_refused_wherever_they_are_set():
    """Root's group and the system's (0, `disk` 6, ...) may not replace the operator's 10001, by any
    of the fields that set one: the user's value is kept where set, so it is checked as merged."""
    template = {
        "spec": {
            "securityContext": {"runAsGroup": 0, "fsGroup": 0, "supplementalGroups": [20000, 6]},
            "containers": [{"name": "generator", "securityContext": {"runAsGroup": 5, "runAsUser": 999}}],
        }
    }
    with pytest.raises(RenderError) as err:
        render(job(podTemplate=template), "team-a", "uid", CFG)
    why = "below 1000: root's or a system ID, not allowed"
    assert err.value.problems == [
        f"generator.podTemplate.spec.securityContext.{f}: {why}"
        for f in ("runAsGroup", "fsGroup", "supplementalGroups")
    ] + [
        f"generator.podTemplate.spec.containers[generator].securityContext.{f}: {why}"
        for f in ("runAsUser", "runAsGroup")
    ]
    ok = {"spec": {"securityContext": {"runAsGroup": 20000, "fsGroup": 20000, "supplementalGroups": [20001]}}}
    pod = pods(job(podTemplate=ok))["demo-prl-generator"]
    assert pod["spec"]["securityContext"]["fsGroup"] == 20000  # tightened: the user's value kept
