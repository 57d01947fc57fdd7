"""The chart's NATS store, which every job of the install shares: each running job's reservation
(its streams' bytes), decided one at a time so that no two jobs take the same room, and the NATS
accounts of the jobs that hold one, written into the Secret the server includes (their limits add
up to its store, so it can always start). The decisions stand in the jobs' statuses
(`status.natsReservedBytes`, read back through kopf's index: `handlers.jobs`), so a restarted
operator, or the replica taking its turn, starts from them. The kopf wiring is in handlers.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.capacity import admission_problem, reserved_bytes
from pipelinerl.contracts import NATS_ACCOUNTS_FILE, OperatorEnv
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.credentials import job_account, nats_accounts, secret_data
from pipelinerl_operator.pod_template import on_chart_nats
from pipelinerl_operator.status import is_terminal

Held = dict[str, tuple[str, str, int]]  # uid -> (namespace, name, bytes held)
# How long a job's account stays, JetStream disabled, after its job gave its room back (and its
# room counts as held): longer than a change of the accounts Secret takes to reach the server
# (the kubelet's Secret sync, about a minute, then the chart's reloader).
RETIRE_S = 300.0


def retire_seconds() -> float:
    return float(os.environ.get(OperatorEnv.NATS_RETIRE_SECONDS) or RETIRE_S)


@dataclass(frozen=True)
class JobRecord:
    uid: str
    held: int  # status.natsReservedBytes: what its status says it holds in the chart's NATS store


def store_bytes_needed(job: Any, previous: dict[str, Any], cfg: OperatorConfig) -> int:
    """What the job must hold in the chart's NATS store now: its streams' bytes while it runs on
    the install's own NATS; with a spec that no longer parses, what it holds; suspended or
    finished, nothing (handlers deletes its streams first, and gives the room back only then)."""
    held = int(previous.get("natsReservedBytes") or 0)
    if is_terminal(previous) or job is not None and job.spec.suspend:
        return 0
    if job is None:
        return held
    return reserved_bytes(job.spec) if on_chart_nats(job) and cfg.nats_bundled else 0


def accounts_secret(name: str, namespace: str, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "nats"},
        },
        "data": secret_data({NATS_ACCOUNTS_FILE: text}),
    }


def accounts_secret_name() -> tuple[str | None, str | None]:
    """The accounts Secret the chart's NATS includes, and the operator's namespace (where it is)."""
    return os.environ.get(OperatorEnv.NATS_ACCOUNTS_SECRET), os.environ.get(OperatorEnv.NAMESPACE)


@dataclass
class Reservations:
    """This operator process's decisions, serialized by `lock`; what it decided (`decided`) counts
    until the job's status says so too; the accounts it last wrote, so that unchanged ones are
    not written again."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    decided: Held = field(default_factory=dict)
    accounts_written: str | None = None
    enabled: dict[str, tuple[str, int]] = field(default_factory=dict)  # account -> (namespace, bytes) last written
    retired: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # ... and since when, retired

    def held(self, index: Mapping[tuple[str, str], Iterable[JobRecord]]) -> Held:
        """Every job holding a reservation now: its status's, or what was decided here since."""
        records = {r.uid: (ns, n, r.held) for (ns, n), rs in index.items() for r in rs}
        for uid, decided in list(self.decided.items()):
            if uid not in records or records[uid] == decided:
                del self.decided[uid]  # gone, or the status has caught up
            else:
                records[uid] = decided
        return {uid: r for uid, r in records.items() if r[2] > 0}

    async def reserve(
        self, index: Mapping, cfg: OperatorConfig, kube: Any, uid: str, namespace: str, name: str, need: int
    ) -> tuple[str | None, int]:
        """Take, keep or give back (`need` 0) the job's reservation, then write the NATS accounts
        of the jobs that hold one. Returns why the job must wait, if it must (it holds nothing
        then, and has no account), and the bytes it holds. A running job whose update needs more
        than there is keeps what it holds."""
        async with self.lock:
            held = self.held(index)
            problem = None
            mine = held.pop(uid, None)
            if need and (mine is None or mine[2] != need) and cfg.nats_store_bytes:
                others = {u: (ns, b) for u, (ns, _, b) in held.items()}
                own = job_account(namespace, name, uid)
                others |= {a: (ns, b) for a, (ns, b, _) in self.retiring().items() if a != own}
                problem = admission_problem(cfg.nats_store_bytes, cfg.policy.namespace_share, others, namespace, need)
            decided = mine if problem and mine else (namespace, name, 0 if problem else need)
            self.decided[uid] = decided
            if decided[2]:
                held[uid] = decided
            await self.write_accounts(cfg, kube, held)
            return problem, decided[2]

    async def write_accounts(self, cfg: OperatorConfig, kube: Any, held: Held) -> None:
        """The accounts of the jobs in `held`, into the Secret the chart's NATS server includes (it
        reloads when the file changes). Only with the install's key and that Secret named (the
        chart's own NATS in use)."""
        secret, namespace = accounts_secret_name()
        if not (cfg.auth_key and secret and namespace and kube):
            return
        accounts = [(ns, name, uid, b * cfg.nats_replicas) for uid, (ns, name, b) in held.items()]  # every copy
        # Retired room is counted as `held` counts it (one copy), beside the other jobs'.
        retired = self.retire({job_account(ns, name, uid): (ns, b) for uid, (ns, name, b) in held.items()})
        text = nats_accounts(cfg.auth_key, accounts, retired)
        if text != self.accounts_written:
            await kube.apply(accounts_secret(secret, namespace, text))
            self.accounts_written = text

    def retire(self, enabled: dict[str, tuple[str, int]], now: float | None = None) -> list[str]:
        """The accounts to write with JetStream disabled (`enabled`: those written with it, by
        account: namespace and bytes): those whose job gave its room back in the last RETIRE_S.
        nats-server keeps the storage of an account dropped from its configuration reserved
        until it restarts (nats-io/nats-server#3420), and releases it when the account's
        JetStream is disabled; so a job's account is disabled first and dropped once the server
        has had time to reload that. Its room counts as held until then (`retiring`): a reload
        that enabled an account into room another in the same reload gives back could fail (the
        server takes accounts in no set order, and stops at the first it cannot enable)."""
        now = time.monotonic() if now is None else now
        for account, (namespace, size) in self.enabled.items():
            if account not in enabled:
                self.retired[account] = (namespace, size, now)
        self.enabled = dict(enabled)
        self.retired = {a: r for a, r in self.retiring(now).items() if a not in enabled}
        return sorted(self.retired)

    def retiring(self, now: float | None = None) -> dict[str, tuple[str, int, float]]:
        now = time.monotonic() if now is None else now
        return {a: r for a, r in self.retired.items() if now - r[2] < retire_seconds()}
