"""Pure status: what the operator observed → the job's `status` and the Events to post. No I/O.

Role conditions (`GeneratorsReady`, `PreprocessorReady`, `TrainerReady`, `WeightSyncReady`)
roll up into `Ready`, as KServe does. `Succeeded` and `Failed` are terminal: once set they stay.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from pipelinerl.contracts import Progress, TrainerStatus
from pipelinerl.crd import CONDITION_MESSAGE_MAX, JobStatus
from pipelinerl_operator.pods import REASONS as POD_REASONS
from pipelinerl_operator.pods import PodProblem

ROLE_CONDITIONS = {"generator": "GeneratorsReady", "preprocessor": "PreprocessorReady", "trainer": "TrainerReady"}
# The fixed vocabulary of Event reasons the operator posts (docs/kubernetes.md lists them).
EVENT_REASONS = frozenset(
    {
        "Created",
        "Updated",
        "InvalidSpec",
        "Ready",
        "NotReady",
        "Degraded",
        "Recovered",
        "Suspended",
        "Resumed",
        "Succeeded",
        "Failed",
        "BackoffLimitExceeded",
        "DeadlineExceeded",
        "TTLExpired",
        "StreamsDeleted",
        "StreamsDeleteFailed",
        "StoreRestored",
        "ApplyRefused",
        "ProgressDeadlineExceeded",
        "TrainerGangRestarted",
        "StoreLost",
        *POD_REASONS,
    }
)


@dataclass(frozen=True)
class RoleObserved:
    desired: int  # what the spec asks for (the StatefulSet may be scaled to 0 while suspended)
    replicas: int = 0
    ready: int = 0
    update_revision: str | None = None  # the StatefulSet's template revision its pods should run


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from; gathered by a pass (reconcile.py)."""

    generation: int
    now: datetime
    previous: dict[str, Any] = field(default_factory=dict)  # the status as last written
    spec_error: str | None = None
    suspend: bool = False
    roles: dict[str, RoleObserved] = field(default_factory=dict)
    trainer_status: TrainerStatus | None = None  # trainer rank 0 `/status` once ready; None: unreachable
    store_lost: str = ""  # ... its StoreLost message, ready or not (it waits for its store unready)
    pod_restarts: Mapping[str, int] = field(default_factory=dict)  # container restarts per pod, every role's
    # ... the pods of runPolicy.failingRoles among them, whose restarts are failures (None: all). Every
    # pod's count is kept, so a role added to failingRoles later is charged from then on only.
    failing_pods: frozenset[str] | None = None
    pods_stopped: frozenset[str] = frozenset()  # ... whose last restart followed a trainer's STOPPED_EXIT
    backoff_limit: int = 3
    active_deadline_seconds: int | None = None  # counted from creation, suspended time left out
    progress_deadline_seconds: int | None = None  # no new policy version for this long: not progressing
    created: datetime | None = None  # metadata.creationTimestamp
    pod_problems: tuple[PodProblem, ...] = ()
    apply_error: str | None = None  # the API server refused a child: its message
    generator_selector: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _ts(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def starting_point(
    body: Mapping[str, Any], last: tuple[str | None, dict[str, Any], str | None] | None
) -> tuple[dict[str, Any], str | None]:
    """The status a pass goes on from, and the job's version its write is made on condition of.
    `last`: this replica's last pass (the version it read, the status it wrote, the version that
    write made). While the job is still at the version that pass read, the watch has not brought
    the write yet: the pass goes on from that write (not from the status before it, which would
    have it redo what the last pass did, e.g. scale a job that just finished up again). Else the
    job's own status and version: what the other replica wrote meanwhile stands."""
    version = body["metadata"].get("resourceVersion")
    if last is not None and last[0] == version and last[2] is not None:
        return copy.deepcopy(last[1]), last[2]
    return copy.deepcopy(dict(body.get("status") or {})), version


def merge_patch(before: Any, after: Any) -> Any:
    """The JSON merge patch (RFC 7396) that turns `before` into `after`: what `after` no longer has
    is null (a patch of `after` alone would leave it behind: a resumed job's suspendedSince, counted
    again by every pass), changed values as they are now, maps patched key by key."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return after
    patch = {key: None for key in before if key not in after}
    for key, value in after.items():
        if key not in before or before[key] != value:
            patch[key] = merge_patch(before.get(key), value)
    return patch


def is_terminal(status: dict[str, Any] | None) -> bool:
    return (status or {}).get("phase") in ("Succeeded", "Failed")


def progress_from(trainer: TrainerStatus | None, previous: dict[str, Any]) -> dict[str, Any]:
    """The trainer's progress as `status.progress`; the last known values when it is unreachable."""
    if trainer is None:
        return previous or Progress().model_dump(by_alias=True, exclude_none=True)
    return trainer.model_dump(by_alias=True, exclude_none=True, include=set(Progress.model_fields))


class _Conditions:
    def __init__(self, previous: list[dict[str, Any]], now: str, generation: int):
        self._previous = {c["type"]: c for c in previous or []}
        self._now = now
        self._generation = generation
        self.items: list[dict[str, Any]] = []

    def set(self, type_: str, ok: bool, reason: str, message: str = "") -> None:
        status = "True" if ok else "False"
        before = self._previous.get(type_)
        since = before["lastTransitionTime"] if before and before.get("status") == status else self._now
        self.items.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": clipped(message, CONDITION_MESSAGE_MAX),
                "lastTransitionTime": since,
                "observedGeneration": self._generation,
            }
        )

    def get(self, type_: str) -> bool:
        return any(c["type"] == type_ and c["status"] == "True" for c in self.items)


def _role_condition(
    conds: _Conditions, type_: str, role: RoleObserved, active: bool, problems: list[PodProblem]
) -> None:
    counts = f"{role.ready}/{role.desired} ready"
    if not active:
        conds.set(type_, False, "ScaledDown", counts)
    elif problems:  # why, rather than how many: the first pod's problem names pod and container
        more = f" (and {len(problems) - 1} more pods)" if len(problems) > 1 else ""
        conds.set(type_, False, problems[0].reason, f"{counts}; {problems[0].describe()}{more}")
    elif role.ready >= role.desired > 0:
        conds.set(type_, True, "AllReplicasReady", counts)
    else:
        conds.set(type_, False, "ReplicasNotReady", counts)


def _clocks(obs: Observed, prev: dict[str, Any], progress: dict[str, Any], now: str) -> dict[str, Any]:
    """Suspended time (it stops the deadline's clock) and when the policy version last moved."""
    suspended_s = float(prev.get("suspendedSeconds", 0) or 0)
    since = prev.get("suspendedSince")
    if since and not obs.suspend:
        suspended_s += (obs.now - parse_ts(since)).total_seconds()
        since = None
    elif obs.suspend and not since:
        since = now
    moved = progress.get("version") != (prev.get("progress") or {}).get("version")
    counting = prev.get("phase") == "Running" and not obs.suspend and prev.get("lastProgressTime")
    last_progress = prev["lastProgressTime"] if counting and not moved else now
    return {"suspendedSeconds": suspended_s, "suspendedSince": since, "lastProgressTime": last_progress}


def _running_seconds(obs: Observed, clocks: dict[str, Any]) -> float | None:
    """Seconds the job has existed, less the time it was suspended."""
    if obs.created is None:
        return None
    suspended = clocks["suspendedSeconds"]
    if clocks["suspendedSince"]:
        suspended += (obs.now - parse_ts(clocks["suspendedSince"])).total_seconds()
    return (obs.now - obs.created).total_seconds() - suspended


INCIDENT_WINDOW = timedelta(minutes=2)


def count_failures(
    prev: dict[str, Any],
    restarts: Mapping[str, int],
    now: datetime,
    stopped: frozenset[str] = frozenset(),
    failing: frozenset[str] | None = None,
) -> tuple[int, dict | None]:
    """Failures, per incident: the pods (`failing`, those of `runPolicy.failingRoles`; None: all)
    whose restart count rose since the last reconcile join the current incident if it began within INCIDENT_WINDOW and
    they are not in it yet (one cause, e.g. a gang's collective broken by one rank, restarts several pods: one
    failure); every other restart is a failure of its own (a pod crash-looping fails again and
    again). A pod recreated with its count reset is a new baseline, not a failure. The last restart
    of a pod in `stopped` is none either: its trainer stopped with its gang (another trainer pod
    drained or evicted), its checkpoint written, and starts again to resume from it."""
    failures = int(prev.get("failures", 0) or 0)
    seen = prev.get("podRestarts") or {}
    incident = copy.deepcopy(prev.get("lastIncident"))
    for pod, count in sorted(restarts.items()):
        if failing is not None and pod not in failing:
            continue
        rise = count - int(seen.get(pod, 0)) - int(pod in stopped)
        if (
            rise > 0
            and incident
            and now - parse_ts(incident["time"]) <= INCIDENT_WINDOW
            and pod not in incident["pods"]
        ):
            incident["pods"].append(pod)
            rise -= 1
        if rise > 0:
            failures += rise
            incident = {"time": _ts(now), "pods": [pod]}
    return failures, incident


def compute(obs: Observed) -> tuple[dict[str, Any], list[Event]]:
    """The new status and the Events for what changed since `obs.previous`."""
    prev = obs.previous or {}
    now = _ts(obs.now)
    conds = _Conditions(prev.get("conditions", []), now, obs.generation)
    progress = progress_from(obs.trainer_status, prev.get("progress") or {})
    if obs.spec_error is None:
        failures, incident = count_failures(prev, obs.pod_restarts, obs.now, obs.pods_stopped, obs.failing_pods)
        restarts = dict(obs.pod_restarts)
    else:  # its runPolicy unread: nothing counted, nothing ended by it (counting goes on once it is fixed)
        failures, incident = int(prev.get("failures", 0) or 0), prev.get("lastIncident")
        restarts = dict(prev.get("podRestarts") or {})
    roles = {r: obs.roles.get(r, RoleObserved(desired=0)) for r in ROLE_CONDITIONS}
    clocks = _clocks(obs, prev, progress, now)

    phase, fail_reason, fail_message = _terminal_outcome(obs, prev, progress, failures, incident, clocks)
    terminal = phase in ("Succeeded", "Failed")
    suspended = obs.suspend and not terminal
    running = not suspended and not terminal  # its pods asked for (as they are, where its spec no longer reads)
    active = running and obs.spec_error is None
    for role, type_ in ROLE_CONDITIONS.items():
        problems = [p for p in obs.pod_problems if p.role == role]
        _role_condition(conds, type_, roles[role], running, problems)
    _weight_sync_condition(conds, obs, progress, running)
    stalled = _stalled(obs, prev, progress, clocks, active)
    phase, ready, ready_reason = _ready_condition(conds, obs, prev, roles, phase, fail_message, stalled, active)
    if phase != "Running" and prev.get("phase") != "Running":
        # Its clock starts as it runs: until then held (else every pass of a job queued for
        # its GPUs would write its status again).
        clocks["lastProgressTime"] = prev.get("lastProgressTime") or now
    unacknowledged = obs.trainer_status.store_unacknowledged if obs.trainer_status else ""
    _degraded_condition(conds, progress, roles["generator"], failures, phase, active, unacknowledged)
    _progressing_condition(conds, ready, ready_reason, stalled, active, progress)
    _outcome_conditions(conds, phase, suspended, fail_reason, fail_message)

    gen = roles["generator"]
    status = JobStatus.model_validate(
        {
            "observedGeneration": obs.generation,
            "phase": phase,
            "conditions": conds.items,
            "roles": {r: {"desired": o.desired, "replicas": o.replicas, "ready": o.ready} for r, o in roles.items()},
            "generatorsReady": f"{gen.ready}/{gen.desired}",
            "generatorSelector": obs.generator_selector,
            "progress": progress,
            "failures": failures,
            "podRestarts": restarts,
            "lastIncident": incident,
            "startTime": prev.get("startTime") or (now if phase == "Running" else None),
            "completionTime": prev.get("completionTime") or (now if terminal else None),
            **clocks,
        }
    ).model_dump(by_alias=True, exclude_none=True)
    return status, events_between(prev, status)


def _terminal_outcome(
    obs: Observed,
    prev: dict[str, Any],
    progress: dict[str, Any],
    failures: int,
    incident: dict[str, Any] | None,
    clocks: dict[str, Any],
) -> tuple[str | None, str, str]:
    """(Succeeded or Failed or None, reason, message), in order of precedence; sticky once reached."""
    if is_terminal(prev):
        phase = prev["phase"]
        before = _cond(prev, phase) or {}
        return phase, before.get("reason", phase), before.get("message", "")
    if obs.spec_error is not None:  # a spec that no longer reads (a policy tightened since, a scale past it)
        return None, "", ""
    deadline = obs.active_deadline_seconds
    if obs.trainer_status and obs.trainer_status.finished:
        return "Succeeded", "", f"trainer finished at step {progress.get('step', 0)}"
    if failures > obs.backoff_limit:
        return (
            "Failed",
            "BackoffLimitExceeded",
            f"pods failed {failures} times (runPolicy.backoffLimit {obs.backoff_limit}; pods "
            f"restarting together count once; incident: {', '.join(incident['pods']) if incident else ''})",
        )
    if deadline and not obs.suspend and (_running_seconds(obs, clocks) or 0) > deadline:
        return (
            "Failed",
            "DeadlineExceeded",
            f"not finished within runPolicy.activeDeadlineSeconds ({deadline}s) of its creation "
            f"(suspended time not counted)",
        )
    return None, "", ""


def _weight_sync_condition(conds: _Conditions, obs: Observed, progress: dict[str, Any], active: bool) -> None:
    pods_ready = all(conds.get(t) for t in ROLE_CONDITIONS.values())
    if not active:
        conds.set("WeightSyncReady", False, "ScaledDown", "")
    elif obs.spec_error is not None:  # the trainer not asked: nothing known of its group
        conds.set("WeightSyncReady", False, "InvalidSpec", "the spec no longer reads: the trainer is not asked")
    elif obs.trainer_status is None:
        conds.set("WeightSyncReady", False, "TrainerUnreachable", "trainer rank 0 /status did not answer")
    elif not obs.trainer_status.weight_sync_ready or not pods_ready:
        conds.set("WeightSyncReady", False, "WaitingForMembers", "the weight broadcast group is not complete")
    else:
        conds.set("WeightSyncReady", True, "GroupFormed", f"policy version {progress.get('version', 0)}")


def _stalled(
    obs: Observed, prev: dict[str, Any], progress: dict[str, Any], clocks: dict[str, Any], active: bool
) -> str:
    """Why the run counts as stalled (no new version within progressDeadlineSeconds), or ""."""
    if not (active and obs.progress_deadline_seconds and prev.get("phase") == "Running"):
        return ""
    if obs.now - parse_ts(clocks["lastProgressTime"]) <= timedelta(seconds=obs.progress_deadline_seconds):
        return ""
    return (
        f"no new policy version since {clocks['lastProgressTime']} (version {progress.get('version', 0)}; "
        f"runPolicy.progressDeadlineSeconds {obs.progress_deadline_seconds})"
    )


def _ready_condition(
    conds: _Conditions,
    obs: Observed,
    prev: dict[str, Any],
    roles: dict[str, RoleObserved],
    phase: str | None,
    fail_message: str,
    stalled: str,
    active: bool,
) -> tuple[str | None, bool, str]:
    """Sets Ready; returns the phase, whether the job is ready and why (not)."""
    terminal = phase in ("Succeeded", "Failed")
    if obs.spec_error is not None:  # its pods stopped where its stored spec says suspend, else as they are
        phase = phase or ("Suspended" if obs.suspend else _resumed(prev, prev.get("phase") or "Pending"))
        reason, message = "InvalidSpec", obs.spec_error
    elif obs.apply_error is not None and not terminal:
        phase = phase or ("Suspended" if obs.suspend else _resumed(prev, "Pending"))
        reason, message = "ApplyRefused", obs.apply_error
    elif terminal:
        reason, message = phase or "", fail_message
    elif obs.store_lost and not obs.suspend:
        # The trainer trains nothing until `pipelinerl recover-store` gives its checkpoint a store.
        phase = _resumed(prev, "Running")
        reason, message = "StoreLost", obs.store_lost
    elif obs.suspend:
        phase, reason, message = "Suspended", "Suspended", "spec.suspend is true; all roles scaled to zero"
    else:
        not_ready = [
            c
            for c in conds.items
            if c["type"] in (*ROLE_CONDITIONS.values(), "WeightSyncReady") and c["status"] != "True"
        ]
        reason = f"{not_ready[0]['type'].removesuffix('Ready')}NotReady" if not_ready else "AllComponentsReady"
        message = "; ".join(f"{c['type']}: {c['reason']} {c['message']}".strip() for c in not_ready)
        started = roles["trainer"].ready > 0 and roles["generator"].ready > 0
        phase = "Running" if started or (prev.get("phase") == "Running" and not_ready) else "Pending"
    if stalled and reason == "AllComponentsReady":
        reason, message = "ProgressDeadlineExceeded", stalled
    ready = not not_ready_any(conds) and active and obs.apply_error is None and not stalled and reason != "StoreLost"
    conds.set("Ready", ready, reason, message)
    return phase, ready, reason


def clipped(text: str, limit: int) -> str:
    """`text` within `limit` characters, saying how much was cut (a spec's errors can run long)."""
    if len(text) <= limit:
        return text
    tail = f" ... (cut: {len(text)} characters in all)"
    return text[: limit - len(tail)] + tail


def _resumed(prev: dict[str, Any], otherwise: str) -> str:
    """The phase of a job not suspended that cannot tell more this pass: the one it had, but for
    Suspended, which its spec no longer says."""
    phase = prev.get("phase")
    return phase if phase and phase != "Suspended" else otherwise


def _degraded_condition(
    conds: _Conditions,
    progress: dict[str, Any],
    gen: RoleObserved,
    failures: int,
    phase: str | None,
    active: bool,
    unacknowledged: str = "",
) -> None:
    in_group = progress.get("generatorsInGroup")
    reason, alarm = "", progress.get("learningAlarm")
    running = active and phase == "Running"
    if active and unacknowledged:
        reason, alarm = "StoreNotAcknowledging", f"the trainer: {unacknowledged}"  # JetStream cannot write?
    elif active and alarm:
        reason = "LearningStalled"  # the trainer steps, but learns nothing: see the message
    elif running and 0 < gen.ready < gen.desired:
        reason = "GeneratorsMissing"
    elif running and progress.get("step", 0) > 0 and in_group is not None and in_group < gen.desired:
        reason = "GeneratorsOutOfWeightGroup"  # pods up, but dropped from (or not yet back in) the group
    elif active and failures > 0:
        reason = "PodsRestarted"
    group = f", {in_group} in the weight group (epoch {progress.get('weightEpoch')})" if in_group is not None else ""
    message = f"{gen.ready}/{gen.desired} generators ready{group}, {failures} pod failures"
    conds.set(
        "Degraded",
        bool(reason),
        reason or "AsExpected",
        (f"{alarm}; {message}" if alarm else message) if reason else "",
    )


def _progressing_condition(
    conds: _Conditions, ready: bool, ready_reason: str, stalled: str, active: bool, progress: dict[str, Any]
) -> None:
    if stalled:
        conds.set("Progressing", False, "ProgressDeadlineExceeded", stalled)
    else:
        conds.set(
            "Progressing",
            active,
            "Training" if ready else ("Starting" if active else (ready_reason or "Stopped")),
            f"step {progress.get('step', 0)}" if active else "",
        )


def _outcome_conditions(
    conds: _Conditions, phase: str | None, suspended: bool, fail_reason: str, fail_message: str
) -> None:
    """Suspended, Succeeded, Failed."""
    conds.set("Suspended", suspended, "Suspended" if suspended else "NotSuspended")
    succeeded, failed = phase == "Succeeded", phase == "Failed"
    conds.set("Succeeded", succeeded, "Succeeded" if succeeded else "NotFinished", fail_message if succeeded else "")
    conds.set("Failed", failed, fail_reason if failed else "NotFailed", fail_message if failed else "")


def not_ready_any(conds: _Conditions) -> bool:
    return not all(conds.get(t) for t in (*ROLE_CONDITIONS.values(), "WeightSyncReady"))


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def _flipped(prev: dict[str, Any], new: dict[str, Any], type_: str) -> bool | None:
    """True/False when condition `type_` turned True/False; None when unchanged."""
    before, after = _cond(prev, type_), _cond(new, type_)
    was = bool(before and before["status"] == "True")
    now = bool(after and after["status"] == "True")
    if was == now or (before is None and not now):
        return None
    return now


def events_between(prev: dict[str, Any], new: dict[str, Any]) -> list[Event]:
    events = []
    ready = _cond(new, "Ready") or {}
    if _flipped(prev, new, "Ready") is True:
        events.append(Event("Normal", "Ready", "all roles ready and the weight group formed"))
    elif _flipped(prev, new, "Ready") is False and ready.get("reason") not in ("Suspended", "Succeeded", "Failed"):
        why = "InvalidSpec" if ready.get("reason") == "InvalidSpec" else "NotReady"
        events.append(Event("Warning", why, ready.get("message", "")))
    elif ready.get("reason") == "InvalidSpec" and (_cond(prev, "Ready") or {}).get("message") != ready.get("message"):
        events.append(Event("Warning", "InvalidSpec", ready.get("message", "")))
    degraded = _flipped(prev, new, "Degraded")
    if degraded is not None:
        d = _cond(new, "Degraded") or {}
        events.append(
            Event("Warning", "Degraded", d["message"])
            if degraded
            else Event("Normal", "Recovered", "no longer degraded")
        )
    suspended = _flipped(prev, new, "Suspended")
    if suspended is not None:
        events.append(
            Event(
                "Normal",
                "Suspended" if suspended else "Resumed",
                "scaled all roles to zero; checkpoints kept" if suspended else "scaling roles back up",
            )
        )
    if _flipped(prev, new, "Succeeded"):
        events.append(Event("Normal", "Succeeded", (_cond(new, "Succeeded") or {}).get("message", "")))
    for type_ in (*ROLE_CONDITIONS.values(), "Ready", "Progressing"):
        after, before = _cond(new, type_) or {}, _cond(prev, type_) or {}
        reason = after.get("reason")
        if (
            (reason in POD_REASONS or reason in ("ApplyRefused", "ProgressDeadlineExceeded", "StoreLost"))
            and (reason, after.get("message")) != (before.get("reason"), before.get("message"))
            and not (type_ == "Ready" and reason == "ProgressDeadlineExceeded")
        ):  # Progressing says it
            events.append(Event("Warning", reason, after.get("message", "")))
    if _flipped(prev, new, "Failed"):
        failed = _cond(new, "Failed") or {}
        events.append(
            Event(
                "Warning",
                failed["reason"] if failed["reason"] in EVENT_REASONS else "Failed",
                failed.get("message", ""),
            )
        )
    return events


def at_rest(status: dict[str, Any]) -> bool:
    """Whether nothing but an edit moves the job on: ended or suspended, no pod of it left, no
    room held in the NATS store (its streams' release takes passes), nothing refused that a
    change in the cluster could let through (ApplyRefused: a name taken, a claim in the way)."""
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    return (
        status.get("phase") in ("Succeeded", "Failed", "Suspended")
        and not status.get("natsReservedBytes")
        and ready.get("reason") != "ApplyRefused"
        and not any((r or {}).get("replicas") for r in (status.get("roles") or {}).values())
    )


def suspended_as_stored(body: Mapping[str, Any]) -> bool:
    """spec.suspend, read from the job as stored: a job whose spec no longer reads is stopped by it."""
    return (body.get("spec") or {}).get("suspend") is True


def ttl_of(body: Mapping[str, Any]) -> int | None:
    """runPolicy.ttlSecondsAfterFinished, read from the job as stored: a finished job whose spec
    no longer reads (a policy tightened since) is deleted all the same."""
    ttl = ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else None


def ttl_expired(status: dict[str, Any], ttl_seconds: int | None, now: datetime) -> bool:
    if ttl_seconds is None or not is_terminal(status) or not status.get("completionTime"):
        return False
    return now - parse_ts(status["completionTime"]) >= timedelta(seconds=ttl_seconds)
