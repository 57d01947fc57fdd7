"""Why a job's pods are not running, read from their status (pure): the problems a user must see
in the job's conditions and Events, with the pod and the container named."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pipelinerl.contracts import ROLE_LABEL, STOPPED_EXIT

# Container waiting reasons that will not clear by themselves.
WAITING = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
REASONS = frozenset({*WAITING, "OOMKilled", "Unschedulable"})


@dataclass(frozen=True)
class PodProblem:
    role: str
    pod: str
    container: str | None
    reason: str  # one of REASONS
    message: str

    def describe(self) -> str:
        where = f"pod {self.pod}" + (f" container {self.container}" if self.container else "")
        return f"{where}: {self.reason}" + (f": {self.message}" if self.message else "")


def pod_problems(pods: list[dict[str, Any]]) -> list[PodProblem]:
    """Each pod's problem, if it has one: unschedulable, an image that cannot be pulled, a
    container crash-looping or killed for memory (the latest cause first)."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        role = (pod["metadata"].get("labels") or {}).get(ROLE_LABEL, "")
        found = None
        for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (c.get("state") or {}).get("waiting") or {}
            killed = (c.get("state") or {}).get("terminated") or {}
            if not c.get("ready"):  # the restart before: the cause while it crash-loops or comes back up
                killed = killed or (c.get("lastState") or {}).get("terminated") or {}
            if killed.get("reason") == "OOMKilled":
                limit = f" (exit code {killed.get('exitCode')}): raise the role's memory limit"
                found = PodProblem(role, name, c.get("name"), "OOMKilled", f"killed for memory{limit}")
            elif waiting.get("reason") in WAITING:
                message = waiting.get("message", "")
                if waiting["reason"] == "CrashLoopBackOff" and (said := last_words(c)):
                    message = f"{said} ({message})" if message else said
                found = PodProblem(role, name, c.get("name"), waiting["reason"], message)
            if found:
                break
        if found is None:
            scheduled: dict[str, Any] = next(
                (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
            )
            if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
                found = PodProblem(role, name, None, "Unschedulable", scheduled.get("message", ""))
        if found:
            out.append(found)
    return out


LAST_WORDS = 400  # characters of a crashed container's last line quoted in the job's conditions


EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: \S")  # "module.Name: message", as Python prints one


def last_words(container_status: dict[str, Any]) -> str:
    """What a container that crashed said of it, from its termination message (its log's tail,
    `FallbackToLogsOnError`): the exception of its last traceback (a pod of several ranks logs
    the others' shutdown after it), else its last line that reads as one, else its last line."""
    terminated = (container_status.get("lastState") or {}).get("terminated") or {}
    lines = [line.rstrip() for line in str(terminated.get("message") or "").splitlines() if line.strip()]
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    after = lines[tracebacks[-1] + 1 :] if tracebacks else []
    said = next((line for line in after if not line[0].isspace()), None)
    said = said or next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), None)
    return (said or (lines[-1] if lines else "")).strip()[:LAST_WORDS]


def pods_stopped(pods: list[dict[str, Any]]) -> frozenset[str]:
    """The pods whose container last ended with STOPPED_EXIT: a trainer rank that stopped with its
    gang, its checkpoint written (another trainer pod was drained), restarted to resume."""
    return frozenset(
        p["metadata"]["name"]
        for p in pods
        for c in (p.get("status") or {}).get("containerStatuses") or []
        if ((c.get("lastState") or {}).get("terminated") or {}).get("exitCode") == STOPPED_EXIT
    )


REVISION_LABEL = "controller-revision-hash"  # set by the StatefulSet controller on each pod


def trainer_gang_to_restart(pods: list[dict[str, Any]], update_revision: str | None) -> list[str]:
    """The trainer pods to delete so that the gang restarts as a whole on its new template: all of
    them, once any still runs an older revision (their StatefulSet updates `OnDelete`: rolled one
    pod at a time, new ranks would meet old ones in a collective that never completes). Each
    checkpoints on SIGTERM, and the new gang resumes from there. None while nothing is stale."""
    trainers = [p for p in pods if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == "trainer"]
    stale = [
        p
        for p in trainers
        if update_revision
        and (p["metadata"].get("labels") or {}).get(REVISION_LABEL) not in (None, update_revision)
        and not p["metadata"].get("deletionTimestamp")
    ]
    return (
        sorted(p["metadata"]["name"] for p in trainers if not p["metadata"].get("deletionTimestamp")) if stale else []
    )
