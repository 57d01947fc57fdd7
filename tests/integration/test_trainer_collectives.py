"""Two trainer ranks in a collective of a group with torch's default timeout, as DeepSpeed runs
ZeRO's gradient all-reduce (a clone of the world group: 30 minutes for gloo, 10 for NCCL), when
one of them is killed (SIGKILL) or frozen (SIGSTOP: a node that stops answering keeps its
connections open). The other is ended within the ranks' watch's bound (pipelinerl_trainer.peers),
by the watch or, where its transport noticed first, by the collective's own error: the test says
which. gloo here; NCCL on a GPU (two ranks on one GPU, NCCL's socket transport between them: each
process its own NCCL_HOSTID), in `bash bench/gpu_check.sh`."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
from rank_processes import rank_of_two  # tests/integration/rank_processes.py
import torch

GPUS = torch.cuda.device_count()
BOUND_S = 4.0  # the watch's bound (weightSync.timeoutSeconds in a job)

pytestmark = pytest.mark.slow


def rank_process(rank: int, port: int, backend: str) -> subprocess.Popen:
    """Trainer rank `rank` of 2: the world group (5 x the bound, as the trainer makes it), a group
    of torch's default timeout, the watch, then all-reduces in that group until it is ended."""
    device = "cuda" if backend == "nccl" else "cpu"
    code = textwrap.dedent(
        f"""
        import logging, os, sys
        from datetime import timedelta
        import torch, torch.distributed as dist
        from pipelinerl_trainer.peers import PeerWatch
        logging.basicConfig()
        if "{backend}" == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group("{backend}", timeout=timedelta(seconds={5 * BOUND_S}))
        group = dist.new_group([0, 1])
        watch = PeerWatch.of_ranks("127.0.0.1", {port}, {rank}, 2, {BOUND_S})
        x = torch.ones(1 << 18, device="{device}")
        dist.all_reduce(x, group=group)
        if "{backend}" == "nccl":
            torch.cuda.synchronize()
        print("reducing", flush=True)
        while True:
            dist.all_reduce(x, group=group)
            x.div_(2)
            if "{backend}" == "nccl":
                torch.cuda.synchronize()
        """
    )
    # One GPU: two "hosts" (PLATFORM.md).
    return rank_of_two(code, rank, port, NCCL_HOSTID=f"trainer-rank-{rank}")


@pytest.mark.parametrize("fault", ["killed", "frozen"])
@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")])],
)
def test_a_rank_killed_or_frozen_in_a_collective_ends_the_other_within_the_bound(port, backend, fault):
    ranks = [rank_process(r, port, backend) for r in (0, 1)]
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline() == "reducing\n", p.stderr.read() if p.stderr else ""
        os.kill(ranks[1].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        code = ranks[0].wait(timeout=BOUND_S + 60)
        ended_s = time.monotonic() - t0
        log = ranks[0].stderr.read() if ranks[0].stderr else ""
        by_watch = "trainer rank 1 said nothing" in log
        how = "by the watch" if by_watch else "by its collective: " + log.strip().splitlines()[-1][:160]
        print(f"NOTE {backend}, rank 1 {fault}: rank 0 ended after {ended_s:.1f} s (code {code}), {how}")
        assert code != 0 and ended_s <= BOUND_S + 5.0, log[-2000:]
        if fault == "frozen":  # nothing closed: no transport can notice, only the watch
            assert by_watch and code == 1, log[-2000:]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
