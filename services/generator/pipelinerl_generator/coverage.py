"""Whether a weight update wrote every weight of the engine, element by element.

A parameter the update's tensors do not fill keeps what it held: the previous version's values
under the new version's label (loaded in place), or uninitialised memory (vLLM's layerwise reload
materialises a layer from its metadata with `torch.empty` and processes it at the end whatever
was loaded). vLLM only logs the parameters no tensor named, and never a stacked one (q/k/v into
qkv_proj, gate/up into gate_up_proj) that only some of its shards reached: its loader reports the
name as loaded at the first shard. So coverage is counted in elements written:

- in place (the live weights or the staging copy): every write into a parameter's storage during
  the load (`WriteCounter`; the loaders copy shards in and zero padding rows);
- reload: vLLM's own per-layer count of the elements its loaders took (`reload_uncovered`),
  read before its finalisation processes the incomplete layers.
"""

from __future__ import annotations

import bisect

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
WRITES = {_aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


def not_loaded_names() -> set[str]:
    """Parameter names vLLM never loads from a checkpoint (`SKIP_LOAD_TENSORS`: expert maps, a
    router's `e_score_correction_bias`, a buffer in Hugging Face's model, so never sent)."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return set(SKIP_LOAD_TENSORS)


class WriteCounter(TorchDispatchMode):
    """Elements written (copied in, filled) into each of `params` while active, each write
    credited to the parameter whose memory it falls in (parameters may share one buffer). A
    dispatch mode is the thread's own: the engine's steps on another thread (a staged update
    loads beside them) do not pass through it. Each op under it pays a Python call: a load is a
    few ops per tensor (tens of thousands for a large MoE's per-expert loaders, about a second)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        skip = not_loaded_names()
        self.params = {n: p for n, p in params.items() if p.numel() > 0 and n.rsplit(".", 1)[-1] not in skip}
        self._spans = sorted(
            (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), n) for n, p in self.params.items()
        )
        self.written = dict.fromkeys(self.params, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in WRITES and isinstance(args[0], torch.Tensor):
            at = args[0].data_ptr()
            i = bisect.bisect_right(self._spans, at, key=lambda span: span[0]) - 1
            if i >= 0 and at < self._spans[i][1]:
                self.written[self._spans[i][2]] += args[0].numel()
        return func(*args, **(kwargs or {}))

    def uncovered(self) -> list[str]:
        """The parameters written in part or not at all, each with its count (of the elements
        its loader fills: padding a layer declares, `weight_loader_numel`, left out, as vLLM does)."""
        out = []
        for name, p in self.params.items():
            due = getattr(p, "weight_loader_numel", p.numel())
            if self.written[name] < due:
                out.append(f"{name} ({self.written[name]} of {due} elements)")
        return out


def missing_expert_shards(arrived: set[tuple[int, str]], experts: int, shards: tuple[str, ...]) -> list[str]:
    """The (expert, shard) weights of an MoE layer no loader call brought, as `expert/shard`."""
    return [f"{e}/{s}" for e in range(experts) for s in shards if (e, s) not in arrived]


def reload_uncovered(model: torch.nn.Module, tied_head: bool) -> list[str]:
    """During vLLM's layerwise reload, once its loaders have taken the update (before
    `finalize_layerwise_reload`): the layers with parameters whose weights did not all come.
    A layer all of whose elements came has been processed already, and left the count. Left out:
    layers of buffers alone (rotary caches, attention scales: not in a checkpoint), attention
    layers (vLLM finalises them at the end, with their optional scales), a tied LM head (the
    receiver ties it to the embedding afterwards), a vocabulary embedding's padding rows (its one
    tensor came, or nothing did). An MoE layer short of its count (an online-quantized one pads
    its sizes, undeclared) is complete where every expert's every shard came (its loader calls)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not any(p is not None for p in layer._parameters.values()):
            continue
        if is_deferred_attention_layer(layer) or (tied_head and isinstance(layer, ParallelLMHead)):
            continue
        loaded, total = info.load_numel, info.load_numel_total or 0
        if loaded > 0 and isinstance(layer, VocabParallelEmbedding):
            continue
        moe = getattr(layer, "moe_config", None)
        if loaded > 0 and moe is not None:
            calls = [args.arguments for _, args in info.loaded_weights]
            arrived = {(a["expert_id"], a["shard_id"]) for a in calls if "expert_id" in a and "shard_id" in a}
            # gated: gate (w1), down (w2), up (w3); otherwise the shards any expert took
            shards = ("w1", "w2", "w3") if moe.is_act_and_mul else tuple(sorted({s for _, s in arrived}))
            missing = missing_expert_shards(arrived, moe.num_logical_experts, shards)
            if missing:
                out.append(f"{name} (experts' weights missing: {', '.join(missing[:4])})")
            continue
        out.append(f"{name} ({loaded} of {total} elements)")
    return out


def not_covered(uncovered: list[str]) -> RuntimeError:
    return RuntimeError(f"weight update did not cover {len(uncovered)} weights, e.g. {', '.join(uncovered[:3])}")
