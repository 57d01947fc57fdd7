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
    Invitation,
    WeightGroup,
    dtype_name,
    open_store,
    plan_buckets,
)
from pipelinerl.weight_snapshot import Snapshot
from pipelinerl_generator.staging import Transfer
from pipelinerl_generator.weight_receiver import WeightReceiverExtension

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
GPUS = torch.cuda.device_count()


def joined(worker: WeightReceiverExtension, seconds: float = 20.0) -> str:
    """Poll as the engine does until the join's thread is done, then accept: "" or why not."""
    deadline = time.monotonic() + seconds
    while (state := worker.weight_group_joined()) is None:
        assert time.monotonic() < deadline, "the join did not end"
        time.sleep(0.01)
    return state or worker.accept_weight_group()


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
    assert worker.init_weight_group(HOST, port, "e1", 1, 2, TIMEOUT_S, "gloo", "", connect_beside) == ""
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.5)
    assert worker.weight_group_joined() is None  # waiting for the trainer's `go`
    formed: list[WeightGroup] = []
    trainer = threading.Thread(target=lambda: formed.append(WeightGroup.form(store, "e1", 2, TIMEOUT_S)))
    trainer.start()
    if connect_beside:
        assert joined(worker) == ""
    else:  # accepted by the engine's call to every worker, once all are done: a collective
        while worker.weight_group_joined() is None:
            time.sleep(0.01)
        assert worker.weight_group_joined() == "" and accepted_on == []  # asked again: the same answer
        assert worker.accept_weight_group() == ""
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


def test_a_join_the_trainer_calls_off_is_told_at_the_next_poll_and_leaves_nothing_held():
    """Told, not raised: at the first worker that raises, vLLM's multiprocess executor leaves the
    other workers' answers queued for the calls that follow."""
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    worker = WeightReceiverExtension()
    worker.init_weight_group(HOST, port, "e1", 1, 3, TIMEOUT_S, "gloo")
    time.sleep(0.3)
    assert worker.weight_group_joined() is None
    store.set(f"{GROUP_PREFIX}/e1/go", "abort")  # what the trainer writes when a member did not come
    assert joined(worker).startswith("GroupAborted: weight group e1: called off by the trainer")
    assert worker._pipelinerl_weight_group is None
    assert worker.weight_group_joined() == "no weight group is being joined"
    assert worker.accept_weight_group() == "no weight group was joined"


def test_a_join_given_up_on_is_closed_once_it_ends_and_never_waited_for():
    """The engine stopped polling a join (its bound passed). The next epoch's join starts at once,
    beside it; what the one given up on joined is closed once its thread has ended."""
    port = free_port()
    store = open_store(HOST, port, True, TIMEOUT_S)
    worker = WeightReceiverExtension()
    worker.init_weight_group(HOST, port, "e1", 1, 2, TIMEOUT_S, "gloo")
    abandoned = worker._pipelinerl_joining
    assert abandoned is not None
    t0 = time.monotonic()
    worker.init_weight_group(HOST, port, "e2", 1, 2, TIMEOUT_S, "gloo")  # e1 still waits for `go`
    assert time.monotonic() - t0 < 1.0 and abandoned.thread.is_alive()
    first = WeightGroup.form(store, "e1", 2, TIMEOUT_S)  # e1 forms late: its join ends, unpolled
    abandoned.thread.join(TIMEOUT_S)
    assert abandoned.result.pg is not None
    formed: list[WeightGroup] = []
    trainer = threading.Thread(target=lambda: formed.append(WeightGroup.form(store, "e2", 2, TIMEOUT_S)))
    trainer.start()
    assert joined(worker) == ""
    trainer.join(TIMEOUT_S)
    assert formed and worker._pipelinerl_group().world_size == 2
    worker.init_weight_group(HOST, port, "e3", 1, 2, TIMEOUT_S, "gloo")  # the next join closes e1's
    assert abandoned.result.pg is None and worker._pipelinerl_abandoned == ()
    store.set(f"{GROUP_PREFIX}/e3/go", "abort")
    assert joined(worker).startswith("GroupAborted")
    for group in (first, formed[0]):
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
        while worker.weight_group_joined() is None:  # the engine's steps, meanwhile
            busy = torch.tanh(busy @ busy)
            torch.cuda.synchronize()
            steps += 1
        assert worker.accept_weight_group() == ""
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


def test_a_worker_whose_given_up_update_still_receives_says_it_can_take_no_weights():
    """An update given up on whose transfer outlives the group's timeout would write into the
    staging copy under the next one: the worker says so (the engine stops the generator)."""
    worker = WeightReceiverExtension()
    worker._pipelinerl_transfer = Transfer(lambda: time.sleep(3.0), torch.device("cpu"))
    said = worker.init_weight_group(HOST, free_port(), "e1", 1, 2, 0.5, "gloo")
    assert said == "TimeoutError: an abandoned weight update still receives after 0 s"
    assert worker._pipelinerl_joining is None
