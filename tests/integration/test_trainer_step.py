"""The trainer's micro-batch step on the trainer's model (real HF Qwen2).

A sentinel (a rank's empty micro-batch) runs the same modules as a real row, so the ranks'
ZeRO-3 gathers stay in step (a sentinel through a different path deadlocked two ranks), and
contributes nothing.

The micro-batch loop never makes the host wait for the device: between taking a
micro-batch and the step's end, no operation reads a value back (`.item()`, `.tolist()`, a
boolean mask, `nonzero`, `unique`, …), so a GPU runs ahead through the whole step; the step's
tallies are read once, after its last micro-batch. Counted here on CPU by intercepting every
tensor operation (on a GPU, bench/gpu_check.sh runs the same step under
`torch.cuda.set_sync_debug_mode("error")`). Building the micro-batch's tensors from the message's
lists, and the grouped kernel's gather plan from its lengths, is host work by construction (CPU
tensors made from host lists, then copied without waiting) and is not counted."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipelinerl_preprocessor.packing import StepSample, pack_wave
from pipelinerl import messages as m
from pipelinerl_trainer import step as step_module
from pipelinerl_trainer.loss import LossConfig
from pipelinerl_trainer.packed_attention import Packing
from pipelinerl_trainer.step import StepConfig, StepTally, micro_batch_loss
from test_packed_forward import trainer_model  # tests/integration

# Operations whose result the host must wait for: a scalar read, or an output sized by the data.
SYNCING = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "is_nonzero",
    "bincount",
    "masked_scatter",
    "histc",
}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops += 1
        if (
            name in SYNCING
            or (
                name == "index"
                and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
            )
            or (name == "repeat_interleave" and "output_size" not in (kwargs or {}))
        ):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def micro_batches(n: int) -> list[m.MicroBatch]:
    import random

    rng = random.Random(0)
    items = []
    for i in range(24):
        k = rng.randint(3, 12)
        items.append(
            StepSample(
                m.Sample(
                    tokens=[rng.randrange(2, 14) for _ in range(4 + k)],
                    mask=[0] * 4 + [1] * k,
                    logprobs=[0.0] * 4 + [-1.0] * k,
                    versions=[-1] * 4 + [i % 3] * k,
                    reward=float(i % 2),
                ),
                advantage=rng.gauss(0, 1),
            )
        )
    return pack_wave(0, items, 1, 64, 1 / 24, last=True)[0][:n]


def uncounted(monkeypatch, owner, name: str) -> None:
    """Host work (from host lists, onto CPU tensors) run outside the counter."""
    host_work = getattr(owner, name)

    def run(*args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            return host_work(*args, **kwargs)

    monkeypatch.setattr(owner, name, run)


def test_the_micro_batch_loop_reads_nothing_back(monkeypatch):
    model = trainer_model(seed=0).train()
    batches = micro_batches(3)
    assert len(batches) == 3 and not any(b.is_sentinel for b in batches)
    counter = SyncCounter()
    uncounted(monkeypatch, step_module, "device_batch")
    uncounted(monkeypatch, Packing, "grouped_plan")
    for kind in ("reinforce", "gspo", "ppo"):
        tally = StepTally(max_lag=1)
        cfg = StepConfig(
            LossConfig(kind, kl_coef=0.0, importance="sequence" if kind == "reinforce" else "token"),
            temperature=0.7,
            max_lag=1,
        )
        with counter:
            for mb in batches:
                micro_batch_loss(model, mb, 2, cfg, tally).backward()
        assert counter.ops > 1000  # the forward and backward passes were seen
        assert counter.syncs == [], f"{kind}: host syncs in the micro-batch loop: {counter.syncs}"
        metrics = tally.finish().metrics()  # the one read, at the step's end
        assert metrics["samples"] == sum(len(b.rewards) for b in batches) and metrics["tokens"] > 0
        assert metrics["reward_trained"] == pytest.approx(sum(sum(b.rewards) for b in batches) / metrics["samples"])
        assert metrics["dropped_for_lag"] > 0  # versions 0 at version 2 are over max lag 1


def test_the_counter_sees_a_sync():
    counter = SyncCounter()
    x = torch.arange(6.0)
    with counter:
        x.sum().item()
        x[x > 2].sum()
        torch.unique(x)
    assert counter.syncs == ["_local_scalar_dense", "index", "_unique2"]


def test_a_sentinel_runs_what_a_row_runs_and_counts_nothing():
    model = trainer_model(seed=0).train()
    row = micro_batches(1)[0]
    sentinel = m.MicroBatch(step=0, rank=0, index=5, last=True)
    cfg = StepConfig(LossConfig("reinforce"), temperature=0.7, max_lag=1)
    calls: list[str] = []
    names = {mod: name for name, mod in model.named_modules()}
    hooks = [mod.register_forward_pre_hook(lambda mod, args: calls.append(names[mod])) for mod in names]
    paths = []
    for mb in (row, sentinel):
        calls.clear()
        tally = StepTally(max_lag=1)
        loss = micro_batch_loss(model, mb, 1, cfg, tally)
        paths.append(list(calls))
    for h in hooks:
        h.remove()
    assert paths[0] == paths[1] and len(paths[0]) > 10
    model.zero_grad()
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    metrics = tally.finish().metrics()
    assert metrics["samples"] == 0 and metrics["tokens"] == 0 and metrics["row_tokens"] == 0
