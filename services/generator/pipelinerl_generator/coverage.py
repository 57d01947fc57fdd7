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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
WRITES = {_aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


class WriteCounter(TorchDispatchMode):
    """Elements written (copied in, filled) into each of `params`' storage while active. Each op
    under it pays a Python call: a load is a few ops per tensor (tens of thousands for a large
    MoE's per-expert loaders, about a second)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = {name: p for name, p in params.items() if p.numel() > 0}
        self._by_storage = {p.untyped_storage().data_ptr(): name for name, p in self.params.items()}
        self.written = dict.fromkeys(self.params, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in WRITES and isinstance(args[0], torch.Tensor):
            name = self._by_storage.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.written[name] += args[0].numel()
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


def reload_uncovered(model: torch.nn.Module, tied_head: bool) -> list[str]:
    """During vLLM's layerwise reload, once its loaders have taken the update (before
    `finalize_layerwise_reload`): the layers with parameters whose weights did not all come.
    A layer all of whose elements came has been processed already, and left the count. Left out:
    layers of buffers alone (rotary caches, attention scales: not in a checkpoint), attention
    layers (vLLM finalises them at the end, with their optional scales), a tied LM head (the
    receiver ties it to the embedding afterwards) and a vocabulary embedding's padding rows
    (its one tensor came, or nothing did)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    head = getattr(model, "lm_head", None) if tied_head else None
    out = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or not layer._parameters or layer is head:
            continue
        if is_deferred_attention_layer(layer):
            continue
        loaded, total = info.load_numel, info.load_numel_total or 0
        if loaded == 0 or (loaded < total and not isinstance(layer, VocabParallelEmbedding)):
            out.append(f"{name} ({loaded} of {total} elements)")
    return out


def not_covered(uncovered: list[str]) -> RuntimeError:
    return RuntimeError(f"weight update did not cover {len(uncovered)} weights, e.g. {', '.join(uncovered[:3])}")
