"""What every part of the `PipelineRLJob` spec shares (pipelinerl/spec.py assembles the job from
its roles, `spec_roles`, and its other sections, `spec_sections`): the API's names, the bounds
values are held to, and the base model (strict, camelCase)."""

from __future__ import annotations

import difflib
import functools
import re
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel

from pipelinerl.contracts import reserved_env
from pipelinerl.k8s_types import DNS_1035_LABEL

API_GROUP = "pipelinerl.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "PipelineRLJob"

# The longest derived name, "<job>-prl-preprocessor", names a StatefulSet, whose pods carry the
# label controller-revision-hash "<statefulset>-<10-char hash>" (≤ 63): so 52 - 17 characters.
MAX_JOB_NAME = 35
# Integers are bounded as the API server bounds them (int64) and, where they feed libraries, as
# those do: seeds become numpy's and vLLM's (32 bits, with room for a seed per generator).
MAX_SEED = 2**31 - 1
MAX_STEPS = 10**9
MAX_SECONDS = 10**10
DNS_LABEL = re.compile(DNS_1035_LABEL)
TASK_NAMES = ("arith", "chain", "dataset", "guess", "math")  # pipelinerl.tasks.BUILTIN (a test keeps them equal)
# The models the package builds itself (pipelinerl.tiny_model): any other `builtin:` is refused.
BUILTIN_MODELS = ("builtin:tiny-arith", "builtin:tiny-chain", "builtin:tiny-random")
# A relative or ~ path names a folder by where a process runs and whose home it is: a pod's are its
# image's (/app, root), not the author's, and a run resumed from elsewhere would read another folder.
MODEL_PATH_PLACED = (
    "a relative or ~ path is read from wherever the services run (in a pod: the image's folder): give the model "
    "folder's absolute path, or a hub id"
)
TASK_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
GPU_RESOURCE = "nvidia.com/gpu"
# Fields a running job cannot change: the model, task and layout its checkpoints belong to, and
# the trainer's volume claim templates (a StatefulSet refuses changes to them).
# Where the job's streams are (nats.url) too: moved while it runs, the operator would lose them.
IMMUTABLE = ("mode", "model", "task", "trainer.replicas", "trainer.gpus", "trainer.zeroStage", "storage", "nats.url")
# Env names the operator sets itself; a user template may not override them.
RESERVED_ENV = reserved_env()


class NullsPruned(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _prune_nulls(cls, data: Any) -> Any:
        """A null where the field cannot be null is dropped, as the API server prunes it from a
        custom resource (its schema's field is not nullable): `env:` with nothing after it is
        the default, at every door."""
        if not isinstance(data, dict):
            return data
        refused, maps = _null_rules(cls)
        pruned = {k: v for k, v in data.items() if v is not None or k not in refused}
        return {k: _without_nulls(v) if k in maps else v for k, v in pruned.items()}


class SpecModel(NullsPruned):
    # strict: "4" is not 4, "yes" is not true (the API server refuses both; so do we). No
    # infinity or NaN: JSON has none, so no manifest sent to the API server holds one.
    # Manifests are parsed by alias only (`parse_mapping`): maxSteps, never max_steps.
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        strict=True,
        allow_inf_nan=False,
    )


def _without_nulls(value: Any) -> Any:
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _takes_null(annotation: Any) -> bool:
    return annotation is Any or type(None) in typing.get_args(annotation)


@functools.cache
def _null_rules(model: type[BaseModel]) -> tuple[frozenset[str], frozenset[str]]:
    """The aliases of `model`'s fields that take no null, and of its map fields whose values take
    none (`requests: {cpu: null}`: the API server prunes that entry too)."""
    refused, maps = set(), set()
    for name, field in model.model_fields.items():
        alias = field.alias or name
        if not _takes_null(field.annotation):
            refused.add(alias)
        for kind in (field.annotation, *typing.get_args(field.annotation)):
            if typing.get_origin(kind) is dict and not _takes_null(typing.get_args(kind)[1]):
                maps.add(alias)
    return frozenset(refused), frozenset(maps)


def closest(word: str, names: Iterable[str]) -> str | None:
    """The name `word` most likely misspells: close in spelling, or the same but for case and
    underscores (snake_case for camelCase); None where none is."""
    names = list(names)
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    folded = word.replace("_", "").lower()
    return close[0] if close else next((n for n in names if n.lower() == folded), None)
