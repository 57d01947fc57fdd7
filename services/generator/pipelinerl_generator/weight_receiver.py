"""vLLM worker extension: receive trainer weights in-flight.

Use with ``AsyncEngineArgs(worker_extension_cls=
"pipelinerl_generator.weight_receiver.WeightReceiverExtension")`` and drive it
from the engine side with ``collective_rpc`` (as ``Engine.update_weights`` does):

    await engine.collective_rpc("init_weight_group", args=(host, port, rank, world, timeout_s))
    await engine.pause_generation(mode="keep", clear_cache=False)
    await engine.collective_rpc("receive_weights", args=(buckets,))
    await engine.update_weight_version(str(version))  # tags tokens sampled from now on
    await engine.resume_generation()

Only the bucket plan (plain lists/dicts) crosses collective_rpc; tensors come
over the dedicated weight group (pipelinerl.weight_group.WeightGroup).

vLLM mixes this class into its Worker (it appends it to the worker's bases),
so ``self`` is the worker: ``self.model_runner``, ``self.reload_weights`` exist.
Attribute names must not clash with Worker attributes.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelinerl.weight_group import WeightGroup


class WeightReceiverExtension:
    _pipelinerl_weight_group: WeightGroup | None = None
    _pipelinerl_packed: list[torch.nn.Module] | None = None

    def init_weight_group(self, host: str, port: int, rank: int, world_size: int,
                          timeout_s: float) -> None:
        # `rank` is this engine's first rank in the weight group; collective_rpc
        # sends the same args to every worker, so worker i of a TP/PP engine
        # (self.rank == i) takes rank + i. Every worker receives full tensors:
        # vLLM's loaders shard them.
        # Blocks until the trainer (TCPStore master, rank 0) and all other
        # ranks have joined: the trainer must create its side concurrently.
        # On GPUs pass backend="nccl" once that branch exists in make_group.
        self._pipelinerl_weight_group = WeightGroup.create(
            host, port, rank + int(getattr(self, "rank", 0)), world_size, timeout_s,
            is_master=False, backend="gloo",
        )

    def receive_weights(self, buckets: list[dict[str, Any]]) -> None:
        group = self._pipelinerl_weight_group
        if group is None:
            raise RuntimeError("receive_weights called before init_weight_group")
        # Received bucket by bucket as the loader consumes the iterator.
        weights = group.receive_buckets(buckets)
        if self._pipelinerl_can_load_in_place():
            self._pipelinerl_load_in_place(weights)
        else:
            # Quantized models: vLLM's reload restores checkpoint-format params layer by
            # layer, loads, and re-runs process_weights_after_loading (re-quantizes).
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
            self._pipelinerl_retie_lm_head()

    def _pipelinerl_can_load_in_place(self) -> bool:
        # Not for quantized weights, nor for CPU conv weights that vLLM re-lays out in place.
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return (self.model_runner.model_config.quantization is None  # type: ignore[attr-defined]
                and not any(hasattr(m, "_cpu_unpacked_conv_weight") for m in model.modules()))

    def _pipelinerl_load_in_place(self, weights) -> None:
        """Unquantized models: copy into the live parameters with the model's own loaders
        (they stack q/k/v and gate/up and shard for TP), then redo only the CPU GEMM packing.

        This is one copy plus the packing, where vLLM's layerwise reload re-creates every layer
        (fresh, page-faulted allocations) and copies twice: 1.5-2x faster on CPU. On GPU, unquantized
        weights need no processing, so it is the copy alone."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = self._pipelinerl_packed_layers(model)
        expected = {name for name, _ in model.named_parameters()}
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            loaded = model.load_weights(weights)
            missing = expected - set(loaded or ())
            if missing:  # a kept weight would otherwise keep stale (or, before any load, unset) values
                raise RuntimeError(f"weight update did not cover {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
            for layer in packed:
                _repack_cpu_gemm(layer)

    def _pipelinerl_packed_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Layers with a CPU GEMM packed from their weight (none on GPU), computed once.

        The CPU build drops a linear layer's weight after packing it; the first call gives each
        such layer its checkpoint-format weight back (from the metadata vLLM records for reloads,
        weight_loader attributes included), kept from then on as the target of in-place loads:
        one extra copy of the linear weights in host memory."""
        if self._pipelinerl_packed is not None:
            return self._pipelinerl_packed
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        packed = []
        for layer in model.modules():
            if not callable(getattr(layer, "cpu_linear", None)) or getattr(layer, "_cpu_skip_gemm_dispatch", False):
                continue
            weight = getattr(layer, "weight", None)
            if weight is not None and weight.numel() == 0:
                meta = get_layerwise_info(layer).restore_metadata[0].get("weight")
                if meta is None:
                    raise RuntimeError(f"no reload metadata for {type(layer).__name__}.weight")
                with torch.device(weight.device):  # materialize copies the attributes; re-bind them
                    layer.weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
            packed.append(layer)
        self._pipelinerl_packed = packed
        return packed

    def close_weight_group(self) -> None:
        if self._pipelinerl_weight_group is not None:
            self._pipelinerl_weight_group.close()
            self._pipelinerl_weight_group = None

    def _pipelinerl_retie_lm_head(self) -> None:
        # With tie_word_embeddings the checkpoint has no lm_head.weight, so the
        # reload never "loads" lm_head: it gets its old kernel tensors back and,
        # on CPU, keeps its old pre-packed GEMM closure (layer.cpu_linear) ->
        # logits from stale weights. Re-tie and re-pack from the new embedding.
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        if not getattr(hf_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or lm_head is embed or not hasattr(lm_head, "weight"):
            return
        lm_head.weight = embed.weight
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            with torch.no_grad():
                _repack_cpu_gemm(lm_head)


def _repack_cpu_gemm(layer: torch.nn.Module) -> None:
    """Rebuild a layer's packed CPU GEMM from its (kept, freshly loaded) weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
