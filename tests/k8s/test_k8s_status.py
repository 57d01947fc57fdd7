"""Pure status computation: conditions roll-up, terminal outcomes, transitions and Events."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from pipelinerl.contracts import TrainerStatus
from pipelinerl.crd import JobStatus
from pipelinerl_operator.status import Observed, RoleObserved, compute, ttl_expired

T0 = datetime(2026, 11, 22, 3, 0, tzinfo=timezone.utc)
UP = {"generator": RoleObserved(2, 2, 2), "preprocessor": RoleObserved(1, 1, 1), "trainer": RoleObserved(1, 1, 1)}


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def run(previous=None, now=T0, **kw):
    kw.setdefault("roles", UP)
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
        "type": "Ready", "status": "False", "reason": "PreprocessorNotReady", "lastTransitionTime": "",
        "message": "PreprocessorReady: ReplicasNotReady 0/1 ready; WeightSyncReady: WaitingForMembers the weight broadcast group is not complete",
        "observedGeneration": 1}


def test_transition_time_kept_while_unchanged() -> None:
    first, _ = run()
    second, events = run(previous=first, now=T0 + timedelta(minutes=5))
    assert cond(second, "Ready")["lastTransitionTime"] == cond(first, "Ready")["lastTransitionTime"]
    assert events == []
    third, events = run(previous=second, now=T0 + timedelta(minutes=6), roles={**UP, "generator": RoleObserved(2, 2, 1)})
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
    failed, _ = run(trainer_restarts=4, backoff_limit=3)
    assert failed["phase"] == "Failed" and cond(failed, "Failed")["reason"] == "BackoffLimitExceeded"
    ok, _ = run(trainer_restarts=3, backoff_limit=3)
    assert ok["phase"] == "Running" and cond(ok, "Degraded")["reason"] == "TrainerRestarted"
    started, _ = run()
    late, events = run(previous=started, now=T0 + timedelta(hours=2), active_deadline_seconds=3600)
    assert late["phase"] == "Failed" and cond(late, "Failed")["reason"] == "DeadlineExceeded"
    assert "DeadlineExceeded" in {e.reason for e in events}


def test_failures_never_decrease() -> None:
    first, _ = run(trainer_restarts=2)
    second, _ = run(previous=first, trainer_restarts=0)  # the pod was recreated: its count reset
    assert second["failures"] == 2


def test_suspend_and_invalid_spec() -> None:
    suspended, events = run(suspend=True, roles={r: RoleObserved(o.desired) for r, o in UP.items()})
    assert suspended["phase"] == "Suspended" and cond(suspended, "Suspended")["status"] == "True"
    assert cond(suspended, "GeneratorsReady")["reason"] == "ScaledDown"
    invalid, events = run(spec_error="generator.tensorParallel (2) needs at least as many generator.gpus (1)")
    assert cond(invalid, "Ready")["reason"] == "InvalidSpec" and invalid["phase"] == "Pending"
    assert [e.reason for e in events] == ["InvalidSpec"]


def test_malformed_or_missing_trainer_report_keeps_previous_progress() -> None:
    first, _ = run(trainer_status={"step": 5, "version": 5, "weightSyncReady": True})
    with pytest.raises(ValidationError):  # progress.fetch_trainer_status reads such a report as None
        TrainerStatus.model_validate({"step": "many"})
    second, _ = run(previous=first, trainer_status=None)
    assert second["progress"]["step"] == 5


def test_weight_group_not_formed_is_not_ready() -> None:
    status, _ = run(trainer_status={"step": 0, "version": 0})  # the trainer still waits for generators
    assert cond(status, "WeightSyncReady")["reason"] == "WaitingForMembers"
    assert cond(status, "Ready")["status"] == "False"


def test_ttl() -> None:
    done, _ = run(trainer_status={"finished": True, "step": 1})
    assert not ttl_expired(done, None, T0 + timedelta(days=9))
    assert not ttl_expired(done, 60, T0 + timedelta(seconds=30))
    assert ttl_expired(done, 60, T0 + timedelta(seconds=60))


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
    status, events = run(trainer_status={"step": 22, "version": 22, "weightSyncReady": True, "learningAlarm": alarm,
                                         "groupsRejected": 3, "samplesRejected": 1})
    JobStatus.model_validate(status)
    degraded = cond(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "LearningStalled"
    assert degraded["message"].startswith(alarm)
    assert status["progress"]["learningAlarm"] == alarm and status["progress"]["groupsRejected"] == 3
    assert any(e.type == "Warning" and e.reason == "Degraded" for e in events)
    healthy, events = run(previous=status, trainer_status={"step": 23, "version": 23, "weightSyncReady": True})
    assert cond(healthy, "Degraded")["status"] == "False" and "Recovered" in {e.reason for e in events}
