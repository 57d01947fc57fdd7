"""A small async Kubernetes API client for the operator's own calls (kopf watches; we apply children).

It uses the very `kopf.ConnectionInfo` the operator logged in with, so kopf and this client
always talk to the same server with the same credentials. Every call has a timeout.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from pipelinerl_operator.names import FIELD_MANAGER

PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "StatefulSet": "statefulsets",
    "Pod": "pods",
    "PipelineRLJob": "pipelinerljobs",
    "Event": "events",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "ServiceAccount": "serviceaccounts",
    "PodGroup": "podgroups",
    "PersistentVolumeClaim": "persistentvolumeclaims",
}


def status_message(text: str) -> str:
    """The message of an API error: a `Status` object's `reason: message`, else the body's start."""
    try:
        status = json.loads(text)
        return f"{status.get('reason', '')}: {status['message']}".lstrip(": ")[:1000]
    except (ValueError, KeyError, TypeError, AttributeError):
        return text[:500]


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Conflict(KubeError):
    """409: the object was written since the version a write was made on condition of (a create:
    an object of that name exists)."""


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{PLURALS[kind]}"
    return f"{base}/{quote(name)}" if name else base


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    ctx = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
    cert, key = info.certificate_path, info.private_key_path
    with tempfile.TemporaryDirectory() as tmp:
        if info.certificate_data:  # ssl only loads client certs from files
            cert = f"{tmp}/cert.pem"
            with open(cert, "wb") as f:
                f.write(_pem(info.certificate_data))
        if info.private_key_data:
            key = f"{tmp}/key.pem"
            with open(key, "wb") as f:
                f.write(_pem(info.private_key_data))
        if cert:
            ctx.load_cert_chain(cert, key)
    return ctx


def _pem(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)


class Kube:
    def __init__(self, info: kopf.ConnectionInfo, timeout_s: float = 10.0):
        self._info = info
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        # Named in the API server's audit log as the operator (kopf's own calls say `kopf/<version>`).
        headers = {"User-Agent": FIELD_MANAGER}
        if self._info.token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
        return headers

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        if self._session is None or self._session.closed:
            auth = aiohttp.BasicAuth(self._info.username, self._info.password or "") if self._info.username else None
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                timeout=self._timeout,
                auth=auth,
                connector=aiohttp.TCPConnector(ssl=_ssl_context(self._info)),
            )
        headers = {**self._headers(), "Content-Type": content_type}
        data = json.dumps(body) if body is not None else None
        async with self._session.request(method, path.lstrip("/"), data=data, params=params, headers=headers) as resp:
            if resp.status == 404:
                return None
            text = await resp.text()
            if resp.status >= 400:
                raise (Conflict if resp.status == 409 else KubeError)(resp.status, status_message(text))
            return json.loads(text) if text else {}

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self._request("GET", object_path(api_version, kind, namespace, name))

    async def list(self, api_version: str, kind: str, namespace: str | None, selector: str) -> list[dict[str, Any]]:
        result = await self._request(
            "GET", object_path(api_version, kind, namespace), params={"labelSelector": selector}
        )
        return (result or {}).get("items", [])

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply (we own the fields we set, forcefully). The emulator used in tests
        cannot create by apply, so a 404 falls back to create; a real server never returns it."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        applied = await self._request(
            "PATCH",
            path,
            obj,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",  # JSON is valid YAML
        )
        if applied is None:
            created = await self._request(
                "POST", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj
            )
            if created is None:
                raise KubeError(404, _not_served(obj))
            return created
        return applied

    async def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set the object's spec.replicas alone (a merge patch: what else the operator applied stays)."""
        path = object_path(api_version, kind, namespace, name)
        body = {"spec": {"replicas": replicas}}
        await self._request("PATCH", path, body, content_type="application/merge-patch+json")

    async def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless an object of its name exists (then leave that one as it is)."""
        meta = obj["metadata"]
        try:
            made = await self._request("POST", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)
        except Conflict:  # AlreadyExists
            return False
        if made is None:
            raise KubeError(404, _not_served(obj))
        return True

    async def write_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any], version: str | None
    ) -> str | None:
        """Merge `patch` into the object's status (RFC 7396: a null removes a field), only while the
        object is still at resourceVersion `version` (None: whatever its version); else Conflict.
        Returns the version written (None: the object is gone)."""
        body: dict[str, Any] = {"status": patch}
        if version is not None:
            body["metadata"] = {"resourceVersion": version}
        path = object_path(api_version, kind, namespace, name) + "/status"
        written = await self._request("PATCH", path, body, content_type="application/merge-patch+json")
        return ((written or {}).get("metadata") or {}).get("resourceVersion")

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        return await self._request("DELETE", object_path(api_version, kind, namespace, name)) is not None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _not_served(obj: dict[str, Any]) -> str:
    """Why a create was answered 404: no such kind (a CRD not installed), or no such namespace."""
    where = obj["metadata"].get("namespace")
    return f"not found: the API server serves no {obj['kind']} ({obj['apiVersion']}; is its CRD installed?)" + (
        f" or has no namespace {where}" if where else ""
    )
