"""Trainer -> generator weight broadcast over a dedicated process group.

One implementation serves both sides: the trainer (rank 0, TCPStore master)
calls ``broadcast_buckets``; each generator worker calls ``receive_buckets``.
The group is built from its own TCPStore/PrefixStore so it never touches the
default group that DeepSpeed (or vLLM) owns. Two transports behind it
(`weightSync.backend`): gloo moves host buffers (CPU, and GPUs at the cost of
a copy each way); NCCL moves CUDA buffers from GPU to GPU, no host round trip.

Bucket plans are plain lists/dicts/str/int so they can travel through
msgpack (vLLM ``collective_rpc`` args, NATS). Tensors never do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GROUP_PREFIX = "pipelinerl-weights"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """The weight group cannot be formed or used."""


class WeightSyncTimeout(WeightSyncError):
    """A weight-group rendezvous or broadcast did not complete in time."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported weight dtype {dtype}") from None


def plan_buckets(
    named_shapes_dtypes: list[tuple[str, list[int], str]], bucket_bytes: int
) -> list[dict[str, Any]]:
    """Group same-dtype tensors, in order, into flat buckets of <= bucket_bytes.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Order is
    preserved so receivers feed the loader layer by layer (vLLM's layerwise
    reload buffers less when a layer's weights arrive together).
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for name, shape, dtype in named_shapes_dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"{name}: unsupported dtype {dtype!r}")
        numel = 1
        for d in shape:
            numel *= int(d)
        itemsize = DTYPES[dtype].itemsize
        fits = (
            cur is not None
            and cur["dtype"] == dtype
            and (cur["numel"] + numel) * itemsize <= bucket_bytes
        )
        if not fits:
            cur = {"dtype": dtype, "numel": 0, "tensors": []}
            buckets.append(cur)
        assert cur is not None
        cur["tensors"].append(
            {"name": name, "shape": [int(d) for d in shape], "offset": cur["numel"], "numel": numel}
        )
        cur["numel"] += numel
    return buckets


def check_backend(backend: str) -> None:
    """Refuse a transport this process cannot run, with the reason (never swapped silently)."""
    if backend == "gloo":
        return
    if backend != "nccl":
        raise ValueError(f"weightSync.backend: unknown transport {backend!r} (gloo or nccl)")
    if not dist.is_nccl_available():
        raise WeightSyncError("weightSync.backend is nccl but this torch build has no NCCL (a CPU build?)")
    if not torch.cuda.is_available():
        raise WeightSyncError("weightSync.backend is nccl but no CUDA device is visible to this process")


def make_group(
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    is_master: bool,
) -> tuple[dist.Store, dist.ProcessGroup]:
    """The single seam where the transport is chosen: a gloo or NCCL backend on the group's
    own store. NCCL needs the process's CUDA device set (``torch.cuda.set_device``) first."""
    check_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    try:
        # Master (trainer) waits for all world_size clients to connect; clients
        # wait for the master. Both bounded by `timeout`.
        store = dist.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout)
        prefixed = dist.PrefixStore(GROUP_PREFIX, store)
        if backend == "gloo":
            pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except RuntimeError as e:  # DistStoreError / gloo connect errors subclass RuntimeError
        raise WeightSyncTimeout(
            f"weight group rendezvous at {host}:{port} (rank {rank}/{world_size}) "
            f"failed (timeout {timeout_s:g} s): {e}"
        ) from e
    return store, pg


class WeightGroup:
    """A broadcast group: rank 0 is the trainer, ranks 1.. are generator workers."""

    def __init__(self, store: dist.Store, pg: dist.ProcessGroup, rank: int, world_size: int,
                 timeout_s: float, backend: str = "gloo") -> None:
        self.store = store  # keep alive: the group's rendezvous store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        # Buffers live where the transport moves them from: host memory (gloo), or this
        # process's current GPU (NCCL).
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # Flat buffers kept across updates: fresh large CPU buffers come from mmap untouched
        # and would be page-faulted in on every update (bench/README.md, benchmark 2).
        # Costs one model copy in the receiver's memory and the largest bucket in the sender's.
        self._send_buffers: dict[str, torch.Tensor] = {}  # dtype -> scratch, reused per bucket
        self._receive_buffers: dict[int, torch.Tensor] = {}  # bucket index -> buffer (see receive_buckets)

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float,
               is_master: bool | None = None, backend: str = "gloo") -> "WeightGroup":
        if is_master is None:
            is_master = rank == 0
        store, pg = make_group(backend, host, port, rank, world_size, timeout_s, is_master)
        return cls(store, pg, rank, world_size, timeout_s, backend)

    def _broadcast(self, buf: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([buf], opts).wait()
        except RuntimeError as e:  # gloo raises RuntimeError on timeout / peer loss
            peers = f"{self.world_size - 1} generators" if self.rank == 0 else "trainer"
            raise WeightSyncTimeout(
                f"weight broadcast {'to' if self.rank == 0 else 'from'} {peers} "
                f"failed or timed out after {self.timeout_s}s ({what}): {e}"
            ) from e

    def broadcast_buckets(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        buckets: list[dict[str, Any]],
    ) -> None:
        """Sender (rank 0): flatten each bucket into one buffer and broadcast it.

        One flat buffer per bucket is ~2x faster than per-tensor sends.
        """
        if self.rank != 0:
            raise RuntimeError("broadcast_buckets is for rank 0 (trainer)")
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        for i, b in enumerate(buckets):
            buf = self._send_buffer(b)
            for t in b["tensors"]:
                src = tensors[t["name"]].detach()
                if list(src.shape) != list(t["shape"]):
                    raise ValueError(f"{t['name']}: shape {list(src.shape)} != planned {t['shape']}")
                buf[t["offset"]: t["offset"] + t["numel"]].copy_(src.reshape(-1))  # casts dtype
            self._broadcast(buf, f"bucket {i + 1}/{len(buckets)}, {buf.numel() * buf.element_size()} bytes")

    def receive_buckets(self, buckets: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: yields (name, tensor) views, receiving each bucket lazily. The views
        share buffers with the next call's: copy what must outlive it.

        The caller must exhaust the iterator; otherwise the sender blocks and
        then fails with WeightSyncTimeout.
        """
        if self.rank == 0:
            raise RuntimeError("receive_buckets is for ranks >= 1 (generators)")
        for i, b in enumerate(buckets):
            buf = self._receive_buffer(i, b)
            self._broadcast(buf, f"bucket {i + 1}/{len(buckets)}")
            for t in b["tensors"]:
                yield t["name"], buf[t["offset"]: t["offset"] + t["numel"]].view(t["shape"])

    def synchronize(self) -> None:
        """Wait until the GPU has finished what was queued with the received tensors (the loader's
        copies), so a model swapped in next reads complete weights. Nothing to wait for on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _send_buffer(self, bucket: dict[str, Any]) -> torch.Tensor:
        # One scratch buffer per dtype: each broadcast completes before the next bucket is filled.
        dtype = bucket["dtype"]
        buf = self._send_buffers.get(dtype)
        if buf is None or buf.numel() < bucket["numel"]:
            buf = self._send_buffers[dtype] = torch.empty(bucket["numel"], dtype=DTYPES[dtype], device=self.device)
        return buf[: bucket["numel"]]

    def _receive_buffer(self, i: int, bucket: dict[str, Any]) -> torch.Tensor:
        # One buffer per bucket, not shared within an update: the loader may hold views of
        # earlier buckets until their layer is complete. The next update reuses them: by
        # then the loader has copied everything into the model.
        dtype = DTYPES[bucket["dtype"]]
        buf = self._receive_buffers.get(i)
        if buf is None or buf.numel() != bucket["numel"] or buf.dtype != dtype:
            buf = self._receive_buffers[i] = torch.empty(bucket["numel"], dtype=dtype, device=self.device)
        return buf

    def close(self) -> None:
        # ProcessGroupGloo has no explicit shutdown in all torch versions;
        # dropping references closes its sockets.
        pg, self.pg = self.pg, None  # type: ignore[assignment]
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass
        self.store = None  # type: ignore[assignment]
        self._send_buffers, self._receive_buffers = {}, {}
