"""The kubelet's part, played by podman (pure): a rendered pod → the `podman run` command that runs
its container as a kubelet would, and the names the cluster's DNS would give it.

What is carried over: image (through a map of local builds), command/args (an image's own
entrypoint where the container has no command), env with `value` and `valueFrom` (field,
Secret and ConfigMap keys), ConfigMap and Secret volumes as files, emptyDir (tmpfs where
`medium: Memory`) and claim volumes as host folders owned by `fsGroup`, the pod's and the
container's securityContext (user, group, fsGroup, read-only root, dropped capabilities, no
privilege escalation, runAsNonRoot checked), CPU and memory limits, and the hostname and
subdomain a StatefulSet's pod gets. What has no podman equivalent is left out and said so:
NetworkPolicies (every container on the private network reaches every other) and probes (the
runner polls the health endpoints itself).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
CLUSTER_DOMAIN = "cluster.local"


class Unsupported(ValueError):
    """A pod field this stand-in cannot carry over faithfully (refused, never dropped silently)."""


@dataclass(frozen=True)
class Image:
    """A local image that stands in for a rendered one; `entrypoint` replaces the image's own
    where the stand-in's differs (a container without `command` runs the entrypoint)."""

    ref: str
    entrypoint: tuple[str, ...] = ()


# The pod's restartPolicy as podman's (which restarts at once: the kubelet backs off, up to 5 min).
RESTART = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}


@dataclass
class Pod:
    """One pod of a StatefulSet, as its controller makes it."""

    name: str
    namespace: str
    labels: dict[str, str]
    spec: dict[str, Any]
    subdomain: str
    claims: list[str] = field(default_factory=list)  # its volumeClaimTemplates' names


def stateful_set_pods(sts: dict[str, Any]) -> list[Pod]:
    """The pods the StatefulSet controller makes: `<name>-<i>`, with the pod-index and pod-name labels."""
    name, spec = sts["metadata"]["name"], sts["spec"]
    pods = []
    for i in range(spec.get("replicas", 1)):
        pod_name = f"{name}-{i}"
        labels = dict(spec["template"]["metadata"].get("labels", {}))
        labels |= {POD_INDEX_LABEL: str(i), POD_NAME_LABEL: pod_name}
        claims = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])]
        pods.append(
            Pod(pod_name, sts["metadata"]["namespace"], labels, spec["template"]["spec"], spec["serviceName"], claims)
        )
    return pods


def podman_name(pod: Pod, container: str) -> str:
    """The podman container that runs one container of a pod (unique across namespaces)."""
    return f"{pod.namespace}.{pod.name}.{container}"


def dns_names(pod: Pod, services: list[dict[str, Any]]) -> list[str]:
    """The names cluster DNS answers with this pod's address: its own under its subdomain's
    headless Service, and each Service that selects it (with and without the cluster domain)."""
    names = []
    for svc in services:
        meta = svc["metadata"]
        if meta["namespace"] != pod.namespace:
            continue
        selector = svc["spec"].get("selector") or {}
        if not selector or any(pod.labels.get(k) != v for k, v in selector.items()):
            continue
        short = f"{meta['name']}.{pod.namespace}.svc"
        names += [short, f"{short}.{CLUSTER_DOMAIN}"]
        if meta["name"] == pod.subdomain:
            names += [f"{pod.name}.{short}", f"{pod.name}.{short}.{CLUSTER_DOMAIN}"]
    return names


def _field(pod: Pod, path: str) -> str:
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label:
        return pod.labels.get(label.group(1), "")
    known = {"metadata.name": pod.name, "metadata.namespace": pod.namespace}
    if path not in known:
        raise Unsupported(f"fieldRef {path!r}")
    return known[path]


def _object_data(obj: dict[str, Any]) -> dict[str, str]:
    if obj["kind"] == "Secret":
        out = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return out | dict(obj.get("stringData") or {})
    return dict(obj.get("data") or {})


def env_values(pod: Pod, container: dict[str, Any], objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet resolves it; a missing Secret or key fails the
    pod's start, as it does on a cluster (unless `optional`)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            env[var["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
            continue
        kind, ref = next(
            (k, source[key])
            for key, k in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap"))
            if key in source
        )
        data = _object_data(objects.get((kind, ref["name"]), {"kind": kind}))
        if ref["key"] in data:
            env[var["name"]] = data[ref["key"]]
        elif not ref.get("optional"):
            raise Unsupported(f"{pod.name}: env {var['name']}: {kind} {ref['name']!r} has no key {ref['key']!r}")
    return env


def volume_files(pod: Pod, objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The files of each ConfigMap and Secret volume (volume name → file name → text)."""
    out = {}
    for vol in pod.spec.get("volumes", []):
        for key, kind, ref in (("configMap", "ConfigMap", "name"), ("secret", "Secret", "secretName")):
            if key in vol:
                name = vol[key][ref]
                if (kind, name) not in objects:
                    raise Unsupported(f"{pod.name}: volume {vol['name']}: no {kind} {name!r}")
                data = _object_data(objects[(kind, name)])
                items = vol[key].get("items")
                out[vol["name"]] = {i["path"]: data[i["key"]] for i in items} if items else data
    return out


def _security(pod: Pod, container: dict[str, Any]) -> list[str]:
    ctx = dict(pod.spec.get("securityContext") or {}) | dict(container.get("securityContext") or {})
    user, group = ctx.get("runAsUser"), ctx.get("runAsGroup")
    if ctx.get("runAsNonRoot") and (user is None or user == 0):
        raise Unsupported(f"{pod.name}: runAsNonRoot without a non-zero runAsUser (the kubelet refuses to start it)")
    args = []
    if user is not None:
        args += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if (fs_group := ctx.get("fsGroup")) is not None:
        args += ["--group-add", str(fs_group)]
    if ctx.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # a pod gets no tmpfs it did not ask for
    caps = ctx.get("capabilities") or {}
    args += [f"--cap-drop={c}" for c in caps.get("drop", [])] + [f"--cap-add={c}" for c in caps.get("add", [])]
    if ctx.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if ctx.get("privileged"):
        raise Unsupported(f"{pod.name}: privileged")
    return args


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _limits(container: dict[str, Any], host_cores: int) -> list[str]:
    limits = (container.get("resources") or {}).get("limits") or {}
    args = []
    if "cpu" in limits:  # podman refuses more CPUs than the host has; a node would not schedule it
        args += ["--cpus", f"{min(cpu_cores(limits['cpu']), host_cores):g}"]
    if "memory" in limits:
        args += ["--memory", str(limits["memory"]).replace("Gi", "g").replace("Mi", "m")]
    return args


def run_args(
    pod: Pod,
    container_name: str,
    objects: dict[tuple[str, str], dict[str, Any]],
    images: dict[str, Image],
    volume_dirs: dict[str, Path],
    network: str,
    aliases: list[str],
    host_cores: int,
) -> list[str]:
    """`podman run` for one container of `pod`: `volume_dirs` maps each volume that is a folder
    (emptyDir, claim, ConfigMap, Secret) to the host folder the runner made for it."""
    container = next(c for c in pod.spec["containers"] if c["name"] == container_name)
    if container["image"] not in images:
        raise Unsupported(f"{pod.name}: no local image stands in for {container['image']!r}")
    image = images[container["image"]]
    args = ["podman", "run", "--detach", "--name", podman_name(pod, container_name)]
    args += ["--network", network, "--hostname", pod.name, "--pull", "never"]
    args += ["--restart", RESTART[pod.spec.get("restartPolicy", "Always")]]  # one that ends starts again in place
    args += [f"--network-alias={a}" for a in aliases]
    args += _security(pod, container) + _limits(container, host_cores)
    for key, value in env_values(pod, container, objects).items():
        args += ["--env", f"{key}={value}"]
    memory_volumes = {
        v["name"] for v in pod.spec.get("volumes", []) if (v.get("emptyDir") or {}).get("medium") == "Memory"
    }
    for mount in container.get("volumeMounts", []):
        if mount["name"] in memory_volumes:
            args += ["--mount", f"type=tmpfs,destination={mount['mountPath']}"]
            continue
        if mount["name"] not in volume_dirs:
            raise Unsupported(f"{pod.name}: volumeMount {mount['name']!r} names no volume")
        mode = "ro" if mount.get("readOnly") else "rw"
        args += ["--volume", f"{volume_dirs[mount['name']]}:{mount['mountPath']}:{mode}"]
    command = container.get("command") or list(image.entrypoint)
    if command:
        args += ["--entrypoint", command[0]]
    args.append(image.ref)
    return args + list(command[1:]) + [str(a) for a in container.get("args", [])]


def folder_volumes(pod: Pod) -> dict[str, str]:
    """Each volume the runner makes a host folder for, by kind: emptyDir, claim, configMap, secret."""
    kinds = {}
    for vol in pod.spec.get("volumes", []):
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") != "Memory":
                kinds[vol["name"]] = "emptyDir"
        elif "configMap" in vol or "secret" in vol:
            kinds[vol["name"]] = "configMap" if "configMap" in vol else "secret"
        elif "persistentVolumeClaim" in vol or "ephemeral" in vol:
            raise Unsupported(f"{pod.name}: volume {vol['name']}: only emptyDir, ConfigMap, Secret and claim templates")
        else:
            raise Unsupported(f"{pod.name}: volume {vol['name']}: {sorted(vol)}")
    return kinds | {claim: "claim" for claim in pod.claims}
