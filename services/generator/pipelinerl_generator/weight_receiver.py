"""vLLM worker extension: receive trainer weights in-flight.

Use with ``AsyncEngineArgs(worker_extension_cls=
"pipelinerl_generator.weight_receiver.WeightReceiverExtension")`` and drive it
from the engine side with ``collective_rpc``:

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
        # reload_weights (not model.load_weights): it restores checkpoint-format
        # params, loads, then re-runs process_weights_after_loading, which is
        # what re-packs CPU GEMM weights (and quantizes, on GPU). The iterator
        # receives buckets lazily, so peak extra memory is ~ one layer.
        self.reload_weights(weights_iterator=group.receive_buckets(buckets))  # type: ignore[attr-defined]
        self._pipelinerl_retie_lm_head()

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
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            with torch.no_grad():
                dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
