"""The trainer's DeepSpeed engine takes the same optimizer step as plain PyTorch AdamW with
gradient-norm clipping, over any number of micro-batches. Steps hold a variable number of
micro-batches, so the trainer calls backward() per micro-batch and step() itself
(`managed_gradient_accumulation: false`); a wrong accumulation setting would silently train on
one micro-batch of each step, or scale its gradients. The loss goes through the trainer's own
forward (packed rows, fused log-prob head), under ZeRO-1 and ZeRO-3. Each case runs in a fresh
process (one gloo rank), as a trainer pod does; and two ranks take the step one takes."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from pipelinerl.ports import free_port
from rank_processes import run_ranks  # tests/integration/rank_processes.py

pytestmark = pytest.mark.slow
LR = 1e-2  # large enough that a missing micro-batch or a wrong scale moves the weights visibly


def _loss(model, batch: torch.Tensor, scale: float) -> torch.Tensor:
    """The trainer's forward over a packed row (packed attention, fused log-prob head: under
    ZeRO-3 the head's weight is gathered for it in the forward and the backward passes)."""
    from pipelinerl_trainer.packed_attention import Packing

    lengths = [5, 4, 3]
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    lp, entropy = model(input_ids=batch, position_ids=positions, packing=Packing.of(lengths), temperature=0.7)
    return (-lp.sum() - 0.1 * entropy.sum()) * scale


def _compare(stage: int, path: str, port: int, out: mp.Queue) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pipelinerl.spec import parse_job
    from pipelinerl_trainer.model import build_engine, import_deepspeed, init_distributed, load_model

    deepspeed = import_deepspeed()

    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "ds"},
            "spec": {"model": {"path": path}, "trainer": {"zeroStage": stage, "learningRate": LR, "warmupSteps": 0}},
        }
    )
    init_distributed(False, 60)
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, path)
    plain = load_model(path)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=job.spec.trainer.weight_decay)
    start = torch.cat([p.detach().flatten().clone() for p in plain.parameters()])
    for step, n_micro in enumerate((3, 2)):  # steps of different lengths and loss scales
        for i in range(n_micro):
            batch = torch.randint(2, 32, (1, 12), generator=torch.Generator().manual_seed(10 * step + i))
            engine.backward(_loss(engine, batch, step + 1))
            _loss(plain, batch, step + 1).backward()
        engine.step()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), job.spec.trainer.grad_clip)
        opt.step()
        opt.zero_grad()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
        trained = torch.cat([p.detach().flatten().clone() for p in params])
    expected = torch.cat([p.detach().flatten() for p in plain.parameters()])
    out.put((float((expected - start).abs().max()), float((trained - expected).abs().max())))


def in_a_rank_process(target, stage: int, path) -> object:
    """What `target` reports from a fresh process, a DeepSpeed rank of its own (as a trainer pod's)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(stage, str(path), free_port(), out))
    proc.start()
    try:
        return out.get(timeout=180)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_step_equals_plain_adamw_over_micro_batches(tiny_qwen2, stage):
    moved, diff = in_a_rank_process(_compare, stage, tiny_qwen2)
    assert moved > 1e-2  # the two steps did move the weights
    assert diff < 1e-4, f"DeepSpeed ZeRO-{stage} weights differ from plain AdamW by {diff}"


def _dtypes(stage: int, path: str, port: int, out: mp.Queue) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from pipelinerl.spec import parse_job
    from pipelinerl_trainer.model import build_engine, init_distributed

    job = parse_job(
        {
            "metadata": {"name": "ds"},
            "spec": {"model": {"path": path, "dtype": "bfloat16"}, "trainer": {"zeroStage": stage}},
        }
    )
    init_distributed(False, 60)
    engine = build_engine(job.spec.trainer, "bfloat16", path)
    opt = engine.optimizer  # ZeRO's: the flat partitions its AdamW steps, per stage
    masters = opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups
    out.put(({p.dtype for p in engine.module.parameters()}, {t.dtype for t in masters}))


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_weights_compute_while_zero_keeps_the_fp32_master_copy(tiny_qwen2, stage):
    module, stepped = in_a_rank_process(_dtypes, stage, tiny_qwen2)
    assert module == {torch.bfloat16}  # forward and backward in bf16
    assert stepped == {torch.float32}  # AdamW steps ZeRO's fp32 copy, which is cast back into the weights


def test_deepspeed_is_imported_without_mlflow_which_a_job_can_still_import():
    """DeepSpeed's autotuner imports mlflow whenever it is installed (1.65 s of every trainer
    start); the trainer hides it from that import only. In a fresh process, as a trainer's."""
    code = (
        "import sys; from pipelinerl_trainer.model import import_deepspeed; import_deepspeed(); "
        "assert 'mlflow' not in sys.modules, 'DeepSpeed imported mlflow'; import mlflow; print(mlflow.__name__)"
    )
    env = os.environ | {"DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "mlflow", done.stderr[-2000:]


def _non_finite(stage: int, path: str, port: int, out: mp.Queue) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pipelinerl.spec import parse_job
    from pipelinerl_trainer.model import build_engine, import_deepspeed, init_distributed

    job = parse_job({"metadata": {"name": "ds"}, "spec": {"model": {"path": path}, "trainer": {"zeroStage": stage}}})
    init_distributed(False, 60)
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, path)
    params = list(engine.module.parameters())

    def weights() -> torch.Tensor:
        with import_deepspeed().zero.GatheredParameters(params, modifier_rank=None, enabled=stage == 3):
            return torch.cat([p.detach().flatten().clone() for p in params])

    applied = []
    for scale in (float("nan"), 1.0):
        before = weights()
        engine.backward(_loss(engine, torch.randint(2, 32, (1, 12)), scale))
        engine.step()
        applied.append((engine.was_step_applied(), bool((weights() != before).any())))
    out.put(applied)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_of_non_finite_gradients_is_skipped_and_says_so(tiny_qwen2, stage):
    """DeepSpeed applies no update where the gradients are not finite, and tells it
    (`was_step_applied`), which the trainer reports as `step_skipped`: the next step applies."""
    assert in_a_rank_process(_non_finite, stage, tiny_qwen2) == [(False, False), (True, True)]


def _samples(seed: int, n: int) -> list:
    """`n` samples of a step, as the preprocessor hands them to packing (their advantages drawn)."""
    import random

    from pipelinerl import messages as m
    from pipelinerl_preprocessor.packing import StepSample

    rng = random.Random(seed)
    samples = []
    for i in range(n):
        k = rng.randint(3, 12)
        sample = m.Sample(
            tokens=[rng.randrange(2, 30) for _ in range(4 + k)],
            mask=[0] * 4 + [1] * k,
            logprobs=[0.0] * 4 + [-1.0] * k,
            versions=[-1] * 4 + [0] * k,
            reward=float(i % 2),
        )
        samples.append(StepSample(sample, advantage=rng.gauss(0, 1)))
    return samples


# Two steps' samples (seed, count), each packed into rows of 48 tokens: spread over two ranks,
# each step leaves one rank a sentinel, and the steps hold 2 and 3 passes.
STEPS = ((12, 12), (17, 17))


def _data_parallel(rank: int, port: int, model: str, root: str, out: mp.Queue, backend: str, stage: int) -> None:
    from rank_processes import WORLD, end_ranks, trainer_rank_job, whole_weights

    from pipelinerl_preprocessor.packing import pack_wave
    from pipelinerl_trainer.model import build_engine, load_model
    from pipelinerl_trainer.step import StepTally, backward, micro_batch_loss, step_config

    job = trainer_rank_job(rank, port, model, backend, stage, learningRate=LR, warmupSteps=0)
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    cfg, spec = step_config(job), job.spec.trainer
    plain = load_model(model)  # one rank's step over all of the step's samples: plain PyTorch
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=spec.weight_decay)
    norms, passes = [], []
    for step, (seed, n) in enumerate(STEPS):
        samples = _samples(seed, n)
        mine = pack_wave(step, samples, WORLD, 48, 1 / n, last=True)[rank]
        passes.append([len(mb.tokens) for mb in mine])
        for mb in mine:
            backward(engine, micro_batch_loss(engine, mb, 0, cfg, StepTally(job.spec.max_lag)), WORLD)
        engine.step()
        for mb in pack_wave(step, samples, 1, 48, 1 / n, last=True)[0]:
            micro_batch_loss(plain, mb, 0, cfg, StepTally(job.spec.max_lag)).backward()
        expected = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), spec.grad_clip))
        opt.step()
        opt.zero_grad()
        norms.append((float(engine.get_global_grad_norm()), expected))
    trained, start = whole_weights(engine), torch.cat([p.detach().flatten() for p in load_model(model).parameters()])
    expected = torch.cat([p.detach().flatten() for p in plain.parameters()])
    out.put((rank, norms, passes, float((expected - start).abs().max()), float((trained - expected).abs().max())))
    end_ranks()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_on_two_ranks_is_the_step_one_rank_takes_over_all_its_samples(tmp_path, tiny_qwen2, stage):
    """The preprocessor spreads a step's rows over the ranks, each sample weighing 1/samplesPerStep
    wherever it lands; DeepSpeed averages the ranks' gradients, which the trainer's backward scales
    back (`step.backward`). Two ranks on gloo then take the step one rank takes over all of the
    samples: the same gradient norm (AdamW's first steps hide a gradient's scale, the norm does
    not) and the same weights, under ZeRO-1 (reduced at the step) and ZeRO-3 (at each backward)."""
    results = run_ranks(_data_parallel, tmp_path, tiny_qwen2, "gloo", stage)
    for step, (ours, theirs) in enumerate(zip(results[0][1], results[1][1])):
        assert len(ours) == len(theirs) == step + 2 and 0 in ours + theirs  # a sentinel's pass (no tokens)
    for rank, (norms, passes, moved, diff) in results.items():
        for got, expected in norms:
            assert got == pytest.approx(expected, rel=1e-4), (rank, norms)
        assert moved > 1e-2 and diff < 1e-4, (rank, moved, diff)
