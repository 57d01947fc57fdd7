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

from typing import Any

from pipelinerl.contracts import (
    HTTP_PORT,
    JOB_LABEL,
    POD_GROUP_API,
    ROLE_LABEL,
    ROLES,
)
from pipelinerl.spec import PipelineRLJob, dump_job
from pipelinerl_operator import policy_checks, policy_job
from pipelinerl_operator.credentials import job_credentials, secret_data
from pipelinerl_operator.egress import dns_egress, egress_rules
from pipelinerl_operator.pod_security import pod_violations
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.job_policy import NATS_PORT, url_servers
from pipelinerl_operator.names import (
    config_map_name,
    gang_name,
    metadata,
    owned_name,
    replicas,
    role_name,
    secret_name,
    selector_labels,
    service_account_name,
)
from pipelinerl_operator.pod_template import container_ports, on_chart_nats, pod_template


class RenderError(ValueError):
    """A spec the operator cannot run; reported as a condition and an Event, never retried blindly.
    Each problem names its field under `spec.`."""

    def __init__(self, *problems: str):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# ---------------------------------------------------------------- objects


def config_map(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    # The pods name the job's streams by its namespace: it is in the manifest they read.
    placed = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace})})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, namespace, uid, config_map_name(job.name), None),
        "data": {"job.yaml": dump_job(placed)},
    }


def service_account(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    """The job's pods' own identity, wherever the job runs (no role is bound to it; its token is
    not mounted): a binding of the user's may give it cloud permissions (object-store access)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "automountServiceAccountToken": False,
        "metadata": metadata(job, namespace, uid, owned_name(job.name), None),
    }


def secret(job: PipelineRLJob, namespace: str, uid: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(job, namespace, uid, secret_name(job.name, uid), None),
        "data": secret_data(job_credentials(key, namespace, job.name, uid)),
    }


OPERATOR_POD = {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "operator"}
NATS_POD = {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "nats"}


def network_policy(job: PipelineRLJob, namespace: str, uid: str, cfg: OperatorConfig) -> dict[str, Any]:
    """Ingress to the job's pods: from its own pods on any port (the weight group's and
    DeepSpeed's rendezvous, gloo's and NCCL's connections, whose ports are not fixed); to the
    HTTP port (health, /metrics, /status) also from the operator (in its namespace) and the
    metrics namespaces.
    Egress (where the install restricts it): to its own pods, NATS, DNS, and what the job lists."""
    own = {"podSelector": {"matchLabels": {JOB_LABEL: job.name}}}
    # The operator's pods in its own namespace only: anyone who can make pods elsewhere can label them so.
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": cfg.namespace}}}
    readers = [operator | {"podSelector": {"matchLabels": dict(OPERATOR_POD)}}]
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
            *_nats_egress(job, cfg),
            dns_egress(cfg.policy),
            *egress_rules(job.spec.network.egress, cfg.policy),  # within the platform's
        ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, namespace, uid, owned_name(job.name), None),
        "spec": spec,
    }


def _nats_egress(job: PipelineRLJob, cfg: OperatorConfig) -> list[dict[str, Any]]:
    """The chart's NATS pods on its client port; the chart's external NATS on its URLs' ports, at
    its addresses where the chart lists them; each of a job's own servers (jobPolicy.natsServers)
    on its port, at the addresses the policy lists for it, anywhere where it lists none (a
    NetworkPolicy cannot name a host). A rule each: one server's port is never another's way to
    the addresses listed for it."""
    if on_chart_nats(job) and cfg.nats_bundled:
        return [
            {
                "to": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": cfg.namespace}},
                        "podSelector": {"matchLabels": dict(NATS_POD)},
                    }
                ],
                "ports": [{"port": NATS_PORT, "protocol": "TCP"}],
            }
        ]
    servers = sorted(set(url_servers(job.spec.nats.url or cfg.nats_url)), key=lambda s: (s[1], s[0]))
    if on_chart_nats(job):  # the chart's external NATS: one rule, at the addresses the chart lists
        rule: dict[str, Any] = {"ports": [{"port": p, "protocol": "TCP"} for p in sorted({p for _, p in servers})]}
        if cfg.nats_external_cidrs:
            rule["to"] = [{"ipBlock": {"cidr": c}} for c in cfg.nats_external_cidrs]
        return [rule]
    rules: list[dict[str, Any]] = []
    for host, port in servers:
        listed = cfg.policy.nats_server(f"{host}:{port}")
        rule = {"ports": [{"port": port, "protocol": "TCP"}]}
        if listed is not None and listed.cidrs:
            rule["to"] = [{"ipBlock": {"cidr": c}} for c in listed.cidrs]
        if rule not in rules:
            rules.append(rule)
    return rules


def pod_group(job: PipelineRLJob, namespace: str, uid: str) -> dict[str, Any]:
    """The gang as coscheduling-style gang schedulers read it (scheduler-plugins' PodGroup): the
    pods carrying POD_GROUP_LABEL are bound together or not at all."""
    return {
        "apiVersion": POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": metadata(job, namespace, uid, gang_name(job.name), None),
        "spec": {"minMember": replicas(job, "trainer") + replicas(job, "preprocessor")},
    }


def service(job: PipelineRLJob, role: str, namespace: str, uid: str) -> dict[str, Any]:
    ports = [
        {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
        for p in container_ports(job, role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, namespace, uid, role_name(job.name, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rendezvous must resolve before pods are ready
            "selector": selector_labels(job.name, role),
            "ports": ports,
        },
    }


def output_place(job: PipelineRLJob) -> str | None:
    """Where the job's pods write its model (`claimName/subPath`); None: nowhere (`output.path`
    alone is `pipelinerl run`'s)."""
    output = job.spec.output
    return f"{output.claim_name}/{output.sub_path or ''}" if output is not None and output.claim_name else None


def volumes_deletable(job: PipelineRLJob, written_to: str | None) -> bool:
    """Whether the trainer volumes may go with the job (`runPolicy.checkpointRetention`).
    `written_to`: where the model was written when the job succeeded (`status.outputWritten`);
    after output only while the spec still names that place (an output claim added to a finished
    job holds nothing)."""
    retention = job.spec.run_policy.checkpoint_retention
    place = output_place(job)
    return retention == "Delete" or (retention == "DeleteAfterOutput" and place is not None and place == written_to)


def stateful_set(
    job: PipelineRLJob,
    role: str,
    namespace: str,
    uid: str,
    cfg: OperatorConfig,
    active: bool,
    written_to: str | None = None,
) -> dict[str, Any]:
    name = role_name(job.name, role)
    spec: dict[str, Any] = {
        "serviceName": name,
        "replicas": replicas(job, role) if active else 0,
        "podManagementPolicy": "Parallel",  # ranks rendezvous: start them together
        "selector": {"matchLabels": selector_labels(job.name, role)},
        "template": pod_template(job, role, namespace, uid, cfg),
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
            "whenDeleted": "Delete" if volumes_deletable(job, written_to) else "Retain",
            "whenScaled": "Retain",
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(job, namespace, uid, name, role),
        "spec": spec,
    }


def validate_renderable(job: PipelineRLJob) -> None:
    """Checks that only matter on Kubernetes (the spec models cannot know the pod layout)."""
    for role in ROLES:
        template = getattr(job.spec, role).pod_template or {}
        given = template.get("spec")
        pod_spec = given if isinstance(given, dict) else {}
        for kind in ("containers", "initContainers"):
            containers = pod_spec.get(kind) or []
            if not isinstance(containers, list) or any(
                not isinstance(c, dict) or not c.get("name") for c in containers
            ):
                raise RenderError(
                    f"{role}.podTemplate.spec.{kind}: a list of containers, each with a name "
                    f"(name one {role!r} to add mounts to the service container; other names add sidecars)"
                )
            for c in containers:
                if (c["name"] != role or kind == "initContainers") and not c.get("image"):
                    raise RenderError(
                        f"{role}.podTemplate.spec.{kind}[{c['name']}].image: a sidecar needs an image "
                        f"(only the {role!r} container gets the job's)"
                    )


def render(
    job: PipelineRLJob,
    namespace: str,
    uid: str,
    cfg: OperatorConfig,
    active: bool = True,
    written_to: str | None = None,
) -> list[dict[str, Any]]:
    """Every child object of the job; `active=False` (suspended, finished) scales all roles to zero;
    `written_to`: where the job's model was written when it succeeded (see `volumes_deletable`)."""
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
        objects.append(stateful_set(job, role, namespace, uid, cfg, active, written_to))
    check_pods(job, objects, cfg)
    if not active:  # its pods stop first: a child refused after them does not keep them (and their GPUs)
        objects.sort(key=lambda o: o["kind"] != "StatefulSet")
    return objects


def _as_written(job: PipelineRLJob, problem: str) -> str:
    """A problem of the rendered pod named where its author wrote it: a role's own `env` entry
    reaches the role's container (`<role>.podTemplate.spec.containers[<role>].env[NAME]`)."""
    for role in ROLES:
        for var in getattr(job.spec, role).env:
            rendered = f"{role}.podTemplate.spec.containers[{role}].env[{var.name}]"
            if problem.startswith(rendered):
                return f"{role}.env[{var.name}]{problem[len(rendered) :]}"
    return problem


def check_pods(job: PipelineRLJob, objects: list[dict[str, Any]], cfg: OperatorConfig) -> None:
    """Refuse a job that asks for more than its author may have: its podTemplate's fields, its
    pods as rendered (the podTemplate merged in) and its spec, against the platform's policy
    (policy_checks) and the pod security rules (pod_security)."""
    namespace = job.metadata.namespace or "default"
    bad = policy_checks.Problems()
    for role in ROLES:
        policy_checks.template_violations(role, getattr(job.spec, role).pod_template, cfg.policy, bad)
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
                config_map_name(job.name),
                (cfg.cpu_image, cfg.gpu_image),
                cfg.install,
                bad,
            )
    problems = [_as_written(job, p) for p in bad.items] + policy_job.spec_violations(job, namespace, cfg)
    statefulsets = [o for o in objects if o["kind"] == "StatefulSet"]
    problems += policy_job.total_violations({r: replicas(job, r) for r in ROLES}, statefulsets, job, cfg.policy)
    if problems:
        raise RenderError(*dict.fromkeys(problems))  # each once
