"""A fuzzer for the job policy: podTemplates drawn from the whole Kubernetes pod schema (the
kubernetes-validate definitions of the oldest Kubernetes the chart supports), not from the
allowlist, with the values hostile authors spell (quantities with spaces or as JSON numbers,
node-choosing keys, prefixed labels, GPU-runtime variables, other tenants' Secrets...). Every
job the operator would apply (render and its checks admit it) is held to the invariant on the
rendered pods, by an oracle written apart from the checks: nothing the platform's policy does not
allow reaches a pod, whatever the spelling. Seeded: the same draw every run.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from pipelinerl.spec import SpecError, parse_job
from pipelinerl_operator.admission import KUBE_VERSION
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.job_policy import JobPolicy, parse_policy
from pipelinerl_operator.render import RenderError, render

EXAMPLES = 800  # per policy: a fixed draw (seeded), not what a time budget allows on the day

LISTS = {
    "images": ["ghcr.io/pipelinerl", "docker.io/me"],
    "nodeLabels": {"pool": ["gpu"]},
    "tolerations": [{"key": "nvidia.com/gpu"}],
    "podMetadataPrefixes": ["example.com"],
    "localhostProfiles": ["profiles/vetted.json"],
    "storageClassNames": ["fast"],
}
POLICIES = {  # references listed by name; or every name listed, where only the never-rules stand
    "listed": parse_policy(
        LISTS | {"secrets": ["team-a/hf-token"], "configMaps": ["team-a/settings"], "volumeClaims": ["team-a/models"]}
    ),
    "wide": parse_policy(LISTS | {"secrets": ["*/*"], "configMaps": ["*/*"], "volumeClaims": ["*/*"]}),
}

# ------------------------------------------------------------------ what hostile authors write

STRINGS = {
    "key": ["pool", "kubernetes.io/hostname", "node-role.kubernetes.io/control-plane", "example.com/x",
            "k8s.v1.cni.cncf.io/networks", "sidecar.istio.io/inject", "NVIDIA_VISIBLE_DEVICES", "team", ""],
    "image": ["ghcr.io/pipelinerl/tools:1", "docker.io/me/tool:2", "docker.io/me/tool:3", "ghcr.io/pipelinerl/x:2",
              "evil.example.com/miner:1", "ghcr.io/pipelinerl-evil/x:1"],
    "name": ["hf-token", "settings", "models", "hf-token", "settings", "models", "NVIDIA_MOFED", "NVIDIA_GDS",
             "other-pipelinerl-credentials", "sh.helm.release.v1.rl.v1",
             "rl-pipelinerl-auth", "team-b-data", "run-other-prl-trainer-0", "other-pipelinerl-config",
             "data-rl-pipelinerl-nats-0", "generator", "trainer", "side", "fast", "premium"],
    "cidr": ["10.0.0.0/8", "64:ff9b::a00:0/104", "0.0.0.0/0", "::ffff:169.254.169.254/128"],
    "path": ["/", "/var/run/docker.sock", "/models", "profiles/vetted.json", "profiles/open.json"],
    "other": ["true", "false", "Always", "IfNotPresent", "Never", "Localhost", "RuntimeDefault", "Unconfined",
              "Exists", "In", "NoSchedule", "0", "control-plane-1", "spc_t", "ALL", "SYS_ADMIN", "NET_BIND_SERVICE"],
}  # fmt: skip
# Fields a policy bounds, drawn more often than the rest of the schema's.
FOCUS = {
    "resources", "limits", "requests", "env", "volumes", "volumeMounts", "securityContext", "nodeSelector",
    "tolerations", "topologySpreadConstraints", "affinity", "nodeAffinity", "podAffinity", "emptyDir",
    "ephemeral", "sizeLimit", "image", "imagePullPolicy", "seccompProfile", "capabilities", "runAsUser",
    "runAsGroup", "fsGroup", "secret", "configMap", "persistentVolumeClaim", "envFrom", "valueFrom",
}  # fmt: skip
QUANTITIES = [" 32", "4096.5", 4096.5, "10Ti", " 10Ti ", "1e3", "-1", "500m", 7, 1e16, "4 cores", "2Pi", "+64Gi"]
INTEGERS = [0, 1, 999, 1000, 20000, 65535, 10**9]


class Draw:
    """Random values of a schema, from the kubernetes-validate definitions."""

    def __init__(self, rng: random.Random):
        from kubernetes_validate import utils

        version = [v for v in utils.all_versions() if utils.major_minor(v) <= KUBE_VERSION][-1]
        folder = f"kubernetes-json-schema/v{version}-local-strict"
        self.defs = utils.schema_contents(f"{folder}/_definitions.json", version)["$defs"]
        self.rng = rng

    def value(self, schema: dict[str, Any], field: str, depth: int) -> Any:
        rng = self.rng
        ref = schema.get("$ref")
        if ref:
            name = ref.rsplit("/", 1)[-1]
            if name.endswith("resource.Quantity"):
                return rng.choice(QUANTITIES)
            if name.endswith("IntOrString"):
                return rng.choice([80, 443, "http"])
            return self.value(self.defs[name], field, depth)
        kinds = schema.get("type") or ["object"]
        kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if k != "null"]
        kind = kinds[0] if kinds else "object"
        if kind == "object" and "properties" in schema:
            return self.object(schema, depth)
        if kind == "object":  # a map: labels, nodeSelector, resources...
            inner = schema.get("additionalProperties") or {"type": "string"}
            resources = ["cpu", "memory", "cpu", "memory", "nvidia.com/gpu", "hugepages-1Gi", "ephemeral-storage"]
            keys = resources if field in ("limits", "requests", "overhead") else STRINGS["key"]
            return {rng.choice(keys): self.value(inner, field, depth + 1) for _ in range(rng.randint(1, 2))}
        if kind == "array":
            return [self.value(schema.get("items") or {}, field, depth + 1) for _ in range(rng.randint(1, 2))]
        if kind == "integer":
            return rng.choice(INTEGERS)
        if kind == "number":
            return rng.choice([0.0, 1000.0, 0.5])
        if kind == "boolean":
            return rng.random() < 0.5
        lowered = field.lower()
        if lowered in ("localhostprofile", "type"):
            return rng.choice(STRINGS["path"] if lowered == "localhostprofile" else ["Localhost", "RuntimeDefault"])
        pool = next((STRINGS[k] for k in ("image", "cidr", "path", "key", "name") if k in lowered), None) or rng.choice(
            list(STRINGS.values())
        )
        return rng.choice(pool)

    def object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """Some of its fields: any of the schema's, with those a policy bounds drawn more often
        (so that enough drawn pods pass the allowlist for the oracle to judge)."""
        props = schema["properties"]
        required = list(schema.get("required") or [])
        count = 0 if depth > 5 else self.rng.choice([0, 1, 1, 2, 3])
        names = sorted(props)
        focus = [n for n in names if n in FOCUS]
        chosen = required + [
            self.rng.choice(focus if focus and self.rng.random() < 0.6 else names) for _ in range(count)
        ]
        return {k: self.value(props[k], k, depth + 1) for k in dict.fromkeys(chosen)}

    def template(self, role: str) -> dict[str, Any]:
        """A pod template an author could write: the service container and maybe a sidecar, then
        one to three fields of the whole schema set anywhere on it (the pod, a container, the
        pod's labels and annotations), each a drawn value."""
        rng = self.rng
        containers: list[dict[str, Any]] = [{"name": role}]
        if rng.random() < 0.5:
            containers.append({"name": "side", "image": rng.choice(STRINGS["image"])})
        spec: dict[str, Any] = {"containers": containers}
        template: dict[str, Any] = {"spec": spec}
        pod_schema, container_schema = (self.defs[f"io.k8s.api.core.v1.{k}"] for k in ("PodSpec", "Container"))
        for _ in range(rng.randint(1, 3)):
            where = rng.random()
            if where < 0.45:
                target, schema = rng.choice(containers), container_schema
            elif where < 0.9:
                target, schema = spec, pod_schema
            else:
                meta = template.setdefault("metadata", {})
                keys = STRINGS["key"] + ["container.apparmor.security.beta.kubernetes.io/side"]
                meta.setdefault(rng.choice(["labels", "annotations"]), {})[rng.choice(keys)] = "x"
                continue
            names = sorted(schema["properties"])
            focus = [n for n in names if n in FOCUS]
            field = rng.choice(focus if rng.random() < 0.6 else names)
            if field not in ("name", "containers"):
                target[field] = self.value(schema["properties"][field], field, 2)
        if rng.random() < 0.1:  # a claim's storage class: deeper than the drawn fields reach
            claim = {"storageClassName": rng.choice(STRINGS["name"]), "resources": {"requests": {"storage": "1Gi"}}}
            volume = {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}
            spec["volumes"] = [v for v in spec.get("volumes") or [] if isinstance(v, dict)] + [volume]
        return template


# ------------------------------------------------------------------ the oracle, apart from the checks

_UNITS = {"": 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_UNITS |= {f"{p}i": 1024.0**n for n, p in enumerate("KMGTPE", start=1)}


def kube_number(value: Any) -> float:
    """What the kubelet reads (Quantity.UnmarshalJSON, re-derived): raises where it could not."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|([KMGTPE]i|[numkMGTPE])?)", str(value).strip())
    if not match:
        raise ValueError(value)
    return float(match.group(1) + (match.group(2) or "")) * _UNITS.get(match.group(3) or "", 1)


OPERATOR_SCRATCH = {"cache", "tmp", "run"}  # the operator's own disk emptyDirs (pod_template.py)
OPERATOR_KEY_PREFIXES = ("app.kubernetes.io", "pipelinerl.dev", "kueue.x-k8s.io", "scheduling.x-k8s.io")
VOLUME_KINDS = {"emptyDir", "configMap", "secret", "projected", "persistentVolumeClaim", "ephemeral", "downwardAPI"}


def leaks(pod: dict[str, Any], policy: JobPolicy, defaults: tuple[str, ...], own_config: str) -> list[str]:
    """What on the pod the policy does not allow."""
    spec, out = pod["spec"], []
    for flag in ("hostNetwork", "hostPID", "hostIPC", "hostUsers", "shareProcessNamespace"):
        if spec.get(flag):
            out.append(flag)
    for field in ("nodeName", "runtimeClassName", "hostAliases", "dnsConfig", "overhead", "resourceClaims"):
        if field in spec:
            out.append(field)
    for kind, meta in (pod.get("metadata") or {}).items():
        for key in meta if kind in ("labels", "annotations") else ():
            prefix = key.rpartition("/")[0]
            if prefix and prefix not in policy.pod_metadata_prefixes and not prefix.endswith(OPERATOR_KEY_PREFIXES):
                out.append(f"{kind}[{key}]")
    for key in spec.get("nodeSelector") or {}:
        if key not in policy.node_labels:
            out.append(f"nodeSelector[{key}]")
    for c in spec.get("topologySpreadConstraints") or []:
        if c.get("topologyKey") not in {*policy.node_labels, "kubernetes.io/hostname"}:
            out.append("topologyKey")
    for t in spec.get("tolerations") or []:
        if t.get("key") not in {r.key for r in policy.tolerations}:
            out.append("toleration")
    caps = {k: kube_number(v) for k, v in policy.max_pod_resources.items()}
    for kind in ("requests", "limits"):
        totals: dict[str, float] = {}
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for name, value in ((c.get("resources") or {}).get(kind) or {}).items():
                try:
                    totals[name] = totals.get(name, 0.0) + kube_number(value)
                except ValueError:
                    out.append(f"unreadable {kind}.{name}: {value!r}")
        out += [f"{kind}.{n}={v}" for n, v in totals.items() if n not in caps or v > caps[n]]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        sc = c.get("securityContext") or {}
        if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: privileges")
        if set((sc.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: capabilities")
        for field in ("runAsUser", "runAsGroup"):
            if field in sc and not (isinstance(sc[field], (int, float)) and sc[field] >= 1000):
                out.append(f"{c['name']}: {field}")
        if c.get("image") not in defaults:
            if not str(c.get("image")).startswith(tuple(p + "/" for p in policy.images)):
                out.append(f"{c['name']}: image")
            if c.get("imagePullPolicy") != "Always":
                out.append(f"{c['name']}: pull policy")
        for var in c.get("env") or []:
            if var == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}:
                continue  # the operator's own, on a container with no GPU asked for: none seen
            if str(var.get("name")).startswith("NVIDIA_") or var.get("name") == "CUDA_VISIBLE_DEVICES":
                out.append(f"{c['name']}: {var.get('name')}")
        if c.get("volumeDevices"):
            out.append("volumeDevices")
    psc = spec.get("securityContext") or {}
    for sc in [psc] + [c.get("securityContext") or {} for c in spec["containers"]]:
        profile = sc.get("seccompProfile") or {}
        if profile and profile.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append("seccomp")
        if profile.get("type") == "Localhost" and profile.get("localhostProfile") not in policy.localhost_profiles:
            out.append("seccomp profile")
    for field in ("runAsUser", "runAsGroup", "fsGroup"):
        if field in psc and not (isinstance(psc[field], (int, float)) and psc[field] >= 1000):
            out.append(field)
    volume_cap = kube_number(policy.max_volume_size)
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if kinds - VOLUME_KINDS:
            out.append(f"volume {kinds}")
        claim = ((v.get("ephemeral") or {}).get("volumeClaimTemplate") or {}).get("spec") or {}
        if "storageClassName" in claim and claim["storageClassName"] not in policy.storage_class_names:
            out.append(f"storage class {claim['storageClassName']!r}")
        size = (v.get("emptyDir") or {}).get("sizeLimit")
        disk = "emptyDir" in v and (v["emptyDir"] or {}).get("medium") != "Memory"
        if disk and size is None and v.get("name") not in OPERATOR_SCRATCH:
            out.append("emptyDir unbounded")
        try:
            if size is not None and kube_number(size) > volume_cap:
                out.append("emptyDir size")
        except ValueError:
            out.append(f"unreadable sizeLimit: {size!r}")
    for kind, name in references(spec):
        if name != own_config and re.search(NEVER[kind], name):
            out.append(f"a reference to {kind} {name}")
    return out


# What no job may name, by kind, whatever the policy lists: re-derived from docs/kubernetes.md.
NEVER = {
    "Secret": r"-pipelinerl-credentials$|^sh\.helm\.release\."
    r"|-pipelinerl-(auth|nats-accounts|nats-routes|operator-webhook)$",
    "ConfigMap": r"^sh\.helm\.release\.|-pipelinerl-config$|-pipelinerl-nats$",
    "claim": r"^run-.+-trainer-[0-9]+$|^data-.+-pipelinerl-nats-[0-9]+$",
}
REFERRING = {
    "secret": "Secret", "secretKeyRef": "Secret", "secretRef": "Secret", "configMap": "ConfigMap",
    "configMapKeyRef": "ConfigMap", "configMapRef": "ConfigMap", "persistentVolumeClaim": "claim",
}  # fmt: skip


def references(node: Any, parent: str = "") -> list[tuple[str, str]]:
    """Every (kind, name) of a Secret, ConfigMap or claim anywhere in a pod spec (the operator's
    own credentials, under its PIPELINERL_ variables, left out)."""
    if isinstance(node, list):
        return [n for item in node for n in references(item, parent)]
    if not isinstance(node, dict) or str(node.get("name", "")).startswith("PIPELINERL_"):
        return []
    found = [(REFERRING[parent], str(node["name"])) for _ in [0] if parent in REFERRING and "name" in node]
    found += [("Secret", str(node["secretName"]))] if "secretName" in node else []
    found += [("claim", str(node["claimName"]))] if "claimName" in node else []
    return found + [n for k, v in node.items() for n in references(v, k)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_drawn_pod_template_gets_past_the_policy(policy: str) -> None:
    rng = random.Random(55)
    draw = Draw(rng)
    cfg = OperatorConfig(auth_key="install-key", policy=POLICIES[policy])
    admitted, refused = 0, 0
    for i in range(EXAMPLES):
        role = rng.choice(["generator", "preprocessor", "trainer"])
        template = draw.template(role)
        manifest = {"metadata": {"name": "demo", "namespace": "team-a"}, "spec": {role: {"podTemplate": template}}}
        try:
            objects = render(parse_job(manifest), "team-a", "uid-1", cfg)
        except (SpecError, RenderError):
            refused += 1
            continue
        admitted += 1
        for sts in (o for o in objects if o["kind"] == "StatefulSet"):
            found = leaks(sts["spec"]["template"], cfg.policy, (cfg.cpu_image, cfg.gpu_image), "demo-pipelinerl-config")
            assert not found, f"example {i}: {found} reached a pod from {template}"
    # Not vacuous: many drawn, and some admitted (the oracle judged real pods).
    assert admitted + refused == EXAMPLES and admitted >= 100, (admitted, refused)


@pytest.mark.parametrize(
    "value, number",
    [(" 32", 32), (4096.5, 4096.5), ("1e3", 1000), ("500m", 0.5), ("+2Ki", 2048), ("-1", -1), (" 10Ti ", 10 * 2**40)],
)
def test_the_oracle_reads_quantities_as_kubernetes_does(value: Any, number: float) -> None:
    assert kube_number(value) == number
    with pytest.raises(ValueError):
        kube_number("4 cores")


def wrong_type(value: Any) -> Any:
    """A value no field that holds `value` takes: an object for a list, a list for anything else."""
    return {"x": [1]} if isinstance(value, list) else [["x"]]


def test_a_value_of_the_wrong_type_anywhere_in_a_template_is_refused_by_name() -> None:
    """Every door reads a podTemplate before the API server does: a list where a name goes, a
    string where an object goes... is refused naming the podTemplate's field, never crashes a
    check that reads it (a traceback at `validate`, a 500 at the webhook)."""
    from pipelinerl_operator.admission import check

    rng = random.Random(56)
    draw = Draw(rng)
    cfg = OperatorConfig(auth_key="install-key", policy=POLICIES["wide"])
    for _ in range(EXAMPLES // 4):
        role = rng.choice(["generator", "preprocessor", "trainer"])
        template = draw.template(role)
        nodes: list[tuple[Any, Any]] = []  # (container, key) of every value in the template
        stack: list[Any] = [template]
        while stack:
            node = stack.pop()
            for key, value in node.items() if isinstance(node, dict) else enumerate(node):
                nodes.append((node, key))
                if isinstance(value, (dict, list)):
                    stack.append(value)
        container, key = rng.choice(nodes)
        container[key] = wrong_type(container[key])
        manifest = {"metadata": {"name": "demo", "namespace": "team-a"}, "spec": {role: {"podTemplate": template}}}
        with pytest.raises(SpecError, match=rf"spec\.{role}\.podTemplate"):
            check(manifest, cfg=cfg)
