"""The real kopf engine reconciling PipelineRLJobs against kmock's Kubernetes emulator (see operator_harness)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from typing import Any

import aiohttp

import kmock
import nats
from prometheus_client import generate_latest

from operator_harness import JOBS, NS, Api, eventually, running_operator
from pipelinerl.contracts import JobSubjects, OperatorEnv
from pipelinerl.streams import ensure_streams
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


async def test_create_renders_children_and_turns_ready_with_progress(cluster) -> None:
    emulator, api, trainer = cluster
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        sts = await eventually(lambda: all(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES), what="StatefulSets")
        assert sts
        for kind, name in (
            [(STS, f"demo-prl-{r}") for r in ROLES]
            + [("v1/services", f"demo-prl-{r}") for r in ROLES]
            + [("v1/configmaps", "demo-pipelinerl-config")]
        ):
            child = obj(emulator, kind, name)
            assert child is not None, name
            owner = child["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "PipelineRLJob",
                "demo",
                obj(emulator, JOBS, "demo")["metadata"]["uid"],
                True,
            )
        assert obj(emulator, STS, "demo-prl-generator")["spec"]["replicas"] == 2
        assert obj(emulator, STS, "demo-prl-trainer")["spec"]["replicas"] == 2

        await eventually(lambda: condition(emulator, "Ready"), what="a Ready condition")
        assert condition(emulator, "Ready")["reason"] == "GeneratorsNotReady", status(emulator)
        assert status(emulator)["phase"] == "Pending"
        assert status(emulator)["observedGeneration"] == 1
        # Play the StatefulSet controller: pods come up. The trainer does not answer /status yet.
        await all_ready(api)
        await eventually(
            lambda: all(
                condition(emulator, t).get("status") == "True"
                for t in ("GeneratorsReady", "PreprocessorReady", "TrainerReady")
            ),
            what="roles ready",
        )
        assert condition(emulator, "WeightSyncReady")["reason"] == "TrainerUnreachable"
        assert condition(emulator, "Ready") | {"lastTransitionTime": ""} == {
            "type": "Ready",
            "status": "False",
            "reason": "WeightSyncNotReady",
            "observedGeneration": 1,
            "message": "WeightSyncReady: TrainerUnreachable trainer rank 0 /status did not answer",
            "lastTransitionTime": "",
        }
        trainer.reports["demo"] = {
            "step": 12,
            "version": 12,
            "samples": 1536,
            "reward": 0.41,
            "lagMean": 1.3,
            "lagMax": 3,
            "tokensPerSecond": 5230.0,
            "lastUpdate": "2026-11-22T03:00:00Z",
            "finished": False,
            "maxSteps": 50,
            "weightSyncReady": True,
        }
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
        st = status(emulator)
        assert st["phase"] == "Running" and st["startTime"]
        assert st["progress"] == {
            "step": 12,
            "version": 12,
            "maxSteps": 50,
            "samples": 1536,
            "reward": 0.41,
            "lagMean": 1.3,
            "lagMax": 3,
            "tokensPerSecond": 5230.0,
            "lastUpdate": "2026-11-22T03:00:00Z",
        }
        assert st["generatorsReady"] == "2/2" and st["roles"]["trainer"] == {"desired": 2, "replicas": 2, "ready": 2}
        await eventually(lambda: {"Created", "Ready"} <= set(events(emulator)), what="events")
        assert b'pipelinerl_operator_jobs{namespace="team-a",phase="Running"} 1.0' in generate_latest(metrics.REGISTRY)

        # An unreachable trainer keeps the last progress and must not break reconciliation.
        del trainer.reports["demo"]
        await eventually(lambda: condition(emulator, "WeightSyncReady").get("reason") == "TrainerUnreachable")
        assert status(emulator)["progress"]["step"] == 12


def sts_template(emulator, role: str) -> dict[str, Any]:
    return obj(emulator, STS, f"demo-prl-{role}")["spec"]["template"]


def allow(monkeypatch, **policy: Any) -> None:
    """The platform's job policy (the chart's jobPolicy values, as the operator reads them)."""
    monkeypatch.setenv(OperatorEnv.JOB_POLICY, json.dumps(policy))


async def test_scale_suspend_resume_and_spec_change(cluster, monkeypatch) -> None:
    emulator, api, trainer = cluster
    allow(monkeypatch, images=["ghcr.io/pipelinerl", "example.com"])
    trainer.reports["demo"] = {"step": 3, "version": 3, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(scheduling={"queueName": "team-a-gpus"}))  # in a Kueue queue: the gang labels
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"), what="trainer StatefulSet")
        assert (
            sts_template(emulator, "trainer")["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"]
            == "demo-pipelinerl-gang"
        )
        await all_ready(api)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
        trainer_before = sts_template(emulator, "trainer")

        # `kubectl scale prl/demo --replicas=4`: the scale subresource writes spec.generator.replicas.
        await api.scale_job("demo", 4)
        assert obj(emulator, JOBS, "demo")["spec"]["generator"]["replicas"] == 4
        await eventually(lambda: obj(emulator, STS, "demo-prl-generator")["spec"]["replicas"] == 4, what="scaled")
        await eventually(lambda: status(emulator)["generatorsReady"] == "2/4", what="2/4")
        # What an autoscaler reads back: the replicas running and a selector of the generator pods.
        scale = await api.get_scale("demo")
        assert scale["spec"]["replicas"] == 4 and scale["status"]["replicas"] == 2
        assert scale["status"]["selector"] == "pipelinerl.dev/job=demo,pipelinerl.dev/role=generator"
        assert condition(emulator, "Degraded")["reason"] == "GeneratorsMissing"
        assert sts_template(emulator, "trainer") == trainer_before, "scaling generators must not restart trainers"
        assert status(emulator)["observedGeneration"] == 2
        await api.set_sts_status("demo-prl-generator", 4, 4)
        await eventually(lambda: condition(emulator, "Degraded").get("status") == "False", what="recovered")

        # A trainer setting rolls the trainers (new config hash) but not the generators, and the
        # trainer gang restarts as a whole: the operator deletes every trainer pod at once.
        gen_before = sts_template(emulator, "generator")
        assert obj(emulator, STS, "demo-prl-trainer")["spec"]["updateStrategy"] == {"type": "OnDelete"}
        for i in range(2):
            await api.create_pod(
                f"demo-prl-trainer-{i}",
                {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer", "controller-revision-hash": "rev-1"},
                0,
            )
        await api.patch_job("demo", {"spec": {"trainer": {"learningRate": 0.0005}}})
        await eventually(lambda: sts_template(emulator, "trainer") != trainer_before, what="trainer rollout")
        assert obj(emulator, "v1/pods", "demo-prl-trainer-0") and obj(emulator, "v1/pods", "demo-prl-trainer-1")
        await api.set_sts_status("demo-prl-trainer", 2, 2, update_revision="rev-2")  # the controller's new revision
        await eventually(
            lambda: (
                not obj(emulator, "v1/pods", "demo-prl-trainer-0")
                and not obj(emulator, "v1/pods", "demo-prl-trainer-1")
            ),
            what="the trainer gang deleted",
        )
        await eventually(lambda: "TrainerGangRestarted" in events(emulator), what="TrainerGangRestarted event")
        assert "learningRate: 0.0005" in obj(emulator, "v1/configmaps", "demo-pipelinerl-config")["data"]["job.yaml"]
        ann = "pipelinerl.dev/config-hash"
        assert (
            sts_template(emulator, "generator")["metadata"]["annotations"][ann]
            != gen_before["metadata"]["annotations"][ann]
        )
        trainer_before = sts_template(emulator, "trainer")
        await api.patch_job("demo", {"spec": {"generator": {"image": "example.com/gen:2"}}})
        await eventually(
            lambda: sts_template(emulator, "generator")["spec"]["containers"][0]["image"] == "example.com/gen:2"
        )
        assert sts_template(emulator, "trainer") == trainer_before, "a generator image change must not restart trainers"

        # Suspend: every role scales to zero, the job says so; resume brings them back.
        await api.patch_job("demo", {"spec": {"suspend": True}})
        await eventually(
            lambda: all(obj(emulator, STS, f"demo-prl-{r}")["spec"]["replicas"] == 0 for r in ROLES), what="scaled to 0"
        )
        for role in ROLES:
            await api.set_sts_status(f"demo-prl-{role}", 0, 0)
        await eventually(lambda: status(emulator).get("phase") == "Suspended", what="Suspended")
        assert condition(emulator, "Suspended")["status"] == "True"
        assert condition(emulator, "Ready")["reason"] == "Suspended"
        assert "volumeClaimTemplates" in obj(emulator, STS, "demo-prl-trainer")["spec"], "checkpoints are kept on PVCs"
        await api.patch_job("demo", {"spec": {"suspend": False}})
        await eventually(
            lambda: obj(emulator, STS, "demo-prl-generator")["spec"]["replicas"] == 4,
            what=f"resumed {obj(emulator, JOBS, 'demo')['spec']} {status(emulator)}",
        )
        await all_ready(api, generators=4)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready again")
        await eventually(
            lambda: {"Suspended", "Resumed", "Degraded", "Recovered", "Updated"} <= set(events(emulator)),
            what=f"events, got {set(events(emulator))}",
        )


async def test_failing_trainer_fails_after_backoff_limit(cluster) -> None:
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 1, "version": 1, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())  # backoffLimit 2
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
        await all_ready(api)
        labels = {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer"}
        await api.create_pod("demo-prl-trainer-0", labels, restarts=0)
        await api.create_pod(
            "demo-prl-generator-0", {**labels, "pipelinerl.dev/role": "generator"}, restarts=5
        )  # elastic: not a failure
        await api.create_pod("demo-prl-trainer-1", labels, restarts=1)
        await eventually(lambda: condition(emulator, "Degraded").get("reason") == "PodsRestarted")
        assert status(emulator)["phase"] == "Running"
        # The other pod restarting with it (its collective broke): the same incident, one failure.
        await api.patch_pod_restarts("demo-prl-trainer-0", 1)
        await eventually(lambda: status(emulator)["podRestarts"] == {"demo-prl-trainer-0": 1, "demo-prl-trainer-1": 1})
        assert status(emulator)["failures"] == 1 and status(emulator)["phase"] == "Running"
        await api.patch_pod_restarts("demo-prl-trainer-0", 3)  # it fails twice more: 3 failures > backoffLimit 2
        await eventually(lambda: status(emulator).get("phase") == "Failed", what="Failed")
        failed = condition(emulator, "Failed")
        assert failed["status"] == "True" and failed["reason"] == "BackoffLimitExceeded"
        assert status(emulator)["completionTime"]
        await eventually(
            lambda: all(obj(emulator, STS, f"demo-prl-{r}")["spec"]["replicas"] == 0 for r in ROLES), what="released"
        )
        await eventually(lambda: "BackoffLimitExceeded" in events(emulator))
        # Terminal is sticky: a recovered trainer does not resurrect the job.
        await api.patch_pod_restarts("demo-prl-trainer-0", 0)
        await api.set_sts_status("demo-prl-trainer", 2, 2)
        await eventually(lambda: status(emulator)["roles"]["trainer"]["ready"] == 2)
        assert status(emulator)["phase"] == "Failed"


async def test_finished_trainer_succeeds_and_ttl_deletes(cluster, monkeypatch) -> None:
    emulator, api, trainer = cluster
    allow(monkeypatch, volumeClaims=[f"{NS}/models"])
    trainer.reports["demo"] = {"step": 50, "version": 50, "maxSteps": 50, "finished": True, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(runPolicy={"ttlSecondsAfterFinished": 1}, output={"claimName": "models"}))
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
        retention = lambda: obj(emulator, STS, "demo-prl-trainer")["spec"]["persistentVolumeClaimRetentionPolicy"][  # noqa: E731
            "whenDeleted"
        ]  # noqa: E731
        assert retention() == "Retain"  # the checkpoints are the only copy of the model until the output is written
        await all_ready(api)
        await eventually(lambda: status(emulator).get("phase") == "Succeeded", what="Succeeded")
        assert retention() == "Delete"  # the final model is on the output claim: the volumes may go with the job
        assert condition(emulator, "Succeeded")["message"] == "trainer finished at step 50"
        assert condition(emulator, "Progressing")["status"] == "False"
        # ttlSecondsAfterFinished: the operator deletes the job; the finalizer is released (NATS is absent here).
        await eventually(lambda: obj(emulator, JOBS, "demo") is None, timeout_s=15, what="TTL deletion")
        await eventually(lambda: {"Succeeded", "TTLExpired", "StreamsDeleteFailed"} <= set(events(emulator)))


async def review(operation: str, new: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    """An AdmissionReview as the API server POSTs it to the operator's webhook; its answer."""
    request = {
        "uid": "r-1",
        "operation": operation,
        "object": new,
        "oldObject": old,
        "namespace": NS,
        "name": new["metadata"]["name"],
        "userInfo": {"username": "alice"},
        "kind": {"group": "pipelinerl.dev", "version": "v1alpha1", "kind": "PipelineRLJob"},
        "resource": {"group": "pipelinerl.dev", "version": "v1alpha1", "resource": "pipelinerljobs"},
    }
    url = f"http://127.0.0.1:{os.environ['PIPELINERL_WEBHOOK_PORT']}/validate-job"
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    for _ in range(50):  # kopf opens the server once it has discovered the resources
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=10)) as resp,
            ):
                assert resp.status == 200
                return (await resp.json())["response"]
        except aiohttp.ClientConnectorError:
            await asyncio.sleep(0.2)
    raise AssertionError(f"no webhook server at {url}")


async def test_the_webhook_refuses_what_validate_refuses(cluster) -> None:
    emulator, _, _ = cluster
    good = manifest(generator={"replicas": 2, "engineArgs": {"max_num_seqs": 8}})
    async with running_operator(str(emulator.url)):
        assert (await review("CREATE", good))["allowed"] is True
        refused = await review("CREATE", manifest(generator={"replicas": 2, "engineArgs": {"max_num_seq": 8}}))
        assert refused["allowed"] is False and refused["status"]["code"] == 422
        assert "engineArgs.max_num_seq: not an argument of vLLM" in refused["status"]["message"]
        changed = copy.deepcopy(good)
        changed["spec"]["trainer"]["replicas"] = 4
        refused = await review("UPDATE", changed, good)
        assert refused["allowed"] is False and "spec.trainer.replicas: cannot change" in refused["status"]["message"]
        scaled = copy.deepcopy(good)
        scaled["spec"]["generator"]["replicas"] = 6
        assert (await review("UPDATE", scaled, good))["allowed"] is True
        # A job admitted by older rules is never stuck: changes outside its spec always pass.
        stale = manifest(generator={"replicas": 2, "engineArgs": {"max_num_seq": 8}})
        finalized = copy.deepcopy(stale)
        finalized["metadata"]["finalizers"] = []
        assert (await review("UPDATE", finalized, stale))["allowed"] is True


async def test_invalid_spec_is_a_condition_not_a_crash(cluster) -> None:
    emulator, api, _ = cluster
    # Where no webhook stops it (kmock calls none; a cluster without the chart's), the operator
    # refuses it the same way: a condition and an Event, nothing rendered.
    bad = manifest(generator={"replicas": 2, "engineArgs": {"kv_cache_dtype": "fp7"}})
    async with running_operator(str(emulator.url)):
        await api.create_job(bad)
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "InvalidSpec", what="InvalidSpec")
        assert "engineArgs.kv_cache_dtype: must be one of" in condition(emulator, "Ready")["message"]
        assert obj(emulator, STS, "demo-prl-generator") is None
        await eventually(lambda: "InvalidSpec" in events(emulator))
        # Fixing the spec recovers without restarting anything.
        await api.patch_job("demo", {"spec": {"generator": {"engineArgs": {"kv_cache_dtype": "fp8"}}}})
        await eventually(lambda: obj(emulator, STS, "demo-prl-generator"), what="rendered after the fix")
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "GeneratorsNotReady")


async def test_the_operator_refuses_what_the_platform_does_not_allow(cluster, monkeypatch) -> None:
    """The job policy at the operator's door (no webhook here): a job asking for what the policy
    does not list is InvalidSpec, the field named, nothing rendered; once the platform lists it
    (the chart's jobPolicy, read from the operator's environment), the same job runs."""
    emulator, api, _ = cluster
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(scheduling={"priorityClassName": "training"}))
        await eventually(
            lambda: condition(emulator, "Ready").get("reason") == "InvalidSpec", timeout_s=40, what="InvalidSpec"
        )
        assert (
            "spec.scheduling.priorityClassName: 'training' is not a priority class jobs may use"
            in condition(emulator, "Ready")["message"]
        )
        assert not obj(emulator, STS, "demo-prl-trainer") and not obj(
            emulator, "v1/configmaps", "demo-pipelinerl-config"
        )
        allow(monkeypatch, priorityClassNames=["training"])
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"), timeout_s=20, what="rendered once allowed")
        assert sts_template(emulator, "trainer")["spec"]["priorityClassName"] == "training"


async def test_operator_restart_creates_no_duplicates(cluster) -> None:
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 7, "version": 7, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
        await all_ready(api)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True")
    creates_before = [c for c in emulator.creates if not c.startswith("events/")]
    async with running_operator(str(emulator.url)):
        trainer.reports["demo"]["step"] = 8  # the new operator picks up where the old one stopped
        await eventually(lambda: status(emulator)["progress"]["step"] == 8, what="resumed reconciliation")
    creates_after = [c for c in emulator.creates if not c.startswith("events/")]
    assert creates_after == creates_before and len(set(creates_after)) == len(creates_after) == 1 + 9, creates_after
    assert condition(emulator, "Ready")["status"] == "True"


async def test_deletion_removes_this_jobs_nats_streams(cluster, nats_url: str, monkeypatch) -> None:
    emulator, api, _ = cluster
    allow(monkeypatch, natsServers=[nats_url.removeprefix("nats://")])
    nc = await nats.connect(nats_url, connect_timeout=2)
    js = nc.jetstream(timeout=2)
    # This job's, a job's of another name, and a same-named job's in another namespace.
    for subjects in (JobSubjects("demo", NS), JobSubjects("demo-2", NS), JobSubjects("demo", "team-b")):
        await ensure_streams(js, subjects, 1)
    try:
        async with running_operator(str(emulator.url)):
            await api.create_job(manifest(nats={"url": nats_url}))
            await eventually(
                lambda: "pipelinerl.dev/cleanup" in obj(emulator, JOBS, "demo")["metadata"].get("finalizers", [])
            )
            await api.delete_job("demo")
            await eventually(lambda: obj(emulator, JOBS, "demo") is None, what="deleted")
        left = sorted(s.config.name for s in await js.streams_info())
        assert left == sorted(JobSubjects("demo-2", NS).streams + JobSubjects("demo", "team-b").streams), (
            "only this job's streams go"
        )
        await eventually(lambda: "StreamsDeleted" in events(emulator))
    finally:
        await nc.close()


async def test_a_job_deleted_with_orphan_cascade_leaves_no_statefulset_behind(cluster) -> None:
    """`kubectl delete prl demo --cascade=orphan`: the garbage collector strips the children's
    ownerReferences instead of deleting them (done here by hand: kmock has no garbage collector),
    which would leave the StatefulSets and their GPU pods running with nothing to stop them. The
    operator's finalizer deletes the job's StatefulSets itself; one of that name another owner
    holds stays."""
    emulator, api, _ = cluster
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: all(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES), what="children")
        for role in ("generator", "trainer"):
            await api._call(
                "PATCH",
                f"/apis/apps/v1/namespaces/{NS}/statefulsets/demo-prl-{role}",
                {"metadata": {"ownerReferences": []}},
            )
        other = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": "keeper",
            "uid": "not-the-job",
            "controller": True,
        }
        await api._call(
            "PATCH",
            f"/apis/apps/v1/namespaces/{NS}/statefulsets/demo-prl-preprocessor",
            {"metadata": {"ownerReferences": [other]}},
        )
        assert not obj(emulator, STS, "demo-prl-trainer")["metadata"].get("ownerReferences")
        await api.delete_job("demo")
        await eventually(lambda: obj(emulator, JOBS, "demo") is None, what="deleted")
    assert obj(emulator, STS, "demo-prl-generator") is None and obj(emulator, STS, "demo-prl-trainer") is None
    assert obj(emulator, STS, "demo-prl-preprocessor") is not None  # another owner's: not ours to delete


async def test_a_refused_apply_and_a_stuck_pod_are_told_in_the_status_and_events(cluster) -> None:
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 3, "version": 3, "finished": False, "weightSyncReady": True}
    refusal = 'spec.template.spec.containers[0].image: Invalid value: "bad image": no spaces allowed'
    emulator.refuse["statefulsets/demo-prl-generator"] = refusal
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "ApplyRefused", what="ApplyRefused")
        ready = condition(emulator, "Ready")
        assert (
            ready["status"] == "False"
            and "StatefulSet demo-prl-generator" in ready["message"]
            and refusal in ready["message"]
        )
        await eventually(lambda: "ApplyRefused" in events(emulator), what="ApplyRefused event")
        emulator.refuse.clear()  # fixed (e.g. a quota raised): the next reconcile applies it
        await api.patch_job("demo", {"spec": {"generator": {"replicas": 3}}})
        await eventually(lambda: all(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES), what="every StatefulSet")
        await all_ready(api, generators=3)
        # A trainer pod that no node can take: the condition says which pod and why.
        await api.create_pod(
            "demo-prl-trainer-1",
            {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer"},
            0,
            status={
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ]
            },
        )
        await api.set_sts_status("demo-prl-trainer", 2, 1)
        await eventually(
            lambda: condition(emulator, "TrainerReady").get("reason") == "Unschedulable", what="Unschedulable"
        )
        assert "pod demo-prl-trainer-1: Unschedulable: 0/4 nodes" in condition(emulator, "TrainerReady")["message"]
        assert condition(emulator, "Ready")["reason"] == "TrainerNotReady"
        await eventually(lambda: "Unschedulable" in events(emulator), what="Unschedulable event")


async def test_an_object_the_job_does_not_own_is_never_taken_over(cluster) -> None:
    """A user's ServiceAccount already holds the name of the job's: the operator stops there
    (nothing of the job's is applied after it, no pod runs as that account), says so in the
    condition and an Event, and goes on once the name is free."""
    emulator, api, _ = cluster
    theirs = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "demo-pipelinerl", "namespace": NS}}
    await api.create(f"/api/v1/namespaces/{NS}/serviceaccounts", theirs)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "ApplyRefused", what="ApplyRefused")
        assert (
            "ServiceAccount demo-pipelinerl already exists and is not this job's"
            in condition(emulator, "Ready")["message"]
        )
        await eventually(lambda: "ApplyRefused" in events(emulator), what="ApplyRefused event")
        assert not any(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES)  # no pod could run as that account
        assert not obj(emulator, "v1/serviceaccounts", "demo-pipelinerl").get("metadata", {}).get("ownerReferences")


async def test_a_credentials_secret_the_operator_did_not_make_is_never_used(cluster, monkeypatch) -> None:
    """Someone makes the job's credentials Secret (its name has the job's uid: only once the job
    exists) before the operator's first pass: the operator, which cannot read Secrets, tells its
    own from theirs by the job's status (status.credentialsSecret), applies nothing that would
    read it, and goes on once it is deleted. Restarted, it keeps using the one it made."""
    monkeypatch.setenv(OperatorEnv.AUTH_KEY, "install-key")
    emulator, api, _ = cluster
    await api.create_job(manifest())  # no operator running yet
    uid = obj(emulator, JOBS, "demo")["metadata"]["uid"]
    name = f"demo-{uid[:8]}-pipelinerl-credentials"
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}, "data": {}}
    await api.create(f"/api/v1/namespaces/{NS}/secrets", theirs)
    async with running_operator(str(emulator.url)):
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "ApplyRefused", what="refused")
        assert f"Secret {name} already exists and this job did not make it" in condition(emulator, "Ready")["message"]
        assert not any(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES)  # no pod reads it
        await api._call("DELETE", f"/api/v1/namespaces/{NS}/secrets/{name}")
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"), timeout_s=30, what="its pods, with its own")
        await eventually(lambda: status(emulator).get("credentialsSecret") == name, what="said in its status")
        assert obj(emulator, "v1/secrets", name)["metadata"]["ownerReferences"][0]["uid"] == uid
    async with running_operator(str(emulator.url)):  # restarted: its own Secret is there (a create finds it)
        await asyncio.sleep(1)
        assert condition(emulator, "Ready").get("reason") != "ApplyRefused"


async def test_a_failed_job_takes_over_nothing_on_its_way_out(cluster) -> None:
    """The terminal path (Failed/DeadlineExceeded here) scales the job's children down through the
    same ownership check as every other apply: a user's own ServiceAccount and Service that hold
    the names of the job's children get no ownerReference (a real API server would delete them
    with the job) and keep what their owner set."""
    emulator, api, _ = cluster
    mine = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "demo-pipelinerl", "namespace": NS}}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo-prl-generator", "namespace": NS, "labels": {"app": "theirs"}},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
    }
    await api.create(f"/api/v1/namespaces/{NS}/serviceaccounts", mine)
    await api.create(f"/api/v1/namespaces/{NS}/services", service)
    async with running_operator(str(emulator.url)):
        # Created long ago (kmock stamps a past time): past its deadline at its first reconcile.
        await api.create_job(manifest(runPolicy={"activeDeadlineSeconds": 1}))
        await eventually(
            lambda: condition(emulator, "Failed").get("reason") == "DeadlineExceeded", timeout_s=40, what="Failed"
        )
        await eventually(lambda: "DeadlineExceeded" in events(emulator), what="its Event")
        await asyncio.sleep(1)  # a resync or two after the terminal one
    for kind, name in (("v1/serviceaccounts", "demo-pipelinerl"), ("v1/services", "demo-prl-generator")):
        theirs = obj(emulator, kind, name)
        assert not theirs["metadata"].get("ownerReferences"), f"{kind} {name} taken over: {theirs['metadata']}"
    assert obj(emulator, "v1/services", "demo-prl-generator")["spec"]["selector"] == {"app": "theirs"}
    assert not obj(emulator, STS, "demo-prl-generator")  # nothing after the refused child


async def test_a_job_the_nats_store_cannot_hold_waits_and_holds_nothing_until_there_is_room(
    cluster, nats_url, monkeypatch
) -> None:
    """Each running job holds its streams' bytes in the chart's NATS store (pipelinerl.capacity),
    said in its status. A job the store cannot hold beside them waits, told in a condition and an
    Event (its pods never start), holding nothing: it takes no later job hostage. It starts once a
    running job gives its room back: deleted, or suspended (once its streams are deleted: NATS
    runs here, with no checkpoint record to keep)."""
    from pipelinerl.capacity import reserved_bytes
    from pipelinerl.spec import parse_job

    emulator, api, _ = cluster
    one = reserved_bytes(parse_job(manifest("zeta")).spec)
    monkeypatch.setenv("PIPELINERL_NATS_STORE_BYTES", str(2 * one + one // 2))  # room for two jobs
    monkeypatch.setenv(OperatorEnv.DEFAULT_NATS_URL, nats_url)  # where suspended jobs' streams are deleted
    held = lambda name: status(emulator, name).get("natsReservedBytes")  # noqa: E731
    async with running_operator(str(emulator.url)):
        for name in ("zeta", "mid"):
            await api.create_job(manifest(name))
            await eventually(lambda n=name: obj(emulator, STS, f"{n}-prl-trainer"), timeout_s=30, what=f"{name} runs")
        await eventually(lambda: held("zeta") == held("mid") == one, what="their reservations in their status")
        await api.create_job(manifest("alpha"))
        await eventually(lambda: condition(emulator, "Ready", "alpha").get("reason") == "ApplyRefused", what="refused")
        assert "cannot hold this job's streams" in condition(emulator, "Ready", "alpha")["message"]
        assert held("alpha") == 0 and not obj(emulator, STS, "alpha-prl-trainer")
        await eventually(lambda: "ApplyRefused" in events(emulator), what="an Event")
        # A suspended job gives its room back: the waiting one starts.
        await api.patch_job("mid", {"spec": {"suspend": True}})
        await eventually(lambda: obj(emulator, STS, "alpha-prl-trainer"), timeout_s=40, what="the waiting job's pods")
        await eventually(lambda: held("mid") == 0 and held("alpha") == one, what="mid's room, alpha's now")
        # Resumed, it waits in turn (the store is full), holding nothing; deleting a job makes room.
        await api.patch_job("mid", {"spec": {"suspend": False}})
        await eventually(lambda: condition(emulator, "Ready", "mid").get("reason") == "ApplyRefused", what="mid waits")
        assert held("mid") == 0
        await api.delete_job("zeta")
        await eventually(lambda: held("mid") == one, timeout_s=40, what="mid running again")


async def test_two_replicas_take_turns_and_the_survivor_takes_over(cluster, tmp_path) -> None:
    """The chart's two operator replicas (real processes, as in their pods) meet in kopf's peering
    object: one reconciles, the other pauses; the one reconciling is killed (SIGKILL) and the
    other takes the next job once the dead one's turn has lapsed."""
    import signal
    import subprocess
    import sys

    from pipelinerl.ports import free_port

    emulator, api, _ = cluster
    await api.create(
        f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rl-pipelinerl", "namespace": NS}},
    )
    procs: dict[str, subprocess.Popen] = {}
    log = lambda name: (tmp_path / f"{name}.log").read_text()  # noqa: E731

    def start(name: str) -> None:
        env = {
            **os.environ,
            "PIPELINERL_KUBE_SERVER": str(emulator.url),
            "PIPELINERL_WATCH_NAMESPACES": NS,
            "PIPELINERL_PEERING": "rl-pipelinerl",
            # kopf touches every second below 11 s: a 6 s lifetime leaves a starved CI core 5 s
            # before a live leader is taken for dead (3 s left 2 s)
            "PIPELINERL_PEERING_LIFETIME": "6",
            "POD_ID": name,
            "PIPELINERL_METRICS_PORT": "0",
            "PIPELINERL_LIVENESS": f"http://127.0.0.1:{free_port()}/healthz",
        }
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pipelinerl_operator"],
            env=env,
            stdout=open(tmp_path / f"{name}.log", "wb"),
            stderr=subprocess.STDOUT,
        )

    def paused(name: str) -> bool:
        """kopf starts a replica paused and logs each change after: paused if it never resumed or
        paused again since."""
        changes = [line for line in log(name).splitlines() if "Resuming operations" in line or "Pausing" in line]
        return not changes or "Pausing" in changes[-1]

    try:
        # one after the other, so that every state of the object the second one reads holds the
        # first one, and the first one's pause (if the second one leads) is a line in its log
        start("replica-a")
        await eventually(lambda: not paused("replica-a"), timeout_s=60, what="the first replica alone resuming")
        start("replica-b")
        peers = await eventually(
            lambda: (
                len((obj(emulator, "kopf.dev/v1/kopfpeerings", "rl-pipelinerl") or {}).get("status") or {}) == 2
                and obj(emulator, "kopf.dev/v1/kopfpeerings", "rl-pipelinerl")["status"]
            ),
            timeout_s=60,
            what="both replicas in the peering",
        )
        leader = max(peers, key=lambda p: peers[p]["priority"])
        other = next(n for n in procs if n != leader)
        await eventually(lambda: paused(other), timeout_s=30, what="the other replica's pause")
        await api.create_job(manifest("first"))
        await eventually(lambda: obj(emulator, STS, "first-prl-trainer"), timeout_s=30, what="the first job's children")
        await eventually(lambda: "Timer 'resync' succeeded" in log(leader), timeout_s=40, what="the leader's resync")
        assert "Handler 'created' succeeded" in log(leader)
        assert "Handler '" not in log(other) and "Timer '" not in log(other)  # the other one paused: none ran
        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait()
        await api.create_job(manifest("second"))
        await eventually(
            lambda: obj(emulator, STS, "second-prl-trainer"), timeout_s=60, what="the survivor taking over"
        )
        assert procs[other].poll() is None and "Resuming operations after the pause" in log(other)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
