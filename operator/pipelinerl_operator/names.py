"""What the operator names and labels (pure): each child's name, its labels and metadata, owned by
the job so that deleting the job garbage-collects it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipelinerl.contracts import JOB_LABEL, RESERVED_LABEL_PREFIXES, ROLE_LABEL
from pipelinerl.reserved import CREDENTIALS_SUFFIX
from pipelinerl.spec import API_VERSION, KIND, PipelineRLJob

if TYPE_CHECKING:
    from pipelinerl_operator.config import OperatorConfig

FIELD_MANAGER = "pipelinerl-operator"
ROLE_INFIX = "prl"


def role_name(job: str, role: str) -> str:
    """A role's StatefulSet and Service: marked as PipelineRL's, so that no ordinary object such as
    a Deployment's Service `<job>-generator` holds the name (spec.MAX_JOB_NAME leaves room)."""
    return f"{job}-{ROLE_INFIX}-{role}"


def owned_name(job: str, what: str = "") -> str:
    """The name of a child that is not a role's: one no user object is likely to hold (and the
    operator never takes over an object it does not own: reconcile.apply_owned)."""
    return f"{job}-pipelinerl" + (f"-{what}" if what else "")


def config_map_name(job: str) -> str:
    return owned_name(job, "config")


def secret_name(job: str, uid: str) -> str:
    """The job's credentials, named for this job only: a later job of the same name never takes an
    earlier one's Secret the garbage collector has not deleted yet, and nobody can make one for a
    job before it exists (the operator only creates it: it has no right to read Secrets). The
    policy refuses other jobs' by the suffix."""
    return f"{job}-{uid[:8]}{CREDENTIALS_SUFFIX}"


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


def job_labels(job: PipelineRLJob, role: str | None) -> dict[str, str]:
    # The job's labels, less those the operator sets from the spec (queue, gang, its own).
    mine = {k: v for k, v in job.metadata.labels.items() if not k.startswith(RESERVED_LABEL_PREFIXES)}
    return mine | operator_labels(job, role)


def operator_labels(job: PipelineRLJob, role: str | None) -> dict[str, str]:
    """The labels the operator puts on a job's children, over any of the job's own of those names
    (its selectors and NetworkPolicy find the job's pods by them)."""
    labels = {
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


def metadata(job: PipelineRLJob, namespace: str, uid: str, name: str, role: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": job_labels(job, role),
        "ownerReferences": [owner_reference(job, uid)],
    }


# ---------------------------------------------------------------- pod template merge


def gang_name(job: str) -> str:
    """The pod group that must be scheduled together: the trainer ranks and the preprocessor."""
    return owned_name(job, "gang")
