"""The NATS store's books are one: kept in the accounts Secret and written on condition of its
version, so two operator replicas deciding at once (kopf's peering is a turn, not a lock) never
give the same room twice. Against kmock's emulator (a mock of the API server: nothing real runs
one here), which answers 409 to a write on condition of a version the object has left, as the
API server does; the decisions themselves are in tests/k8s/pure/test_k8s_nats_books.py."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys

import kopf
import pytest
from job_views import condition, manifest, obj, status
from operator_harness import JOBS, NS, eventually

from pipelinerl.capacity import reserved_bytes
from pipelinerl.contracts import NATS_ACCOUNTS_FILE, NATS_STORE_BOOKS_ANNOTATION, OperatorEnv
from pipelinerl.ports import free_port
from pipelinerl.spec import parse_job
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.kube import Kube
from pipelinerl_operator.nats_store import Books, JobRecord, Reservations, accounts_secret

SECRET = "rl-pipelinerl-nats-accounts"
SECRETS = "v1/secrets"
GIB = 1 << 30


def books_of(emulator) -> Books:
    return Books.loads(obj(emulator, SECRETS, SECRET)["metadata"]["annotations"][NATS_STORE_BOOKS_ANNOTATION])


def accounts_of(emulator) -> str:
    return base64.b64decode(obj(emulator, SECRETS, SECRET)["data"][NATS_ACCOUNTS_FILE]).decode()


@pytest.fixture
def cfg(monkeypatch) -> OperatorConfig:
    """The operator's settings with the chart's accounts Secret, which keeps the books: a 10 GiB store."""
    for name, value in {OperatorEnv.NATS_ACCOUNTS_SECRET: SECRET, OperatorEnv.NAMESPACE: NS}.items():
        monkeypatch.setenv(name, value)
    return OperatorConfig(auth_key="install-key", nats_store_bytes=10 * GIB)


class ReadTogether:
    """A replica's API client whose first read of the books waits for the other replica's: both
    decide on the same books, and then both write."""

    def __init__(self, kube: Kube, both: asyncio.Barrier):
        self.kube, self.both, self.reads = kube, both, 0

    async def get(self, *args):
        got = await self.kube.get(*args)
        self.reads += 1
        if self.reads == 1:
            await self.both.wait()
        return got

    def __getattr__(self, name):
        return getattr(self.kube, name)


async def test_two_replicas_deciding_on_the_same_books_admit_one_job(cluster, cfg) -> None:
    """Two jobs that each fit the store but not together, decided at once by two replicas that
    both read the books before either writes: the second write is refused (409), its replica
    reads the first one's books and refuses its job. One account is written, and the books say
    the same. (An unconditional write would have admitted both: 12 GiB into a 10 GiB store.)"""
    emulator, _, _ = cluster
    seen = {(NS, "one"): [JobRecord("u1", 0)], (NS, "two"): [JobRecord("u2", 0)]}
    info = kopf.ConnectionInfo(server=str(emulator.url))
    kubes = [Kube(info), Kube(info)]
    try:
        assert await kubes[0].create(accounts_secret(SECRET, NS, "# the operator's account alone"))
        both = asyncio.Barrier(2)
        clients = [ReadTogether(k, both) for k in kubes]
        decided = await asyncio.wait_for(
            asyncio.gather(
                Reservations().reserve(seen, cfg, clients[0], "u1", NS, "one", 6 * GIB),
                Reservations().reserve(seen, cfg, clients[1], "u2", NS, "two", 6 * GIB),
            ),
            timeout=30,
        )
        admitted = [uid for uid, (problem, held) in zip(("u1", "u2"), decided) if problem is None and held]
        refused = [problem for problem, held in decided if problem and not held]
        assert len(admitted) == 1 and len(refused) == 1 and "cannot hold this job's streams" in refused[0]
        assert sorted(c.reads for c in clients) == [1, 2]  # the loser read the books again
        assert set(books_of(emulator).held) == set(admitted)
        winner = "one" if admitted == ["u1"] else "two"
        assert f'"{NS}.{winner}.{admitted[0]}"' in accounts_of(emulator) and accounts_of(emulator).count("user:") == 2
    finally:
        for k in kubes:
            await k.close()


async def test_books_spoiled_or_lost_are_made_again_from_the_jobs_statuses(cluster, cfg) -> None:
    """Only the operator writes the books; an annotation someone spoiled (or a Secret made anew,
    without one) is read as the jobs' statuses say, and written again at the next decision."""
    emulator, _, _ = cluster
    seen = {(NS, "one"): [JobRecord("u1", 6 * GIB)], (NS, "two"): [JobRecord("u2", 0)]}
    kube = Kube(kopf.ConnectionInfo(server=str(emulator.url)))
    try:
        spoiled = accounts_secret(SECRET, NS, "# accounts")
        spoiled["metadata"]["annotations"] = {NATS_STORE_BOOKS_ANNOTATION: "{not json"}
        assert await kube.create(spoiled)
        problem, held = await Reservations().reserve(seen, cfg, kube, "u2", NS, "two", 6 * GIB)
        assert problem and held == 0  # one's 6 GiB, from its status, still count
        assert set(books_of(emulator).held) == {"u1"} and f'"{NS}.one.u1"' in accounts_of(emulator)
    finally:
        await kube.close()


async def test_two_operators_reconciling_at_once_admit_the_same_one_job(cluster, tmp_path) -> None:
    """The worst a lapsed turn can do: two operator processes (standalone, both reconciling every
    job, as two replicas do while one is taken for gone) and two jobs created together that each
    fit the store but not together. Both operators agree: one job holds room, the other waits,
    and the books, the accounts and both jobs' statuses say so. (Their decisions rarely meet in
    the same instant here; the test above makes them.)"""
    emulator, api, _ = cluster
    need = reserved_bytes(parse_job(manifest("x")).spec)
    env = {
        **os.environ,
        "PIPELINERL_KUBE_SERVER": str(emulator.url),
        OperatorEnv.WATCH_NAMESPACES: NS,
        OperatorEnv.NAMESPACE: NS,
        OperatorEnv.AUTH_KEY: "install-key",
        OperatorEnv.NATS_ACCOUNTS_SECRET: SECRET,
        OperatorEnv.NATS_STORE_BYTES: str(need * 3 // 2),
        "PIPELINERL_METRICS_PORT": "0",
    }
    procs = []
    try:
        for name in ("replica-a", "replica-b"):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pipelinerl_operator"],
                    env={**env, OperatorEnv.LIVENESS: f"http://127.0.0.1:{free_port()}/healthz"},
                    stdout=open(tmp_path / f"{name}.log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        await eventually(lambda: obj(emulator, SECRETS, SECRET), timeout_s=60, what="the accounts Secret")
        await asyncio.gather(api.create_job(manifest("one")), api.create_job(manifest("two")))

        def settled() -> bool:
            held = {n: status(emulator, n).get("natsReservedBytes") for n in ("one", "two")}
            return sorted(held.values(), key=str) == [0, need] and held

        held = await eventually(settled, timeout_s=90, what="one job admitted, the other waiting")
        winner = next(n for n, b in held.items() if b)
        loser = "two" if winner == "one" else "one"
        await asyncio.sleep(5)  # both operators have had their say on both jobs: nothing changes
        assert {n: status(emulator, n).get("natsReservedBytes") for n in held} == held
        assert condition(emulator, "Ready", loser).get("reason") == "ApplyRefused"
        winner_uid = obj(emulator, JOBS, winner)["metadata"]["uid"]
        assert set(books_of(emulator).held) == {winner_uid}
        assert f'"{NS}.{winner}.' in accounts_of(emulator) and f'"{NS}.{loser}.' not in accounts_of(emulator)
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
