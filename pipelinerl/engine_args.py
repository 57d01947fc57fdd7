"""`generator.engineArgs` checked against vLLM's own argument list, without importing vLLM.

The operator image has no vLLM, and importing it costs ~10 s, so the names and types of
`AsyncEngineArgs` are kept in `engine_args.json`, generated from the installed vLLM:

    python -m pipelinerl.engine_args > pipelinerl/engine_args.json

`tests/unit/test_engine_args.py` fails when the file and the installed vLLM disagree.
"""

from __future__ import annotations

import difflib
import functools
import json
import types
import typing
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("engine_args.json")

# Arguments PipelineRL sets from the spec (or itself): setting them twice would contradict it.
# An engine is generator.tensorParallel workers, one weight-group rank each: workers beyond them
# (pipeline stages, prefill-context or data-parallel ranks) would take another engine's ranks.
_ONE_ENGINE = "an engine spans generator.tensorParallel GPUs; more engines: generator.replicas"
OWNED = {
    "model": "set model.path",
    "dtype": "set model.dtype",
    "max_model_len": "set model.maxSeqLen",
    "tensor_parallel_size": "set generator.tensorParallel",
    "pipeline_parallel_size": _ONE_ENGINE,
    "prefill_context_parallel_size": _ONE_ENGINE,
    "data_parallel_size": _ONE_ENGINE,
    "seed": "PipelineRL seeds each generator from task.seed",
    "worker_extension_cls": "PipelineRL's weight-update extension must stay loaded",
    # vLLM then sizes its KV cache by these alone, ignoring gpu_memory_utilization, which the
    # generator's memory plan sets so that the weight update's buffers fit beside the engine.
    "kv_cache_memory_bytes": "the memory plan budgets vLLM by gpu_memory_utilization",
    "num_gpu_blocks_override": "the memory plan budgets vLLM by gpu_memory_utilization",
    "logprobs_mode": "the trainer's importance ratios need the sampling policy's own log-probs (processed_logprobs)",
}
# Arguments whose feature in-flight updates cannot keep, refused where switched on (vLLM's
# loaders place experts by its initial expert map).
UNSUPPORTED = {
    "enable_eplb": "expert-load balancing moves experts between slots as the engine runs, and a weight update "
    "loads each expert into the slot it started in: the updates would write the wrong experts",
}


def _describe(tp: Any) -> tuple[set[str], list[Any] | None]:
    """A type annotation → (the JSON kinds it accepts, its allowed values when it is an enum of literals)."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return {"null"}, None
    if origin is typing.Literal:
        values = list(typing.get_args(tp))
        return set().union(*(_describe(type(v))[0] for v in values)), values
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(arg) for arg in typing.get_args(tp)]
        kinds = set().union(*(k for k, _ in parts))
        literal = [(k, e) for k, e in parts if k != {"null"}]
        enum = [v for _, e in literal for v in e or ()] if all(e is not None for _, e in literal) else None
        return kinds, enum
    base = origin or tp
    if base is bool:
        return {"bool"}, None
    if base is int:
        return {"int"}, None
    if base is float:
        return {"int", "float"}, None
    if base is str:
        return {"str"}, None
    if base in (list, set, tuple, frozenset):
        return {"list"}, None
    if base is dict:
        return {"dict"}, None
    return {"any"}, None  # config objects, enums, callables: vLLM parses these from plain values itself


def table_from_vllm() -> dict[str, Any]:
    import dataclasses

    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = {}
    for field in dataclasses.fields(AsyncEngineArgs):
        if field.name.startswith("_"):
            continue
        kinds, enum = _describe(field.type)
        args[field.name] = {"kinds": sorted(kinds), **({"enum": enum} if enum is not None else {})}
    return {"vllm": vllm.__version__, "args": args}


@functools.cache
def table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, python in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list), ("dict", dict)):
        if isinstance(value, python):
            return kind
    return type(value).__name__


def engine_arg_errors(engine_args: dict[str, Any]) -> list[str]:
    """One message per argument vLLM would refuse or PipelineRL already sets, naming it."""
    known = table()["args"]
    errors = []
    overrides = engine_args.get("hf_overrides") or {}  # the generator adds head_dtype to them
    if not isinstance(overrides, dict):
        errors.append(f"engineArgs.hf_overrides: expected dict, got {_kind(overrides)} {overrides!r}")
    elif "head_dtype" in overrides:
        errors.append(
            "engineArgs.hf_overrides.head_dtype: set by PipelineRL (the LM head runs in fp32, as the trainer's)"
        )
    for name, value in engine_args.items():
        if name in OWNED:
            errors.append(f"engineArgs.{name}: set by PipelineRL ({OWNED[name]})")
            continue
        if name in UNSUPPORTED and value is True:
            errors.append(f"engineArgs.{name}: not with in-flight weight updates ({UNSUPPORTED[name]})")
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            errors.append(f"engineArgs.{name}: not an argument of vLLM {table()['vllm']}{hint}")
            continue
        kinds, enum = set(known[name]["kinds"]), known[name].get("enum")
        kind = _kind(value)
        if "any" in kinds:
            continue
        if kind not in kinds and not (kind == "int" and "float" in kinds):
            errors.append(f"engineArgs.{name}: expected {' or '.join(sorted(kinds))}, got {kind} {value!r}")
        elif enum is not None and value is not None and value not in enum:
            errors.append(f"engineArgs.{name}: must be one of {', '.join(map(str, enum))}; got {value!r}")
    return errors


if __name__ == "__main__":
    print(json.dumps(table_from_vllm(), indent=1, sort_keys=True))
