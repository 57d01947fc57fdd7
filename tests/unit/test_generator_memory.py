"""The generator GPU's memory plan (pipelinerl.generator_memory): model sizes from config.json,
GPU sizes from node labels, where each byte of a weight update goes, and the refusals by field."""

import math

import pytest

from pipelinerl import weight_group
from pipelinerl.generator_memory import (
    GiB,
    KNOWN_MODELS,
    MiB,
    RECEIVE_RING,
    NCCL_BYTES,
    ModelShape,
    fit_utilization,
    gpu_memory_from_labels,
    job_plan,
    known_config,
    plan,
    update_room_problem,
)
from pipelinerl.spec import SpecError, parse_job, read_manifest
from pipelinerl_operator.admission import check, job_warnings

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def gpu_job(generator=None, **spec):
    generator = {"gpus": 1, "podTemplate": {"spec": {"nodeSelector": H100}}} | (generator or {})
    body = {"model": {"path": "/models/Qwen2.5-7B-Instruct"}, "trainer": {"gpus": 1}, "generator": generator} | spec
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": "m"}, "spec": body}


def test_known_models_have_their_published_sizes():
    published = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.7,
                 "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6}  # fmt: skip
    for name, billions in published.items():
        assert ModelShape.from_config(KNOWN_MODELS[name]).params() / 1e9 == pytest.approx(billions, rel=0.01)
    assert known_config("/models/Qwen2.5-7B-Instruct") is KNOWN_MODELS["qwen2.5-7b"]
    assert known_config("Qwen/Qwen2.5-7B") is KNOWN_MODELS["qwen2.5-7b"]
    assert known_config("/models/Qwen2.5-72B") is KNOWN_MODELS["qwen2.5-72b"]  # not 7b's
    assert known_config("/models/Qwen2.5-Math-7B") is None


def test_a_worker_holds_its_share_with_kv_heads_whole():
    shape = ModelShape.from_config(KNOWN_MODELS["qwen2.5-7b"])  # 28 heads, 4 KV heads
    assert shape.worker_params(2) == pytest.approx(shape.params() / 2, rel=0.01)
    assert sum(math.prod(s) for _, s in shape.worker_tensors(2)) == shape.worker_params(2)
    assert shape.kv_bytes_per_token(8, 2) == 2 * 28 * 1 * 128 * 2  # 4 KV heads over 8 workers: each keeps one
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_config(KNOWN_MODELS["qwen2.5-7b"] | {"num_experts": 64})
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        ModelShape.from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 9})


def test_gpu_memory_from_node_labels():
    assert gpu_memory_from_labels({"nvidia.com/gpu.memory": "81559"}) == 81559 * MiB
    assert gpu_memory_from_labels(H100) == 81559 * MiB
    assert gpu_memory_from_labels({"nvidia.com/gpu.product": "NVIDIA-H100-NVL"}) == 95830 * MiB
    assert gpu_memory_from_labels({"nvidia.com/gpu.product": "NVIDIA-B200-180GB"}) == 180 * 1000 * MiB
    assert gpu_memory_from_labels({"nvidia.com/gpu.product": "Tesla-T4"}) is None
    assert gpu_memory_from_labels({}) is None


def test_the_receive_ring_is_the_weight_groups():
    assert RECEIVE_RING == weight_group.RECEIVE_RING


def test_the_gpu_example_fits_with_room_for_its_updates():
    """examples/gpu-qwen-math.yaml: Qwen2.5-7B in bf16, TP 2, utilization 0.85, 80 GB H100s."""
    job = parse_job(read_manifest("examples/gpu-qwen-math.yaml"))
    memory, why = job_plan(job.spec)
    assert why == "" and memory is not None and memory.errors == []
    assert memory.weights / GiB == pytest.approx(7.1, abs=0.1)  # half of 7.62B bf16 parameters
    assert memory.staging == memory.weights
    assert memory.receive == 2 * 152064 * 3584 * 2  # two buffers of the largest bucket: the embedding
    assert memory.nccl == 2 * NCCL_BYTES  # the weight group's communicator and vLLM's tensor-parallel one
    assert memory.outside / GiB == pytest.approx(10.6, abs=0.1)
    assert (memory.gpu_bytes - int(0.85 * memory.gpu_bytes)) / GiB == pytest.approx(11.9, abs=0.1)
    assert memory.kv_sequences >= 400


def test_a_utilization_that_leaves_no_room_is_refused_by_field():
    with pytest.raises(SpecError, match=r"spec.generator.engineArgs.gpu_memory_utilization \(0.90\).*at most 0.78"):
        check(gpu_job({"engineArgs": {"gpu_memory_utilization": 0.9}}))
    check(gpu_job({"engineArgs": {"gpu_memory_utilization": 0.9}}, weightSync={"staged": False}))  # no copy: fits
    check(gpu_job({"engineArgs": {"gpu_memory_utilization": 0.75}}))


def test_unset_utilization_is_the_largest_that_leaves_the_update_room():
    memory, _ = job_plan(parse_job(gpu_job()).spec)
    assert not memory.explicit_utilization
    assert memory.utilization == 0.78 == fit_utilization(memory.gpu_bytes, memory.outside)
    assert memory.gpu_bytes - int(memory.utilization * memory.gpu_bytes) >= memory.outside
    small, _ = job_plan(parse_job(gpu_job(model={"path": "/models/Qwen2.5-0.5B"})).spec)
    assert small.utilization == 0.92  # never above vLLM's own default


def test_a_model_no_plan_covers_is_refused_at_the_start_where_its_update_finds_no_room():
    """A mixture of experts is planned by none: vLLM keeps its default budget, and the staging copy
    met an out-of-memory error at its allocation. The generator measures what vLLM left free once
    started, and says by field what leaves the update room (the utilization, to the hundredth)."""
    total, free = 80 * GiB, 6 * GiB  # vLLM's 0.92 taken, the CUDA context beside it
    why = update_room_problem(free, total, 0.92, staging=28 * GiB, receive=512 * MiB, nccl=NCCL_BYTES)
    assert why.startswith("generator.engineArgs.gpu_memory_utilization (0.92) leaves 6.0 GiB of this 80.0 GiB GPU")
    assert (
        "need 28.8 GiB there (staging copy 28.0, receive ring 0.5, NCCL ~0.2): at most 0.63, weightSync.staged" in why
    )
    need = 28 * GiB + 512 * MiB + NCCL_BYTES  # at 0.63 vLLM leaves it room, at 0.64 it does not
    assert free + (0.92 - 0.64) * total < need <= free + (0.92 - 0.63) * total
    assert update_room_problem(free, total, 0.92, staging=0, receive=512 * MiB, nccl=NCCL_BYTES) == ""  # in place
    no_staging = update_room_problem(free, total, 0.92, staging=0, receive=8 * GiB, nccl=0)
    assert "weightSync.staged" not in no_staging and "a smaller weightSync.bucketMb" in no_staging


def test_a_model_too_large_for_its_gpus_is_refused():
    with pytest.raises(SpecError, match=r"spec.generator: the KV cache .* holds no sequence.*tensorParallel"):
        check(gpu_job(model={"path": "/models/Qwen2.5-72B-Instruct"}, weightSync={"staged": False}))
    shape = ModelShape.from_config(KNOWN_MODELS["qwen2.5-72b"])
    kw = dict(tp=1, dtype="bfloat16", staged=False, nccl=True, bucket_mb=1024, max_seq_len=4096, concurrent=1)
    assert plan(shape, 80 * GiB, utilization=0.9, **kw).errors
    assert plan(shape, 80 * GiB, utilization=0.9, **(kw | {"tp": 4})).errors == []


def test_a_plan_the_manifest_cannot_make_is_a_warning_not_a_refusal():
    unknown_model = parse_job(gpu_job(model={"path": "/models/my-own-7b"}))
    check(gpu_job(model={"path": "/models/my-own-7b"}))
    assert any("not planned here" in w and "my-own-7b" in w for w in job_warnings(unknown_model))
    no_selector = parse_job(gpu_job({"podTemplate": None}))
    assert any("nodeSelector" in w for w in job_warnings(no_selector))
    assert job_plan(parse_job(gpu_job({"gpus": 0}, trainer={"gpus": 0})).spec) == (None, "")  # a CPU job: no plan


def test_a_model_quantized_online_plans_the_reload_not_a_staging_copy():
    """vLLM quantizing online (engineArgs.quantization) takes every update through its layerwise
    reload: no staging copy, but the largest layer twice over beside the weights (its tensors as
    received, cloned whole; the layer materialised in the worker's shard)."""
    job = parse_job(gpu_job({"engineArgs": {"quantization": "fp8"}}))
    memory, _ = job_plan(job.spec)
    assert memory.staging == 0
    vocab, hidden = 152064, 3584  # Qwen2.5-7B's embedding (and untied head): its largest layer
    assert memory.reload == (vocab * hidden + vocab * hidden) * 2
    tp2 = ModelShape.from_config(KNOWN_MODELS["qwen2.5-7b"]).reload_peak(2)
    assert tp2 == vocab * hidden + vocab // 2 * hidden  # the received tensor whole, the worker's half
    assert any("reload buffers 2.0 GiB" in line for line in memory.lines())
    staged, _ = job_plan(parse_job(gpu_job()).spec)
    assert memory.outside < staged.outside and memory.reload < staged.staging  # 2 GiB against 15
    check(gpu_job({"engineArgs": {"quantization": "fp8", "gpu_memory_utilization": 0.92}}))
    with pytest.raises(SpecError, match="staging copy"):  # where a staging copy does not fit
        check(gpu_job({"engineArgs": {"gpu_memory_utilization": 0.92}}))
    with pytest.raises(SpecError, match=r"reload buffers 2\.0, .*at most 0\.92, a smaller weightSync"):
        check(gpu_job({"engineArgs": {"quantization": "fp8", "gpu_memory_utilization": 0.95}}))
