"""What a job's pods may hold (pure): a job must never be more powerful than its author.

The operator creates pods on a job author's behalf, so what it renders is checked after the
user's `podTemplate` is merged in: the pod as it would run, not the template. The rules are
Kubernetes' "restricted" Pod Security Standard (the version of 1.28-1.37: host namespaces,
privileged containers, capabilities, host paths and ports, AppArmor, SELinux, /proc mounts,
seccomp, sysctls, volume types, privilege escalation, non-root) and the operator's own:
read-only root filesystems, no user or group ID below MIN_ID (root's group, `disk`, ...), no
ServiceAccount but the one it sets and no projected ServiceAccount token (job pods never talk to
the Kubernetes API), no ephemeral containers. A user's podTemplate may tighten what the operator
sets, never loosen it. Each violation names the field at fault. (What a job may set at all, and
the Secrets it may name, are policy_checks'.)
"""

from __future__ import annotations

from typing import Any

from pipelinerl.reserved import ID_WHY, MIN_ID

# Restricted: volume types a pod may use.
VOLUME_TYPES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)
ADDABLE_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Baseline: the sysctls any pod may set (the "safe" set, namespaced to the pod).
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SECCOMP_TYPES = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def pod_violations(pod: dict[str, Any], *, service_account: str) -> list[str]:
    """Every rule the pod template `pod` breaks, as 'podTemplate.<path>: why' (paths as in the
    job's podTemplate; a container is named by its name)."""
    spec = pod.get("spec") or {}
    out: list[str] = []

    def bad(path: str, why: str) -> None:
        out.append(f"podTemplate.{path}: {why}")

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad(f"spec.{field}", "host namespaces are not allowed")
    if spec.get("serviceAccountName") != service_account:
        bad("spec.serviceAccountName", f"job pods run as {service_account!r}, set by the operator")
    if spec.get("serviceAccount") not in (None, service_account):
        bad("spec.serviceAccount", "job pods run as the ServiceAccount the operator sets")
    if spec.get("automountServiceAccountToken") is not False:
        bad("spec.automountServiceAccountToken", "job pods never call the Kubernetes API: no token is mounted")
    if spec.get("ephemeralContainers"):
        bad("spec.ephemeralContainers", "not allowed in a job's pods")
    sc = spec.get("securityContext") or {}
    _context(sc, "spec.securityContext", bad, pod_level=True)
    for i, sysctl in enumerate(sc.get("sysctls") or []):
        if sysctl.get("name") not in SAFE_SYSCTLS:
            bad(f"spec.securityContext.sysctls[{i}]", f"sysctl {sysctl.get('name')!r} is not in the safe set")
    for key, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            bad(f"metadata.annotations[{key}]", "AppArmor must be runtime/default or localhost/*")
    for volume in spec.get("volumes") or []:
        name = volume.get("name", "?")
        kinds = [k for k in volume if k != "name"]
        for kind in kinds:
            if kind not in VOLUME_TYPES:
                bad(
                    f"spec.volumes[{name}].{kind}",
                    f"{kind} volumes are not allowed (restricted: {', '.join(sorted(VOLUME_TYPES))})",
                )
        for j, source in enumerate((volume.get("projected") or {}).get("sources") or []):
            if "serviceAccountToken" in source:
                bad(
                    f"spec.volumes[{name}].projected.sources[{j}].serviceAccountToken",
                    "job pods never call the Kubernetes API: no ServiceAccount token",
                )
    run_as_non_root = sc.get("runAsNonRoot") is True
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            where = f"spec.{kind}[{c.get('name', '?')}]"
            csc = c.get("securityContext") or {}
            _context(csc, f"{where}.securityContext", bad, pod_level=False)
            if csc.get("privileged"):
                bad(f"{where}.securityContext.privileged", "privileged containers are not allowed")
            if csc.get("allowPrivilegeEscalation") is not False:
                bad(f"{where}.securityContext.allowPrivilegeEscalation", "must be false")
            if csc.get("readOnlyRootFilesystem") is not True:  # the operator's own rule: writes go to volumes
                bad(f"{where}.securityContext.readOnlyRootFilesystem", "must be true (write to a volume)")
            if not (run_as_non_root or csc.get("runAsNonRoot") is True):
                bad(f"{where}.securityContext.runAsNonRoot", "must be true (on the pod or the container)")
            caps = csc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []):
                bad(f"{where}.securityContext.capabilities.drop", "must drop ALL")
            for cap in caps.get("add") or []:
                if cap not in ADDABLE_CAPABILITIES:
                    bad(f"{where}.securityContext.capabilities.add", f"{cap} may not be added (only NET_BIND_SERVICE)")
            if csc.get("procMount") not in (None, "Default"):
                bad(f"{where}.securityContext.procMount", "must be Default")
            for port in c.get("ports") or []:
                if port.get("hostPort"):
                    bad(
                        f"{where}.ports[{port.get('name', port.get('containerPort'))}].hostPort",
                        "host ports are not allowed",
                    )
    return out


def _id(value: Any, path: str, bad) -> None:  # type: ignore[no-untyped-def]
    """A user or group ID as the API server reads it: any JSON number (0.0 is group 0, root's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # not a number: the schema check names it
    if value != int(value):
        bad(path, "must be a whole number")
    elif value < MIN_ID:
        bad(path, ID_WHY)


def _context(sc: dict[str, Any], path: str, bad, pod_level: bool) -> None:
    """The checks a pod's and a container's securityContext share."""
    if sc.get("runAsNonRoot") is False:
        bad(f"{path}.runAsNonRoot", "must not be false")
    for field in ("runAsUser", "runAsGroup", "fsGroup") if pod_level else ("runAsUser", "runAsGroup"):
        _id(sc.get(field), f"{path}.{field}", bad)
    if pod_level:
        groups = sc.get("supplementalGroups")
        for value in groups if isinstance(groups, list) else []:
            _id(value, f"{path}.supplementalGroups", bad)
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        bad(f"{path}.windowsOptions.hostProcess", "host processes are not allowed")
    se = sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES:
        bad(f"{path}.seLinuxOptions.type", f"must be one of {', '.join(sorted(t for t in SELINUX_TYPES if t))}")
    for field in ("user", "role"):
        if se.get(field):
            bad(f"{path}.seLinuxOptions.{field}", "may not be set")
    seccomp = (sc.get("seccompProfile") or {}).get("type")
    if (seccomp is None and pod_level) or (seccomp is not None and seccomp not in SECCOMP_TYPES):
        bad(f"{path}.seccompProfile.type", "must be RuntimeDefault or Localhost")
    apparmor = (sc.get("appArmorProfile") or {}).get("type")
    if apparmor is not None and apparmor not in ("RuntimeDefault", "Localhost"):
        bad(f"{path}.appArmorProfile.type", "must be RuntimeDefault or Localhost")
