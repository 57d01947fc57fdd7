"""The trainer's side of a weight update's data: the model packed into one flat buffer per
bucket (`Snapshot`), where the transport sends from, kept between updates so that a generator
that joins later gets the last version sent without the trainer ranks gathering again; and
where that copy lives (`snapshot_in_host`). The transport itself: `pipelinerl.weight_group`."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from pipelinerl.weight_group import DTYPES, bucket_nbytes, side_stream

SEND_RING = 2  # a host snapshot's bucket buffers on the sender's GPU (`Snapshot`)
# The trainer's snapshot stays on its GPU only where the whole model takes at most this share of
# the GPU's memory (bfloat16 on an 80 GB H100: up to ~10B parameters, so a 7B model's 15 GB stays,
# as at the paper's scale; 14B and larger are kept in host memory: `snapshot_in_host`). DeepSpeed
# keeps no budget for it: the ZeRO states (16 bytes a parameter in mixed precision, over the
# ranks under ZeRO-3: 15 GB a GPU for 7B over 8), the gathered layers and a step's activations
# share the GPU with it.
SNAPSHOT_GPU_SHARE = 0.25


def snapshot_in_host(model_bytes: int, device: torch.device, gpu_bytes: int | None = None) -> bool:
    """Whether the trainer's snapshot of a model of `model_bytes` (in the planned dtypes) is kept
    in host memory and sent through the GPU bucket by bucket (`Snapshot`): only for a GPU
    transport, where the model is more than SNAPSHOT_GPU_SHARE of the GPU's memory (`gpu_bytes`:
    the device's total where not given). Such an update costs a copy to the host as it is packed
    and a copy back as it is sent, and host memory the size of the model on rank 0's node."""
    if device.type != "cuda":
        return False
    total = gpu_bytes if gpu_bytes is not None else torch.cuda.get_device_properties(device).total_memory
    return model_bytes > SNAPSHOT_GPU_SHARE * total


def pinned_bytes(buckets: list[dict[str, Any]]) -> int:
    """What a snapshot in host memory pins: torch's pinned-memory allocator rounds each buffer up
    to a power of two."""
    return sum(1 << (n - 1).bit_length() for n in map(bucket_nbytes, buckets) if n)


class Snapshot:
    """Weights packed into one flat buffer per bucket, where the transport sends from: the
    trainer keeps the last version sent, so a generator that joins later gets it without the
    trainer ranks gathering again. One copy of the model, on the transport's `device` (host
    memory with gloo, GPU memory with NCCL) or, `in_host`, in host memory (pinned where the
    transport is a GPU), each bucket copied into a ring of SEND_RING bucket buffers on `device`
    as it is sent: what a model that would take too much of the trainer's GPU costs there
    (`snapshot_in_host`)."""

    def __init__(self, buckets: list[dict[str, Any]], device: torch.device, in_host: bool = False) -> None:
        self.buckets, self.device, self.in_host = buckets, device, in_host
        home, pinned = (torch.device("cpu"), device.type == "cuda") if in_host else (device, False)
        self.buffers = [
            torch.empty(b["numel"], dtype=DTYPES[b["dtype"]], device=home, pin_memory=pinned) for b in buckets
        ]
        self.version: int | None = None  # of the weights packed (None: nothing yet)
        # In host memory: SEND_RING buffers of the largest bucket on `device`, allocated now (beside
        # training, a GPU out of memory would fail an update mid-run instead of the start).
        nbytes = max(map(bucket_nbytes, buckets), default=0)
        slots = min(SEND_RING, len(buckets)) if in_host else 0
        self._ring = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]

    def stage(self, index: int) -> torch.Tensor:
        """Bucket `index`'s buffer as the transport sends it: the buffer itself, or (in host memory) its
        copy in ring slot index % SEND_RING, queued on the current stream (from pinned memory:
        the host goes on). The caller queues it once the broadcast of the bucket that slot held
        was waited for on that stream (`WeightGroup.broadcast`: while the broadcast of the bucket
        in the other slot is under way), so it never overwrites a bucket still being sent."""
        buf = self.buffers[index]
        if not self.in_host:
            return buf
        slot = self._ring[index % SEND_RING][: bucket_nbytes(self.buckets[index])].view(buf.dtype)
        slot.copy_(buf, non_blocking=True)
        return slot

    def handoff(self) -> contextlib.AbstractContextManager:
        """What a thread that sends the buffers while the caller trains on sends them in. On a GPU,
        a stream of its own (`side_stream`) that waits for the packing queued so far on the
        caller's stream, and for nothing else: a collective waits for the current stream of the thread that issues it,
        and its `wait()` makes that stream wait for it, while every thread's current stream starts
        as the device's default one, the one training runs on: on it, the broadcast would wait for
        the training kernels queued before each bucket and hold back those queued after. The
        group's blocking wait returns once a bucket is sent, so the buffers are free again once
        the thread ends. On CPU the copies are done already."""
        device = self.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        packed = torch.cuda.Event()
        packed.record(torch.cuda.current_stream(device))

        @contextlib.contextmanager
        def on_its_own_stream():
            torch.cuda.set_device(device)
            stream = side_stream(device)
            stream.wait_event(packed)
            try:
                with torch.cuda.stream(stream):
                    yield
            finally:  # failed too: nothing it queued is left reading the buffers the next send packs
                stream.synchronize()

        return on_its_own_stream()

    def pack(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy bucket `index`'s tensors (by name) into its buffer, casting to the planned dtype."""
        buf = self.buffers[index]
        for t in self.buckets[index]["tensors"]:
            src = tensors[t["name"]].detach()
            if list(src.shape) != list(t["shape"]):
                raise ValueError(f"{t['name']}: shape {list(src.shape)} != planned {t['shape']}")
            buf[t["offset"] : t["offset"] + t["numel"]].copy_(src.reshape(-1))
