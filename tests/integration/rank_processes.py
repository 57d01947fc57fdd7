"""Trainer ranks as processes of their own, for the tests of what happens between them."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipelinerl.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def rank_of_two(code: str, rank: int, port: int, **env: str) -> subprocess.Popen:
    """Rank `rank` of 2 running `code` (Python), with torch's env:// rendezvous at 127.0.0.1:port
    and the trainer's package importable; `env`: more of its environment."""
    environ = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "services/trainer")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    )


def whole_weights(engine) -> torch.Tensor:
    from pipelinerl_trainer.model import full_parameters

    params = list(engine.module.parameters())
    with full_parameters(engine, params):  # whole, under ZeRO-3
        return torch.cat([p.detach().float().flatten() for p in params])


def trainer_rank_job(rank: int, port: int, model: str, backend: str, stage: int = 1, **trainer):
    """The rank's process made one of a two-pod trainer (gloo on CPU in float32; NCCL in bfloat16,
    both ranks on one GPU); the job both build engines for (`trainer`: more of its trainer fields)."""
    gpu = backend == "nccl"
    if gpu:  # two ranks on one GPU: each its own host id, so NCCL takes its socket transport
        os.environ["NCCL_HOSTID"] = f"pod-{rank}"
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK="0",  # one rank per pod
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from pipelinerl.spec import parse_job
    from pipelinerl_trainer.model import init_distributed

    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "ck"},
            "spec": {
                "model": {"path": model, "dtype": "bfloat16" if gpu else "float32"},
                "trainer": {"replicas": WORLD, "zeroStage": stage, **trainer},
            },
        }
    )
    init_distributed(gpu, 60)
    return job


def end_ranks() -> None:
    """The rank's groups ended as the trainer ends them: left to the interpreter's exit, gloo's
    threads now and then abort the process (SIGABRT: 'terminate called without an active exception')."""
    import torch.distributed as dist

    dist.destroy_process_group()


def run_ranks(target, tmp_path: Path, model: Path, backend: str, *more) -> dict:
    """Both ranks of `target` run to their result (rank, *rest), which is returned by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    args = [(r, port, str(model), str(tmp_path), out, backend, *more) for r in range(WORLD)]
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + 240
    try:
        while len(results) < WORLD:
            # A rank that dies leaves the other blocked in a collective: fail at once, not at the deadline.
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"rank exit codes {dead}, results {sorted(results)}"
            try:
                rank, *rest = out.get(timeout=1)
                results[rank] = rest
            except queue.Empty:
                pass
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results
