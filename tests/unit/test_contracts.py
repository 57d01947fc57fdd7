"""pipelinerl.contracts is the one definition of every name and shape two components share: these
tests fail when another place spells one of them itself, or when a side drifts from it."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipelinerl import contracts as c
from pipelinerl.contracts import Env, JobSubjects, OperatorEnv, ServiceEnv, TrainerStatus
from pipelinerl.spec import RESERVED_ENV, parse_job
from pipelinerl.streams import stream_configs

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pipelinerl", "services", "operator", "bench")
PORTS = {c.HTTP_PORT, c.MASTER_PORT, c.WEIGHTS_PORT, c.OPERATOR_METRICS_PORT, c.OPERATOR_HEALTH_PORT}
ENV_NAMES = {v for k, v in vars(Env).items() if k.isupper()} | {v for k, v in vars(OperatorEnv).items() if k.isupper()}


def constants():
    """(file, line, value) of every literal in the project's code outside contracts.py."""
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "pipelinerl/contracts.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", node.value


def test_no_environment_name_spelled_outside_contracts():
    found = [
        (where, v)
        for where, v in constants()
        if isinstance(v, str) and (re.fullmatch(r"PIPELINERL_[A-Z_]+", v) or v in ("MASTER_ADDR", "MASTER_PORT"))
    ]  # not prose
    assert not found, f"use pipelinerl.contracts.Env / OperatorEnv instead: {found}"


def test_no_label_or_annotation_spelled_outside_contracts():
    prefixes = ("pipelinerl.dev/", c.KUEUE_PREFIX, c.POD_INDEX_LABEL, "scheduling.x-k8s.io/")
    found = [
        (where, v)
        for where, v in constants()
        if isinstance(v, str) and v.startswith(prefixes) and v != "pipelinerl.dev/v1alpha1"
    ]  # the API version: pipelinerl.spec
    assert not found, f"use the label and annotation constants of pipelinerl.contracts: {found}"


def test_no_port_number_outside_contracts():
    found = [(where, v) for where, v in constants() if type(v) is int and v in PORTS]
    assert not found, f"use the port constants of pipelinerl.contracts: {found}"


def test_chart_and_images_use_the_contract_names_and_ports():
    operator = (ROOT / "charts/pipelinerl/templates/operator.yaml").read_text()
    chart_env = set(re.findall(r"name: (PIPELINERL_[A-Z_]+)", operator))
    assert chart_env and chart_env <= ENV_NAMES, chart_env - ENV_NAMES
    assert f"{{name: health, containerPort: {c.OPERATOR_HEALTH_PORT}," in operator
    values = yaml.safe_load((ROOT / "charts/pipelinerl/values.yaml").read_text())
    assert values["operator"]["metricsPort"] == c.OPERATOR_METRICS_PORT
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        used = set(re.findall(r"\bPIPELINERL_[A-Z_]+", dockerfile.read_text()))
        assert used <= ENV_NAMES, (dockerfile.name, used - ENV_NAMES)
    assert (
        f"EXPOSE {c.OPERATOR_METRICS_PORT} {c.OPERATOR_HEALTH_PORT}"
        in (ROOT / "docker/operator.Dockerfile").read_text()
    )


def test_service_env_round_trips_and_names_a_bad_value():
    envs = [
        ServiceEnv("generator"),
        ServiceEnv(
            "trainer",
            rank=3,
            world_size=8,
            nats_url="nats://n:1",
            weights_addr="t-0.t:1234",
            run_dir=Path("/r"),
            http_port=0,
            exit_when_done=True,
            torch_threads=2,
            local_rank=1,
            ranks_per_pod=4,
            master_addr="t-0.t",
            master_port=c.MASTER_PORT,
        ),
    ]
    for env in envs:
        assert ServiceEnv.from_environ(env.role, env.to_environ()) == env
        assert set(env.to_environ()) <= ENV_NAMES
    assert (envs[1].weights_host, envs[1].weights_port) == ("t-0.t", 1234)
    with pytest.raises(ValueError, match="PIPELINERL_RANK='two'"):
        ServiceEnv.from_environ("trainer", {Env.RANK: "two"})


def test_reserved_env_is_what_pipelinerl_sets():
    assert RESERVED_ENV == c.reserved_env()
    operator_sets = set(
        ServiceEnv("trainer", local_rank=0, ranks_per_pod=1, master_addr="m", master_port=1).to_environ()
    )
    assert operator_sets <= RESERVED_ENV
    assert {Env.TORCH_RANK, Env.TORCH_WORLD_SIZE, Env.TORCH_LOCAL_RANK} <= RESERVED_ENV
    assert Env.TORCH_THREADS not in RESERVED_ENV  # a user may tune a CPU trainer's threads


def test_rendered_pods_are_told_what_the_services_read():
    from pipelinerl_operator.config import OperatorConfig
    from pipelinerl_operator.render import render

    job = parse_job(
        {
            "metadata": {"name": "demo"},
            "spec": {
                "model": {"path": "/models/qwen"},
                "trainer": {"replicas": 2, "gpus": 4},
                "generator": {"replicas": 3, "gpus": 1},
            },
        }
    )
    for sts in (o for o in render(job, "team-a", "uid", OperatorConfig()) if o["kind"] == "StatefulSet"):
        role = sts["metadata"]["labels"][c.ROLE_LABEL]
        container = next(x for x in sts["spec"]["template"]["spec"]["containers"] if x["name"] == role)
        environ = {e["name"]: e.get("value", "2") for e in container["env"]}  # the pod index label: 2
        env = ServiceEnv.from_environ(role, environ)
        assert env.rank == 2 and env.run_dir == Path(c.POD_RUN_DIR) and env.http_port == c.HTTP_PORT
        assert container["ports"][0]["containerPort"] == env.http_port
        assert env.weights_host == "demo-prl-trainer-0.demo-prl-trainer.team-a.svc"
        assert env.weights_port == c.WEIGHTS_PORT
        if role == "trainer":
            assert (env.world_size, env.ranks_per_pod, env.master_port) == (8, 4, c.MASTER_PORT)
        else:
            assert env.ranks_per_pod is None and env.master_addr is None
        assert container["args"] == ["service", role, c.JOB_FILE]


def test_stream_names_are_the_ones_created_and_deleted():
    subjects = JobSubjects("my-job-1", "team-a")
    assert [cfg.name for cfg in stream_configs(subjects, 1 << 20)] == subjects.streams
    assert subjects.streams == [
        "PRL_TEAM-A_MY-JOB-1_ROLLOUTS",
        "PRL_TEAM-A_MY-JOB-1_BATCHES",
        "PRL_TEAM-A_MY-JOB-1_CONTROL",
        "PRL_TEAM-A_MY-JOB-1_METRICS",
        "PRL_TEAM-A_MY-JOB-1_DEADLETTER",
    ]
    assert subjects.rollouts(0) == "prl.team-a.my-job-1.rollouts.0"
    with pytest.raises(ValueError, match="unknown stream"):
        subjects.stream("OTHER")
    for job, namespace in (("my.job", "a"), ("job", "a_b"), ("*", "a"), ("job", ">")):
        with pytest.raises(ValueError, match="not a DNS label"):
            JobSubjects(job, namespace)


def test_jobs_of_one_name_in_two_namespaces_share_no_stream_or_subject():
    def names(s: JobSubjects) -> set[str]:
        return {
            *s.streams,
            s.rollouts(0),
            s.batches(0),
            s.version,
            s.metrics("train"),
            s.deadletter("rollout"),
            s.weights_update,
            s.weights_done,
            s.weights_hello,
        }

    # Where a name and a namespace split at another '-', too: the separators keep them apart.
    pairs = [
        (JobSubjects("demo", "team-a"), JobSubjects("demo", "team-b")),
        (JobSubjects("b-c", "a"), JobSubjects("c", "a-b")),
    ]
    for one, other in pairs:
        assert not names(one) & names(other)
    job = parse_job({"metadata": {"name": "demo", "namespace": "team-a"}})
    assert job.subjects == JobSubjects("demo", "team-a")
    assert parse_job({"metadata": {"name": "demo"}}).subjects.namespace == "default"


def test_status_bodies_of_every_role_are_the_contract_models():
    from pipelinerl.admission import Admission
    from pipelinerl_generator.main import Generator
    from pipelinerl_operator.status import progress_from
    from pipelinerl_preprocessor.main import Preprocessor
    from pipelinerl_trainer.reporting import Board

    job = parse_job({"metadata": {"name": "s"}, "spec": {"trainer": {"maxSteps": 7}}})
    pre = Preprocessor(job, ServiceEnv("preprocessor"), 1)
    for key in c.PreprocessorStatus.model_fields:  # every count the service keeps has a field
        if key not in ("role", "next_step", "trainer_version", "pending_groups"):
            pre.stats[key] += 1
    # A generator as `assemble` hands it in; only what its status reads is real.
    engine = SimpleNamespace(version=3, tokens_generated=120)
    nc = SimpleNamespace(jetstream=lambda: None)
    admission = Admission(groups_per_step=4, generators=1, max_lag=1, max_inflight=8)
    events = asyncio.Event(), asyncio.Event()
    generator = Generator(job, ServiceEnv("generator"), nc, engine, None, None, admission, None, *events)
    for service, model in (
        (Board(0, job.spec.trainer.max_steps), c.TrainerStatus),  # what the trainer serves, from its start
        (generator, c.GeneratorStatus),
        (pre, c.PreprocessorStatus),
    ):
        body = service.status().model_dump(mode="json", by_alias=True)  # what HealthServer serves
        assert model.model_validate(body) == service.status()
    trainer = TrainerStatus.model_validate(Board(0, 7).status().model_dump(by_alias=True))
    assert progress_from(trainer, {}) == {"step": 0, "version": 0, "maxSteps": 7, "samples": 0}
