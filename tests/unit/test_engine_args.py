"""`generator.engineArgs` checked against vLLM's own argument list (pipelinerl/engine_args.json)."""

from __future__ import annotations

from typing import Literal, Optional, Union

import pytest

from pipelinerl.engine_args import _describe, engine_arg_errors, table, table_from_vllm


@pytest.mark.slow
def test_the_table_is_the_installed_vllms() -> None:
    assert table_from_vllm() == table(), "run: python -m pipelinerl.engine_args > pipelinerl/engine_args.json"


@pytest.mark.parametrize(
    "annotation, kinds, enum",
    [
        (bool, {"bool"}, None),
        (float, {"int", "float"}, None),
        (int | None, {"int", "null"}, None),
        (Optional[Literal["lazy", "eager"]], {"str", "null"}, ["lazy", "eager"]),
        (Union[Literal["auto", "hf"], str], {"str"}, None),  # any string goes
        (Literal[1, 8, 16], {"int"}, [1, 8, 16]),
        (list[int] | None, {"list", "null"}, None),
        (dict[str, int], {"dict"}, None),
        (type, {"any"}, None),  # config objects and enums: vLLM parses them itself
    ],
)
def test_annotations_become_kinds(annotation, kinds, enum) -> None:
    assert _describe(annotation) == (kinds, enum)


def test_errors_name_each_argument() -> None:
    assert (
        engine_arg_errors(
            {
                "max_num_seqs": 64,
                "gpu_memory_utilization": 1,
                "enforce_eager": True,
                "kv_cache_dtype": "fp8",
                "compilation_config": {"level": 3},
                "block_size": None,
            }
        )
        == []
    )
    errors = engine_arg_errors({"max_num_seq": 64, "enforce_eager": 1, "kv_cache_dtype": "fp7", "seed": 3})
    assert errors[0].startswith("engineArgs.max_num_seq: not an argument of vLLM") and "max_num_seqs" in errors[0]
    assert errors[1] == "engineArgs.enforce_eager: expected bool, got int 1"
    assert errors[2].startswith("engineArgs.kv_cache_dtype: must be one of auto, ")
    assert errors[3].startswith("engineArgs.seed: set by PipelineRL")


def test_workers_beyond_the_engines_tensor_parallel_ones_are_refused() -> None:
    """Each of an engine's workers takes a rank of the weight group (the engine's first plus its
    index in generator.tensorParallel): a pipeline, prefill-context or data-parallel worker would
    take another engine's rank."""
    for name in ("pipeline_parallel_size", "prefill_context_parallel_size", "data_parallel_size"):
        (error,) = engine_arg_errors({name: 2})
        assert error.startswith(f"engineArgs.{name}: set by PipelineRL") and "generator.tensorParallel" in error
    assert engine_arg_errors({"decode_context_parallel_size": 2}) == []  # within the tensor-parallel workers


def test_the_lm_heads_dtype_is_the_generators_own() -> None:
    """The generator adds head_dtype (fp32, as the trainer's head) to the job's hf_overrides."""
    assert engine_arg_errors({"hf_overrides": {"rope_theta": 5000.0}}) == []
    (error,) = engine_arg_errors({"hf_overrides": {"head_dtype": "bfloat16"}})
    assert error.startswith("engineArgs.hf_overrides.head_dtype: set by PipelineRL")
    assert engine_arg_errors({"hf_overrides": '{"rope_theta": 1}'}) == [
        "engineArgs.hf_overrides: expected dict, got str '{\"rope_theta\": 1}'"
    ]


def test_expert_load_balancing_is_refused_off_it_is_taken() -> None:
    """vLLM's weight loaders place each expert by its initial expert map; EPLB moves experts away
    from it as the engine runs, so an in-flight update would write the wrong experts."""
    (error,) = engine_arg_errors({"enable_eplb": True})
    assert error.startswith("engineArgs.enable_eplb: not with in-flight weight updates") and "wrong experts" in error
    assert engine_arg_errors({"enable_eplb": False}) == []
    assert engine_arg_errors({"enable_eplb": "false"}) == ["engineArgs.enable_eplb: expected bool, got str 'false'"]
