"""Pure rendering: every object validates strictly against Kubernetes' own schemas; wiring is as contracted."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from k8s_schema import restricted_violations

from pipelinerl.contracts import POD_GROUP_API, ROLES
from pipelinerl.spec import MAX_JOB_NAME, SpecError, load_job, parse_job
from pipelinerl_operator.job_policy import parse_policy
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.pod_template import role_config_hash
from pipelinerl_operator.render import render

ROOT = Path(__file__).resolve().parents[3]
# What these cases ask for beyond the default policy (tests/k8s/pure/test_k8s_job_policy.py tests
# the policy itself): the platform lists it.
POLICY = parse_policy(
    {
        "images": ["ghcr.io/pipelinerl", "docker.io/library", "docker.io/me"],
        "nodeLabels": {"pool": ["gpu"]},
        "tolerations": [{"key": "gpu"}, {"key": "nvidia.com/gpu"}],
        "volumeClaims": ["*/models", "*/team-models"],
        "schedulerNames": ["volcano"],
        "priorityClassNames": ["high"],
        "storageClassNames": ["fast"],
        "natsServers": [
            "nats.example:4222",
            "a:4222",
            "b:7422",
            {"server": "c:4222", "cidrs": ["10.8.0.0/16"]},
            {"server": "d:4222", "cidrs": ["10.9.0.5/32", "10.8.0.0/16"]},
        ],
        "maxJobPods": 2048,  # the edge cases: 64 generators, the most replicas a role may have
        "maxJobGpus": 1024,
    }
)
CFG = OperatorConfig(auth_key="install-key", policy=POLICY)
EXAMPLES_CFG = OperatorConfig(
    auth_key="install-key",
    policy=parse_policy(yaml.safe_load((ROOT / "examples" / "platform-values.yaml").read_text())),
)
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("**/*.yaml")) if "kind: PipelineRLJob" in p.read_text()]


def job(**spec):
    if any((spec.get(role) or {}).get("gpus") for role in ("generator", "trainer")):
        spec.setdefault("model", {"path": "/models/qwen"})  # GPU jobs need a real model
    return parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "demo", "labels": {"team": "a"}},
            "spec": spec,
        }
    )


def by_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def env_of(sts):
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }


EDGE_CASES = [
    {},
    {"suspend": True},
    {"generator": {"replicas": 64, "gpus": 8, "tensorParallel": 8, "resources": {"limits": {"memory": "200Gi"}}}},
    {"scheduling": {"schedulerName": "volcano", "queueName": "team-a", "priorityClassName": "high"}},
    {"storage": {"size": "1.5Ti", "storageClassName": "fast"}},
    {
        "trainer": {
            "podTemplate": {
                "metadata": {"annotations": {"a": "b"}},
                "spec": {
                    "nodeSelector": {"pool": "gpu"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                    "containers": [
                        {"name": "trainer", "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
                        {"name": "log-shipper", "image": "busybox"},
                    ],
                },
            }
        }
    },
]


GANG = POD_GROUP_API  # scheduler-plugins' PodGroup: no upstream schema to validate against


@pytest.mark.parametrize("spec", EDGE_CASES)
def test_edge_cases_validate_strictly(spec) -> None:
    for obj in render(job(**spec), "team-a", "uid-1", CFG, active=not spec.get("suspend")):
        if obj["apiVersion"] != GANG:
            kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.mark.parametrize("spec", EDGE_CASES)
def test_every_pod_meets_the_restricted_pod_security_standard(spec) -> None:
    pods = [o["spec"]["template"] for o in render(job(**spec), "team-a", "uid-1", CFG) if o["kind"] == "StatefulSet"]
    assert len(pods) == 3
    for pod in pods:
        assert restricted_violations(pod["spec"]) == []
        for c in pod["spec"]["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert {"/tmp", "/var/cache/pipelinerl", "/var/lib/pipelinerl/run"} <= mounts  # the writable places
    assert restricted_violations({"containers": [{"name": "x"}], "hostNetwork": True}) == [
        "spec.hostNetwork",
        "container x: allowPrivilegeEscalation not false",
        "container x: runAsNonRoot not true",
        "container x: seccompProfile None",
        "container x: capabilities {}",
    ]  # the checker itself checks


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_strictly(path: Path) -> None:
    example = load_job(path)
    example.metadata.namespace = "team-a"  # where examples/platform-values.yaml lets them run
    objects = render(example, "team-a", "uid-1", EXAMPLES_CFG)
    assert len(objects) == 10  # ConfigMap, NetworkPolicy, ServiceAccount, Secret, a Service and a StatefulSet per role
    for version in [f"1.{minor}" for minor in range(28, 38)]:  # every release the chart admits
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)
    for pod in (o["spec"]["template"]["spec"] for o in objects if o["kind"] == "StatefulSet"):
        for c in pod["containers"]:  # every container is bounded: a ResourceQuota admits it
            assert {"cpu", "memory"} <= c["resources"]["limits"].keys() and c["resources"]["requests"], c["name"]


def test_wiring_contract() -> None:
    objs = by_name(render(job(generator={"replicas": 3}, trainer={"replicas": 2}), "team-a", "uid-1", CFG))
    trainer = objs[("StatefulSet", "demo-prl-trainer")]
    env = env_of(trainer)
    assert env["MASTER_ADDR"] == "demo-prl-trainer-0.demo-prl-trainer.team-a.svc" and env["MASTER_PORT"] == "29500"
    assert env["PIPELINERL_WORLD_SIZE"] == "2" and env["PIPELINERL_RANKS_PER_POD"] == "1"
    assert env["PIPELINERL_RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert "RANK" not in env and "LOCAL_RANK" not in env  # each rank process sets its own
    gen = env_of(objs[("StatefulSet", "demo-prl-generator")])
    assert gen["PIPELINERL_WEIGHTS_ADDR"] == "demo-prl-trainer-0.demo-prl-trainer.team-a.svc:29600"
    assert "PIPELINERL_WORLD_SIZE" not in gen and gen["PIPELINERL_HTTP_PORT"] == "8000"  # elastic: no count
    assert "MASTER_ADDR" not in gen and "PIPELINERL_RANKS_PER_POD" not in gen
    container = trainer["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] + container["args"] == ["pipelinerl", "service", "trainer", "/etc/pipelinerl/job.yaml"]
    for role in ("generator", "preprocessor", "trainer"):
        svc = objs[("Service", f"demo-prl-{role}")]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        sts = objs[("StatefulSet", f"demo-prl-{role}")]
        assert sts["spec"]["serviceName"] == f"demo-prl-{role}"
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert sts["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert (
        parse_job(
            __import__("yaml").safe_load(objs[("ConfigMap", "demo-pipelinerl-config")]["data"]["job.yaml"])
        ).spec.generator.replicas
        == 3
    )
    # No output: the checkpoints are the trained model, kept when the job goes (see the retention test).
    assert trainer["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}


def test_multi_gpu_trainer_pods_run_one_rank_per_gpu() -> None:
    objs = by_name(render(job(trainer={"replicas": 2, "gpus": 8}), "team-a", "uid-1", CFG))
    trainer = objs[("StatefulSet", "demo-prl-trainer")]
    env = env_of(trainer)
    assert env["PIPELINERL_WORLD_SIZE"] == "16" and env["PIPELINERL_RANKS_PER_POD"] == "8"
    assert trainer["spec"]["replicas"] == 2
    assert trainer["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_generator_pods_run_one_engine_per_tensor_parallel_gpus() -> None:
    objs = by_name(render(job(generator={"replicas": 2, "gpus": 8, "tensorParallel": 2}), "team-a", "uid-1", CFG))
    env = env_of(objs[("StatefulSet", "demo-prl-generator")])
    assert env["PIPELINERL_RANKS_PER_POD"] == "4"  # four engines per pod: no GPU left idle
    assert job(generator={"replicas": 2, "gpus": 8, "tensorParallel": 2}).spec.generator_engines == 8
    one = env_of(
        by_name(render(job(generator={"gpus": 2, "tensorParallel": 2}), "team-a", "u", CFG))[
            ("StatefulSet", "demo-prl-generator")
        ]
    )
    assert "PIPELINERL_RANKS_PER_POD" not in one


def test_gpus_images_and_scheduling() -> None:
    objs = by_name(
        render(
            job(
                generator={"gpus": 2, "tensorParallel": 2},
                trainer={"image": "me/trainer:1"},
                scheduling={"queueName": "q", "schedulerName": "volcano"},
            ),
            "ns",
            "u",
            CFG,
        )
    )
    gen = objs[("StatefulSet", "demo-prl-generator")]["spec"]["template"]
    c = gen["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["image"] == CFG.gpu_image
    assert (
        objs[("StatefulSet", "demo-prl-preprocessor")]["spec"]["template"]["spec"]["containers"][0]["image"]
        == CFG.cpu_image
    )
    assert (
        objs[("StatefulSet", "demo-prl-trainer")]["spec"]["template"]["spec"]["containers"][0]["image"]
        == "me/trainer:1"
    )
    assert gen["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert gen["spec"]["schedulerName"] == "volcano"
    # The gang is the trainer ranks and the preprocessor; each generator is admitted on its own.
    for role in ("trainer", "preprocessor"):
        meta = objs[("StatefulSet", f"demo-prl-{role}")]["spec"]["template"]["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "q"
        assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "demo-pipelinerl-gang"
        assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
        assert meta["labels"]["scheduling.x-k8s.io/pod-group"] == "demo-pipelinerl-gang"
    assert not {k for k in (*gen["metadata"]["labels"], *gen["metadata"]["annotations"]) if "pod-group" in k}
    # The gang scheduler's PodGroup: the trainer pods and the preprocessor, bound together.
    group = objs[("PodGroup", "demo-pipelinerl-gang")]
    assert group["apiVersion"] == GANG and group["spec"] == {"minMember": 2}  # one trainer pod here
    assert group["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert not [o for o in render(job(), "ns", "u", CFG) if o["kind"] == "PodGroup"]  # no gang scheduler named


def test_a_container_that_asks_for_no_gpu_sees_none_whatever_its_image_says() -> None:
    """CUDA base images set NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA runtime honours by
    default: a container given the GPU image without a GPU request (a role's `image`, a sidecar,
    an init container) would see every GPU of its node. Every container without a GPU limit gets
    NVIDIA_VISIBLE_DEVICES=void; one with a limit gets what the device plugin hands it. A limit
    of 0 hands none, so it gets void too."""
    sidecar = {"name": "probe", "image": CFG.gpu_image}
    none_asked = {"resources": {"limits": {"nvidia.com/gpu": 0}}}
    objs = by_name(
        render(
            job(
                generator={"gpus": 1},
                preprocessor={"image": CFG.gpu_image, "podTemplate": {"spec": {"initContainers": [sidecar]}}},
                trainer={
                    "image": CFG.gpu_image,
                    **none_asked,
                    "podTemplate": {"spec": {"containers": [{**sidecar, **none_asked}]}},
                },
            ),
            "ns",
            "u",
            CFG,
        )
    )

    def devices(role: str) -> dict[str, list[str]]:
        pod = objs[("StatefulSet", f"demo-prl-{role}")]["spec"]["template"]["spec"]
        return {
            c["name"]: [e.get("value") for e in c.get("env", []) if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
            for c in pod.get("initContainers", []) + pod["containers"]
        }

    assert devices("generator") == {"generator": []}
    assert devices("preprocessor") == {"probe": ["void"], "preprocessor": ["void"]}
    assert devices("trainer") == {"trainer": ["void"], "probe": ["void"]}


def test_scaling_generators_in_a_queued_job_changes_no_pod_template() -> None:
    def templates(generators: int) -> dict:
        objs = render(
            job(
                generator={"replicas": generators},
                trainer={"replicas": 2},
                scheduling={"queueName": "q", "schedulerName": "volcano"},
            ),
            "ns",
            "u",
            CFG,
        )
        return {o["metadata"]["name"]: o["spec"]["template"] for o in objs if o["kind"] == "StatefulSet"}

    assert templates(4) == templates(6)


def test_suspend_scales_to_zero_before_anything_else_is_applied() -> None:
    """Children are applied in order, up to the first refused: a stopped job's pods stop first."""
    kinds = [o["kind"] for o in render(job(), "ns", "u", CFG, active=False)]
    assert kinds[: len(ROLES)] == ["StatefulSet"] * len(ROLES) and kinds.count("StatefulSet") == len(ROLES)
    for obj in render(job(), "ns", "u", CFG, active=False):
        if obj["kind"] == "StatefulSet":
            assert obj["spec"]["replicas"] == 0
    assert [o["kind"] for o in render(job(), "ns", "u", CFG)][-1] == "StatefulSet"  # running: after what they read


def test_pod_template_merges_under_ours() -> None:
    spec = EDGE_CASES[-1]
    pod = by_name(render(job(**spec), "ns", "u", CFG))[("StatefulSet", "demo-prl-trainer")]["spec"]["template"]
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["trainer", "log-shipper"]
    mounts = {m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert {"models", "job-config", "dshm", "run"} <= mounts
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"} and pod["metadata"]["annotations"]["a"] == "b"
    assert pod["spec"]["containers"][0]["command"] == ["pipelinerl"]


def test_reserved_env_in_pod_template_rejected() -> None:
    with pytest.raises(SpecError, match="reserved"):
        job(
            generator={
                "podTemplate": {
                    "spec": {"containers": [{"name": "generator", "env": [{"name": "RANK", "value": "9"}]}]}
                }
            }
        )


def test_config_hash_restarts_only_affected_roles() -> None:
    base = job()
    assert role_config_hash(job(generator={"replicas": 5}), "trainer") == role_config_hash(base, "trainer")
    assert role_config_hash(job(generator={"replicas": 5}), "generator") == role_config_hash(base, "generator")
    assert role_config_hash(job(suspend=True), "trainer") == role_config_hash(base, "trainer")
    assert role_config_hash(job(generator={"image": "x"}), "trainer") == role_config_hash(base, "trainer")
    assert role_config_hash(job(generator={"image": "x"}), "generator") != role_config_hash(base, "generator")
    assert role_config_hash(job(trainer={"learningRate": 0.01}), "trainer") != role_config_hash(base, "trainer")


def test_scaling_generators_changes_no_pod_template() -> None:
    """kubectl scale (or a replicas edit) adds or removes generator pods only: no running pod of
    any role is restarted (the weight group takes the new generators in as they say hello)."""
    before = by_name(render(job(generator={"replicas": 2}), "team-a", "uid-1", CFG))
    after = by_name(render(job(generator={"replicas": 6}), "team-a", "uid-1", CFG))
    for role in ("generator", "preprocessor", "trainer"):
        key = ("StatefulSet", f"demo-prl-{role}")
        assert after[key]["spec"]["template"] == before[key]["spec"]["template"], role
    assert after[("StatefulSet", "demo-prl-generator")]["spec"]["replicas"] == 6


def test_the_longest_job_name_leaves_every_child_name_valid() -> None:
    name = "a" * MAX_JOB_NAME
    longest = parse_job({"metadata": {"name": name}, "spec": {"generator": {"replicas": 1024}}})
    for obj in render(longest, "team-a", "u", CFG):
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]  # Services: DNS-1035 labels
        if obj["kind"] == "StatefulSet":
            # Its pods carry controller-revision-hash "<name>-<10-char hash>", a label value (≤ 63).
            assert len(obj["metadata"]["name"]) + 11 <= 63
            assert len(f"{obj['metadata']['name']}-{obj['spec']['replicas'] - 1}") <= 63  # pod names
    with pytest.raises(SpecError, match=f"at most {MAX_JOB_NAME} characters"):
        parse_job({"metadata": {"name": name + "a"}})


def test_the_output_claim_is_mounted_into_trainer_pods_only() -> None:
    objs = by_name(render(job(output={"claimName": "team-models"}), "team-a", "uid-1", CFG))
    trainer = objs[("StatefulSet", "demo-prl-trainer")]["spec"]["template"]["spec"]
    assert {"name": "output", "persistentVolumeClaim": {"claimName": "team-models"}} in trainer["volumes"]
    assert {"name": "output", "mountPath": "/var/lib/pipelinerl/output", "subPath": "demo"} in trainer["containers"][0][
        "volumeMounts"
    ]
    assert env_of(objs[("StatefulSet", "demo-prl-trainer")])["PIPELINERL_OUTPUT_DIR"] == "/var/lib/pipelinerl/output"
    generator = objs[("StatefulSet", "demo-prl-generator")]
    assert "PIPELINERL_OUTPUT_DIR" not in env_of(generator)
    assert all(v["name"] != "output" for v in generator["spec"]["template"]["spec"]["volumes"])
    assert not [o for o in objs.values() if o["kind"] == "PersistentVolumeClaim"]  # the user's, not the job's
    # A subPath is a folder the job's own goes in: naming another job's folder reaches inside it, never its model.
    other = by_name(render(job(output={"claimName": "team-models", "subPath": "other"}), "team-a", "uid-1", CFG))
    mounts = other[("StatefulSet", "demo-prl-trainer")]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "output", "mountPath": "/var/lib/pipelinerl/output", "subPath": "other/demo"} in mounts


# --- tenancy: credentials by reference, a NetworkPolicy per job, nothing shared between namespaces


def test_the_jobs_credentials_reach_its_pods_only_by_reference() -> None:
    import base64
    import json

    from pipelinerl.contracts import JOB_SECRET_KEYS

    objs = by_name(render(job(), "team-a", "uid-1", CFG))
    secret = objs[("Secret", "demo-uid-1-pipelinerl-credentials")]
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert values.keys() == JOB_SECRET_KEYS.keys() and values["natsUser"] == "team-a.demo"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # goes with the job
    for role in ("generator", "preprocessor", "trainer"):
        env = env_of(objs[("StatefulSet", f"demo-prl-{role}")])
        for key, name in JOB_SECRET_KEYS.items():
            assert env[name] == {"secretKeyRef": {"name": "demo-uid-1-pipelinerl-credentials", "key": key}}
    # No secret value anywhere but in the Secret: not in the ConfigMap, env, labels or annotations.
    elsewhere = json.dumps([o for key, o in objs.items() if key[0] != "Secret"])
    assert not [k for k in ("natsPassword", "weightsToken") if values[k] in elsewhere]
    # A job on its own NATS server gets no NATS credentials (the operator does not configure
    # that server), still its weight token; an install without a key: no Secret at all.
    external = by_name(render(job(nats={"url": "nats://nats.example:4222"}), "team-a", "uid-1", CFG))
    env = env_of(external[("StatefulSet", "demo-prl-trainer")])
    assert "PIPELINERL_NATS_PASSWORD" not in env and "PIPELINERL_WEIGHTS_TOKEN" in env
    assert not [o for o in render(job(), "team-a", "uid-1", OperatorConfig()) if o["kind"] == "Secret"]


def test_the_network_policy_admits_only_the_jobs_own_pods_but_to_the_http_port() -> None:
    cfg = OperatorConfig(auth_key="k", metrics_namespaces=("monitoring",), namespace="pipelinerl-system")
    objects = render(job(generator={"replicas": 3}, trainer={"replicas": 2}), "team-a", "uid-1", cfg)
    policy = by_name(objects)[("NetworkPolicy", "demo-pipelinerl")]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for sts in (o for o in objects if o["kind"] == "StatefulSet"):  # it covers every pod of the job
        assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    own, readers = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}  # any port, this namespace only
    assert readers["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert [
        f.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for f in readers["from"]
    ] == ["operator", None]
    assert readers["from"][1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    # The operator's pods in the operator's namespace only (pods labelled as it elsewhere get nothing).
    assert readers["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "pipelinerl-system"}
    }
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_job_pods_may_connect_only_to_their_job_nats_dns_and_what_the_job_lists() -> None:
    hub = {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    cfg = OperatorConfig(namespace="pipelinerl-system", policy=POLICY)
    policy = by_name(render(job(network={"egress": [hub]}), "team-a", "u", cfg))[("NetworkPolicy", "demo-pipelinerl")]
    own, nats, dns, listed = policy["spec"]["egress"]
    assert own == {"to": [{"podSelector": {"matchLabels": {"pipelinerl.dev/job": "demo"}}}]}
    assert nats == {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pipelinerl-system"}},
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "nats"}
                },
            }
        ],
        "ports": [{"port": 4222, "protocol": "TCP"}],
    }
    assert dns == {  # the cluster DNS only: a resolver anywhere would be a way out
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }
    # The author's rule within the platform's (the default: public addresses on 443): its exceptions added.
    assert listed == {
        "to": [
            {
                "ipBlock": {
                    "cidr": "0.0.0.0/0",
                    "except": [
                        "10.0.0.0/8",
                        "172.16.0.0/12",
                        "192.168.0.0/16",
                        "100.64.0.0/10",
                        "169.254.0.0/16",
                        "127.0.0.0/8",
                        "192.0.0.0/24",
                        "198.18.0.0/15",
                        "0.0.0.0/8",
                        "224.0.0.0/4",
                        "240.0.0.0/4",
                    ],
                }
            }
        ],
        "ports": [{"port": 443, "protocol": "TCP"}],
    }

    def nats_rules(url: str) -> list[dict]:
        egress = by_name(render(job(nats={"url": url}), "team-a", "u", cfg))[("NetworkPolicy", "demo-pipelinerl")]
        return egress["spec"]["egress"][1:-1]  # between the rule for its own pods and DNS

    # Its servers' ports, anywhere: the policy lists no address for them.
    assert nats_rules("nats://a:4222,tls://b:7422") == [
        {"ports": [{"port": 4222, "protocol": "TCP"}]},
        {"ports": [{"port": 7422, "protocol": "TCP"}]},
    ]
    # Each at the addresses the policy lists for it, a rule each (one's port is not the other's way in).
    assert nats_rules("nats://c:4222,nats://d:4222,nats://a:4222") == [
        {"ports": [{"port": 4222, "protocol": "TCP"}]},
        {"ports": [{"port": 4222, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "10.8.0.0/16"}}]},
        {
            "ports": [{"port": 4222, "protocol": "TCP"}],
            "to": [{"ipBlock": {"cidr": "10.9.0.5/32"}}, {"ipBlock": {"cidr": "10.8.0.0/16"}}],
        },
    ]
    open_egress = by_name(render(job(), "team-a", "u", OperatorConfig(restrict_egress=False)))
    assert open_egress[("NetworkPolicy", "demo-pipelinerl")]["spec"]["policyTypes"] == ["Ingress"]


def test_two_jobs_of_one_name_in_two_namespaces_share_nothing() -> None:
    from pipelinerl_operator.credentials import nats_accounts

    a = render(job(), "team-a", "uid-a", CFG)
    b = render(job(), "team-b", "uid-b", CFG)
    assert {o["metadata"]["namespace"] for o in a} == {"team-a"} and {o["metadata"]["namespace"] for o in b} == {
        "team-b"
    }
    secret = lambda objs: next(o for o in objs if o["kind"] == "Secret")["data"]  # noqa: E731
    assert not set(secret(a).values()) & set(secret(b).values())  # other NATS users, passwords, weight tokens
    # The pods read their job's namespace from its manifest: they name their streams by it.
    config = lambda objs: parse_job(  # noqa: E731
        yaml.safe_load(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["job.yaml"])
    )  # noqa: E731
    assert (config(a).subjects.namespace, config(b).subjects.namespace) == ("team-a", "team-b")
    # Each is an account of its own on the NATS server (its streams live in it); the same job
    # created again (a new uid) gets new credentials.
    accounts = nats_accounts(
        "install-key", [("team-a", "demo", "uid-a", 1 << 30), ("team-b", "demo", "uid-b", 2 << 30)]
    )
    assert f'"team-a.demo.uid-a": {{ jetstream: {{ max_file: {1 << 30}, max_mem: 0' in accounts
    assert f'"team-b.demo.uid-b": {{ jetstream: {{ max_file: {2 << 30}, max_mem: 0' in accounts
    # Created again (a new uid): new credentials, a Secret of another name, an account of its own
    # (so streams an earlier job left on the volume are not in it).
    again = render(job(), "team-a", "uid-a2", CFG)
    assert secret(again)["natsPassword"] != secret(a)["natsPassword"]
    assert {o["metadata"]["name"] for o in again if o["kind"] == "Secret"} == {"demo-uid-a2-pipelinerl-credentials"}
    assert '"team-a.demo.uid-a2"' in nats_accounts("install-key", [("team-a", "demo", "uid-a2", 1 << 30)])


def test_a_retired_account_is_written_disabled_without_a_user() -> None:
    """(When accounts retire: tests/k8s/pure/test_k8s_nats_books.py.)"""
    from pipelinerl_operator.credentials import nats_accounts

    text = nats_accounts("k", [("team-a", "demo", "u1", 1 << 30)], retired=["team-a.old.u0"])
    assert '"team-a.old.u0": { jetstream: disabled }' in text and text.count("user:") == 2  # the operator's, demo's


def test_a_jobs_own_labels_reach_its_pods_only_where_the_platform_allows_their_prefix() -> None:
    """A label on the job is copied to its children; onto its pods only without a prefix or with
    one the platform lists (a mesh opt-out or a network plugin's label would act on every pod)."""
    from pipelinerl_operator.job_policy import JobPolicy

    manifest = {"metadata": {"name": "demo", "labels": {"team": "a", "sidecar.istio.io/inject": "false"}}}
    for prefixes, expected in (([], {"team"}), (["sidecar.istio.io"], {"team", "sidecar.istio.io/inject"})):
        cfg = OperatorConfig(policy=JobPolicy(pod_metadata_prefixes=prefixes))
        objs = by_name(render(parse_job(manifest), "team-a", "uid-1", cfg))
        for role in ("generator", "preprocessor", "trainer"):
            sts = objs[("StatefulSet", f"demo-prl-{role}")]
            pod_labels = set(sts["spec"]["template"]["metadata"]["labels"])
            assert pod_labels & {"team", "sidecar.istio.io/inject"} == expected
            assert "sidecar.istio.io/inject" in sts["metadata"]["labels"]  # the StatefulSet itself keeps it
    # A job's label of one of the operator's names: the operator's value on its pods, which its
    # StatefulSet's selector and NetworkPolicy find them by (the pods had no job label at all).
    manifest["metadata"]["labels"] = {"pipelinerl.dev/job": "x", "app.kubernetes.io/managed-by": "y"}
    for sts in (o for o in render(parse_job(manifest), "team-a", "uid-1", CFG) if o["kind"] == "StatefulSet"):
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert (
            pod_labels["pipelinerl.dev/job"] == "demo"
            and pod_labels["app.kubernetes.io/managed-by"] == "pipelinerl-operator"
        )


def test_job_pods_run_as_their_jobs_own_service_account_wherever_the_job_is() -> None:
    objs = by_name(render(job(), "team-z", "uid-1", CFG))  # any namespace: nothing needs to be there first
    account = objs[("ServiceAccount", "demo-pipelinerl")]
    assert account["automountServiceAccountToken"] is False and account["metadata"]["namespace"] == "team-z"
    for role in ("generator", "preprocessor", "trainer"):
        pod = objs[("StatefulSet", f"demo-prl-{role}")]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "demo-pipelinerl" and pod["automountServiceAccountToken"] is False
    chosen = render(job(), "team-z", "uid-1", OperatorConfig(service_account="shared-sa"))  # the install names one
    assert not [o for o in chosen if o["kind"] == "ServiceAccount"]
    assert {o["spec"]["template"]["spec"]["serviceAccountName"] for o in chosen if o["kind"] == "StatefulSet"} == {
        "shared-sa"
    }


@pytest.mark.parametrize(
    "retention, output, written_to, deleted",
    [
        ("DeleteAfterOutput", {"claimName": "models"}, None, False),  # running: the checkpoints are the only copy
        ("DeleteAfterOutput", {"claimName": "models"}, "models/", True),  # succeeded: the final model is on the claim
        ("DeleteAfterOutput", {"claimName": "models", "subPath": "a"}, "models/a", True),
        # The claim or its subPath added or changed after the job succeeded: no pod wrote there.
        ("DeleteAfterOutput", {"claimName": "models"}, "other/", False),
        ("DeleteAfterOutput", {"claimName": "models", "subPath": "b"}, "models/a", False),
        ("DeleteAfterOutput", None, None, False),  # no output: the checkpoints are the model
        ("DeleteAfterOutput", {"path": "/models"}, None, False),  # `pipelinerl run`'s output: no pod writes it
        ("Retain", {"claimName": "models"}, "models/", False),
        ("Delete", None, None, True),
    ],
)
def test_trainer_volumes_go_with_the_job_only_per_the_retention_policy(retention, output, written_to, deleted) -> None:
    spec = {"runPolicy": {"checkpointRetention": retention}, **({"output": output} if output else {})}
    trainer = by_name(render(job(**spec), "ns", "u", CFG, written_to=written_to))[("StatefulSet", "demo-prl-trainer")]
    assert trainer["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete" if deleted else "Retain",
        "whenScaled": "Retain",
    }


def test_where_the_output_was_written_is_the_spec_the_job_succeeded_with() -> None:
    """The pass that finds the job succeeded records where its pods wrote the model; later passes
    keep that, whatever the spec says since (a claim added to a finished job holds nothing: its
    volumes, deleted with it, took the only copy)."""
    from pipelinerl_operator.reconcile import output_written

    ran, edited = job(output={"claimName": "models"}), job(output={"claimName": "later"})
    running, done = {"phase": "Running"}, {"phase": "Succeeded"}
    assert output_written(running, running, ran) is None
    assert output_written(running, done, ran) == "models/"  # the pass it succeeds on
    assert output_written(done | {"outputWritten": "models/"}, done, edited) == "models/"
    assert output_written(done, done, edited) is None  # succeeded before it was recorded: kept, not guessed
    assert output_written(running, done, job()) is None  # written nowhere


def test_every_pod_asks_for_resources_the_user_did_not_name() -> None:
    """A namespace ResourceQuota refuses pods without requests and limits: each role gets its
    defaults (per GPU on GPUs) for cpu and memory wherever the user names neither."""

    def resources(**spec):
        objs = by_name(render(job(**spec), "ns", "u", CFG))
        return {
            r: objs[("StatefulSet", f"demo-prl-{r}")]["spec"]["template"]["spec"]["containers"][0]["resources"]
            for r in ("generator", "preprocessor", "trainer")
        }

    plain = resources()
    assert plain["preprocessor"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    assert plain["trainer"] == {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
    mine = resources(model={"path": "/models/q"}, generator={"gpus": 2, "resources": {"requests": {"memory": "100Gi"}}})
    assert mine["generator"] == {
        "requests": {"memory": "100Gi", "cpu": "8", "nvidia.com/gpu": "2"},
        "limits": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "2"},
    }  # memory: the user's request, and the default limit (the larger)
    big = resources(trainer={"resources": {"requests": {"memory": "100Gi"}}})["trainer"]
    assert big["limits"]["memory"] == "100Gi"  # a request above the default limit: the limit is the request
    sidecar = by_name(
        render(
            job(trainer={"podTemplate": {"spec": {"containers": [{"name": "log", "image": "busybox:1"}]}}}),
            "ns",
            "u",
            CFG,
        )
    )[("StatefulSet", "demo-prl-trainer")]["spec"]["template"]["spec"]["containers"][0]
    assert sidecar["resources"] == {  # a sidecar naming nothing gets small defaults
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
