"""The platform's job policy (pure): what jobs may ask for, as a model of the chart's `jobPolicy`
values, and what the install itself holds, which no job may reach whatever the policy says.

The policy comes from the chart's `jobPolicy` values: the operator reads them from its
environment (PIPELINERL_JOB_POLICY, `pipelinerl_operator.config`), `pipelinerl validate --policy
FILE` from the values file (the same way); unset, the defaults below are the safe default
(nothing beyond the well-known). Helm refuses a bad policy at install by `values_schema`, the
operator by `parse_policy`, naming each field. What a job is checked for against it is
`pipelinerl_operator.policy_checks`; its egress, `pipelinerl_operator.egress`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

from pipelinerl.k8s_types import Quantity
from pipelinerl.spec import SpecError, parse_mapping

# Entries of the policy's lists, as the chart's values schema refuses them too.
IMAGE_PREFIX = r"^([a-z0-9-]+(\.[a-z0-9-]+)+(:[0-9]+)?|[a-z0-9-]+:[0-9]+|localhost)(/[a-z0-9._/-]+)?$"  # host first
NAMESPACED = r"^[^/\s]+/[^/\s]+$"  # namespace/name, either "*"
HOST_PORT = r"^[^\s:/,]+:[0-9]{1,5}$"


class PolicyModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class TolerationRule(PolicyModel):
    """A taint jobs may tolerate: its key, and its effect (unset: any)."""

    key: str = Field(min_length=1, max_length=316)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class PortRule(PolicyModel):
    port: int = Field(ge=1, le=65535)
    end_port: int | None = Field(default=None, ge=1, le=65535)
    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"

    def covers(self, port: int, end: int, protocol: str) -> bool:
        return protocol == self.protocol and self.port <= port and end <= (self.end_port or self.port)


def _network(cidr: str) -> str:
    ipaddress.ip_network(cidr)  # ValueError names it
    if "/" not in cidr:  # a NetworkPolicy's ipBlock refuses a bare address
        raise ValueError(f"{cidr!r} has no prefix length (write {cidr}/32 for one IPv4 address)")
    return cidr


Cidr = Annotated[str, AfterValidator(_network)]


class EgressRule(PolicyModel):
    """Destinations jobs may reach: a CIDR less its exceptions, on these ports (unset: any)."""

    cidr: Cidr
    except_: list[Cidr] = Field(default_factory=list, alias="except")
    ports: list[PortRule] | None = None


class NatsServer(PolicyModel):
    """A NATS server a job's own spec.nats.url may name, and where it is: job pods reach its port
    at these addresses only (none: anywhere on that port, since a NetworkPolicy cannot name a host)."""

    server: Annotated[str, StringConstraints(pattern=HOST_PORT)]
    cidrs: list[Cidr] = Field(default_factory=list)


NATS_PORT = 4222  # a NATS URL's port where it names none


def url_servers(urls: str) -> list[tuple[str, int]]:
    """(host, port) of each server a comma-separated NATS URL list names, in order."""
    parts = [urlsplit(u.strip()) for u in urls.split(",") if u.strip()]
    return [(p.hostname or "", p.port or NATS_PORT) for p in parts]


class DnsPeers(PolicyModel):
    """Where job pods resolve names: the cluster DNS pods (and node-local caches, by address)."""

    namespace: str = "kube-system"
    pod_labels: dict[str, str] = Field(default_factory=lambda: {"k8s-app": "kube-dns"})
    cidrs: list[str] = Field(default_factory=list)


PRIVATE_V4 = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "127.0.0.0/8",
    "192.0.0.0/24",  # IETF protocol assignments
    "198.18.0.0/15",  # benchmarking: some clouds route it inside
]
PRIVATE_V6 = ["fc00::/7", "fe80::/10", "::1/128"]
MAX_POD_RESOURCES: dict[str, int | str] = {
    "cpu": "128",
    "memory": "2Ti",
    "nvidia.com/gpu": "16",
    "ephemeral-storage": "1Ti",
}
WELL_KNOWN_NODE_LABELS = (
    "kubernetes.io/arch",
    "kubernetes.io/os",
    "node.kubernetes.io/instance-type",
    "topology.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "nvidia.com/gpu.product",
)


class JobPolicy(PolicyModel):
    """The platform's policy for job pods (the chart's `jobPolicy` values); the defaults are the
    safe default: the well-known node labels, the GPU taint, the operator's own image registry,
    no Secret or claim of anyone's, egress to public addresses on 443."""

    images: list[Annotated[str, StringConstraints(pattern=IMAGE_PREFIX)]] = Field(
        default_factory=lambda: ["ghcr.io/pipelinerl"],
        description="Registries or repository prefixes (registry host first) job containers may pull from.",
    )
    max_pod_resources: dict[str, Quantity] = Field(
        default_factory=lambda: dict(MAX_POD_RESOURCES),
        description="Per pod, requests and limits each (its containers summed); a resource not listed is refused.",
    )
    max_volume_size: Quantity = Field(
        default="2Ti", description="An emptyDir's sizeLimit, an ephemeral volume's claim, spec.storage.size."
    )
    max_job_pods: int = Field(default=64, ge=1, description="Pods one job may run, every role together.")
    max_job_gpus: int = Field(default=64, ge=0, description="GPUs one job may ask for, every pod together.")
    max_job_volume_size: Quantity = Field(
        default="16Ti", description="Volume bytes one job may ask for, every pod's volumes together."
    )
    queue_required_above_gpus: int | None = Field(
        default=None,
        ge=0,
        description="A job asking for more GPUs than this must name a Kueue queue (scheduling.queueName); unset: none.",
    )
    node_labels: dict[str, list[str]] = Field(
        default_factory=lambda: {k: ["*"] for k in WELL_KNOWN_NODE_LABELS},
        description="Node labels nodeSelector and node affinity may use, with their values ('*': any).",
    )
    tolerations: list[TolerationRule] = Field(default_factory=lambda: [TolerationRule(key="nvidia.com/gpu")])
    priority_class_names: list[str] = Field(default_factory=list)
    scheduler_names: list[str] = Field(default_factory=list)
    csi_drivers: list[str] = Field(default_factory=list, description="Drivers of inline CSI volumes.")
    storage_class_names: list[str] = Field(
        default_factory=list,
        description="StorageClasses a job's volumes may name (spec.storage.storageClassName, an ephemeral "
        "volume's claim); one that names none gets the cluster's default class.",
    )
    localhost_profiles: list[str] = Field(
        default_factory=list,
        description="Node-local seccomp and AppArmor profiles (localhostProfile) jobs may use: a profile "
        "on the node may allow more than RuntimeDefault, so only those the platform vetted.",
    )
    pod_metadata_prefixes: list[str] = Field(
        default_factory=list,
        description="Prefixes (the part of a key before '/') of the labels and annotations a job may put "
        "on its pods: the network plugins, meshes and schedulers act on prefixed keys (Multus, Calico, "
        "sidecar injection); keys without a prefix are always allowed.",
    )
    secrets: list[Annotated[str, StringConstraints(pattern=NAMESPACED)]] = Field(
        default_factory=list, description="Secrets jobs may read: 'namespace/name', '*' for either."
    )
    config_maps: list[Annotated[str, StringConstraints(pattern=NAMESPACED)]] = Field(
        default_factory=list, description="ConfigMaps jobs may read: 'namespace/name', '*' for either."
    )
    volume_claims: list[Annotated[str, StringConstraints(pattern=NAMESPACED)]] = Field(
        default_factory=list, description="PersistentVolumeClaims jobs may mount: 'namespace/name', '*' for either."
    )
    nats_servers: list[Annotated[str, StringConstraints(pattern=HOST_PORT)] | NatsServer] = Field(
        default_factory=list,
        description="NATS servers a job's own spec.nats.url may name: host:port, or {server: host:port, "
        "cidrs: [...]} where job pods reach it at those addresses only (a host:port alone: anywhere on its port).",
    )
    egress: list[EgressRule] = Field(
        default_factory=lambda: [
            EgressRule.model_validate({"cidr": "0.0.0.0/0", "except": PRIVATE_V4, "ports": [{"port": 443}]}),
            EgressRule.model_validate({"cidr": "::/0", "except": PRIVATE_V6, "ports": [{"port": 443}]}),
        ],
        description="What spec.network.egress rules must fall inside (restricted job egress).",
    )
    dns: DnsPeers = Field(default_factory=DnsPeers)
    max_job_store_gi: float | None = Field(
        default=None, gt=0, description="NATS store one job may reserve; unset: the store (times namespaceShare)."
    )
    namespace_share: float = Field(
        default=0.8, gt=0, le=1, description="Share of the NATS store the jobs of one namespace may reserve together."
    )

    def nats_server_entries(self) -> list[NatsServer]:
        """`nats_servers`, each in the object form (a host:port alone lists no addresses)."""
        return [e if isinstance(e, NatsServer) else NatsServer(server=e) for e in self.nats_servers]

    def nats_server(self, server: str) -> NatsServer | None:
        """The listed entry for `server` (host:port); None where it is not listed."""
        return next((e for e in self.nats_server_entries() if e.server == server), None)

    def pod_metadata_allowed(self, key: str) -> bool:
        """A label or annotation a job may put on its pods: no prefix, or one the platform lists."""
        prefix, slash, _ = key.rpartition("/")
        return not slash or prefix in self.pod_metadata_prefixes


@dataclass(frozen=True)
class Install:
    """What the install itself holds, which no job may reach whatever the policy says: its
    Secrets' exact names (the chart's, auth.existingSecret and nats.routesExistingSecret included:
    PIPELINERL_INSTALL_SECRETS), besides pipelinerl.reserved's patterns."""

    secrets: tuple[str, ...] = ()


class PolicyError(SpecError):
    """A policy (the chart's jobPolicy, `validate --policy`) that does not validate; names each field."""


def parse_policy(data: Any, source: str = "jobPolicy") -> JobPolicy:
    """A policy: the chart's `jobPolicy` values, or a whole values file holding them."""
    if isinstance(data, dict) and "jobPolicy" in data:
        data = data["jobPolicy"]
    return parse_mapping(JobPolicy, {} if data is None else data, source, "job policy", PolicyError)


def values_schema() -> dict[str, Any]:
    """The JSON schema of the chart's `jobPolicy` values (in values.schema.json; a test keeps it so):
    Helm refuses a bad policy at install, before the operator would."""

    def inline(node: Any, defs: dict[str, Any]) -> Any:
        if isinstance(node, list):
            return [inline(n, defs) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: inline(v, defs) for k, v in node.items() if k != "title"}

    raw = JobPolicy.model_json_schema(by_alias=True)
    return inline(raw, raw.pop("$defs", {}))
