"""Trainer checkpoints when every trainer pod has a volume of its own (as on Kubernetes): two real
DeepSpeed ZeRO-1 ranks on gloo, each saving to and resuming from its own folder only. The resumed
ranks must continue exactly as the uninterrupted run (weights and Adam state restored), and when
one pod's `latest` is a step behind (a crash between the pods' writes), both resume at that step,
which every pod keeps (the newest two checkpoints are), unless every pod's part of the newer one
is whole (the crash came after the save's collective): then both go on from it; both go back to
the older one where the job's store goes on from it. A pod whose volume is lost takes the
weights and data position of the pod that kept its checkpoints, instead of sending the job back to
step 0 (ZeRO-1, and ZeRO-3, whose pods hold only partitions)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from rank_processes import end_ranks, run_ranks, trainer_rank_job, whole_weights  # tests/integration/rank_processes.py

pytestmark = pytest.mark.slow


def _batch(step: int) -> torch.Tensor:
    return torch.randint(2, 32, (1, 12), generator=torch.Generator().manual_seed(step))


def _train(engine, step: int) -> None:
    logits = engine(input_ids=_batch(step).to(engine.device), use_cache=False).logits
    engine.backward(logits.float().logsumexp(-1).mean())
    engine.step()


def _rank(rank: int, port: int, model: str, root: str, out: mp.Queue, backend: str) -> None:
    from pipelinerl_trainer import checkpoint
    from pipelinerl_trainer.model import build_engine

    job = trainer_rank_job(rank, port, model, backend)
    pod = Path(root) / f"pod-{rank}" / "checkpoints"
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    _train(engine, 0)
    checkpoint.save(engine, pod, 1, {"step": 1, "rank": rank}, rank, local_rank=0, previous=0)
    _train(engine, 1)
    after_two = whole_weights(engine)
    checkpoint.save(engine, pod, 2, {"step": 2, "rank": rank}, rank, local_rank=0, previous=1)
    _train(engine, 2)
    after_three = whole_weights(engine)
    checkpoint.save(engine, pod, 3, {"step": 3, "rank": rank}, rank, local_rank=0, previous=2)
    if rank == 1:  # this pod crashed while writing step 3: its part not whole, its `latest` at step 2
        (pod / "step-3" / checkpoint.WHOLE).unlink()
        (pod / "latest").write_text("step-2")

    resumed = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    state = checkpoint.load(resumed, pod)
    _train(resumed, 2)  # the step the crash lost, again
    # Killed after the save's collective instead (every pod's part whole), before its `latest`
    # moved: both go on from step 3, which every pod holds whole (before, from step 2; a run's
    # first save cut so on rank 0's pod under ZeRO-3 went back to step 0).
    if rank == 1:
        (pod / "step-3" / checkpoint.WHOLE).write_text("step-3")
    whole = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    went_on = checkpoint.load(whole, pod) == {"step": 3, "rank": rank} and torch.equal(
        whole_weights(whole), after_three
    )
    # Both pods at step 3 again, and the job's store made to go on from step 2 (its record of step 3
    # never told): both go back to step 2 (`step_the_store_goes_on_from`).
    (pod / "latest").write_text("step-3")
    back = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    went_back = checkpoint.load(back, pod, resume=2) == {"step": 2, "rank": rank} and torch.equal(
        whole_weights(back), after_two
    )
    out.put(
        (
            rank,
            state,
            went_on,
            went_back,
            torch.equal(whole_weights(resumed), after_three),
            sorted(p.name for p in (pod / "step-3").iterdir()),
            sorted(p.name for p in (pod / "step-3" / "ds" / "ds").iterdir()),
            sorted(p.name for p in pod.iterdir()),
        )
    )
    end_ranks()


def _rank_losing_its_volume(
    rank: int, port: int, model: str, root: str, out: mp.Queue, backend: str, stage: int
) -> None:
    import shutil

    import deepspeed

    from pipelinerl_trainer import checkpoint
    from pipelinerl_trainer.model import build_engine

    job = trainer_rank_job(rank, port, model, backend, stage)
    pod = Path(root) / f"pod-{rank}" / "checkpoints"
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    for step in (1, 2):
        _train(engine, step - 1)
        checkpoint.save(engine, pod, step, {"step": step, "rank": rank}, rank, local_rank=0, previous=step - 1)
    at_two = whole_weights(engine)
    if rank == 1:  # its volume lost: the pod starts on an empty one
        shutil.rmtree(pod)

    resumed = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    # Weights unlike the run's on rank 1, in the model and in ZeRO's fp32 copy: both must be
    # replaced (under ZeRO-3 its zeros are every rank's partitions).
    with torch.no_grad():
        for p in resumed.module.parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=1, enabled=stage == 3):
                if rank == 1:
                    p.zero_()
    resumed.optimizer.refresh_fp32_params()
    state = checkpoint.load(resumed, pod)
    adopted = whole_weights(resumed)
    _train(resumed, 2)
    out.put((rank, state, torch.equal(adopted, at_two), float((whole_weights(resumed) - adopted).abs().max())))
    end_ranks()


def _rank_unnamed_first(rank: int, port: int, model: str, root: str, out: mp.Queue, backend: str) -> None:
    from pipelinerl_trainer import checkpoint
    from pipelinerl_trainer.model import build_engine

    job = trainer_rank_job(rank, port, model, backend, 3)
    pod = Path(root) / f"pod-{rank}" / "checkpoints"
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    _train(engine, 0)
    checkpoint.save(engine, pod, 1, {"step": 1, "rank": rank}, rank, local_rank=0, previous=0)
    at_one = whole_weights(engine)
    if rank == 0:  # killed after the save's collective, before its `latest` named step 1
        (pod / "latest").unlink()
    resumed = build_engine(job.spec.trainer, job.spec.weights_dtype, model)
    state = checkpoint.load(resumed, pod)
    out.put((rank, state, torch.equal(whole_weights(resumed), at_one)))
    end_ranks()


def test_a_first_save_rank_0s_pod_did_not_name_is_resumed_from_not_started_afresh(tmp_path, tiny_qwen2):
    """ZeRO-3's whole weights are rank 0's Hugging Face copy: its pod killed between the first
    save's collective and its `latest`, the run went back to step 0 (the other pod, which named
    it, holds only partitions). Its part whole (`checkpoint.WHOLE`), every pod resumes from it."""
    for rank, (state, same) in run_ranks(_rank_unnamed_first, tmp_path, tiny_qwen2, "gloo").items():
        assert state == {"step": 1, "rank": rank} and same


# nccl: the same on a GPU (bench/gpu_check.sh's checkpoint part); CI has none.
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_pod_resumes_from_its_own_volume(tmp_path, tiny_qwen2, backend):
    results = run_ranks(_rank, tmp_path, tiny_qwen2, backend)
    for rank, (state, went_on, went_back, same_as_uninterrupted, step_files, ds_files, kept) in results.items():
        assert kept == ["latest", "step-2", "step-3"]  # the newest two: step 1's deleted
        assert state == {"step": 2, "rank": rank}  # both at the step every pod has
        assert went_on  # to the newest every pod holds whole, named by `latest` or not
        assert went_back  # to the one their store goes on from, from their newest, exactly
        assert same_as_uninterrupted  # weights and Adam moments came back from the pod's own folder
        # Each pod holds the model states and its own ZeRO shard; the HF weights are written once.
        assert step_files == (["ds", "hf", "state.json", "whole"] if rank == 0 else ["ds", "state.json", "whole"])
        assert "mp_rank_00_model_states.pt" in ds_files
        bf16 = "bf16_" if backend == "nccl" else ""  # DeepSpeed names a bfloat16 run's shards so (seen on an H200)
        assert [f for f in ds_files if "optim_states" in f] == [f"{bf16}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stage", [1, 3])  # ZeRO-3: the whole weights from rank 0's Hugging Face copy
def test_a_pod_that_lost_its_volume_goes_on_from_the_pod_that_kept_its_checkpoint(tmp_path, tiny_qwen2, backend, stage):
    results = run_ranks(_rank_losing_its_volume, tmp_path, tiny_qwen2, backend, stage)
    for rank, (state, adopted_the_run, moved) in results.items():
        assert state == {"step": 2, "rank": 0}  # both at pod 0's step, with its data position
        assert adopted_the_run  # exactly the weights the run had at step 2, on both pods
        # One step on from them (fresh Adam: at most about the learning rate, 1e-4, per weight):
        # a stale fp32 copy (rank 1's zeros) would have pulled its shard far back.
        assert moved < 1e-3, f"rank {rank}: a weight moved {moved}"
