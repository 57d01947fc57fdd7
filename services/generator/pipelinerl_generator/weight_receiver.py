"""vLLM worker extension: receive trainer weights in-flight.

Use with ``AsyncEngineArgs(worker_extension_cls=
"pipelinerl_generator.weight_receiver.WeightReceiverExtension")`` and drive it
from the engine side with ``collective_rpc`` (as ``Engine.update_weights`` does):

    await engine.collective_rpc("init_weight_group", args=(host, port, group, rank, world, timeout_s, backend, token))
    # staged (default): receive and load beside generation, pause only to swap
    await engine.collective_rpc("stage_weights", args=(buckets,))   # [False]: cannot stage
    while not all(await engine.collective_rpc("staged_weights_ready")): await asyncio.sleep(...)
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)  # running requests kept
    await engine.collective_rpc("commit_staged_weights")   # or receive_weights(buckets) unstaged
    await engine.update_weight_version(str(version))  # tags tokens sampled from now on
    await engine.resume_generation()

Only the bucket plan (plain lists/dicts) crosses collective_rpc; tensors come
over the dedicated weight group (pipelinerl.weight_group.WeightGroup).

vLLM mixes this class into its Worker (it appends it to the worker's bases),
so ``self`` is the worker: ``self.model_runner``, ``self.reload_weights`` exist.
Attribute names must not clash with Worker attributes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from types import MethodType
from typing import Any

import torch

from pipelinerl.weight_group import WeightGroup, WeightSyncError

logger = logging.getLogger(__name__)


class WeightReceiverExtension:
    _pipelinerl_weight_group: WeightGroup | None = None
    _pipelinerl_packed: list[torch.nn.Module] | None = None
    _pipelinerl_shadow: Shadow | None = None
    _pipelinerl_staging: Staging | None = None

    def init_weight_group(
        self,
        host: str,
        port: int,
        group: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str,
        token: str = "",
    ) -> None:
        """Join weight group `group` (a membership epoch), leaving the previous one."""
        # `rank` is this engine's first rank in the weight group; collective_rpc
        # sends the same args to every worker, so worker i of a TP/PP engine
        # (self.rank == i) takes rank + i. Every worker receives full tensors:
        # vLLM's loaders shard them. With NCCL, on this worker's GPU (vLLM has set it).
        # Blocks until the trainer lets the epoch's members connect (or calls it off:
        # GroupAborted).
        if self._pipelinerl_weight_group is not None:
            self._pipelinerl_weight_group.close()
            self._pipelinerl_weight_group = None
        self._pipelinerl_end_abandoned_staging(timeout_s)
        self._pipelinerl_weight_group = WeightGroup.join(
            host, port, group, rank + int(getattr(self, "rank", 0)), world_size, timeout_s, backend, token
        )

    def receive_weights(self, buckets: list[dict[str, Any]]) -> bool:
        """Receive and load into the live model: call while generation is paused. Every bucket
        arrives before any is loaded (into buffers kept anyway), so a transfer that fails (the
        trainer or another member died) returns False with the live weights untouched."""
        group = self._pipelinerl_group()
        try:
            weights = list(group.receive_buckets(buckets))
        except WeightSyncError as err:
            logger.warning("weights not received, the live ones are kept: %s", err)
            return False
        if self._pipelinerl_can_load_in_place():
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            self._pipelinerl_load_in_place(model, self._pipelinerl_packed_layers(model), weights)
        else:
            # Quantized models: vLLM's reload restores checkpoint-format params layer by
            # layer, loads, and re-runs process_weights_after_loading (re-quantizes).
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            self._pipelinerl_retie_lm_head()
        return True

    def _pipelinerl_group(self) -> WeightGroup:
        if self._pipelinerl_weight_group is None:
            raise RuntimeError("weights sent before init_weight_group")
        return self._pipelinerl_weight_group

    # -- staged updates: the transfer, load and re-pack run beside generation -------------------
    def stage_weights(self, buckets: list[dict[str, Any]]) -> bool:
        """Start receiving the next weights into a second copy of the model's parameters, on a
        thread, while the engine keeps generating with the current ones; `commit_staged_weights`
        swaps them in (a pause of pointer swaps). False, and nothing started, where this model
        cannot be loaded in place (quantized): then use `receive_weights` inside a pause."""
        if self._pipelinerl_staging is not None:
            raise RuntimeError("weights are already being staged")
        if not self._pipelinerl_can_load_in_place():
            return False
        group = self._pipelinerl_group()
        shadow = self._pipelinerl_shadow_model()

        def load() -> None:
            # A thread's CUDA device is its own: use the group's. The swap must find the copies done.
            with torch.cuda.device(group.device) if group.device.type == "cuda" else contextlib.nullcontext():
                self._pipelinerl_load_in_place(shadow.model, shadow.packed, group.receive_buckets(buckets))
                group.synchronize()

        self._pipelinerl_staging = Staging(load)
        return True

    def staged_weights_ready(self) -> bool:
        """True once the staged weights are loaded; raises what staging raised (the live
        weights are then untouched)."""
        staging = self._pipelinerl_staging
        if staging is None:
            raise RuntimeError("no weights are being staged")
        if staging.thread.is_alive():
            return False
        if staging.error is not None:
            self._pipelinerl_staging = None
            raise staging.error
        return True

    def _pipelinerl_end_abandoned_staging(self, timeout_s: float) -> None:
        """An update the engine gave up on (its deadline passed: WeightsKept) may still be
        receiving from the group just closed. Its thread ends with that group (a failed receive)
        or at the group's collective timeout; wait for it, so the next update can stage."""
        staging = self._pipelinerl_staging
        if staging is None:
            return
        staging.thread.join(timeout_s)
        if staging.thread.is_alive():
            raise TimeoutError(f"an abandoned weight update still receives after {timeout_s:.0f} s")
        self._pipelinerl_staging = None

    def commit_staged_weights(self) -> None:
        """Swap the staged weights in. Call while generation is paused: the next engine step
        uses them. The previous weights become the second copy, the next update's target."""
        if not self.staged_weights_ready():
            raise RuntimeError("commit_staged_weights called before the staged weights were loaded")
        self._pipelinerl_staging = None
        self._pipelinerl_shadow.swap()  # type: ignore[union-attr]

    def _pipelinerl_shadow_model(self) -> Shadow:
        if self._pipelinerl_shadow is None:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            self._pipelinerl_shadow = Shadow(model, self._pipelinerl_packed_layers(model))
        return self._pipelinerl_shadow

    def _pipelinerl_can_load_in_place(self) -> bool:
        # Not for quantized weights, nor for CPU conv weights that vLLM re-lays out in place.
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return (
            self.model_runner.model_config.quantization is None  # type: ignore[attr-defined]
            and not any(hasattr(m, "_cpu_unpacked_conv_weight") for m in model.modules())
        )

    def _pipelinerl_load_in_place(self, model: torch.nn.Module, packed: list[torch.nn.Module], weights) -> None:
        """Unquantized models: copy into `model`'s parameters (the live model, or its second
        copy when staged) with the model's own loaders (they stack q/k/v and gate/up and shard
        for TP), then redo only the CPU GEMM packing of `packed`, its packed layers.

        This is one copy plus the packing, where vLLM's layerwise reload re-creates every layer
        (fresh, page-faulted allocations) and copies twice: 1.5-2x faster on CPU. On GPU, unquantized
        weights need no processing, so it is the copy alone."""
        from vllm.config import set_current_vllm_config

        expected = {name for name, _ in model.named_parameters()}
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            loaded = model.load_weights(weights)  # type: ignore[operator]  # vLLM's models have it, nn.Module not
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


class Staging:
    """A staged update running on its own thread; keeps what it raised."""

    def __init__(self, work) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="pipelinerl-stage-weights", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - handed to the engine by staged_weights_ready
            self.error = err


class Shadow:
    """A second copy of a model's parameters, as a shallow copy of its module tree: each module
    copied with its own parameters (same class and loader attributes, bound loaders re-bound to
    the copy) and everything else shared. The model's own `load_weights` runs on it unchanged
    while the live model generates; `swap` exchanges parameter storage and packed CPU GEMMs.
    Costs one more copy of the weights (and of the packed GEMMs on CPU) in memory."""

    def __init__(self, model: torch.nn.Module, packed: list[torch.nn.Module]) -> None:
        modules: dict[int, torch.nn.Module] = {}
        params: dict[int, torch.nn.Parameter] = {}
        self.model = _shadow_module(model, modules, params)
        self.packed = [modules[id(layer)] for layer in packed]
        self.pairs = [(live, params[id(live)]) for live in model.parameters()]
        self.packed_pairs = list(zip(packed, self.packed))

    def swap(self) -> None:
        with torch.no_grad():
            for live, other in self.pairs:
                live.data, other.data = other.data, live.data
        for layer, twin in self.packed_pairs:
            layer.cpu_linear, twin.cpu_linear = twin.cpu_linear, layer.cpu_linear


def _shadow_module(module: torch.nn.Module, modules: dict, params: dict) -> torch.nn.Module:
    if id(module) in modules:  # shared (tied) submodules stay shared
        return modules[id(module)]
    shadow = modules[id(module)] = copy.copy(module)
    shadow._parameters = {
        name: None if p is None else _shadow_param(p, module, shadow, params) for name, p in module._parameters.items()
    }
    shadow._buffers = dict(module._buffers)  # shared tensors: buffers are not in checkpoints
    shadow._modules = {
        name: None if child is None else _shadow_module(child, modules, params)
        for name, child in module._modules.items()
    }
    return shadow


def _shadow_param(
    p: torch.nn.Parameter, owner: torch.nn.Module, shadow: torch.nn.Module, params: dict
) -> torch.nn.Parameter:
    if id(p) not in params:
        # Uninitialised: every staged load must cover every parameter before a swap (checked).
        twin = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
        twin.__class__ = p.__class__
        twin.__dict__ = {
            key: value.__func__.__get__(shadow) if isinstance(value, MethodType) and value.__self__ is owner else value
            for key, value in p.__dict__.items()
        }
        params[id(p)] = twin
    return params[id(p)]
