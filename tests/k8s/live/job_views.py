"""What the operator's tests read of kmock's emulator (a job's children, status, conditions and
events) and write into it (the children's StatefulSet status, the platform's job policy)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kmock

from operator_harness import JOBS, NS, Api, eventually
from pipelinerl.contracts import OperatorEnv

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
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": base,
    }


def obj(emulator: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any] | None:
    for (res, ns, n), o in list(emulator.objects.items()):
        if (
            n == name
            and ns == NS
            and f"{res.group}/{res.version}/{res.plural}".lstrip("/") == resource
            and not o.deleted
        ):
            return copy.deepcopy(o.raw)
    return None


def status(emulator: kmock.KubernetesEmulator, name: str = "demo") -> dict[str, Any]:
    return (obj(emulator, JOBS, name) or {}).get("status") or {}


def condition(emulator: kmock.KubernetesEmulator, type_: str, name: str = "demo") -> dict[str, Any]:
    return next((c for c in status(emulator, name).get("conditions", []) if c["type"] == type_), {})


def events(emulator: kmock.KubernetesEmulator) -> list[str]:
    return [o.raw.get("reason") for (res, _, _), o in list(emulator.objects.items()) if res.plural == "events"]


async def all_ready(api: Api, name: str = "demo", generators: int = 2, trainers: int = 2) -> None:
    for role, n in (("generator", generators), ("preprocessor", 1), ("trainer", trainers)):
        await api.set_sts_status(f"{name}-prl-{role}", n, n)


async def ready_job(emulator: kmock.KubernetesEmulator, api: Api, **spec: Any) -> None:
    """The default job (with `spec`) created, its pods up (the StatefulSet controller's part played), Ready."""
    await api.create_job(manifest(**spec))
    await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
    await all_ready(api)
    await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")


def sts_template(emulator, role: str) -> dict[str, Any]:
    return obj(emulator, STS, f"demo-prl-{role}")["spec"]["template"]


def allow(monkeypatch, **policy: Any) -> None:
    """The platform's job policy (the chart's jobPolicy values, as the operator reads them)."""
    monkeypatch.setenv(OperatorEnv.JOB_POLICY, json.dumps(policy))
