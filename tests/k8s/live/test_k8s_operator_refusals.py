"""The real kopf engine against kmock's Kubernetes emulator (see operator_harness): what the
operator and its webhook refuse (what `validate` refuses, what the platform does not allow, a
job the NATS store cannot hold), and what it never takes over (objects and credentials it did
not make), each told in the job's status and events."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import aiohttp


from job_views import ROLES, STS, all_ready, allow, condition, events, manifest, obj, status, sts_template
from operator_harness import JOBS, NS, eventually, running_operator
from pipelinerl.contracts import OperatorEnv


async def review(
    operation: str, new: dict[str, Any], old: dict[str, Any] | None = None, subresource: str | None = None
) -> dict[str, Any]:
    """An AdmissionReview as the API server POSTs it to the operator's webhook (the job's, or its
    `subresource`'s: the chart's path for each); its answer."""
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
    if subresource:
        request |= {"subResource": subresource, "kind": {"group": "autoscaling", "version": "v1", "kind": "Scale"}}
    path = {None: "/validate-job", "scale": "/validate-scale"}[subresource]
    url = f"http://127.0.0.1:{os.environ['PIPELINERL_WEBHOOK_PORT']}{path}"
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


async def test_an_api_server_that_cannot_serve_a_write_is_retried_not_told_as_a_refusal(cluster) -> None:
    """A 500 (an admission webhook unreachable, etcd overloaded) on a child's write: the pass is
    retried, the job's conditions left as they were. Before, it read as a refusal: Ready turned
    False with `ApplyRefused` and an Event, then back at the next pass."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 3, "version": 3, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: all(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES), what="StatefulSets")
        await all_ready(api)
        await eventually(lambda: condition(emulator, "Ready").get("status") == "True", what="Ready")
        emulator.failing_writes.add("statefulsets/demo-prl-generator")
        await api.patch_job("demo", {"spec": {"generator": {"replicas": 3}}})
        await asyncio.sleep(3)  # passes 0.3 s apart, each refused its write
        assert condition(emulator, "Ready")["status"] == "True" and "ApplyRefused" not in events(emulator)
        emulator.failing_writes.clear()
        await all_ready(api, generators=3)


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


async def test_a_statefulset_of_its_name_the_job_does_not_own_is_not_observed_as_its_own(cluster) -> None:
    """An earlier job's trainer StatefulSet left behind (its deletion failed), its pod restarting
    and its trainer finished: the new job of that name refuses to apply over it, and reads none of
    it as its own. Before, its restarts counted against the new job's backoffLimit and the old
    trainer's `finished` could make the new job Succeeded."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 100, "version": 100, "finished": True, "weightSyncReady": True}
    earlier = [{"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "name": "demo", "uid": "earlier"}]
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "demo-prl-trainer",
            "namespace": NS,
            "ownerReferences": [earlier[0] | {"controller": True}],
        },
        "spec": {"replicas": 1},
    }
    await api.create(f"/apis/apps/v1/namespaces/{NS}/statefulsets", theirs)
    await api.set_sts_status("demo-prl-trainer", 1, 1)
    sts_uid = obj(emulator, STS, "demo-prl-trainer")["metadata"]["uid"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-prl-trainer-0",
            "namespace": NS,
            "labels": {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": "demo-prl-trainer",
                    "uid": sts_uid,
                    "controller": True,
                }
            ],
        },
        "status": {"containerStatuses": [{"name": "trainer", "restartCount": 50}]},
    }
    await api.create(f"/api/v1/namespaces/{NS}/pods", pod)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "ApplyRefused", what="ApplyRefused")
        assert "StatefulSet demo-prl-trainer already exists" in condition(emulator, "Ready")["message"]
        await asyncio.sleep(2)  # several passes
        assert status(emulator).get("phase") not in ("Succeeded", "Failed") and not status(emulator).get("failures")


async def test_a_trainer_volume_an_earlier_job_of_its_name_kept_is_never_mounted(cluster) -> None:
    """A claim named as the trainer's first pod's (`run-<statefulset>-0`) made before the job, as
    one an earlier job of the name left (runPolicy.checkpointRetention): no StatefulSet is made
    (the trainers would mount it, the others hold GPUs with no trainer), the condition says which
    claim and what to do; once it is gone, and one
    made with the job stands in its place (the job's own, kept past a StatefulSet deleted by
    hand), the trainers are applied."""
    emulator, api, _ = cluster
    claims = f"/api/v1/namespaces/{NS}/persistentvolumeclaims"
    kept = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "run-demo-prl-trainer-0", "namespace": NS, "creationTimestamp": "2026-11-21T09:00:00Z"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    await api.create(claims, kept)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "ApplyRefused", what="ApplyRefused")
        message = condition(emulator, "Ready")["message"]
        assert (
            "PersistentVolumeClaim run-demo-prl-trainer-0 was made at 2026-11-21T09:00:00Z, before this job" in message
        )
        assert "kubectl delete pvc run-demo-prl-trainer-0 -n team-a" in message
        assert not any(obj(emulator, STS, f"demo-prl-{r}") for r in ROLES)  # no GPU held without a trainer
        await api._call("DELETE", f"{claims}/run-demo-prl-trainer-0")
        del kept["metadata"]["creationTimestamp"]  # made now: the emulator stamps it as it stamped the job
        await api.create(claims, kept)
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"), what="the trainers applied")
        await eventually(lambda: condition(emulator, "Ready").get("reason") != "ApplyRefused", what="not refused")


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
        await eventually(
            lambda: (
                status(emulator).get("credentialsSecret") == name
                and condition(emulator, "Ready").get("reason") != "ApplyRefused"
            ),
            what="said in its status",
        )
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
    # Stopped, its StatefulSets come first (none refused: they hold no pod), then the refused child.
    assert all(obj(emulator, STS, f"demo-prl-{r}")["spec"]["replicas"] == 0 for r in ROLES)


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
        # (By the next resync, 15 s; on a loaded machine a resync's request failed once and kopf
        # retried it 60 s later.)
        await eventually(lambda: obj(emulator, STS, "alpha-prl-trainer"), timeout_s=90, what="the waiting job's pods")
        await eventually(lambda: held("mid") == 0 and held("alpha") == one, what="mid's room, alpha's now")
        # Resumed, it waits in turn (the store is full), holding nothing; deleting a job makes room.
        await api.patch_job("mid", {"spec": {"suspend": False}})
        await eventually(lambda: condition(emulator, "Ready", "mid").get("reason") == "ApplyRefused", what="mid waits")
        assert held("mid") == 0
        await api.delete_job("zeta")
        await eventually(lambda: held("mid") == one, timeout_s=40, what="mid running again")


async def test_a_kind_the_api_server_does_not_serve_is_an_error_naming_it(cluster) -> None:
    """A job's gang-scheduler PodGroup where the scheduler's CRD is not installed: the API server
    answers 404 to both the apply and the create. Before, the create's 404 read as made, and the
    job's pods waited unscheduled with nothing in its status."""
    import kopf
    import pytest

    from pipelinerl.contracts import POD_GROUP_API
    from pipelinerl_operator.kube import Kube, KubeError

    emulator, _, _ = cluster
    emulator.unserved.add("podgroups")
    kube = Kube(kopf.ConnectionInfo(server=str(emulator.url)))
    group = {"apiVersion": POD_GROUP_API, "kind": "PodGroup", "metadata": {"name": "demo", "namespace": NS}, "spec": {}}
    try:
        for write in (kube.apply, kube.create):
            with pytest.raises(KubeError, match=r"serves no PodGroup \(.*is its CRD installed\?\)"):
                await write(group)
    finally:
        await kube.close()


async def test_kubectl_scale_past_the_platforms_limit_is_refused_at_the_door(cluster, monkeypatch) -> None:
    """`kubectl scale` writes the job's scale subresource: the API server sends the webhook a
    Scale, not the job (the chart's second rule, its own path). The webhook reads the job and
    checks it as scaled, as it checks the same edit of the job: past jobPolicy.maxJobPods it is
    refused, naming the limit; within it, admitted. Before, only the reconcile saw it, and the
    job went InvalidSpec after the fact."""
    emulator, api, _ = cluster
    allow(monkeypatch, maxJobPods=7)  # two trainer ranks, a preprocessor, and up to 4 generators
    await api.create_job(manifest(generator={"replicas": 2}))

    def scale(replicas: int) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": "demo", "namespace": NS},
            "spec": {"replicas": replicas},
        }

    async with running_operator(str(emulator.url)):
        assert (await review("UPDATE", scale(4), scale(2), subresource="scale"))["allowed"] is True
        refused = await review("UPDATE", scale(5), scale(2), subresource="scale")
        assert refused["allowed"] is False and refused["status"]["code"] == 422, refused
        assert "8 pods, every role together" in refused["status"]["message"]  # (jobPolicy.maxJobPods: 7)
        gone = scale(9) | {"metadata": {"name": "other", "namespace": NS}}  # no such job: the API server's 404
        assert (await review("UPDATE", gone, gone, subresource="scale"))["allowed"] is True
