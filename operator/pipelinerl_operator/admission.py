"""One validation for every door a manifest comes through: `pipelinerl validate`, the operator's
admission webhook, and its reconcile.

The CRD's schema and CEL rules (`pipelinerl/crd.py`) refuse most mistakes at the API server even
where the webhook is not installed; this is the whole check, adding what CEL cannot express:
vLLM's argument list, Kubernetes quantities compared, the rendered children (user pod templates
merged in) validated against the Kubernetes OpenAPI schema of the oldest version the chart
supports and against the pod security rules, and whether the task's prompts fit the context.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pipelinerl.contracts import POD_GROUP_API, ROLE_LABEL, ROLES
from pipelinerl.generator_memory import job_plan
from pipelinerl.prompt_fit import static_prompt_fit
from pipelinerl.tasks import param_problems
from pipelinerl.spec import KIND, PipelineRLJob, SpecError, check_depth, immutable_changes, parse_job
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.render import RenderError, output_place, render, volumes_deletable

# A job's JSON (what `job_manifest` keeps of it): checking one costs CPU in proportion (the
# webhook's too), and the object holds it up to twice more in annotations (kubectl's
# last-applied-configuration, kopf's last-handled-configuration), which Kubernetes caps at 256 KiB
# in all: a larger job could be created but not applied again or handled.
MAX_MANIFEST_BYTES = 100 * 1024
# The oldest Kubernetes the chart admits (`kubeVersion` in Chart.yaml): the pod-index label
# that ranks are read from is there from 1.28, and sidecars (an init container's `restartPolicy:
# Always`, which a podTemplate may add) from 1.29, where the SidecarContainers gate is on by
# default: on 1.28 it is off and such a container runs as an init container that never ends.
KUBE_VERSION = "1.29"
# A podTemplate is checked against this definition before anything reads it.
TEMPLATE_SCHEMA = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.api.core.v1.PodTemplateSpec"
# jsonschema's wording for an unknown field: name the field itself, as `validate` does.
_UNEXPECTED = re.compile(r"^Additional properties are not allowed \('([^']+)' was unexpected\)$")


@functools.cache
def _registry() -> Any:
    """kubernetes-validate's strict definitions at KUBE_VERSION, loaded once: its own `validate`
    reads and parses the schema files at every call (about a second of CPU per job, which every
    webhook review would pay)."""
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = _schema_version()
    definitions = utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    return Resource.from_contents(definitions) @ Registry()


def _schema_version() -> str:
    from kubernetes_validate import utils

    return [v for v in utils.all_versions() if utils.major_minor(v) <= KUBE_VERSION][-1]


@functools.cache
def _validator(kind: str, api_version: str) -> Any:
    """The strict schema of a kind at KUBE_VERSION."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Resource

    version = _schema_version()
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # rbac.authorization.k8s.io/v1 → rbac-v1
    schema = utils.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/{kind.lower()}-{group}.json", version
    )
    return jsonschema.validators.Draft202012Validator(schema, registry=Resource.from_contents(schema) @ _registry())


@functools.cache
def _template_validator() -> Any:
    import jsonschema

    return jsonschema.validators.Draft202012Validator({"$ref": TEMPLATE_SCHEMA}, registry=_registry())


def _schema_errors(obj: dict[str, Any]) -> list[str]:
    err = next(_validator(obj["kind"], obj["apiVersion"]).iter_errors(obj), None)
    return [_name_field(obj, list(err.path), err.message)] if err is not None else []


def _name_field(obj: dict[str, Any], path: list[Any], message: str) -> str:
    """A schema error in a rendered child → the field of the job that put it there."""
    unknown = _UNEXPECTED.match(message)
    if unknown:
        path, message = [*path, unknown.group(1)], "unknown field"
    dotted = ".".join(map(str, path))
    role = ((obj.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)
    if obj.get("kind") == "StatefulSet" and dotted.startswith("spec.template.") and role:
        return f"spec.{role}.podTemplate.{dotted.removeprefix('spec.template.')}: {message}"
    if obj.get("kind") == "NetworkPolicy" and len(path) > 2 and path[:2] == ["spec", "egress"] and path[2] >= 3:
        # its first three rules are the operator's (own pods, NATS, DNS); the rest are spec.network.egress
        rest = ".".join(map(str, path[3:]))
        return f"spec.network.egress.{path[2] - 3}{'.' + rest if rest else ''}: {message}"
    return f"{obj.get('kind')} {obj['metadata']['name']}: {dotted}: {message}"


def _template_errors(job: PipelineRLJob) -> list[str]:
    """Each podTemplate's types against Kubernetes' PodTemplateSpec, before the policy and the
    render read it: `env: [{name: [A]}]` is named here, where it would crash them. Unknown and
    required fields are left to the rendered pod's check (after the policy's, which names a field
    it forbids more precisely): a template is merged into the operator's pod, and may name a
    container by its name alone."""
    errors = []
    for role in ROLES:
        template = getattr(job.spec, role).pod_template
        found = _template_validator().iter_errors(template or {})
        err = next((e for e in found if e.validator not in ("required", "additionalProperties")), None)
        if err is not None:
            errors.append(f"spec.{role}.podTemplate{''.join('.' + str(p) for p in err.path)}: {err.message}")
    return errors


def job_manifest(obj: Any) -> dict[str, Any]:
    """What of a stored job (or one under review) its manifest is, as `validate` reads a file:
    its kind, name, namespace, labels and spec; not the annotations, managed fields and status
    the API server and the operator add."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {k: meta[k] for k in ("name", "generateName", "namespace", "labels") if k in meta},
        "spec": obj.get("spec"),
    }


def check(manifest: Any, old: Any = None, source: str = "manifest", cfg: OperatorConfig | None = None) -> PipelineRLJob:
    """The job `manifest` describes, or SpecError naming every field at fault; `old`: the stored
    object this manifest would replace (fields that cannot change are refused); `cfg`: the
    install's settings and the platform's policy (default: `OperatorConfig()`, the safe default)."""
    check_depth(manifest, source)  # before anything walks it
    size = len(json.dumps(manifest, default=str))
    if size > MAX_MANIFEST_BYTES:
        raise SpecError(
            f"{source}: the manifest is {size} bytes, more than a job may be ({MAX_MANIFEST_BYTES}): "
            "keep data in ConfigMaps and volumes, not in the job"
        )
    job = parse_job(manifest, source)
    unknown = param_problems(job.spec.task.name, job.spec.task.params)
    if unknown:
        raise SpecError(f"{source} is not a valid {KIND}:\n" + "\n".join(f"  spec.{u}" for u in unknown))
    if old is not None:
        try:
            stored: PipelineRLJob | None = parse_job(old, f"{source} (stored)")
        except SpecError:
            # Admitted by rules since tightened (a policy, vLLM's argument list): the update is
            # checked alone, so that it can fix the job; the CRD's rules still hold the
            # IMMUTABLE fields at the API server.
            stored = None
        changed = immutable_changes(stored, job) if stored is not None else []
        if changed:
            raise SpecError(
                f"{source} is not a valid update of the stored {KIND}:\n"
                + "\n".join(f"  spec.{path}: cannot change once the job exists (create a new job)" for path in changed)
            )
    shape = _template_errors(job)
    if shape:
        raise SpecError(f"{source} is not a valid {KIND}:\n" + "\n".join(f"  {e}" for e in shape))
    try:
        children = render(
            job, job.metadata.namespace or "default", "00000000-0000-0000-0000-000000000000", cfg or OperatorConfig()
        )
    except RenderError as err:
        raise SpecError(f"{source} is not a valid {KIND}:\n" + "\n".join(f"  spec.{p}" for p in err.problems)) from None
    # Kubernetes' own kinds (a gang scheduler's PodGroup has no schema here: we fill in all of it).
    errors = [e for obj in children if obj["apiVersion"] != POD_GROUP_API for e in _schema_errors(obj)]
    if errors:
        raise SpecError(f"{source} renders objects Kubernetes would refuse:\n" + "\n".join(f"  {e}" for e in errors))
    fit = static_prompt_fit(job)
    if fit and fit[0]:
        raise SpecError(f"{source} cannot run:\n" + "\n".join(f"  spec.{e}" for e in fit[0]))
    memory, _ = job_plan(job.spec)
    if memory is not None and memory.errors:
        raise SpecError(f"{source} cannot run:\n" + "\n".join(f"  spec.{e}" for e in memory.errors))
    return job


def job_warnings(job: PipelineRLJob, runs_here: bool = False) -> list[str]:
    """What runs, but not as the author may expect (completions that would be cut, GPUs no process
    uses; on a cluster, an output only `pipelinerl run` writes), or is checked only once it runs
    (a generator memory plan the manifest cannot make). `runs_here`: for `pipelinerl run`."""
    fit = static_prompt_fit(job)
    _, unplanned = job_plan(job.spec)
    warnings = [f"spec.{w}" for w in fit[1]] if fit else []
    if unplanned:
        warnings.append(f"generator GPU memory not planned here, only at the generator's start: {unplanned}")
    output = job.spec.output
    if output and output.claim_name is None and not runs_here:
        warnings.append(
            "spec.output.path: `pipelinerl run`'s; in a pod the model is written nowhere but the trainer volumes, "
            "which are then kept (set output.claimName)"
        )
    if job.spec.preprocessor.gpus:
        warnings.append(
            f"spec.preprocessor.gpus: the preprocessor uses no GPU (it scores and packs on the CPU): its "
            f"{job.spec.preprocessor.gpus} per pod would sit idle"
        )
    return warnings if runs_here else warnings + _tracking_in_volumes(job)


def _tracking_in_volumes(job: PipelineRLJob) -> list[str]:
    """Trackers writing into the run directory, which in a pod is the trainer's volume: gone with
    it where the job's volumes go with the job (`runPolicy.checkpointRetention`)."""
    tracking = job.spec.tracking
    if tracking is None or not volumes_deletable(job, written_to=output_place(job)):
        return []
    local = {
        "mlflow": "trackingUri" if tracking.mlflow and not tracking.mlflow.tracking_uri else None,
        "tensorboard": "logDir" if tracking.tensorboard and not tracking.tensorboard.log_dir else None,
        "wandb": "mode: online" if tracking.wandb and tracking.wandb.mode == "offline" else None,
    }
    retention = job.spec.run_policy.checkpoint_retention
    return [
        f"spec.tracking.{name}: written into the trainer's volume, which goes with the job "
        f"(runPolicy.checkpointRetention: {retention}): set {instead}, or Retain"
        for name, instead in local.items()
        if instead
    ]
