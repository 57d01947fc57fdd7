"""The pod security rules (pure): the operator's own pods pass; a user's podTemplate may tighten
what the operator sets (the user's value is kept) but never loosen it; each rule names its field.
The manifest corpus runs the same rules through every door (tests/k8s/pure/test_k8s_corpus.py); the
pods of every example and every manifest the doors accept are also checked by the tests' own,
independent reading of the restricted standard (k8s_schema.restricted_violations)."""

from pathlib import Path

import pytest
import yaml

from k8s_schema import restricted_violations
from pipelinerl.spec import load_job, parse_job
from pipelinerl_operator.pod_security import pod_violations
from pipelinerl_operator.render import OperatorConfig, RenderError, render, secret_name, service_account_name

ROOT = Path(__file__).resolve().parents[3]
CFG = OperatorConfig(auth_key="k")


def pods(job) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]
        for o in render(job, "team-a", "uid", CFG)
        if o["kind"] == "StatefulSet"
    }


def violations(pod: dict, job_name: str = "demo") -> list[str]:
    return pod_violations(pod, service_account=service_account_name(job_name, CFG), own_secret=secret_name(job_name))


CORPUS = yaml.safe_load((Path(__file__).parents[1] / "manifest_corpus.yaml").read_text())
ACCEPTED = [load_job(p) for p in sorted((ROOT / "examples").glob("*.yaml"))] + [
    parse_job({"metadata": {"name": "demo", **case.get("metadata", {})}, "spec": case.get("spec", {})})
    for case in CORPUS["valid"]
    if "text" not in case
]


@pytest.mark.parametrize("job", ACCEPTED, ids=lambda j: j.name)
def test_every_accepted_manifest_renders_pods_that_meet_the_restricted_standard(job):
    for name, pod in pods(job).items():
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
    )["demo-generator"]
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
                    "image": "x/miner",
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


def test_secrets_a_pod_may_and_may_not_read():
    pod = yaml.safe_load("""
    spec:
      serviceAccountName: demo-pipelinerl
      automountServiceAccountToken: false
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: c
          securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
          env:
            - {name: MINE, valueFrom: {secretKeyRef: {name: demo-pipelinerl-credentials, key: natsPassword}}}
            - {name: TEAM, valueFrom: {secretKeyRef: {name: hf-token, key: token}}}
            - {name: KEY, valueFrom: {secretKeyRef: {name: prod-pipelinerl-auth, key: key}}}
      volumes:
        - {name: other, secret: {secretName: rival-pipelinerl-credentials}}
    """)
    assert violations(pod) == [
        "podTemplate.spec.volumes[other].secret.secretName: Secret 'rival-pipelinerl-credentials' holds another job's "
        "credentials",
        "podTemplate.spec.containers[c].env[KEY].valueFrom.secretKeyRef.name: Secret 'prod-pipelinerl-auth' is the "
        "PipelineRL install's own",
    ]
