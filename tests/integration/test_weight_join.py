"""A generator worker joins its weight group beside generation (`WeightReceiverExtension`'s
`init_weight_group`, polled by `weight_group_joined`), here without vLLM: the extension alone,
against a real rendezvous store and a trainer forming real gloo epochs. The engine's side (requests
decoding while a join waits) is in test_inflight_update.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from pipelinerl.ports import free_port
from pipelinerl.weight_group import (
    GROUP_PREFIX,
    GroupAborted,
    Invitation,
    WeightGroup,
    dtype_name,
    open_store,
    plan_buckets,
)
from pipelinerl.weight_snapshot import Snapshot
from pipelinerl_generator.weight_receiver import WeightReceiverExtension

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
GPUS = torch.cuda.device_count()


def poll(worker: WeightReceiverExtension, seconds: float = 20.0) -> int:
    """Poll as the engine does until joined; how many polls said "not yet"."""
    deadline, waits = time.monotonic() + seconds, 0
    while not worker.weight_group_joined():
        assert time.monotonic() < deadline, "the join did not end"
        waits += 1
        time.sleep(0.01)
    return waits


@pytest.mark.parametrize("connect_beside", [True, False])
def test_a_join_waits_on_its_thread_and_connects_where_told(connect_beside, monkeypatch):
    """The worker's call returns at once; polls say "not yet" until the trainer lets the epoch go;
    the connection is made on the join's thread, or (NCCL with tensor parallelism) on the polling
    thread; the group joined receives the trainer's weights."""
    accepted_on: list[str] = []
    accept = Invitation.accept
    monkeypatch.setattr(
        Invitation, "accept", lambda inv: accepted_on.append(threading.current_thread().name) or accept(inv)
    )
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    worker = WeightReceiverExtension()
    t0 = time.monotonic()
    worker.init_weight_group(HOST, port, "e1", 1, 2, TIMEOUT_S, "gloo", "", connect_beside)
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.5)
    assert not worker.weight_group_joined()  # waiting for the trainer's `go`
    formed: list[WeightGroup] = []
    trainer = threading.Thread(target=lambda: formed.append(WeightGroup.form(store, "e1", 2, TIMEOUT_S)))
    trainer.start()
    poll(worker)
    trainer.join(TIMEOUT_S)
    want = "pipelinerl-join-weights" if connect_beside else threading.current_thread().name
    assert accepted_on == [want]
    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    buckets = plan_buckets([(n, list(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()], 32)
    snapshot = Snapshot(buckets, torch.device("cpu"))
    for i in range(len(buckets)):
        snapshot.pack(i, tensors)
    sender = threading.Thread(target=formed[0].broadcast, args=(snapshot,))
    sender.start()
    got = {name: t.clone() for name, t in worker._pipelinerl_group().receive_buckets(buckets)}
    sender.join(TIMEOUT_S)
    assert got.keys() == tensors.keys() and all(torch.equal(got[n], tensors[n]) for n in tensors)
    formed[0].close()
    worker._pipelinerl_group().close()


def test_a_join_the_trainer_calls_off_raises_at_the_next_poll_and_leaves_nothing_held():
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    worker = WeightReceiverExtension()
    worker.init_weight_group(HOST, port, "e1", 1, 3, TIMEOUT_S, "gloo")
    time.sleep(0.3)
    assert not worker.weight_group_joined()
    store.set(f"{GROUP_PREFIX}/e1/go", "abort")  # what the trainer writes when a member did not come
    with pytest.raises(GroupAborted, match="called off by the trainer"):
        poll(worker)
    assert worker._pipelinerl_weight_group is None
    with pytest.raises(RuntimeError, match="no weight group is being joined"):
        worker.weight_group_joined()


def test_a_join_given_up_on_is_waited_for_and_its_group_closed_before_the_next():
    """The engine stopped polling a join (its bound passed); the next epoch's join first waits for
    that thread and closes what it joined, then joins the new epoch."""
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    worker = WeightReceiverExtension()
    worker.init_weight_group(HOST, port, "e1", 1, 2, TIMEOUT_S, "gloo")
    first = WeightGroup.form(store, "e1", 2, TIMEOUT_S)
    abandoned = worker._pipelinerl_joining
    assert abandoned is not None
    abandoned.thread.join(TIMEOUT_S)  # joined, never polled
    assert abandoned.result.pg is not None
    formed: list[WeightGroup] = []
    trainer = threading.Thread(target=lambda: formed.append(WeightGroup.form(store, "e2", 2, TIMEOUT_S)))
    trainer.start()
    worker.init_weight_group(HOST, port, "e2", 1, 2, TIMEOUT_S, "gloo")
    assert abandoned.result.pg is None  # closed
    poll(worker)
    trainer.join(TIMEOUT_S)
    assert formed and worker._pipelinerl_group().world_size == 2
    for group in (first, formed[0], worker._pipelinerl_group()):
        group.close()


def _nccl_member(port: int, connect_beside: bool, out_q) -> None:
    """A generator worker on GPU 0 (its own NCCL "host": one GPU, two ranks) joining beside a
    busy default stream, then receiving one update on the polling thread."""
    try:
        torch.cuda.set_device(0)
        os.environ["NCCL_HOSTID"] = "member"
        busy = torch.randn(4096, 4096, device="cuda")
        worker = WeightReceiverExtension()
        worker.init_weight_group(HOST, port, "e1", 1, 2, TIMEOUT_S, "nccl", "", connect_beside)
        out_q.put(("joining", None))
        steps = 0
        while not worker.weight_group_joined():  # the engine's steps, meanwhile
            busy = torch.tanh(busy @ busy)
            torch.cuda.synchronize()
            steps += 1
        group = worker._pipelinerl_group()
        got = [t.sum().item() for _, t in group.receive_buckets(plan_buckets([("w", [1 << 20], "float32")], 4 << 20))]
        group.close()
        out_q.put(("ok", (steps, got)))
    except BaseException as e:  # report instead of hanging the parent
        out_q.put(("err", repr(e)))


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("connect_beside", [True, False])
def test_a_join_beside_sets_nccl_up_where_told_while_the_device_computes_on_cuda(connect_beside, monkeypatch):
    """Over NCCL the member's communicator is set up by its first collective (the token's proof):
    on the join's thread, on the worker's device and its side stream, while the default stream
    computes; or on the polling thread. Either way the group joined receives exact weights."""
    torch.cuda.set_device(0)
    monkeypatch.setenv("NCCL_HOSTID", "trainer")
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    out_q = mp.get_context("spawn").Queue()
    member = mp.get_context("spawn").Process(target=_nccl_member, args=(port, connect_beside, out_q), daemon=True)
    member.start()
    try:
        assert out_q.get(timeout=60)[0] == "joining"
        time.sleep(1.0)  # the member computes on while it waits for `go`
        group = WeightGroup.form(store, "e1", 2, TIMEOUT_S, backend="nccl")
        buckets = plan_buckets([("w", [1 << 20], "float32")], 4 << 20)
        snapshot = Snapshot(buckets, torch.device("cuda", 0))
        snapshot.pack(0, {"w": torch.ones(1 << 20, device="cuda")})
        group.broadcast(snapshot)
        status, payload = out_q.get(timeout=60)
        assert status == "ok", payload
        steps, got = payload
        assert got == [float(1 << 20)] and steps >= 10
        group.close()
    finally:
        member.join(10)
        if member.is_alive():
            member.kill()
