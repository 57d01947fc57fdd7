"""One reconciling pass over a job (`run`): read its spec, hold its room in the NATS store and
apply its children, observe them, compute the status (status.py) and act on it. The kopf
wiring around it is handlers.py.

A pass writes the job's status only over the version of the job it read (`Overtaken`
otherwise: the next pass starts from what was written meanwhile, by the other replica or by
this one), and posts its Events only once that write stands. What it does before that write is
safe to do again, or recorded first: docs/kubernetes.md, "Two replicas".
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import aiohttp
import kopf

from pipelinerl.contracts import JOB_LABEL, ROLE_LABEL, ROLES, OperatorEnv
from pipelinerl.spec import API_VERSION, KIND, SpecError
from pipelinerl_operator import admission, metrics
from pipelinerl_operator.config import OperatorConfig, from_env
from pipelinerl_operator.job_streams import JobStreams
from pipelinerl_operator.kube import Conflict, Kube, KubeError
from pipelinerl_operator.names import generator_selector, replicas, role_name, trainer_host
from pipelinerl_operator.nats_store import Reservations, store_bytes_needed
from pipelinerl_operator.pods import pod_problems, pods_stopped, trainer_gang_to_restart
from pipelinerl_operator.progress import DEFAULT_URL, fetch_trainer_status, status_url
from pipelinerl_operator.render import output_place, render
from pipelinerl_operator.status import (
    Observed,
    RoleObserved,
    compute,
    is_terminal,
    merge_patch,
    parse_ts,
    suspended_as_stored,
    ttl_expired,
    ttl_of,
)


def operator_config() -> OperatorConfig:
    """The install's settings, from this process's environment (as the chart sets it)."""
    return from_env(os.environ)


@dataclass
class JobRef:
    """The job a pass writes, and the version its next status write is made on condition of (moved
    on by the pass's own writes)."""

    namespace: str
    name: str
    uid: str
    version: str | None
    created: str = ""  # metadata.creationTimestamp

    async def write_status(self, kube: Kube, patch: dict[str, Any]) -> str | None:
        """`patch` merged into the job's status over `version`, which moves on to the version written;
        Overtaken when the job was written meanwhile. None: the job is gone."""
        try:
            written = await kube.write_status(API_VERSION, KIND, self.namespace, self.name, patch, self.version)
        except Conflict:
            raise Overtaken() from None
        self.version = written
        return written

    async def still_current(self, kube: Kube) -> None:
        """Overtaken unless the job is still at `version`: a pass about to stop the job's pods reads
        it again first, since a StatefulSet cannot be written on condition of the job's version."""
        job = await kube.get(API_VERSION, KIND, self.namespace, self.name)
        if job is not None and self.version is not None and job["metadata"].get("resourceVersion") != self.version:
            raise Overtaken()


class Overtaken(kopf.TemporaryError):
    """The job was written between this pass's read and its status write (the other replica's
    pass, a user's edit, kopf's own annotations): the pass is dropped unwritten and run again on
    the job as it now is."""

    def __init__(self) -> None:
        super().__init__("the job changed during this pass: run again on what was written", delay=1)


async def run(
    kube: Kube | None,
    store: Reservations,
    body: kopf.Body,
    start: tuple[dict[str, Any], str | None],
    logger: logging.Logger | logging.LoggerAdapter,
    jobs: kopf.Index,
) -> tuple[dict[str, Any], str | None]:
    """One pass: read the spec, apply its children, observe them, restart a trainer gang on a new
    template, compute the status and act on it. `start`: the status it goes on from and the
    version its write is made on condition of (status.starting_point). Returns the status and the
    version its write made."""
    if kube is None:
        raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=5)
    started = time.monotonic()
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    previous, version = start
    ref = JobRef(ns, name, meta.get("uid", ""), version, meta.get("creationTimestamp", ""))
    metrics.reconciling(ns)
    logger.debug("reconciling generation %s", meta.get("generation"))
    cfg = operator_config()
    job, spec_error, children = _read_spec(body, previous, cfg, logger)
    try:
        apply_error, held, kept, made = await _reserve_and_apply(
            kube, store, jobs, body, ref, job, previous, children, cfg, logger
        )
        sets = await _owned_statefulsets(kube, ns, name, ref.uid)
        roles = _observe_roles(job, sets)
        uids = {sts["metadata"].get("uid") for sts in sets.values()}
        pods = [p for p in await kube.list("v1", "Pod", ns, f"{JOB_LABEL}={name}") if not _foreign_pod(p, uids)]
        await _restart_trainer_gang(kube, body, job, pods, roles)
        now = datetime.now(timezone.utc)
        status, events = compute(
            _observed(
                body, job, now, previous, spec_error, roles, *await _trainer_status(job, roles), pods, apply_error
            )
        )
        status["natsReservedBytes"] = held
        if written := output_written(previous, status, job):
            status["outputWritten"] = written
        # A suspended job's checkpoint record, until its resume; the Secret the operator made. Unset,
        # absent (as the API server keeps a status): a null would be patched again by every pass.
        status.update({k: v for k, v in (("suspendedStore", kept), ("credentialsSecret", made)) if v})
        await _act_on(kube, body, ref, logger, job, cfg, previous, status, events, now)
        return status, ref.version
    except Overtaken:
        raise
    except Exception:
        metrics.RECONCILE_ERRORS.labels(ns).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


async def apply_owned(
    kube: Kube, ref: JobRef, children: list[dict[str, Any]], made: str | None
) -> tuple[str | None, str | None]:
    """Apply the job's children in order; stop at the first that cannot be, and say why: an object
    of that name the job does not own (never taken over: deleting the job would delete it), or
    one the API server refused (invalid, quota, an admission webhook). Every path that writes a
    child comes here (the terminal one included). The job's Secret is only ever created: its
    values follow from the job's uid and never change, so the operator needs no right to read (nor
    to overwrite) Secrets where jobs run. `made`: the Secret the job's status says the operator
    created (status.credentialsSecret); one of that name found otherwise is someone else's, and
    the job's pods never get it; one it makes is written into the job's status at once (a pass
    that fails or is refused later must not lose it): over the pass's version, else whatever the
    job's version, and the pass is overtaken. Returns why it stopped (None: all applied) and the
    Secret the operator has made, as the status keeps it. Before any: a claim in the way of pods
    about to start (`_earlier_claim`), which would leave the job's other pods holding their GPUs
    with no trainer."""
    try:
        if earlier := await _earlier_claim(kube, ref, children):
            return earlier, made
    except KubeError as err:
        if passing(err):
            raise
        return f"reading the trainers' claims: {err}", made
    for obj in children:
        meta = obj["metadata"]
        what = f"{obj['kind']} {meta['name']}"
        try:
            if obj["kind"] == "Secret":
                try:
                    created = await kube.create(obj)
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    # The answer lost, maybe not the create: the server may have made it, which a
                    # later pass's create (refused: it exists) could tell from someone else's
                    # only by this job's record. Where it was not made, that pass makes it.
                    made = meta["name"]
                    await _record_secret(kube, ref, made)
                    raise
                if created:
                    made = meta["name"]  # the pass's own status write records it, should this one fail
                    await _record_secret(kube, ref, meta["name"])
                elif made != meta["name"]:
                    return f"{what} already exists and this job did not make it: not used (delete it)", made
                continue
            existing = await kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            if existing is not None and not owned_by(existing, ref.uid):
                return (
                    f"{what} already exists and is not this job's: not taken over (delete or rename it, "
                    "or give the job another name)"
                ), made
            if _moves_pods(existing, obj):  # a stale pass must not stop a resumed job's, nor start a stopped one's
                await ref.still_current(kube)
            await kube.apply(obj)
        except KubeError as err:
            if passing(err):
                raise
            return f"{what}: {err}", made
    return None, made


def passing(err: KubeError) -> bool:
    """An API server that could not serve a request (overloaded, etcd or a webhook unreachable),
    not one that refused it: the pass is retried, as on a timeout, the job's conditions left as
    they were (an `ApplyRefused` for it would flip Ready and post Events, then flip back)."""
    return err.status == 429 or err.status >= 500


async def _earlier_claim(kube: Kube, ref: JobRef, children: list[dict[str, Any]]) -> str | None:
    """Why the children's StatefulSets about to start pods (made, resumed) must not: a claim
    their pods would mount (the claims are named for the job, `<template>-<statefulset>-<ordinal>`,
    not for its uid) that was made before the job, so an earlier job of its name kept it when it
    was deleted (`runPolicy.checkpointRetention`). Mounted, its checkpoints would be taken for
    this job's (the trainer then finds its store lost), and a retention policy of Delete would
    delete them with this job. One of this job's own (kept while it was suspended, or past a
    StatefulSet deleted by hand) was made after it. None where there is none."""
    if not ref.created:
        return None
    created = parse_ts(ref.created)
    for sts in children:
        templates = sts["spec"].get("volumeClaimTemplates") if sts["kind"] == "StatefulSet" else None
        if not templates or not _replicas(sts):
            continue
        name = sts["metadata"]["name"]
        if _replicas(await kube.get("apps/v1", "StatefulSet", ref.namespace, name)) >= _replicas(sts):
            continue  # its pods run, on claims they hold
        for claim in (f"{t['metadata']['name']}-{name}-{i}" for t in templates for i in range(_replicas(sts))):
            found = (await kube.get("v1", "PersistentVolumeClaim", ref.namespace, claim) or {}).get("metadata") or {}
            made = found.get("creationTimestamp")
            if made and found.get("deletionTimestamp"):
                return f"PersistentVolumeClaim {claim} is being deleted: the pods that mount it start once it is gone"
            if made and parse_ts(made) < created:
                return (
                    f"PersistentVolumeClaim {claim} was made at {made}, before this job ({ref.created}): an earlier "
                    "job of this name kept it when it was deleted (runPolicy.checkpointRetention), and its "
                    "checkpoints are not this job's: not mounted. Copy out what it holds, then delete it "
                    f"(kubectl delete pvc {claim} -n {ref.namespace}), or give the job another name"
                )
    return None


async def _stop_unread(kube: Kube, ref: JobRef, body: kopf.Body) -> str | None:
    """A job whose spec no longer reads (a policy tightened since) renders nothing; suspended
    (`suspended_as_stored`), its own StatefulSets are scaled to none all the same: a suspension
    frees its GPUs. Why not, if it could not be."""
    if not suspended_as_stored(body):
        return None
    try:
        for role in ROLES:
            name = role_name(ref.name, role)
            sts = await kube.get("apps/v1", "StatefulSet", ref.namespace, name)
            if sts is not None and owned_by(sts, ref.uid) and _replicas(sts):
                await ref.still_current(kube)
                await kube.scale("apps/v1", "StatefulSet", ref.namespace, name, 0)
    except KubeError as err:
        return f"scaling the suspended job's pods to none: {err}"
    return None


def _replicas(obj: dict[str, Any] | None) -> int:
    return int(((obj or {}).get("spec") or {}).get("replicas") or 0)


def _moves_pods(existing: dict[str, Any] | None, obj: dict[str, Any]) -> bool:
    return obj["kind"] == "StatefulSet" and _replicas(existing) != _replicas(obj)


RECORD_TRIES = 4  # writes of a Secret's record the API server failed, in all (`_record_secret`)


RECORD_BACKOFF_S = 1.0  # between those writes: 1, 2, 3 times it


async def _record_secret(kube: Kube, ref: JobRef, secret: str) -> None:
    """The Secret just made, written into the job's status. Unrecorded, no later pass could tell it
    from someone else's (the operator cannot read Secrets), and the job would be refused until a
    user deleted it: a write the API server fails (an error, throttled, timed out) is tried again,
    RECORD_TRIES in all, 1, 2, 3 s apart."""
    fact = {"credentialsSecret": secret}
    for attempt in range(1, RECORD_TRIES + 1):
        try:
            try:
                if await ref.write_status(kube, fact) is None:
                    raise Overtaken()  # the job is gone: nothing more to write
                return
            except Overtaken:
                await kube.write_status(API_VERSION, KIND, ref.namespace, ref.name, fact, None)
                raise
        except (KubeError, asyncio.TimeoutError, aiohttp.ClientError) as err:
            if attempt == RECORD_TRIES:  # as the API server's answer: the pass's status write then records it
                if isinstance(err, KubeError):
                    raise
                raise KubeError(0, f"recording {secret} in the job's status: {err!r}") from err
            await asyncio.sleep(attempt * RECORD_BACKOFF_S)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def event(body: kopf.Body, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def job_streams(body: kopf.Body, cfg: OperatorConfig, logger: logging.Logger | logging.LoggerAdapter) -> JobStreams:
    return JobStreams(body, cfg, lambda type_, reason, message: event(body, type_, reason, message), logger)


async def _owned_statefulsets(kube: Kube, ns: str, name: str, uid: str) -> dict[str, dict[str, Any]]:
    """The job's role StatefulSets, by role; one of the name it does not own (an earlier job's,
    left behind; the pass refuses to apply over it) is not the job's to observe: its pods' state,
    restarts and trainer would be read as the job's."""
    sets = {}
    for role in ROLES:
        sts = await kube.get("apps/v1", "StatefulSet", ns, role_name(name, role))
        if sts is not None and owned_by(sts, uid):
            sets[role] = sts
    return sets


def _foreign_pod(pod: dict[str, Any], statefulsets: set[str]) -> bool:
    """A pod of the job's labels that a StatefulSet other than the job's own controls."""
    refs = pod["metadata"].get("ownerReferences") or []
    return any(
        r.get("controller") and r.get("kind") == "StatefulSet" and r.get("uid") not in statefulsets for r in refs
    )


def _observe_roles(job: Any, sets: dict[str, dict[str, Any]]) -> dict[str, RoleObserved]:
    roles = {}
    for role in ROLES:
        sts = sets.get(role) or {}
        st = sts.get("status") or {}
        desired = replicas(job, role) if job is not None else int((sts.get("spec") or {}).get("replicas", 0))
        roles[role] = RoleObserved(
            desired=desired,
            replicas=int(st.get("replicas", 0) or 0),
            ready=int(st.get("readyReplicas", 0) or 0),
            update_revision=st.get("updateRevision"),
        )
    return roles


def _pod_restarts(pods: list[dict[str, Any]]) -> dict[str, int]:
    """Container restarts per pod."""
    return {
        p["metadata"]["name"]: sum(
            int(c.get("restartCount", 0) or 0) for c in (p.get("status") or {}).get("containerStatuses") or []
        )
        for p in pods
    }


def _pods_of(pods: list[dict[str, Any]], roles: list[str]) -> frozenset[str]:
    """The pods of `roles` (those whose failures count: `runPolicy.failingRoles`)."""
    return frozenset(
        p["metadata"]["name"] for p in pods if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) in roles
    )


def output_written(previous: dict[str, Any], status: dict[str, Any], job: Any) -> str | None:
    """Where the job's model was written (`render.output_place`), from the pass that finds it
    succeeded on: with the spec its pods ran with then, not as edited since (an output claim added
    to a finished job holds nothing, and its volumes hold the only copy)."""
    if status.get("phase") != "Succeeded":
        return None
    if previous.get("phase") == "Succeeded" or job is None:
        return previous.get("outputWritten")
    return output_place(job)


def _read_spec(
    body: kopf.Body, previous: dict[str, Any], cfg: Any, logger: logging.Logger | logging.LoggerAdapter
) -> tuple[Any, str | None, list[dict[str, Any]]]:
    """The job as `validate` reads it, and its children as rendered now; or the spec's error."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    try:
        job = admission.check(admission.job_manifest(body), source=f"{KIND} {ns}/{name}", cfg=cfg)
    except SpecError as err:
        logger.warning("invalid spec: %s", err)
        return None, str(err), []
    active = not job.spec.suspend and not is_terminal(previous)
    return job, None, render(job, ns, meta.get("uid", ""), cfg, active=active, written_to=previous.get("outputWritten"))


async def _reserve_and_apply(
    kube: Kube,
    store: Reservations,
    jobs: kopf.Index,
    body: kopf.Body,
    ref: JobRef,
    job: Any,
    previous: dict[str, Any],
    children: list[dict[str, Any]],
    cfg: OperatorConfig,
    logger: logging.Logger | logging.LoggerAdapter,
) -> tuple[str | None, int, dict[str, Any] | None, str | None]:
    """Hold (or give back) the job's room in the NATS store, then apply its children if it has
    room; why not, otherwise; the bytes it holds; a suspended job's checkpoint record, kept until
    its resume has restored its store from it; the credentials Secret the operator made."""
    # What the status says it holds, or the books: a pass whose status write was refused took room.
    holds = max(int(previous.get("natsReservedBytes") or 0), await store.holding(jobs, kube, ref.uid))
    # A job whose spec no longer reads is suspended by its stored spec (`_stop_unread` stops its
    # pods): its room goes back as any suspended job's, its checkpoint record kept first.
    suspended = job.spec.suspend if job is not None else suspended_as_stored(body)
    need = store_bytes_needed(job, previous, cfg, holds, suspended)
    kept, made = previous.get("suspendedStore"), previous.get("credentialsSecret")
    streams = job_streams(body, cfg, logger)
    if holds and not need:  # its account (and room) stays until its streams are gone: tried again next pass
        kept, gone = await release_streams(kube, streams, suspended, kept)
        if not gone:
            need = holds
    error, held = await store.reserve(jobs, cfg, kube, ref.uid, ref.namespace, ref.name, need)
    # Resumed: its store goes on from its checkpoint first.
    if not error and children and need and kept and not suspended:
        error = await streams.restore(job, kept)
        kept = kept if error else None
    if not error and children:
        error, made = await apply_owned(kube, ref, children, made)
    elif job is None:
        error = error or await _stop_unread(kube, ref, body)
    if error:
        logger.warning("not applied: %s", error)
    return error, held, kept, made


async def release_streams(
    kube: Kube, streams: JobStreams, suspended: bool, kept: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, bool]:
    """A job's streams deleted before its room is given back: the suspended job's checkpoint record
    (its resume restores the store from it) and whether they are gone. The record is read in one
    pass, which writes it into the status, and the streams deleted in a later one, once it
    stands: a pass whose status write is refused loses nothing it cannot do again. A store made
    again from the kept record was made by a resume this pass did not see (the other replica's,
    or one whose status write was refused before the job was suspended again): it is not deleted
    while the job's pods may run in it, and a newer record they told there since replaces the kept
    one. A store made from a record holds it (`recover_store`; its trainer tells it again at its
    start): read back, it is nothing new, and the streams go. A finished job's go once its pods
    are gone: those on their way out still publish and read there (and a service starting makes
    its job's streams: a store deleted under it would be made again, outside the books)."""
    if not suspended:
        return kept, await streams.pods_gone(kube) and await streams.delete()
    again = await streams.restored_from(kept) if kept else False
    if again is None:  # not known: next pass
        return kept, False
    if again or not kept:
        record = await streams.checkpoint_record(kube)
        if record is None:  # its pods not gone yet
            return kept, False
        if record and not same_checkpoint(record, kept):  # to be written first
            return record, False
    return kept, await streams.delete()


def same_checkpoint(record: dict[str, Any], kept: dict[str, Any] | None) -> bool:
    return kept is not None and (record["store"], record["step"]) == (kept["store"], kept["step"])


async def _restart_trainer_gang(
    kube: Kube, body: kopf.Body, job: Any, pods: list[dict[str, Any]], roles: dict[str, RoleObserved]
) -> None:
    """Trainer ranks restart together on a new template (one rank alone cannot rejoin the others)."""
    if job is None:
        return
    gang = trainer_gang_to_restart(pods, roles["trainer"].update_revision)
    for pod in gang:
        await kube.delete("v1", "Pod", body["metadata"]["namespace"], pod)
    if gang:
        event(
            body,
            "Normal",
            "TrainerGangRestarted",
            f"trainer pods {', '.join(gang)} restart together on the "
            f"new template (revision {roles['trainer'].update_revision}), from their checkpoint",
        )


async def _trainer_status(job: Any, roles: dict[str, RoleObserved]) -> tuple[Any, str]:
    """Trainer rank 0's /status once it is ready (None before, or if it does not answer), and its
    StoreLost message whenever it answers: a trainer waiting for its store is never ready (its
    /status is served from its start, its host resolved unready: `publishNotReadyAddresses`)."""
    if job is None or roles["trainer"].replicas == 0:
        return None, ""
    ns, name = job.namespace, job.name
    url = status_url(os.environ.get(OperatorEnv.TRAINER_STATUS_URL, DEFAULT_URL), name, ns, trainer_host(job, ns))
    report = await fetch_trainer_status(url)
    if report is None:
        return None, ""
    return (report if roles["trainer"].ready else None), report.store_lost


def _observed(
    body: kopf.Body,
    job: Any,
    now: datetime,
    previous: dict[str, Any],
    spec_error: str | None,
    roles: dict[str, RoleObserved],
    trainer_status: Any,
    store_lost: str,
    pods: list[dict[str, Any]],
    apply_error: str | None,
) -> Observed:
    meta = body["metadata"]
    run_policy = job.spec.run_policy if job is not None else None
    return Observed(
        generation=int(meta.get("generation", 0) or 0),
        now=now,
        previous=previous,
        spec_error=spec_error,
        suspend=job.spec.suspend if job is not None else suspended_as_stored(body),
        roles=roles,
        trainer_status=trainer_status,
        store_lost=store_lost,
        pod_restarts=_pod_restarts(pods),
        failing_pods=_pods_of(pods, run_policy.failing_roles if run_policy else []),
        pods_stopped=pods_stopped(pods),
        pod_problems=tuple(pod_problems(pods)),
        apply_error=apply_error,
        created=parse_ts(meta["creationTimestamp"]) if meta.get("creationTimestamp") else None,
        backoff_limit=run_policy.backoff_limit if run_policy else 0,
        active_deadline_seconds=run_policy.active_deadline_seconds if run_policy else None,
        progress_deadline_seconds=run_policy.progress_deadline_seconds if run_policy else None,
        generator_selector=generator_selector(meta["name"]),
    )


async def _act_on(
    kube: Kube,
    body: kopf.Body,
    ref: JobRef,
    logger: logging.Logger | logging.LoggerAdapter,
    job: Any,
    cfg: Any,
    previous: dict[str, Any],
    status: dict[str, Any],
    events: list[Any],
    now: datetime,
) -> None:
    """Write the status over the pass's version of the job (`ref`, which moves on to the version
    written) and post its events at once; free the GPUs of a job that has just ended (after the write: a
    pass that ended the job but was refused would otherwise leave it Running with its pods gone,
    and the next pass would start them again; every pass after the write renders it stopped
    anyway); delete a finished job whose TTL has run out."""
    ns, name, uid = ref.namespace, ref.name, ref.uid
    # `previous` is the job's status the pass started at (or this replica's write that made it);
    # nothing changed, nothing written (and no other replica's pass overtaken by it).
    patch = merge_patch(previous, status)
    if patch:
        await ref.write_status(kube, patch)
    # The events of the status written, before anything else can fail: no later pass makes them.
    for e in events:
        logger.debug("event %s: %s", e.reason, e.message)
        event(body, e.type, e.reason, e.message)
    metrics.JOBS.record(ns, name, status)
    if job is not None and is_terminal(status) and not is_terminal(previous):
        # Free the GPUs; the checkpoints stay (or may now go with the job: the output is written).
        # As owned as any other apply: an object of a child's name that is not the job's stays as it is.
        children = render(job, ns, uid, cfg, active=False, written_to=status.get("outputWritten"))
        error, _ = await apply_owned(kube, ref, children, status.get("credentialsSecret"))
        if error:
            logger.warning("not scaled down: %s", error)  # the next pass renders it stopped again
    ttl = job.spec.run_policy.ttl_seconds_after_finished if job is not None else ttl_of(body)
    if ttl_expired(status, ttl, now):
        event(body, "Normal", "TTLExpired", "deleting the finished job (runPolicy.ttlSecondsAfterFinished)")
        await kube.delete(API_VERSION, KIND, ns, name)
