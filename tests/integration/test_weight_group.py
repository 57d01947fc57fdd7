"""pipelinerl.weight_group: bucket plans, a real multi-process gloo broadcast, epochs whose
missing members are named and whose others are told to abort, clear timeouts; the NCCL transport
refused where it cannot run, and run for real where GPUs are (marked `gpu`)."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import os
import queue
import subprocess
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipelinerl.spec import parse_job
from pipelinerl.weight_group import (
    GROUP_PREFIX,
    JOIN_TIMEOUT_S,
    GroupAborted,
    GroupIncomplete,
    WeightGroup,
    WeightSyncError,
    received_whole,
    WeightSyncTimeout,
    bucket_nbytes,
    dtype_name,
    join_window,
    open_store,
    plan_buckets,
)
from pipelinerl.weight_snapshot import Snapshot, pinned_bytes, snapshot_in_host

HOST = "127.0.0.1"
GPUS = torch.cuda.device_count()


def plan_buckets_for(tensors, bucket_bytes):
    return plan_buckets([(n, list(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()], bucket_bytes)


def send(group, tensors, buckets, in_host=False, snapshot=None):
    """Pack `tensors` and broadcast them as the trainer does in flight: from a thread of its own,
    in the stream `Snapshot.handoff` gives it. Returns the snapshot (pass it back to reuse it)."""
    snapshot = snapshot or Snapshot(buckets, group.device, in_host)
    for i in range(len(buckets)):
        snapshot.pack(i, tensors)
    handoff, failed = snapshot.handoff(), []

    def fly():
        try:
            with handoff:
                group.broadcast(snapshot)
        except BaseException as err:  # noqa: BLE001 - raised in the test's thread
            failed.append(err)

    flight = threading.Thread(target=fly)
    flight.start()
    flight.join()
    if failed:
        raise failed[0]
    return snapshot


def reap(procs) -> None:
    """Member processes ended: joined, or killed after 10 s."""
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def names(buckets):
    return [[t["name"] for t in b["tensors"]] for b in buckets]


# --- bucket planning (pure) ---------------------------------------------------------------


def test_plan_groups_same_dtype_in_order_up_to_the_byte_limit():
    spec = [
        ("a", [4], "float32"),
        ("b", [2, 2], "float32"),
        ("c", [3], "float32"),
        ("d", [8], "bfloat16"),
        ("e", [8], "bfloat16"),
        ("f", [1], "float32"),
        ("g", [5], "float16"),
    ]
    b = plan_buckets(spec, bucket_bytes=32)  # 8 float32 or 16 bfloat16 elements
    # a+b fill 32 bytes exactly (fits: <=); c starts a new bucket; a dtype change always starts one,
    # and a later float32 tensor is not merged back into an earlier float32 bucket (order is kept).
    assert names(b) == [["a", "b"], ["c"], ["d", "e"], ["f"], ["g"]]
    assert [x["dtype"] for x in b] == ["float32", "float32", "bfloat16", "float32", "float16"]
    assert [t for x in names(b) for t in x] == [n for n, _, _ in spec]
    for x in b:
        itemsize = torch.empty(0, dtype=getattr(torch, x["dtype"])).element_size()
        assert x["numel"] * itemsize <= 32


def test_plan_offsets_are_contiguous_and_shapes_kept():
    b = plan_buckets([("w", [3, 2], "float32"), ("v", [4], "float32"), ("s", [], "float32")], bucket_bytes=1 << 20)
    assert len(b) == 1
    assert b[0]["tensors"] == [
        {"name": "w", "shape": [3, 2], "offset": 0, "numel": 6},
        {"name": "v", "shape": [4], "offset": 6, "numel": 4},
        {"name": "s", "shape": [], "offset": 10, "numel": 1},
    ]
    assert b[0]["numel"] == 11


def test_plan_oversize_tensor_gets_a_bucket_of_its_own():
    b = plan_buckets([("small", [2], "float32"), ("big", [100], "float32"), ("after", [2], "float32")], bucket_bytes=16)
    assert names(b) == [["small"], ["big"], ["after"]]
    assert b[1]["numel"] == 100 and b[1]["tensors"][0]["offset"] == 0
    assert b[2]["tensors"][0]["offset"] == 0


def test_plan_for_tensors_is_plain_data_and_rejects_bad_input():
    tensors = {"x": torch.zeros(2, 3), "y": torch.zeros(4, dtype=torch.bfloat16)}
    b = plan_buckets_for(tensors, bucket_bytes=1024)
    assert json.loads(json.dumps(b)) == b  # travels through msgpack/JSON (collective_rpc, NATS)
    assert [(x["dtype"], x["tensors"][0]["shape"]) for x in b] == [("float32", [2, 3]), ("bfloat16", [4])]
    with pytest.raises(ValueError):
        plan_buckets([("x", [2], "int64")], bucket_bytes=1024)
    with pytest.raises(ValueError):
        plan_buckets([("x", [2], "float32")], bucket_bytes=0)
    with pytest.raises(ValueError):
        plan_buckets_for({"i": torch.zeros(2, dtype=torch.int32)}, bucket_bytes=1024)


def test_the_trainer_keeps_its_snapshot_on_its_gpu_only_where_the_model_is_a_small_share_of_it():
    cuda, h100, gib = torch.device("cuda", 0), 80 * 2**30, 2**30
    assert not snapshot_in_host(3 * gib, cuda, h100)  # 1.5B in bfloat16
    assert not snapshot_in_host(15 * gib, cuda, h100)  # 7B
    assert not snapshot_in_host(20 * gib, cuda, h100)  # a quarter: still on the GPU
    assert snapshot_in_host(20 * gib + 1, cuda, h100)
    assert snapshot_in_host(28 * gib, cuda, h100)  # 14B: host memory, sent through the GPU
    assert not snapshot_in_host(10**12, torch.device("cpu"))  # gloo sends from host memory anyway


def test_a_snapshot_in_host_memory_the_container_cannot_hold_stops_the_trainer_at_its_start():
    """Pinned buffers round up to a power of two, and each checkpoint gathers the whole model into
    host memory beside them; more than the container's memory limit is the trainer's SpecError at
    its start, naming the field, not an OOM kill at its first update or checkpoint."""
    from pipelinerl_trainer.weight_sender import host_memory_problem

    buckets = plan_buckets([(f"w{i}", [3 << 30], "bfloat16") for i in range(4)], 1 << 30)  # 6 GiB each
    pinned, model = pinned_bytes(buckets), sum(map(bucket_nbytes, buckets))
    assert (pinned, model) == (4 * (8 << 30), 24 << 30)
    assert host_memory_problem(pinned, model, None) == host_memory_problem(pinned, model, 56 << 30) == ""
    problem = host_memory_problem(pinned, model, 55 << 30)
    assert problem.startswith("trainer.resources.limits.memory:") and "32.0 GiB" in problem and "24.0 GiB" in problem
    assert "(55.0 GiB)" in problem


def test_the_containers_memory_limit_is_read_from_either_cgroup_version(tmp_path):
    from pipelinerl.runtime import memory_limit_bytes

    assert memory_limit_bytes(tmp_path) is None  # neither file: no limit known
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1, unlimited
    assert memory_limit_bytes(tmp_path) is None
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("68719476736\n")
    assert memory_limit_bytes(tmp_path) == 64 << 30
    (tmp_path / "memory.max").write_text("max\n")  # v2 first: unlimited
    assert memory_limit_bytes(tmp_path) is None
    (tmp_path / "memory.max").write_text("17179869184\n")
    assert memory_limit_bytes(tmp_path) == 16 << 30


def test_a_snapshot_is_sent_only_over_a_group_on_its_device():
    group = SimpleNamespace(rank=0, device=torch.device("cpu"))
    snapshot = Snapshot([], torch.device("cuda", 0))  # no bucket: nothing allocated
    with pytest.raises(ValueError, match="snapshot for cuda:0 sent over a group on cpu"):
        WeightGroup.broadcast(group, snapshot)  # type: ignore[arg-type]


# --- real gloo groups (spawned processes) -------------------------------------------------


def _receiver(
    port, rank, world, timeout_s, buckets, out_q, backend="gloo", group_id="g", token="", delay_s=0.0, ready=None
):
    try:
        time.sleep(delay_s)  # a member still starting up (importing torch, creating a CUDA context)
        if ready is not None:
            ready.set()  # imports done: a test's short join timeout is about the group, not process start
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            if torch.cuda.device_count() == 1:  # NCCL refuses two ranks of one host on one GPU: another "host"
                os.environ["NCCL_HOSTID"] = f"receiver-{rank}"
        group = WeightGroup.join(HOST, port, group_id, rank, world, timeout_s, backend, token)
        # Two updates: the second reuses the first one's buffers (views are copied out), both
        # allocated at the largest bucket's size before the first (never grown: on a GPU each
        # buffer outgrown would stay reserved by the caching allocator).
        got, rings = [], []
        for _ in range(2):
            got.append({n: t.cpu().clone() for n, t in group.receive_buckets(buckets)})
            rings.append([(b.data_ptr(), b.numel()) for b in group._receive_buffers])
        largest = max(map(bucket_nbytes, buckets))
        assert rings[0] == rings[1] and {n for _, n in rings[0]} == {largest}, (rings, largest)
        group.close()
        blob = io.BytesIO()
        torch.save(got, blob)  # plain bytes: tensors put on a queue would share memory with this exiting process
        out_q.put((rank, "ok", blob.getvalue()))
    except BaseException as e:  # report instead of hanging the parent
        out_q.put((rank, "err", repr(e)))


def _member_whose_loader_fails(port, timeout_s, buckets, out_q):
    """Rank 1: its loader raises at the first tensor of the first update; it takes the second."""
    try:
        group = WeightGroup.join(HOST, port, "g", 1, 3, timeout_s)
        try:
            with received_whole(group.receive_buckets(buckets)) as weights:
                next(weights)
                raise ValueError("the loader's own error")
        except ValueError as err:
            raised = repr(err)
        second = {n: t.clone() for n, t in group.receive_buckets(buckets)}
        group.close()
        out_q.put((1, raised, sorted(second)))
    except BaseException as e:  # report instead of hanging the parent
        out_q.put((1, "err", repr(e)))


def test_a_members_loader_error_keeps_the_broadcast_going_for_the_others(port):
    """A broadcast needs every member: a loader that raises mid-update has the rest of it received
    anyway (`received_whole`), so the trainer's send and the other member's update finish at once
    instead of at the group's timeout, and the group takes the next update."""
    tensors = {f"w{i}": torch.full((16,), float(i)) for i in range(6)}
    buckets = plan_buckets_for(tensors, bucket_bytes=64)
    assert len(buckets) == 6
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [
        ctx.Process(target=_member_whose_loader_fails, args=(port, 10.0, buckets, out_q), daemon=True),
        ctx.Process(target=_receiver, args=(port, 2, 3, 10.0, buckets, out_q), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        sender = WeightGroup.form(open_store(HOST, port, True, 30.0), "g", 3, 10.0)
        sent = []
        for _ in range(2):
            t0 = time.monotonic()
            send(sender, tensors, buckets)
            sent.append(time.monotonic() - t0)
        results = dict((r[0], r[1:]) for r in (out_q.get(timeout=60) for _ in procs))
        sender.close()
    finally:
        reap(procs)
    assert max(sent) < 5.0, sent  # not the group's 10 s timeout
    assert results[1] == ('ValueError("the loader\'s own error")', sorted(tensors))
    status, got = results[2]
    assert status == "ok"
    assert all(torch.equal(update[n], t) for update in torch.load(io.BytesIO(got)) for n, t in tensors.items())


def _idle_member(port, world, timeout_s, hold_s, ready):
    """Joins the group as rank 1 but never enters a broadcast."""
    ready.set()  # imports done: the short rendezvous timeout is about the group, not process start
    group = WeightGroup.join(HOST, port, "g", 1, world, timeout_s)
    time.sleep(hold_s)
    group.close()


@pytest.mark.parametrize("in_host", [False, True], ids=["gpu-snapshot", "host-snapshot"])
def test_broadcast_round_trips_to_two_receivers_are_exact(port, in_host):
    """Twice, the second update over the first's buffers; a snapshot in host memory (each
    bucket sent through a ring of two: `snapshot_in_host`) delivers the same bytes."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed": torch.randn(7, 5, generator=g),
        "bias": torch.randn(3, generator=g),
        "norm": (torch.randn(4, 4, generator=g) * 1e3).to(torch.bfloat16),
        "big": torch.randn(40, generator=g),  # 160 bytes > bucket: alone
        "scalar": torch.tensor(3.25),
        "tail": torch.randn(2, 3, generator=g).to(torch.bfloat16),
    }
    buckets = plan_buckets_for(tensors, bucket_bytes=64)
    assert len(buckets) >= 4 and {b["dtype"] for b in buckets} == {"float32", "bfloat16"}
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, r, 3, 30.0, buckets, out_q), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        sender = WeightGroup.form(open_store(HOST, port, True, 30.0), "g", 3, 30.0)
        second = {n: -2 * t for n, t in tensors.items()}
        snapshot = send(sender, tensors, buckets, in_host)
        send(sender, second, buckets, snapshot=snapshot)
        if in_host:  # two bucket buffers on the transport's device, kept, whatever the bucket count
            assert [r.numel() for r in snapshot._ring] == [max(map(bucket_nbytes, buckets))] * 2
        results = {}
        for _ in procs:
            rank, status, got = out_q.get(timeout=60)
            assert status == "ok", got
            results[rank] = torch.load(io.BytesIO(got))
        sender.close()
    finally:
        reap(procs)
    assert sorted(results) == [1, 2]
    for first, again in results.values():
        for got, sent in ((first, tensors), (again, second)):
            assert list(got) == list(sent)  # every tensor, in plan order
            for name, t in sent.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                assert torch.equal(got[name], t), name


def test_a_member_without_the_job_token_is_refused_before_any_weights_move(port):
    tensors = {"w": torch.arange(6.0), "b": torch.ones(2)}
    buckets = plan_buckets_for(tensors, bucket_bytes=1024)
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    store = open_store(HOST, port, True, 30.0)
    # An intruder that reached the rendezvous and knows the epoch, but not the job's token.
    intruder = ctx.Process(
        target=_receiver, args=(port, 1, 2, 30.0, buckets, out_q, "gloo", "e1", "a-guess"), daemon=True
    )
    member = ctx.Process(
        target=_receiver, args=(port, 1, 2, 30.0, buckets, out_q, "gloo", "e2", "job-token"), daemon=True
    )
    intruder.start()
    try:
        with pytest.raises(
            GroupIncomplete, match=r"weight group e1: ranks \[1\] did not prove the job's weight token: refused"
        ) as err:
            WeightGroup.form(store, "e1", 2, 30.0, join_timeout_s=30.0, token="job-token")
        assert err.value.missing == [1]  # dropped like a member that never came
        rank, status, detail = out_q.get(timeout=30)
        assert status == "err" and "GroupAborted" in detail and "ranks [0] (0: the trainer)" in detail, detail
        # The job's own generator, in the next epoch: admitted, and it gets the weights exactly.
        member.start()
        group = WeightGroup.form(store, "e2", 2, 30.0, join_timeout_s=30.0, token="job-token")
        send(group, tensors, buckets)
        send(group, tensors, buckets)
        rank, status, blob = out_q.get(timeout=30)
        assert status == "ok", blob
        assert all(torch.equal(got[n], t) for got in torch.load(io.BytesIO(blob)) for n, t in tensors.items())
        group.close()
    finally:
        reap([intruder, member])


def test_the_join_window_is_half_a_minute_and_never_longer_than_the_members_wait():
    assert JOIN_TIMEOUT_S == 30.0 and join_window(120.0) == 30.0
    assert join_window(20.0) == 20.0  # members give up waiting for `go` after the group's timeout
    assert join_window(120.0, join_timeout_s=1.5) == 1.5  # a caller's own window


def test_a_member_that_starts_slowly_joins_within_the_default_window(port):
    """A member spawned beside the trainer must import torch (on a GPU also create its CUDA
    context) before it can join, seconds after the trainer starts waiting: here it comes 6 s
    late, and the default window still admits it (the earlier 5 s one did not)."""
    tensors = {"w": torch.arange(10.0)}
    buckets = plan_buckets_for(tensors, bucket_bytes=1024)
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    late = ctx.Process(target=_receiver, args=(port, 1, 2, 60.0, buckets, out_q, "gloo", "g", "", 6.0), daemon=True)
    late.start()
    try:
        t0 = time.perf_counter()
        group = WeightGroup.form(open_store(HOST, port, True, 60.0), "g", 2, 60.0)  # the default window
        assert time.perf_counter() - t0 >= 6.0  # it did wait for the late member
        send(group, tensors, buckets)
        send(group, tensors, buckets)
        rank, status, blob = out_q.get(timeout=60)
        assert status == "ok", blob
        assert all(torch.equal(got["w"], tensors["w"]) for got in torch.load(io.BytesIO(blob)))
        group.close()
    finally:
        late.join(10)
        if late.is_alive():
            late.kill()


def test_a_trainer_frozen_past_its_join_window_gives_its_members_the_rest_of_it_on_thawing(port):
    """The window counts the trainer's awake time. The trainer (this process, its store with it)
    SIGSTOPped for 3 s into a 2 s window; its member says it joins 0.5 s after the thaw: the group
    forms. By the wall clock the window was over on thawing: GroupIncomplete, a re-formed epoch."""
    store = open_store(HOST, port, True, 30.0)
    formed: list = []
    former = threading.Thread(target=lambda: formed.append(WeightGroup.form(store, "g", 2, 30.0, join_timeout_s=2.0)))
    former.start()
    time.sleep(0.3)
    me = os.getpid()
    t0 = time.monotonic()
    subprocess.run(["sh", "-c", f"kill -STOP {me}; sleep 3; kill -CONT {me}"], check=True, timeout=20)
    assert time.monotonic() - t0 >= 3.0
    time.sleep(0.5)
    member = WeightGroup.join(HOST, port, "g", 1, 2, 30.0)
    former.join(30)
    assert len(formed) == 1 and formed[0].world_size == 2
    member.close()
    formed[0].close()


def test_epoch_nobody_joins_names_the_missing_ranks(port):
    store = open_store(HOST, port, True, 30.0)
    t0 = time.perf_counter()
    with pytest.raises(GroupIncomplete, match=r"weight group e1: ranks \[1, 2\] did not join within 1.5 s") as err:
        WeightGroup.form(store, "e1", 3, 30.0, join_timeout_s=1.5)  # trainer side: no generator comes
    assert err.value.missing == [1, 2]
    elapsed = time.perf_counter() - t0
    assert 1.0 <= elapsed < 10, elapsed


def test_generator_without_trainer_times_out_clearly(port):
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncTimeout, match="rendezvous.*no trainer"):
        WeightGroup.join(HOST, port, "e1", 1, 2, 1.5)  # generator side: nobody serves the store
    assert time.perf_counter() - t0 < 10


def test_a_member_that_never_comes_aborts_the_epoch_and_the_next_one_goes_on(port):
    """Rank 2 of epoch e1 never joins (a generator that died): the trainer names it, rank 1 is told
    to abort instead of waiting in a half-formed group, and epoch e2 without rank 2 works."""
    store = open_store(HOST, port, True, 30.0)
    tensors = {"w": torch.arange(12.0).reshape(3, 4)}
    buckets = plan_buckets_for(tensors, bucket_bytes=1024)
    ctx = mp.get_context("spawn")
    out_q, ready = ctx.Queue(), ctx.Event()
    first = ctx.Process(
        target=_receiver, args=(port, 1, 3, 30.0, buckets, out_q, "gloo", "e1", "", 0.0, ready), daemon=True
    )
    first.start()
    try:
        # Rank 1 started (a loaded CI once took over the 8 s below to spawn it and import torch).
        assert ready.wait(60)
        with pytest.raises(GroupIncomplete) as err:
            WeightGroup.form(store, "e1", 3, 30.0, join_timeout_s=8.0)
        assert err.value.missing == [2]
        rank, status, message = out_q.get(timeout=60)
        assert (rank, status) == (1, "err") and GroupAborted.__name__ in message
        second = ctx.Process(target=_receiver, args=(port, 1, 2, 30.0, buckets, out_q, "gloo", "e2"), daemon=True)
        second.start()
        group = WeightGroup.form(store, "e2", 2, 30.0, join_timeout_s=30.0)
        send(group, tensors, buckets)
        send(group, tensors, buckets)
        rank, status, payload = out_q.get(timeout=60)
        assert status == "ok", payload
        assert all(torch.equal(got["w"], tensors["w"]) for got in torch.load(io.BytesIO(payload)))
        second.join(30)
        group.close()
    finally:
        first.join(10)


def test_broadcast_receiver_never_enters_times_out_clearly(port):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    member = ctx.Process(target=_idle_member, args=(port, 2, 2.0, 30.0, ready), daemon=True)
    member.start()
    try:
        assert ready.wait(60)
        sender = WeightGroup.form(open_store(HOST, port, True, 30.0), "g", 2, 2.0)  # the rendezvous succeeds
        tensors = {"w": torch.zeros(4 << 20)}  # 16 MiB: more than socket buffers absorb
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncTimeout, match=r"broadcast to 1 generators timed out after 2 s"):
            send(sender, tensors, plan_buckets_for(tensors, bucket_bytes=64 << 20))
        elapsed = time.perf_counter() - t0
        assert member.is_alive(), "the member must still be in the group: a timeout, not a lost peer"
        assert elapsed < 6, elapsed
        sender.close()
    finally:
        member.kill()  # it would idle for hold_s more
        member.join(10)


def test_a_peer_lost_early_is_told_apart_from_a_timeout(port):
    """A member that dies 1 s into a 30 s budget: the error says the peer's connection closed,
    after about a second, not that the broadcast timed out after 30 s."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    member = ctx.Process(target=_idle_member, args=(port, 2, 30.0, 1.0, ready), daemon=True)
    member.start()
    try:
        assert ready.wait(60)
        sender = WeightGroup.form(open_store(HOST, port, True, 30.0), "g", 2, 30.0)
        tensors = {"w": torch.zeros(4 << 20)}  # 16 MiB: more than socket buffers absorb
        with pytest.raises(
            WeightSyncTimeout,
            match=r"broadcast to 1 generators failed after [0-9.]+ s: a peer's "
            r"connection closed",
        ) as err:
            send(sender, tensors, plan_buckets_for(tensors, bucket_bytes=64 << 20))
        assert float(str(err.value).split("failed after ")[1].split(" s")[0]) < 20
        sender.close()
    finally:
        member.kill()
        member.join(10)


def _receiving_member(port, backend, ready, timeout_s):
    """Joins epoch "g" as rank 1 and receives update after update until it is killed."""
    if backend == "nccl":
        torch.cuda.set_device(0)
        os.environ["NCCL_HOSTID"] = "member-killed"  # one GPU: two "hosts" (see below)
    group = WeightGroup.join(HOST, port, "g", 1, 2, timeout_s, backend)
    ready.set()
    buckets = plan_buckets([("w", [BIG], "float32")], BIG * 4)
    while True:
        for _ in group.receive_buckets(buckets):
            pass


def _abandoning_member(port, backend, timeout_s, out_q, ready):
    """Joins epoch "g" as rank 1, receives on a thread of its own (as a staged update does) an
    update the trainer never sends, and after 1 s closes the group as an engine closes the group
    of a transfer it gave up on: how long the close took, how long the thread then took to end,
    and how it ended."""
    try:
        ready.set()  # imports done: the group's timeout is about the group, not a loaded machine's process start
        if backend == "nccl":
            torch.cuda.set_device(0)
            os.environ["NCCL_HOSTID"] = "member-abandoning"  # one GPU: two "hosts"
        group = WeightGroup.join(HOST, port, "g", 1, 2, timeout_s, backend)
        raised = []

        def receive():
            try:
                for _ in group.receive_buckets(plan_buckets([("w", [1024], "float32")], 4096)):
                    pass
            except WeightSyncError as e:
                raised.append(repr(e))

        thread = threading.Thread(target=receive)
        thread.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        group.close()
        closed_s = time.monotonic() - t0
        thread.join(timeout_s + 30)
        out_q.put(("ok", closed_s, time.monotonic() - t0, thread.is_alive(), raised))
    except BaseException as e:  # report instead of hanging the parent
        out_q.put(("err", repr(e), None, None, None))


@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")])],
)
def test_a_receive_given_up_on_ends_when_its_group_is_closed(port, backend, monkeypatch):
    """A generator that gave an update up (its deadline passed) closes that epoch's group while
    its staging thread still waits in a broadcast the trainer never sends: the wait ends by
    raising. NCCL's group is aborted, which ends it at once (its shutdown would wait for the
    communicator's kernels, the pending broadcast's among them); gloo's close, abort or shutdown
    alike, waits for the pending receive, which ends at the collective timeout (or as soon as the
    trainer closes its side)."""
    timeout_s = 30.0 if backend == "nccl" else 8.0
    if backend == "nccl":
        torch.cuda.set_device(0)
        monkeypatch.setenv("NCCL_HOSTID", "trainer")
    ctx = mp.get_context("spawn")
    out_q, ready = ctx.Queue(), ctx.Event()
    member = ctx.Process(target=_abandoning_member, args=(port, backend, timeout_s, out_q, ready), daemon=True)
    member.start()
    try:
        assert ready.wait(60)
        trainer = WeightGroup.form(open_store(HOST, port, True, 60.0), "g", 2, timeout_s, backend=backend)
        status, closed_s, ended_s, alive, raised = out_q.get(timeout=120)  # the trainer sends nothing
        assert status == "ok", closed_s
        assert not alive and raised, "the receive did not end by raising"
        bound = 10 if backend == "nccl" else timeout_s + 5
        assert closed_s < bound and ended_s < bound, f"closed in {closed_s:.1f} s, the receive ended in {ended_s:.1f} s"
        trainer.close()
    finally:
        member.kill()
        member.join(10)


BIG = 16 << 20  # 64 MiB of float32 per update: a broadcast long enough to be killed in
KILL_TIMEOUT_S = 8.0


@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")])],
)
def test_a_member_killed_mid_broadcast_raises_and_the_trainer_goes_on(port, backend, monkeypatch):
    """kill -9 of a generator while the trainer broadcasts to it: the trainer gets WeightSyncError
    (with NCCL too: its weight group waits blocking, so no watchdog kills the trainer) by the
    collective timeout, then forms the next epoch with a new member and sends it exact weights."""
    if backend == "nccl":
        torch.cuda.set_device(0)
        monkeypatch.setenv("NCCL_HOSTID", "trainer")
    device = "cuda" if backend == "nccl" else "cpu"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    member = ctx.Process(target=_receiving_member, args=(port, backend, ready, 60.0), daemon=True)
    member.start()
    store = open_store(HOST, port, True, 60.0)
    try:
        sender = WeightGroup.form(store, "g", 2, KILL_TIMEOUT_S, backend=backend)
        assert ready.wait(60)
        tensors = {"w": torch.ones(BIG, device=device)}
        buckets = plan_buckets_for(tensors, BIG * 4)
        send(sender, tensors, buckets)  # one whole update first: the member really receives
        killer = threading.Timer(0.5, member.kill)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError):
            while time.monotonic() - t0 < 60:
                send(sender, tensors, buckets)
        # gloo notices a peer killed between two sends at once, one killed mid-send only at the
        # collective timeout (its pending send is not failed when the pair closes): bounded both ways.
        assert time.monotonic() - (t0 + 0.5) < KILL_TIMEOUT_S + 5, "raised late: after the collective timeout"
        sender.close()
    finally:
        member.kill()
        member.join(10)
    # The trainer goes on: the next epoch with a new member, exact weights.
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(1000, generator=g).to(device), "b": torch.randn(10, generator=g).to(device)}
    buckets = plan_buckets_for(tensors, bucket_bytes=2048)
    out_q = ctx.Queue()
    joiner = ctx.Process(target=_receiver, args=(port, 1, 2, 60.0, buckets, out_q, backend, "g2"), daemon=True)
    joiner.start()
    sender = WeightGroup.form(store, "g2", 2, 60.0, backend=backend)
    for _ in range(2):
        send(sender, tensors, buckets)
    rank, status, payload = out_q.get(timeout=120)
    assert status == "ok", payload
    for got in torch.load(io.BytesIO(payload)):
        assert all(torch.equal(got[n], t.cpu()) for n, t in tensors.items())
    joiner.join(30)
    sender.close()


class _TinyEngine:
    """What WeightSender needs of a DeepSpeed engine (ZeRO-1: no gather)."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(4, 4)

    def zero_optimization_stage(self) -> int:
        return 1


class _Bridge:
    """What WeightSender needs of the trainer's NATS bridge: one generator said hello; the
    update's group id is handed to the test (the generator's side reads it from NATS)."""

    def __init__(self, group_ids) -> None:
        from pipelinerl import messages as m

        self.subjects = SimpleNamespace(weights_update="weights", sent="sent")
        self.done: queue.Queue = queue.Queue()
        self.hellos: queue.Queue = queue.Queue()
        self.hellos.put((self.now(), m.GeneratorHello(generator=0, incarnation="a", version=-1)))
        self.group_ids = group_ids
        self.sent: list[int] = []  # what the store would hold: each WeightsSent's version

    def publish(self, subject, msg, stream=True) -> None:
        if subject == "sent":
            self.sent.append(msg.version)
        else:
            self.group_ids.put(msg.group)

    def now(self) -> float:
        return time.monotonic()


def _trainer_sending(port, backend, bound_s, timeout_s, log_path, group_ids, out_q):
    """The trainer's WeightSender (rank 0) sending version 1 to its one generator, its group's
    timeout `timeout_s`, the watchdog's bound on forming the group shortened to `bound_s`.
    Reports how the send ended, unless the watchdog ended the process first."""
    import pipelinerl_trainer.weight_sender as ws

    logging.basicConfig(filename=log_path, level=logging.INFO)
    if backend == "nccl":
        torch.cuda.set_device(0)
        os.environ["NCCL_HOSTID"] = "trainer"  # one GPU: two "hosts"
    ws.form_bound = lambda timeout_s: bound_s
    sender = ws.WeightSender(
        _TinyEngine(),
        0,
        _Bridge(group_ids),
        backend=backend,
        bucket_mb=1,
        timeout_s=timeout_s,
        store=open_store(HOST, port, True, timeout_s),
    )
    sender.send(1)
    out_q.put(f"send returned: {sender.status()}")  # not expected: the watchdog ends it first


def _sender(port, group_ids, backend="gloo"):
    """Rank 0's WeightSender of a one-layer model, its one generator having said hello."""
    import pipelinerl_trainer.weight_sender as ws

    return ws.WeightSender(
        _TinyEngine(), 0, _Bridge(group_ids), backend=backend, bucket_mb=1, timeout_s=60.0,
        store=open_store(HOST, port, True, 60.0),
    )  # fmt: skip


def _receiver_of_announced(port, group_ids, buckets, out_q, backend):
    """A generator that joins the epoch the trainer announces and receives two updates."""
    _receiver(port, 1, 2, 60.0, buckets, out_q, backend, group_ids.get(timeout=60))


@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")])],
)
def test_the_trainer_trains_on_while_its_update_is_sent_and_the_next_waits_for_it(port, backend, monkeypatch):
    """Pipeline mode's send (`wait=False`) confirms, forms the epoch and returns once the
    broadcast has started from a thread (held here until released, as a large model's would
    run): the trainer trains on, changing its weights, while the snapshot goes out unchanged. The
    next send waits for it first; the generator receives each version exactly. With NCCL the
    thread's stream first waits for the packing queued on the trainer's (`Snapshot.handoff`)."""
    from pipelinerl import messages as m

    if backend == "nccl":
        torch.cuda.set_device(0)
        monkeypatch.setenv("NCCL_HOSTID", "trainer")
    released = threading.Event()
    broadcast = WeightGroup.broadcast

    def held(self, snapshot):
        assert released.wait(60)
        broadcast(self, snapshot)

    monkeypatch.setattr(WeightGroup, "broadcast", held)
    ctx = mp.get_context("spawn")
    group_ids, out_q = ctx.Queue(), ctx.Queue()
    sender = _sender(port, group_ids, backend)
    generator = ctx.Process(target=_receiver_of_announced, args=(port, group_ids, sender.buckets, out_q, backend))
    generator.start()
    try:
        layer = sender.engine.module
        sent = [{n: p.detach().clone() for n, p in layer.named_parameters()}]
        stats = sender.send(1, wait=False)  # returns with the broadcast held in its thread
        assert stats["weight_updates"] == 1 and sender.flight is not None and sender.flight.is_alive()
        assert sender.status()["generators_in_group"] == 1  # the epoch formed in the trainer's thread
        with torch.no_grad():
            layer.weight.add_(1.0)  # the trainer's next step, while version 1 is still to be sent
        sent.append({n: p.detach().clone() for n, p in layer.named_parameters()})
        released.set()
        sender.bridge.done.put(
            m.WeightUpdateDone(version=1, generator=0, incarnation="a", pause_seconds=0.25, running_requests=3)
        )
        confirmed = sender.send(2, wait=False)  # waits for version 1's broadcast, confirms it
        assert confirmed["weight_pause_max_seconds"] == 0.25 and confirmed["updates_with_running_requests"] == 1
        sender.finish()
        rank, status, payload = out_q.get(timeout=60)
        assert status == "ok", payload
        got = torch.load(io.BytesIO(payload))
        assert [all(torch.equal(g[n], t) for n, t in want.items()) for g, want in zip(got, sent)] == [True, True]
        assert sender.failures == 0 and sender.flight is None
    finally:
        released.set()
        generator.kill()
        generator.join(10)
        sender._close_group()


def _late_member(port, hold_s, out_q):
    """Joins epoch "g" over NCCL as rank 1, receives one update at once, and the next only
    `hold_s` later (a generator still busy when the trainer sends)."""
    try:
        torch.cuda.set_device(0)
        os.environ["NCCL_HOSTID"] = "member-late"  # one GPU: two "hosts"
        group = WeightGroup.join(HOST, port, "g", 1, 2, 60.0, "nccl")
        buckets = plan_buckets([("w", [BIG], "float32")], BIG * 4)
        for update in range(2):
            time.sleep(hold_s * update)
            for _ in group.receive_buckets(buckets):
                pass
        torch.cuda.synchronize()
        group.close()
        out_q.put(("ok", None))
    except BaseException as e:  # report instead of hanging the parent
        out_q.put(("err", repr(e)))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_a_broadcast_in_flight_holds_back_no_training_kernel_on_cuda(port, monkeypatch):
    """Pipeline mode sends the weights from a thread while the trainer trains on, on the thread's
    own stream (`Snapshot.handoff`): a broadcast still waiting for a generator holds back no
    kernel the trainer queues meanwhile. On the default stream, which is every thread's current
    one and the one training runs on, a bucket's `wait()` made it wait for the broadcast: here,
    for the seconds the member took to come."""
    hold_s = 3.0
    torch.cuda.set_device(0)
    monkeypatch.setenv("NCCL_HOSTID", "trainer")
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    member = ctx.Process(target=_late_member, args=(port, hold_s, out_q), daemon=True)
    member.start()
    try:
        group = WeightGroup.form(open_store(HOST, port, True, 60.0), "g", 2, 60.0, backend="nccl")
        snapshot = Snapshot(plan_buckets([("w", [BIG], "float32")], BIG * 4), torch.device("cuda", 0))
        snapshot.pack(0, {"w": torch.ones(BIG, device="cuda")})
        group.broadcast(snapshot)  # the first: NCCL's communicator set up, the member ready
        handoff, raised = snapshot.handoff(), []

        def fly() -> None:
            try:
                with handoff:
                    group.broadcast(snapshot)
            except BaseException as e:  # noqa: BLE001 - asserted below
                raised.append(e)

        flight = threading.Thread(target=fly)
        t0 = time.monotonic()
        flight.start()
        time.sleep(0.5)  # the bucket issued and waited on by the thread
        x = torch.randn(2048, 2048, device="cuda")
        t1 = time.monotonic()
        (x @ x).sum().item()  # a training kernel, queued on the default stream, and its result read
        trained_s = time.monotonic() - t1
        flight.join(60)
        sent_s = time.monotonic() - t0
        assert not raised and out_q.get(timeout=60) == ("ok", None), raised
        print(f"NOTE a training kernel took {trained_s:.3f} s while the broadcast in flight took {sent_s:.1f} s")
        assert sent_s >= hold_s - 0.5 and trained_s < 1.0
        group.close()
    finally:
        member.kill()
        member.join(10)


def test_what_a_broadcast_in_flight_raises_is_raised_by_the_next_call_that_needs_the_group(port, monkeypatch):
    """An error the thread met (not a generator's failure, which only drops it) reaches the
    trainer's own thread at the next send, resync or holders, as it would have from a send that
    waited; after it the sender has nothing in flight."""
    sender = _sender(port, queue.Queue())
    monkeypatch.setattr(sender, "_current_group", lambda version: SimpleNamespace())

    def broken(group, version):
        raise RuntimeError("the snapshot is gone")

    monkeypatch.setattr(sender, "_broadcast", broken)
    sender.send(1, wait=False)
    with pytest.raises(RuntimeError, match="the snapshot is gone"):
        sender.holders(1)
    assert sender.flight is None
    sender.finish()  # nothing left to raise


def test_each_version_is_recorded_in_the_store_before_its_broadcast_begins(port, monkeypatch):
    """A trainer killed after broadcasting a version and before announcing it leaves the
    generators holding a version the stream never announced: its successor takes the recorded one
    as its floor (`main.newest_sent`) and sends nothing older, where it would have replayed up to
    the announced version and sent it, taking the generators' weights back a version. In the
    store (CONTROL), not on the trainer's volume: a store made again (`recover-store`) forgets it
    with the announcements, and the generators are then sent the checkpoint's weights."""
    sender = _sender(port, queue.Queue())
    monkeypatch.setattr(sender, "_current_group", lambda version: SimpleNamespace())
    seen: list[list[int]] = []
    monkeypatch.setattr(sender, "_broadcast", lambda group, version: seen.append(list(sender.bridge.sent)) or True)
    sender.send(3)
    sender.send(4, wait=False)
    sender.finish()
    assert seen == [[3], [3, 4]]
    monkeypatch.setattr(sender, "_current_group", lambda version: None)  # nobody to send to: nothing sent
    sender.send(5)
    assert sender.bridge.sent == [3, 4]


@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")])],
)
def test_a_member_killed_before_the_group_connects_ends_the_trainer_within_its_bound(port, backend, tmp_path):
    """A generator that said it was joining and died before connecting leaves the trainer's `form`
    waiting in native code: gloo's connection (up to the group's timeout, here a minute), NCCL's
    communicator set-up inside the first collective (no timeout of ours reaches it). The trainer's
    watchdog ends the process at its bound on forming (shortened to 3 s here; `form_bound` in a
    job) with the group named in its log, to be restarted; it never waits on. Should NCCL's set-up
    fail by itself first, the trainer forms the next epoch and the watchdog ends that wait: the
    test prints which happened."""
    ctx = mp.get_context("spawn")
    group_ids, out_q = ctx.Queue(), ctx.Queue()
    log_path = tmp_path / "trainer.log"
    trainer = ctx.Process(target=_trainer_sending, args=(port, backend, 3.0, 60.0, str(log_path), group_ids, out_q))
    trainer.start()
    try:
        group_id = group_ids.get(timeout=60)
        # The generator's side of the rendezvous, then nothing: killed right after the trainer's `go`.
        epoch = dist.PrefixStore(f"{GROUP_PREFIX}/{group_id}", open_store(HOST, port, False, 30.0))
        epoch.set("joining/1", "1")
        epoch.wait(["go"], timedelta(seconds=30))
        t0 = time.monotonic()
        trainer.join(30)
        ended_s = time.monotonic() - t0
        log = log_path.read_text()
        failed_first = f"weight group {group_id} failed to connect" in log
        returned = out_q.get(timeout=1) if not out_q.empty() else "-"
        print(
            f"NOTE killed before connecting, {backend}: exit code {trainer.exitcode} after {ended_s:.1f} s;"
            f" set-up failed by itself: {failed_first}"
        )
        assert trainer.exitcode == 1, f"the trainer did not end ({returned}): {log[-2000:]}"
        if failed_first:  # NCCL's own error, then the next epoch's join window, cut at the bound
            assert backend == "nccl" and "not done within 3 s" in log and ended_s < 12
        else:
            assert f"forming weight group {group_id}: not done within 3 s" in log and ended_s < 8
    finally:
        trainer.kill()
        trainer.join(10)


# --- transport choice (weightSync.backend) ----------------------------------------------------


def job(**spec):
    return parse_job({"metadata": {"name": "t"}, "spec": spec}).spec


def test_auto_picks_nccl_only_with_gpus_on_both_sides():
    assert job().weight_transport == "gloo"
    model = {"path": "/models/qwen"}  # GPU jobs need a real model
    gpus = {"trainer": {"gpus": 1}, "generator": {"gpus": 1}, "model": model}
    assert job(**gpus).weight_transport == "nccl"
    assert job(**gpus, weightSync={"backend": "gloo"}).weight_transport == "gloo"
    assert job(trainer={"gpus": 1}, model=model).weight_transport == "gloo"


@pytest.mark.skipif(GPUS > 0, reason="checks the refusal where no GPU is visible")
def test_nccl_without_a_gpu_is_refused_before_any_rendezvous(port):
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="weightSync.backend is nccl but"):
        WeightGroup.form(open_store(HOST, port, True, 30.0), "g", 2, 30.0, backend="nccl")
    assert time.perf_counter() - t0 < 5  # refused at once, not after the rendezvous timeout


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_host", [False, True], ids=["gpu-snapshot", "host-snapshot"])
def test_nccl_broadcast_round_trips_gpu_to_gpu(port, monkeypatch, in_host):
    """On two GPUs, or on one: NCCL refuses two ranks of one host on one device, so there each
    process names its own NCCL_HOSTID and NCCL takes them for two hosts (socket transport). A
    snapshot in host memory (pinned, each bucket copied into a ring of two on the GPU on the
    broadcast's stream) delivers the same bytes: a copy into a slot still being sent would not."""
    torch.cuda.set_device(0)
    if GPUS == 1:
        monkeypatch.setenv("NCCL_HOSTID", "trainer")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(64, 32, generator=g).cuda(),
        "b": torch.randn(7, generator=g).to(torch.bfloat16).cuda(),
        "w2": torch.randn(16, 16, generator=g).cuda(),
        "w3": torch.randn(300, generator=g).cuda(),
    }
    buckets = plan_buckets_for(tensors, bucket_bytes=1024)
    assert len(buckets) == 4  # the ring of two goes round twice
    second = {n: -2 * t for n, t in tensors.items()}
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, 1, 2, 60.0, buckets, out_q, "nccl"), daemon=True)
    proc.start()
    sender = WeightGroup.form(open_store(HOST, port, True, 60.0), "g", 2, 60.0, backend="nccl")
    assert sender.device.type == "cuda"
    snapshot = send(sender, tensors, buckets, in_host)
    send(sender, second, buckets, snapshot=snapshot)
    assert snapshot.buffers[0].is_pinned() == in_host
    rank, status, payload = out_q.get(timeout=120)
    assert status == "ok", payload
    for got, sent in zip(torch.load(io.BytesIO(payload)), (tensors, second)):
        assert set(got) == set(sent)
        for name, t in sent.items():
            assert torch.equal(got[name], t.cpu()), name
    proc.join(30)
    sender.close()
