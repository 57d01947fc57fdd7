"""vLLM worker extension: receive trainer weights in-flight.

Use with ``AsyncEngineArgs(worker_extension_cls=
"pipelinerl_generator.weight_receiver.WeightReceiverExtension")`` and drive it
from the engine side with ``collective_rpc`` (as ``Engine.update_weights`` does):

    await engine.collective_rpc("prepare_weight_updates", args=(staged,))  # once: the loading path
    await engine.collective_rpc("init_weight_group", args=(host, port, group, rank, world, timeout_s, backend, token))
    while None in await engine.collective_rpc("weight_group_joined"): await asyncio.sleep(...)  # beside generation
    await engine.collective_rpc("accept_weight_group")
    # staged (default): receive and load into the staging copy beside generation
    await engine.collective_rpc("stage_weights", args=(buckets,))   # [False]: no staging copy
    while None in await engine.collective_rpc("staged_weights_ready"): await asyncio.sleep(...)  # "": done
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)  # running requests kept
    await engine.collective_rpc("commit_staged_weights")   # or receive_weights(buckets) inside the pause
    await engine.update_weight_version(str(version))  # tags tokens sampled from now on
    await engine.resume_generation()

Only the bucket plan (plain lists/dicts) crosses collective_rpc; tensors come
over the dedicated weight group (pipelinerl.weight_group.WeightGroup).

Whatever the path, the live parameters keep their storage: a GPU engine's CUDA graphs replay
the addresses they captured (staging.py). Three loading paths, chosen once per engine:
- staged (weightSync.staged, unquantized models whose weights need no post-load processing):
  every update loads into the staging copy, then `commit` copies it into the live weights. A
  transfer that fails leaves the live weights untouched.
- in place (staged: false): loaded straight into the live weights inside the pause: no second
  copy, but a transfer that fails after the first bucket leaves them half-loaded (the generator
  then stops and is restarted).
- reload (quantized, MoE kernels that re-lay their weights out, MLA, attention sinks:
  `load_blockers`): vLLM's layerwise reload, which re-runs each layer's post-load processing and
  copies into the original storage; inside the pause, half-loaded on failure as above.

vLLM mixes this class into its Worker (it appends it to the worker's bases),
so ``self`` is the worker: ``self.model_runner``, ``self.reload_weights`` exist.
Attribute names must not clash with Worker attributes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pipelinerl.generator_memory import NCCL_BYTES, VLLM_DEFAULT_UTILIZATION, update_room_problem
from pipelinerl.weight_group import (
    RECEIVE_RING,
    Invitation,
    WeightGroup,
    WeightSyncError,
    buffer_device,
    check_backend,
    received_whole,
)
from pipelinerl_generator.coverage import WriteCounter, not_covered, reload_uncovered
from pipelinerl_generator.staging import StagingCopy, Transfer

logger = logging.getLogger(__name__)


class WeightReceiverExtension:
    _pipelinerl_weight_group: WeightGroup | None = None
    _pipelinerl_packed: list[torch.nn.Module] | None = None
    _pipelinerl_path: str | None = None  # staged, in_place or reload (prepare_weight_updates)
    _pipelinerl_staging: StagingCopy | None = None
    _pipelinerl_transfer: Transfer | None = None
    _pipelinerl_joining: Transfer | None = None  # a join running beside generation
    _pipelinerl_invitation: Invitation | None = None  # joined, to connect in accept_weight_group
    _pipelinerl_abandoned: tuple[Transfer, ...] = ()  # joins given up on, still running

    def prepare_weight_updates(self, staged: bool, bucket_bytes: int = 0, nccl: bool = False) -> dict[str, Any]:
        """Choose this engine's loading path and allocate the staging copy where staged: at
        start, so a copy that does not fit fails the generator's start, not its first update.
        What was chosen and why, for the engine's log; `room`: why the update's buffers (the copy,
        the receive ring of `bucket_bytes` buckets, the weight group's NCCL buffers) do not fit
        in what the GPU has free beside vLLM, if they do not (nothing allocated then). (Called
        again with another `staged`, it allocates or frees the copy: tests switch paths on one
        engine.)"""
        if self._pipelinerl_transfer is not None:
            raise RuntimeError("the loading path cannot change while weights are being staged")
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if self._pipelinerl_path is None:
            self._pipelinerl_blockers = self._pipelinerl_load_blockers(model)
        room = ""
        if self._pipelinerl_blockers:
            self._pipelinerl_path, self._pipelinerl_staging = "reload", None
        elif staged:
            self._pipelinerl_path = "staged"
            if self._pipelinerl_staging is None:
                room = self._pipelinerl_room(model, True, bucket_bytes, nccl)
                if not room:
                    self._pipelinerl_staging = StagingCopy(model, self._pipelinerl_packed_layers(model))
        else:
            self._pipelinerl_path, self._pipelinerl_staging = "in_place", None
            room = self._pipelinerl_room(model, False, bucket_bytes, nccl)
        staging = self._pipelinerl_staging
        return {
            "path": self._pipelinerl_path,
            "blockers": self._pipelinerl_blockers[:5],
            "staging_bytes": staging.nbytes if staging else 0,
            "room": room,
        }

    def _pipelinerl_room(self, model: torch.nn.Module, staged: bool, bucket_bytes: int, nccl: bool) -> str:
        """`generator_memory.update_room_problem` on this worker's GPU, measured after vLLM took
        its budget ("" on CPU: no budget there). The ring holds whole tensors (loaders shard them):
        a sharded one's whole size is at most its shard's times the tensor-parallel size."""
        device = next(model.parameters()).device
        if device.type != "cuda":
            return ""
        sizes = [p.numel() * p.element_size() for p in model.parameters()]  # (tied ones once)
        tp = int(getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1))
        free, total = torch.cuda.mem_get_info(device)
        utilization = getattr(getattr(self, "cache_config", None), "gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION)
        return update_room_problem(
            free,
            total,
            float(utilization),
            staging=sum(sizes) if staged else 0,
            receive=RECEIVE_RING * max(bucket_bytes, max(sizes) * tp),
            nccl=NCCL_BYTES if nccl else 0,
        )

    def _pipelinerl_load_blockers(self, model: torch.nn.Module) -> list[str]:
        return load_blockers(model)

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
        connect_beside: bool = True,
    ) -> str:
        """Leave the weight group held and start joining `group` (a membership epoch) on a thread,
        so that the engine generates on while the epoch's members gather (up to the trainer's
        join window where one is late): poll `weight_group_joined`, then call
        `accept_weight_group`. The thread also connects where `connect_beside`; otherwise every
        worker connects in `accept_weight_group`, together (NCCL with tensor parallelism: the new
        communicator's first collective would run beside the worker's own all-reduces). "" once
        started, else why this worker can take no weights any more (told, never raised)."""
        # `rank` is this engine's first rank in the weight group; collective_rpc
        # sends the same args to every worker, so worker i of a TP/PP engine
        # (self.rank == i) takes rank + i. Every worker receives full tensors:
        # vLLM's loaders shard them. With NCCL, on this worker's GPU (vLLM has set it).
        if self._pipelinerl_weight_group is not None:
            self._pipelinerl_weight_group.close()  # a transfer still receiving from it raises
            self._pipelinerl_weight_group = None
        self._pipelinerl_invitation = None
        if self._pipelinerl_joining is not None:  # given up on: it ends at its own timeouts
            self._pipelinerl_abandoned += (self._pipelinerl_joining,)
            self._pipelinerl_joining = None
        self._pipelinerl_close_abandoned()
        try:
            self._pipelinerl_end_abandoned_transfer(timeout_s)
            check_backend(backend)
        except Exception as err:  # noqa: BLE001 - told (`weight_group_joined`)
            return why(err)
        rank += int(getattr(self, "rank", 0))

        def join() -> Invitation | WeightGroup:
            invitation = WeightGroup.invitation(host, port, group, rank, world_size, timeout_s, backend, token)
            return invitation.accept() if connect_beside else invitation

        self._pipelinerl_joining = Transfer(join, buffer_device(backend), "pipelinerl-join-weights")
        return ""

    def weight_group_joined(self) -> str | None:
        """None while the join's thread runs; "" once it is done; else why it failed. Never raises:
        at the first worker that raises, vLLM's multiprocess executor (tensor parallelism) leaves
        the other workers' answers queued, to be read as the answers of the calls that follow."""
        joining = self._pipelinerl_joining
        if joining is None:
            joined = self._pipelinerl_weight_group is not None or self._pipelinerl_invitation is not None
            return "" if joined else "no weight group is being joined"
        if joining.thread.is_alive():
            return None
        self._pipelinerl_joining = None
        if joining.error is not None:
            return why(joining.error)
        if isinstance(joining.result, Invitation):
            self._pipelinerl_invitation = joining.result
        else:
            self._pipelinerl_weight_group = joining.result
        return ""

    def accept_weight_group(self) -> str:
        """Once every worker has joined: connect where the join's thread did not, every worker in
        this one call (the connection is a collective). "" once connected, else why not."""
        invitation, self._pipelinerl_invitation = self._pipelinerl_invitation, None
        if invitation is not None:
            try:
                self._pipelinerl_weight_group = invitation.accept()
            except Exception as err:  # noqa: BLE001 - told, never raised (`weight_group_joined`)
                return why(err)
        return "" if self._pipelinerl_weight_group is not None else "no weight group was joined"

    def _pipelinerl_close_abandoned(self) -> None:
        """Close what joins given up on joined, once their threads have ended (never waited for)."""
        running = []
        for joining in self._pipelinerl_abandoned:
            if joining.thread.is_alive():
                running.append(joining)
            elif isinstance(joining.result, WeightGroup):
                joining.result.close()
        self._pipelinerl_abandoned = tuple(running)

    def receive_weights(self, buckets: list[dict[str, Any]]) -> str:
        """Receive and load, inside the pause (on this worker's thread, between engine steps);
        "" once loaded, else why the live weights were kept. Staged: into the staging copy,
        then committed; any failure keeps the live weights. Otherwise straight into the live
        weights: kept if the first bucket failed (nothing loaded yet); a transfer failing later
        raises (they are half-loaded: the generator stops)."""
        group = self._pipelinerl_group()
        if self._pipelinerl_path is None:
            raise RuntimeError("receive_weights before prepare_weight_updates")
        staging = self._pipelinerl_staging
        if staging is not None:
            try:
                self._pipelinerl_stage(staging, group, buckets)
            except Exception as err:  # noqa: BLE001 - the staging copy alone saw it
                logger.warning("weights not loaded, the live ones are kept: %s", err)
                return why(err)
            staging.commit()
            self._pipelinerl_synchronize()
            return ""
        weights = _Counted(group.receive_buckets(buckets))
        try:
            with received_whole(weights):
                self._pipelinerl_load_live(weights)
        except WeightSyncError as err:
            if weights.taken:
                raise RuntimeError(f"weight transfer failed with the live weights half-loaded: {err}") from err
            logger.warning("weights not received, the live ones are kept: %s", err)
            return why(err)
        self._pipelinerl_synchronize()
        return ""

    def _pipelinerl_load_live(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self._pipelinerl_path == "in_place":
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            self._pipelinerl_load_in_place(model, self._pipelinerl_packed_layers(model), weights)
            return
        # vLLM's layerwise reload swaps every layer's tensors for meta ones before it takes a weight
        # (`initialize_layerwise_reload`): the first is received before it is called, so that a
        # transfer failing there leaves the model as it was. It keeps a layer's tensors until the
        # layer is complete: the ring's views would be overwritten by then, so each is cloned (a
        # layer's worth).
        first = next(weights)
        received = itertools.chain([first], weights)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        load, uncovered = model.load_weights, []

        def load_and_count(weights: Iterable[tuple[str, torch.Tensor]]):
            loaded = load(weights)
            uncovered.extend(reload_uncovered(model, self._pipelinerl_tied()))  # before vLLM processes them
            return loaded

        model.load_weights = load_and_count  # what vLLM's reload calls, between its set-up and finalisation
        try:
            self.reload_weights(weights_iterator=((name, t.clone()) for name, t in received))  # type: ignore[attr-defined]
        finally:
            del model.load_weights
        if uncovered:  # finalised all the same: kept or garbage there; the generator stops
            raise not_covered(uncovered)
        self._pipelinerl_retie_lm_head()

    def _pipelinerl_stage(self, staging: StagingCopy, group: WeightGroup, buckets: list[dict[str, Any]]) -> None:
        """Receive and load the update into the staging copy."""
        with received_whole(group.receive_buckets(buckets)) as weights:
            self._pipelinerl_load_in_place(staging.model, staging.packed, weights)

    def _pipelinerl_group(self) -> WeightGroup:
        if self._pipelinerl_weight_group is None:
            raise RuntimeError("weights sent before init_weight_group")
        return self._pipelinerl_weight_group

    def _pipelinerl_synchronize(self) -> None:
        # The loads ran on this thread's stream, before the engine's next step on the same one;
        # waiting here makes the pause's length the update's real cost and surfaces errors.
        self._pipelinerl_group().synchronize()

    # -- staged updates: the transfer, load and re-pack run beside generation -------------------
    def stage_weights(self, buckets: list[dict[str, Any]]) -> bool:
        """Start receiving the next weights into the staging copy, on a thread, while the engine
        keeps generating with the live ones; `commit_staged_weights` copies them in. False, and
        nothing started, where this engine has no staging copy: use `receive_weights`."""
        if self._pipelinerl_transfer is not None:
            raise RuntimeError("weights are already being staged")
        staging = self._pipelinerl_staging
        if staging is None:
            return False
        group = self._pipelinerl_group()
        self._pipelinerl_transfer = Transfer(lambda: self._pipelinerl_stage(staging, group, buckets), group.device)
        return True

    def staged_weights_ready(self) -> str | None:
        """None while the staged weights are received and loaded; "" once they are; else why
        staging failed (the live weights are then untouched). Never raises (`weight_group_joined`)."""
        transfer = self._pipelinerl_transfer
        if transfer is None:
            return "no weights are being staged"
        if transfer.thread.is_alive():
            return None
        if transfer.error is not None:
            self._pipelinerl_transfer = None
            return why(transfer.error)
        return ""

    def _pipelinerl_end_abandoned_transfer(self, timeout_s: float) -> None:
        """An update the engine gave up on (its deadline passed: WeightsKept) may still be
        receiving from the group just closed. Its thread ends with that group (a failed receive)
        or at the group's collective timeout; wait for it, so the next update can stage (one
        still receiving after `timeout_s` would write into the staging copy under the next)."""
        transfer = self._pipelinerl_transfer
        if transfer is None:
            return
        transfer.thread.join(timeout_s)
        if transfer.thread.is_alive():
            raise TimeoutError(f"an abandoned weight update still receives after {timeout_s:.0f} s")
        self._pipelinerl_transfer = None

    def commit_staged_weights(self) -> None:
        """Copy the staged weights into the live storage. Call while generation is paused: the
        next engine step uses them."""
        if self.staged_weights_ready() != "":
            raise RuntimeError("commit_staged_weights called before the staged weights were loaded")
        self._pipelinerl_transfer = None
        self._pipelinerl_staging.commit()  # type: ignore[union-attr]
        self._pipelinerl_synchronize()

    def probe_live_storage(self) -> list[int]:
        """The live parameters' storage addresses, in order (tests: they never change)."""
        return [p.data_ptr() for p in self.model_runner.get_model().parameters()]  # type: ignore[attr-defined]

    def _pipelinerl_load_in_place(self, model: torch.nn.Module, packed: list[torch.nn.Module], weights) -> None:
        """Unquantized models: copy into `model`'s parameters (the live model, or the staging
        copy) with the model's own loaders (they stack q/k/v and gate/up and shard for TP; each
        copies in place, `param.data.copy_`, as it goes), then redo only the CPU GEMM packing of
        `packed`, its packed layers.

        This is one copy plus the packing, where vLLM's layerwise reload re-creates every layer
        (fresh, page-faulted allocations) and copies twice: 1.5-2x faster on CPU. On GPU, these
        weights need no processing (`load_blockers`), so it is the copy alone."""
        from vllm.config import set_current_vllm_config

        written = WriteCounter(dict(model.named_parameters()))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            with written:
                model.load_weights(weights)  # type: ignore[operator]  # vLLM's models have it, nn.Module not
            if uncovered := written.uncovered():  # what was not written keeps the previous version
                raise not_covered(uncovered)
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

    def _pipelinerl_tied(self) -> bool:
        return bool(getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False))  # type: ignore[attr-defined]

    def _pipelinerl_retie_lm_head(self) -> None:
        # With tie_word_embeddings the checkpoint has no lm_head.weight, so the
        # reload never "loads" lm_head: it gets its old kernel tensors back and,
        # on CPU, keeps its old pre-packed GEMM closure (layer.cpu_linear) ->
        # logits from stale weights. Re-tie and re-pack from the new embedding.
        if not self._pipelinerl_tied():
            return
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or lm_head is embed or not hasattr(lm_head, "weight"):
            return
        from vllm.platforms import current_platform

        with torch.no_grad():
            if current_platform.is_cpu():
                lm_head.weight = embed.weight
                _repack_cpu_gemm(lm_head)
            elif lm_head.weight is not embed.weight:  # (vLLM ties by one Parameter: then nothing to do)
                lm_head.weight.copy_(embed.weight)  # in place: a CUDA graph reads the storage it captured


def why(err: BaseException) -> str:
    """A failure as a worker call tells it (its answer, not raised: `weight_group_joined`)."""
    return f"{type(err).__name__}: {err}"


class _Counted:
    """An iterator that remembers whether anything was taken from it (a load has begun)."""

    def __init__(self, items: Iterable) -> None:
        self._items: Iterator = iter(items)
        self.taken = False

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._items)
        self.taken = True
        return item


def load_blockers(model: torch.nn.Module) -> list[str]:
    """Why copying checkpoint tensors into `model`'s parameters with its own loaders would leave
    it wrong (empty: it is enough). vLLM post-processes some weights after loading, and only its
    layerwise reload re-runs that: quantized weights; MoE kernels that re-lay their weights out
    (FlashInfer, AITER, CPU prepacking: only Triton's keep the checkpoint layout); MLA, whose
    W_UK_T / W_UV derive from kv_b_proj; attention sinks kept in float32; CPU convolutions
    repacked in place; ROCm's bf16x3 gate weights. CPU-packed linear GEMMs are not blockers:
    the receiver repacks them itself."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backend import MLAAttentionImpl

    copy_safe_moe = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON)
    reasons = []
    for name, m in model.named_modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod):
            if method.unquantized_backend not in copy_safe_moe:
                reasons.append(f"{name}: MoE weights re-laid out for {method.unquantized_backend.name}")
        elif method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            reasons.append(f"{name}: quantized ({type(method).__name__})")
        if isinstance(m, MLAAttention):
            reasons.append(f"{name}: MLA (W_UK_T, W_UV derive from kv_b_proj)")
        impl: Any = getattr(m, "impl", None)
        for variant in impl.get_impl_variants() if hasattr(impl, "get_impl_variants") else [impl]:
            if isinstance(variant, MLAAttentionImpl) and not isinstance(m, MLAAttention):
                reasons.append(f"{name}: MLA attention")
            if getattr(variant, "_sinks_source", None) is not None:
                reasons.append(f"{name}: attention sinks copied to float32")
        for attr in ("_cpu_unpacked_conv_weight", "_bf16x3_weight"):
            if getattr(m, attr, None) is not None:
                reasons.append(f"{name}: {attr.lstrip('_')} derived at load")
    return reasons


def _repack_cpu_gemm(layer: torch.nn.Module) -> None:
    """Rebuild a layer's packed CPU GEMM from its (kept, freshly loaded) weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
