"""A role's pod template (pure): the user's pod template merged under PipelineRL's container, its
command and environment (the role's `ServiceEnv`, the job's credentials by reference), resources
and GPUs, ports and probes, labels and the config hash that restarts a role when its pod fields
change, and the security context every container runs with."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from pipelinerl.contracts import (
    CONFIG_HASH_ANNOTATION,
    HTTP_PORT,
    JOB_FILE,
    JOB_SECRET_KEYS,
    JOB_FILE_DIR,
    KUEUE_POD_GROUP_COUNT_ANNOTATION,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_QUEUE_LABEL,
    MASTER_PORT,
    POD_GROUP_LABEL,
    POD_INDEX_LABEL,
    POD_CACHE_DIR,
    POD_OUTPUT_DIR,
    POD_RUN_DIR,
    POD_TMP_DIR,
    POD_USER,
    ROLES,
    Env,
    STOP_GRACE_S,
    ServiceEnv,
)
from pipelinerl.k8s_types import parse_quantity, read_quantity
from pipelinerl.spec import GPU_RESOURCE, PipelineRLJob, RoleSpec
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.names import (
    config_map_name,
    gang_name,
    job_labels,
    operator_labels,
    replicas,
    secret_name,
    service_account_name,
    trainer_host,
)


# Pod-level fields of a role: changing them restarts that role only.
POD_FIELDS = ("image", "resources", "gpus", "env", "podTemplate")


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


def _env(job: PipelineRLJob, role: str, namespace: str, uid: str, cfg: OperatorConfig) -> list[dict[str, Any]]:
    rank = {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}
    env = [
        {"name": name, "valueFrom": rank} if name == Env.RANK else {"name": name, "value": value}
        for name, value in service_env(job, role, namespace, cfg).to_environ().items()
    ]
    spec: RoleSpec = getattr(job.spec, role)
    # The root filesystem is read-only: caches and home go to volumes (a user's env may move them).
    env += [{"name": Env.CACHE, "value": POD_CACHE_DIR}, {"name": Env.HOME, "value": POD_TMP_DIR}]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(job.name, uid), "key": key}}}
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
        limits[GPU_RESOURCE] = str(spec.gpus)
        requests[GPU_RESOURCE] = str(spec.gpus)
    return {"requests": requests, "limits": limits}


def container_ports(job: PipelineRLJob, role: str) -> list[dict[str, Any]]:
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


def _pod_labels(job: PipelineRLJob, role: str, cfg: OperatorConfig) -> tuple[dict[str, str], dict[str, str]]:
    # The job's own labels reach its pods only where the platform lets a job label them so; the
    # operator's always (a job's label of one of their names is not taken for theirs).
    ours = operator_labels(job, role)
    labels = {k: v for k, v in job_labels(job, role).items() if k in ours or cfg.policy.pod_metadata_allowed(k)}
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
                limits[resource] = max(SIDECAR_RESOURCES["limits"][resource], requests[resource], key=read_quantity)
            except ValueError:
                pass  # not a quantity: the policy check names it
    container["resources"] = {**given, "requests": requests, "limits": limits}


NVIDIA_RESOURCES = "nvidia.com/"  # the device plugin's: nvidia.com/gpu, nvidia.com/mig-<profile>


def _given_gpus(limits: Any) -> bool:
    """Whether the device plugin hands a container with these limits a GPU: a limit above 0 of
    one of its resources. A limit of 0 hands none (so the container must be kept from seeing the
    node's), as does one Kubernetes cannot read (the policy check refuses it)."""
    for name, value in (limits if isinstance(limits, dict) else {}).items():
        try:
            if str(name).startswith(NVIDIA_RESOURCES) and read_quantity(value) > 0:
                return True
        except ValueError:
            pass
    return False


# Locked down (the "restricted" Pod Security Standard): writes go to the pod's volumes only. A
# sidecar from the user's podTemplate gets the same.
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod_template(job: PipelineRLJob, role: str, namespace: str, uid: str, cfg: OperatorConfig) -> dict[str, Any]:
    spec: RoleSpec = getattr(job.spec, role)
    image = spec.image or (cfg.gpu_image if spec.gpus else cfg.cpu_image)
    container: dict[str, Any] = {
        "name": role,
        "image": image,
        "imagePullPolicy": cfg.image_pull_policy if image in (cfg.cpu_image, cfg.gpu_image) else "Always",
        "command": ["pipelinerl"],
        "args": ["service", role, JOB_FILE],
        "env": _env(job, role, namespace, uid, cfg),
        "ports": container_ports(job, role),
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
            {
                "name": "output",
                "mountPath": POD_OUTPUT_DIR,
                "subPath": "/".join(filter(None, (output.sub_path, job.name))),
            }
        )
    pod_spec: dict[str, Any] = {
        "serviceAccountName": service_account_name(job.name, cfg),
        "automountServiceAccountToken": False,  # job pods never call the Kubernetes API
        "terminationGracePeriodSeconds": STOP_GRACE_S,
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
    labels, annotations = _pod_labels(job, role, cfg)
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
        if not _given_gpus((c.get("resources") or {}).get("limits")):
            # No GPU asked for (whole or a MIG slice): none seen, whatever the image's environment
            # says (CUDA base images set NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA runtime honours).
            c["env"] = [*(c.get("env") or []), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
        if c["name"] != role:
            _sidecar_resources(c)
        else:  # unless the job's template says otherwise: the kubelet keeps a failed service's log
            # tail (its exception) as its termination message, which the job's conditions quote (`pods`)
            c.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
        if c.get("image") not in (cfg.cpu_image, cfg.gpu_image):
            # A job's own image is pulled every time, so the registry checks the job's pull rights:
            # a cached copy on the node may be another tenant's (pulled with their credentials).
            c.setdefault("imagePullPolicy", "Always")
    return pod
