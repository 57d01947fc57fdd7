"""The install's settings (pure): the operator's `OperatorConfig` from its environment, which the
chart writes from its values (`from_env`); and that same environment computed from a values file
(`chart_env`, `from_values`), so that `pipelinerl validate --policy values.yaml` checks a job with
the policy, the install's own Secret names, the NATS store and the images that the webhook of an
install with those values holds.

`chart_env` mirrors templates/operator.yaml and _helpers.tpl: the user's values merged over the
chart's defaults as Helm merges them (`coalesce`), then each plain `env` value the operator reads.
tests/k8s/pure/test_k8s_job_policy.py renders the chart with Helm and holds the two equal. Two
settings are no values of the chart: the install key (a Secret's, read through secretKeyRef: a
stand-in here) and the release namespace (the pod's own: a stand-in too). The names that depend
on the release name (`<release>-pipelinerl-auth`, ...) are refused by their suffix whatever the
release (pipelinerl.reserved), so the stand-in release changes no check.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pipelinerl.contracts import OperatorEnv
from pipelinerl_operator.job_policy import Install, JobPolicy, PolicyError, parse_policy


@dataclass(frozen=True)
class OperatorConfig:
    """Install-wide settings (Helm values → operator env)."""

    cpu_image: str = "ghcr.io/pipelinerl/pipelinerl-services:0.1.0"
    gpu_image: str = "ghcr.io/pipelinerl/pipelinerl-services-gpu:0.1.0"
    nats_url: str = "nats://pipelinerl-nats:4222"
    service_account: str | None = None  # job pods' ServiceAccount; None: one per job, rendered with it
    image_pull_policy: str = "IfNotPresent"
    # The install's secret key (the chart generates one): per-job credentials derive from it.
    # None: no Secret, no NATS credentials, an empty weight token (a cluster of one team).
    auth_key: str | None = None
    # Namespaces whose pods may reach job pods' HTTP port (/metrics, /status) besides the
    # operator's: where Prometheus runs.
    metrics_namespaces: tuple[str, ...] = ()
    nats_replicas: int = 1  # servers of the chart's NATS: each stream of a job on it is kept by all of them
    nats_store_bytes: int = 0  # the chart's NATS store (each server's): jobs beyond it are refused; 0: unchecked
    nats_max_payload_mb: int = 0  # the chart's NATS's max_payload: jobs on it asking more are refused; 0: unchecked
    # The chart's NATS runs in the install (its pods, its accounts); False: `nats.externalUrl`, a
    # server someone else runs, reached at `nats_external_cidrs` (none: anywhere on its ports).
    nats_bundled: bool = True
    nats_external_cidrs: tuple[str, ...] = ()
    # Job pods may connect only to their own job, NATS, DNS and what the job lists (spec.network);
    # False: anywhere. `namespace`: the operator's (where the chart's NATS runs).
    restrict_egress: bool = True
    namespace: str = "pipelinerl"
    # What jobs may ask for (the chart's jobPolicy), and the install's own Secrets, which no job may name.
    policy: JobPolicy = JobPolicy()
    install: Install = Install()


# The chart's JetStream store, per server, per GiB of its volume (90%: `pipelinerl.natsStoreBytes`).
STORE_BYTES_PER_GI = 966367641
# The chart's default values that reach the operator's settings (charts/pipelinerl/values.yaml;
# a test holds them equal).
CHART_DEFAULTS: dict[str, Any] = {
    "auth": {"enabled": True, "existingSecret": ""},
    "metricsNamespaces": [],
    "jobEgress": "restricted",
    "jobPolicy": JobPolicy().model_dump(by_alias=True, mode="json"),
    "services": {
        "image": {"repository": "ghcr.io/pipelinerl/pipelinerl-services", "tag": "0.1.0"},
        "gpuImage": {"repository": "ghcr.io/pipelinerl/pipelinerl-services-gpu", "tag": "0.1.0"},
        "pullPolicy": "IfNotPresent",
    },
    "nats": {
        "enabled": True,
        "replicas": 1,
        "routesExistingSecret": "",
        "storageGi": 20,
        "maxPayloadMb": 8,
        "externalUrl": "",
        "externalCidrs": [],
    },
}
# The chart's default NATS store (20 GiB volume, 90% of it).
DEFAULT_STORE_BYTES = CHART_DEFAULTS["nats"]["storageGi"] * STORE_BYTES_PER_GI
# The top-level keys of the chart's values (values.schema.json refuses any other): a mapping with
# none of them is a `jobPolicy` block alone.
VALUES_KEYS = frozenset(
    {
        "clusterWide",
        "watchNamespaces",
        "crds",
        "operator",
        "services",
        "nats",
        "metrics",
        "webhook",
        "auth",
        "metricsNamespaces",
        "jobEgress",
        "networkPolicies",
        "acknowledgeInsecure",
        "jobPolicy",
        "apiServer",
    }
)
# What the settings of an install hold where no values say it (see the module's docstring).
RELEASE = "pipelinerl"
NAMESPACE = "pipelinerl"
KEY_STANDIN = "the-install-key"


@functools.cache
def _policy(text: str) -> JobPolicy:
    return parse_policy(json.loads(text) if text else None, OperatorEnv.JOB_POLICY)


def from_env(env: Mapping[str, str]) -> OperatorConfig:
    """The operator's settings from its environment (as the chart sets it; unset: the defaults)."""
    defaults = OperatorConfig()
    get = env.get
    return OperatorConfig(
        cpu_image=get(OperatorEnv.SERVICES_IMAGE, defaults.cpu_image),
        gpu_image=get(OperatorEnv.SERVICES_GPU_IMAGE, defaults.gpu_image),
        nats_url=get(OperatorEnv.DEFAULT_NATS_URL, defaults.nats_url),
        service_account=get(OperatorEnv.JOB_SERVICE_ACCOUNT) or None,
        image_pull_policy=get(OperatorEnv.IMAGE_PULL_POLICY, defaults.image_pull_policy),
        auth_key=get(OperatorEnv.AUTH_KEY) or None,
        metrics_namespaces=tuple(n for n in get(OperatorEnv.METRICS_NAMESPACES, "").split(",") if n),
        nats_replicas=int(get(OperatorEnv.NATS_REPLICAS) or 1),
        nats_store_bytes=int(get(OperatorEnv.NATS_STORE_BYTES) or 0),
        nats_max_payload_mb=int(get(OperatorEnv.NATS_MAX_PAYLOAD_MB) or 0),
        restrict_egress=get(OperatorEnv.JOB_EGRESS, "restricted") != "open",
        namespace=get(OperatorEnv.NAMESPACE, defaults.namespace),
        nats_bundled=get(OperatorEnv.NATS_BUNDLED, "true") != "false",
        nats_external_cidrs=tuple(c for c in get(OperatorEnv.NATS_EXTERNAL_CIDRS, "").split(",") if c),
        policy=_policy(get(OperatorEnv.JOB_POLICY, "")),
        install=Install(tuple(n for n in get(OperatorEnv.INSTALL_SECRETS, "").split(",") if n)),
    )


def coalesce(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`values` over `defaults` as Helm merges a values file over the chart's: maps key by key, a
    null deleting the default, any other value replacing it (lists whole)."""
    out = dict(values)
    for key, default in defaults.items():
        if key not in out:
            out[key] = copy.deepcopy(default)
        elif out[key] is None:
            del out[key]
        elif isinstance(out[key], dict) and isinstance(default, dict):
            out[key] = coalesce(out[key], default)
    return out


def _at(values: dict[str, Any], path: str, kind: type | tuple[type, ...], source: str) -> Any:
    node: Any = values
    for key in path.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            raise PolicyError(f"{source}: {path}: not set (the chart needs it)")
        node = node[key]
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is not bool):
        raise PolicyError(f"{source}: {path}: {node!r} is not the chart's kind of value")
    return node


def _image(ref: dict[str, Any]) -> str:
    """`pipelinerl.image`: pinned by digest when one is given."""
    return f"{ref['repository']}@{ref['digest']}" if ref.get("digest") else f"{ref['repository']}:{ref['tag']}"


def chart_env(
    values: dict[str, Any] | None, source: str = "values", release: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    """The operator's environment as the chart renders it for these values (merged over the
    chart's defaults): the plain values `from_env` reads (templates/operator.yaml)."""
    v = coalesce(values or {}, CHART_DEFAULTS)
    fullname = release[:39].rstrip("-") + "-pipelinerl"  # `pipelinerl.fullname`
    auth, nats = _at(v, "auth", dict, source), _at(v, "nats", dict, source)
    bundled = _at(v, "nats.enabled", bool, source)
    secrets = [f"{fullname}-{s}" for s in ("auth", "nats-accounts", "nats-routes", "operator-webhook")]
    secrets += [s for s in (auth.get("existingSecret"), nats.get("routesExistingSecret")) if s]  # `installSecrets`
    env = {
        OperatorEnv.SERVICES_IMAGE: _image(_at(v, "services.image", dict, source)),
        OperatorEnv.SERVICES_GPU_IMAGE: _image(_at(v, "services.gpuImage", dict, source)),
        OperatorEnv.IMAGE_PULL_POLICY: str(_at(v, "services.pullPolicy", str, source)),
        OperatorEnv.DEFAULT_NATS_URL: (
            f"nats://{fullname}-nats.{namespace}.svc:4222" if bundled else str(nats.get("externalUrl") or "")
        ),
        OperatorEnv.JOB_EGRESS: str(_at(v, "jobEgress", str, source)),
        OperatorEnv.JOB_POLICY: json.dumps(v.get("jobPolicy")),
        OperatorEnv.INSTALL_SECRETS: ",".join(secrets),
        OperatorEnv.NATS_BUNDLED: "true" if bundled else "false",
    }
    if nats.get("externalCidrs"):
        env[OperatorEnv.NATS_EXTERNAL_CIDRS] = ",".join(nats["externalCidrs"])
    if bundled:
        env[OperatorEnv.NATS_REPLICAS] = str(_at(v, "nats.replicas", int, source))
        env[OperatorEnv.NATS_STORE_BYTES] = str(
            int(_at(v, "nats.storageGi", (int, float), source)) * STORE_BYTES_PER_GI
        )
        env[OperatorEnv.NATS_MAX_PAYLOAD_MB] = str(_at(v, "nats.maxPayloadMb", int, source))
    if v.get("metricsNamespaces"):
        env[OperatorEnv.METRICS_NAMESPACES] = ",".join(v["metricsNamespaces"])
    return env


def from_values(
    values: Any = None, source: str = "the chart's default values", release: str = RELEASE, namespace: str = NAMESPACE
) -> OperatorConfig:
    """The settings the operator (and so its webhook) of an install with these Helm values holds:
    `values` a values file's mapping, or the `jobPolicy` block alone; None: the chart's defaults."""
    if values is not None and not isinstance(values, dict):
        raise PolicyError(f"{source}: expected a mapping of Helm values (or a jobPolicy block)")
    if values and not values.keys() & VALUES_KEYS:
        values = {"jobPolicy": values}
    merged = coalesce(values or {}, CHART_DEFAULTS)
    parse_policy(merged.get("jobPolicy"), source)  # a bad policy named by its fields, in the file's name
    key = KEY_STANDIN if _at(merged, "auth.enabled", bool, source) else None
    return replace(from_env(chart_env(values, source, release, namespace)), auth_key=key)
