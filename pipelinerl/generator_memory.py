"""A generator GPU's memory, planned from the manifest (pure: no torch, no vLLM).

vLLM takes `gpu_memory_utilization` of the device for the weights, its working memory and the
KV cache (it refuses to start unless that much is free, then fills what its profile leaves
with KV cache). Everything an in-flight weight update allocates later comes out of the rest:
the staging copy (one copy of this worker's weights: `weightSync.staged`) or, for a model vLLM
quantizes online (`engineArgs.quantization`: the layerwise reload, which cannot stage), the
reload's buffers; the receive ring (`weight_group.RECEIVE_RING` buffers of the largest bucket),
the NCCL weight group's buffers;
the CUDA context sits there too, and at tensorParallel > 1 vLLM's own tensor-parallel
communicator (made before vLLM measures what it may use, so outside its budget as well). `plan`
puts each in its place and says whether it fits; `validate`, the webhook and `plan` show it, and
the generator checks it again at its start with the device's real size and the model's own
config (and sets the utilization where the job leaves it unset).

Estimates are marked as such: vLLM's working memory (activations at its token budget, CUDA
graphs), the CUDA context and NCCL's buffers are not measured here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
RECEIVE_RING = 2  # pipelinerl.weight_group.RECEIVE_RING (kept in step by a test)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_DEFAULT_UTILIZATION = 0.92  # vllm/config/cache.py
CONTEXT_BYTES = 1 * GiB  # estimate: the CUDA context and torch's own, outside vLLM's budget
NCCL_BYTES = 256 * MiB  # estimate: one NCCL communicator's buffers (channels x NCCL_BUFFSIZE)
GRAPHS_BYTES = 1 * GiB  # estimate: vLLM's CUDA graph pool (its log prints the real figure)
BATCH_TOKENS = 16384  # vLLM's default token budget per step on a large GPU: sets its activation peak
MAX_SEQS = 256  # vLLM's default running sequences: fp32 logits for each

# Public config.json values of common RL base models (their Hugging Face model cards), for plans
# made where the weights are not (a manifest naming /models/Qwen2.5-7B-Instruct on a volume).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2"),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2"),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2"),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2"),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, model_type="qwen2"),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, model_type="llama"),
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, model_type="llama"),
}  # fmt: skip

# A GPU's memory from its node labels: GPU feature discovery's `nvidia.com/gpu.memory` (MiB), else
# the product name (`nvidia.com/gpu.product`): the sizes the devices report, in MiB.
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MEMORY_MIB = {
    "H200": 143771, "H100-NVL": 95830, "H100": 81559, "A100-SXM4-80GB": 81920, "A100-PCIE-80GB": 81920,
    "A100-SXM4-40GB": 40960, "A100-PCIE-40GB": 40960, "L40S": 46068, "L4": 23034, "A10G": 23028,
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's sizes (Llama / Qwen2 / Mistral layout), from its config.json."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Raises ValueError saying what this estimate does not cover."""
        cfg = config.get("text_config") or config
        if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError("a mixture-of-experts model (its layout is not estimated here)")
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)} (not a dense decoder this estimate covers)")
        heads = cfg["num_attention_heads"]
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        )

    def params(self) -> int:
        """Parameters of the whole model, as a checkpoint holds them."""
        return self.worker_params(1)

    def worker_params(self, tp: int) -> int:
        """Parameters one of `tp` tensor-parallel workers holds in vLLM's layout: heads, MLP and
        vocabulary split `tp` ways; key/value heads too, each kept whole (replicated where there
        are fewer than `tp`)."""
        return sum(math.prod(shape) for _, shape in self.worker_tensors(tp))

    def worker_tensors(self, tp: int) -> list[tuple[str, tuple[int, ...]]]:
        """One worker's parameters, by vLLM's fused names (qkv_proj, gate_up_proj)."""
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d // tp, max(1, self.kv_heads // tp) * d
        inter, vocab = self.intermediate // tp, -(-self.vocab // tp)
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h))]
            out += [(p + "self_attn.qkv_proj.bias", (q + 2 * kv,))] if self.qkv_bias else []
            out += [(p + "self_attn.o_proj.weight", (h, q)), (p + "mlp.gate_up_proj.weight", (2 * inter, h))]
            out += [(p + "mlp.down_proj.weight", (h, inter))]
            out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (vocab, h)))
        return out

    def reload_peak(self, tp: int) -> int:
        """Elements vLLM's layerwise reload holds beside the live weights at its peak, at the
        largest layer: the layer's tensors as received (whole, each cloned by the receiver until
        the layer is complete) and the layer materialised in this worker's shard."""
        whole = dict(self.worker_tensors(1))
        return max(math.prod(whole[name]) + math.prod(shape) for name, shape in self.worker_tensors(tp))

    def largest_tensor(self) -> int:
        """Elements of the largest tensor the trainer sends (whole, unsharded): the embedding."""
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes


def known_config(model_path: str) -> dict[str, Any] | None:
    """The config of a model KNOWN_MODELS lists, recognised by its folder or hub name
    (`/models/Qwen2.5-7B-Instruct`, `Qwen/Qwen2.5-7B`)."""
    name = PurePosixPath(model_path.rstrip("/")).name.lower()
    return next((cfg for key, cfg in KNOWN_MODELS.items() if name == key or name.startswith(key + "-")), None)


def gpu_memory_from_labels(node_selector: dict[str, Any]) -> int | None:
    """Bytes of one GPU of the nodes a pod template selects, where its labels say."""
    memory = node_selector.get(GPU_MEMORY_LABEL)
    if isinstance(memory, str) and memory.isdigit():
        return int(memory) * MiB
    product = node_selector.get(GPU_PRODUCT_LABEL)
    if not isinstance(product, str):
        return None
    for name in sorted(GPU_MEMORY_MIB, key=len, reverse=True):  # the most specific name first
        if name.lower() in product.lower():
            return GPU_MEMORY_MIB[name] * MiB
    size = re.search(r"(\d+)GB", product, re.IGNORECASE)
    return int(size.group(1)) * 1000 * MiB if size else None


@dataclass
class MemoryPlan:
    """One generator GPU (one tensor-parallel worker): where each byte goes, and whether it fits."""

    gpu_bytes: int
    utilization: float  # of the device, vLLM's: explicit (engineArgs) or chosen (`fit_utilization`)
    explicit_utilization: bool
    weights: int
    staging: int
    reload: int  # vLLM's layerwise reload's buffers (a model quantized online); 0 where it stages
    receive: int
    nccl: int
    context: int
    working: int  # vLLM's activations at its token budget and its CUDA graphs (estimate)
    kv_per_token: int
    max_seq_len: int
    concurrent: int  # sequences the generator may run at once (maxInflightGroups x attempts)
    errors: list[str] = field(default_factory=list)

    @property
    def outside(self) -> int:
        """What must fit beside vLLM's budget."""
        return self.staging + self.reload + self.receive + self.nccl + self.context

    @property
    def kv_bytes(self) -> int:
        return int(self.utilization * self.gpu_bytes) - self.weights - self.working

    @property
    def kv_sequences(self) -> int:
        """Full-length sequences the KV cache holds at once."""
        return max(0, self.kv_bytes) // max(1, self.kv_per_token * self.max_seq_len)

    def lines(self) -> list[str]:
        g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        budget = int(self.utilization * self.gpu_bytes)
        how = "engineArgs.gpu_memory_utilization" if self.explicit_utilization else "set by PipelineRL"
        return [
            f"generator GPU memory ({g(self.gpu_bytes)} per GPU; estimates marked ~):",
            f"  vLLM's budget {g(budget)} (utilization {self.utilization:.2f}, {how}): weights {g(self.weights)}, "
            f"~working memory {g(self.working)}, KV cache {g(max(0, self.kv_bytes))} = {self.kv_sequences} sequences "
            f"of maxSeqLen {self.max_seq_len} (the generator may run {self.concurrent})",
            f"  outside it, {g(self.gpu_bytes - budget)}: "
            + (f"reload buffers {g(self.reload)}" if self.reload else f"staging copy {g(self.staging)}")
            + ", receive ring "
            f"{g(self.receive)}, ~NCCL {g(self.nccl)}, ~CUDA context {g(self.context)} = {g(self.outside)}",
        ]


def plan(
    shape: ModelShape,
    gpu_bytes: int,
    *,
    tp: int,
    dtype: str,
    staged: bool,
    nccl: bool,
    quantized: bool = False,
    bucket_mb: int,
    max_seq_len: int,
    concurrent: int,
    utilization: float | None,
) -> MemoryPlan:
    """The plan of one generator GPU; `utilization` None: the largest that leaves the update
    room (`fit_utilization`). `quantized`: vLLM quantizes the model online, so every update goes
    through its layerwise reload, with no staging copy (`weight_receiver.load_blockers`); the
    weights are counted unquantized (an upper bound). `errors` says, by field, why it cannot run."""
    size = DTYPE_BYTES[dtype]
    weights = shape.worker_params(tp) * size
    hidden, inter, vocab = shape.hidden, shape.intermediate // tp, -(-shape.vocab // tp)
    working = BATCH_TOKENS * (4 * hidden + 2 * inter) * size + 2 * MAX_SEQS * vocab * 4 + GRAPHS_BYTES
    p = MemoryPlan(
        gpu_bytes=gpu_bytes,
        utilization=0.0,
        explicit_utilization=utilization is not None,
        weights=weights,
        staging=weights if staged and not quantized else 0,
        reload=shape.reload_peak(tp) * size if quantized else 0,
        receive=RECEIVE_RING * max(bucket_mb * MiB, shape.largest_tensor() * size),
        nccl=NCCL_BYTES * (int(nccl) + int(tp > 1)),  # the weight group's; vLLM's tensor-parallel group's
        context=CONTEXT_BYTES,
        working=working,
        kv_per_token=shape.kv_bytes_per_token(tp, size),
        max_seq_len=max_seq_len,
        concurrent=concurrent,
    )
    p.utilization = utilization if utilization is not None else fit_utilization(gpu_bytes, p.outside)
    budget = int(p.utilization * gpu_bytes)
    if gpu_bytes - budget < p.outside:
        room = gpu_bytes - budget
        fix = f"at most {fit_utilization(gpu_bytes, p.outside):.2f}" if utilization is not None else "a larger GPU"
        p.errors.append(
            f"generator.engineArgs.gpu_memory_utilization ({p.utilization:.2f}) leaves {room / GiB:.1f} GiB of the "
            f"{gpu_bytes / GiB:.1f} GiB GPU outside vLLM's budget; in-flight weight updates need {p.outside / GiB:.1f} "
            f"GiB there ({'reload buffers' if quantized else 'staging copy'} {(p.reload + p.staging) / GiB:.1f}, "
            f"receive ring {p.receive / GiB:.1f}, NCCL and CUDA "
            f"context ~{(p.nccl + p.context) / GiB:.1f}): {room_fixes(fix, staged=not quantized)}"
        )
    elif p.kv_sequences < 1:
        p.errors.append(
            f"generator: the KV cache left in vLLM's budget ({max(0, p.kv_bytes) / GiB:.1f} GiB after weights "
            f"{weights / GiB:.1f} GiB and ~{working / GiB:.1f} GiB working memory) holds no sequence of "
            f"model.maxSeqLen {max_seq_len} ({p.kv_per_token * max_seq_len / GiB:.2f} GiB): more "
            "generator.tensorParallel, a larger GPU, or a smaller model.maxSeqLen"
        )
    return p


def room_fixes(first: str, staged: bool) -> str:
    """What leaves an update's buffers room beside vLLM: `first`, then the job's other levers."""
    staging = "weightSync.staged: false, " if staged else ""
    return f"{first}, {staging}a smaller weightSync.bucketMb, or more generator.tensorParallel"


def update_room_problem(free: int, total: int, utilization: float, staging: int, receive: int, nccl: int) -> str:
    """Whether an update's buffers fit in what a GPU has free once vLLM has started (its budget,
    `utilization` of `total`, taken): "" where they do, else why, by field, with the utilization
    that leaves them room. The generator's check at its start, for every model: `plan` estimates
    beforehand for the dense decoders it knows, and leaves vLLM its default where it knows none
    (a mixture of experts: the staging copy then met an out-of-memory error at its allocation)."""
    need = staging + receive + nccl
    if need <= free:
        return ""
    fit = math.floor((utilization - (need - free) / total) * 100) / 100
    return (
        f"generator.engineArgs.gpu_memory_utilization ({utilization:.2f}) leaves {free / GiB:.1f} GiB of this "
        f"{total / GiB:.1f} GiB GPU free once vLLM has started; in-flight weight updates need {need / GiB:.1f} GiB "
        f"there (staging copy {staging / GiB:.1f}, receive ring {receive / GiB:.1f}, NCCL ~{nccl / GiB:.1f}): "
        + room_fixes(f"at most {fit:.2f}", staged=staging > 0)
    )


def fit_utilization(gpu_bytes: int, outside: int) -> float:
    """The largest utilization (in hundredths, at most vLLM's default) that leaves `outside`."""
    return min(VLLM_DEFAULT_UTILIZATION, math.floor((gpu_bytes - outside) / gpu_bytes * 100) / 100)


def job_plan(
    spec: Any, config: dict[str, Any] | None = None, gpu_bytes: int | None = None
) -> tuple[MemoryPlan | None, str]:
    """The plan of a GPU job's generators (`spec`: a JobSpec), from what the manifest says: a model
    KNOWN_MODELS lists (or its `config`), a GPU its pod template's nodeSelector names (or
    `gpu_bytes`). (None, why not) where either is unknown; (None, "") for a CPU job."""
    gen = spec.generator
    if not gen.gpus:
        return None, ""
    config = config or known_config(spec.model.path)
    if config is None:
        return None, f"model.path {spec.model.path!r} is not a model the plan knows (pipelinerl.generator_memory)"
    try:
        shape = ModelShape.from_config(config)
    except ValueError as err:
        return None, f"model.path {spec.model.path!r}: {err}"
    if gpu_bytes is None:
        selector = ((gen.pod_template or {}).get("spec") or {}).get("nodeSelector") or {}
        gpu_bytes = gpu_memory_from_labels(selector if isinstance(selector, dict) else {})
    if gpu_bytes is None:
        return None, (
            f"no GPU memory known: generator.podTemplate.spec.nodeSelector names neither {GPU_MEMORY_LABEL} nor a "
            f"{GPU_PRODUCT_LABEL} the plan knows"
        )
    utilization = gen.engine_args.get("gpu_memory_utilization")
    return (
        plan(
            shape,
            gpu_bytes,
            tp=gen.tensor_parallel,
            dtype=spec.weights_dtype,
            staged=spec.weight_sync.staged,
            nccl=spec.weight_transport == "nccl",
            quantized=bool(gen.engine_args.get("quantization")),
            bucket_mb=spec.weight_sync.bucket_mb,
            max_seq_len=spec.model.max_seq_len,
            concurrent=gen.max_inflight_groups * spec.rl.attempts,
            utilization=float(utilization) if isinstance(utilization, (int, float)) else None,
        ),
        "",
    )
