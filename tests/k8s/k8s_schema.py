"""What the API server does, done offline: with a CRD schema, structural defaulting, schema
validation (jsonschema over the OpenAPI v3.0 dialect) and CEL rules (cel-python, oldSelf included);
with a pod, the "restricted" Pod Security Standard's checks."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import celpy
import jsonschema


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Fill `default`s the way the API server does: for absent properties of present objects,
    recursively. A null where the schema has no `nullable` is absent (the server prunes it, or
    defaults it where there is a default: PruneNonNullableNullsWithoutDefaults, then Default)."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        values = schema["additionalProperties"]
        obj = {k: apply_defaults(values, v) for k, v in obj.items() if v is not None or values.get("nullable")}
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key in obj and obj[key] is None and not sub.get("nullable"):
                del obj[key]
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(sub, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def to_jsonschema(node: Any) -> Any:
    """OpenAPI v3.0 `nullable` → JSON-schema draft 4 (which shares the boolean exclusive bounds)."""
    if isinstance(node, list):
        return [to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-preserve-unknown-fields"):  # its declared fields typed, the rest kept
        out.pop("additionalProperties", None)
    elif node.get("type") == "object" and "properties" in node:
        out["additionalProperties"] = False  # the server would prune; we want to hear about typos
    return out


def schema_errors(schema: dict[str, Any], obj: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(to_jsonschema(schema))
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj))


_STRING = re.compile(r"'(?:[^'\\]|\\.)*'")
_ITERATION = re.compile(r"\b((?:self|oldSelf|[a-z])(?:\.\w+)*)\.(?:all|exists_one|exists|filter|map)\((\w+),")
_ACCESS = re.compile(r"\b(self|oldSelf|[a-z])(?=\.)((?:\.[A-Za-z_]\w*)+)(\s*\()?")


def undeclared_fields(node: dict[str, Any], rule: str, root: bool = False) -> list[str]:
    """The fields `rule` (on schema `node`) reads that the schema does not declare. The API
    server types a rule by the schema when the CRD is written: an object without declared
    properties (free-form, x-kubernetes-preserve-unknown-fields) has no field CEL may select, and
    the CRD is refused ("compilation failed: undefined field"). cel-python, untyped, runs them."""
    text = _STRING.sub("''", rule)
    scope: dict[str, dict[str, Any] | None] = {"self": node, "oldSelf": node}
    for m in _ITERATION.finditer(text):
        base, *names = m.group(1).split(".")
        target, _ = _select(scope.get(base), names, root and base in ("self", "oldSelf"))
        if target is not None:  # an array's items; a map's keys (strings)
            scope[m.group(2)] = target.get("items") if target.get("type") == "array" else {"type": "string"}
    missing = []
    for m in _ACCESS.finditer(text):
        base, chain, call = m.groups()
        names = chain[1:].split(".")[: -1 if call else None]  # a method's name is no field
        if base in scope and names:
            _, bad = _select(scope[base], names, root and base in ("self", "oldSelf"))
            if bad:
                missing.append(f"{base}.{bad}")
    return missing


def _select(node: dict[str, Any] | None, names: list[str], root: bool) -> tuple[dict[str, Any] | None, str]:
    """The schema node `names` select from `node`, or where the selection fails."""
    for i, name in enumerate(names):
        if node is None:
            return None, ""
        if root and i == 0 and name == "metadata":  # the server declares metadata.name and generateName
            ok = len(names) == 1 or names[1] in ("name", "generateName")
            return None, "" if ok else ".".join(names[:2])
        props = node.get("properties") or {}
        if name in props:
            node = props[name]
        elif isinstance(node.get("additionalProperties"), dict):  # a map: its values
            node = node["additionalProperties"]
        else:
            return None, ".".join(names[: i + 1])
    return node, ""


@functools.cache
def program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def all_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str, str]]:
    found = [(path, r["rule"], r["message"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        found += all_rules(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        found += all_rules(schema["items"], f"{path}[]")
    return found


def cel_errors(schema: dict[str, Any], new: Any, old: Any = None, path: str = "") -> list[str]:
    """Messages of the CEL rules that reject `new` (an update from `old` when given)."""
    errors = []
    rules = schema.get("x-kubernetes-validations", [])
    if rules:  # converted once for all of this node's rules (a subtree's conversion is its size)
        activation = {"self": celpy.json_to_cel(new)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
    for r in rules:
        if "oldSelf" in r["rule"] and old is None:
            continue  # transition rules only run on updates where the old value exists
        result = program(r["rule"]).evaluate(activation)
        if result is not True and result != celpy.celtypes.BoolType(True):
            errors.append(r["message"])
    if isinstance(new, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in new:
                old_sub = old.get(key) if isinstance(old, dict) else None
                errors += cel_errors(sub, new[key], old_sub, f"{path}.{key}")
    elif isinstance(new, list) and "items" in schema:
        for item in new:
            errors += cel_errors(schema["items"], item, None, f"{path}[]")
    return errors


def admit(
    crd: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Route, default, then validate: returns the stored object and every error the API server would
    report. CEL rules run only on objects of the schema's types (the API server stops at schema errors)."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    served = {f"{group}/{v['name']}" for v in crd["spec"]["versions"] if v["served"]}
    if obj.get("apiVersion") not in served or obj.get("kind") != kind:
        return obj, [f"apiVersion/kind: no matches for kind {obj.get('kind')!r} in version {obj.get('apiVersion')!r}"]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored = apply_defaults(schema, obj)
    old_stored = apply_defaults(schema, old) if old is not None else None
    return stored, schema_errors(schema, stored) or cel_errors(schema, stored, old_stored)


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict) -> list[str]:
    """What breaks the Kubernetes "restricted" Pod Security Standard (v1.33) in a pod spec."""
    out, psc = [], pod.get("securityContext") or {}
    out += [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    out += [
        f"volume {v['name']}: {t}"
        for v in pod.get("volumes", [])
        for t in v
        if t != "name" and t not in RESTRICTED_VOLUMES
    ]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, where = c.get("securityContext") or {}, f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities {caps}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
    return out
