"""What no job may use, whatever its platform allows (pure constants): shared by the CRD's CEL
rules (pipelinerl/crd.py) and the operator's policy checks (pipelinerl_operator/policy_checks.py), so
that the API server and the webhook refuse the same things with the same words."""

from __future__ import annotations

# Secrets: every job's credentials ("<job>-<uid[:8]>-pipelinerl-credentials"), the chart's own
# ("<release>-pipelinerl-<suffix>": its fullname always ends in -pipelinerl), Helm's record of
# each release (its rendered values, the generated install key among them).
CREDENTIALS_SUFFIX = "-pipelinerl-credentials"
INSTALL_SECRET_SUFFIXES = (
    "-pipelinerl-auth",
    "-pipelinerl-nats-accounts",
    "-pipelinerl-nats-routes",
    "-pipelinerl-operator-webhook",
)
HELM_RELEASE_PREFIX = "sh.helm.release.v1."
# Claims: a trainer StatefulSet's run volumes ("run-<statefulset>-<n>": checkpoints), the chart's
# NATS store ("data-<release>-pipelinerl-nats-<n>": every job's streams).
CHECKPOINT_CLAIM = r"^run-.+-trainer-[0-9]+$"
NATS_CLAIM = r"^data-.+-pipelinerl-nats-[0-9]+$"

# What a GPU container runtime reads from a container's environment: NVIDIA_VISIBLE_DEVICES=all
# hands a pod every GPU of its node, requested or not, and the NVIDIA toolkit reads more of its
# NVIDIA_ names with every release (NVIDIA_MOFED, NVIDIA_GDS, ...), so the whole prefix is
# refused, not a list of today's names.
DEVICE_ENV_PREFIXES = ("NVIDIA_", "HABANA_VISIBLE_", "AMD_VISIBLE_DEVICES")
DEVICE_ENV_NAMES = frozenset({"CUDA_VISIBLE_DEVICES"})


def is_device_env(name: object) -> bool:
    return isinstance(name, str) and (name in DEVICE_ENV_NAMES or name.startswith(DEVICE_ENV_PREFIXES))


def could_yield_device_env(prefix: str) -> bool:
    """Whether `prefix` + some key is a name `is_device_env` refuses (an envFrom's keys are
    anyone's)."""
    return any(p.startswith(prefix) or prefix.startswith(p) for p in DEVICE_ENV_PREFIXES) or any(
        n.startswith(prefix) for n in DEVICE_ENV_NAMES
    )


# User and group IDs below this are root's and the system's (group 0, `disk`, `shadow`...): a pod
# may run as another ID than the operator's 10001, never as one of those.
MIN_ID = 1000

# Pod fields a podTemplate may not set that the CRD's CEL can see without iterating (the webhook
# refuses every field outside its allowlist), and where the job's spec sets one instead.
REFUSED_POD_FIELDS = (
    "nodeName",
    "runtimeClassName",
    "shareProcessNamespace",
    "hostAliases",
    "dnsConfig",
    "dnsPolicy",
    "resourceClaims",
    "overhead",
)
SPEC_INSTEAD = {
    "priorityClassName": "set spec.scheduling.priorityClassName",
    "schedulerName": "set spec.scheduling.schedulerName",
}
# The cluster's own priority classes: never a job's.
SYSTEM_PRIORITY_PREFIX = "system-"

# The words of each refusal, the same at every door.
NOT_ALLOWED = "not a field a job may set here"
DEVICE_ENV_WHY = "the GPU runtime reads it: a pod gets the GPUs it requests (gpus), no others"
ID_WHY = f"below {MIN_ID}: root's or a system ID, not allowed"
HELM_CONFIG_MAP_WHY = "a Helm release record (HELM_DRIVER=configmap: the rendered values, the install key among them)"
JOB_CONFIG_WHY = "another job's configuration"
INSTALL_CONFIG_MAP_SUFFIXES = ("-pipelinerl-nats", "-pipelinerl-dashboard")
JOB_CONFIG_SUFFIX = "-pipelinerl-config"
HELM_SECRET_WHY = "a Helm release Secret (it holds the release's rendered values, the install key among them)"
INSTALL_SECRET_WHY = "the PipelineRL install's own"
CREDENTIALS_WHY = "a job's credentials (its own reach its pods from the operator alone)"
CHECKPOINT_WHY = "a job's checkpoints (a trainer's run volume)"
NATS_CLAIM_WHY = "the NATS store of a PipelineRL install (every job's streams)"
NEVER = "no job may use it"
EGRESS_TO_WHY = "list the destinations, each an ipBlock (a CIDR): no rule may reach everywhere, nor pods"
EGRESS_PORTS_WHY = "list the ports, each a number (with endPort, not below it, for a range)"
