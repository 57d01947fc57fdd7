"""Pure status computation: conditions roll-up, terminal outcomes, transitions and Events."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from pipelinerl.contracts import TrainerStatus
from pipelinerl.crd import JobStatus
from pipelinerl_operator.pods import PodProblem, pod_problems, trainer_gang_to_restart
from pipelinerl_operator.status import (
    Observed,
    RoleObserved,
    at_rest,
    compute,
    merge_patch,
    starting_point,
    ttl_expired,
)

T0 = datetime(2026, 11, 22, 3, 0, tzinfo=timezone.utc)
UP = {"generator": RoleObserved(2, 2, 2), "preprocessor": RoleObserved(1, 1, 1), "trainer": RoleObserved(1, 1, 1)}


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def run(previous=None, now=T0, **kw):
    kw.setdefault("roles", UP)
    kw.setdefault("created", T0)
    report = kw.setdefault("trainer_status", {"step": 1, "version": 1, "weightSyncReady": True})
    if report is not None:
        kw["trainer_status"] = TrainerStatus.model_validate(report)
    return compute(Observed(generation=1, now=now, previous=previous or {}, **kw))


def test_ready_rollup_and_schema_valid() -> None:
    status, events = run()
    JobStatus.model_validate(status)
    assert cond(status, "Ready")["status"] == "True" and status["phase"] == "Running"
    assert [e.reason for e in events] == ["Ready"]
    status, _ = run(roles={**UP, "preprocessor": RoleObserved(1, 1, 0)})
    assert cond(status, "Ready") | {"lastTransitionTime": ""} == {
        "type": "Ready",
        "status": "False",
        "reason": "PreprocessorNotReady",
        "lastTransitionTime": "",
        "message": "PreprocessorReady: ReplicasNotReady 0/1 ready; "
        "WeightSyncReady: WaitingForMembers the weight broadcast group is not complete",
        "observedGeneration": 1,
    }


def test_transition_time_kept_while_unchanged() -> None:
    first, _ = run()
    second, events = run(previous=first, now=T0 + timedelta(minutes=5))
    assert cond(second, "Ready")["lastTransitionTime"] == cond(first, "Ready")["lastTransitionTime"]
    assert events == []
    third, events = run(
        previous=second, now=T0 + timedelta(minutes=6), roles={**UP, "generator": RoleObserved(2, 2, 1)}
    )
    assert cond(third, "Degraded")["status"] == "True" and cond(third, "Degraded")["reason"] == "GeneratorsMissing"
    assert cond(third, "Ready")["lastTransitionTime"] == "2026-11-22T03:06:00Z"
    assert {e.reason for e in events} == {"NotReady", "Degraded"}


def test_success_is_terminal_and_sticky() -> None:
    done, events = run(trainer_status={"step": 100, "version": 100, "finished": True})
    assert done["phase"] == "Succeeded" and done["completionTime"] == "2026-11-22T03:00:00Z"
    assert cond(done, "Ready")["reason"] == "Succeeded" and cond(done, "Progressing")["status"] == "False"
    assert "Succeeded" in {e.reason for e in events}
    later, events = run(previous=done, trainer_status=None, roles={r: RoleObserved(o.desired) for r, o in UP.items()})
    assert later["phase"] == "Succeeded" and later["progress"]["step"] == 100 and events == []


def test_backoff_and_deadline() -> None:
    status = {}
    for minute in range(4):  # one pod failing again and again: each restart is a failure
        status, _ = run(
            previous=status, now=T0 + timedelta(minutes=3 * minute), pod_restarts={"t-0": minute + 1}, backoff_limit=3
        )
    assert status["failures"] == 4 and status["phase"] == "Failed"
    assert cond(status, "Failed")["reason"] == "BackoffLimitExceeded"
    ok, _ = run(pod_restarts={"t-0": 3}, backoff_limit=3)  # restarts before the operator saw them count too
    assert ok["failures"] == 3 and ok["phase"] == "Running" and cond(ok, "Degraded")["reason"] == "PodsRestarted"
    started, _ = run()
    late, events = run(previous=started, now=T0 + timedelta(hours=2), active_deadline_seconds=3600)
    assert late["phase"] == "Failed" and cond(late, "Failed")["reason"] == "DeadlineExceeded"
    assert "DeadlineExceeded" in {e.reason for e in events}


def test_failures_are_counted_per_incident_and_never_decrease() -> None:
    # One rank fails; the other trainer pods' collectives break and they restart a minute later:
    # one incident, one failure.
    first, _ = run(pod_restarts={"t-0": 1, "t-1": 0, "t-2": 0})
    second, _ = run(previous=first, now=T0 + timedelta(minutes=1), pod_restarts={"t-0": 1, "t-1": 1, "t-2": 1})
    assert (first["failures"], second["failures"]) == (1, 1)
    assert second["lastIncident"] == {"time": "2026-11-22T03:00:00Z", "pods": ["t-0", "t-1", "t-2"]}
    # The same pod again, even soon: a new incident; after the window, any pod: a new one.
    third, _ = run(previous=second, now=T0 + timedelta(seconds=90), pod_restarts={"t-0": 2, "t-1": 1, "t-2": 1})
    fourth, _ = run(previous=third, now=T0 + timedelta(minutes=10), pod_restarts={"t-0": 2, "t-1": 2, "t-2": 1})
    assert (third["failures"], fourth["failures"]) == (2, 3)
    # Pods recreated (a gang restart, a drain): counts reset to 0, nothing counted, none forgotten.
    fifth, _ = run(previous=fourth, now=T0 + timedelta(minutes=11), pod_restarts={"t-0": 0, "t-1": 0, "t-2": 0})
    assert fifth["failures"] == 3
    sixth, _ = run(previous=fifth, now=T0 + timedelta(minutes=20), pod_restarts={"t-0": 1, "t-1": 0, "t-2": 0})
    assert sixth["failures"] == 4
    JobStatus.model_validate(sixth)


def test_trainer_pods_that_stopped_with_their_gang_are_no_failure() -> None:
    """One trainer pod drained: the others stop with it, their stop checkpoint written, and exit
    STOPPED_EXIT to start again (`pipelinerl_trainer.stopping`): no failure. A crash after that
    is one."""
    from pipelinerl_operator.pods import pods_stopped

    def pod(name: str, code: int | None) -> dict:
        last = {"terminated": {"exitCode": code}} if code is not None else {}
        return {"metadata": {"name": name}, "status": {"containerStatuses": [{"lastState": last}]}}

    stopped = pods_stopped([pod("t-0", 75), pod("t-1", 1), pod("t-2", None)])
    assert stopped == {"t-0"}
    first, _ = run(pod_restarts={"t-0": 0, "t-1": 0})
    second, _ = run(previous=first, pod_restarts={"t-0": 1, "t-1": 0}, pods_stopped=frozenset({"t-0"}))
    third, _ = run(previous=second, pod_restarts={"t-0": 1, "t-1": 0}, pods_stopped=frozenset({"t-0"}))
    assert (second["failures"], third["failures"]) == (0, 0)
    crashed, _ = run(previous=third, now=T0 + timedelta(minutes=5), pod_restarts={"t-0": 2, "t-1": 0})
    assert crashed["failures"] == 1


def test_suspend_and_invalid_spec() -> None:
    suspended, events = run(suspend=True, roles={r: RoleObserved(o.desired) for r, o in UP.items()})
    assert suspended["phase"] == "Suspended" and cond(suspended, "Suspended")["status"] == "True"
    assert cond(suspended, "GeneratorsReady")["reason"] == "ScaledDown"
    invalid, events = run(spec_error="generator.tensorParallel (2) needs at least as many generator.gpus (1)")
    assert cond(invalid, "Ready")["reason"] == "InvalidSpec" and invalid["phase"] == "Pending"
    assert [e.reason for e in events] == ["InvalidSpec"]
    # Its pods, left as they are, are told as they are (not "ScaledDown").
    assert cond(invalid, "GeneratorsReady")["reason"] == "AllReplicasReady"
    assert cond(invalid, "WeightSyncReady")["reason"] == "InvalidSpec"  # its trainer is not asked


def test_a_running_jobs_spec_that_no_longer_reads_neither_fails_nor_counts_it() -> None:
    """A spec refused on a running job (a policy tightened since, `kubectl scale` past it: the
    webhook does not see scale writes) leaves its runPolicy unread: the pass counts no failure
    and ends nothing by it, and keeps the pods' counts as they were, so that fixing the spec
    counts only restarts that happened since."""
    running, _ = run(pod_restarts={"demo-trainer-0": 0, "demo-preprocessor-0": 0})
    running, _ = run(previous=running, pod_restarts={"demo-trainer-0": 1, "demo-preprocessor-0": 0})
    assert running["failures"] == 1 and running["phase"] == "Running"
    restarts = {"demo-trainer-0": 2}  # what a pass without the spec counts: the trainer's alone
    invalid, _ = run(
        previous=running, spec_error="generator.replicas: more pods than a job may run", pod_restarts=restarts
    )
    assert invalid["phase"] == "Running" and invalid["failures"] == 1  # backoffLimit unread: not 0
    assert cond(invalid, "Ready")["reason"] == "InvalidSpec"
    assert invalid["podRestarts"] == {"demo-trainer-0": 1, "demo-preprocessor-0": 0}
    fixed, _ = run(previous=invalid, pod_restarts={"demo-trainer-0": 2, "demo-preprocessor-0": 0})
    assert fixed["phase"] == "Running" and fixed["failures"] == 2  # the trainer's one restart since
    JobStatus.model_validate(invalid)


def test_a_role_added_to_failing_roles_is_charged_only_for_restarts_after_it() -> None:
    """Every pod's restart count is kept, the failing roles' alone charged: a job whose generators
    restarted 4 and 3 times over days, uncharged, then given `failingRoles: [trainer, generator]`,
    is charged from there on only. Counting them afresh, it failed at once (7 > backoffLimit 3)."""
    pods = {"j-trainer-0": 0, "j-generator-0": 4, "j-generator-1": 3}
    trainer_only = frozenset({"j-trainer-0"})
    days, _ = run(pod_restarts=pods, failing_pods=trainer_only, backoff_limit=3)
    assert days["failures"] == 0 and days["podRestarts"] == pods
    both = trainer_only | {"j-generator-0", "j-generator-1"}
    edited, _ = run(previous=days, now=T0 + timedelta(minutes=1), pod_restarts=pods, failing_pods=both, backoff_limit=3)
    assert edited["failures"] == 0 and edited["phase"] == "Running"
    later, _ = run(
        previous=edited,
        now=T0 + timedelta(minutes=10),
        pod_restarts=pods | {"j-generator-1": 4},
        failing_pods=both,
        backoff_limit=3,
    )
    assert later["failures"] == 1  # its restart since


def test_a_condition_message_past_the_crds_bound_is_cut_and_says_so() -> None:
    problems = "; ".join(f"spec.generator.podTemplate.spec.containers[side].env[{i}]: not allowed" for i in range(900))
    s, _ = run(spec_error=problems)
    message = cond(s, "Ready")["message"]
    assert len(problems) > 32768 and len(message) == 32768
    assert message.startswith(problems[:1000]) and message.endswith(f"(cut: {len(problems)} characters in all)")
    JobStatus.model_validate(s)


def test_malformed_or_missing_trainer_report_keeps_previous_progress() -> None:
    first, _ = run(trainer_status={"step": 5, "version": 5, "weightSyncReady": True})
    with pytest.raises(ValidationError):  # progress.fetch_trainer_status reads such a report as None
        TrainerStatus.model_validate({"step": "many"})
    second, _ = run(previous=first, trainer_status=None)
    assert second["progress"]["step"] == 5


def test_a_report_with_keys_of_another_release_is_read_and_a_malformed_one_is_not() -> None:
    """A trainer of another release (a job's own trainer.image, an upgrade rolling the operator and
    the pods apart) reports keys this build does not know: they are left out. Refused, the trainer
    read as unreachable, and its `finished` was never seen: the job held its GPUs to a deadline."""
    from pipelinerl_operator.progress import read_trainer_status

    newer = read_trainer_status(b'{"step": 9, "version": 9, "finished": true, "tokensPerDollar": 3}')
    assert (newer.step, newer.finished) == (9, True)
    for body in (b'{"step": "many"}', b"[1, 2]", b"not json"):
        with pytest.raises(ValueError):
            read_trainer_status(body)


def test_weight_group_not_formed_is_not_ready() -> None:
    status, _ = run(trainer_status={"step": 0, "version": 0})  # the trainer still waits for generators
    assert cond(status, "WeightSyncReady")["reason"] == "WaitingForMembers"
    assert cond(status, "Ready")["status"] == "False"


def test_ttl() -> None:
    done, _ = run(trainer_status={"finished": True, "step": 1})
    assert not ttl_expired(done, None, T0 + timedelta(days=9))
    assert not ttl_expired(done, 60, T0 + timedelta(seconds=30))
    assert ttl_expired(done, 60, T0 + timedelta(seconds=60))


def test_a_job_is_at_rest_once_ended_or_suspended_with_nothing_left_to_move() -> None:
    """What the resync passes over (handlers.resting): no pod left, no store room held, nothing
    refused that the cluster could let through; a running job never."""
    gone = {r: RoleObserved(0, 0, 0) for r in UP}
    assert not at_rest(run()[0])
    done, _ = run(trainer_status={"finished": True, "step": 1})
    assert done["phase"] == "Succeeded" and not at_rest(done)  # its pods not gone yet
    stopped, _ = run(previous=done, roles=gone, trainer_status={"finished": True, "step": 1})
    assert stopped["phase"] == "Succeeded" and at_rest(stopped)
    assert not at_rest(stopped | {"natsReservedBytes": 1 << 20})  # its streams' release takes passes
    suspended, _ = run(roles=gone, suspend=True)
    assert suspended["phase"] == "Suspended" and at_rest(suspended)
    refused, _ = run(roles=gone, suspend=True, apply_error="PersistentVolumeClaim run-x was made before this job")
    assert cond(refused, "Ready")["reason"] == "ApplyRefused" and not at_rest(refused)


def test_generators_out_of_the_weight_group_degrade_the_job() -> None:
    report = {"step": 9, "version": 9, "weightSyncReady": True, "generatorsInGroup": 1, "weightEpoch": 4}
    status, events = run(trainer_status=report)  # both generator pods ready, one dropped from the group
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "GeneratorsOutOfWeightGroup"
    assert "1 in the weight group (epoch 4)" in degraded["message"]
    assert status["progress"]["generatorsInGroup"] == 1 and cond(status, "Ready")["status"] == "True"
    back, events = run(previous=status, trainer_status=report | {"generatorsInGroup": 2, "weightEpoch": 5})
    assert cond(back, "Degraded")["status"] == "False" and [e.reason for e in events] == ["Recovered"]


def test_a_run_that_stopped_learning_is_degraded_with_the_trainers_reason() -> None:
    alarm = "NoTokensTrained: step(s) 19–22 trained no tokens (512 samples dropped for lag, 0 samples rejected)"
    status, events = run(
        trainer_status={
            "step": 22,
            "version": 22,
            "weightSyncReady": True,
            "learningAlarm": alarm,
            "groupsRejected": 3,
            "samplesRejected": 1,
        }
    )
    JobStatus.model_validate(status)
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "LearningStalled"
    assert degraded["message"].startswith(alarm)
    assert status["progress"]["learningAlarm"] == alarm and status["progress"]["groupsRejected"] == 3
    assert any(e.type == "Warning" and e.reason == "Degraded" for e in events)
    healthy, events = run(previous=status, trainer_status={"step": 23, "version": 23, "weightSyncReady": True})
    assert cond(healthy, "Degraded")["status"] == "False" and "Recovered" in {e.reason for e in events}


def test_the_deadline_counts_from_creation_and_not_while_suspended() -> None:
    stuck, _ = run(
        now=T0 + timedelta(hours=2),
        active_deadline_seconds=3600,
        trainer_status=None,
        roles={**UP, "trainer": RoleObserved(1, 1, 0)},
    )  # never started: Pending for 2 h
    assert stuck["phase"] == "Failed" and cond(stuck, "Failed")["reason"] == "DeadlineExceeded"
    minutes = lambda m: T0 + timedelta(minutes=m)  # noqa: E731
    down = {r: RoleObserved(o.desired) for r, o in UP.items()}
    s, _ = run(now=minutes(10), active_deadline_seconds=3600)
    s, _ = run(previous=s, now=minutes(10), suspend=True, roles=down, active_deadline_seconds=3600)
    s, _ = run(previous=s, now=minutes(80), suspend=True, roles=down, active_deadline_seconds=3600)
    assert s["phase"] == "Suspended"  # past the deadline since creation, but suspended: not failed
    s, _ = run(previous=s, now=minutes(100), active_deadline_seconds=3600)  # resumed: 90 min suspended
    assert s["suspendedSeconds"] == 90 * 60 and "suspendedSince" not in s
    s, _ = run(previous=s, now=minutes(140), active_deadline_seconds=3600)
    assert s["phase"] == "Running"  # 50 minutes counted
    s, events = run(previous=s, now=minutes(155), active_deadline_seconds=3600)
    assert s["phase"] == "Failed" and "DeadlineExceeded" in {e.reason for e in events}


def pod(name, role, **status):
    return {"metadata": {"name": name, "labels": {"pipelinerl.dev/role": role}}, "status": status}


PODS = [
    pod(
        "demo-generator-1",
        "generator",
        containerStatuses=[
            {
                "name": "generator",
                "state": {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": 'Back-off pulling image "example.com/gen:typo"',
                    }
                },
            }
        ],
    ),
    pod("demo-generator-0", "generator", containerStatuses=[{"name": "generator", "state": {"running": {}}}]),
    pod(
        "demo-trainer-0",
        "trainer",
        containerStatuses=[
            {
                "name": "trainer",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
            }
        ],
    ),
    pod(
        "demo-preprocessor-0",
        "preprocessor",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient memory.",
            }
        ],
    ),
]


def test_pod_problems_are_read_with_pod_and_container_named() -> None:
    assert pod_problems(PODS) == [
        PodProblem(
            "generator",
            "demo-generator-1",
            "generator",
            "ImagePullBackOff",
            'Back-off pulling image "example.com/gen:typo"',
        ),
        PodProblem(
            "preprocessor",
            "demo-preprocessor-0",
            None,
            "Unschedulable",
            "0/3 nodes are available: 3 Insufficient memory.",
        ),
        PodProblem(
            "trainer",
            "demo-trainer-0",
            "trainer",
            "OOMKilled",
            "killed for memory (exit code 137): raise the role's memory limit",
        ),
    ]


def test_a_crash_loop_is_told_with_the_crashed_services_exception() -> None:
    """The trainer's container keeps its log's tail as its termination message
    (FallbackToLogsOnError): the exception of its last traceback names what failed (a full
    volume), whatever the pod's launcher logged after it as it stopped the other ranks."""
    said = (
        "OSError: [Errno 28] checkpoint step-40 not written to /run/checkpoints: its volume is full or over its quota"
    )
    tail = (
        'Traceback (most recent call last):\n  File "/app/main.py", line 9, in <module>\n    main()\n'
        f"{said}\nrank 1 stopping: SIGTERM\n2026-12-06 pod ERROR pod: a rank exited with code 1; stopped the others\n"
    )
    crashed = pod(
        "demo-trainer-0",
        "trainer",
        containerStatuses=[
            {
                "name": "trainer",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed"}},
                "lastState": {"terminated": {"exitCode": 1, "message": tail}},
            }
        ],
    )
    (problem,) = pod_problems([crashed])
    assert problem.reason == "CrashLoopBackOff" and problem.message == f"{said} (back-off 40s restarting failed)"
    s, _ = run(roles={**UP, "trainer": RoleObserved(1, 1, 0)}, pod_problems=(problem,), trainer_status=None)
    assert said in cond(s, "TrainerReady")["message"]


def test_pod_problems_show_in_the_role_conditions_ready_and_events() -> None:
    healthy, _ = run()
    roles = {
        "generator": RoleObserved(2, 2, 1),
        "preprocessor": RoleObserved(1, 1, 0),
        "trainer": RoleObserved(1, 1, 0),
    }
    s, events = run(previous=healthy, roles=roles, pod_problems=tuple(pod_problems(PODS)), trainer_status=None)
    JobStatus.model_validate(s)
    gen = cond(s, "GeneratorsReady")
    assert gen["reason"] == "ImagePullBackOff" and "demo-generator-1 container generator" in gen["message"]
    assert (
        cond(s, "TrainerReady")["reason"] == "OOMKilled" and cond(s, "PreprocessorReady")["reason"] == "Unschedulable"
    )
    assert "ImagePullBackOff" in cond(s, "Ready")["message"]
    assert {(e.type, e.reason) for e in events} >= {
        ("Warning", "ImagePullBackOff"),
        ("Warning", "OOMKilled"),
        ("Warning", "Unschedulable"),
    }
    again, events = run(previous=s, roles=roles, pod_problems=tuple(pod_problems(PODS)), trainer_status=None)
    assert not [e for e in events if e.reason in ("ImagePullBackOff", "OOMKilled", "Unschedulable")]  # said once


def test_a_container_back_up_after_being_killed_for_memory_is_no_problem() -> None:
    oomed = {"name": "generator", "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
    coming_back = pod("demo-generator-0", "generator", containerStatuses=[oomed | {"state": {"running": {}}}])
    back = pod("demo-generator-0", "generator", containerStatuses=[oomed | {"state": {"running": {}}, "ready": True}])
    assert [p.reason for p in pod_problems([coming_back])] == ["OOMKilled"]
    assert pod_problems([back]) == []


def test_the_phase_beside_a_refused_apply_or_a_lost_store_follows_suspend() -> None:
    suspended, _ = run(suspend=True, roles={r: RoleObserved(o.desired) for r, o in UP.items()})
    assert suspended["phase"] == "Suspended"
    # Resumed, waiting for room in the NATS store: no longer Suspended.
    waiting, _ = run(previous=suspended, apply_error="no room in the NATS store", trainer_status=None)
    assert waiting["phase"] == "Pending" and cond(waiting, "Suspended")["status"] == "False"
    lost, _ = run(previous=suspended, store_lost="StoreLost: ...", trainer_status=None)
    assert lost["phase"] == "Running"
    # Suspended while an apply is refused: Suspended.
    running, _ = run()
    again, _ = run(previous=running, suspend=True, apply_error="StatefulSet demo-prl-trainer: HTTP 500")
    assert again["phase"] == "Suspended" and cond(again, "Suspended")["status"] == "True"


def test_a_refused_apply_is_a_condition_and_an_event() -> None:
    refused = "StatefulSet demo-generator: 422 spec.template.spec.containers[0].image: Invalid value"
    s, events = run(apply_error=refused)
    assert cond(s, "Ready") | {"lastTransitionTime": ""} == {
        "type": "Ready",
        "status": "False",
        "reason": "ApplyRefused",
        "message": refused,
        "lastTransitionTime": "",
        "observedGeneration": 1,
    }
    assert ("Warning", "ApplyRefused", refused) in {(e.type, e.reason, e.message) for e in events}


def test_no_new_version_for_the_progress_deadline_is_not_ready() -> None:
    s, _ = run()
    s, _ = run(previous=s, now=T0 + timedelta(minutes=5), progress_deadline_seconds=600)
    assert cond(s, "Ready")["status"] == "True"
    s, events = run(previous=s, now=T0 + timedelta(minutes=16), progress_deadline_seconds=600)  # still version 1
    assert cond(s, "Ready")["reason"] == "ProgressDeadlineExceeded" and cond(s, "Ready")["status"] == "False"
    assert cond(s, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert "no new policy version since 2026-11-22T03:00:00Z" in cond(s, "Progressing")["message"]
    assert "ProgressDeadlineExceeded" in {e.reason for e in events}
    s, _ = run(
        previous=s,
        now=T0 + timedelta(minutes=17),
        progress_deadline_seconds=600,
        trainer_status={"step": 2, "version": 2, "weightSyncReady": True},
    )
    assert cond(s, "Ready")["status"] == "True" and s["lastProgressTime"] == "2026-11-22T03:17:00Z"


def test_the_progress_clock_is_held_while_the_job_waits_and_starts_as_it_runs() -> None:
    """A job queued for its GPUs is passed over and over: each pass must leave its status as it
    was (a status write per pass otherwise). The deadline counts from when it runs."""
    waiting = dict(roles={**UP, "trainer": RoleObserved(1, 1, 0)}, trainer_status=None)
    s, _ = run(**waiting)
    assert s["phase"] == "Pending" and s["lastProgressTime"] == "2026-11-22T03:00:00Z"
    later, _ = run(previous=s, now=T0 + timedelta(hours=3), **waiting)
    assert later == s
    running, _ = run(previous=later, now=T0 + timedelta(hours=3, minutes=1), progress_deadline_seconds=600)
    assert running["phase"] == "Running" and running["lastProgressTime"] == "2026-11-22T06:01:00Z"
    s, _ = run(previous=running, now=T0 + timedelta(hours=3, minutes=9), progress_deadline_seconds=600)
    assert cond(s, "Ready")["status"] == "True"


def test_a_lost_store_is_not_ready_with_a_store_lost_event_until_recovered() -> None:
    s, _ = run(trainer_status={"step": 7, "version": 7, "weightSyncReady": True})
    # The restarted trainer waits for its store unready: its /status says only why.
    lost = dict(
        trainer_status=None, store_lost="StoreLost: ... store a, now b", roles={**UP, "trainer": RoleObserved(1, 1, 0)}
    )
    s, events = run(previous=s, now=T0 + timedelta(minutes=1), **lost)
    ready = cond(s, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "StoreLost", lost["store_lost"])
    assert s["phase"] == "Running" and [(e.type, e.reason) for e in events if e.reason == "StoreLost"] == [
        ("Warning", "StoreLost")
    ]
    assert s["progress"]["step"] == 7  # the last progress known is kept
    JobStatus.model_validate(s)
    s, events = run(previous=s, now=T0 + timedelta(minutes=2), **lost)
    assert not [e for e in events if e.reason == "StoreLost"]  # once, not at every reconcile
    s, events = run(previous=s, now=T0 + timedelta(minutes=3))  # recover-store ran: the trainer goes on
    assert cond(s, "Ready")["status"] == "True" and "Ready" in {e.reason for e in events}


def test_publishes_jetstream_does_not_acknowledge_degrade_the_job_with_the_likely_cause() -> None:
    s, _ = run()
    report = {"step": 3, "version": 3, "weightSyncReady": True}
    what = "a publish to prl.team-a.demo.metrics.train not acknowledged (... JetStream unable to write its store ...)"
    s, events = run(previous=s, now=T0 + timedelta(minutes=1), trainer_status=report | {"storeUnacknowledged": what})
    degraded = cond(s, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "StoreNotAcknowledging")
    assert what in degraded["message"] and [e.reason for e in events] == ["Degraded"]
    s, events = run(previous=s, now=T0 + timedelta(minutes=4), trainer_status=report)  # acknowledged again
    assert cond(s, "Degraded")["status"] == "False" and [e.reason for e in events] == ["Recovered"]


def test_a_trainer_template_change_restarts_the_whole_gang_once() -> None:
    def pod(name: str, role: str, revision: str | None, deleting: bool = False) -> dict:
        labels = {"pipelinerl.dev/role": role, **({"controller-revision-hash": revision} if revision else {})}
        meta = {"name": name, "labels": labels, **({"deletionTimestamp": "2026-11-25T00:00:00Z"} if deleting else {})}
        return {"metadata": meta}

    gen = pod("demo-generator-0", "generator", "g-1")
    # One pod on the old template: every trainer pod goes (a mixed gang cannot train), never a generator.
    assert trainer_gang_to_restart(
        [pod("demo-trainer-0", "trainer", "t-1"), pod("demo-trainer-1", "trainer", "t-2"), gen], "t-2"
    ) == ["demo-trainer-0", "demo-trainer-1"]
    # All on the new one, or already going, or no revision known yet: nothing to do.
    assert (
        trainer_gang_to_restart(
            [pod("demo-trainer-0", "trainer", "t-2"), pod("demo-trainer-1", "trainer", "t-2")], "t-2"
        )
        == []
    )
    assert trainer_gang_to_restart([pod("demo-trainer-0", "trainer", "t-1", deleting=True)], "t-2") == []
    assert trainer_gang_to_restart([pod("demo-trainer-0", "trainer", "t-1")], None) == []
    assert trainer_gang_to_restart([pod("demo-trainer-0", "trainer", None)], "t-2") == []


def test_a_pass_goes_on_from_this_replicas_last_write_only_while_the_job_has_not_moved_on():
    """While the job is still at the version this replica's last pass read, kopf's body has not
    caught up with that pass's write: the next pass goes on from the write, on condition of the
    version it made (from the body's older status it would redo what the last pass did, e.g.
    scale a just-finished job up again, only to be refused). Once the job has moved on, the job's
    own status and version: what the other replica wrote meanwhile stands."""
    mine = {"phase": "Succeeded", "natsReservedBytes": 0}
    theirs = {"phase": "Suspended", "suspendedStore": {"step": 7}}
    before = {"metadata": {"resourceVersion": "41"}, "status": {"phase": "Running"}}
    assert starting_point(before, ("41", mine, "42")) == (mine, "42")
    assert starting_point({"metadata": {"resourceVersion": "57"}, "status": theirs}, ("41", mine, "42")) == (
        theirs,
        "57",
    )
    assert starting_point({"metadata": {"resourceVersion": "57"}}, None) == ({}, "57")
    # A write whose version is unknown (the job gone meanwhile) is never a condition to write on.
    assert starting_point(before, ("41", mine, None)) == ({"phase": "Running"}, "41")
    previous, _ = starting_point(before, ("41", mine, "42"))
    previous["phase"] = "Failed"  # a copy: the pass's changes do not reach the memory
    assert mine["phase"] == "Succeeded"


def test_the_status_write_is_the_merge_patch_from_what_the_job_had():
    """A pass writes the merge patch (RFC 7396) from the status it went on from to the one it
    computed: a field the status no longer has goes (null), maps are patched key by key, lists
    and values replaced; applied to the old status it gives the new one exactly."""
    before = {
        "phase": "Suspended",
        "suspendedSince": "2026-12-04T20:00:00Z",
        "suspendedSeconds": 3.0,
        "progress": {"step": 7, "reward": 0.4},
        "podRestarts": {"demo-prl-trainer-0": 1},
        "conditions": [{"type": "Ready", "status": "False"}],
    }
    after = {
        "phase": "Running",
        "suspendedSeconds": 63.0,
        "progress": {"step": 8},
        "podRestarts": {"demo-prl-trainer-0": 1},
        "conditions": [{"type": "Ready", "status": "True"}],
        "suspendedStore": None,
    }
    patch = merge_patch(before, after)
    assert patch == {
        "phase": "Running",
        "suspendedSince": None,
        "suspendedSeconds": 63.0,
        "progress": {"step": 8, "reward": None},
        "conditions": [{"type": "Ready", "status": "True"}],
        "suspendedStore": None,
    }

    def apply(target, patch):  # RFC 7396's own algorithm
        if not isinstance(patch, dict):
            return patch
        out = dict(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = apply(out.get(key), value)
        return out

    assert apply(before, patch) == {k: v for k, v in after.items() if v is not None}
    assert merge_patch(after, after) == {}


async def test_a_replica_forgets_its_last_pass_over_jobs_no_longer_watched():
    """Jobs deleted while the other replica held the turn never reach this one's `deleted`: each
    pass drops the state this replica keeps for jobs its watch no longer holds (by uid, or by
    namespace/name for a job without one), except a lock a pass still holds."""
    import asyncio

    from pipelinerl_operator.handlers import STATE, forget_gone
    from pipelinerl_operator.nats_store import JobRecord

    held = asyncio.Lock()
    await held.acquire()
    STATE.last.clear()
    STATE.locks.clear()
    STATE.last.update({k: ("1", {}, "2") for k in ("u-live", "u-gone", "team-a/nouid", "team-a/gone")})
    STATE.locks.update({"u-live": asyncio.Lock(), "u-gone": asyncio.Lock(), "u-busy": held})
    forget_gone({("team-a", "live"): [JobRecord("u-live", 0)], ("team-a", "nouid"): [JobRecord("", 0)]})
    assert set(STATE.last) == {"u-live", "team-a/nouid"} and set(STATE.locks) == {"u-live", "u-busy"}
    STATE.last.clear()
    STATE.locks.clear()


async def test_a_deletion_waits_for_the_pass_in_flight_and_no_pass_follows_it(monkeypatch):
    """A resync pass in flight when the job's deletion begins could apply its StatefulSets and
    take its NATS room again after `deleted` removed them: `deleted` takes the job's lock, and a
    pass that waited for it sees the deletion in kopf's live view of the job and does nothing."""
    import asyncio
    import logging

    from pipelinerl_operator import handlers

    done: list[str] = []

    async def delete_job(*_args) -> None:
        done.append("deleted")

    async def run_pass(*_args):
        raise AssertionError("a pass ran over a job being deleted")

    monkeypatch.setattr(handlers, "_delete_job", delete_job)
    monkeypatch.setattr(handlers, "run_pass", run_pass)
    handlers.STATE.locks.clear()
    body = {"metadata": {"name": "j", "namespace": "team-a", "uid": "u-1", "resourceVersion": "7"}}
    pass_in_flight = handlers.STATE.locks.setdefault("u-1", asyncio.Lock())
    await pass_in_flight.acquire()
    deletion = asyncio.create_task(handlers.deleted(body=body, logger=logging.getLogger("t"), jobs={}))
    await asyncio.sleep(0.05)
    assert done == []  # waits for the pass
    body["metadata"] = body["metadata"] | {"deletionTimestamp": "2026-12-06T00:00:00Z"}  # kopf's live body
    resync = asyncio.create_task(handlers.reconcile(body, logging.getLogger("t"), {}))
    pass_in_flight.release()
    await deletion
    assert done == ["deleted"] and await resync is None and "u-1" not in handlers.STATE.locks
    handlers.STATE.locks.clear()
