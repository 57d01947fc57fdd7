"""The trainer's step rate on an example job's shape (part of benchmark 12,
`bench/decode_curve.py`): alone on 1 and 2 cores, and on one core beside a decoding engine."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from bench import engines_side_by_side as side_by_side
from bench.common import alternate, summary
from bench.measured_machine import job_length_model, sample_of

BESIDE_SECONDS = 600.0  # an engine decoding beside the trainer's steps (stopped once they are timed)


def trainer_rates(path: str, job: str, repeats: int) -> tuple[dict[int, dict], dict]:
    """Row tokens per second of the trainer's step on `job`'s shape, torch on 1 and on 2 threads
    (alternated), and on 1 thread beside an engine decoding a full batch in another process (the
    pipeline's trainer): its samples per step at the example's lengths (its calibration's
    sample), packed into micro-batches of its microBatchTokens, each the trainer's loss
    (`micro_batch_loss`) and backward, then the optimizer's step, all through the trainer's own
    DeepSpeed engine (`build_engine`: the job's ZeRO stage, gradient clipping, AdamW; gloo, one
    rank): as the trainer computes a step, so its rate reads as a run's does."""
    from pipelinerl import messages as m
    from pipelinerl.spec import load_job
    from pipelinerl_preprocessor.packing import StepSample, pack_wave, step_weight
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.ports import free_port
    from pipelinerl_trainer.main import join_torch_group
    from pipelinerl_trainer.model import build_engine
    from pipelinerl_trainer.step import StepTally, micro_batch_loss, step_config

    example = load_job(job)
    spec = example.spec
    model_lengths = job_length_model(job)
    assert model_lengths is not None, f"{job}: not an example job with a calibration (CALIBRATION_OF_JOB)"
    lengths, prompt = sample_of(model_lengths)
    if not torch.distributed.is_initialized():  # this process as a trainer of one rank (gloo)
        join_torch_group(example, ServiceEnv(role="trainer", master_port=free_port()), threading.Event())
    engine = build_engine(spec.trainer, spec.weights_dtype, path)
    engine.train()
    vocab = engine.module.config.vocab_size
    rng = np.random.default_rng(0)
    items = []
    for i in range(spec.trainer.samples_per_step):
        n = lengths[i % len(lengths)]
        tokens = [int(t) for t in rng.integers(3, vocab, prompt + n)]
        sample = m.Sample(
            tokens=tokens, mask=[0] * prompt + [1] * n, logprobs=[0.0] * prompt + [-0.5] * n,
            versions=[-1] * prompt + [0] * n, reward=float(i % 2),
        )  # fmt: skip
        items.append(StepSample(sample, float(rng.normal())))
    weight = step_weight(items, spec.rl.token_weighting, len(items))
    batches = pack_wave(0, items, 1, spec.trainer.micro_batch_tokens, weight, last=True)[0]
    row_tokens = sum(len(mb.tokens) for mb in batches)
    cfg = step_config(example)

    def rate(threads: int):
        def once() -> float:
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            tally = StepTally(cfg.max_lag, "cpu")
            for mb in batches:
                engine.backward(micro_batch_loss(engine, mb, 0, cfg, tally))
            engine.step()
            return row_tokens / (time.perf_counter() - t0)

        return once

    cores = [c for c in (1, 2) if c <= (os.cpu_count() or 1)]
    runs = alternate({str(c): rate(c) for c in cores}, repeats, warmup=2)
    # The pipeline's trainer: one core, an engine decoding on the other (a full batch).
    with side_by_side.running_engines(1, 64, BESIDE_SECONDS):
        beside = [rate(1)() for _ in range(repeats + 1)][1:]
    torch.set_num_threads(os.cpu_count() or 1)
    return {c: summary(runs[str(c)]) for c in cores}, summary(beside)
