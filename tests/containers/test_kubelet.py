"""The podman stand-in for the kubelet (kubelet.py), on the tiny job as the operator renders it:
what each container would be started with, read back from the `podman run` arguments."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

import kubelet
from pipelinerl.spec import parse_job
from pipelinerl_operator.config import from_values
from pipelinerl_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/pipelinerl-services:dev"
VALUES = {"services": {"image": {"repository": "localhost/pipelinerl-services", "tag": "dev"}}}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    job = parse_job(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text()))
    return render(job, "team-b", "0123abcd-0000", from_values(VALUES, release="rl", namespace="team-a"))


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def trainer_pod(objects) -> kubelet.Pod:
    sts = next(o for o in by_kind(objects, "StatefulSet") if o["metadata"]["name"].endswith("trainer"))
    (pod,) = kubelet.stateful_set_pods(sts)
    return pod


def args_of(objects, pod, dirs=None, cores=2) -> list[str]:
    index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    dirs = dirs or {v: Path(f"/host/{v}") for v in kubelet.folder_volumes(pod)}
    return kubelet.run_args(
        pod, pod.spec["containers"][0]["name"], index, {IMAGE: kubelet.Image(IMAGE)}, dirs, "net", ["a.b"], cores
    )


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_a_statefulset_pod_gets_its_name_index_label_and_its_headless_dns_names(objects) -> None:
    pod = trainer_pod(objects)
    assert pod.name == "tiny-arith-prl-trainer-0" and pod.labels[kubelet.POD_INDEX_LABEL] == "0"
    assert pod.claims == ["run"]
    names = kubelet.dns_names(pod, by_kind(objects, "Service"))
    # The address the rendered env gives the generator for the trainer's weights, and the rendezvous.
    assert "tiny-arith-prl-trainer-0.tiny-arith-prl-trainer.team-b.svc" in names
    assert "tiny-arith-prl-trainer.team-b.svc.cluster.local" in names
    assert not [n for n in names if "generator" in n]  # another role's Service does not select it


def test_env_resolves_values_the_pod_index_and_the_secrets_keys(objects) -> None:
    pod = trainer_pod(objects)
    env = dict(e.split("=", 1) for e in flag_values(args_of(objects, pod), "--env"))
    secret = next(iter(by_kind(objects, "Secret")))
    assert env["PIPELINERL_RANK"] == "0"
    assert env["PIPELINERL_NATS_USER"] == base64.b64decode(secret["data"]["natsUser"]).decode() == "team-b.tiny-arith"
    assert env["PIPELINERL_NATS_URL"] == "nats://rl-pipelinerl-nats.team-a.svc:4222"
    assert env["HOME"] == "/tmp"


def test_a_missing_secret_key_fails_the_start_as_on_a_cluster(objects) -> None:
    pod = trainer_pod(objects)
    broken = [o for o in objects if o["kind"] != "Secret"]
    with pytest.raises(kubelet.Unsupported, match="has no key 'natsUser'"):
        args_of(broken, pod)


def test_security_context_volumes_and_limits_carry_over(objects) -> None:
    pod = trainer_pod(objects)
    args = args_of(objects, pod)
    assert flag_values(args, "--user") == ["10001:10001"] and flag_values(args, "--group-add") == ["10001"]
    assert "--read-only" in args and "--read-only-tmpfs=false" in args
    assert "--cap-drop=ALL" in args and flag_values(args, "--security-opt") == ["no-new-privileges"]
    assert flag_values(args, "--cpus") == ["2"]  # the limit of 4, capped at the host's cores
    assert flag_values(args, "--memory") == ["8g"]
    assert flag_values(args, "--restart") == ["always"]  # a StatefulSet's pods: restartPolicy Always
    volumes = flag_values(args, "--volume")
    assert "/host/job-config:/etc/pipelinerl:ro" in volumes and "/host/run:/var/lib/pipelinerl/run:rw" in volumes
    assert flag_values(args, "--mount") == ["type=tmpfs,destination=/dev/shm"]  # emptyDir medium: Memory
    # The container's command and args after the image: `pipelinerl service trainer /etc/pipelinerl/job.yaml`.
    assert flag_values(args, "--entrypoint") == ["pipelinerl"]
    assert args[args.index(IMAGE) :] == [IMAGE, "service", "trainer", "/etc/pipelinerl/job.yaml"]


def test_configmap_volumes_become_the_files_the_pod_reads(objects) -> None:
    pod = trainer_pod(objects)
    index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    files = kubelet.volume_files(pod, index)
    assert list(files) == ["job-config"]
    placed = yaml.safe_load(files["job-config"]["job.yaml"])
    assert (placed["metadata"]["name"], placed["metadata"]["namespace"]) == ("tiny-arith", "team-b")
    assert kubelet.folder_volumes(pod) == {
        "job-config": "configMap",
        "cache": "emptyDir",
        "tmp": "emptyDir",
        "run": "claim",
    }


def test_a_root_pod_under_run_as_non_root_is_refused_as_the_kubelet_refuses_it(objects) -> None:
    pod = trainer_pod(objects)
    pod.spec = pod.spec | {"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}
    with pytest.raises(kubelet.Unsupported, match="runAsNonRoot"):
        args_of(objects, pod)


def test_an_image_with_no_local_stand_in_is_refused(objects) -> None:
    pod = trainer_pod(objects)
    index = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    with pytest.raises(kubelet.Unsupported, match="no local image"):
        kubelet.run_args(pod, "trainer", index, {}, {}, "net", [], 2)


def test_an_image_entrypoint_stands_in_where_the_container_has_no_command() -> None:
    pod = kubelet.Pod(
        "nats-0",
        "ns",
        {},
        {"containers": [{"name": "nats", "image": "nats:2", "args": ["-c", "/etc/nats/nats.conf"]}]},
        "nats",
    )
    args = kubelet.run_args(pod, "nats", {}, {"nats:2": kubelet.Image("local", ("nats-server",))}, {}, "net", [], 2)
    assert flag_values(args, "--entrypoint") == ["nats-server"]
    assert args[args.index("local") :] == ["local", "-c", "/etc/nats/nats.conf"]
