"""DeepSpeed set-up: process group, engine, and full-weight access under any ZeRO stage."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch

from pipelinerl.contracts import Env
from pipelinerl.spec import TrainerSpec
from pipelinerl.weight_group import DTYPES, open_store
from pipelinerl_trainer.logprob_head import linear_logprobs
from pipelinerl_trainer.packed_attention import Packing, use_packed_attention
from pipelinerl_trainer.peers import rendezvous_client


def import_deepspeed():
    """DeepSpeed, imported without mlflow: its autotuner imports mlflow whenever it is installed
    (1.65 s of CPU at every trainer start), for autotuning this project never runs. A None in
    sys.modules fails that one import; a job's mlflow tracking imports it as usual afterwards."""
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed(
    on_gpu: bool, timeout_s: float, listen_host: str = "0.0.0.0", collective_timeout_s: float | None = None
) -> None:
    """The ranks' torch group, from torch's variables (RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; LOCAL_RANK on a GPU), which DeepSpeed then takes as its own. Its store is made
    here, not by torch from the variables: rank 0 serves it on `listen_host` alone where that
    names one address (a local run's loopback), where torch's own server listens on every one.
    `timeout_s` bounds the rendezvous, `collective_timeout_s` (default: the same) the group's
    collectives."""
    import torch.distributed as dist

    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_deepspeed()
    if not on_gpu:
        # DeepSpeed's optional shared-memory all-reduce for CPU costs ~80 s to compile on first
        # use; gloo is fast enough for the tiny models run on CPU. (sys.modules: the attribute
        # `deepspeed.comm.torch` is shadowed by the torch package itself.)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    rank, world = int(os.environ[Env.TORCH_RANK]), int(os.environ[Env.TORCH_WORLD_SIZE])
    port = int(os.environ[Env.MASTER_PORT])
    if rank == 0:
        store = open_store(listen_host, port, True, timeout_s, "the trainer ranks' rendezvous")
    else:
        store = rendezvous_client(os.environ[Env.MASTER_ADDR], port, timeout_s)
    extra: dict[str, Any] = {}
    if on_gpu and world > 1:  # as DeepSpeed binds it: NCCL's communicator made at once, on this rank's GPU
        extra["device_id"] = torch.device("cuda", int(os.environ.get(Env.TORCH_LOCAL_RANK, 0)))
    backend = "nccl" if on_gpu else "gloo"
    timeout = timedelta(seconds=collective_timeout_s or timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def ds_config(trainer: TrainerSpec, dtype: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # Steps hold a variable number of micro-batches: we call step() ourselves after the
        # last one, and DeepSpeed treats each step() as the accumulation boundary.
        "managed_gradient_accumulation": False,
        "gradient_clipping": trainer.grad_clip,
        "zero_optimization": {"stage": trainer.zero_stage},
        "steps_per_print": 10**9,
        # Each trainer pod checkpoints to its own volume (pipelinerl_trainer.checkpoint)
        "checkpoint": {"use_node_local_storage": True},
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "float16":
        cfg["fp16"] = {"enabled": True}
    return cfg


def load_model(model_path: str, dtype: str = "float32", gradient_checkpointing: bool = False, compile: bool = False):
    """The Hugging Face model as the trainer runs it: packed-row attention, the fused log-prob
    head (`policy_forward`), no KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
    model.config.use_cache = False
    use_packed_attention(model)
    use_policy_forward(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        compile_elementwise(model)
    return model


def compile_elementwise(model) -> None:
    """torch.compile the decoder's MLPs and RMS norms, shapes dynamic (one compilation for every
    row length): eager mode runs their elementwise work op by op (SiLU × up, the norm's fp32
    round trip), compiled it is fused. Attention and the log-prob head are custom kernels already
    and stay eager."""
    for module in model.modules():
        if type(module).__name__.endswith(("MLP", "RMSNorm")):
            module.compile(dynamic=True)


# Config fields of models that transform the logits after the LM head (soft-capping, scaling):
# the fused head computes log-probs from hidden states and would skip that.
POST_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def use_policy_forward(model) -> None:
    """Give `model` the trainer's forward: called with a `packing`, it returns the per-token
    (log-prob, entropy) of a packed row straight from the last hidden states (`linear_logprobs`:
    no full-vocabulary tensor); without one, it is the model's own forward.

    The forward is the root module's (not a separate function over its parts) so that DeepSpeed
    sees the call: ZeRO-3 gathers the head's weight for it, and the engine hooks its outputs."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}: the trainer needs a bias-free linear LM head")
    for name in POST_HEAD_FIELDS:
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(
                f"{type(model).__name__} transforms its logits after the LM head ({name}), "
                "which the trainer's fused log-prob head does not"
            )
    stock = type(model).forward

    def forward(self, input_ids=None, *, packing: Packing | None = None, temperature: float = 1.0, **kwargs):
        if packing is None:
            return stock(self, input_ids=input_ids, **kwargs)
        hidden = self.base_model(input_ids=input_ids, packing=packing, use_cache=False, **kwargs).last_hidden_state[0]
        # Entry t is token t's, predicted from position t - 1; entry 0 has no prediction.
        logprobs, entropy = linear_logprobs(
            hidden[:-1], self.get_output_embeddings().weight, input_ids[0, 1:], temperature
        )
        zero = logprobs.new_zeros(1)
        return torch.cat([zero, logprobs]), torch.cat([zero, entropy])

    model.forward = types.MethodType(forward, model)


def build_engine(trainer: TrainerSpec, dtype: str, model_path: str):
    import deepspeed

    torch.manual_seed(trainer.seed)
    model = load_model(model_path, dtype, trainer.gradient_checkpointing, trainer.compile)
    # A client optimizer: DeepSpeed's own CPU Adam would compile kernels for minutes.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay, betas=(0.9, 0.999)
    )
    warmup = trainer.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(trainer, dtype)
    )
    return engine


class TrainingEngine(Protocol):
    """What weight access uses of a DeepSpeed engine (benchmarks pass a plain module's stand-in)."""

    module: torch.nn.Module

    def zero_optimization_stage(self) -> int: ...


@contextlib.contextmanager
def full_parameters(engine: TrainingEngine, params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Full tensors of `params` on every rank; under ZeRO-3 a collective all ranks must join."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


def named_weights(engine: TrainingEngine) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters in checkpoint naming (tied weights appear once, as the HF checkpoint has them)."""
    return list(engine.module.named_parameters())
