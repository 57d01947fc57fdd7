"""The real kopf engine reconciling PipelineRLJobs against kmock's Kubernetes emulator (see operator_harness)."""

from __future__ import annotations

import copy
from typing import Any

import kmock
import nats
import pytest
from prometheus_client import generate_latest

from operator_harness import JOBS, NS, Api, emulator, eventually, running_operator
from pipelinerl_operator import metrics

STS = "apps/v1/statefulsets"
ROLES = ("generator", "preprocessor", "trainer")


def manifest(name: str = "demo", **spec: Any) -> dict[str, Any]:
    base = {
        "generator": {"replicas": 2},
        "trainer": {"replicas": 2, "samplesPerStep": 16, "maxSteps": 50},
        "rl": {"attempts": 4},
        "runPolicy": {"backoffLimit": 2},
    }
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return {
        "apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"},
        "spec": base,
    }


def obj(emulator: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any] | None:
    for (res, ns, n), o in emulator.objects.items():
        if n == name and ns == NS and f"{res.group}/{res.version}/{res.plural}".lstrip("/") == resource and not o.deleted:
            return copy.deepcopy(o.raw)
    return None


def status(emulator: kmock.KubernetesEmulator, name: str = "demo") -> dict[str, Any]:
    return (obj(emulator, JOBS, name) or {}).get("status") or {}


def condition(emulator: kmock.KubernetesEmulator, type_: str, name: str = "demo") -> dict[str, Any]:
    return next((c for c in status(emulator, name).get("conditions", []) if c["type"] == type_), {})


def events(emulator: kmock.KubernetesEmulator) -> list[str]:
    return [o.raw.get("reason") for (res, _, _), o in emulator.objects.items() if res.plural == "events"]


async def all_ready(api: Api, name: str = "demo", generators: int = 2, trainers: int = 2) -> None:
    for role, n in (("generator", generators), ("preprocessor", 1), ("trainer", trainers)):
        await api.set_sts_status(f"{name}-{role}", n, n)


@pytest.fixture
async def cluster(trainer_status):
    async with emulator() as server:
        api = Api(str(server.url))
        yield server, api, trainer_status
        await api.close()


async def test_create_renders_children_and_turns_ready_with_progress(cluster) -> None:
    emulator, api, trainer = cluster
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        sts = await eventually(lambda: all(obj(emulator, STS, f"demo-{r}") for r in ROLES), what="StatefulSets")
        assert sts
        for kind, name in [(STS, f"demo-{r}") for r in ROLES] + [("v1/services", f"demo-{r}") for r in ROLES] + [("v1/configmaps", "demo-config")]:
            child = obj(emulator, kind, name)
            assert child is not None, name
            owner = child["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("PipelineRLJob", "demo", "uid-demo", True)
        assert obj(emulator, STS, "demo-generator")["spec"]["replicas"] == 2
        assert obj(emulator, STS, "demo-trainer")["spec"]["replicas"] == 2

        await eventually(lambda: condition(emulator, "Ready"), what="a Ready condition")
        assert condition(emulator, "Ready")["reason"] == "GeneratorsNotReady", status(emulator)
        assert status(emulator)["phase"] == "Pending"
        assert status(emulator)["observedGeneration"] == 1
        # Play the StatefulSet controller: pods come up. The trainer does not answer /status yet.
        await all_ready(api)
        await eventually(lambda: all(condition(emulator, t).get("status") == "True"
                                     for t in ("GeneratorsReady", "PreprocessorReady", "TrainerReady")), what="roles ready")
        assert condition(emulator, "WeightSyncReady")["reason"] == "TrainerUnreachable"
        assert condition(emulator, "Ready") | {"lastTransitionTime": ""} == {
            "type": "Ready", "status": "False", "reason": "WeightSyncNotReady", "observedGeneration": 1,
            "message": "WeightSyncReady: TrainerUnreachable trainer rank 0 /status did not answer", "lastTransitionTime": ""}
        trainer.reports["demo"] = {"step": 12, "version": 12, "samples": 1536, "reward": 0.41, "lagMean": 1.3,
                                   "lagMax": 3, "tokensPerSecond": 5230.0, "lastUpdate": "2026-11-22T03:00:00Z",
                                   "finished": False, "maxSteps": 50}
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
        st = status(emulator)
        assert st["phase"] == "Running" and st["startTime"]
        assert st["progress"] == {"step": 12, "version": 12, "maxSteps": 50, "samples": 1536, "reward": 0.41,
                                  "lagMean": 1.3, "lagMax": 3, "tokensPerSecond": 5230.0, "lastUpdate": "2026-11-22T03:00:00Z"}
        assert st["generatorsReady"] == "2/2" and st["roles"]["trainer"] == {"desired": 2, "replicas": 2, "ready": 2}
        await eventually(lambda: {"Created", "Ready"} <= set(events(emulator)), what="events")
        assert b'pipelinerl_operator_jobs{namespace="team-a",phase="Running"} 1.0' in generate_latest(metrics.REGISTRY)

        # An unreachable trainer keeps the last progress and must not break reconciliation.
        del trainer.reports["demo"]
        await eventually(lambda: condition(emulator, "WeightSyncReady").get("reason") == "TrainerUnreachable")
        assert status(emulator)["progress"]["step"] == 12
