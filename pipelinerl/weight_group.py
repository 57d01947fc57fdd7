"""Trainer -> generator weight broadcast over a dedicated process group.

One implementation serves both sides: the trainer (rank 0, TCPStore master)
calls ``broadcast`` with its ``Snapshot`` (`pipelinerl.weight_snapshot`); each
generator worker calls ``receive_buckets``.
The group is built from its own TCPStore/PrefixStore so it never touches the
default group that DeepSpeed (or vLLM) owns. Two transports behind it
(`weightSync.backend`): gloo moves host buffers (CPU, and GPUs at the cost of
a copy each way); NCCL moves CUDA buffers from GPU to GPU, no host round trip.

Bucket plans are plain lists/dicts/str/int so they can travel through
msgpack (vLLM ``collective_rpc`` args, NATS). Tensors never do.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from pipelinerl.awake import AwakeClock

GROUP_PREFIX = "pipelinerl-weights"
# How long the trainer waits for a new epoch's members to say they are joining. They said hello,
# so they are up, but joining still takes each a NATS round trip, a vLLM collective_rpc, closing
# its previous group and connecting to the store; a member started beside the trainer (a test's or
# a benchmark's spawned process) must first import torch and create its CUDA context, which alone
# takes several seconds (4.8 s measured for the import and join on a 2-core CPU machine). A member
# that never comes costs the trainer this wait once per epoch tried. Never longer than the members
# themselves wait for `go` (the weight-sync timeout): by then they have given up.
JOIN_TIMEOUT_S = 30.0
JOIN_POLL_S = 0.01  # how often the trainer looks for the members' `joining` keys

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Receive buffers a receiver cycles through: bucket i arrives in buffer i % RECEIVE_RING while
# the loader still copies out of bucket i - 1. Two bound the update's transfer memory at two
# buckets, whatever the model's size (one per bucket was the whole unsharded model, kept).
RECEIVE_RING = 2
_ENV_LOCK = threading.Lock()


class Outgoing(Protocol):
    """What `WeightGroup.broadcast` sends: the trainer's snapshot (`pipelinerl.weight_snapshot`)."""

    device: torch.device
    buffers: list[torch.Tensor]

    def stage(self, index: int) -> torch.Tensor: ...


class WeightSyncError(RuntimeError):
    """The weight group cannot be formed or used."""


class WeightSyncTimeout(WeightSyncError):
    """A weight-group rendezvous or broadcast did not complete in time."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported weight dtype {dtype}") from None


def plan_buckets(named_shapes_dtypes: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[dict[str, Any]]:
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
        fits = cur is not None and cur["dtype"] == dtype and (cur["numel"] + numel) * itemsize <= bucket_bytes
        if not fits:
            cur = {"dtype": dtype, "numel": 0, "tensors": []}
            buckets.append(cur)
        assert cur is not None
        cur["tensors"].append({"name": name, "shape": [int(d) for d in shape], "offset": cur["numel"], "numel": numel})
        cur["numel"] += numel
    return buckets


def bucket_nbytes(bucket: dict[str, Any]) -> int:
    """A planned bucket's size in bytes (its flat buffer's)."""
    return bucket["numel"] * DTYPES[bucket["dtype"]].itemsize


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


def buffer_device(backend: str) -> torch.device:
    """Where a transport moves buffers from: host memory (gloo), or this process's GPU (NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def open_store(
    host: str, port: int, is_master: bool, timeout_s: float, what: str = "weight group rendezvous"
) -> dist.Store:
    """The rendezvous store: trainer rank 0 serves it for its lifetime (every epoch's group meets
    in it under its own prefix); each generator connects to it to join an epoch. The server
    listens on `host` where it names one address (a local run's loopback): torch's own server
    listens on every address whatever it is given, so it is handed a socket bound here. (The
    trainer ranks' own store is served so too: `what` names it in errors.)"""
    try:
        fd = None
        if is_master and host not in ("", "0.0.0.0", "::"):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            fd = socket.create_server((host, port), family=family).detach()  # the store's now: it closes it
        return dist.TCPStore(
            host, port, None, is_master, timedelta(seconds=timeout_s), wait_for_workers=False, master_listen_fd=fd
        )
    except OSError as e:  # the address taken or not this machine's
        raise WeightSyncTimeout(f"{what} at {host}:{port}: cannot serve: {e}") from e
    except RuntimeError as e:  # DistStoreError subclasses RuntimeError
        side = "cannot serve" if is_master else "no trainer"
        raise WeightSyncTimeout(f"{what} at {host}:{port}: {side} (timeout {timeout_s:g} s): {e}") from e


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float):
    """The single seam where the transport is chosen. NCCL needs the process's CUDA device set
    (``torch.cuda.set_device``) first.

    NCCL is built with blocking wait for this group alone (ProcessGroupNCCL reads the variable in
    its constructor): it then runs no watchdog thread, and `wait()` polls the collective on the
    calling thread, aborts the group's communicator on a timeout or an NCCL error (a lost peer)
    and raises DistBackendError, as gloo raises. By default the watchdog would instead kill the
    process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3). The process's other groups (DeepSpeed's, vLLM's)
    keep torch's defaults. Every collective here is issued asynchronously and waited on: a
    synchronous one returns no work to wait on, and would have no timeout at all.

    Its collectives run on a stream NCCL draws from torch's high-priority pool at the set-up of
    each epoch's communicator: drawn round-robin from the default pool, which vLLM's and
    DeepSpeed's streams come from, it would now and then be the engine's compute stream, and a
    broadcast waiting for its peers would hold up every decode step queued behind it."""
    timeout = timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = True
        with _environ(**NCCL_ENVIRONMENT):
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except RuntimeError as e:  # gloo connect errors subclass RuntimeError
        raise WeightSyncTimeout(
            f"weight group (rank {rank}/{world_size}) could not connect (timeout {timeout_s:g} s): {e}"
        ) from e


NCCL_ENVIRONMENT = {"TORCH_NCCL_BLOCKING_WAIT": "1"}  # what an NCCL weight group's constructor reads
NCCL_DEFAULTS = {"TORCH_NCCL_BLOCKING_WAIT": "0"}  # torch's own, for the process's other groups


def reserve_nccl_environment() -> None:
    """Put NCCL_ENVIRONMENT's names in the environment at torch's defaults where absent: at the
    start of a process that makes weight groups, before any thread (a pod's entrypoint). Every
    later change of them (`_environ`) then replaces a value, which glibc's
    setenv does in place (one pointer, the old string kept); adding a name reallocates the array
    NCCL's and torch's own threads may be reading with getenv at that moment, removing one shifts it."""
    for k, v in NCCL_DEFAULTS.items():
        os.environ.setdefault(k, v)


@contextlib.contextmanager
def _environ(**values: str):
    """Environment variables set while a constructor reads them, then restored (one at a time:
    the environment is the process's; its names reserved at the start, `reserve_nccl_environment`)."""
    with _ENV_LOCK:
        values = {k: v for k, v in values.items() if os.environ.get(k) != v}
        before = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextlib.contextmanager
def received_whole(weights: Iterator[tuple[str, torch.Tensor]]):
    """Load from `weights` (`WeightGroup.receive_buckets`) inside it: a load that raises before it
    took them all (a loader's error, nothing to do with the transfer) has the rest received
    anyway, unused, before its error goes on. A broadcast needs every member: the trainer and the
    other members would otherwise wait for this one to the group's timeout, and all lose the
    update (a tensor-parallel engine receiving inside its pause, paused that long). A transfer
    that failed has ended the iterator: nothing more is received."""
    try:
        yield weights
    except Exception:
        with contextlib.suppress(Exception):
            for _ in weights:
                pass
        raise


def join_window(timeout_s: float, join_timeout_s: float | None = None) -> float:
    """The trainer's wait for an epoch's `joining` keys: `join_timeout_s` where given, else
    JOIN_TIMEOUT_S capped at the group's `timeout_s` (a member's own wait for `go`)."""
    if join_timeout_s is not None:
        return join_timeout_s
    return min(JOIN_TIMEOUT_S, timeout_s)


FORM_MARGIN_S = 10.0  # past a `form`'s own waits: the store's round trips, a loaded machine


def form_bound(timeout_s: float) -> float:
    """The longest a trainer's `WeightGroup.form` takes while every wait of ours holds: the join
    window, then the group's connection and its authentication's collective, each within
    `timeout_s`, plus FORM_MARGIN_S. NCCL sets its communicator up inside that first collective,
    where no timeout of ours reaches (a peer dead since it joined can hold it there): the trainer
    bounds the whole `form` with this (`pipelinerl.awake.Watchdog`)."""
    return join_window(timeout_s) + 2 * timeout_s + FORM_MARGIN_S


def proof(token: str, group_id: str, rank: int) -> bytes:
    """What `rank` shows the others of epoch `group_id` to prove it holds the job's token (fresh
    per epoch: group ids never repeat, so a proof seen once is worth nothing later)."""
    return hmac.new(token.encode(), f"{group_id}/{rank}".encode(), hashlib.sha256).digest()


class GroupIncomplete(WeightSyncTimeout):
    """Trainer side: members of a new epoch did not come to its rendezvous in time."""

    def __init__(self, missing: list[int], message: str) -> None:
        super().__init__(message)
        self.missing = missing  # their ranks


class GroupAborted(WeightSyncError):
    """Generator side: the trainer called this epoch off (another member did not come)."""


class WeightGroup:
    """The broadcast group of one membership epoch: rank 0 is the trainer, ranks 1.. are
    generator workers. It meets in the trainer's store under the epoch's own prefix, in two
    phases so that a member that never comes costs a short wait, not a broken group: each member
    says it is joining, and only once all have does the trainer let them build the group."""

    AUTH = "did not prove the job's weight token"

    def __init__(self, store: dist.Store, pg, rank: int, world_size: int, timeout_s: float, backend: str) -> None:
        self.store = store  # keep alive: the group's rendezvous store
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.device = buffer_device(backend)
        # RECEIVE_RING flat byte buffers, kept across updates: fresh large CPU buffers come from
        # mmap untouched and would be page-faulted in on every update (bench/README.md,
        # benchmark 2). Each holds the largest bucket; a bucket is a dtype view of one.
        self._receive_buffers: list[torch.Tensor] = []

    @classmethod
    def form(
        cls,
        store: dist.Store,
        group_id: str,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        join_timeout_s: float | None = None,
        token: str = "",
    ) -> WeightGroup:
        """Trainer side (rank 0) of epoch `group_id`: wait until ranks 1..world_size-1 said they
        are joining, then let them go and connect. Raises GroupIncomplete naming the ranks that
        did not come within the join window (`join_window`: `join_timeout_s`, or by default
        JOIN_TIMEOUT_S capped at `timeout_s`; the others are told to abort), or that came
        without the job's `token` (see `_authenticate`)."""
        check_backend(backend)
        join_timeout_s = join_window(timeout_s, join_timeout_s)
        epoch = dist.PrefixStore(f"{GROUP_PREFIX}/{group_id}", store)
        keys = [f"joining/{r}" for r in range(1, world_size)]
        # The window counts this process's awake time: a trainer frozen in it (a paused pod, its
        # store with it) gives its members what is left of the window on thawing.
        waited = AwakeClock()
        while keys and not epoch.check(keys):
            if waited.now() > join_timeout_s:
                missing = [r for r, key in enumerate(keys, 1) if not epoch.check([key])]
                epoch.set("go", "abort")
                raise GroupIncomplete(
                    missing, f"weight group {group_id}: ranks {missing} did not join within {join_timeout_s:g} s"
                )
            time.sleep(JOIN_POLL_S)
            waited.tick()
        epoch.set("go", "go")
        group = cls(epoch, _process_group(backend, epoch, 0, world_size, timeout_s), 0, world_size, timeout_s, backend)
        refused = group._authenticate(group_id, token)
        if refused:
            raise GroupIncomplete(refused, f"weight group {group_id}: ranks {refused} {cls.AUTH}: refused")
        return group

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        group_id: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        token: str = "",
    ) -> WeightGroup:
        """Generator side: join epoch `group_id` as `rank` (≥ 1): `invitation`, then `accept`."""
        return cls.invitation(host, port, group_id, rank, world_size, timeout_s, backend, token).accept()

    @staticmethod
    def invitation(
        host: str,
        port: int,
        group_id: str,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        token: str = "",
    ) -> Invitation:
        """Generator side, the first half of joining: say this rank is joining epoch `group_id`
        and wait for the trainer's `go`, which comes once every member has said so. The wait
        for the others is here; `Invitation.accept` then connects. Raises GroupAborted if the
        trainer called the epoch off, WeightSyncTimeout if no trainer answers in time."""
        check_backend(backend)
        store = open_store(host, port, False, timeout_s)
        epoch = dist.PrefixStore(f"{GROUP_PREFIX}/{group_id}", store)
        epoch.set(f"joining/{rank}", "1")
        try:
            epoch.wait(["go"], timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise WeightSyncTimeout(
                f"weight group {group_id}: the trainer did not start it within {timeout_s:g} s: {e}"
            ) from e
        if epoch.get("go") == b"abort":
            raise GroupAborted(f"weight group {group_id}: called off by the trainer (a member did not join)")
        return Invitation(epoch, group_id, rank, world_size, timeout_s, backend, token)

    def _authenticate(self, group_id: str, token: str) -> list[int]:
        """Before any weights move, every rank shows every other its proof of the job's token;
        the ranks whose proof is wrong (the group is closed if any). The rendezvous store has no
        access control (anyone who reaches its port may list and write keys, and so take a rank's
        place): this is what keeps an intruder from receiving weights or sending forged ones."""
        mine = torch.frombuffer(bytearray(proof(token, group_id, self.rank)), dtype=torch.uint8).to(self.device)
        shown = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            self.pg.allgather([shown], [mine]).wait()
        except RuntimeError as e:
            self.close()
            raise WeightSyncTimeout(
                f"weight group {group_id}: authentication failed or timed out after {self.timeout_s:g} s: {e}"
            ) from e
        refused = [
            r
            for r, t in enumerate(shown)
            if not hmac.compare_digest(bytes(t.cpu().tolist()), proof(token, group_id, r))
        ]
        if refused:
            self.close()
        return refused

    def _broadcast(self, buf: torch.Tensor, what: str, meanwhile: Callable[[], Any] | None = None) -> Any:
        """Broadcast `buf` and wait for it; `meanwhile` (its result returned) is called once the
        broadcast is issued, before the wait: on a GPU its work is queued on the current stream
        while the collective runs on NCCL's, which waited for the current stream up to its issue."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.monotonic()
        pg = self.pg
        if pg is None:
            raise WeightSyncTimeout(f"weight group closed before {what} (a transfer given up on)")
        try:
            work = pg.broadcast([buf], opts)
            ahead = meanwhile() if meanwhile is not None else None
            work.wait()
        except RuntimeError as e:  # gloo, and NCCL with blocking wait, raise on a timeout or a lost peer
            peers = f"{self.world_size - 1} generators" if self.rank == 0 else "trainer"
            elapsed = time.monotonic() - t0
            # Say which happened: nobody answered in time, or a peer's connection closed early.
            how = (
                f"timed out after {self.timeout_s:g} s"
                if elapsed >= 0.9 * self.timeout_s
                else f"failed after {elapsed:.1f} s: a peer's connection closed (it died or left)"
            )
            raise WeightSyncTimeout(
                f"weight broadcast {'to' if self.rank == 0 else 'from'} {peers} {how} ({what}): {e}"
            ) from e
        if self.pg is None:
            # Closed by another thread meanwhile: gloo's wait raises, but an aborted NCCL
            # communicator's ends its kernel and its wait returns as though done (its work is not
            # checked for errors once aborted), with part of the bucket received.
            raise WeightSyncTimeout(f"weight group closed during {what} (a transfer given up on)")
        return ahead

    def broadcast(self, snapshot: Outgoing) -> None:
        """Sender (rank 0): broadcast each bucket's flat buffer (~2x faster than per-tensor sends)."""
        if self.rank != 0:
            raise RuntimeError("broadcast is for rank 0 (trainer)")
        if snapshot.device != self.device:
            raise ValueError(f"a snapshot for {snapshot.device} sent over a group on {self.device}")
        n = len(snapshot.buffers)
        buf = snapshot.stage(0) if n else None
        for i in range(n):
            assert buf is not None
            # A host snapshot's next bucket is copied into the other slot while this one is sent.
            following = (lambda i=i: snapshot.stage(i + 1)) if i + 1 < n else None
            what = f"bucket {i + 1}/{n}, {buf.numel() * buf.element_size()} bytes"
            buf = self._broadcast(buf, what, following)

    def receive_buckets(self, buckets: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: yields (name, tensor) views, receiving each bucket lazily into the ring of
        RECEIVE_RING buffers. A view is overwritten when the bucket RECEIVE_RING places later
        arrives: consume it before asking for more (a loader that copies as it goes), or clone it.
        On a GPU the copies may still be queued when the next receive is issued: both run in
        stream order (NCCL's stream waits for the current one), so nothing is overwritten early.

        The caller must exhaust the iterator; otherwise the sender blocks and
        then fails with WeightSyncTimeout.
        """
        if self.rank == 0:
            raise RuntimeError("receive_buckets is for ranks >= 1 (generators)")
        self._size_ring(buckets)
        for i, b in enumerate(buckets):
            buf = self._receive_buffers[i % RECEIVE_RING][: bucket_nbytes(b)].view(DTYPES[b["dtype"]])
            self._broadcast(buf, f"bucket {i + 1}/{len(buckets)}")
            for t in b["tensors"]:
                yield t["name"], buf[t["offset"] : t["offset"] + t["numel"]].view(t["shape"])

    def synchronize(self) -> None:
        """Wait until the GPU has finished what was queued with the received tensors (the loader's
        copies), so a model swapped in next reads complete weights. Nothing to wait for on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _size_ring(self, buckets: list[dict[str, Any]]) -> None:
        """Allocate the ring at the largest bucket's size at once: grown bucket by bucket, each
        buffer outgrown would stay reserved by CUDA's caching allocator, beside the memory plan."""
        nbytes = max(map(bucket_nbytes, buckets), default=0)
        slots = min(RECEIVE_RING, len(buckets))
        ring = self._receive_buffers
        if len(ring) < slots or ring[0].numel() < nbytes:
            ring.clear()  # freed before the new ones are allocated
            ring.extend(torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(slots))

    def close(self) -> None:
        """Release the group: aborted, never shut down. NCCL's shutdown flushes the communicator
        (ncclCommFinalize, then ncclCommDestroy), which waits for its peers: a group closed because
        a member was lost (a new epoch, a failed broadcast) would hold the caller there, an engine
        core's thread until its call is given up on. Abort ends at once, and ends a collective
        another thread still waits in (a transfer given up on: its wait raises, as a lost peer's
        would). A process group without `abort` is shut down."""
        pg, self.pg = self.pg, None  # type: ignore[assignment]
        if pg is not None:
            ending = getattr(pg, "abort", None) or getattr(pg, "shutdown", None)
            if ending is not None:
                try:
                    ending()
                except Exception:
                    pass
        self.store = None  # type: ignore[assignment]
        self._receive_buffers = []


@dataclass
class Invitation:
    """A generator's place in an epoch the trainer has let go (`WeightGroup.invitation`)."""

    epoch: dist.Store
    group_id: str
    rank: int
    world_size: int
    timeout_s: float
    backend: str
    token: str

    def accept(self) -> WeightGroup:
        """Connect to the epoch's members and prove the job's token to them. Raises GroupAborted
        where a member (the trainer included) lacks it, WeightSyncTimeout where one does not come.
        Over NCCL the communicator is set up here (its first collective), on this thread's device,
        once the device's queued work has ended: a vLLM worker accepts between steps, but its last
        step may still run (async scheduling), and its tensor-parallel all-reduces beside this
        communicator's first kernels could deadlock (two communicators on one GPU)."""
        if self.backend == "nccl":
            torch.cuda.synchronize()
        pg = _process_group(self.backend, self.epoch, self.rank, self.world_size, self.timeout_s)
        group = WeightGroup(self.epoch, pg, self.rank, self.world_size, self.timeout_s, self.backend)
        refused = group._authenticate(self.group_id, self.token)
        if refused:
            raise GroupAborted(f"weight group {self.group_id}: ranks {refused} (0: the trainer) {WeightGroup.AUTH}")
        return group


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream weight transfers beside the main work run on (a generator's staged update, the
    trainer's broadcast in flight): one per device for the process's life, at a raised priority.
    torch hands out pool streams round-robin, 32 per priority, and vLLM and DeepSpeed draw theirs
    from the default priority's pool: a stream drawn there for every transfer would be one of
    theirs every 32nd time (a transfer then stalling the decode steps, or the gradient reductions,
    queued behind it), and the caching allocator reuses a block only on the stream that freed it.
    No stream of vLLM's or DeepSpeed's is drawn at a raised priority."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device]
