"""The trainer's ranks stop together, at the same micro-batch of a step, so that they meet in the
stop checkpoint's collectives.

A rank is asked to stop by its own SIGTERM (a drain, a suspend, Ctrl-C) or by another rank's: the
word goes round the ranks' store with their beats (`peers.PeerWatch.asked`), since a drain ends
one pod only. Asked, a rank takes no more micro-batches, but the others may hold theirs: under
ZeRO-1/2 ranks train up to a step's micro-batches apart, and under ZeRO-3 each forward is a
collective. A rank that went to the checkpoint's `all_gather` while another trained on would
meet it in different collectives, and both would end without the checkpoint. So before each
micro-batch every rank votes whether to stop (`StopVote`: an all-reduce of one flag, MAX), and
every rank stops at the first micro-batch any rank voted to stop at, having trained as many of
the step's micro-batches as the others. The step cut short is trained again in full after the
restart, from the checkpoint of the step before.

The vote runs on a gloo group of its own, on a CPU tensor: on GPUs it does not wait for the
device (the step reads it once, by design), and it waits for a rank still waiting for its
micro-batch without blocking this rank's duties meanwhile (`while_waiting`, rank 0's weight group)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

WAITING_TICK_S = 1.0  # while the others have not voted: `while_waiting` this often


class StopVote:
    """Whether the ranks stop at this micro-batch: any rank's yes, on every rank. `group`: the gloo
    group the vote runs in; None for a gang of one (its own word)."""

    def __init__(self, group) -> None:
        self.group = group

    @classmethod
    def of_ranks(cls, world: int, timeout_s: float) -> StopVote:
        """Every rank makes it at the same point (a group is made collectively); `timeout_s`:
        the longest a rank waits for another's vote, which waits as long for its micro-batch."""
        if world == 1:
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    def __call__(self, stopping: bool, while_waiting: Callable[[], None] = lambda: None) -> bool:
        if self.group is None:
            return stopping
        flag = torch.tensor([int(stopping)], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        while True:
            try:  # a wait bounded by a timeout raises at it, the vote going on (torch's Work.wait)
                work.wait(timeout=timedelta(seconds=WAITING_TICK_S))
                break
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # the vote's own failure (a rank gone) raises here
                    break
                while_waiting()
        return bool(flag.item())
