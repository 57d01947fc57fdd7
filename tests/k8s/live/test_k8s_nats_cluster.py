"""The chart's NATS as a JetStream cluster (`nats.replicas: 3`): three real nats-server processes
on the configuration Helm renders (addresses moved to loopback), the job's streams created as
the services create them with the replica count the operator gives their pods; one server
SIGKILLed, nothing acknowledged is lost and the job's streams take writes on."""

from __future__ import annotations

import asyncio
import base64
import re
import signal
import socket
import subprocess
import time

import nats
from chart import render as render_chart

from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl_cli.embedded_nats import nats_server_binary
from pipelinerl.ports import free_port
from pipelinerl.spec import parse_job
from pipelinerl.streams import connect
from pipelinerl.store import ensure_streams
from pipelinerl_operator.job_policy import parse_policy
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.render import render

SUBJECTS = JobSubjects("demo", "team-a")


def chart_objects(replicas: int) -> list[dict]:
    return render_chart({"nats": {"replicas": replicas}, "auth": {"enabled": False}, "acknowledgeInsecure": True})


def test_the_chart_renders_a_cluster_and_the_operator_replicates_job_streams_on_it() -> None:
    objects = chart_objects(3)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert (
        next(
            o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "rl-pipelinerl-nats"
        )["spec"]["maxUnavailable"]
        == 1
    )
    operator = next(o for o in objects if o["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PIPELINERL_NATS_REPLICAS"] == "3"
    # The operator tells a job's pods to keep each stream on every server (on the chart's NATS only).
    for spec, expected in (({}, 3), ({"nats": {"url": "nats://elsewhere:4222"}}, None)):
        job = parse_job({"metadata": {"name": "demo"}, "spec": spec})
        cfg = OperatorConfig(nats_replicas=3, policy=parse_policy({"natsServers": ["elsewhere:4222"]}))
        pod = next(o for o in render(job, "team-a", "u", cfg) if o["kind"] == "StatefulSet")
        environ = {
            e["name"]: e["value"] for e in pod["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e
        }
        assert ServiceEnv.from_environ("trainer", environ).stream_replicas == expected
    single = chart_objects(1)
    assert (
        "cluster {"
        not in next(o for o in single if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-nats"))["data"][
            "nats.conf"
        ]
    )
    assert not [
        o for o in single if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "rl-pipelinerl-nats"
    ]


class Cluster:
    """Each server as its pod runs it: the chart's nats.conf, and its container's environment
    (the route password from the chart's Secret, the route URLs the kubelet expands it into)."""

    def __init__(self, root, size: int = 3):
        objects = chart_objects(size)
        conf = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rl-pipelinerl-nats")
        template = conf["data"]["nats.conf"]
        routes_secret = next(
            o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "rl-pipelinerl-nats-routes"
        )
        self.password = base64.b64decode(routes_secret["data"]["password"]).decode()
        assert self.password not in template  # the configuration carries no password
        sts = next(o for o in objects if o["kind"] == "StatefulSet")
        env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["ROUTE_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "rl-pipelinerl-nats-routes",
            "key": "password",
        }
        self.client = [free_port() for _ in range(size)]
        self.cluster = [free_port() for _ in range(size)]
        routes = {}
        for j in range(size):  # one route per server, by pod DNS name → this machine's ports
            url = env[f"ROUTE_{j}"]["value"]
            assert url == f"nats://route:$(ROUTE_PASSWORD)@rl-pipelinerl-nats-{j}.rl-pipelinerl-nats.team-a.svc:6222"
            routes[f"ROUTE_{j}"] = f"nats://route:{self.password}@127.0.0.1:{self.cluster[j]}"
        self.procs: list[subprocess.Popen | None] = []
        for i in range(size):
            text = re.sub(r"^port: 4222$", f"port: {self.client[i]}", template, flags=re.M)
            text = text.replace("  port: 6222", f"  port: {self.cluster[i]}")
            text = text.replace('http: "127.0.0.1:8222"', f'http: "127.0.0.1:{free_port()}"')
            text = text.replace("/var/run/nats", str(root / f"s{i}")).replace(
                "/data/jetstream", str(root / f"s{i}" / "js")
            )
            (root / f"s{i}" / "etc").mkdir(parents=True, exist_ok=True)
            (root / f"s{i}" / "etc" / "nats.conf").write_text(text)
            self.procs.append(
                subprocess.Popen(
                    [nats_server_binary(), "-c", str(root / f"s{i}" / "etc" / "nats.conf")],
                    env={"POD_NAME": f"rl-pipelinerl-nats-{i}", "ROUTE_PASSWORD": self.password, **routes},
                    stdout=open(root / f"s{i}" / "log", "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        for port in self.client:
            wait_for_port(port)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.client]

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_job_streams_on_a_three_server_cluster_survive_losing_one(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        nc = await connect(",".join(cluster.urls), "test")  # as the services connect (`nats.url` takes a list)
        js = nc.jetstream(timeout=5)
        await retried(lambda: ensure_streams(js, SUBJECTS, 1, replicas=3), "a JetStream cluster formed")
        info = await js.stream_info(SUBJECTS.stream("BATCHES"))
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2  # a leader and two copies
        await publish(js, "before")
        cluster.kill(int(info.cluster.leader.rsplit("-", 1)[1]))  # the stream's leader itself
        await retried(lambda: publish(js, "after"), "writes after losing a server")  # a new leader takes them
        got = await retried(lambda: read(js), "reads after losing a server")
        assert got == [f"{w}-{i}" for w in ("before", "after") for i in range(20)]  # nothing lost, nothing twice
        await nc.close()
    finally:
        cluster.stop()


async def test_claims_and_give_backs_racing_on_a_replicated_stream_draw_every_index_once(tmp_path) -> None:
    """Generators on each server of a cluster claim problems and give some back, all at once, on the
    job's replicated CONTROL stream, where an append another came first to may be refused as
    10164 (not 10071) and a refused message id is kept as in process (10158): no claim fails, no
    index is kept twice, and every index claimed is kept once or waits to be drawn again."""
    from pipelinerl.claims import Claims, indices, with_indices
    from pipelinerl.streams import claim_problems, give_back_problems

    cluster = Cluster(tmp_path)
    try:
        ncs = [await connect(url, f"generator-{i}") for i, url in enumerate(cluster.urls)]
        await retried(lambda: ensure_streams(ncs[0].jetstream(timeout=5), SUBJECTS, 1, replicas=3), "a cluster formed")

        async def generator(rank: int, nc) -> list[int]:
            js, kept = nc.jetstream(timeout=5), []
            for _ in range(12):
                taken = await claim_problems(js, SUBJECTS, 3, timeout_s=60)
                kept += taken[:2]
                await give_back_problems(js, SUBJECTS, rank, with_indices([], taken[2:]), timeout_s=60)
            return kept

        kept = [i for got in await asyncio.gather(*(generator(r, nc) for r, nc in enumerate(ncs))) for i in got]
        last = await ncs[0].jetstream(timeout=5).get_last_msg(SUBJECTS.stream("CONTROL"), SUBJECTS.problems)
        claims = Claims.parse(last.data.decode())
        assert len(kept) == len(set(kept)) == 3 * 12 * 2
        assert sorted(kept + indices(claims.redraw)) == list(range(claims.next))
        for nc in ncs:
            await nc.close()
    finally:
        cluster.stop()


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 10
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def outsider(root, name: str, route: str) -> tuple[subprocess.Popen, int]:
    """A nats-server started by someone else, routed to the cluster's first server."""
    port, cluster_port = free_port(), free_port()
    (root / name).mkdir()
    (root / name / "nats.conf").write_text(
        f"port: {port}\nserver_name: {name}\n"
        f"cluster {{ name: rl-pipelinerl-nats, port: {cluster_port}, routes: [{route}] }}\n"
    )
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(root / name / "nats.conf")],
        stdout=open(root / name / "log", "wb"),
        stderr=subprocess.STDOUT,
    )
    wait_for_port(port)
    return proc, port


async def test_a_server_without_the_route_password_never_joins(tmp_path) -> None:
    """Routes are authenticated: a rogue server routed to a member gets none of the cluster's
    messages; one given the route password does (the control: the route itself works)."""
    cluster = Cluster(tmp_path)
    procs = []
    try:
        rogue, rogue_port = outsider(tmp_path, "rogue", f"nats://127.0.0.1:{cluster.cluster[0]}")
        peer, peer_port = outsider(tmp_path, "peer", f"nats://route:{cluster.password}@127.0.0.1:{cluster.cluster[0]}")
        procs = [rogue, peer]
        inside = await nats.connect(cluster.urls[0])
        listeners = {}
        for name, port in (("rogue", rogue_port), ("peer", peer_port)):
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            listeners[name] = (nc, await nc.subscribe("prl.team-a.demo.>"))

        async def heard(name: str) -> bool:
            try:
                await listeners[name][1].next_msg(timeout=0.3)
                return True
            except nats.errors.TimeoutError:
                return False

        async def peer_hears() -> None:
            await inside.publish("prl.team-a.demo.version", b"v")
            assert await heard("peer")

        await retried(peer_hears, "the peer with the password routed in")
        for _ in range(5):
            await inside.publish("prl.team-a.demo.version", b"secret")
        assert not await heard("rogue")
        for nc, _ in listeners.values():
            await nc.close()
        await inside.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cluster.stop()


async def retried(step, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await step()
        except Exception as err:  # noqa: BLE001 - no JetStream leader (yet)
            assert time.monotonic() < deadline, f"no {what} in {timeout_s:g} s: {err!r}"
            await asyncio.sleep(0.5)


async def publish(js, what: str) -> None:
    for i in range(20):  # retried as a whole: the message ids keep each once
        await js.publish(SUBJECTS.batches(0), f"{what}-{i}".encode(), headers={"Nats-Msg-Id": f"{what}-{i}"})


async def read(js) -> list[str]:
    sub = await js.subscribe(SUBJECTS.batches(0), ordered_consumer=True)
    got = []
    try:
        while True:
            try:
                got.append((await sub.next_msg(timeout=1)).data.decode())
            except nats.errors.TimeoutError:
                return got
    finally:
        await sub.unsubscribe()
