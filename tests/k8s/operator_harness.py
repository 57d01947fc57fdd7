"""Run the real kopf engine with our handlers against kmock's Kubernetes emulator.

No kube-apiserver can run on this machine, so kmock stands in for it: it serves discovery,
list/watch/patch/create/delete of the declared resources over real HTTP. It has no controllers,
defaulting or garbage collection: the tests play the StatefulSet controller (patching status
through the API, as the real controller would) and assert ownerReferences instead of GC, and
play the API server's validation where a test needs a write refused (`Emulator.refuse`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import uuid
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock
import kopf

from pipelinerl.crd import crd_manifest

NS = "team-a"
JOBS = "pipelinerl.dev/v1alpha1/pipelinerljobs"
RESOURCES = {
    JOBS: dict(
        namespaced=True,
        kind="PipelineRLJob",
        singular="pipelinerljob",
        shortnames={"prl"},
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "patch", "create", "delete", "update"},
    ),
    "apps/v1/statefulsets": dict(namespaced=True, kind="StatefulSet", subresources={"status", "scale"}),
    "v1/services": dict(namespaced=True, kind="Service"),
    "v1/configmaps": dict(namespaced=True, kind="ConfigMap"),
    "v1/secrets": dict(namespaced=True, kind="Secret"),
    "v1/serviceaccounts": dict(namespaced=True, kind="ServiceAccount"),
    "networking.k8s.io/v1/networkpolicies": dict(namespaced=True, kind="NetworkPolicy"),
    "v1/pods": dict(namespaced=True, kind="Pod", subresources={"status"}),
    "v1/persistentvolumeclaims": dict(namespaced=True, kind="PersistentVolumeClaim"),
    "v1/events": dict(namespaced=True, kind="Event"),
    "v1/namespaces": dict(namespaced=False, kind="Namespace"),
    "kopf.dev/v1/kopfpeerings": dict(namespaced=True, kind="KopfPeering"),
}


@attrs.frozen
class Invalid(kmock.KubernetesError):
    """What an API server answers to an object its validation or an admission webhook refuses."""

    status: int = 422
    reason: str = "Invalid"
    message: str = "refused"


@attrs.frozen
class Failing(kmock.KubernetesError):
    """What an API server answers when it cannot serve a request (etcd unreachable, overloaded)."""

    status: int = 500
    reason: str = "InternalError"
    message: str = "etcdserver: request timed out"


@attrs.frozen
class Conflict(kmock.KubernetesError):
    """What an API server answers to a write on condition of a version the object has left."""

    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; please apply your changes to the latest version and try again"


@attrs.frozen
class NotServed(kmock.KubernetesError):
    """What an API server answers for a kind it does not serve (a CRD not installed)."""

    status: int = 404
    reason: str = "NotFound"
    message: str = "the server could not find the requested resource"


OPERATOR_AGENTS = ("kopf/", "pipelinerl-operator")
REQUESTS_KEPT = 64  # far more than are ever in flight at once
KUBE_TIMEOUT_S = 10  # the operator's client's (pipelinerl_operator.kube.Kube)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server bookkeeping kopf relies on: a resourceVersion bumped
    on every write (kopf waits for its own patches by it), `metadata.generation` bumped on spec
    changes, uid/creationTimestamp on create, and `generateName` (kopf names its Events that way)."""

    _version: int = 0
    creates: list[str] = []  # "plural/name" of every POST, to check nothing is created twice
    refuse: dict[str, str] = {}  # "plural/name" → the message of a 422 answered to writes of it
    failing: set[str] = set()  # plurals every request for which is answered 500
    failing_writes: set[str] = set()  # "plural/name" whose writes are answered 500 (a webhook unreachable)
    unserved: set[str] = set()  # plurals the server does not serve (their CRD not installed): 404
    gates: dict[str, asyncio.Event] = {}  # plural → requests for it wait until it is set (`waiting` meanwhile)
    # The first request this says True of is answered only after the operator's client gave up
    # on it (a timeout: a failure that is not the API's answer).
    stall: Callable[[Any], bool] | None = None
    waiting: asyncio.Event
    # (API group, resource[/subresource], verb, name) of every call the operator made: kopf's and
    # its own client's, told apart from this harness's by their User-Agent (tests/k8s/chart.py
    # holds them against the chart's RBAC, which the emulator does not enforce).
    calls: set[tuple[str, str, str, str | None]] = set()
    counts: collections.Counter[str] = collections.Counter()  # the operator's calls per resource (plural)
    verbs: collections.Counter[tuple[str, str]] = collections.Counter()  # ... per resource[/subresource] and verb

    def _record(self, request) -> None:  # type: ignore[no-untyped-def]
        agent = str((request.headers or {}).get("User-Agent", ""))
        if request.resource is None or request.resource.plural is None or not agent.startswith(OPERATOR_AGENTS):
            return  # discovery: every authenticated client may read it (system:discovery)
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            verb = "watch" if request.params.get("watch") in ("true", "1") else ("get" if request.name else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method) or (
                "delete" if request.name else "deletecollection"
            )
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        self.calls.add((request.resource.group or "", resource, verb, request.name))
        self.counts[request.resource.plural] += 1
        self.verbs[(resource, verb)] += 1

    def _current(self, request) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        for (res, ns, name), obj in list(self.objects.items()):
            if res == request.resource and ns == request.namespace and name == request.name and not obj.deleted:
                return obj.raw
        return {}

    async def _handle(self, request):  # type: ignore[no-untyped-def]
        # kmock keeps every request and, for each new one, filters the whole log through each
        # reaction to find the one that sees it: a long test got slower with every request (a
        # tenancy test spent 90% of its CPU there, and its operator fell behind). No test reads
        # the log, so only its tail is kept; `request`, just appended, is in it.
        del self._requests[:-REQUESTS_KEPT]
        self._record(request)
        if self.stall is not None and self.stall(request):
            self.stall = None
            await asyncio.sleep(KUBE_TIMEOUT_S + 1)
        gate = self.gates.get(request.resource.plural) if request.resource is not None else None
        if gate is not None:
            self.waiting.set()
            await gate.wait()
        if (
            request.resource is not None
            and request.resource.plural == "pipelinerljobs"
            and request.subresource == "scale"
        ):
            if request.method == "GET":
                return aiohttp.web.json_response(self._scale(self._current(request)))
            # A write of the Scale's spec.replicas is one of the job's specReplicasPath, as the
            # API server maps it from the CRD's scale subresource (it bumps the generation too).
            replicas = request.data["spec"]["replicas"]
            request.data.clear()
            request.data.update(_nested(SCALE["specReplicasPath"], replicas))
        if request.resource is not None and request.resource.plural in self.failing:
            raise Failing()
        if request.resource is not None and request.resource.plural in self.unserved:
            raise NotServed()
        if request.method in ("PATCH", "POST", "PUT") and request.resource is not None:
            name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
            refused = self.refuse.get(f"{request.resource.plural}/{name}")
            if refused:
                raise Invalid(message=refused)
            if f"{request.resource.plural}/{name}" in self.failing_writes:
                raise Failing(message='Internal error occurred: failed calling webhook "quota.example.com"')
        Emulator._version += 1
        rv = str(Emulator._version)
        data = request.data
        if request.method == "POST" and isinstance(data, dict) and request.resource is not None:
            meta = data.setdefault("metadata", {})
            if meta.get("generateName") and not meta.get("name"):
                meta["name"] = f"{meta['generateName']}{rv}"
            self.creates.append(f"{request.resource.plural}/{meta['name']}")
            meta.setdefault("uid", str(uuid.uuid4()))  # as the API server: one per object ever made
            meta.setdefault("creationTimestamp", "2026-11-22T00:00:00Z")
            meta["generation"], meta["resourceVersion"] = 1, rv
        elif request.method == "PATCH" and request.resource is not None:
            current = self._current(request)
            generation = int(current.get("metadata", {}).get("generation", 1))
            if isinstance(data, dict):
                # A patch that says a resourceVersion is written only over that version, as the API
                # server does (kubernetes#63104): the optimistic lock the NATS store's books rely on.
                wanted = (data.get("metadata") or {}).get("resourceVersion")
                if wanted and current and wanted != current["metadata"].get("resourceVersion"):
                    raise Conflict()
                if "spec" in data and request.subresource in (None, "", "scale"):  # not /status
                    generation += 1
                data.setdefault("metadata", {}).update(resourceVersion=rv, generation=generation)
            elif isinstance(data, list):  # JSON patch (kopf's finalizers): append the bump
                # No optimistic concurrency here: drop kopf's resourceVersion precondition, which
                # a real server checks against versions kopf may not have watched yet.
                data[:] = [
                    op for op in data if not (op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion")
                ]
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
        return await super()._handle(request)

    @staticmethod
    def _scale(job: dict[str, Any]) -> dict[str, Any]:
        """The autoscaling/v1 Scale the API server serves for a job, read through the CRD's paths."""
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": job["metadata"]["name"]},
            "spec": {"replicas": _at(job, SCALE["specReplicasPath"])},
            "status": {
                "replicas": _at(job, SCALE["statusReplicasPath"]) or 0,
                "selector": _at(job, SCALE["labelSelectorPath"]) or "",
            },
        }


SCALE = crd_manifest()["spec"]["versions"][0]["subresources"]["scale"]


def _at(obj: dict[str, Any], path: str) -> Any:
    for key in path.lstrip(".").split("."):
        obj = (obj or {}).get(key)
    return obj


def _nested(path: str, value: Any) -> dict[str, Any]:
    for key in reversed(path.lstrip(".").split(".")):
        value = {key: value}
    return value


@contextlib.asynccontextmanager
async def emulator() -> AsyncIterator[Emulator]:
    async with Emulator() as handler, kmock.Server(handler):
        handler.creates, handler.refuse, handler.failing, handler.calls = [], {}, set(), set()
        handler.failing_writes = set()
        handler.unserved = set()
        handler.counts, handler.verbs = collections.Counter(), collections.Counter()
        handler.gates, handler.waiting, handler.stall = {}, asyncio.Event(), None
        declare(handler)
        yield handler


def declare(emulator: kmock.KubernetesEmulator) -> None:
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(
            **{**info, "verbs": info.get("verbs", {"get", "list", "watch", "patch", "create", "delete"})}
        )


class Api:
    """What `kubectl` and the Kubernetes controllers would do, over HTTP against the emulator."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")
        # A connection per call: a kept-alive one holds a server task open past the operator's
        # stop, which kopf then waits 5 s for (every task made after its start counts as its own).
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=10)
        )

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, self.base + path, json=body) as resp:
            text = await resp.text()
            assert resp.status < 400, f"{method} {path}: {resp.status} {text[:300]}"
            return json.loads(text) if text else None

    def _job_path(self, name: str = "") -> str:
        return f"/apis/pipelinerl.dev/v1alpha1/namespaces/{NS}/pipelinerljobs" + (f"/{name}" if name else "")

    async def create_job(self, manifest: dict[str, Any]) -> None:
        await self._call("POST", self._job_path(), manifest)

    async def patch_job(self, name: str, patch: dict[str, Any]) -> None:
        await self._call("PATCH", self._job_path(name), patch)

    async def patch_job_status(self, name: str, status: dict[str, Any]) -> None:
        """A write of the job's status by someone else: the other operator replica's pass."""
        await self._call("PATCH", self._job_path(name) + "/status", {"status": status})

    async def scale_job(self, name: str, replicas: int) -> None:
        """`kubectl scale prl/NAME --replicas=N`: a write to the scale subresource."""
        await self._call("PATCH", self._job_path(name) + "/scale", {"spec": {"replicas": replicas}})

    async def get_scale(self, name: str) -> dict[str, Any]:
        return await self._call("GET", self._job_path(name) + "/scale")

    async def delete_job(self, name: str) -> None:
        await self._call("DELETE", self._job_path(name))

    async def set_sts_status(self, name: str, replicas: int, ready: int, update_revision: str | None = None) -> None:
        path = f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}/status"
        revision = {"updateRevision": update_revision} if update_revision else {}
        await self._call("PATCH", path, {"status": {"replicas": replicas, "readyReplicas": ready, **revision}})

    async def create_pod(
        self, name: str, labels: dict[str, str], restarts: int, status: dict[str, Any] | None = None
    ) -> None:
        await self._call(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "labels": labels},
                "status": {"containerStatuses": [{"name": "trainer", "restartCount": restarts}], **(status or {})},
            },
        )

    async def create(self, path: str, body: dict[str, Any]) -> None:
        """Any object, as a user would create it (e.g. one whose name a job's child would take)."""
        await self._call("POST", path, body)

    async def patch_pod_restarts(self, name: str, restarts: int) -> None:
        await self._call(
            "PATCH",
            f"/api/v1/namespaces/{NS}/pods/{name}/status",
            {"status": {"containerStatuses": [{"name": "trainer", "restartCount": restarts}]}},
        )

    async def close(self) -> None:
        await self.session.close()


@contextlib.asynccontextmanager
async def running_operator(server_url: str, timeout_s: float = 10.0) -> AsyncIterator[None]:
    """Start the operator (namespaced to NS, as a per-team install) in this event loop; stop it after."""
    import pipelinerl_operator.handlers  # noqa: F401  (registers the handlers in kopf's default registry)

    os.environ["PIPELINERL_KUBE_SERVER"] = server_url
    os.environ["PIPELINERL_WATCH_NAMESPACES"] = NS
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            standalone=True,
            clusterwide=False,
            namespaces=[NS],
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout_s)
        yield
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout_s)
        except asyncio.TimeoutError:
            task.cancel()


async def collect_garbage(emulator: kmock.KubernetesEmulator, api: Api, owner_uid: str) -> None:
    """What the garbage collector does once an owner is gone (kmock has none): delete what it owned."""
    for (res, ns, name), o in list(emulator.objects.items()):
        if o.deleted:
            continue
        refs = (o.raw.get("metadata") or {}).get("ownerReferences") or []
        if any(r.get("uid") == owner_uid for r in refs):
            base = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
            await api._call("DELETE", f"{base}/namespaces/{ns}/{res.plural}/{name}")


async def eventually(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll `check` until it returns a truthy value (or stops raising AssertionError)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, KeyError, TypeError) as err:
            last = err
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {last!r}")
