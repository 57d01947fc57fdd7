"""The real kopf engine reconciling PipelineRLJobs against kmock's Kubernetes emulator (see
operator_harness): a job's life (children rendered, Ready with progress, scaled, suspended,
resumed, failed, succeeded and deleted, the operator restarted or replaced by its standby)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any


import nats
import pytest
from prometheus_client import generate_latest

from job_views import ROLES, STS, all_ready, allow, condition, events, manifest, obj, ready_job, status, sts_template
from operator_harness import JOBS, KUBE_TIMEOUT_S, NS, eventually, running_operator
from pipelinerl.contracts import JobSubjects, OperatorEnv
from pipelinerl.store import ensure_streams
from pipelinerl_operator import handlers, metrics


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
        # The suspension is counted once (it stops the deadline's clock), and its start goes from
        # the status: a field the status no longer has is removed, not left behind by the write.
        assert "suspendedSince" not in status(emulator)
        counted = status(emulator)["suspendedSeconds"]
        await asyncio.sleep(1.5)  # passes 0.3 s apart
        assert status(emulator)["suspendedSeconds"] == counted > 0


async def test_a_trainer_waiting_unready_for_its_lost_store_says_so_on_the_job(cluster) -> None:
    """A restarted trainer that finds the store lost waits before it is ready (nothing to train):
    its /status is read unready for that, while its progress is kept from when it was ready."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 8, "version": 8, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await ready_job(emulator, api)
        lost = "StoreLost: the trainer's position (step 8, its checkpoint) belongs to the job's NATS store a, ..."
        trainer.reports["demo"] = {"step": 0, "version": 0, "finished": False, "storeLost": lost}
        await api.set_sts_status("demo-prl-trainer", 2, 0)
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "StoreLost", what="StoreLost")
        assert condition(emulator, "Ready")["message"] == lost and status(emulator)["progress"]["step"] == 8
        await eventually(lambda: "StoreLost" in events(emulator), what="a StoreLost event")


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
        # every pod's count is kept (a role added to failingRoles later is charged from then on only)
        kept = {"demo-prl-trainer-0": 1, "demo-prl-trainer-1": 1, "demo-prl-generator-0": 5}
        await eventually(lambda: status(emulator)["podRestarts"] == kept)
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


@pytest.mark.parametrize("tightened", [False, True], ids=["as-it-was", "policy-tightened-since"])
async def test_finished_trainer_succeeds_and_ttl_deletes(cluster, monkeypatch, tightened) -> None:
    """With the platform's policy tightened after the job finished (its output claim no longer
    allowed), its spec no longer reads: its TTL, read from the job as stored, deletes it all the same."""
    emulator, api, trainer = cluster
    allow(monkeypatch, volumeClaims=[f"{NS}/models"])
    trainer.reports["demo"] = {"step": 50, "version": 50, "maxSteps": 50, "finished": True, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(runPolicy={"ttlSecondsAfterFinished": 4}, output={"claimName": "models"}))
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
        retention = lambda: obj(emulator, STS, "demo-prl-trainer")["spec"]["persistentVolumeClaimRetentionPolicy"][  # noqa: E731
            "whenDeleted"
        ]  # noqa: E731
        assert retention() == "Retain"  # the checkpoints are the only copy of the model until the output is written
        await all_ready(api)
        await eventually(lambda: status(emulator).get("phase") == "Succeeded", what="Succeeded")
        # The final model is on the output claim: the volumes may go with the job (applied once the
        # status that says so is written).
        await eventually(lambda: retention() == "Delete", what="the volumes free to go")
        assert condition(emulator, "Succeeded")["message"] == "trainer finished at step 50"
        assert condition(emulator, "Progressing")["status"] == "False"
        if tightened:
            allow(monkeypatch)  # the claim no longer allowed
            await eventually(lambda: condition(emulator, "Ready").get("reason") == "InvalidSpec", what="unread")
        # ttlSecondsAfterFinished: the operator deletes the job; the finalizer is released (NATS is absent here).
        await eventually(lambda: obj(emulator, JOBS, "demo") is None, timeout_s=15, what="TTL deletion")
        await eventually(lambda: {"Succeeded", "TTLExpired"} <= set(events(emulator)))
        if not tightened:
            await eventually(lambda: "StreamsDeleteFailed" in events(emulator))


async def test_a_running_job_whose_spec_no_longer_reads_is_stopped_by_its_suspension(cluster, monkeypatch) -> None:
    """A policy tightened under a running job (its output claim no longer allowed): the operator
    renders nothing for it and leaves its pods as they are, said as they are. Suspended, its own
    StatefulSets are scaled to none all the same: a suspension frees the job's GPUs."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 7, "version": 7, "finished": False, "weightSyncReady": True}
    allow(monkeypatch, volumeClaims=[f"{NS}/models"])
    async with running_operator(str(emulator.url)):
        await ready_job(emulator, api, output={"claimName": "models"})
        allow(monkeypatch)  # the claim no longer allowed
        await eventually(lambda: condition(emulator, "Ready").get("reason") == "InvalidSpec", what="unread")
        assert condition(emulator, "TrainerReady")["reason"] == "AllReplicasReady"  # left as they are
        assert all(_replicas(obj(emulator, STS, f"demo-prl-{r}")) for r in ROLES)
        await api.patch_job("demo", {"spec": {"suspend": True}})
        await eventually(
            lambda: not any(_replicas(obj(emulator, STS, f"demo-prl-{r}")) for r in ROLES), what="scaled to none"
        )
        await eventually(lambda: condition(emulator, "TrainerReady").get("reason") == "ScaledDown", what="said")
        assert condition(emulator, "Ready")["reason"] == "InvalidSpec"
        # Suspended as any job: its phase says so (it said Running), and its room in the NATS store
        # goes back once its streams are gone (`store_bytes_needed`; no NATS here to delete them).
        await eventually(lambda: status(emulator).get("phase") == "Suspended", what="Suspended")


def stopping_writes(seen: list[str], stall: bool) -> Callable[[Any], bool]:
    """The emulator's `stall` predicate that notes in `seen` each StatefulSet written to no
    replicas (a pass stopping the job's pods) and, if `stall`, stalls the first."""

    def stops(request: Any) -> bool:
        data = request.data if isinstance(request.data, dict) else {}
        if request.method == "PATCH" and (data.get("spec") or {}).get("replicas") == 0:
            seen.append(request.name)
            return stall
        return False

    return stops


async def test_a_job_that_ends_tells_so_even_when_freeing_its_pods_fails(cluster) -> None:
    """The pass that writes a job Succeeded posts its Events before it frees the job's pods: when
    that scale-down times out (the API server answers after the operator's client gave up), the
    Event stands, and a later pass scales the job down. Posted after it, the Event was lost: the
    passes after the write, the job already ended, make none."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 50, "version": 50, "maxSteps": 50, "finished": True, "weightSyncReady": True}
    stalled: list[str] = []
    emulator.stall = stopping_writes(stalled, stall=True)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"))
        await all_ready(api)
        await eventually(lambda: status(emulator).get("phase") == "Succeeded", what="Succeeded")
        await eventually(lambda: stalled, timeout_s=15, what="the scale-down stalled")
        await eventually(lambda: "Succeeded" in events(emulator), timeout_s=15, what="its Event")
        # The stalled write holds its pass for the client's timeout (KUBE_TIMEOUT_S, 10 s); the
        # resync that raised runs again a resync interval later (0.3 s here). 15 s from the stall
        # left a loaded CI machine 4 s for that pass: not enough once.
        await eventually(
            lambda: all(obj(emulator, STS, f"demo-prl-{r}")["spec"]["replicas"] == 0 for r in ROLES),
            timeout_s=KUBE_TIMEOUT_S + 20,
            what="its pods freed by a later pass",
        )
        assert len(stalled) == 1 and events(emulator).count("Succeeded") == 1


async def test_a_pass_in_flight_when_the_other_replica_writes_does_not_write_over_it(cluster) -> None:
    """Two replicas can both be reconciling (kopf's peering is a turn, not a lock): here the other
    one marks the job Failed (played by the test) while this one's pass, which read the job
    Running, waits on the API server (its listing of the job's pods held), and the trainer then
    tells that pass it has finished. That pass's status write (Succeeded) is refused: the job is
    no longer at the version it read. The next pass goes on from Failed, which stands, and the
    job's pods are released. Written unconditionally, the pass turned the job Succeeded."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 7, "version": 7, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await ready_job(emulator, api)
        assert status(emulator)["phase"] == "Running"
        emulator.gates["pods"] = gate = asyncio.Event()
        emulator.waiting.clear()
        await asyncio.wait_for(emulator.waiting.wait(), 10)  # a pass in flight, having read the job Running
        trainer.reports["demo"] = {"step": 50, "version": 50, "finished": True, "weightSyncReady": True}
        await api.patch_job_status("demo", {"phase": "Failed", "completionTime": "2026-12-04T20:00:00Z"})
        del emulator.gates["pods"]
        gate.set()
        await eventually(
            lambda: all(obj(emulator, STS, f"demo-prl-{r}")["spec"]["replicas"] == 0 for r in ROLES),
            what="the ended job's pods released",
        )
        await asyncio.sleep(1)  # passes 0.3 s apart
        assert status(emulator)["phase"] == "Failed"


async def test_a_pass_that_read_the_job_suspended_does_not_stop_the_pods_of_its_resume(cluster) -> None:
    """The other replica's resume (played by the test: the job un-suspended) lands while this
    one's pass, which read the job suspended, waits on the API server (its reads of the
    StatefulSets held). About to stop the job's pods, that pass reads the job again, finds it
    moved on and is dropped: the pods are never stopped. Before, they were stopped until the next
    pass started them again (every rank restarted)."""
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 7, "version": 7, "finished": False, "weightSyncReady": True}
    stopped: list[str] = []
    async with running_operator(str(emulator.url)):
        await ready_job(emulator, api)
        emulator.stall = stopping_writes(stopped, stall=False)
        emulator.gates["statefulsets"] = gate = asyncio.Event()
        emulator.waiting.clear()
        await api.patch_job("demo", {"spec": {"suspend": True}})
        await asyncio.wait_for(emulator.waiting.wait(), 10)  # a pass in flight
        await asyncio.sleep(0.5)  # the suspension's own pass started too (behind it, or it)
        await api.patch_job("demo", {"spec": {"suspend": False}})
        del emulator.gates["statefulsets"]
        gate.set()
        await asyncio.sleep(3)  # passes 0.3 s apart
        assert stopped == [] and status(emulator)["phase"] == "Running"


async def test_a_pass_that_read_the_job_resumed_does_not_start_the_pods_of_its_suspension(cluster) -> None:
    """The mirror of the one above: the job is resumed and, while the resume's pass waits on the
    API server (its reads of the StatefulSets held), suspended again (the other replica, played by
    the test). About to start the pods, that pass reads the job again, finds it moved on and is
    dropped: no pod is started. Started, the trainer would have written a new store the
    suspension's next pass then deleted."""
    emulator, api, _ = cluster
    started: list[str] = []

    def starts(request: Any) -> bool:
        data = request.data if isinstance(request.data, dict) else {}
        if request.method == "PATCH" and (data.get("spec") or {}).get("replicas"):
            started.append(request.name)
        return False

    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(suspend=True))
        await eventually(lambda: status(emulator).get("phase") == "Suspended", what="Suspended")
        await eventually(lambda: _rests(emulator), what="at rest")
        emulator.stall = starts
        emulator.gates["statefulsets"] = gate = asyncio.Event()
        emulator.waiting.clear()
        await api.patch_job("demo", {"spec": {"suspend": False}})
        await asyncio.wait_for(emulator.waiting.wait(), 10)  # the resume's pass in flight
        await api.patch_job("demo", {"spec": {"suspend": True}})
        del emulator.gates["statefulsets"]
        gate.set()
        await asyncio.sleep(3)  # passes 0.3 s apart
        assert started == [] and status(emulator)["phase"] == "Suspended"
        assert not any(_replicas(obj(emulator, STS, f"demo-prl-{r}")) for r in ROLES)


async def test_a_suspended_jobs_record_the_other_replica_wrote_meanwhile_stands(
    cluster, nats_url: str, monkeypatch
) -> None:
    """The suspended variant: the other replica (played by the test) has read the suspended job's
    checkpoint record, written it into the status, deleted the job's streams (NATS holds none of
    its here) and given its room back while this one's pass, which read the job holding room with
    no record, waits on the API server (its listing of the job's pods held). That pass finds no
    record (the streams are gone) and would write none; its write is refused, and the passes
    after it go on from the record: it stands, and the room stays given back. Written
    unconditionally, the pass wrote the record away, and the job's resume would start its store
    afresh."""
    from pipelinerl.capacity import reserved_bytes
    from pipelinerl.spec import parse_job

    emulator, api, _ = cluster
    room = reserved_bytes(parse_job(manifest()).spec)
    monkeypatch.setenv("PIPELINERL_NATS_STORE_BYTES", str(2 * room))
    monkeypatch.setenv(OperatorEnv.DEFAULT_NATS_URL, nats_url)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: status(emulator).get("natsReservedBytes") == room, what="its room")
        emulator.gates["pods"] = gate = asyncio.Event()
        emulator.waiting.clear()
        await api.patch_job("demo", {"spec": {"suspend": True}})
        await asyncio.wait_for(emulator.waiting.wait(), 10)  # a pass in flight, having read the job holding room
        record = {"store": "a5a6bc9c889b4c4090c9fdd25e8c419b", "step": 7, "problems": 123}
        await api.patch_job_status("demo", {"natsReservedBytes": 0, "suspendedStore": record})
        del emulator.gates["pods"]
        gate.set()
        await eventually(lambda: status(emulator).get("phase") == "Suspended", what="the passes after it")
        await asyncio.sleep(2)  # several resyncs (0.3 s apart) more
        assert status(emulator).get("suspendedStore") == record and status(emulator)["natsReservedBytes"] == 0


async def test_a_store_made_again_from_the_kept_record_stands_while_the_job_may_run_in_it(
    cluster, nats_url: str
) -> None:
    """A pass that read the job suspended with its checkpoint record kept (the record stands, its
    streams not yet deleted) goes on after a resume it did not see made the store again from that
    record: the other replica's, or one whose status write was refused before the job was
    suspended again. While the job has pods, the restored store stands; once they are gone, a
    record the trainer told there since replaces the kept one (its streams go a pass later); with
    none, the kept record still holds and the streams go. Before, the pass deleted the restored
    store under the running job, which then met a lost store. A finished job's streams, too, go
    only once its pods are gone."""
    import logging

    import kopf

    from pipelinerl.claims import Claims
    from pipelinerl.contracts import JOB_LABEL
    from pipelinerl.messages import Checkpointed, encode
    from pipelinerl.ports import free_port
    from pipelinerl.spec import parse_job
    from pipelinerl.store import recover_store, store_identity
    from pipelinerl_operator.config import from_env
    from pipelinerl_operator.job_streams import JobStreams
    from pipelinerl_operator.kube import Kube
    from pipelinerl_operator.reconcile import release_streams

    emulator, api, _ = cluster
    subjects, spec = JobSubjects("demo", NS), parse_job(manifest()).spec
    body = {"metadata": {"name": "demo", "namespace": NS, "uid": "u"}, "spec": {}}
    told: list[str] = []
    cfg = from_env({OperatorEnv.DEFAULT_NATS_URL: nats_url})
    streams = JobStreams(body, cfg, lambda _type, reason, _message: told.append(reason), logging.getLogger("test"))
    kube = Kube(kopf.ConnectionInfo(server=str(emulator.url)))
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def store() -> str | None:  # the store's identity; None where its streams are gone
        try:
            return (await store_identity(js, subjects, timeout_s=1)).id if await js.streams_info() else None
        except TimeoutError:
            return None

    try:
        await ensure_streams(js, subjects, 1)
        suspended_in = await store_identity(js, subjects)
        kept = {"store": suspended_in.id, "step": 7, "problems": 123}
        restored = (await recover_store(js, subjects, spec, kept["store"], 7, Claims(123))).id  # the resume
        await api.create_pod("demo-prl-trainer-0", {JOB_LABEL: "demo"}, restarts=0)
        assert await release_streams(kube, streams, True, kept) == (kept, False)
        assert await store() == restored and told == []
        # Its pods gone, having told no checkpoint there: the kept record holds; the streams go.
        await kube.delete("v1", "Pod", NS, "demo-prl-trainer-0")
        assert await release_streams(kube, streams, True, kept) == (kept, True)
        assert await store() is None and told == ["StreamsDeleted"]
        # Made again, and its trainer told a newer checkpoint there on its way out.
        restored = (await recover_store(js, subjects, spec, kept["store"], 7, Claims(123))).id
        await js.publish(subjects.checkpoint, encode(Checkpointed(store=restored, step=9, problems=150, redraw="140")))
        newer = {"store": restored, "step": 9, "problems": 150, "redraw": "140"}
        assert await release_streams(kube, streams, True, kept) == (newer, False)
        assert await store() == restored
        assert await release_streams(kube, streams, True, newer) == (newer, True)
        assert await store() is None
        # Resumed (the kept record left the status with the restore), suspended again before its
        # trainer told any checkpoint (its pods never started): the record the store holds, the
        # one it was made from, is kept, and the streams go a pass later. Before, they went at
        # once with no record, and the next resume met a lost store.
        await recover_store(js, subjects, spec, kept["store"], 7, Claims(123, ((5, 9),)))
        again = kept | {"redraw": "5-8"}
        assert await release_streams(kube, streams, True, None) == (again, False)
        assert await store() is not None
        assert await release_streams(kube, streams, True, again) == (again, True)
        assert await store() is None
        # ... or after its trainer told it again at its start: the same checkpoint is nothing new.
        # Before, each pass read it back as a record to write first, and the streams never went.
        await recover_store(js, subjects, spec, kept["store"], 7, Claims(123))
        await js.publish(subjects.checkpoint, encode(Checkpointed(store=kept["store"], step=7, problems=123)))
        assert await release_streams(kube, streams, True, None) == (kept, False)
        assert await release_streams(kube, streams, True, kept) == (kept, True)
        assert await store() is None
        # Finished (not suspended): its streams go once its pods are gone, not under a pod on its
        # way out (a service starting there would make them again, outside the books).
        await ensure_streams(js, subjects, 1)
        await api.create_pod("demo-prl-generator-0", {JOB_LABEL: "demo"}, restarts=0)
        assert await release_streams(kube, streams, False, None) == (None, False)
        assert await store() is not None
        await kube.delete("v1", "Pod", NS, "demo-prl-generator-0")
        assert await release_streams(kube, streams, False, None) == (None, True)
        assert await store() is None
        # NATS not answering: nothing is known, so nothing goes, and the Event says why.
        gone = from_env({OperatorEnv.DEFAULT_NATS_URL: f"nats://127.0.0.1:{free_port()}"})
        unreachable = JobStreams(body, gone, lambda _type, reason, _message: told.append(reason), streams.logger)
        assert await release_streams(kube, unreachable, True, newer) == (newer, False)
        assert told[-1] == "StreamsDeleteFailed"
    finally:
        await nc.close()
        await kube.close()


async def test_operator_restart_creates_no_duplicates(cluster) -> None:
    emulator, api, trainer = cluster
    trainer.reports["demo"] = {"step": 7, "version": 7, "finished": False, "weightSyncReady": True}
    async with running_operator(str(emulator.url)):
        await ready_job(emulator, api)
    creates_before = [c for c in emulator.creates if not c.startswith("events/")]
    async with running_operator(str(emulator.url)):
        trainer.reports["demo"]["step"] = 8  # the new operator picks up where the old one stopped
        await eventually(lambda: status(emulator)["progress"]["step"] == 8, what="resumed reconciliation")
    creates_after = [c for c in emulator.creates if not c.startswith("events/")]
    assert creates_after == creates_before and len(set(creates_after)) == len(creates_after) == 1 + 9, creates_after
    assert condition(emulator, "Ready")["status"] == "True"


async def test_a_job_at_rest_costs_the_resync_no_call_until_its_idle_stretch_ends(cluster, monkeypatch) -> None:
    """A suspended job (no pods, no room in the store) is at rest once a pass found it so: the
    resync (every 0.3 s here) makes no API call for it for IDLE_RESYNC_SECONDS, then one pass
    puts back a StatefulSet deleted by hand; an edit (the resume) is acted on without waiting out
    the idle stretch."""
    emulator, api, _ = cluster
    monkeypatch.setattr(handlers, "IDLE_RESYNC_SECONDS", 6.0)
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest(suspend=True))
        await eventually(lambda: status(emulator).get("phase") == "Suspended", what="Suspended")
        # At rest, as the job now is (kopf's own annotations, written after a change handler, make
        # a version its last pass did not see: that takes one more pass).
        await eventually(lambda: _rests(emulator), what="at rest")
        emulator.counts.clear()
        await asyncio.sleep(2.0)  # six resync ticks
        assert not emulator.counts, emulator.counts
        await api._call("DELETE", f"/apis/apps/v1/namespaces/{NS}/statefulsets/demo-prl-generator")
        await eventually(lambda: obj(emulator, STS, "demo-prl-generator"), timeout_s=15, what="put back")
        assert emulator.counts["statefulsets"] > 0
        # The edit is acted on well within a (now long) idle stretch: a pass left at rest does not
        # hold back one the edit made. Not in 3 s: an overtaken pass retries a second later, and a
        # loaded machine took longer than that.
        monkeypatch.setattr(handlers, "IDLE_RESYNC_SECONDS", 60.0)
        await api.patch_job("demo", {"spec": {"suspend": False}})
        await eventually(lambda: _replicas(obj(emulator, STS, "demo-prl-trainer")) == 2, timeout_s=15, what="resumed")


async def test_a_pass_that_changes_nothing_writes_nothing(cluster) -> None:
    """A job whose passes find it as they left it (its pods not up: kmock runs none) gets no
    status write from the resync (every 0.3 s here), only reads."""
    emulator, api, _ = cluster
    async with running_operator(str(emulator.url)):
        await api.create_job(manifest())
        await eventually(lambda: obj(emulator, STS, "demo-prl-trainer"), what="applied")
        await asyncio.sleep(1.5)  # the first passes' writes settle
        emulator.verbs.clear()
        await asyncio.sleep(2.0)  # six resync ticks
        assert emulator.verbs[("statefulsets", "get")] > 0, "passes ran"
        assert not emulator.verbs[("pipelinerljobs/status", "patch")], emulator.verbs


def _rests(emulator) -> bool:
    version = obj(emulator, JOBS, "demo")["metadata"]["resourceVersion"]
    return any(version in (last[0], last[2]) for last in handlers.STATE.last.values()) and bool(handlers.STATE.rested)


def _replicas(sts: dict[str, Any] | None) -> int:
    return int(((sts or {}).get("spec") or {}).get("replicas") or 0)


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


async def test_a_deleted_jobs_streams_go_once_its_pods_are_gone(cluster, nats_url: str, monkeypatch) -> None:
    """A pod of the job still up when it is deleted (a trainer checkpointing on its way out) could
    make its streams again (a service that starts joins the job): they are deleted, and the job
    let go, only once its pods are gone; past PODS_GONE_WAIT_S, whatever is left."""
    emulator, api, _ = cluster
    allow(monkeypatch, natsServers=[nats_url.removeprefix("nats://")])
    nc = await nats.connect(nats_url, connect_timeout=2)
    js = nc.jetstream(timeout=2)
    await ensure_streams(js, JobSubjects("demo", NS), 1)
    labels = {"pipelinerl.dev/job": "demo", "pipelinerl.dev/role": "trainer"}
    try:
        async with running_operator(str(emulator.url)):
            await api.create_job(manifest(nats={"url": nats_url}))
            await eventually(
                lambda: "pipelinerl.dev/cleanup" in obj(emulator, JOBS, "demo")["metadata"].get("finalizers", [])
            )
            await api.create_pod("demo-prl-trainer-0", labels, restarts=0)
            await api.delete_job("demo")
            await eventually(lambda: not obj(emulator, STS, "demo-prl-trainer"), what="its StatefulSets deleted")
            await asyncio.sleep(2 * handlers.PODS_POLL_S)
            assert obj(emulator, JOBS, "demo") is not None  # held while its pod is there
            assert len(await js.streams_info()) == len(JobSubjects("demo", NS).streams)
            await api._call("DELETE", f"/api/v1/namespaces/{NS}/pods/demo-prl-trainer-0")
            await eventually(lambda: obj(emulator, JOBS, "demo") is None, timeout_s=15, what="deleted")
            assert await js.streams_info() == []
            # A pod that never goes (its node lost) holds the deletion no longer than the bound.
            monkeypatch.setattr(handlers, "PODS_GONE_WAIT_S", 0.0)
            await api.create_job(manifest("late", nats={"url": nats_url}))
            await eventually(lambda: obj(emulator, STS, "late-prl-trainer"), what="the second job's trainers")
            await api.create_pod("late-prl-trainer-0", {**labels, "pipelinerl.dev/job": "late"}, restarts=0)
            await api.delete_job("late")
            await eventually(lambda: obj(emulator, JOBS, "late") is None, timeout_s=15, what="deleted, pod or not")
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


async def test_two_replicas_take_turns_and_the_survivor_takes_over(cluster, tmp_path) -> None:
    """The chart's two operator replicas (real processes, as in their pods) meet in kopf's peering
    object: one reconciles, the other pauses; the one reconciling is killed (SIGKILL) and the
    other takes the next job once the dead one's turn has lapsed."""
    import signal
    import subprocess
    import sys
    import time

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
            # kopf touches the peering `lifetime` less 5-10 s apart (at least every second), so a
            # leader starved 5-10 s is taken for dead whatever the lifetime: 10 s leaves it 5-9 s
            # at random (6 s left 5 s, which a loaded CI crossed: both replicas ran handlers)
            "PIPELINERL_PEERING_LIFETIME": "10",
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

    since: list[float] = []  # when the other replica was first seen paused, since without a break
    touches: set[str] = set()  # the leader's keep-alive stamps seen meanwhile

    def settled(name: str, leader: str, lifetime_s: float = 10.0) -> bool:
        if not paused(name):
            since.clear()
            touches.clear()
            return False
        since[:] = since or [time.monotonic()]
        entry = ((obj(emulator, "kopf.dev/v1/kopfpeerings", "rl-pipelinerl") or {}).get("status") or {}).get(leader)
        touches.add((entry or {}).get("lastseen", ""))
        return time.monotonic() - since[0] > lifetime_s + 2 and len(touches - {""}) >= 2

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
        # A replica paused from the start logs nothing, so one line-less moment proves nothing: a
        # loaded machine may starve the leader past its lifetime and let the other resume a
        # moment later (kopf's takeover, as meant). Settled: paused throughout a whole lifetime
        # while the leader kept touching the peering, so the other has read it alive since.
        await eventually(lambda: settled(other, leader), timeout_s=90, what="the other replica settled paused")
        await api.create_job(manifest("first"))
        await eventually(lambda: obj(emulator, STS, "first-prl-trainer"), timeout_s=30, what="the first job's children")
        await eventually(lambda: "Timer 'resync' succeeded" in log(leader), timeout_s=40, what="the leader's resync")
        assert "Handler 'created' succeeded" in log(leader)
        # the other one ran nothing before it first took its turn: kopf's turn is a lease, not a
        # fence, so a loaded machine starving the leader past its lifetime may let the other resume
        # (and run handlers, guarded by the resourceVersion checks), but a paused one runs none
        lines = log(other).splitlines()
        resumed = next((i for i, line in enumerate(lines) if "Resuming operations" in line), len(lines))
        assert not [line for line in lines[:resumed] if "Handler '" in line or "Timer '" in line]
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
