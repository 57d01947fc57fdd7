"""The spec's fields that only the operator acts on (pure): `pipelinerl run` reads the same
manifest and tells which of them it was given and leaves alone, rather than seeming to honour them
(a deadline that never fires, resource limits never applied)."""

from __future__ import annotations

from typing import Any

from pipelinerl.contracts import ROLES
from pipelinerl.spec import PipelineRLJob

CLUSTER_ONLY = (
    "suspend",  # the operator scales a suspended job's pods to none; a local run is stopped with Ctrl-C
    "runPolicy.activeDeadlineSeconds",
    "runPolicy.progressDeadlineSeconds",
    "runPolicy.ttlSecondsAfterFinished",
    "runPolicy.checkpointRetention",  # the run folder is kept
    "runPolicy.failingRoles",  # every process's restarts count against backoffLimit here
    *(f"{role}.{field}" for role in ROLES for field in ("image", "resources", "podTemplate")),
    "scheduling",
    "storage",
    "network",
    "nats.url",  # a local run starts its own nats-server
    "output.claimName",
    "output.subPath",
)


def cluster_only_given(job: PipelineRLJob) -> list[str]:
    """The CLUSTER_ONLY fields the job sets to other than their defaults, as `spec.<path>`."""
    given = job.spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)

    def at(path: str) -> Any:
        node: Any = given
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    return [f"spec.{path}" for path in CLUSTER_ONLY if at(path) is not None]
