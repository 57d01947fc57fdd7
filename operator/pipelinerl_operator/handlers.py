"""Thin kopf wiring: the operator's settings, its admission webhook, login, the jobs' index, and
the handlers. Every trigger (create, spec update, operator resume, periodic resync) runs the same
idempotent pass (reconcile.py), one at a time per job, so restarting the operator at any point
converges without duplicates.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import aiohttp.web
import kopf

from pipelinerl.contracts import JOB_LABEL, OPERATOR_METRICS_PORT, ROLES, OperatorEnv
from pipelinerl.crd import PLURAL, VERSION
from pipelinerl.spec import API_GROUP, API_VERSION, KIND, SpecError
from pipelinerl_operator import admission, metrics
from pipelinerl_operator.admission import MAX_MANIFEST_BYTES
from pipelinerl_operator.credentials import nats_accounts
from pipelinerl_operator.job_streams import own_nats_url
from pipelinerl_operator.kube import Kube, KubeError
from pipelinerl_operator.names import role_name
from pipelinerl_operator.nats_store import JobRecord, Reservations, accounts_secret, accounts_secret_name
from pipelinerl_operator.reconcile import Overtaken, event, job_streams, operator_config, owned_by
from pipelinerl_operator.reconcile import run as run_pass
from pipelinerl_operator.status import at_rest, parse_ts, starting_point, ttl_expired, ttl_of

FINALIZER = f"{API_GROUP}/cleanup"
RESYNC_SECONDS = float(os.environ.get(OperatorEnv.RESYNC_SECONDS, "15"))
# A job at rest (ended, or suspended, its pods and its store's room gone: `status.at_rest`) is
# passed over by the resync for this long after a pass that found and left it so: a pass is some
# 12 API calls for a suspended job (every child read and applied, the StatefulSets and pods read;
# more for a running one), and jobs that ended
# stay until deleted (hundreds where no ttlSecondsAfterFinished is set), each costing them every
# RESYNC_SECONDS. An edit still makes a pass at once (the change handlers); a child edited or
# deleted by hand is put back within this long; a TTL that runs out is acted on at the next tick.
IDLE_RESYNC_SECONDS = 300.0
# A deleted job's streams wait this long at most for its pods to go (a trainer checkpoints on its
# way out, in the 60 s of grace its pods get), looking every PODS_POLL_S.
PODS_GONE_WAIT_S = 180.0
PODS_POLL_S = 3.0


# An admission review holds the job at most twice (an update's old and new objects), each its
# manifest (admission.MAX_MANIFEST_BYTES), its annotations (at most 256 KiB, Kubernetes' bound:
# kubectl's and kopf's copies of it), its managed fields (about the manifest's size) and its
# status: a larger body is refused unread (the webhook's port is reachable from the API server,
# and wherever the network lets callers in). It is aiohttp's own bound on a body too.
MAX_REVIEW_BYTES = 2 * (2 * MAX_MANIFEST_BYTES + 256 * 1024) + 64 * 1024


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
    # Per job, this replica's last pass: the version it read, the status it wrote and the version
    # that write made (status.starting_point: kopf's body lags behind our own writes).
    last: dict[str, tuple[str | None, dict[str, Any], str | None]] = {}
    rested: dict[str, float] = {}  # per job, when (monotonic) a pass last found and left it at rest
    store: Reservations = Reservations()  # the chart's NATS store (nats_store.py)


STATE = _State()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    STATE.locks.clear()
    STATE.last.clear()
    STATE.rested.clear()
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
    if stored is not None and _but_suspend(stored) == _but_suspend(body):
        # Metadata, finalizers, status, a suspension or a resume: never blocked, even for a job
        # older rules admitted (a job whose spec no longer reads is stopped by its suspension).
        return
    meta = body.get("metadata") or {}
    try:
        job = admission.check(
            admission.job_manifest(body),
            admission.job_manifest(stored) if stored else None,
            source=f"{KIND} {meta.get('namespace', '')}/{meta.get('name', '')}",
            cfg=operator_config(),
        )
    except SpecError as err:
        raise kopf.AdmissionError(str(err), code=422) from None
    if warnings is not None:
        warnings.extend(admission.job_warnings(job))


async def validate_scale(body: Any, warnings: list[str] | None = None, userinfo: Any = None, **_: Any) -> None:
    """`kubectl scale` (the job's scale subresource: spec.generator.replicas), refused where the
    same edit of the job would be: past the platform's limits, or past what the job can run. The
    review holds a Scale, not the job: the job is read (a job gone is the API server's to answer)."""
    meta = body.get("metadata") or {}
    if not meta.get("namespace") or not meta.get("name"):
        raise kopf.AdmissionError("a Scale without its job's namespace and name cannot be checked", code=400)
    try:
        if STATE.kube is None:
            raise KubeError(0, "no client yet (the operator is starting)")
        stored = await STATE.kube.get(API_VERSION, KIND, meta["namespace"], meta["name"])
    except (KubeError, asyncio.TimeoutError, aiohttp.ClientError) as err:
        raise kopf.AdmissionError(f"the job's scale cannot be checked now (try again): {err}", code=503) from None
    if stored is None:
        return
    scaled = copy.deepcopy(stored)
    scaled.setdefault("spec", {}).setdefault("generator", {})["replicas"] = (body.get("spec") or {}).get("replicas", 0)
    # the whole check takes CPU (a cold one seconds): off the event loop kopf serves from
    await asyncio.to_thread(
        validate_job, body=scaled, old=stored, operation="UPDATE", warnings=warnings, userinfo=userinfo
    )


def _but_suspend(job: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (job.get("spec") or {}).items() if k != "suspend"}


if os.environ.get(OperatorEnv.WEBHOOK_PORT):  # kopf refuses webhook handlers with no server to serve them
    kopf.on.validate(API_GROUP, VERSION, PLURAL, id="validate-job", operations=["CREATE", "UPDATE"])(validate_job)
    kopf.on.validate(API_GROUP, VERSION, PLURAL, id="validate-scale", subresource="scale", operations=["UPDATE"])(
        validate_scale
    )


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


def _state_key(namespace: str, name: str, uid: str | None) -> str:
    """A job's key in this replica's per-job state."""
    return str(uid or f"{namespace}/{name}")


def forget_gone(jobs: kopf.Index) -> None:
    """This replica's per-job state dropped for jobs no longer watched: deleted jobs whose
    finalizer the other replica ran (this one's `deleted` never did). A lock held stays. Read
    through only while it holds more jobs than are watched (every pass comes here)."""
    if len(STATE.last) <= len(jobs) and len(STATE.locks) <= len(jobs):
        return
    live = {_state_key(ns, name, r.uid) for (ns, name), records in jobs.items() for r in records}
    for key in [k for k in STATE.last if k not in live]:
        del STATE.last[key]
        STATE.rested.pop(key, None)
    for key in [k for k, lock in STATE.locks.items() if k not in live and not lock.locked()]:
        del STATE.locks[key]


async def reconcile(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter, jobs: kopf.Index
) -> dict[str, Any] | None:
    """A pass over the job, one at a time per job; none once its deletion began (a resync's body is
    kopf's live view of the job: a pass that waited for `deleted` would apply what it removed)."""
    forget_gone(jobs)
    meta = body["metadata"]
    key = _state_key(meta["namespace"], meta["name"], meta.get("uid"))
    async with STATE.locks.setdefault(key, asyncio.Lock()):
        if body["metadata"].get("deletionTimestamp"):  # read now: kopf swaps the live body's content
            return None
        read = meta.get("resourceVersion")
        start = starting_point(body, STATE.last.get(key))
        STATE.rested.pop(key, None)  # a pass that raises (overtaken, an API error) leaves no rest behind
        status, written = await run_pass(STATE.kube, STATE.store, body, start, logger, jobs)
        STATE.last[key] = (read, status, written)
        if at_rest(start[0]) and at_rest(status):
            STATE.rested[key] = time.monotonic()
        return status


def resting(body: kopf.Body) -> bool:
    """Whether the resync passes over the job now: this replica's latest pass over it found and
    left it at rest less than IDLE_RESYNC_SECONDS ago, the job is as that pass read or wrote it
    (nobody else wrote it since: the other replica, a user), and its TTL, if any, has not run
    out. A job passed over keeps its metrics (they go stale unrecorded)."""
    meta = body["metadata"]
    key = _state_key(meta["namespace"], meta["name"], meta.get("uid"))
    since, last = STATE.rested.get(key), STATE.last.get(key)
    if since is None or last is None or time.monotonic() - since >= IDLE_RESYNC_SECONDS:
        return False
    if meta.get("resourceVersion") not in (last[0], last[2]):
        return False
    if ttl_expired(last[1], ttl_of(body), datetime.now(timezone.utc)):
        return False
    metrics.JOBS.record(meta["namespace"], meta["name"], last[1])
    return True


async def on_change(
    body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter, jobs: kopf.Index
) -> dict[str, Any] | None:
    """A change's pass. One overtaken is left to the resync timer (its next pass, or its retry a
    second later, goes on from what was written): a change handler retried by kopf writes its
    progress into the job, which overtakes the other replica's pass in turn, and two replicas
    reconciling at once kept refusing each other's passes that way."""
    try:
        return await reconcile(body, logger, jobs)
    except Overtaken:
        logger.info("overtaken: the resync goes on from what was written meanwhile")
        return None


def _valid(status: dict[str, Any]) -> bool:
    return not any(c["reason"] == "InvalidSpec" for c in status["conditions"])


# The resource handlers take the `jobs` index, which kopf passes by name; its callback protocols
# cannot name an index, hence the type: ignore on each of them.
@kopf.on.create(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def created(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    status = await on_change(body, logger, jobs)
    if status is not None and _valid(status):
        event(body, "Normal", "Created", "created the ConfigMap, Services and StatefulSets")


@kopf.on.update(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def updated(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    status = await on_change(body, logger, jobs)
    if status is not None and _valid(status):
        event(body, "Normal", "Updated", f"applied generation {status.get('observedGeneration')}")


@kopf.on.resume(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def resumed(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    await on_change(body, logger, jobs)


# A pass that raised (the API server timed out, answered 5xx) is tried again at the same cadence,
# not after kopf's default backoff for errors (60 s): every pass is idempotent.
@kopf.timer(API_GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=RESYNC_SECONDS)  # type: ignore[arg-type]
async def resync(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    if not resting(body):
        await reconcile(body, logger, jobs)


@kopf.on.delete(API_GROUP, VERSION, PLURAL)  # type: ignore[arg-type]
async def deleted(body: kopf.Body, logger: kopf.Logger, jobs: kopf.Index, **_: Any) -> None:
    """Children go by garbage collection (ownerReferences), unless the job was deleted with
    `--cascade=orphan`: its StatefulSets are deleted here either way (nothing else would stop
    their pods). Then, once its pods are gone (`_pods_left`), its NATS streams, and only then its
    account (deleting them needs it). Never blocks deletion for long: a NATS failure is reported
    and the finalizer is released (what is left is in an account no later job gets:
    `credentials.job_account`)."""
    meta = body["metadata"]
    name, ns, uid = meta["name"], meta["namespace"], meta.get("uid", "")
    key = _state_key(ns, name, uid)
    async with STATE.locks.setdefault(key, asyncio.Lock()):  # after a pass in flight, which could apply again
        await _delete_job(body, name, ns, uid, logger, jobs)
        STATE.locks.pop(key, None)
        STATE.last.pop(key, None)
        STATE.rested.pop(key, None)


async def _delete_job(
    body: kopf.Body, name: str, ns: str, uid: str, logger: logging.Logger | logging.LoggerAdapter, jobs: kopf.Index
) -> None:
    cfg = operator_config()
    await _delete_statefulsets(STATE.kube, ns, name, uid, logger)
    while await _pods_left(STATE.kube, ns, name, body):  # polled here: kopf logs each retry as an error
        await asyncio.sleep(PODS_POLL_S)
    held = await STATE.store.holding(jobs, STATE.kube, uid)
    if held or own_nats_url(body) or not cfg.nats_bundled:  # on the chart's NATS, no room means no streams
        await job_streams(body, cfg, logger).delete()
    try:
        await STATE.store.reserve(jobs, cfg, STATE.kube, uid, ns, name, 0)  # its account goes with it
    except Exception as err:  # noqa: BLE001 - the next job's change (or the resync) writes it again
        logger.warning("could not remove the NATS account of %s/%s: %r", ns, name, err)
    metrics.JOBS.record(ns, name, None)


async def _pods_left(kube: Kube | None, ns: str, name: str, body: kopf.Body) -> bool:
    """Whether the deleted job's streams wait for its pods: a pod still up could make them again
    once deleted (a service that starts, or restarts in place, joins the job, which makes its
    streams), in an account no later job gets, on the NATS volume for good. Not past
    PODS_GONE_WAIT_S since the deletion (a lost node's pods stay Terminating until the node
    controller gives up on them), nor where the pods cannot be listed."""
    since = body["metadata"].get("deletionTimestamp")
    if kube is None or (since and datetime.now(timezone.utc) - parse_ts(since) > timedelta(seconds=PODS_GONE_WAIT_S)):
        return False
    try:
        return bool(await kube.list("v1", "Pod", ns, f"{JOB_LABEL}={name}"))
    except KubeError:
        return False


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
