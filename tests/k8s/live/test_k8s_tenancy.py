"""One job's pods cannot read, write or join another's streams: the operator (real kopf against
kmock) writes each job's credentials and the NATS accounts; a real nats-server runs the chart's
own nats.conf (rendered by Helm) with the accounts the operator wrote, as the chart's NATS pod
does (its reloader sidecar's SIGHUP is sent by the test)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from operator_harness import JOBS, NS, collect_garbage, eventually, running_operator
from chart import render as render_chart
from job_views import condition, events, manifest, obj, status

from pipelinerl.capacity import stream_bytes
from pipelinerl.contracts import NATS_ACCOUNTS_FILE, JobSubjects, OperatorEnv
from pipelinerl.reserved import CREDENTIALS_SUFFIX
from pipelinerl_cli.embedded_nats import nats_server_binary
from pipelinerl.ports import free_port
from pipelinerl.spec import parse_job
from pipelinerl.messages import Checkpointed, encode
from pipelinerl.streams import claim_problems, last_announcement, problems_claimed
from pipelinerl.store import ensure_streams, store_identity
from pipelinerl_operator.credentials import nats_accounts

ACCOUNTS_SECRET = "rl-pipelinerl-nats-accounts"  # the chart's name for it (release "rl")
SECRETS = "v1/secrets"


def decoded(secret: dict | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in ((secret or {}).get("data") or {}).items()}


def credentials(emulator, job: str) -> dict[str, str] | None:
    """The job's credentials Secret's values (its name has the job's uid in it)."""
    uid = (obj(emulator, JOBS, job) or {}).get("metadata", {}).get("uid")
    return decoded(obj(emulator, SECRETS, f"{job}-{uid[:8]}{CREDENTIALS_SUFFIX}")) if uid else None


class ChartNats:
    """nats-server started on the chart's nats.conf, its paths and ports moved under `root`."""

    def __init__(self, root: Path):
        conf = next(
            o for o in render_chart({}) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rl-pipelinerl-nats"
        )
        self.port, self.root = free_port(), root
        text = conf["data"]["nats.conf"]
        assert 'include "../nats-accounts/accounts.conf"' in text  # where the chart mounts the accounts Secret
        text = re.sub(r"^port: 4222$", f"port: {self.port}", text, flags=re.M)
        text = text.replace('http: "127.0.0.1:8222"', f'http: "127.0.0.1:{free_port()}"')
        text = text.replace("/data/jetstream", str(root / "jetstream")).replace("/var/run/nats", str(root))
        self.max_file_store = int(re.search(r"max_file_store: ([0-9]+)", text)[1])  # type: ignore[index]
        (root / "nats").mkdir(parents=True)
        (root / "nats" / "nats.conf").write_text(text)
        (root / "nats-accounts").mkdir()
        self.proc: subprocess.Popen | None = None

    def accounts(self, text: str) -> None:
        (self.root / "nats-accounts" / NATS_ACCOUNTS_FILE).write_text(text)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(self.root / "nats" / "nats.conf")],
            stdout=open(self.root / "nats.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while socket.socket().connect_ex(("127.0.0.1", self.port)) != 0:
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.root / "nats.log").read_text()
            time.sleep(0.05)

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)

    @contextlib.asynccontextmanager
    async def following(self, emulator) -> AsyncIterator[None]:
        """What the chart's reloader sidecar does: each change of the accounts Secret written to
        the server's file, and the server reloaded (checked, with its log, for JetStream errors)."""

        async def follow() -> None:
            written = None
            while True:
                text = decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET)).get(NATS_ACCOUNTS_FILE)
                if text and text != written:
                    self.accounts(text)
                    self.reload()
                    written = text
                await asyncio.sleep(0.2)

        task = asyncio.create_task(follow())
        try:
            yield
        finally:
            task.cancel()
        assert "Error enabling jetstream" not in (self.root / "nats.log").read_text()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()


def on_chart_nats(monkeypatch, server: ChartNats, **more: str) -> None:
    """The operator's settings as the chart writes them for its own NATS (`server`)."""
    for name, value in {
        OperatorEnv.AUTH_KEY: "install-key",
        OperatorEnv.NATS_ACCOUNTS_SECRET: ACCOUNTS_SECRET,
        OperatorEnv.NAMESPACE: NS,
        OperatorEnv.DEFAULT_NATS_URL: server.url,
        **more,
    }.items():
        monkeypatch.setenv(name, value)


async def refused(url: str, **creds) -> bool:
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **creds)
    except Exception as err:  # noqa: BLE001
        return "Authorization Violation" in str(err)
    await nc.close()
    return False


async def test_a_jobs_account_takes_no_more_of_the_server_than_its_limits(tmp_path) -> None:
    """Whatever a job's pods run, its account takes the shared server's connections and
    subscriptions only up to its limits (jobPolicy.maxJobPods: 1 here, 32 connections), and no
    stream of one copy larger than one copy of its room (2 replicas here: half its bytes), which
    on a replicated NATS would put all of it on one server. The server is the chart's, real."""
    from pipelinerl_operator.credentials import job_credentials

    server = ChartNats(tmp_path)
    need = 64 << 20
    server.accounts(nats_accounts("install-key", [(NS, "demo", "u1", need)], replicas=2, max_job_pods=1))
    server.start()
    creds = job_credentials("install-key", NS, "demo", "u1")
    login = {"user": creds["natsUser"], "password": creds["natsPassword"]}
    conns = []
    try:
        for _ in range(32):
            conns.append(await nats.connect(server.url, allow_reconnect=False, **login))
        with pytest.raises(Exception, match="maximum account active connections exceeded"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **login)
        js = conns[0].jetstream()
        config = nats.js.api.StreamConfig(name="big", subjects=["big.>"], max_bytes=need // 2 + 1)
        with pytest.raises(nats.js.errors.APIError, match="maximum|exceed|limit"):
            await js.add_stream(config)
        await js.add_stream(nats.js.api.StreamConfig(name="fits", subjects=["fits.>"], max_bytes=need // 2))
    finally:
        for nc in conns:
            await nc.close()
        server.stop()


async def test_each_job_has_its_own_nats_account_and_no_other_client_gets_in(cluster, tmp_path, monkeypatch) -> None:
    emulator, api, _ = cluster
    server = ChartNats(tmp_path)
    on_chart_nats(monkeypatch, server)
    try:
        async with running_operator(str(emulator.url)):
            for job in ("demo", "other"):
                await api.create_job(manifest(job))
            both = lambda: (  # noqa: E731
                '"team-a.demo.' in (a := decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET)).get(NATS_ACCOUNTS_FILE, ""))
                and '"team-a.other.' in a
                and a
            )  # noqa: E731
            server.accounts(await eventually(both, what="both jobs' accounts"))
            server.start()
            creds = {job: await eventually(lambda j=job: credentials(emulator, j)) for job in ("demo", "other")}
            login = {job: {"user": c["natsUser"], "password": c["natsPassword"]} for job, c in creds.items()}

            # The job's pods, with its Secret's values: they create and use its streams.
            demo = await nats.connect(server.url, **login["demo"])
            sizes = stream_bytes(parse_job(manifest("demo")).spec)  # as its pods size them: its account's limit
            await ensure_streams(demo.jetstream(), JobSubjects("demo", NS), 1, sizes=sizes)
            await demo.jetstream().publish(JobSubjects("demo", NS).version, b"v1")
            # Anyone else: refused without credentials, with another job's password, or a guess.
            assert await refused(server.url)
            assert await refused(server.url, user="team-a.demo", password=creds["other"]["natsPassword"])
            assert await refused(server.url, user="team-a.demo", password="guess")
            # Another job's pods see nothing of it: not its streams, not its messages.
            other = await nats.connect(server.url, **login["other"])
            assert await other.jetstream().streams_info() == []
            # Nor can it reserve more of the store than its own streams' sizes (its account's limit).
            with pytest.raises(nats.js.errors.APIError, match="insufficient|limit|exceed"):
                await ensure_streams(
                    other.jetstream(), JobSubjects("other", NS), 1, sizes={k: 10 * v for k, v in sizes.items()}
                )
            sub = await other.subscribe(JobSubjects("demo", NS).version)
            await demo.publish(JobSubjects("demo", NS).version, b"v2")
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.5)

            # Deleting the job deletes its streams (as its own user), then retires its account: no
            # user, JetStream disabled (which gives its room back on the running server; dropping
            # the account would keep it reserved until a restart), dropped later.
            await api.delete_job("demo")
            await eventually(
                lambda: re.search(
                    r'"team-a\.demo\.[^"]+": \{ jetstream: disabled \}',
                    decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET))[NATS_ACCOUNTS_FILE],
                ),
                what="the account retired",
            )
            assert await eventually(lambda: set(events(emulator)) & {"StreamsDeleted", "StreamsDeleteFailed"}) == {
                "StreamsDeleted"
            }
            await demo.close()
            server.accounts(decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET))[NATS_ACCOUNTS_FILE])
            server.reload()
            deadline = time.monotonic() + 10  # the reload takes effect when the server gets to it (a loaded machine)
            while not await refused(server.url, **login["demo"]):
                assert time.monotonic() < deadline, "the deleted job's credentials still work after the reload"
                await asyncio.sleep(0.2)
            assert other.is_connected and other.stats["reconnects"] == 0  # the reload left other accounts alone
            await other.close()
    finally:
        server.stop()


async def test_a_job_of_an_earlier_jobs_name_never_sees_its_data(cluster, tmp_path, monkeypatch) -> None:
    """The job is deleted while NATS is down, so its streams stay on the volume; a new job of the
    same name (another uid) gets an account of its own, and finds none of them."""
    emulator, api, _ = cluster
    server = ChartNats(tmp_path)
    on_chart_nats(monkeypatch, server)
    accounts = lambda: decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET)).get(NATS_ACCOUNTS_FILE, "")  # noqa: E731
    subjects = JobSubjects("demo", NS)
    try:
        async with running_operator(str(emulator.url)):
            await api.create_job(manifest("demo"))
            server.accounts(await eventually(lambda: '"team-a.demo.' in accounts() and accounts(), what="account"))
            server.start()
            old = await eventually(lambda: credentials(emulator, "demo"))
            nc = await nats.connect(server.url, user=old["natsUser"], password=old["natsPassword"])
            await ensure_streams(nc.jetstream(), subjects, 1, sizes=stream_bytes(parse_job(manifest("demo")).spec))
            await nc.jetstream().publish(subjects.version, b"the earlier job's")
            await nc.close()
            server.stop()

            uid = obj(emulator, JOBS, "demo")["metadata"]["uid"]
            await api.delete_job("demo")
            await eventually(lambda: obj(emulator, JOBS, "demo") is None, what="deleted")
            assert "StreamsDeleteFailed" in events(emulator)
            await collect_garbage(emulator, api, uid)
            assert any(p.name == subjects.stream("CONTROL") for p in (tmp_path / "jetstream").rglob("*"))  # left

            await api.create_job(manifest("demo"))
            new = await eventually(lambda: credentials(emulator, "demo"))
            assert new["natsPassword"] != old["natsPassword"]
            server.accounts(await eventually(lambda: '"team-a.demo.' in accounts() and accounts(), what="account"))
            server.start()
            nc = await nats.connect(server.url, user=new["natsUser"], password=new["natsPassword"])
            assert await nc.jetstream().streams_info() == []  # the earlier job's streams are not in its account
            await nc.close()
    finally:
        server.stop()


async def test_the_operator_creates_the_accounts_secret_nats_waits_for_and_never_resets_it(
    cluster, monkeypatch
) -> None:
    """No render of the chart writes the accounts Secret (a GitOps sync would log every job out):
    the operator creates it at start-up with its own account alone, and leaves one that exists."""
    emulator, api, _ = cluster
    for name, value in {
        OperatorEnv.AUTH_KEY: "install-key",
        OperatorEnv.NATS_ACCOUNTS_SECRET: ACCOUNTS_SECRET,
        OperatorEnv.NAMESPACE: NS,
    }.items():
        monkeypatch.setenv(name, value)
    async with running_operator(str(emulator.url)):
        first = await eventually(lambda: decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET) or {}).get(NATS_ACCOUNTS_FILE))
        assert '"pipelinerl"' in first and "jetstream" not in first  # the operator's account, no job's
    assert not [o for o in render_chart({}) if o["kind"] == "Secret" and o["metadata"]["name"] == ACCOUNTS_SECRET]
    await api._call(
        "PATCH",
        f"/api/v1/namespaces/{NS}/secrets/{ACCOUNTS_SECRET}",
        {"data": {NATS_ACCOUNTS_FILE: base64.b64encode(b"# jobs' accounts").decode()}},
    )
    async with running_operator(str(emulator.url)):  # a restart leaves what is there
        await asyncio.sleep(1)
        assert decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET))[NATS_ACCOUNTS_FILE] == "# jobs' accounts"


def big(name: str) -> dict:
    """A job whose streams need about 7 GiB: the chart's default store (18 GiB) holds two."""
    return manifest(
        name,
        model={"maxSeqLen": 1024},
        generator={"replicas": 2, "sampling": {"maxTokens": 512}},
        trainer={"samplesPerStep": 2048, "microBatchTokens": 4096, "checkpointInterval": 67},
    )


async def test_nats_starts_whatever_jobs_exist_and_only_running_jobs_have_accounts(
    cluster, tmp_path, monkeypatch
) -> None:
    """Three jobs that each need more than a third of the chart's NATS store: the operator admits
    two, and the third waits without an account; the chart's nats-server (its own nats.conf, the
    accounts the operator wrote) starts. The accounts of all three (what an operator granting
    every job its limit would write) stop it at start-up: the next restart of NATS would have
    taken it from every job. A suspended or finished job gives its account back."""
    from pipelinerl.capacity import reserved_bytes

    emulator, api, trainer = cluster
    server = ChartNats(tmp_path)
    store = server.max_file_store
    need = reserved_bytes(parse_job(big("one")).spec)
    assert 2 * need <= store < 3 * need
    on_chart_nats(
        monkeypatch, server, **{OperatorEnv.NATS_STORE_BYTES: str(store), OperatorEnv.NATS_RETIRE_SECONDS: "3"}
    )
    accounts = lambda: decoded(obj(emulator, SECRETS, ACCOUNTS_SECRET)).get(NATS_ACCOUNTS_FILE, "")  # noqa: E731
    jobs_in = lambda: sorted(re.findall(r'"team-a\.([a-z]+)\.[-0-9a-z]+": \{ jetstream: \{', accounts()))  # noqa: E731
    try:
        async with running_operator(str(emulator.url)):
            for name in ("one", "two"):
                await api.create_job(big(name))
                await eventually(lambda n=name: n in jobs_in(), timeout_s=40, what=f"{name}'s account")
            await api.create_job(big("three"))
            await eventually(
                lambda: condition(emulator, "Ready", "three").get("reason") == "ApplyRefused",
                timeout_s=20,
                what="waits",
            )
            assert jobs_in() == ["one", "two"] and status(emulator, "three")["natsReservedBytes"] == 0
            server.accounts(accounts())
            server.start()  # it starts: the accounts' limits fit in its store
            await (await nats.connect(server.url, user="pipelinerl", password=operator_password())).close()
            server.stop()

            # What granting every job its limit would have written: nats-server refuses to start.
            every = nats_accounts("install-key", [(NS, n, f"uid-{n}", need) for n in ("one", "two", "three")])
            blocked = ChartNats(tmp_path / "blocked")
            blocked.accounts(every)
            with pytest.raises(AssertionError, match="insufficient storage"):
                blocked.start()

            # The chart's reloader from here on. The jobs' pods: their streams, and one's trainer
            # has told its newest checkpoint.
            server.start()
            async with server.following(emulator):
                login = {n: credentials(emulator, n) for n in ("one", "two")}
                for n, c in login.items():
                    nc = await nats.connect(server.url, user=c["natsUser"], password=c["natsPassword"])
                    sizes = stream_bytes(parse_job(big(n)).spec)
                    await ensure_streams(nc.jetstream(), JobSubjects(n, NS), 1, sizes=sizes)
                    if n == "one":
                        identity = await store_identity(nc.jetstream(), JobSubjects(n, NS))
                        told = Checkpointed(store=identity.id, step=7, problems=123, redraw="100-101,120")
                        await nc.jetstream().publish(JobSubjects(n, NS).checkpoint, encode(told))
                    await nc.close()

                # Suspended: once its pods are gone, its checkpoint record kept in its status, its
                # streams deleted (as its user), then its account retired (JetStream disabled, which
                # gives its room back on the running server) and, once the server has had that, the
                # waiting job's account enabled into the room.
                await api.patch_job("one", {"spec": {"suspend": True}})
                await eventually(
                    lambda: (
                        status(emulator, "one").get("suspendedStore")
                        == {"store": identity.id, "step": 7, "problems": 123, "redraw": "100-101,120"}
                        and status(emulator, "one")["natsReservedBytes"] == 0
                    ),
                    timeout_s=60,
                    what="its checkpoint kept, its room given back",
                )
                await eventually(lambda: jobs_in() == ["three", "two"], timeout_s=60, what="the waiting job's account")
                # Finished: its streams deleted (as its user), then its account retired.
                trainer.reports["two"] = {
                    "step": 50,
                    "version": 50,
                    "maxSteps": 50,
                    "finished": True,
                    "weightSyncReady": True,
                }
                for role, n in (("generator", 2), ("preprocessor", 1), ("trainer", 2)):
                    await api.set_sts_status(f"two-prl-{role}", n, n)
                await eventually(lambda: status(emulator, "two").get("phase") == "Succeeded", timeout_s=60, what="done")
                await eventually(  # (kopf retries a resync whose request failed 60 s later)
                    lambda: jobs_in() == ["three"], timeout_s=120, what="the finished job's account retired"
                )
                await eventually(
                    lambda: events(emulator).count("StreamsDeleted") >= 2, what="one's and two's, as their users"
                )
                await eventually(
                    lambda: status(emulator, "two")["natsReservedBytes"] == 0, timeout_s=60, what="said in its status"
                )

                # Resumed (there is room again): its account comes back; once the server has it, the
                # operator makes its store go on from the checkpoint, and only then starts its pods.
                await api.patch_job("one", {"spec": {"suspend": False}})
                await eventually(lambda: jobs_in() == ["one", "three"], timeout_s=60, what="its account back")
                await eventually(lambda: "StoreRestored" in events(emulator), timeout_s=60, what="the store restored")
                await eventually(
                    lambda: (
                        not status(emulator, "one").get("suspendedStore")
                        and obj(emulator, "apps/v1/statefulsets", "one-prl-trainer")["spec"]["replicas"] == 2
                    ),
                    timeout_s=60,
                    what="its pods started",
                )
                ones, one = JobSubjects("one", NS), login["one"]
                nc = await nats.connect(server.url, user=one["natsUser"], password=one["natsPassword"])
                restored = await store_identity(nc.jetstream(), ones)
                assert (restored.adopts, restored.adopted_step) == (identity.id, 7)
                assert (await last_announcement(nc.jetstream(), ones)).version == 7
                assert await problems_claimed(nc.jetstream(), ones) == 123
                # Those claimed at the checkpoint and not settled by it, drawn again first.
                assert await claim_problems(nc.jetstream(), ones, 4) == [100, 101, 120, 123]
                await nc.close()
    finally:
        server.stop()


def operator_password() -> str:
    from pipelinerl_operator.credentials import _derive

    return _derive("install-key", "operator")
