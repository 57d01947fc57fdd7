"""A weight group's receive where NCCL and gloo differ: what gloo shows here for itself, NCCL's
side stands in for (no GPU in CI; bench/gpu_check.sh runs the real one)."""

from __future__ import annotations

import pytest
import torch

from pipelinerl.weight_group import WeightGroup, WeightSyncTimeout, plan_buckets


def test_a_wait_that_returns_after_its_group_was_closed_raises():
    """NCCL's semantics, which gloo here cannot show: a communicator aborted by another thread
    (an engine closing the group of a transfer it gave up on) ends its pending broadcast's kernel,
    and the broadcast's wait then returns as though it were done, its work no longer checked for
    errors. The bucket holds part of the weights: the receive must raise, as gloo's does."""

    class Work:
        def wait(self) -> bool:
            group.close()  # the other thread's close, while this one waits
            return True

    class AbortedNccl:  # a stand-in for NCCL's process group (no GPU here)
        aborted = False

        def broadcast(self, tensors, opts):
            return Work()

        def abort(self):
            self.aborted = True

    pg = AbortedNccl()
    group = WeightGroup(None, pg, 1, 2, 5.0, "gloo")  # type: ignore[arg-type]
    buckets = plan_buckets([("w", [4], "float32")], 4096)
    with pytest.raises(WeightSyncTimeout, match="closed during bucket 1/1"):
        list(group.receive_buckets(buckets))
    assert pg.aborted
    with pytest.raises(WeightSyncTimeout, match="closed before"):
        group._broadcast(torch.zeros(4), "bucket 2/2")


def test_a_group_is_closed_by_abort_never_by_a_shutdown_that_waits_for_its_peers():
    """NCCL's shutdown flushes the communicator (ncclCommFinalize, ncclCommDestroy) and waits for
    its peers: a healthy group closed as a member was lost (a new epoch) would hold the closing
    engine core there. Every close aborts. Before, a group whose collectives had all succeeded was
    shut down."""
    calls: list[str] = []

    class Nccl:  # a stand-in for NCCL's process group (no GPU here)
        def abort(self):
            calls.append("abort")

        def shutdown(self):
            calls.append("shutdown")

    WeightGroup(None, Nccl(), 1, 2, 5.0, "gloo").close()  # type: ignore[arg-type]
    assert calls == ["abort"]
