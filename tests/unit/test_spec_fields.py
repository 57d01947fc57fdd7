"""Every field of the spec is read by some code path (a service, the operator, the local runner,
the planner, or a derived property of the spec), or it does not exist: a field that nothing
reads would be accepted from users and silently do nothing. Validators do not count as readers.

Read statically: a field counts as read where the code accesses it through its parent's name
(`weight_sync.backend`, `trainer.learning_rate`; role fields also through a role's `spec.`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pydantic import BaseModel

from pipelinerl.spec import JobSpec, RoleSpec

ROOT = Path(__file__).resolve().parents[2]
READERS = ("pipelinerl", "services", "operator")


def reader_code() -> str:
    texts = []
    for folder in READERS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name in ("spec.py", "crd.py"):
                continue
            texts.append(path.read_text())
    spec = (ROOT / "pipelinerl/spec.py").read_text()
    for node in ast.walk(ast.parse(spec)):  # derived properties read fields for their callers
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "property" for d in node.decorator_list):
            texts.append(ast.get_source_segment(spec, node))
    return "\n".join(texts)


def fields(model: type[BaseModel], path: tuple[str, ...] = ()):
    for name, info in model.model_fields.items():
        yield path + (name,)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from fields(info.annotation, path + (name,))


def unread(code: str) -> list[str]:
    out = []
    for path in fields(JobSpec):
        parents = {path[-2]} if len(path) > 1 else {"spec", "self"}  # self: the spec's derived properties
        if path[-1] in RoleSpec.model_fields:
            parents.add("spec")  # render: spec: RoleSpec = getattr(job.spec, role)
        if not re.search(rf"\b({'|'.join(parents)})\.{path[-1]}\b", code):
            out.append(".".join(path))
    return out


def test_every_spec_field_is_read():
    assert unread(reader_code()) == []


def test_the_check_finds_an_unread_field():
    code = reader_code()
    assert "weight_sync.backend" in unread(code.replace("weight_sync.backend", "weight_sync.elsewhere"))
    assert len(list(fields(JobSpec))) > 60  # the walk reaches nested models
