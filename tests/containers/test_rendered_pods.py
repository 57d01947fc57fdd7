"""The tiny job's pods as the operator renders them, run as podman containers from the images
`make images` builds, the way a kubelet would run them (tests/containers/kubelet.py): the chart's
NATS pod with the accounts the operator writes, then the job's StatefulSets' pods, on one
private network whose DNS answers the cluster's names. Mid-run a generator pod is deleted and
made again, then trainer-0's pod is lost and made again, each at another address, and the job goes
on by the pods' names. The job trains to its last step and every service exits 0; each pod's
health endpoint answers while it runs.

`make test-containers` (CI runs it after `make test`): needs root, podman and the images.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from pipelinerl import messages as m
from pipelinerl.capacity import reserved_bytes
from pipelinerl.contracts import HTTP_PORT, JobSubjects
from pipelinerl.spec import parse_job
from pipelinerl.streams import connect, stored_messages
from pipelinerl_operator.config import KEY_STANDIN, from_values
from pipelinerl_operator.credentials import job_credentials, nats_accounts
from pipelinerl_operator.nats_store import accounts_secret
from pipelinerl_operator.render import render

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
from chart import render as render_chart  # noqa: E402

import kubelet  # noqa: E402

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("TAG", "dev")
SERVICES = f"localhost/pipelinerl-services:{TAG}"
OPERATOR = f"localhost/pipelinerl-operator:{TAG}"
VALUES = {
    "services": {"image": {"repository": "localhost/pipelinerl-services", "tag": TAG}, "pullPolicy": "Never"},
    "operator": {"image": {"repository": "localhost/pipelinerl-operator", "tag": TAG, "pullPolicy": "Never"}},
}
# This host refuses podman's default limits (above its own): the open-file limit it has, and a
# process limit in the range it lets a container set.
ULIMITS = ["--ulimit=nofile={}:{}".format(*resource.getrlimit(resource.RLIMIT_NOFILE)), "--ulimit=nproc=4096:4096"]
STEPS = 30
RUN_TIMEOUT_S = 420


def podman(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"podman {' '.join(args[:3])}...: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def pause(name: str, tries: int = 5) -> None:
    """`podman pause`, tried again where runc could not freeze: on cgroup v1 (this host) its freezer
    gives up when the cgroup stays FREEZING through its retries, as a busy multi-threaded process
    can make it, and thaws the cgroup again ("a game of chances", runc's fs/freezer.go)."""
    for attempt in range(tries):
        done = subprocess.run(["podman", "pause", name], capture_output=True, text=True, timeout=120)
        if not done.returncode:
            return
        assert "unable to freeze" in done.stderr and attempt < tries - 1, f"podman pause {name}: {done.stderr}"
        time.sleep(1)


def short_job() -> dict:
    """The tiny job, shorter, with two trainer pods: their ranks meet at trainer-0's name under the
    headless Service, as in a cluster, and watch each other through its rendezvous store; and two
    generator pods, each in the weight group rank 0 serves, over the pod network."""
    data = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    data["spec"]["trainer"] |= {"replicas": 2, "maxSteps": STEPS, "checkpointInterval": STEPS // 2}
    data["spec"]["generator"] |= {"replicas": 2}
    data["spec"]["weightSync"] = {"timeoutSeconds": 10}  # the frozen generator below is dropped after it
    data["spec"]["eval"] = {"interval": STEPS // 2, "problems": 100}
    return data


class Cluster:
    """One private podman network playing the cluster: pods started from rendered objects."""

    def __init__(self, root: Path):
        self.root, self.network = root, f"pipelinerl-{uuid.uuid4().hex[:8]}"
        self.containers: list[str] = []
        podman("network", "create", self.network)

    def start(self, pod: kubelet.Pod, containers: list[str], objects: dict, services: list[dict], images: dict) -> None:
        dirs = {}
        for volume in kubelet.folder_volumes(pod):
            folder = self.root / pod.namespace / pod.name / volume
            folder.mkdir(parents=True, exist_ok=True)  # a claim outlives its pod
            dirs[volume] = folder
        fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
        group = fs_group if fs_group is not None else 0
        for folder in dirs.values():  # what the kubelet does with fsGroup: the group owns, setgid
            os.chown(folder, 0, group)
            folder.chmod(0o2775)
        for volume, files in kubelet.volume_files(pod, objects).items():
            for name, text in files.items():  # (a kept claim's contents stay as its pods wrote them)
                (dirs[volume] / name).write_text(text)
                os.chown(dirs[volume] / name, 0, group)
                (dirs[volume] / name).chmod(0o644)
        for name in containers:
            args = kubelet.run_args(
                pod, name, objects, images, dirs, self.network, kubelet.dns_names(pod, services), os.cpu_count() or 1
            )
            args[2:2] = ULIMITS
            podman(*args[1:])
            self.containers.append(kubelet.podman_name(pod, name))

    def replace(self, pod: kubelet.Pod, *start_args, lost: bool = False) -> None:
        """The pod deleted (SIGTERM, its grace period) or lost (SIGKILL: its node gone) and made
        again by its StatefulSet: the same name, its emptyDirs new, its claims kept, an address
        from the network's pool."""
        containers = [c["name"] for c in pod.spec["containers"]]
        grace = 0 if lost else pod.spec["terminationGracePeriodSeconds"]
        for container in containers:
            name = kubelet.podman_name(pod, container)
            podman("rm", "-f", "-t", str(grace), name, timeout=120)
            self.containers.remove(name)
        for volume, kind in kubelet.folder_volumes(pod).items():
            if kind != "claim":
                shutil.rmtree(self.root / pod.namespace / pod.name / volume)
        self.start(pod, containers, *start_args)

    def ip(self, container: str) -> str:
        return podman("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container)

    def state(self, container: str) -> tuple[str, int]:
        out = podman("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", container)
        status, code = out.split()
        return status, int(code)

    def restarts(self, container: str) -> int:
        return int(podman("inspect", "-f", "{{.RestartCount}}", container))

    def logs(self, container: str) -> str:
        return podman("logs", "--tail", "40", container, check=False)

    def close(self) -> None:
        for c in self.containers:
            podman("rm", "-f", "-t", "5", c, check=False)
        podman("network", "rm", "-f", self.network, check=False)


@pytest.fixture
def cluster(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the rendered pods run under rootful podman (make test-containers as root)")
    for image in (SERVICES, OPERATOR):
        if subprocess.run(["podman", "image", "exists", image]).returncode:
            pytest.fail(f"{image} not built: run `make images`")
    c = Cluster(tmp_path)
    yield c
    c.close()


def status(ip: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{ip}:{HTTP_PORT}/status", timeout=3) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def volume_stats(url: str, timeout_s: float = 60) -> dict[str, float]:
    """The samples a volume-stats sidecar serves, once it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=3) as r:
                lines = r.read().decode().splitlines()
            return {k: float(v) for k, v in (line.split() for line in lines if line and not line.startswith("#"))}
        except OSError:
            assert time.monotonic() < deadline, f"no answer from {url} in {timeout_s:.0f} s"
            time.sleep(1)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def test_the_rendered_tiny_job_trains_to_its_last_step_as_podman_containers(cluster, tmp_path) -> None:
    uid, namespace = str(uuid.uuid4()), "team-b"
    job = parse_job(short_job())
    cfg = from_values(VALUES, release="rl", namespace="team-a")  # the chart's NATS and key, as installed
    job_objects = render(job, namespace, uid, cfg)
    chart = render_chart(VALUES)
    accounts = accounts_secret(
        "rl-pipelinerl-nats-accounts",
        "team-a",
        nats_accounts(KEY_STANDIN, [(namespace, job.name, uid, reserved_bytes(job.spec))]),
    )
    objects = {(o["kind"], o["metadata"]["name"]): o for o in chart + job_objects + [accounts]}
    services = [o for o in chart + job_objects if o["kind"] == "Service"]
    images = {
        SERVICES: kubelet.Image(SERVICES),
        OPERATOR: kubelet.Image(OPERATOR),
        # The chart's NATS image is a registry pull: the services image carries the same server.
        next(
            c["image"]
            for o in chart
            if o["kind"] == "StatefulSet"
            for c in o["spec"]["template"]["spec"]["containers"]
            if c["name"] == "nats"
        ): kubelet.Image(SERVICES, ("nats-server",)),
    }
    nats_sts = next(o for o in chart if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-pipelinerl-nats")
    (nats_pod,) = kubelet.stateful_set_pods(nats_sts)
    # The reloader sidecar only follows later account changes; this job's account is there from the start.
    cluster.start(nats_pod, ["nats", "volume-stats"], objects, services, images)
    nats = kubelet.podman_name(nats_pod, "nats")
    # Its volume-stats sidecar reads the volume it is given (read-only), as its own user.
    volume = os.statvfs(tmp_path / "team-a" / nats_pod.name / "data")
    served = volume_stats(f"http://{cluster.ip(kubelet.podman_name(nats_pod, 'volume-stats'))}:7777/metrics")
    assert served["pipelinerl_nats_volume_capacity_bytes"] == volume.f_blocks * volume.f_frsize
    assert abs(served["pipelinerl_nats_volume_available_bytes"] - volume.f_bavail * volume.f_frsize) < 2**30

    pods = [p for o in job_objects if o["kind"] == "StatefulSet" for p in kubelet.stateful_set_pods(o)]
    for pod in pods:
        cluster.start(pod, [pod.spec["containers"][0]["name"]], objects, services, images)
    names = {pod.name: kubelet.podman_name(pod, pod.spec["containers"][0]["name"]) for pod in pods}

    trainer0, trainer1 = (f"{job.name}-prl-trainer-{i}" for i in (0, 1))
    trainer = names[trainer0]
    by_name = {pod.name: pod for pod in pods}
    gen0, gen1 = (f"{job.name}-prl-generator-{i}" for i in (0, 1))
    checkpoint = STEPS // 2

    def until(done, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"no {what} in {timeout_s:.0f} s:\n" + "\n".join(
                f"{p}:\n{cluster.logs(c)}" for p, c in names.items()
            )
            time.sleep(2)

    def step() -> int:
        return status(cluster.ip(trainer)).get("step", 0)

    # generator-1's pod deleted and made again while generator-0 is frozen (podman pause), so that
    # the steps after it are fed by the new pod alone: it finds the trainer by its name and joins
    # the weight group again over the pod network, with whatever address it got.
    until(lambda: step() >= 3, "step 3")
    old_ip = cluster.ip(names[gen1])
    pause(names[gen0])
    replaced_at = step()
    cluster.replace(by_name[gen1], objects, services, images)
    until(lambda: step() >= replaced_at + 3, f"3 steps after step {replaced_at} fed by the new {gen1}")
    fed = status(cluster.ip(names[gen1])).get("groupsFinished", 0)
    podman("unpause", names[gen0])
    assert fed > 0, f"the new {gen1} (address {cluster.ip(names[gen1])}, was {old_ip}) made no group"

    # trainer-0's pod lost (SIGKILL) past the checkpoint and made again with its claim, at another
    # address: trainer-1 finds its rank 0 gone and ends (its watch), and starts again in place;
    # the new gang meets at trainer-0's name and resumes from the checkpoint, and the generators
    # join its weight group by that name.
    until(lambda: step() > checkpoint + 1, f"step {checkpoint + 2}")
    old_ip = cluster.ip(trainer)
    cluster.replace(by_name[trainer0], objects, services, images, lost=True)
    print(f"{trainer0} at {old_ip}, then {cluster.ip(trainer)}")

    # As the operator: poll trainer rank 0's /status until it says finished (status.compute's
    # Succeeded), checking each pod's /healthz on its pod address meanwhile; then scale to zero
    # (SIGTERM, the pods' grace period) and require a clean exit from each.
    answered: set[str] = set()

    def finished() -> bool:
        # Only trainer-1 may have ended (and started again in place): its rank 0 was lost.
        ended = {p: cluster.restarts(c) for p, c in names.items() if p != trainer1}
        shown = "\n".join(f"{p} restarted {n}x:\n{cluster.logs(names[p])}" for p, n in ended.items() if n)
        assert not any(ended.values()), shown
        answered.update(p for p, c in names.items() if healthy(f"http://{cluster.ip(c)}:{HTTP_PORT}/healthz"))
        return bool(status(cluster.ip(trainer)).get("finished"))

    until(finished, "finish")
    answered |= {p for p, c in names.items() if healthy(f"http://{cluster.ip(c)}:{HTTP_PORT}/healthz")}
    assert answered == set(names)  # every pod's /healthz answered on its pod address
    grace = str(pods[0].spec["terminationGracePeriodSeconds"])
    for c in names.values():
        podman("stop", "-t", grace, c, timeout=int(grace) + 30)
    codes = {pod: cluster.state(c)[1] for pod, c in names.items()}
    assert codes == dict.fromkeys(names, 0), {p: cluster.logs(names[p]) for p, code in codes.items() if code}

    # Each trainer pod's claim holds its last checkpoint, written as the pod's non-root user.
    for rank in (0, 1):
        run = tmp_path / namespace / f"{job.name}-prl-trainer-{rank}" / "run"
        latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
        assert json.loads((latest / "state.json").read_text())["step"] == STEPS
        assert latest.stat().st_uid == 10001
    # The job's metrics stream, read with the job's own login: one row per step, the evaluations.
    creds = job_credentials(KEY_STANDIN, namespace, job.name, uid)
    url = f"nats://{cluster.ip(nats)}:4222"
    rows = asyncio.run(metrics(url, creds["natsUser"], creds["natsPassword"], JobSubjects(job.name, namespace)))
    train = [r.values for r in rows if r.kind == "train"]
    steps = [r["step"] for r in train]
    # The first gang's steps, past the checkpoint; then the new gang's, each once from there.
    back = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[:back] == list(range(1, back + 1)) and back > checkpoint, steps
    assert steps[back:] == list(range(checkpoint + 1, STEPS + 1)), steps
    assert cluster.restarts(names[trainer1]) >= 1
    # Both generator pods fed the job, and both were in the weight group at its end.
    assert all(sum(r.get(f"groups_from_generator_{i}", 0) for r in train) > 0 for i in (0, 1))
    assert train[-1]["generators_in_group"] == 2  # generator-0, thawed, joined again
    versions = [r.values["version"] for r in rows if r.kind == "eval"]
    assert versions[0] == 0 and STEPS // 2 in versions and versions[-1] == STEPS


async def metrics(url: str, user: str, password: str, subjects: JobSubjects) -> list:
    nc = await connect(url, "test", user, password, reconnect=False)
    try:
        stored = await stored_messages(nc.jetstream(), subjects.stream("METRICS"))
        return [m.decode(msg.data, m.Metrics) for msg in stored]
    finally:
        await nc.close()
