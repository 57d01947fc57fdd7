"""A job against the platform's policy (pure): what a job may ask for, in one place every door calls.

A platform team lets people create PipelineRLJobs who may not create pods, Secrets or network
rules themselves; the operator creates them on their behalf, so it must never do for a job what
its author could not do alone. `validate`, the admission webhook and every reconcile render the
job and check it here (render.check_pods: `template_violations`, `pod_policy_violations`,
`spec_violations`) against the platform's `JobPolicy` (pipelinerl_operator.job_policy: the
chart's `jobPolicy` values, or the safe default) and the install's own Secrets (`Install`).
Each problem names the field at fault (`<role>.podTemplate.spec...`,
`scheduling.priorityClassName`, ...):

- a podTemplate may set only the fields listed here (POD_SPEC_FIELDS, CONTAINER_FIELDS, ...);
  anything else (nodeName, runtimeClassName, schedulerName, hostAliases, dnsConfig, probes
  aimed at another host, ...) is refused;
- bounds: each pod's resources within `maxPodResources` (only the resources listed there), volume
  sizes within `maxVolumeSize`, node labels, tolerations, priority classes, schedulers, CSI
  drivers and image registries from their allowlists;
- references: a Secret or PersistentVolumeClaim only where `secrets` / `volumeClaims` list it
  (`namespace/name`, `*` for either), in every field that can name one, and never the install's
  Secrets, a Helm release Secret, another job's credentials or checkpoints, nor the NATS store;
- environment: no name PipelineRL sets, nor one the GPU runtime reads (a CPU pod must not see
  the node's GPUs), and no `envFrom` that could yield one;
- egress: each `spec.network.egress` rule inside one of the platform's `egress` rules
  (pipelinerl_operator.egress, which also renders it), a job's own NATS servers from `natsServers`;
- capacity: a job's NATS streams within what one job may reserve (pipelinerl.capacity).

The restricted Pod Security Standard and the operator's own pod rules (non-root, no token, ...)
are pod_security's (render.check_pods calls both; the fields it judges pass the allowlists here),
so a problem is told once.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

from pipelinerl import reserved
from pipelinerl.contracts import JOB_SECRET_KEYS, RESERVED_LABEL_PREFIXES, reserved_env
from pipelinerl.k8s_types import parse_quantity, read_quantity
from pipelinerl.reserved import (
    could_yield_device_env,
    is_device_env,
    CREDENTIALS_SUFFIX,
    HELM_RELEASE_PREFIX,
    INSTALL_SECRET_SUFFIXES,
    NOT_ALLOWED,
    SPEC_INSTEAD,
)
from pipelinerl_operator.job_policy import Install, JobPolicy
from pipelinerl_operator.pod_security import APPARMOR_ANNOTATION

GIB = 1 << 30
HOSTNAME_LABEL = "kubernetes.io/hostname"  # on every node: spreading over it chooses none

# ---------------------------------------------------------------- the fields a podTemplate may set

POD_META_FIELDS = frozenset({"labels", "annotations"})
# Pod fields a job may set. Those pod_security judges (host namespaces, the ServiceAccount and its
# token, securityContext, ephemeral containers) pass here so that each problem is told once.
POD_SPEC_FIELDS = frozenset(
    {
        "containers",
        "initContainers",
        "volumes",
        "nodeSelector",
        "affinity",
        "tolerations",
        "topologySpreadConstraints",
        "imagePullSecrets",
        "enableServiceLinks",
        "hostUsers",
        # judged by pod_security:
        "securityContext",
        "serviceAccountName",
        "serviceAccount",
        "automountServiceAccountToken",
        "hostNetwork",
        "hostPID",
        "hostIPC",
        "ephemeralContainers",
    }
)
CONTAINER_FIELDS = frozenset(
    {
        "name",
        "image",
        "imagePullPolicy",
        "command",
        "args",
        "workingDir",
        "env",
        "envFrom",
        "ports",
        "resources",
        "volumeMounts",
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
        "lifecycle",
        "securityContext",
        "terminationMessagePath",
        "terminationMessagePolicy",
    }
)
INIT_CONTAINER_FIELDS = CONTAINER_FIELDS | {"restartPolicy"}  # restartPolicy: Always makes a sidecar
POD_SECURITY_FIELDS = frozenset(
    {
        "runAsUser",
        "runAsGroup",
        "runAsNonRoot",
        "fsGroup",
        "fsGroupChangePolicy",
        "supplementalGroups",
        "seccompProfile",
        "seLinuxOptions",
        "appArmorProfile",
        "sysctls",
        "windowsOptions",  # pod_security refuses host processes with its reason
    }
)
CONTAINER_SECURITY_FIELDS = frozenset(
    {
        "allowPrivilegeEscalation",
        "readOnlyRootFilesystem",
        "capabilities",
        "privileged",
        "procMount",
        "runAsUser",
        "runAsGroup",
        "runAsNonRoot",
        "seccompProfile",
        "seLinuxOptions",
        "appArmorProfile",
        "windowsOptions",
    }
)
EPHEMERAL_CLAIM_FIELDS = frozenset({"accessModes", "resources", "storageClassName", "volumeMode"})
ENV_SOURCES = frozenset({"secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef"})
DEVICE_ENV_WHY = reserved.DEVICE_ENV_WHY
FORBIDDEN_ENV = reserved_env()
# The job's credentials reach its service containers under these names, set by the operator
# alone (FORBIDDEN_ENV refuses them to a user): the one reference to a credentials Secret allowed.
OPERATORS_SECRET_ENV = frozenset(JOB_SECRET_KEYS.values())
# Annotations the kubelet or a scheduler acts on: the job's spec sets these, one way only.
RESERVED_ANNOTATION_PREFIXES = (
    *RESERVED_LABEL_PREFIXES,
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)

CHECKPOINT_CLAIM = re.compile(reserved.CHECKPOINT_CLAIM)
NATS_CLAIM = re.compile(reserved.NATS_CLAIM)


# ---------------------------------------------------------------- helpers


def _listed(entries: list[str], namespace: str, name: str) -> bool:
    for entry in entries:
        ns, n = entry.split("/")
        if ns in ("*", namespace) and n in ("*", name):
            return True
    return False


def repository(image: str) -> str:
    """An image reference's repository, registry host first (docker.io for Docker Hub's)."""
    name = image.split("@", 1)[0]
    if name.rfind(":") > name.rfind("/"):
        name = name[: name.rfind(":")]
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def image_allowed(image: str, prefixes: list[str]) -> bool:
    repo = repository(image)
    return any(repo == p.rstrip("/") or repo.startswith(p.rstrip("/") + "/") for p in prefixes)


def _quantity(value: Any, at: str, bad: Problems) -> Decimal | None:
    """The number Kubernetes reads (spaces trimmed, JSON numbers, a sign), so that no spelling the
    kubelet reads slips past a bound; one it could not read is refused here, never skipped."""
    try:
        return read_quantity(value)
    except ValueError as err:
        bad(at, str(err))
        return None


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# ---------------------------------------------------------------- the checks


class Problems:
    """Problems of one job, each 'field: why' (fields as under the job's `spec.`)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def __call__(self, field: str, why: str) -> None:
        self.items.append(f"{field}: {why}")


def allowed_fields(given: dict[str, Any], allowed: frozenset[str], where: str, bad: Problems) -> None:
    for key in given:
        if key in SPEC_INSTEAD and where.endswith("podTemplate.spec"):
            bad(f"{where}.{key}", f"not set in a podTemplate: {SPEC_INSTEAD[key]}")
        elif key not in allowed:
            bad(f"{where}.{key}", f"{NOT_ALLOWED} (allowed: {', '.join(sorted(allowed))})")


def template_violations(role: str, template: Any, policy: JobPolicy, bad: Problems) -> None:
    """The fields the user's podTemplate sets, against the allowlists (its values are checked on
    the pod as rendered)."""
    if not isinstance(template, dict):
        return  # the schema check names it
    where = f"{role}.podTemplate"
    allowed_fields(template, frozenset({"metadata", "spec"}), where, bad)
    meta = as_dict(template.get("metadata"))
    allowed_fields(meta, POD_META_FIELDS, f"{where}.metadata", bad)
    for kind in ("labels", "annotations"):
        reserved = RESERVED_LABEL_PREFIXES if kind == "labels" else RESERVED_ANNOTATION_PREFIXES
        for key, value in as_dict(meta.get(kind)).items():
            if key.startswith(reserved):
                bad(f"{where}.metadata.{kind}[{key}]", "reserved: PipelineRL and the job's spec set these")
            elif not policy.pod_metadata_allowed(key):
                listed = ", ".join(policy.pod_metadata_prefixes) or "none"
                bad(
                    f"{where}.metadata.{kind}[{key}]",
                    f"a prefix the platform does not let jobs set on pods (jobPolicy.podMetadataPrefixes: {listed})",
                )
            elif (
                kind == "annotations"
                and key.startswith(APPARMOR_ANNOTATION)
                and isinstance(value, str)
                and value.startswith("localhost/")
                and value.removeprefix("localhost/") not in policy.localhost_profiles
            ):
                bad(f"{where}.metadata.{kind}[{key}]", _node_profile_refused(policy))
    spec = as_dict(template.get("spec"))
    allowed_fields(spec, POD_SPEC_FIELDS, f"{where}.spec", bad)
    allowed_fields(as_dict(spec.get("securityContext")), POD_SECURITY_FIELDS, f"{where}.spec.securityContext", bad)
    for kind, fields in (("containers", CONTAINER_FIELDS), ("initContainers", INIT_CONTAINER_FIELDS)):
        for c in as_list(spec.get(kind)):
            if not isinstance(c, dict):
                continue
            at = f"{where}.spec.{kind}[{c.get('name', '?')}]"
            allowed_fields(c, fields, at, bad)
            allowed_fields(as_dict(c.get("securityContext")), CONTAINER_SECURITY_FIELDS, f"{at}.securityContext", bad)
            _env(c, at, bad)
            if kind == "initContainers" and c.get("restartPolicy") not in (None, "Always"):
                bad(f"{at}.restartPolicy", "only Always (a sidecar)")
    for volume in as_list(spec.get("volumes")):
        empty = as_dict(as_dict(volume).get("emptyDir"))
        if "emptyDir" in as_dict(volume) and empty.get("medium") != "Memory" and "sizeLimit" not in empty:
            bad(
                f"{where}.spec.volumes[{volume.get('name', '?')}].emptyDir.sizeLimit",
                "required (up to jobPolicy.maxVolumeSize): a disk emptyDir without one fills the node's disk "
                "unbounded, its neighbours' pods evicted with it (one in memory counts against the pod's memory)",
            )
        if isinstance(volume, dict) and "ephemeral" in volume:
            template = as_dict(as_dict(volume["ephemeral"]).get("volumeClaimTemplate"))
            at = f"{where}.spec.volumes[{volume.get('name', '?')}].ephemeral.volumeClaimTemplate"
            allowed_fields(template, frozenset({"metadata", "spec"}), at, bad)
            # Labels only: provisioners and the scheduler act on a claim's annotations
            # (volume.kubernetes.io/selected-node binds it, and the pod, to any node by name).
            allowed_fields(as_dict(template.get("metadata")), frozenset({"labels"}), f"{at}.metadata", bad)
            allowed_fields(as_dict(template.get("spec")), EPHEMERAL_CLAIM_FIELDS, f"{at}.spec", bad)


def pod_policy_violations(
    role: str,
    pod: dict[str, Any],
    policy: JobPolicy,
    namespace: str,
    own_config: str,
    default_images: tuple[str, ...],
    install: Install,
    bad: Problems,
) -> None:
    """The rendered pod (the podTemplate merged in) within the policy's bounds and references."""
    spec = as_dict(pod.get("spec"))
    where = f"{role}.podTemplate.spec"
    if spec.get("hostUsers") not in (None, False):
        bad(f"{where}.hostUsers", "may only be false (a user namespace)")
    _placement(spec, where, policy, bad)
    containers = [
        (kind, c) for kind in ("initContainers", "containers") for c in as_list(spec.get(kind)) if isinstance(c, dict)
    ]
    for kind, c in containers:
        at = f"{where}.{kind}[{c.get('name', '?')}]"
        image = c.get("image")
        if isinstance(image, str) and image not in default_images and not image_allowed(image, policy.images):
            bad(
                f"{at}.image" if c.get("name") != role else f"{role}.image",
                f"{repository(image)} is not in an allowed registry (jobPolicy.images: {', '.join(policy.images)})",
            )
        if image not in default_images and c.get("imagePullPolicy") not in (None, "Always"):
            bad(
                f"{at}.imagePullPolicy",
                "only Always for an image of the job's own: a copy cached on the node may be another tenant's, "
                "pulled with their credentials (Always makes the registry check this job's)",
            )
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            _handler_host(as_dict(c.get(probe)), f"{at}.{probe}", bad)
        for hook in ("postStart", "preStop"):
            _handler_host(as_dict(as_dict(c.get("lifecycle")).get(hook)), f"{at}.lifecycle.{hook}", bad)
        for mount in as_list(c.get("volumeMounts")):
            if not isinstance(mount, dict):
                continue
            if mount.get("mountPropagation") not in (None, "None"):
                bad(f"{at}.volumeMounts[{mount.get('name', '?')}].mountPropagation", "only None")
            if _gpu_device_list(mount.get("mountPath")):
                bad(
                    f"{at}.volumeMounts[{mount.get('name', '?')}].mountPath",
                    f"not under {GPU_DEVICE_LIST}: NVIDIA's container runtime may read mounts there as the GPUs "
                    "to give the container (every GPU of the node, whatever it was granted)",
                )
        for port in as_list(c.get("ports")):
            if isinstance(port, dict) and port.get("hostIP"):
                bad(f"{at}.ports[{port.get('name', port.get('containerPort'))}].hostIP", "not allowed")
    contexts = [(f"{where}.securityContext", as_dict(spec.get("securityContext")))]
    contexts += [
        (f"{where}.{kind}[{c.get('name', '?')}].securityContext", as_dict(c.get("securityContext")))
        for kind, c in containers
    ]
    for at, sc in contexts:
        for kind in ("seccompProfile", "appArmorProfile"):
            profile = as_dict(sc.get(kind))
            if profile.get("type") == "Localhost" and profile.get("localhostProfile") not in policy.localhost_profiles:
                bad(f"{at}.{kind}.localhostProfile", _node_profile_refused(policy))
    _resources(containers, role, policy, bad)
    _volumes(spec, where, policy, bad)
    for path, name in references("Secret", spec, where):
        check_reference("Secret", path, name, namespace, policy.secrets, "secrets", install, bad)
    for path, name in claim_references(spec, where):
        check_reference(
            "PersistentVolumeClaim", path, name, namespace, policy.volume_claims, "volumeClaims", install, bad
        )
    for path, name in references("ConfigMap", spec, where):
        if name != own_config:  # the job's own manifest, which the operator mounts
            check_reference("ConfigMap", path, name, namespace, policy.config_maps, "configMaps", install, bad)


def _node_profile_refused(policy: JobPolicy) -> str:
    listed = ", ".join(policy.localhost_profiles) or "none"
    return (
        f"not a node profile jobs may use (jobPolicy.localhostProfiles: {listed}): one may allow more than "
        "RuntimeDefault"
    )


# Where NVIDIA's container toolkit reads a container's GPUs from mounts' paths where the node sets
# accept-nvidia-visible-devices-as-volume-mounts (its hardened setting: "/all" there is every GPU).
GPU_DEVICE_LIST = "/var/run/nvidia-container-devices"


def _gpu_device_list(path: object) -> bool:
    """A mount path at or under GPU_DEVICE_LIST (or /run's, which /var/run names), however spelt."""
    if not isinstance(path, str):
        return False
    normal = posixpath.normpath("/" + path.strip().lstrip("/")).removeprefix("/var")
    return normal == "/run/nvidia-container-devices" or normal.startswith("/run/nvidia-container-devices/")


def _handler_host(handler: dict[str, Any], at: str, bad: Problems) -> None:
    for kind in ("httpGet", "tcpSocket"):
        if as_dict(handler.get(kind)).get("host"):
            bad(f"{at}.{kind}.host", "the kubelet would call another host from the node: not allowed")


def _env(c: dict[str, Any], at: str, bad: Problems) -> None:
    for var in as_list(c.get("env")):
        if not isinstance(var, dict):
            continue
        name = var.get("name")
        if is_device_env(name):
            bad(f"{at}.env[{name}]", DEVICE_ENV_WHY)
        elif name in FORBIDDEN_ENV:
            bad(f"{at}.env[{name}]", "reserved (set by PipelineRL itself)")
        source = as_dict(var.get("valueFrom"))
        for key in source:
            if key not in ENV_SOURCES:
                bad(f"{at}.env[{name}].valueFrom.{key}", f"not allowed (allowed: {', '.join(sorted(ENV_SOURCES))})")
    for j, source in enumerate(as_list(c.get("envFrom"))):
        prefix = as_dict(source).get("prefix") or ""
        clash = sorted(n for n in FORBIDDEN_ENV if n.startswith(prefix))
        if could_yield_device_env(prefix):
            clash.insert(0, "a GPU runtime's variable")
        if clash:
            bad(
                f"{at}.envFrom[{j}].prefix",
                (f"{prefix!r} could yield {clash[0]}" if prefix else "needed")
                + ": a prefix no reserved name starts with (e.g. APP_), so no key of it can set a variable "
                "PipelineRL or the GPU runtime reads",
            )


def _placement(spec: dict[str, Any], where: str, policy: JobPolicy, bad: Problems) -> None:
    for key, value in as_dict(spec.get("nodeSelector")).items():
        _node_label(key, [value], f"{where}.nodeSelector[{key}]", policy, bad)
    node = as_dict(as_dict(spec.get("affinity")).get("nodeAffinity"))
    terms = [
        (f"requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]", t)
        for i, t in enumerate(
            as_list(as_dict(node.get("requiredDuringSchedulingIgnoredDuringExecution")).get("nodeSelectorTerms"))
        )
    ] + [
        (f"preferredDuringSchedulingIgnoredDuringExecution[{i}].preference", as_dict(t).get("preference"))
        for i, t in enumerate(as_list(node.get("preferredDuringSchedulingIgnoredDuringExecution")))
    ]
    for path, term in terms:
        term = as_dict(term)
        at = f"{where}.affinity.nodeAffinity.{path}"
        if term.get("matchFields"):
            bad(f"{at}.matchFields", "choosing nodes by name is not allowed (use allowed node labels)")
        for j, expr in enumerate(as_list(term.get("matchExpressions"))):
            expr = as_dict(expr)
            _node_label(
                expr.get("key"),
                as_list(expr.get("values")),
                f"{at}.matchExpressions[{j}]",
                policy,
                bad,
                expr.get("operator"),
            )
    for kind in ("podAffinity", "podAntiAffinity"):
        pods = as_dict(as_dict(spec.get("affinity")).get(kind))
        terms = as_list(pods.get("requiredDuringSchedulingIgnoredDuringExecution")) + [
            as_dict(t).get("podAffinityTerm")
            for t in as_list(pods.get("preferredDuringSchedulingIgnoredDuringExecution"))
        ]
        for i, term in enumerate(terms):
            for field in ("namespaces", "namespaceSelector"):
                if field in as_dict(term):
                    bad(f"{where}.affinity.{kind}.{field}", "pods of other namespaces are not a job's to follow")
            _topology_key(as_dict(term).get("topologyKey"), f"{where}.affinity.{kind}[{i}].topologyKey", policy, bad)
    for i, constraint in enumerate(as_list(spec.get("topologySpreadConstraints"))):
        at = f"{where}.topologySpreadConstraints[{i}].topologyKey"
        _topology_key(as_dict(constraint).get("topologyKey"), at, policy, bad)
    for i, toleration in enumerate(as_list(spec.get("tolerations"))):
        t = as_dict(toleration)
        allowed = any(
            t.get("key") == rule.key and (rule.effect is None or t.get("effect") == rule.effect)
            for rule in policy.tolerations
        )
        if not allowed:
            taints = ", ".join(f"{r.key}{':' + r.effect if r.effect else ''}" for r in policy.tolerations) or "none"
            bad(
                f"{where}.tolerations[{i}]",
                f"not a taint jobs may tolerate (jobPolicy.tolerations: {taints}; a key is required)",
            )


def _topology_key(key: Any, at: str, policy: JobPolicy, bad: Problems) -> None:
    """A topology key chooses nodes too: only nodes carrying the label take the pod (a spread
    constraint over `node-role.kubernetes.io/control-plane` lands on control-plane nodes), so it
    must be a label jobs may select on, or the hostname every node has."""
    if key is not None and key != HOSTNAME_LABEL and key not in policy.node_labels:
        listed = ", ".join([HOSTNAME_LABEL, *sorted(policy.node_labels)])
        bad(at, f"{key!r}: a topology key only nodes with that label satisfy; one of: {listed}")


def _node_label(key: Any, values: list[Any], at: str, policy: JobPolicy, bad: Problems, operator: Any = "In") -> None:
    """A node label a job selects on (`operator`: a match expression's) within jobPolicy.nodeLabels.
    A label whose values are listed is selected with In only: NotIn, Exists, DoesNotExist, Gt
    and Lt choose nodes by values outside the list."""
    allowed = policy.node_labels.get(key) if isinstance(key, str) else None
    if allowed is None:
        listed = ", ".join(sorted(policy.node_labels)) or "none"
        bad(at, f"node label {key!r} is not one jobs may select on (jobPolicy.nodeLabels: {listed})")
    elif "*" not in allowed:
        if operator != "In":
            bad(
                at,
                f"{key}: only `In` its allowed values, not {operator!r} (jobPolicy.nodeLabels: {', '.join(allowed)})",
            )
        for value in values:
            if value not in allowed:
                bad(at, f"{key}={value} is not an allowed value (jobPolicy.nodeLabels: {', '.join(allowed)})")


def _resources(containers: list[tuple[str, dict[str, Any]]], role: str, policy: JobPolicy, bad: Problems) -> None:
    """Each pod's requests and limits, its containers summed, within the policy's maxima (named as
    the role's resources: the service container's, where sidecars add theirs); and, per container,
    what Kubernetes refuses: a request of a resource it never overcommits (a device plugin's, such
    as nvidia.com/gpu; hugepages) without a limit equal to it."""
    for list_name, c in containers:
        requests, limits = (as_dict(as_dict(c.get("resources")).get(k)) for k in ("requests", "limits"))
        for name, value in requests.items():
            if _overcommitted(name):
                continue
            at = f"{role}.resources.limits.{name}"
            if c.get("name") != role:
                at = f"{role}.podTemplate.spec.{list_name}[{c.get('name', '?')}].resources.limits.{name}"
            try:
                equal = name in limits and read_quantity(value) == read_quantity(limits[name])
            except ValueError:
                continue  # unreadable: the sums below name it
            if not equal:
                bad(at, f"{name} is never overcommitted: its limit must be set, equal to its request ({value})")
    for kind in ("requests", "limits"):
        total: dict[str, Decimal] = {}
        for _, c in containers:
            for name, value in as_dict(as_dict(c.get("resources")).get(kind)).items():
                amount = _quantity(value, f"{role}.resources.{kind}.{name}", bad)
                if amount is not None:
                    total[name] = total.get(name, Decimal(0)) + amount
        for name, amount in sorted(total.items()):
            cap = policy.max_pod_resources.get(name)
            if cap is None:
                allowed = ", ".join(sorted(policy.max_pod_resources)) or "none"
                bad(f"{role}.resources.{kind}.{name}", f"not a resource jobs may ask for (allowed: {allowed})")
            elif amount > parse_quantity(cap):
                bad(
                    f"{role}.resources.{kind}.{name}",
                    f"{amount.normalize():f} per pod (its containers summed) is more than a pod may ask for "
                    f"(jobPolicy.maxPodResources.{name}: {cap})",
                )


def _overcommitted(resource: str) -> bool:
    """Whether Kubernetes lets a request of this resource stay below its limit: its own resources
    (no domain, or a kubernetes.io one), hugepages excepted."""
    return ("/" not in resource or "kubernetes.io/" in resource) and not resource.startswith("hugepages-")


def volume_sizes(spec: dict[str, Any], where: str) -> Iterator[tuple[int, str, str, Any]]:
    """(the volume's index, the field, the resource, its value) of every size a pod's volumes ask
    for: an emptyDir's sizeLimit (storage), an ephemeral claim's requests and limits."""
    for i, volume in enumerate(as_list(spec.get("volumes"))):
        volume = as_dict(volume)
        at = f"{where}.volumes[{volume.get('name', '?')}]"
        empty = as_dict(volume.get("emptyDir"))
        if "sizeLimit" in empty:
            yield i, f"{at}.emptyDir.sizeLimit", "storage", empty["sizeLimit"]
        claim = as_dict(as_dict(as_dict(volume.get("ephemeral")).get("volumeClaimTemplate")).get("spec"))
        for kind, amounts in as_dict(claim.get("resources")).items():
            for name, value in as_dict(amounts).items():
                yield i, f"{at}.ephemeral.volumeClaimTemplate.spec.resources.{kind}.{name}", name, value


def storage_class(name: Any, at: str, policy: JobPolicy, bad: Problems) -> None:
    """A StorageClass a job's volume names: one the platform lists (a class decides the disks'
    cost, speed and where their data lives)."""
    if name not in policy.storage_class_names:
        listed = ", ".join(policy.storage_class_names) or "none: the cluster's default class only"
        bad(at, f"{name!r} is not a storage class jobs may use (jobPolicy.storageClassNames: {listed})")


def _volumes(spec: dict[str, Any], where: str, policy: JobPolicy, bad: Problems) -> None:
    cap = parse_quantity(policy.max_volume_size)
    for _, field, name, value in volume_sizes(spec, where):
        size = _quantity(value, field, bad)
        if name != "storage":
            bad(field, "a volume claim asks for storage only")
        elif size is not None and size > cap:
            bad(field, f"larger than a volume may be (jobPolicy.maxVolumeSize: {policy.max_volume_size})")
    for volume in as_list(spec.get("volumes")):
        volume = as_dict(volume)
        claim = as_dict(as_dict(as_dict(volume.get("ephemeral")).get("volumeClaimTemplate")).get("spec"))
        if claim.get("storageClassName") is not None:
            at = f"{where}.volumes[{volume.get('name', '?')}].ephemeral.volumeClaimTemplate.spec.storageClassName"
            storage_class(claim["storageClassName"], at, policy, bad)
        if "csi" in volume and as_dict(volume["csi"]).get("driver") not in policy.csi_drivers:
            drivers = ", ".join(policy.csi_drivers) or "none"
            at = f"{where}.volumes[{volume.get('name', '?')}]"
            bad(f"{at}.csi.driver", f"not a CSI driver jobs may use inline (jobPolicy.csiDrivers: {drivers})")


# Where a pod names a Secret or a ConfigMap: (volume source, its name field), the env source, the
# envFrom source.
_NAMED_BY = {
    "Secret": (("secret", "secretName"), "secretKeyRef", "secretRef"),
    "ConfigMap": (("configMap", "name"), "configMapKeyRef", "configMapRef"),
}


def references(kind: str, spec: dict[str, Any], where: str) -> Iterator[tuple[str, str]]:
    """(field, name) of every Secret or ConfigMap (`kind`) a pod names: volumes (and projected
    sources; a Secret also as a CSI nodePublishSecretRef and in imagePullSecrets), env, envFrom.
    The operator's own credentials, under the env names only it may set, are not counted."""
    (source, name_field), env_key, env_from_key = _NAMED_BY[kind]
    for volume in as_list(spec.get("volumes")):
        volume = as_dict(volume)
        at = f"{where}.volumes[{volume.get('name', '?')}]"
        if source in volume:
            yield f"{at}.{source}.{name_field}", str(as_dict(volume[source]).get(name_field, ""))
        for j, projected in enumerate(as_list(as_dict(volume.get("projected")).get("sources"))):
            if source in as_dict(projected):
                yield f"{at}.projected.sources[{j}].{source}.name", str(as_dict(projected[source]).get("name", ""))
        ref = as_dict(as_dict(volume.get("csi")).get("nodePublishSecretRef"))
        if ref and kind == "Secret":
            yield f"{at}.csi.nodePublishSecretRef.name", str(ref.get("name", ""))
    for j, ref in enumerate(as_list(spec.get("imagePullSecrets")) if kind == "Secret" else []):
        yield f"{where}.imagePullSecrets[{j}].name", str(as_dict(ref).get("name", ""))
    for containers in ("initContainers", "containers"):
        for c in as_list(spec.get(containers)):
            c = as_dict(c)
            at = f"{where}.{containers}[{c.get('name', '?')}]"
            for var in as_list(c.get("env")):
                ref = as_dict(as_dict(as_dict(var).get("valueFrom")).get(env_key))
                if ref and as_dict(var).get("name") not in OPERATORS_SECRET_ENV:
                    yield f"{at}.env[{as_dict(var).get('name')}].valueFrom.{env_key}.name", str(ref.get("name", ""))
            for j, env_from in enumerate(as_list(c.get("envFrom"))):
                if env_from_key in as_dict(env_from):
                    yield f"{at}.envFrom[{j}].{env_from_key}.name", str(as_dict(env_from[env_from_key]).get("name", ""))


def claim_references(spec: dict[str, Any], where: str) -> Iterator[tuple[str, str]]:
    for volume in as_list(spec.get("volumes")):
        volume = as_dict(volume)
        claim = as_dict(volume.get("persistentVolumeClaim"))
        if claim:
            yield (
                f"{where}.volumes[{volume.get('name', '?')}].persistentVolumeClaim.claimName",
                str(claim.get("claimName", "")),
            )


def never(kind: str, name: str, install: Install) -> str | None:
    """Why no job may ever reference this Secret, ConfigMap or claim, whatever the policy lists;
    None if it may."""
    if kind == "Secret":
        if name.startswith(HELM_RELEASE_PREFIX):
            return reserved.HELM_SECRET_WHY
        if name in install.secrets or name.endswith(INSTALL_SECRET_SUFFIXES):
            return reserved.INSTALL_SECRET_WHY
        if name.endswith(CREDENTIALS_SUFFIX):  # the job's own too: only the operator's env names it
            return reserved.CREDENTIALS_WHY
    elif kind == "ConfigMap":
        if name.startswith(HELM_RELEASE_PREFIX):
            return reserved.HELM_CONFIG_MAP_WHY
        if name.endswith(reserved.INSTALL_CONFIG_MAP_SUFFIXES):
            return reserved.INSTALL_SECRET_WHY
        if name.endswith(reserved.JOB_CONFIG_SUFFIX):
            return reserved.JOB_CONFIG_WHY
    elif CHECKPOINT_CLAIM.match(name):
        return reserved.CHECKPOINT_WHY
    elif NATS_CLAIM.match(name):
        return reserved.NATS_CLAIM_WHY
    return None


def check_reference(
    kind: str,
    path: str,
    name: str,
    namespace: str,
    listed: list[str],
    value: str,
    install: Install,
    bad: Problems,
) -> None:
    why = never(kind, name, install)
    if why:
        bad(path, f"{kind} {name!r} is {why}: {reserved.NEVER}")
    elif not _listed(listed, namespace, name):
        bad(
            path,
            f"{kind} {name!r} is not one jobs in {namespace} may use: the platform lists those in "
            f"jobPolicy.{value} (namespace/name)",
        )
