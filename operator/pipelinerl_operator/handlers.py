"""Thin kopf wiring: observe, render, apply, compute status. The decisions live in render.py and status.py.

Every trigger (create, spec update, operator resume, periodic resync) runs the same idempotent
`reconcile`, so restarting the operator at any point converges without duplicates. A pass
writes the job's status only over the version of the job it read (`Overtaken` otherwise: the
next pass starts from what was written meanwhile, by the other replica or by this one), and
posts its Events only once that write stands.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from datetime import datetime, timezone
from typing import Any

import aiohttp.web
import kopf

from pipelinerl.contracts import JOB_LABEL, OPERATOR_METRICS_PORT, ROLE_LABEL, ROLES, OperatorEnv
from pipelinerl.crd import PLURAL, VERSION
from pipelinerl.spec import API_GROUP, API_VERSION, KIND, SpecError
from pipelinerl_operator import admission, metrics
from pipelinerl_operator.admission import MAX_MANIFEST_BYTES
from pipelinerl_operator.config import from_env
from pipelinerl_operator.credentials import nats_accounts
from pipelinerl_operator.kube import Conflict, Kube, KubeError
from pipelinerl_operator.pods import pod_problems, trainer_gang_to_restart
from pipelinerl_operator.progress import DEFAULT_URL, fetch_trainer_status, status_url
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.names import generator_selector, replicas, role_name, trainer_host
from pipelinerl_operator.render import render
from pipelinerl_operator.status import (
    Observed,
    RoleObserved,
    compute,
    is_terminal,
    parse_ts,
    ttl_expired,
)
from pipelinerl_operator.nats_store import (
    JobRecord,
    Reservations,
    accounts_secret,
    accounts_secret_name,
    store_bytes_needed,
)
from pipelinerl_operator.job_streams import JobStreams, own_nats_url

FINALIZER = f"{API_GROUP}/cleanup"
RESYNC_SECONDS = float(os.environ.get(OperatorEnv.RESYNC_SECONDS, "15"))


def operator_config() -> OperatorConfig:
    """The install's settings, from this process's environment (as the chart sets it)."""
    return from_env(os.environ)


# An admission review holds the job at most twice (an update's old and new objects), each within
# admission.MAX_MANIFEST_BYTES: a larger body is refused unread (the webhook's port is reachable
# from the API server, and wherever the network lets callers in).
MAX_REVIEW_BYTES = 2 * MAX_MANIFEST_BYTES + 64 * 1024


class BoundedWebhookServer(kopf.WebhookServer):
    """kopf's webhook server, refusing (413) a body longer than a review can be before reading it
    (a body without a length stays within aiohttp's own 1 MiB). Overrides kopf's `_serve`."""

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if (request.content_length or 0) > MAX_REVIEW_BYTES:
            raise aiohttp.web.HTTPRequestEntityTooLarge(
                max_size=MAX_REVIEW_BYTES, actual_size=request.content_length or 0
            )
        return await kopf.WebhookServer._serve(fn, request)


class _State:
    kube: Kube | None = None
    locks: dict[str, asyncio.Lock] = {}  # kopf runs timers beside change handlers: one pass per job at a time
    store: Reservations = Reservations()  # the chart's NATS store (nats_store.py)


class Overtaken(kopf.TemporaryError):
    """The job was written between this pass's read and its status write (the other replica's
    pass, a user's edit, kopf's own annotations): the pass is dropped unwritten and run again on
    the job as it now is."""

    def __init__(self) -> None:
        super().__init__("the job changed during this pass: run again on what was written", delay=1)


STATE = _State()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    STATE.locks.clear()
    STATE.store = Reservations()
    # One finalizer for kopf's timer bookkeeping and our stream cleanup.
    settings.persistence.finalizer = FINALIZER
    # Keep kopf's bookkeeping in annotations: status fields outside the CRD schema are pruned.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP,
        key="last-handled-configuration",
    )
    # Events come only from our fixed vocabulary (kopf.event), not from log lines.
    settings.posting.level = logging.CRITICAL + 1
    settings.networking.request_timeout = 60
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    if os.environ.get(OperatorEnv.WATCH_NAMESPACES):
        settings.scanning.disabled = True  # namespaced install: no cluster-wide CRD/namespace scans
    # A deleted job's finalizer waits for its resync timer to exit; kopf looks again only on the
    # job's next change or after this: a pass that ends unwritten (overtaken) makes no change.
    settings.background.cancellation_polling = 2
    settings.peering.lifetime = int(os.environ.get(OperatorEnv.PEERING_LIFETIME) or 60)
    port = int(os.environ.get(OperatorEnv.METRICS_PORT, str(OPERATOR_METRICS_PORT)))
    metrics.JOBS.stale_after_s = 3 * RESYNC_SECONDS  # three passes missed: not this replica's to say
    if port:
        metrics.serve(port)
    webhook_port = os.environ.get(OperatorEnv.WEBHOOK_PORT)
    if webhook_port:  # the chart's ValidatingWebhookConfiguration points here (not managed by kopf)
        certs = os.environ.get(OperatorEnv.WEBHOOK_CERT_DIR)
        settings.admission.server = BoundedWebhookServer(
            addr="0.0.0.0",
            port=int(webhook_port),
            insecure=not certs,
            certfile=os.path.join(certs, "tls.crt") if certs else None,
            pkeyfile=os.path.join(certs, "tls.key") if certs else None,
        )


def finalizer_taken_by_another(old: Any, new: Any, userinfo: Any) -> bool:
    """An update that drops the operator's finalizer, made by anyone but the operator (or a
    cluster admin, the way out when the operator is gone): the job would go without its cleanup."""
    had = FINALIZER in ((old.get("metadata") or {}).get("finalizers") or [])
    has = FINALIZER in ((new.get("metadata") or {}).get("finalizers") or [])
    account, namespace = os.environ.get(OperatorEnv.SERVICE_ACCOUNT), os.environ.get(OperatorEnv.NAMESPACE)
    if not had or has or not (account and namespace):
        return False
    user = userinfo or {}
    return user.get("username") != f"system:serviceaccount:{namespace}:{account}" and "system:masters" not in (
        user.get("groups") or []
    )


def validate_job(
    body: Any,
    old: Any = None,
    operation: str | None = None,
    warnings: list[str] | None = None,
    userinfo: Any = None,
    **_: Any,
) -> None:
    """The admission webhook: refuse what `pipelinerl validate` refuses, naming each field, and
    warn where it warns (kubectl prints the warnings)."""
    stored = old if operation == "UPDATE" and old else None
    if stored is not None and finalizer_taken_by_another(stored, body, userinfo):
        raise kopf.AdmissionError(
            f"metadata.finalizers: {FINALIZER} is the operator's to remove, once it has deleted the job's "
            "streams and StatefulSets (delete the job instead)",
            code=403,
        )
    if stored is not None and stored.get("spec") == body.get("spec"):
        return  # metadata, finalizers, status: never blocked, even for a job older rules admitted
    meta = body.get("metadata") or {}
    try:
        job = admission.check(
            dict(body),
            dict(stored) if stored else None,
            source=f"{KIND} {meta.get('namespace', '')}/{meta.get('name', '')}",
            cfg=operator_config(),
        )
    except SpecError as err:
        raise kopf.AdmissionError(str(err), code=422) from None
    if warnings is not None:
        warnings.extend(admission.job_warnings(job))


if os.environ.get(OperatorEnv.WEBHOOK_PORT):  # kopf refuses webhook handlers with no server to serve them
    kopf.on.validate(API_GROUP, VERSION, PLURAL, id="validate-job", operations=["CREATE", "UPDATE"])(validate_job)


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: kubeconfig; `PIPELINERL_KUBE_SERVER` overrides
    both (a `kubectl proxy`, or the emulator in tests). The same credentials serve our own client."""
    server = os.environ.get(OperatorEnv.KUBE_SERVER)
    if server:
        info: kopf.ConnectionInfo | None = kopf.ConnectionInfo(server=server, default_namespace="default")
    else:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is not None:
        STATE.kube = Kube(info)
    return info


kopf.on.login()(login)  # registered, and still callable as it is (nats_accounts_exist)


@kopf.on.cleanup()
async def close_client(**_: Any) -> None:
    metrics.stop_serving()
    if STATE.kube is not None:
        await STATE.kube.close()
        STATE.kube = None  # the next start logs in again (to whatever server it is told)


@kopf.index(API_GROUP, VERSION, PLURAL)
def jobs(namespace: str | None, name: str, uid: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], JobRecord]:
    """Every job watched, with the bytes of the chart's NATS store its status says it holds: the
    reservations stand in the jobs' statuses, so a restarted operator (or the replica taking its
    turn) starts from them."""
    held = (body.get("status") or {}).get("natsReservedBytes") or 0
    return {(namespace or "", name): JobRecord(uid, held if isinstance(held, int) else 0)}


@kopf.on.startup()
async def nats_accounts_exist(settings: kopf.OperatorSettings, **_: Any) -> None:
    """The chart's NATS starts once its accounts Secret exists: create it (the operator's account
    alone; the store's books are written there at the first decision) if it does not; never
    overwrite it here (that would log every job out until the jobs' next sync). Start-up runs
    before kopf's login: log in for our own client first."""
    cfg = operator_config()
    secret, namespace = accounts_secret_name()
    if not (secret and namespace):
        return
    if STATE.kube is None:
        login(settings=settings)
    if STATE.kube is not None:
        text = nats_accounts(cfg.auth_key, []) if cfg.auth_key else None
        await STATE.kube.create(accounts_secret(secret, namespace, text))


async def apply_owned(
    kube: Kube, children: list[dict[str, Any]], uid: str, made: str | None
) -> tuple[str | None, str | None]:
    """Apply the job's children in order; stop at the first that cannot be, and say why: an object
    of that name the job does not own (never taken over: deleting the job would delete it), or
    one the API server refused (invalid, quota, an admission webhook). Every path that writes a
    child comes here (the terminal one included). The job's Secret is only ever created: its
    values follow from the job's uid and never change, so the operator needs no right to read (nor
    to overwrite) Secrets where jobs run. `made`: the Secret the job's status says the operator
    created (status.credentialsSecret); one of that name found otherwise is someone else's, and
    the job's pods never get it. Returns why it stopped (None: all applied) and the Secret the
    operator has made, as the status keeps it."""
    for obj in children:
        meta = obj["metadata"]
        what = f"{obj['kind']} {meta['name']}"
        try:
            if obj["kind"] == "Secret":
                if not await kube.create(obj) and made != meta["name"]:
                    return f"{what} already exists and this job did not make it: not used (delete it)", made
                made = meta["name"]
                continue
            existing = await kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            if existing is not None and not owned_by(existing, uid):
                return (
                    f"{what} already exists and is not this job's: not taken over (delete or rename it, "
                    "or give the job another name)"
                ), made
            await kube.apply(obj)
        except KubeError as err:
            return f"{what}: {err}", made
    return None, made


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def _event(body: kopf.Body, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


def _streams(body: kopf.Body, cfg: OperatorConfig, logger: logging.Logger | logging.LoggerAdapter) -> JobStreams:
    return JobStreams(body, cfg, lambda type_, reason, message: _event(body, type_, reason, message), logger)


async def _observe_roles(kube: Kube, ns: str, job: Any, name: str) -> dict[str, RoleObserved]:
    roles = {}
    for role in ROLES:
        sts = await kube.get("apps/v1", "StatefulSet", ns, role_name(name, role)) or {}
        st = sts.get("status") or {}
        desired = replicas(job, role) if job is not None else int((sts.get("spec") or {}).get("replicas", 0))
        roles[role] = RoleObserved(
            desired=desired,
            replicas=int(st.get("replicas", 0) or 0),
            ready=int(st.get("readyReplicas", 0) or 0),
            update_revision=st.get("updateRevision"),
        )
    return roles


def _pod_restarts(pods: list[dict[str, Any]], roles: list[str]) -> dict[str, int]:
    """Container restarts per pod of the roles whose failures count (`runPolicy.failingRoles`)."""
    return {
        p["metadata"]["name"]: sum(
            int(c.get("restartCount", 0) or 0) for c in (p.get("status") or {}).get("containerStatuses") or []
        )
        for p in pods
        if (p["metadata"].get("labels") or {}).get(ROLE_LABEL) in roles
    }


async def reconcile(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter, jobs: kopf.Index
) -> dict[str, Any]:
    key = str(body["metadata"].get("uid") or f"{body['metadata']['namespace']}/{body['metadata']['name']}")
    async with STATE.locks.setdefault(key, asyncio.Lock()):
        return await _reconcile(body, logger, jobs)


async def _reconcile(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter, jobs: kopf.Index
) -> dict[str, Any]:
    """One pass: read the spec, apply its children, observe them, restart a trainer gang on a new
    template, compute the status and act on it. kopf's body is live (updated as the watch brings
    changes): the version and status the pass goes on from are taken at its start."""
    kube = STATE.kube
    if kube is None:
        raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=5)
    started = time.monotonic()
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    version, previous = meta.get("resourceVersion"), copy.deepcopy(dict(body.get("status") or {}))
    metrics.reconciling(ns)
    logger.debug("reconciling generation %s", meta.get("generation"))
    cfg = operator_config()
    job, spec_error, children = _read_spec(body, previous, cfg, logger)
    try:
        apply_error, held, kept, made = await _reserve_and_apply(kube, jobs, body, job, previous, children, cfg, logger)
        roles = await _observe_roles(kube, ns, job, name)
        pods = await kube.list("v1", "Pod", ns, f"{JOB_LABEL}={name}")
        await _restart_trainer_gang(kube, body, job, pods, roles)
        now = datetime.now(timezone.utc)
        status, events = compute(
            _observed(
                body, job, now, previous, spec_error, roles, *await _trainer_status(job, roles), pods, apply_error
            )
        )
        status["natsReservedBytes"] = held
        status["suspendedStore"] = kept or None  # a suspended job's checkpoint record, until its resume
        status["credentialsSecret"] = made
        await _act_on(kube, body, version, logger, job, cfg, previous, status, events, now)
        return status
    except Overtaken:
        raise
    except Exception:
        metrics.RECONCILE_ERRORS.labels(ns).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _read_spec(
    body: kopf.Body, previous: dict[str, Any], cfg: Any, logger: logging.Logger | logging.LoggerAdapter
) -> tuple[Any, str | None, list[dict[str, Any]]]:
    """The job as `validate` reads it, and its children as rendered now; or the spec's error."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    try:
        job = admission.check(
            {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "metadata": {"name": name, "namespace": ns, "labels": dict(meta.get("labels") or {})},
                "spec": dict(body.get("spec") or {}),
            },
            source=f"{KIND} {ns}/{name}",
            cfg=cfg,
        )
    except SpecError as err:
        logger.warning("invalid spec: %s", err)
        return None, str(err), []
    active = not job.spec.suspend and not is_terminal(previous)
    output_written = previous.get("phase") == "Succeeded"
    return job, None, render(job, ns, meta.get("uid", ""), cfg, active=active, output_written=output_written)


async def _reserve_and_apply(
    kube: Kube,
    jobs: kopf.Index,
    body: kopf.Body,
    job: Any,
    previous: dict[str, Any],
    children: list[dict[str, Any]],
    cfg: OperatorConfig,
    logger: logging.Logger | logging.LoggerAdapter,
) -> tuple[str | None, int, dict[str, Any] | None, str | None]:
    """Hold (or give back) the job's room in the NATS store, then apply its children if it has
    room; why not, otherwise; the bytes it holds; a suspended job's checkpoint record, kept until
    its resume has restored its store from it; the credentials Secret the operator made."""
    meta = body["metadata"]
    uid = meta.get("uid", "")
    need = store_bytes_needed(job, previous, cfg)
    holds = int(previous.get("natsReservedBytes") or 0)
    kept, made = previous.get("suspendedStore"), previous.get("credentialsSecret")
    streams = _streams(body, cfg, logger)
    suspended = job is not None and job.spec.suspend
    if holds and not need:  # its account (and room) stays until its streams are gone: tried again next pass
        kept, gone = await _release(kube, streams, suspended, kept)
        if not gone:
            need = holds
    error, held = await STATE.store.reserve(jobs, cfg, STATE.kube, uid, meta["namespace"], meta["name"], need)
    # Resumed: its store goes on from its checkpoint first.
    if not error and children and need and kept and not suspended:
        error = await streams.restore(job, kept)
        kept = kept if error else None
    if not error and children:
        error, made = await apply_owned(kube, children, uid, made)
    if error:
        logger.warning("not applied: %s", error)
    return error, held, kept, made


async def _release(
    kube: Kube, streams: JobStreams, suspended: bool, kept: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, bool]:
    """A job's streams deleted before its room is given back: the suspended job's checkpoint record
    (its resume restores the store from it) and whether they are gone. The record is read in one
    pass, which writes it into the status, and the streams deleted in a later one, once it
    stands: a pass whose status write is refused loses nothing it cannot do again."""
    if suspended and not kept:
        record = await streams.checkpoint_record(kube)
        if record is None or record:  # not yet; or its record, to be written first
            return record, False
    return kept, await streams.delete()


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
        _event(
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
        suspend=bool(job and job.spec.suspend),
        roles=roles,
        trainer_status=trainer_status,
        store_lost=store_lost,
        pod_restarts=_pod_restarts(pods, run_policy.failing_roles if run_policy else ["trainer"]),
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
    version: str | None,
    logger: logging.Logger | logging.LoggerAdapter,
    job: Any,
    cfg: Any,
    previous: dict[str, Any],
    status: dict[str, Any],
    events: list[Any],
    now: datetime,
) -> None:
    """Free the GPUs of a job that just ended; write the status over the job's `version` and post
    its events; delete a finished job whose TTL has run out."""
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
    if job is not None and is_terminal(status) and not is_terminal(previous):
        # Free the GPUs; the checkpoints stay (or may now go with the job: the output is written).
        # As owned as any other apply: an object of a child's name that is not the job's stays as it is.
        children = render(job, ns, uid, cfg, active=False, output_written=status["phase"] == "Succeeded")
        error, _ = await apply_owned(kube, children, uid, previous.get("credentialsSecret"))
        if error:
            logger.warning("not scaled down: %s", error)
    try:
        await kube.write_status(API_VERSION, KIND, ns, name, status, version)
    except Conflict:
        made = status.get("credentialsSecret")
        if made and made != previous.get("credentialsSecret"):  # a fact, whatever else was written
            await kube.write_status(API_VERSION, KIND, ns, name, {"credentialsSecret": made}, None)
        raise Overtaken() from None
    for e in events:
        logger.debug("event %s: %s", e.reason, e.message)
        _event(body, e.type, e.reason, e.message)
    metrics.JOBS.record(ns, name, status)
    if job is not None and ttl_expired(status, job.spec.run_policy.ttl_seconds_after_finished, now):
        _event(body, "Normal", "TTLExpired", "deleting the finished job (runPolicy.ttlSecondsAfterFinished)")
        await kube.delete(API_VERSION, KIND, ns, name)


# The resource handlers take the `jobs` index, which kopf passes by name; its callback protocols
# cannot name an index, hence the type: ignore on each of them.
@kopf.on.create(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def created(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    status = await reconcile(body, logger, jobs)
    if not any(c["reason"] == "InvalidSpec" for c in status["conditions"]):
        _event(body, "Normal", "Created", "created the ConfigMap, Services and StatefulSets")


@kopf.on.update(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def updated(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    status = await reconcile(body, logger, jobs)
    if not any(c["reason"] == "InvalidSpec" for c in status["conditions"]):
        _event(body, "Normal", "Updated", f"applied generation {status.get('observedGeneration')}")


@kopf.on.resume(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def resumed(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    await reconcile(body, logger, jobs)


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)  # type: ignore[arg-type]
async def resync(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    await reconcile(body, logger, jobs)


@kopf.on.delete(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def deleted(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    """Children go by garbage collection (ownerReferences), unless the job was deleted with
    `--cascade=orphan`: its StatefulSets are deleted here either way (nothing else would stop
    their pods). Then its NATS streams, and only then its account (deleting them needs it). Never
    blocks deletion: a NATS failure is reported and the finalizer is released (what is left is in
    an account no later job gets: `credentials.job_account`)."""
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta.get("uid", "")
    cfg = operator_config()
    await _delete_statefulsets(STATE.kube, ns, name, uid, logger)
    held = await STATE.store.holding(jobs, STATE.kube, uid)
    if held or own_nats_url(body) or not cfg.nats_bundled:  # on the chart's NATS, no room means no streams
        await _streams(body, cfg, logger).delete()
    try:
        await STATE.store.reserve(jobs, cfg, STATE.kube, uid, ns, name, 0)  # its account goes with it
    except Exception as err:  # noqa: BLE001 - the next job's change (or the resync) writes it again
        logger.warning("could not remove the NATS account of %s/%s: %r", ns, name, err)
    metrics.JOBS.record(ns, name, None)
    key = str(meta.get("uid") or f"{ns}/{name}")
    STATE.locks.pop(key, None)


async def _delete_statefulsets(
    kube: Kube | None, ns: str, name: str, uid: str, logger: logging.Logger | logging.LoggerAdapter
) -> None:
    """The job's StatefulSets: its own, or ones `--cascade=orphan` left with no owner (the garbage
    collector strips the ownerReferences then); never one another owner holds."""
    if kube is None:
        return
    for role in ROLES:
        try:
            sts = await kube.get("apps/v1", "StatefulSet", ns, role_name(name, role))
            if sts is None or (sts["metadata"].get("labels") or {}).get(JOB_LABEL) != name:
                continue
            if owned_by(sts, uid) or not sts["metadata"].get("ownerReferences"):
                await kube.delete("apps/v1", "StatefulSet", ns, role_name(name, role))
        except KubeError as err:
            logger.warning("could not delete StatefulSet %s: %s", role_name(name, role), err)
