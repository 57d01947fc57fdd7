"""The PipelineRLJob CustomResourceDefinition, generated from the pydantic models in `spec.py`.

`spec` comes from `JobSpec`'s JSON schema, converted into a Kubernetes structural schema
(inlined refs, `X | None` as X, nullable for optional sections only, OpenAPI v3.0 exclusive bounds, defaults on
nested objects so the API server fills them in). `status` comes from the `JobStatus` models
below: kopf/the API server silently prune status fields that the schema does not declare, so
every field the operator writes must be here. Cross-field rules that pydantic checks in
`JobSpec._cross_field` are repeated as CEL rules so `kubectl apply` rejects what
`pipelinerl validate` rejects; `tests/k8s/pure/test_k8s_crd.py` checks both agree.
`crds/pipelinerl.dev_pipelinerljobs.yaml` and the chart's `files/` copy are this module's output, committed.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pipelinerl import reserved
from pipelinerl.contracts import (
    BATCH_BYTES_PER_TOKEN,
    BOOKS_BYTES,
    HTTP_PORT,
    MASTER_PORT,
    ROLES,
    ROLLOUT_BYTES_PER_TOKEN,
    Progress,
)
from pipelinerl.k8s_types import DNS_1035_LABEL, RESOURCE_NAME
from pipelinerl.spec_sections import OUTPUT_FOLDERS
from pipelinerl.spec import (
    API_GROUP,
    IMMUTABLE,
    KIND,
    MAX_JOB_NAME,
    RESERVED_ENV,
    TASK_IMPORT_PATH,
    TASK_NAMES,
    TOP_P_ERROR,
    JobSpec,
)

PLURAL = "pipelinerljobs"
SINGULAR = "pipelinerljob"
SHORT_NAMES = ["prl", "prljob"]
VERSION = "v1alpha1"
CRD_NAME = f"{PLURAL}.{API_GROUP}"

PHASES = ("Pending", "Running", "Suspended", "Succeeded", "Failed")
CONDITION_TYPES = (
    "Ready",
    "GeneratorsReady",
    "PreprocessorReady",
    "TrainerReady",
    "WeightSyncReady",
    "Progressing",
    "Degraded",
    "Suspended",
    "Succeeded",
    "Failed",
)


# ---------------------------------------------------------------- status models


class StatusModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


CONDITION_MESSAGE_MAX = 32768  # as metav1.Condition


class Condition(StatusModel):
    """The standard `metav1.Condition` shape."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024)
    message: str = Field(default="", max_length=CONDITION_MESSAGE_MAX)
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0)


class RoleStatus(StatusModel):
    desired: int = Field(default=0, ge=0)
    replicas: int = Field(default=0, ge=0, description="Pods that exist.")
    ready: int = Field(default=0, ge=0)


class RolesStatus(StatusModel):
    generator: RoleStatus = Field(default_factory=RoleStatus)
    preprocessor: RoleStatus = Field(default_factory=RoleStatus)
    trainer: RoleStatus = Field(default_factory=RoleStatus)


class Incident(StatusModel):
    time: str
    pods: list[str] = Field(default_factory=list, max_length=1024, description="Pods that restarted in it.")


class SuspendedStore(StatusModel):
    store: str = Field(max_length=64, description="The store the checkpoint's stream positions belong to.")
    step: int = Field(ge=0)
    problems: int = Field(ge=0, description="The job's problem claims at the checkpoint: their count.")
    redraw: str = Field(
        default="",
        max_length=65536,
        pattern=r"^([0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)?$",
        description="Indices under that count its steps did not settle, drawn again ('3-5,9').",
    )


class JobStatus(StatusModel):
    observed_generation: int | None = None
    phase: Literal[PHASES] = "Pending"  # type: ignore[valid-type]
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    roles: RolesStatus = Field(default_factory=RolesStatus)
    generators_ready: str = Field(default="0/0", description="ready/desired generators, for the printer column.")
    generator_selector: str = Field(default="", description="Label selector of the generator pods (scale subresource).")
    progress: Progress = Field(default_factory=Progress)
    failures: int = Field(
        default=0,
        ge=0,
        description="Failures counted against runPolicy.backoffLimit: "
        "pod restarts of runPolicy.failingRoles, pods restarting together counted once.",
    )
    pod_restarts: dict[str, int] = Field(
        default_factory=dict,
        description="Container restarts seen per pod, every role's: a role added to runPolicy.failingRoles is "
        "charged from then on.",
    )
    last_incident: Incident | None = None
    output_written: str | None = Field(
        default=None,
        max_length=512,
        description="Where the job's model was written when it succeeded (claimName/subPath): under "
        "runPolicy.checkpointRetention DeleteAfterOutput its trainer volumes go with it only while spec.output "
        "still names that place.",
    )
    start_time: str | None = None
    completion_time: str | None = None
    suspended_seconds: float = Field(
        default=0.0, ge=0, description="Time spent suspended (not counted against runPolicy.activeDeadlineSeconds)."
    )
    suspended_since: str | None = None
    last_progress_time: str | None = Field(default=None, description="When the policy version last changed.")
    nats_reserved_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes the job's streams hold in the chart's NATS store: while it runs; 0 while it waits for "
        "room, is suspended, finished or refused.",
    )
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        description="The job's credentials Secret, once the operator has made it (one of that name it did not "
        "make is never used).",
    )
    suspended_store: SuspendedStore | None = Field(
        default=None,
        description="A suspended job's trainer checkpoint, read before its streams were deleted: its resume makes "
        "a new store that goes on from it.",
    )


# ---------------------------------------------------------------- schema conversion


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _resolve(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {**target, **{k: _resolve(v, defs) for k, v in node.items() if k != "$ref"}}
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One JSON-schema node (refs already inlined) → a Kubernetes structural-schema node."""
    node = dict(node)
    node.pop("title", None)
    if node.get("x-kubernetes-int-or-string"):  # a quantity: integer or string, as Kubernetes has it
        return node
    if "anyOf" in node:  # `X | None` → X: nullable only where null is not the default
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express union {variants} in a structural schema")
        node = {**variants[0], **node}
        node.pop("title", None)
        if node.get("default", 0) is None:
            del node["default"]
        # A scalar's null means absent: the API server prunes a null of a field not nullable, as
        # `validate` reads it, so that a stored null and a field left out compare equal in the
        # rules that keep a section immutable (`oldSelf`). An optional section (an object) stays
        # nullable: server-side apply can leave null where a manager stops sending a map it owned
        # (kubernetes#103011), which a non-nullable object schema would refuse.
        if node.get("type") == "object" or "default" in node:
            node["nullable"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound in ("Minimum", "Maximum"):  # JSON schema 2020 number → OpenAPI 3.0 boolean
        key = f"exclusive{bound}"
        if key in node and not isinstance(node[key], bool):
            node[bound.lower()] = node[key]
            node[key] = True
    if node.get("type") == "object":
        props = node.get("properties")
        if props:
            optional = {k for k, v in props.items() if any(u.get("type") == "null" for u in v.get("anyOf", []))}
            node["properties"] = {k: _structural(v) for k, v in props.items()}
            for key, prop in node["properties"].items():
                # A nested object gets `{}` so the API server applies its fields' defaults.
                # (Not an optional section such as `tracking.wandb`: absent means off.)
                if (
                    prop.get("type") == "object"
                    and "properties" in prop
                    and key not in node.get("required", [])
                    and key not in optional
                ):
                    prop.setdefault("default", {})
            node.pop("additionalProperties", None)
        elif isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = _structural(node["additionalProperties"])
        else:  # free-form mapping (podTemplate, engineArgs, task params)
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("type") == "array":
        node["items"] = _structural(node["items"])
    return node


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


# ---------------------------------------------------------------- CEL rules


# Each rule: (JSON path of the schema node it sits on, rule, message). Rules mirror the spec
# models' validators and add what only Kubernetes can check (transitions via oldSelf). What CEL
# cannot express (vLLM's argument list, quantities compared, the pod schema inside podTemplate,
# the pod security rules beyond host namespaces) the operator's admission webhook checks
# (pipelinerl_operator/admission.py). So does a check added once jobs may be stored: Kubernetes
# 1.29 (the oldest the chart admits) has no validation ratcheting, so a rule added to the CRD
# would refuse every later write of a job stored before it, the finalizer's removal included
# (stuck Terminating), while the webhook admits every write that leaves the spec as it was
# (model.path's placement, engineArgs.enable_eplb).
def _cel_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _cel_regex(pattern: str) -> str:
    return pattern.replace("\\", "\\\\")


SPEC_RULES: list[tuple[str, str, str]] = [
    (
        "",
        "self.mode != 'sync' || !has(self.rl.maxLag) || self.rl.maxLag == 0",
        "rl.maxLag must be 0 or unset in sync mode (its lag is set by rl.stepsPerGeneration: at most k - 1)",
    ),
    (
        "",
        "self.mode == 'sync' || self.rl.stepsPerGeneration == 1",
        "rl.stepsPerGeneration applies to sync mode (the conventional baseline): pipeline mode sends weights "
        "after every step",
    ),
    (
        "",
        "self.eval.interval % self.rl.stepsPerGeneration == 0",
        "eval.interval must be a multiple of rl.stepsPerGeneration: the generators hold only the weights sent at "
        "the end of each phase",
    ),
    (
        "",
        "self.rl.importanceWeights != 'sequence' || self.rl.loss in ['reinforce', 'cispo']",
        "rl.importanceWeights: sequence applies to the reinforce and cispo losses",
    ),
    (
        "",
        "self.trainer.samplesPerStep % self.rl.attempts == 0",
        "trainer.samplesPerStep must be a multiple of rl.attempts so that every step holds whole prompt groups",
    ),
    ("generator.sampling", "!has(self.topP) || self.topP == 1.0", "generator.sampling." + TOP_P_ERROR),
    (
        "",
        "self.generator.sampling.maxTokens < self.model.maxSeqLen",
        "generator.sampling.maxTokens must be smaller than model.maxSeqLen",
    ),
    (
        "",
        "self.weightSync.backend != 'nccl' || (self.trainer.gpus > 0 && self.generator.gpus > 0)",
        "weightSync.backend: nccl needs GPUs on both sides (trainer.gpus and generator.gpus)",
    ),
    (
        "",
        "self.trainer.microBatchTokens >= self.model.maxSeqLen",
        "trainer.microBatchTokens must be at least model.maxSeqLen (one sample must fit)",
    ),
    (
        "",
        f"self.rl.attempts * self.model.maxSeqLen * {ROLLOUT_BYTES_PER_TOKEN} <= self.nats.maxPayloadMb * 1048576",
        f"nats.maxPayloadMb is too small for a rollout group: rl.attempts x model.maxSeqLen tokens at up to "
        f"{ROLLOUT_BYTES_PER_TOKEN} bytes each",
    ),
    (
        "",
        f"self.trainer.microBatchTokens * {BATCH_BYTES_PER_TOKEN} + {BOOKS_BYTES} <= self.nats.maxPayloadMb * 1048576",
        f"nats.maxPayloadMb is too small for a micro-batch: trainer.microBatchTokens at up to "
        f"{BATCH_BYTES_PER_TOKEN} bytes each, and the step's books",
    ),
    (
        "generator",
        "self.tensorParallel == 1 || (self.gpus >= self.tensorParallel && self.gpus % self.tensorParallel == 0)",
        "generator.tensorParallel must divide generator.gpus (each engine spans tensorParallel GPUs of its pod)",
    ),
    ("trainer", "self.warmupSteps <= self.maxSteps", "trainer.warmupSteps must not exceed trainer.maxSteps"),
    (
        "weightSync",
        f"!(self.port in [{HTTP_PORT}, {MASTER_PORT}])",
        f"weightSync.port must differ from the services' HTTP port ({HTTP_PORT}) and the trainer ranks' rendezvous "
        f"port ({MASTER_PORT})",
    ),
    (
        "",
        "(self.trainer.gpus == 0 && self.generator.gpus == 0) || !self.model.path.startsWith('builtin:')",
        "model.path: a GPU job needs a Hugging Face model (builtin:tiny-arith is the CPU example's toy model)",
    ),
    (
        "task",
        f"self.name in {_cel_list(TASK_NAMES)} || self.name.matches('{_cel_regex(TASK_IMPORT_PATH)}')",
        f"task.name: a built-in task ({', '.join(TASK_NAMES)}) or module.path:Class",
    ),
    ("storage", "self.size.matches('^[+]?[0.]*[1-9]')", "storage.size must be greater than zero"),
    (
        "output",
        "has(self.claimName) || has(self.path)",
        "output: set claimName (Kubernetes), path (pipelinerl run) or both",
    ),
]
_RESERVED_LIST = ", ".join(f"'{n}'" for n in sorted(RESERVED_ENV))
ENV_RULE = (f"!(self.name in [{_RESERVED_LIST}])", "env name is reserved (set by PipelineRL itself)")
ENV_SOURCE_RULE = ("!(has(self.value) && has(self.valueFrom))", "env: set value or valueFrom, not both")
ENV_UNIQUE_RULE = ("self.all(e, self.exists_one(f, f.name == e.name))", "env names must be unique")
VALUE_FROM_RULE = (
    "has(self.secretKeyRef) != has(self.configMapKeyRef)",
    "env valueFrom: set exactly one of secretKeyRef, configMapKeyRef",
)
RESOURCES_RULE = (
    " && ".join(
        f"(!has(self.{kind}) || self.{kind}.all(k, k.matches('{_cel_regex(RESOURCE_NAME)}')))"
        for kind in ("requests", "limits")
    ),
    "resources.requests and resources.limits: keys must be resource names (cpu, memory, nvidia.com/gpu...)",
)
HOST_NAMESPACES_RULE = (
    "!has(self.spec) || !("
    + " || ".join(f"(has(self.spec.{f}) && self.spec.{f} == true)" for f in ("hostNetwork", "hostPID", "hostIPC"))
    + ")",
    "podTemplate.spec: host namespaces (hostNetwork, hostPID, hostIPC) are not allowed in a job's pods",
)
# What no job may use whatever its platform allows (pipelinerl.reserved), as far as CEL sees it
# without iterating over free-form lists (the webhook's job policy refuses all of it, and more).
POD_FIELD_RULES = [
    (f"!has(self.spec) || !has(self.spec.{f})", f"podTemplate.spec.{f}: {reserved.NOT_ALLOWED}")
    for f in reserved.REFUSED_POD_FIELDS
] + [
    (f"!has(self.spec) || !has(self.spec.{f})", f"podTemplate.spec.{f}: not set in a podTemplate: {why}")
    for f, why in reserved.SPEC_INSTEAD.items()
]
POD_ID_RULES = [
    (
        f"!has(self.spec) || !has(self.spec.securityContext) || !has(self.spec.securityContext.{f}) || "
        f"self.spec.securityContext.{f} >= {reserved.MIN_ID}",
        f"podTemplate.spec.securityContext.{f}: {reserved.ID_WHY}",
    )
    for f in ("runAsUser", "runAsGroup", "fsGroup")
]
ENV_DEVICE_RULE = (
    "!("
    + " || ".join(f"self.name.startsWith('{p}')" for p in reserved.DEVICE_ENV_PREFIXES)
    + f" || self.name in [{', '.join(repr(n) for n in sorted(reserved.DEVICE_ENV_NAMES))}])",
    f"env name: {reserved.DEVICE_ENV_WHY}",
)
_SECRET = "self.valueFrom.secretKeyRef.name"
ENV_INSTALL_SECRET_RULE = (
    f"!has(self.valueFrom) || !has(self.valueFrom.secretKeyRef) || !({_SECRET}.startsWith("
    f"'{reserved.HELM_RELEASE_PREFIX}') || "
    + " || ".join(f"{_SECRET}.endsWith('{suffix}')" for suffix in reserved.INSTALL_SECRET_SUFFIXES)
    + ")",
    f"env valueFrom.secretKeyRef.name: {reserved.INSTALL_SECRET_WHY} or {reserved.HELM_SECRET_WHY}: {reserved.NEVER}",
)


def env_credentials_rule(role: str) -> tuple[str, str]:
    """A role's env names no job's credentials Secret (the job's own reach its pods through the
    operator's env alone)."""
    ref = "e.valueFrom.secretKeyRef.name"
    return (
        f"!has(self.spec.{role}.env) || self.spec.{role}.env.all(e, !has(e.valueFrom) || "
        "!has(e.valueFrom.secretKeyRef) || "
        f"!{ref}.endsWith('{reserved.CREDENTIALS_SUFFIX}'))",
        f"spec.{role}.env valueFrom.secretKeyRef.name: {reserved.CREDENTIALS_WHY}: {reserved.NEVER}",
    )


OUTPUT_CLAIM_RULE = (
    f"!has(self.claimName) || !(self.claimName.matches('{_cel_regex(reserved.CHECKPOINT_CLAIM)}') || "
    f"self.claimName.matches('{_cel_regex(reserved.NATS_CLAIM)}'))",
    f"output.claimName: {reserved.CHECKPOINT_WHY} or {reserved.NATS_CLAIM_WHY}: {reserved.NEVER}",
)
PRIORITY_RULE = (
    f"!has(self.priorityClassName) || !self.priorityClassName.startsWith('{reserved.SYSTEM_PRIORITY_PREFIX}')",
    f"scheduling.priorityClassName: the cluster's own ({reserved.SYSTEM_PRIORITY_PREFIX}...) is not a priority "
    "class jobs may use",
)
EGRESS_RULES = [
    ("self.all(r, has(r.to) && size(r.to) > 0)", f"network.egress: {reserved.EGRESS_TO_WHY}"),
    ("self.all(r, has(r.ports) && size(r.ports) > 0)", f"network.egress: {reserved.EGRESS_PORTS_WHY}"),
]
ROOT_RULES = [
    (f"size(self.metadata.name) <= {MAX_JOB_NAME}", f"metadata.name must be at most {MAX_JOB_NAME} characters"),
    (
        f"self.metadata.name.matches('{_cel_regex(DNS_1035_LABEL)}')",
        "metadata.name must be a DNS-1035 label: a lowercase letter, then lowercase letters, digits or '-', "
        "not ending in '-'",
    ),
    (
        "!has(self.spec) || !has(self.spec.output) || !has(self.spec.output.claimName) || "
        f"!(self.metadata.name in {list(OUTPUT_FOLDERS)})",
        f"metadata.name: a job with spec.output.claimName is not named {' or '.join(OUTPUT_FOLDERS)} "
        "(its folder, <subPath>/<name>, would be another job's)",
    ),
]


def _node(schema: dict[str, Any], path: str) -> dict[str, Any]:
    for part in filter(None, path.split(".")):
        schema = schema["properties"][part]
    return schema


def _add_rule(node: dict[str, Any], rule: str, message: str) -> None:
    node.setdefault("x-kubernetes-validations", []).append({"rule": rule, "message": message})


def _add_immutable(schema: dict[str, Any], path: str) -> None:
    """`path` may not change on an update. A field that may be unset is held from its parent
    (always there: defaulted): a rule on the field itself runs only where the old object and the
    new one both have it, so setting or unsetting it would pass."""
    message = f"{path} is immutable: create a new job to change it"
    parent, _, leaf = path.rpartition(".")
    above = _node(schema, parent)
    if "default" in above["properties"][leaf] or leaf in above.get("required", []):
        _add_rule(_node(schema, path), "self == oldSelf", message)
    else:
        rule = f"has(self.{leaf}) == has(oldSelf.{leaf}) && (!has(self.{leaf}) || self.{leaf} == oldSelf.{leaf})"
        _add_rule(above, rule, message)


def _free(**properties: dict[str, Any]) -> dict[str, Any]:
    """A free-form object (its unknown fields kept) that declares `properties`: the API server's
    CEL sees only declared fields of an object, and refuses a CRD whose rule reads another."""
    node: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return node | {"properties": properties} if properties else node


def _list() -> dict[str, Any]:
    return {"type": "array", "items": _free()}


def pod_template_read() -> dict[str, Any]:
    """The fields of a pod template the rules read, with their types in Kubernetes' PodSpec."""
    ids = {f: {"type": "integer"} for f in ("runAsUser", "runAsGroup", "fsGroup")}
    return _free(
        spec=_free(
            hostNetwork={"type": "boolean"},
            hostPID={"type": "boolean"},
            hostIPC={"type": "boolean"},
            nodeName={"type": "string"},
            runtimeClassName={"type": "string"},
            shareProcessNamespace={"type": "boolean"},
            hostAliases=_list(),
            dnsConfig=_free(),
            dnsPolicy={"type": "string"},
            resourceClaims=_list(),
            overhead=_free(),
            priorityClassName={"type": "string"},
            schedulerName={"type": "string"},
            securityContext=_free(**ids),
        )
    )


def spec_schema() -> dict[str, Any]:
    schema = model_schema(JobSpec)
    for path, rule, message in SPEC_RULES:
        _add_rule(_node(schema, path), rule, message)
    for path in IMMUTABLE:
        _add_immutable(schema, path)
    for role in ROLES:
        env = _node(schema, f"{role}.env")
        _add_rule(env, *ENV_UNIQUE_RULE)
        for item_rule in (ENV_RULE, ENV_SOURCE_RULE):
            _add_rule(env["items"], *item_rule)
        _add_rule(env["items"]["properties"]["valueFrom"], *VALUE_FROM_RULE)
        _add_rule(_node(schema, f"{role}.resources"), *RESOURCES_RULE)
        _node(schema, f"{role}.podTemplate")["properties"] = pod_template_read()["properties"]
        _add_rule(_node(schema, f"{role}.podTemplate"), *HOST_NAMESPACES_RULE)
        _add_rule(env["items"], *ENV_DEVICE_RULE)
        _add_rule(env["items"], *ENV_INSTALL_SECRET_RULE)
        for pod_rule in POD_FIELD_RULES + POD_ID_RULES:
            _add_rule(_node(schema, f"{role}.podTemplate"), *pod_rule)
    _add_rule(_node(schema, "output"), *OUTPUT_CLAIM_RULE)
    _add_rule(_node(schema, "scheduling"), *PRIORITY_RULE)
    _node(schema, "network.egress")["items"]["properties"] = {"to": _list(), "ports": _list()}  # a NetworkPolicy's
    for egress_rule in EGRESS_RULES:
        _add_rule(_node(schema, "network.egress"), *egress_rule)
    return schema


# ---------------------------------------------------------------- the CRD

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Version", "type": "integer", "jsonPath": ".status.progress.version"},
    {
        "name": "Generators",
        "type": "string",
        "jsonPath": ".status.generatorsReady",
        "description": "Ready/desired generator replicas",
    },
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.reward", "priority": 1},
    {"name": "Lag", "type": "number", "jsonPath": ".status.progress.lagMean", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd_manifest() -> dict[str, Any]:
    root: dict[str, Any] = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": model_schema(JobStatus),
        },
    }
    root["properties"]["spec"]["default"] = {}
    for rule, message in ROOT_RULES + [env_credentials_rule(role) for role in ROLES]:
        _add_rule(root, rule, message)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "pipelinerl"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["pipelinerl"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.generator.replicas",
                            "statusReplicasPath": ".status.roles.generator.replicas",
                            "labelSelectorPath": ".status.generatorSelector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `pipelinerl crd` from pipelinerl/spec.py and pipelinerl/crd.py: do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)
