"""The chart's NATS store, which every job of the install shares: each running job's reservation
(its streams' bytes), and the NATS accounts of the jobs that hold one, written into the Secret the
server includes (their limits add up to its store, so it can always start).

The reservations are books (`Books`) kept in that same Secret, beside the accounts they produce:
each decision reads them, decides (`decide`, pure) and writes them back on the condition that
nobody wrote in between (the Secret's resourceVersion; the API server answers 409 otherwise, and
the decision is made again on what was written). kopf's peering takes turns, but a turn is not a
lock (a replica starved of CPU for a few seconds is taken for gone while it still reconciles), so
two replicas may decide at once: the condition keeps them from giving the same room twice.
Without that Secret (no chart NATS named: one operator process, as in most tests), the books are
kept in memory. The pass that calls it is in reconcile.py."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipelinerl.capacity import admission_problem, reserved_bytes
from pipelinerl.contracts import NATS_ACCOUNTS_FILE, NATS_STORE_BOOKS_ANNOTATION, OperatorEnv
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.credentials import job_account, nats_accounts, secret_data
from pipelinerl_operator.kube import Conflict
from pipelinerl_operator.pod_template import on_chart_nats
from pipelinerl_operator.status import is_terminal

# How long a job's account stays, JetStream disabled, after its job gave its room back (and its
# room counts as held): longer than a change of the accounts Secret takes to reach the server
# (the kubelet's Secret sync, about a minute, then the chart's reloader).
RETIRE_S = 300.0
# A reservation whose job is not in the operator's index is a deleted job's (deleted while no
# operator ran its finalizer), unless it is younger than this: the index may not have seen a job
# another replica admitted a moment ago.
UNSEEN_S = 60.0
CONFLICT_TRIES = 5  # decisions made again on books another replica wrote meanwhile


def retire_seconds() -> float:
    return float(os.environ.get(OperatorEnv.NATS_RETIRE_SECONDS) or RETIRE_S)


@dataclass(frozen=True)
class JobRecord:
    uid: str
    held: int  # status.natsReservedBytes: what its status says it holds in the chart's NATS store


@dataclass(frozen=True)
class Books:
    """Who holds room in the store (by job uid: namespace, name, bytes, since when), and the
    accounts retiring (by account: namespace, bytes, since when), in wall-clock seconds: the
    replicas share them."""

    held: dict[str, tuple[str, str, int, float]] = field(default_factory=dict)
    retired: dict[str, tuple[str, int, float]] = field(default_factory=dict)

    def dumps(self) -> str:
        return json.dumps({"held": self.held, "retired": self.retired}, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def loads(text: str) -> Books:
        raw = json.loads(text)
        return Books(
            {u: (str(ns), str(n), int(b), float(t)) for u, (ns, n, b, t) in raw["held"].items()},
            {a: (str(ns), int(b), float(t)) for a, (ns, b, t) in raw["retired"].items()},
        )

    @staticmethod
    def from_statuses(index: Mapping[tuple[str, str], Iterable[JobRecord]], now: float) -> Books:
        """Books no one has kept yet (a first decision, or the Secret made anew): what the jobs'
        statuses say they hold."""
        return Books({r.uid: (ns, n, r.held, now) for (ns, n), rs in index.items() for r in rs if r.held > 0})

    def bytes_held(self, uid: str) -> int:
        return self.held[uid][2] if uid in self.held else 0

    def accounts(self, replicas: int) -> list[tuple[str, str, str, int]]:
        """The enabled accounts (namespace, name, uid, bytes of every copy)."""
        return [(ns, n, uid, b * replicas) for uid, (ns, n, b, _) in self.held.items()]


def decide(
    books: Books,
    index: Mapping[tuple[str, str], Iterable[JobRecord]],
    job: tuple[str, str, str, int],
    cfg: OperatorConfig,
    now: float,
    retire_s: float,
) -> tuple[str | None, Books]:
    """Take, keep or give back (need 0) the room of `job` (uid, namespace, name, need): why it
    must wait, if it must (it holds nothing then), and the books after. A running job whose update
    needs more than there is keeps what it holds. Accounts no longer held retire for `retire_s`
    (nats-server keeps the storage of an account dropped from its configuration reserved until it
    restarts, nats-io/nats-server#3420, and releases it when the account's JetStream is disabled;
    so a job's account is disabled first and dropped once the server has had time to reload that),
    and their room counts as held until then: a reload that enabled an account into room another
    in the same reload gives back could fail (the server takes accounts in no set order, and stops
    at the first it cannot enable)."""
    uid, namespace, name, need = job
    seen = {r.uid for rs in index.values() for r in rs}
    held = {u: h for u, h in books.held.items() if u in seen or now - h[3] < UNSEEN_S}
    mine = held.pop(uid, None)
    retiring = {a: r for a, r in books.retired.items() if now - r[2] < retire_s}
    problem = None
    if need and (mine is None or mine[2] != need) and cfg.nats_store_bytes:
        own = job_account(namespace, name, uid)
        others = {u: (ns, b) for u, (ns, _, b, _) in held.items()}
        others |= {a: (ns, b) for a, (ns, b, _) in retiring.items() if a != own}
        problem = admission_problem(cfg.nats_store_bytes, cfg.policy.namespace_share, others, namespace, need)
    if problem and mine:
        held[uid] = mine
    elif need and not problem:
        held[uid] = (namespace, name, need, mine[3] if mine else now)
    enabled = {job_account(ns, n, u) for u, (ns, n, _, _) in held.items()}
    for u, (ns, n, b, _) in books.held.items():
        account = job_account(ns, n, u)
        if account not in enabled and retire_s > 0:
            retiring.setdefault(account, (ns, b, now))
    return problem, Books(held, {a: r for a, r in retiring.items() if a not in enabled})


def store_bytes_needed(job: Any, previous: dict[str, Any], cfg: OperatorConfig, held: int, suspended: bool) -> int:
    """What the job must hold in the chart's NATS store now: its streams' bytes while it runs on
    the install's own NATS; with a spec that no longer parses, what it holds (`held`); suspended
    (as stored, whether its spec reads or not) or finished, nothing (the pass deletes its streams
    first, and gives the room back only then)."""
    if is_terminal(previous) or suspended:
        return 0
    if job is None:
        return held
    return reserved_bytes(job.spec) if on_chart_nats(job) and cfg.nats_bundled else 0


def accounts_secret(name: str, namespace: str, text: str | None, books: Books | None = None) -> dict[str, Any]:
    """The accounts Secret: the accounts file (with the install's key: `text`), and the books."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/name": "pipelinerl", "app.kubernetes.io/component": "nats"},
    }
    if books is not None:
        meta["annotations"] = {NATS_STORE_BOOKS_ANNOTATION: books.dumps()}
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta}
    return secret | ({"data": secret_data({NATS_ACCOUNTS_FILE: text})} if text is not None else {})


def accounts_secret_name() -> tuple[str | None, str | None]:
    """The accounts Secret the chart's NATS includes, and the operator's namespace (where it is)."""
    return os.environ.get(OperatorEnv.NATS_ACCOUNTS_SECRET), os.environ.get(OperatorEnv.NAMESPACE)


@dataclass
class Reservations:
    """The I/O around `decide`: one decision at a time in this process (`lock`), each on the books
    as last written, in the accounts Secret when the chart's NATS has one, else in `memory`."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    memory: Books | None = None

    @staticmethod
    def _secret(kube: Any) -> tuple[str, str] | None:
        secret, namespace = accounts_secret_name()
        return (secret, namespace) if secret and namespace and kube else None

    async def read(self, index: Mapping, kube: Any) -> tuple[Books, str | None, bool]:
        """The books; the Secret's resourceVersion they were read at (None: no Secret, or kept in
        memory); whether they were kept (else they are the statuses' account of them)."""
        where = self._secret(kube)
        if where is None:
            if self.memory is not None:
                return self.memory, None, True
            return Books.from_statuses(index, time.time()), None, False
        obj = await kube.get("v1", "Secret", where[1], where[0]) or {}
        meta = obj.get("metadata") or {}
        try:  # only the operator writes them; books someone else spoiled are made again, as if lost
            return Books.loads(meta["annotations"][NATS_STORE_BOOKS_ANNOTATION]), meta.get("resourceVersion"), True
        except (KeyError, TypeError, ValueError):
            return Books.from_statuses(index, time.time()), meta.get("resourceVersion"), False

    async def write(self, cfg: OperatorConfig, kube: Any, books: Books, version: str | None) -> None:
        """The books and the accounts of the jobs holding room (with the install's key: the chart
        includes them then), on condition that the Secret is still at `version` (else Conflict)."""
        where = self._secret(kube)
        if where is None:
            self.memory = books
            return
        accounts = books.accounts(cfg.nats_replicas)
        text = (
            nats_accounts(cfg.auth_key, accounts, sorted(books.retired), cfg.nats_replicas, cfg.policy.max_job_pods)
            if cfg.auth_key
            else None
        )
        obj = accounts_secret(*where, text, books)
        if version is None:  # no Secret yet
            if not await kube.create(obj):
                raise Conflict(409, "the accounts Secret was made meanwhile")
            return
        obj["metadata"]["resourceVersion"] = version  # the API server's precondition
        await kube.apply(obj)

    async def holding(self, index: Mapping, kube: Any, uid: str) -> int:
        """The bytes the job holds now."""
        books, _, _ = await self.read(index, kube)
        return books.bytes_held(uid)

    async def reserve(
        self, index: Mapping, cfg: OperatorConfig, kube: Any, uid: str, namespace: str, name: str, need: int
    ) -> tuple[str | None, int]:
        """Take, keep or give back (`need` 0) the job's reservation (`decide`), and write the
        books and accounts when they change. Returns why the job must wait, if it must, and the
        bytes it holds."""
        # Accounts retire only where they are written (the Secret, with the install's key).
        retire_s = retire_seconds() if cfg.auth_key and self._secret(kube) else 0.0
        async with self.lock:
            for _ in range(CONFLICT_TRIES):
                books, version, kept = await self.read(index, kube)
                problem, after = decide(books, index, (uid, namespace, name, need), cfg, time.time(), retire_s)
                try:
                    if after != books or not kept:
                        await self.write(cfg, kube, after, version)
                except Conflict:
                    continue
                return problem, after.bytes_held(uid)
        raise RuntimeError(
            f"the NATS store's books changed under {CONFLICT_TRIES} decisions in a row: the next pass decides again"
        )
