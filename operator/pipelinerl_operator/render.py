"""Pure rendering: a PipelineRLJob → the Kubernetes objects that run it. No I/O.

Per role (generator, preprocessor, trainer): a headless Service (rendezvous DNS, published
before pods are ready) and a StatefulSet (stable names, rank from the pod-index label). One
ConfigMap holds the job manifest every pod reads; a ServiceAccount is the pods' (no role bound,
no token mounted); a NetworkPolicy lets only the job's own pods
reach its pods (the operator and metrics scrapers: the HTTP port only); with the install's key,
a Secret holds the job's credentials (its NATS account, its weight token), given to its pods
only by reference. Everything is owned by the job, so deleting the job garbage-collects it all.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipelinerl.contracts import (
    CONFIG_HASH_ANNOTATION,
    HTTP_PORT,
    JOB_FILE,
    JOB_SECRET_KEYS,
    JOB_FILE_DIR,
    JOB_LABEL,
    KUEUE_POD_GROUP_COUNT_ANNOTATION,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_QUEUE_LABEL,
    MASTER_PORT,
    POD_GROUP_LABEL,
    POD_INDEX_LABEL,
    POD_CACHE_DIR,
    POD_GROUP_API,
    POD_OUTPUT_DIR,
    POD_RUN_DIR,
    POD_TMP_DIR,
    POD_USER,
    ROLE_LABEL,
    ROLES,
    Env,
    ServiceEnv,
)
from pipelinerl.k8s_types import parse_quantity
from pipelinerl.spec import API_VERSION, KIND, PipelineRLJob, RoleSpec, dump_job
from pipelinerl_operator import policy_checks
from pipelinerl_operator.credentials import job_credentials, secret_data
from pipelinerl.contracts import RESERVED_LABEL_PREFIXES
from pipelinerl.reserved import CREDENTIALS_SUFFIX
from pipelinerl_operator.egress import dns_egress, egress_rules
from pipelinerl_operator.job_policy import Install, JobPolicy
from pipelinerl_operator.pod_security import pod_violations

FIELD_MANAGER = "pipelinerl-operator"
ROLE_INFIX = "prl"
# Pod-level fields of a role: changing them restarts that role only.
POD_FIELDS = ("image", "resources", "gpus", "env", "podTemplate")


class RenderError(ValueError):
    """A spec the operator cannot run; reported as a condition and an Event, never retried blindly.
    Each problem names its field under `spec.`."""

    def __init__(self, *problems: str):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class OperatorConfig:
    """Install-wide settings (Helm values → operator env)."""

    cpu_image: str = "ghcr.io/pipelinerl/pipelinerl-services:0.1.0"
    gpu_image: str = "ghcr.io/pipelinerl/pipelinerl-services-gpu:0.1.0"
    nats_url: str = "nats://pipelinerl-nats:4222"
    service_account: str | None = None  # job pods' ServiceAccount; None: one per job, rendered with it
    image_pull_policy: str = "IfNotPresent"
    # The install's secret key (the chart generates one): per-job credentials derive from it.
    # None: no Secret, no NATS credentials, an empty weight token (a cluster of one team).
    auth_key: str | None = None
    # Namespaces whose pods may reach job pods' HTTP port (/metrics, /status) besides the
    # operator's: where Prometheus runs.
    metrics_namespaces: tuple[str, ...] = ()
    nats_replicas: int = 1  # servers of the chart's NATS: each stream of a job on it is kept by all of them
    nats_store_bytes: int = 0  # the chart's NATS store (each server's): jobs beyond it are refused; 0: unchecked
    # The chart's NATS runs in the install (its pods, its accounts); False: `nats.externalUrl`, a
    # server someone else runs, reached at `nats_external_cidrs` (none: anywhere on its ports).
    nats_bundled: bool = True
    nats_external_cidrs: tuple[str, ...] = ()
    # Job pods may connect only to their own job, NATS, DNS and what the job lists (spec.network);
    # False: anywhere. `namespace`: the operator's (where the chart's NATS runs).
    restrict_egress: bool = True
    namespace: str = "pipelinerl"
    # What jobs may ask for (the chart's jobPolicy), and the install's own Secrets, which no job may name.
    policy: JobPolicy = JobPolicy()
    install: Install = Install()


def role_name(job: str, role: str) -> str:
    """A role's StatefulSet and Service: marked as PipelineRL's, so that no ordinary object such as
    a Deployment's Service `<job>-generator` holds the name (spec.MAX_JOB_NAME leaves room)."""
    return f"{job}-{ROLE_INFIX}-{role}"


def owned_name(job: str, what: str = "") -> str:
    """The name of a child that is not a role's: one no user object is likely to hold (and the
    operator never takes over an object it does not own: handlers.apply_owned)."""
    return f"{job}-pipelinerl" + (f"-{what}" if what else "")


def config_map_name(job: str) -> str:
    return owned_name(job, "config")


def secret_name(job: str) -> str:
    return f"{job}{CREDENTIALS_SUFFIX}"  # pod_security refuses other jobs' by the suffix


def service_account_name(job: str, cfg: OperatorConfig) -> str:
    return cfg.service_account or owned_name(job)


def selector_labels(job: str, role: str) -> dict[str, str]:
    return {JOB_LABEL: job, ROLE_LABEL: role}


def generator_selector(job: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(job, "generator").items())


def trainer_host(job: PipelineRLJob, namespace: str) -> str:
    return f"{role_name(job.name, 'trainer')}-0.{role_name(job.name, 'trainer')}.{namespace}.svc"


def replicas(job: PipelineRLJob, role: str) -> int:
    if role == "preprocessor":
        return 1
    return getattr(job.spec, role).replicas


def _labels(job: PipelineRLJob, role: str | None) -> dict[str, str]:
    # The job's labels, less those the operator sets from the spec (queue, gang, its own).
    labels = {
        **{k: v for k, v in job.metadata.labels.items() if not k.startswith(RESERVED_LABEL_PREFIXES)},
        "app.kubernetes.io/name": "pipelinerl",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": "pipelinerl-operator",
        JOB_LABEL: job.name,
    }
    if role:
        labels |= {"app.kubernetes.io/component": role, ROLE_LABEL: role}
    return labels


def owner_reference(job: PipelineRLJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: PipelineRLJob, namespace: str, uid: str, name: str, role: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": _labels(job, role),
        "ownerReferences": [owner_reference(job, uid)],
    }


# ---------------------------------------------------------------- pod template merge


def merge_pod(user: Any, ours: Any) -> Any:
    """Merge our generated pod over the user's template: our scalars win, lists of named
    items (containers, volumes, env, ports, mounts) merge by name, other lists: ours if any."""
    if isinstance(user, dict) and isinstance(ours, dict):
        out = copy.deepcopy(user)
        for key, value in ours.items():
            out[key] = merge_pod(user[key], value) if key in user else copy.deepcopy(value)
        return out
    if isinstance(user, list) and isinstance(ours, list):
        named = all(isinstance(x, dict) and "name" in x for x in user + ours)
        if not named:
            return copy.deepcopy(ours) if ours else copy.deepcopy(user)
        ours_by_name = {x["name"]: x for x in ours}
        user_names = {x["name"] for x in user}
        merged = [
            merge_pod(x, ours_by_name[x["name"]]) if x["name"] in ours_by_name else copy.deepcopy(x) for x in user
        ]
        return merged + [copy.deepcopy(x) for x in ours if x["name"] not in user_names]
    return copy.deepcopy(ours)


# ---------------------------------------------------------------- pieces


def role_config_hash(job: PipelineRLJob, role: str) -> str:
    """Hash of what a role's pods read, leaving out what must not restart them: `suspend`,
    `runPolicy` (operator only), generator replicas (scaling adds or removes generator pods and
    touches no running one: the weight group is elastic), other roles' pod fields."""
    spec = job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec.pop("suspend", None)
    spec.pop("runPolicy", None)
    spec["generator"].pop("replicas", None)
    for other in ROLES:
        if other != role:
            for field in POD_FIELDS:
                spec[other].pop(field, None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def service_env(job: PipelineRLJob, role: str, namespace: str, cfg: OperatorConfig) -> ServiceEnv:
    """What a role's pods are told (their rank comes from the pod-index label instead)."""
    trainer = role == "trainer"
    output = job.spec.output
    # Trainer pods start one rank per GPU, generator pods one engine per tensorParallel GPUs;
    # their rank is the pod's index, from which each rank process derives its own: index × ranks
    # per pod + local rank (pipelinerl_cli.pod_ranks).
    per_pod = {"trainer": job.spec.trainer_ranks_per_pod, "generator": job.spec.generator_engines_per_pod}
    return ServiceEnv(
        role,
        world_size=job.spec.trainer_ranks if trainer else None,
        nats_url=job.spec.nats.url or cfg.nats_url,
        weights_addr=f"{trainer_host(job, namespace)}:{job.spec.weight_sync.port}",
        run_dir=Path(POD_RUN_DIR),
        output_dir=Path(POD_OUTPUT_DIR) if trainer and output and output.claim_name else None,
        ranks_per_pod=per_pod[role] if trainer or per_pod.get(role, 1) > 1 else None,
        stream_replicas=cfg.nats_replicas if cfg.nats_replicas > 1 and on_chart_nats(job) else None,
        master_addr=trainer_host(job, namespace) if trainer else None,
        master_port=MASTER_PORT if trainer else None,
    )


def _env(job: PipelineRLJob, role: str, namespace: str, cfg: OperatorConfig) -> list[dict[str, Any]]:
    rank = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    env = [
        {"name": name, "valueFrom": rank} if name == Env.RANK else {"name": name, "value": value}
        for name, value in service_env(job, role, namespace, cfg).to_environ().items()
    ]
    spec: RoleSpec = getattr(job.spec, role)
    # The root filesystem is read-only: caches and home go to volumes (a user's env may move them).
    env += [{"name": Env.CACHE, "value": POD_CACHE_DIR}, {"name": Env.HOME, "value": POD_TMP_DIR}]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(job.name), "key": key}}}
        for key, name in JOB_SECRET_KEYS.items()
        if _uses_secret(job, cfg, key)
    ]
    return env + [e.model_dump(mode="json", by_alias=True, exclude_none=True) for e in spec.env]


def on_chart_nats(job: PipelineRLJob) -> bool:
    """The job uses the chart's NATS, which the operator configures (accounts, replication); a
    job's own `nats.url` is a server it does not."""
    return job.spec.nats.url is None


def _uses_secret(job: PipelineRLJob, cfg: OperatorConfig, key: str) -> bool:
    """Credentials exist with the install's key; NATS ones are for the chart's own NATS only (the
    operator writes its accounts; an external server is configured by whoever runs it)."""
    return cfg.auth_key is not None and (key == "weightsToken" or (on_chart_nats(job) and cfg.nats_bundled))


# What a role's pod asks for when its spec says nothing of cpu or memory (a namespace with a
# ResourceQuota refuses pods without requests and limits): per pod on CPU, per GPU on GPUs.
DEFAULT_RESOURCES: dict[str, dict[str, dict[str, float]]] = {
    "preprocessor": {"requests": {"cpu": 0.5, "memory": 1}, "limits": {"cpu": 2, "memory": 2}},
    "generator": {"requests": {"cpu": 1, "memory": 4}, "limits": {"cpu": 4, "memory": 8}},
    "trainer": {"requests": {"cpu": 1, "memory": 4}, "limits": {"cpu": 4, "memory": 8}},
}
DEFAULT_PER_GPU: dict[str, dict[str, float]] = {
    "requests": {"cpu": 4, "memory": 32},
    "limits": {"cpu": 8, "memory": 64},
}


def _quantity(resource: str, amount: float) -> str:
    return (f"{amount:g}" if amount >= 1 else f"{int(amount * 1000)}m") if resource == "cpu" else f"{amount:g}Gi"


def _resources(spec: RoleSpec, role: str) -> dict[str, Any]:
    """The user's resources, and for cpu and memory where they name neither request nor limit,
    the defaults for the role (scaled by its GPUs); a request without a limit gets the default
    limit, or the request where it is larger (every pod has limits: a ResourceQuota admits it)."""
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    defaults = DEFAULT_RESOURCES[role]
    for kind, into in (("requests", requests), ("limits", limits)):
        for resource in ("cpu", "memory"):
            if resource not in spec.resources.requests and resource not in spec.resources.limits:
                amount = DEFAULT_PER_GPU[kind][resource] * spec.gpus if spec.gpus else defaults[kind][resource]
                into[resource] = _quantity(resource, amount)
    for resource in ("cpu", "memory"):
        if resource in requests and resource not in limits:
            amount = DEFAULT_PER_GPU["limits"][resource] * spec.gpus if spec.gpus else defaults["limits"][resource]
            default = _quantity(resource, amount)
            limits[resource] = max(default, requests[resource], key=parse_quantity)
    if spec.gpus:
        limits["nvidia.com/gpu"] = str(spec.gpus)
        requests["nvidia.com/gpu"] = str(spec.gpus)
    return {"requests": requests, "limits": limits}


def _ports(job: PipelineRLJob, role: str) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if role == "trainer":
        ports += [
            {"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"},
            {"name": "weights", "containerPort": job.spec.weight_sync.port, "protocol": "TCP"},
        ]
    return ports


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def gang_name(job: str) -> str:
    """The pod group that must be scheduled together: the trainer ranks and the preprocessor."""
    return owned_name(job, "gang")


def _pod_labels(job: PipelineRLJob, role: str) -> tuple[dict[str, str], dict[str, str]]:
    labels = _labels(job, role)
    annotations: dict[str, str] = {CONFIG_HASH_ANNOTATION: role_config_hash(job, role)}
    scheduling = job.spec.scheduling
    # The gang is the trainer ranks and the preprocessor: useless without each other, and fixed in
    # size. Generators are elastic (the job scales them, and runs with any number ≥ 1): each is
    # admitted on its own, so scaling them changes no pod template, a trainer's least of all.
    gang = role != "generator"
    if scheduling.queue_name:
        labels[KUEUE_QUEUE_LABEL] = scheduling.queue_name
        if gang:  # Kueue admits the pods of a pod group together
            labels[KUEUE_POD_GROUP_LABEL] = gang_name(job.name)
            annotations[KUEUE_POD_GROUP_COUNT_ANNOTATION] = str(
                replicas(job, "trainer") + replicas(job, "preprocessor")
            )
    if scheduling.scheduler_name and gang:  # coscheduling-style gang schedulers group pods by this label
        labels[POD_GROUP_LABEL] = gang_name(job.name)
    return labels, annotations


# What a user's sidecar or init container gets where it names neither request nor limit of cpu
# or memory (and a limit where it names a request only).
SIDECAR_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"cpu": "1", "memory": "512Mi"},
}


def _sidecar_resources(container: dict[str, Any]) -> None:
    given = container.get("resources") or {}
    if not isinstance(given, dict):
        return  # a wrong type: the schema check names it
    requests, limits = given.get("requests") or {}, given.get("limits") or {}
    if not isinstance(requests, dict) or not isinstance(limits, dict):
        return
    requests, limits = dict(requests), dict(limits)
    for resource in ("cpu", "memory"):
        if resource not in requests and resource not in limits:
            requests[resource] = SIDECAR_RESOURCES["requests"][resource]
            limits[resource] = SIDECAR_RESOURCES["limits"][resource]
        elif resource not in limits:
            try:
                limits[resource] = max(SIDECAR_RESOURCES["limits"][resource], requests[resource], key=parse_quantity)
            except ValueError:
                pass  # not a quantity: the schema check names it
    container["resources"] = {**given, "requests": requests, "limits": limits}


# Locked down (the "restricted" Pod Security Standard): writes go to the pod's volumes only. A
# sidecar from the user's podTemplate gets the same.
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod_template(job: PipelineRLJob, role: str, namespace: str, cfg: OperatorConfig) -> dict[str, Any]:
    spec: RoleSpec = getattr(job.spec, role)
    image = spec.image or (cfg.gpu_image if spec.gpus else cfg.cpu_image)
    container: dict[str, Any] = {
        "name": role,
        "image": image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": ["pipelinerl"],
        "args": ["service", role, JOB_FILE],
        "env": _env(job, role, namespace, cfg),
        "ports": _ports(job, role),
        "resources": _resources(spec, role),
        "startupProbe": _probe("/healthz", 10, 180),  # model loading may take many minutes
        "livenessProbe": _probe("/healthz", 20, 6),
        "readinessProbe": _probe("/readyz", 10, 3),
        "volumeMounts": [
            {"name": "job-config", "mountPath": JOB_FILE_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "run", "mountPath": POD_RUN_DIR},
            {"name": "cache", "mountPath": POD_CACHE_DIR},
            {"name": "tmp", "mountPath": POD_TMP_DIR},
        ],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    volumes: list[dict[str, Any]] = [
        {"name": "job-config", "configMap": {"name": config_map_name(job.name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and torch workers need a big /dev/shm
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if role != "trainer":  # trainers get a PersistentVolumeClaim per rank instead
        volumes.append({"name": "run", "emptyDir": {}})
    output = job.spec.output
    if role == "trainer" and output and output.claim_name:  # the user's claim: outlives the job
        volumes.append({"name": "output", "persistentVolumeClaim": {"claimName": output.claim_name}})
        container["volumeMounts"].append(
            {"name": "output", "mountPath": POD_OUTPUT_DIR, "subPath": output.sub_path or job.name}
        )
    pod_spec: dict[str, Any] = {
        "serviceAccountName": service_account_name(job.name, cfg),
        "automountServiceAccountToken": False,  # job pods never call the Kubernetes API
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": POD_USER,
            "runAsGroup": POD_USER,
            "fsGroup": POD_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    scheduling = job.spec.scheduling
    if scheduling.scheduler_name:
        pod_spec["schedulerName"] = scheduling.scheduler_name
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    labels, annotations = _pod_labels(job, role)
    ours = {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}
    template = spec.pod_template or {}
    pod = merge_pod(template, ours)
    # Security settings are the exception: where the user sets one, theirs is kept (they may
    # tighten ours), and the pod as merged must pass pod_security (they can never loosen them).
    user = template.get("spec") or {}
    for key in ("serviceAccountName", "serviceAccount", "automountServiceAccountToken"):
        if key in user:
            pod["spec"][key] = copy.deepcopy(user[key])
    pod["spec"]["securityContext"] = merge_pod(pod_spec["securityContext"], user.get("securityContext") or {})
    theirs = {c.get("name"): c for kind in ("initContainers", "containers") for c in user.get(kind) or []}
    for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:  # a user's sidecars too
        c["securityContext"] = merge_pod(CONTAINER_SECURITY, (theirs.get(c["name"]) or {}).get("securityContext") or {})
        if c["name"] != role:
            _sidecar_resources(c)
    return pod


# ---------------------------------------------------------------- objects


def config_map(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    # The pods name the job's streams by its namespace: it is in the manifest they read.
    placed = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace})})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, namespace, uid, config_map_name(job.name), None),
        "data": {"job.yaml": dump_job(placed)},
    }


def service_account(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    """The job's pods' own identity, wherever the job runs (no role is bound to it; its token is
    not mounted): a binding of the user's may give it cloud permissions (object-store access)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "automountServiceAccountToken": False,
        "metadata": _metadata(job, namespace, uid, owned_name(job.name), None),
    }


def secret(job: PipelineRLJob, namespace: str, uid: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(job, namespace, uid, secret_name(job.name), None),
        "data": secret_data(job_credentials(key, namespace, job.name, uid)),
    }


OPERATOR_POD = {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "operator"}
NATS_POD = {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "nats"}
NATS_CLIENT_PORT = 4222


def network_policy(job: PipelineRLJob, namespace: str, uid: str, cfg: OperatorConfig) -> dict[str, Any]:
    """Ingress to the job's pods: from its own pods on any port (the weight group's and
    DeepSpeed's rendezvous, gloo's and NCCL's connections, whose ports are not fixed); to the
    HTTP port (health, /metrics, /status) also from the operator and the metrics namespaces.
    Egress (where the install restricts it): to its own pods, NATS, DNS, and what the job lists."""
    own = {"podSelector": {"matchLabels": {JOB_LABEL: job.name}}}
    readers = [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD)}}]
    readers += [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}} for ns in cfg.metrics_namespaces
    ]
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": {JOB_LABEL: job.name}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [own]}, {"from": readers, "ports": [{"port": HTTP_PORT, "protocol": "TCP"}]}],
    }
    if cfg.restrict_egress:
        spec["policyTypes"].append("Egress")
        spec["egress"] = [
            {"to": [own]},
            _nats_egress(job, cfg),
            dns_egress(cfg.policy),
            *egress_rules(job.spec.network.egress, cfg.policy),  # within the platform's
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, namespace, uid, owned_name(job.name), None),
        "spec": spec,
    }


def _nats_egress(job: PipelineRLJob, cfg: OperatorConfig) -> dict[str, Any]:
    """The chart's NATS pods on its client port; the chart's external NATS on its URLs' ports, at
    its addresses where the chart lists them; a job's own servers (jobPolicy.natsServers): their
    ports, anywhere (a NetworkPolicy cannot name a host)."""
    if on_chart_nats(job) and cfg.nats_bundled:
        return {
            "to": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": cfg.namespace}},
                    "podSelector": {"matchLabels": dict(NATS_POD)},
                }
            ],
            "ports": [{"port": NATS_CLIENT_PORT, "protocol": "TCP"}],
        }
    urls = job.spec.nats.url or cfg.nats_url
    ports = sorted({urlsplit(u.strip()).port or NATS_CLIENT_PORT for u in urls.split(",") if u.strip()})
    rule: dict[str, Any] = {"ports": [{"port": p, "protocol": "TCP"} for p in ports]}
    if on_chart_nats(job) and cfg.nats_external_cidrs:
        rule["to"] = [{"ipBlock": {"cidr": c}} for c in cfg.nats_external_cidrs]
    return rule


def pod_group(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    """The gang as coscheduling-style gang schedulers read it (scheduler-plugins' PodGroup): the
    pods carrying POD_GROUP_LABEL are bound together or not at all."""
    return {
        "apiVersion": POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": _metadata(job, namespace, uid, gang_name(job.name), None),
        "spec": {"minMember": replicas(job, "trainer") + replicas(job, "preprocessor")},
    }


def service(job: PipelineRLJob, role: str, namespace: str, uid: str) -> dict[str, Any]:
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
        for p in _ports(job, role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, namespace, uid, role_name(job.name, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rendezvous must resolve before pods are ready
            "selector": selector_labels(job.name, role),
            "ports": ports,
        },
    }


def volumes_deletable(job: PipelineRLJob, output_written: bool) -> bool:
    """Whether the trainer volumes may go with the job (`runPolicy.checkpointRetention`)."""
    retention = job.spec.run_policy.checkpoint_retention
    return retention == "Delete" or (
        retention == "DeleteAfterOutput" and job.spec.output is not None and output_written
    )


def stateful_set(
    job: PipelineRLJob,
    role: str,
    namespace: str,
    uid: str,
    cfg: OperatorConfig,
    active: bool,
    output_written: bool = False,
) -> dict[str, Any]:
    name = role_name(job.name, role)
    spec: dict[str, Any] = {
        "serviceName": name,
        "replicas": replicas(job, role) if active else 0,
        "podManagementPolicy": "Parallel",  # ranks rendezvous: start them together
        "selector": {"matchLabels": selector_labels(job.name, role)},
        "template": pod_template(job, role, namespace, cfg),
        # A trainer template change restarts the gang as a whole (the operator deletes its pods
        # together: pods.trainer_gang_to_restart); one rank at a time would break its collectives.
        "updateStrategy": {"type": "OnDelete" if role == "trainer" else "RollingUpdate"},
    }
    if role == "trainer":
        storage = job.spec.storage
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": storage.size}},
        }
        if storage.storage_class_name:
            claim["storageClassName"] = storage.storage_class_name
        spec["volumeClaimTemplates"] = [{"metadata": {"name": "run"}, "spec": claim}]
        # Checkpoints survive suspend (scale to 0); with the job they go per the retention policy,
        # never while they hold the only copy of a model the job was to write out.
        spec["persistentVolumeClaimRetentionPolicy"] = {
            "whenDeleted": "Delete" if volumes_deletable(job, output_written) else "Retain",
            "whenScaled": "Retain",
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(job, namespace, uid, name, role),
        "spec": spec,
    }


def validate_renderable(job: PipelineRLJob) -> None:
    """Checks that only matter on Kubernetes (the spec models cannot know the pod layout)."""
    for role in ROLES:
        template = getattr(job.spec, role).pod_template or {}
        given = template.get("spec")
        pod_spec = given if isinstance(given, dict) else {}
        containers = pod_spec.get("containers") or []
        if not isinstance(containers, list) or any(not isinstance(c, dict) or not c.get("name") for c in containers):
            raise RenderError(
                f"{role}.podTemplate.spec.containers: a list of containers, each with a name "
                f"(name one {role!r} to add mounts to the service container; other names add sidecars)"
            )
        for c in containers:
            if c["name"] != role and not c.get("image"):
                raise RenderError(
                    f"{role}.podTemplate.spec.containers[{c['name']}].image: a sidecar needs an image "
                    f"(only the {role!r} container gets the job's)"
                )


def render(
    job: PipelineRLJob, namespace: str, uid: str, cfg: OperatorConfig, active: bool = True, output_written: bool = False
) -> list[dict[str, Any]]:
    """Every child object of the job; `active=False` (suspended, finished) scales all roles to zero;
    `output_written`: the job succeeded with its output written (see `volumes_deletable`)."""
    validate_renderable(job)
    objects = [config_map(job, namespace, uid), network_policy(job, namespace, uid, cfg)]
    if cfg.service_account is None:
        objects.append(service_account(job, namespace, uid))
    if cfg.auth_key is not None:  # before the pods that read it
        objects.append(secret(job, namespace, uid, cfg.auth_key))
    if job.spec.scheduling.scheduler_name:  # before its pods, which the scheduler holds until it exists
        objects.append(pod_group(job, namespace, uid))
    for role in ROLES:
        objects.append(service(job, role, namespace, uid))
        objects.append(stateful_set(job, role, namespace, uid, cfg, active, output_written))
    check_pods(job, objects, cfg)
    return objects


def check_pods(job: PipelineRLJob, objects: list[dict[str, Any]], cfg: OperatorConfig) -> None:
    """Refuse a job that asks for more than its author may have: its podTemplate's fields, its
    pods as rendered (the podTemplate merged in) and its spec, against the platform's policy
    (policy_checks) and the pod security rules (pod_security)."""
    namespace = job.metadata.namespace or "default"
    bad = policy_checks.Problems()
    for role in ROLES:
        policy_checks.template_violations(role, getattr(job.spec, role).pod_template, bad)
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            role = obj["metadata"]["labels"][ROLE_LABEL]
            pod = obj["spec"]["template"]
            bad.items += [
                f"{role}.{v}" for v in pod_violations(pod, service_account=service_account_name(job.name, cfg))
            ]
            policy_checks.pod_policy_violations(
                role,
                pod,
                cfg.policy,
                namespace,
                secret_name(job.name),
                (cfg.cpu_image, cfg.gpu_image),
                cfg.install,
                bad,
            )
    problems = bad.items + policy_checks.spec_violations(
        job, cfg.policy, namespace, cfg.install, cfg.nats_store_bytes, cfg.nats_bundled
    )
    if problems:
        raise RenderError(*dict.fromkeys(problems))  # each once
