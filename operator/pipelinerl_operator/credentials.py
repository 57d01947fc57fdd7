"""Per-job credentials (pure): what keeps one job's pods out of another's streams and weights.

Every job gets a NATS account of its own on the chart's NATS server (its streams and subjects
live in it: no other job's client can see, read or write them) and a weight token its weight
group's members must prove they hold (`pipelinerl.weight_group`). Both are derived from the
install's secret key and the job's namespace, name and uid, so the operator needs no store of
its own: the job's Secret, the server's account list and a re-created job's new credentials
all follow from what the API server already holds.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterable

OPERATOR_ACCOUNT = "pipelinerl"  # always there, so the server never runs without authentication


def _derive(key: str, *parts: str) -> str:
    return hmac.new(key.encode(), "/".join(parts).encode(), hashlib.sha256).hexdigest()


def nats_user(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"  # both DNS labels: no two jobs share one


def job_account(namespace: str, name: str, uid: str) -> str:
    """The job's NATS account: its streams are stored under this name, so a later job of the same
    name (another uid) never finds an earlier one's data, whatever was left on the volume."""
    return f"{nats_user(namespace, name)}.{uid}"


def job_credentials(key: str, namespace: str, name: str, uid: str) -> dict[str, str]:
    """The job Secret's values, by JOB_SECRET_KEYS key."""
    return {
        "natsUser": nats_user(namespace, name),
        "natsPassword": _derive(key, "nats", namespace, name, uid),
        "weightsToken": _derive(key, "weights", namespace, name, uid),
    }


def secret_data(values: dict[str, str]) -> dict[str, str]:
    return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}


# A job's processes that may hold a connection to NATS, per pod: up to a node's GPUs of ranks or
# engines, twice over for connections a restarted process left for the server to notice gone.
CONNECTIONS_PER_POD = 16


def account_limits(file_bytes: int, replicas: int, max_job_pods: int) -> str:
    """What one job's account may take of the server beside its room in the store (`file_bytes`,
    every copy), so that its pods' code, whatever it runs, cannot take the server from the
    others: connections and subscriptions (each holds server memory), consumers, and no stream
    larger than one copy of its room (else one stream of a single copy could fill one server of a
    replicated NATS: its room counts the copies)."""
    connections = CONNECTIONS_PER_POD * max_job_pods + 16
    return (
        f"jetstream: {{ max_file: {file_bytes}, max_mem: 0, max_streams: 8, max_consumers: {4 * connections}, "
        f"disk_max_stream_bytes: {file_bytes // replicas}, max_bytes_required: true }}, "
        f"limits: {{ max_connections: {connections}, max_subscriptions: {64 * connections} }}, "
    )


def nats_accounts(
    key: str,
    jobs: Iterable[tuple[str, str, str, int]],
    retired: Iterable[str] = (),
    replicas: int = 1,
    max_job_pods: int = 64,
) -> str:
    """The `accounts` block of the NATS server's configuration (included by the chart's
    nats.conf, reloaded when it changes): one account per job (namespace, name, uid, the bytes
    its streams reserve, every copy; named by `job_account`), one user in it, JetStream within
    that job's own limit (file storage only; every stream must say its size) and the server's
    other resources within `account_limits` (`replicas`: the chart's NATS servers; `max_job_pods`:
    jobPolicy.maxJobPods), and the operator's own account; `retired`: accounts whose job gave its
    room back, kept a while with JetStream disabled and no user (`nats_store.Reservations.retire`)."""

    def account(name: str, user: str, password: str, file_bytes: int | None) -> str:
        js = account_limits(file_bytes, replicas, max_job_pods) if file_bytes is not None else ""
        login = f"{{ user: {json.dumps(user)}, password: {json.dumps(password)} }}"
        return f"  {json.dumps(name)}: {{ {js}users: [ {login} ] }}"

    lines = [account(OPERATOR_ACCOUNT, OPERATOR_ACCOUNT, _derive(key, "operator"), None)]
    for namespace, name, uid, reserved in sorted(set(jobs)):
        creds = job_credentials(key, namespace, name, uid)
        lines.append(account(job_account(namespace, name, uid), creds["natsUser"], creds["natsPassword"], reserved))
    lines += [f"  {json.dumps(name)}: {{ jetstream: disabled }}" for name in retired]
    return "# Written by the PipelineRL operator: one account per job.\naccounts {\n" + "\n".join(lines) + "\n}\n"
