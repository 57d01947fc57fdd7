"""A job as a whole against the platform's policy (pure): what its spec asks for beyond its pods
(priority, scheduler, volumes, output claim, NATS servers, egress, its room in the NATS store),
and every role's pods together at the replicas the spec asks for (pods, GPUs, volume bytes; a
queue above the size that needs one). The pods one by one are policy_checks'."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pipelinerl.capacity import reserved_bytes
from pipelinerl.contracts import ROLE_LABEL
from pipelinerl.k8s_types import parse_quantity, read_quantity
from pipelinerl.reserved import is_device_env
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.egress import egress_problems
from pipelinerl_operator.job_policy import JobPolicy, url_servers
from pipelinerl_operator.policy_checks import (
    DEVICE_ENV_WHY,
    GIB,
    Problems,
    as_dict,
    as_list,
    check_reference,
    gib,
    storage_class,
    volume_sizes,
)


def _pod_volume_bytes(pod_spec: dict[str, Any]) -> Decimal:
    """What a pod's volumes may hold: emptyDir size limits and ephemeral claims (their larger of
    request and limit); unreadable sizes are refused elsewhere and count as 0 here."""
    largest: dict[int, Decimal] = {}
    for volume, _, name, value in volume_sizes(pod_spec, ""):
        try:
            size = read_quantity(value) if name == "storage" else Decimal(0)
        except ValueError:
            continue
        largest[volume] = max(largest.get(volume, Decimal(0)), size)
    return sum(largest.values(), Decimal(0))


def total_violations(
    replicas: dict[str, int], statefulsets: list[dict[str, Any]], job: Any, policy: JobPolicy
) -> list[str]:
    """The job as a whole (every role's pods at the replicas its spec asks for) within the
    platform's per-job maxima: pods, GPUs, volume bytes; and a queue above the size that needs one."""
    bad = Problems()
    pods, gpus, volume = 0, Decimal(0), Decimal(0)
    for sts in statefulsets:
        role = sts["metadata"]["labels"].get(ROLE_LABEL, "")
        n = replicas.get(role, 0)
        spec = as_dict(as_dict(sts["spec"].get("template")).get("spec"))
        per_pod = Decimal(0)
        for c in as_list(spec.get("containers")) + as_list(spec.get("initContainers")):
            try:
                per_pod += read_quantity(
                    as_dict(as_dict(as_dict(c).get("resources")).get("limits")).get("nvidia.com/gpu")
                )
            except ValueError:
                pass
        claims = [
            as_dict(as_dict(as_dict(t).get("spec")).get("resources")).get("requests", {}).get("storage")
            for t in as_list(sts["spec"].get("volumeClaimTemplates"))
        ]
        pods += n
        gpus += n * per_pod
        volume += n * (_pod_volume_bytes(spec) + sum((read_quantity(c) for c in claims), Decimal(0)))
    if pods > policy.max_job_pods:
        bad(
            "replicas",
            f"{pods} pods, every role together: more than a job may run (jobPolicy.maxJobPods: {policy.max_job_pods})",
        )
    if gpus > policy.max_job_gpus:
        bad(
            "gpus",
            f"{gpus:f} GPUs, every pod together: more than a job may ask for "
            f"(jobPolicy.maxJobGpus: {policy.max_job_gpus})",
        )
    if volume > parse_quantity(policy.max_job_volume_size):
        bad(
            "storage",
            f"{gib(float(volume))} of volumes, every pod's together: more than a job may ask for "
            f"(jobPolicy.maxJobVolumeSize: {policy.max_job_volume_size})",
        )
    above = policy.queue_required_above_gpus
    if above is not None and gpus > above and not job.spec.scheduling.queue_name:
        bad(
            "scheduling.queueName",
            f"required for a job of {gpus:f} GPUs (jobPolicy.queueRequiredAboveGpus: {above}): the platform admits "
            "jobs this large through a Kueue queue",
        )
    return bad.items


def spec_violations(job: Any, namespace: str, cfg: OperatorConfig) -> list[str]:
    """What the job's spec itself asks for, beyond its pods, of the install `cfg`."""
    bad = Problems()
    s, policy, install = job.spec, cfg.policy, cfg.install
    for role in ("generator", "preprocessor", "trainer"):
        for var in getattr(s, role).env:
            if is_device_env(var.name):
                bad(f"{role}.env[{var.name}]", DEVICE_ENV_WHY)
    scheduling = s.scheduling
    if scheduling.priority_class_name and scheduling.priority_class_name not in policy.priority_class_names:
        bad(
            "scheduling.priorityClassName",
            f"{scheduling.priority_class_name!r} is not a priority class jobs may use "
            f"(jobPolicy.priorityClassNames: {', '.join(policy.priority_class_names) or 'none'})",
        )
    if scheduling.scheduler_name and scheduling.scheduler_name not in policy.scheduler_names:
        bad(
            "scheduling.schedulerName",
            f"{scheduling.scheduler_name!r} is not a scheduler jobs may use "
            f"(jobPolicy.schedulerNames: {', '.join(policy.scheduler_names) or 'none'})",
        )
    if s.storage.storage_class_name:
        storage_class(s.storage.storage_class_name, "storage.storageClassName", policy, bad)
    if parse_quantity(s.storage.size) > parse_quantity(policy.max_volume_size):
        bad("storage.size", f"larger than a volume may be (jobPolicy.maxVolumeSize: {policy.max_volume_size})")
    if s.output and s.output.claim_name:
        check_reference("PersistentVolumeClaim", "output.claimName", s.output.claim_name, namespace,
                   policy.volume_claims, "volumeClaims", install, bad)  # fmt: skip
    for host, port in url_servers(s.nats.url or ""):
        if policy.nats_server(f"{host}:{port}") is None:
            listed = ", ".join(e.server for e in policy.nats_server_entries()) or "none"
            bad("nats.url", f"{host}:{port} is not a NATS server jobs may use (jobPolicy.natsServers: {listed})")
    for i, rule in enumerate(s.network.egress):
        for problem in egress_problems(rule, policy):
            bad(f"network.egress.{i}{problem[0]}", problem[1])
    if s.nats.url is None and cfg.nats_max_payload_mb and s.nats.max_payload_mb > cfg.nats_max_payload_mb:
        bad(
            "nats.maxPayloadMb",
            f"more than the install's NATS takes ({cfg.nats_max_payload_mb} MiB: the chart's nats.maxPayloadMb): "
            "lower it, or have the install's raised",
        )
    if s.nats.url is None and cfg.nats_bundled and cfg.nats_store_bytes:
        store_bytes = cfg.nats_store_bytes
        limit = min(store_bytes * policy.namespace_share, (policy.max_job_store_gi or float("inf")) * GIB)
        need = reserved_bytes(s)
        if need > limit:
            bad(
                "trainer.checkpointInterval",
                f"the job's NATS streams would reserve {gib(need)} (what a trainer restarted from its last "
                f"checkpoint replays: checkpointInterval + preprocessor.maxPendingSteps + 1 steps of "
                f"samplesPerStep x model.maxSeqLen tokens; and the rollouts), more than one job may hold "
                f"({gib(limit)}: the NATS store, jobPolicy.namespaceShare, jobPolicy.maxJobStoreGi); lower "
                "trainer.checkpointInterval, trainer.samplesPerStep or model.maxSeqLen",
            )
    return bad.items
