"""The trainer ranks' watch over each other (pipelinerl_trainer.peers): rank 0's account of the
beats as pure state, then real ranks over a real TCPStore, the other side a process of its own
killed with SIGKILL or frozen with SIGSTOP (a node that stops answering keeps its connections
open). The process exit is a stand-in on this side. The whole gang under a frozen rank:
tests/e2e/test_trainer_rank_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from pipelinerl.ports import free_port
from pipelinerl_trainer.peers import FORMED_KEY, LEFT, Hearing, PeerWatch, say_started, start_key

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 3.0  # a beat a second: room for a loaded machine's late ones


def test_a_rank_whose_count_stands_still_past_the_bound_is_silent_and_one_that_left_never():
    h = Hearing((1, 2), bound_s=3.0, since=0.0)
    h.heard(1, 1, 1, 0.5)
    h.heard(2, 1, 1, 0.5)
    assert h.silent(3.4) == []
    h.heard(1, 2, 1, 3.0)  # rank 1 beats on; rank 2's count stands still
    h.heard(2, 1, 1, 3.0)
    assert h.silent(3.6) == [2] and h.silent(5.9) == [2]
    h.heard(2, 1 + LEFT, 1, 6.0)  # it left (its loop ended)
    assert h.silent(100.0) == [1] and not h.all_left()
    h.heard(1, 9 + LEFT, 1, 100.0)
    assert h.silent(1000.0) == [] and h.all_left() and h.restarted() == []


def test_a_rank_never_heard_is_silent_from_the_start_of_the_hearing():
    h = Hearing((1,), bound_s=2.0, since=10.0)
    assert h.silent(11.9) == [] and h.silent(12.1) == [1]


def test_a_rank_started_again_once_the_gang_formed_is_no_longer_its_member():
    h = Hearing((1, 2), bound_s=60.0, since=0.0)
    h.heard(1, 1, 2, 0.0)  # rank 1 started twice while the gang formed (a quick restart): its baseline
    assert not h.formed
    h.heard(1, 2, 3, 1.0)
    h.heard(2, 1, 1, 1.0)
    assert h.formed and h.restarted() == []
    h.heard(1, 3, 3, 2.0)
    h.heard(2, 2, 2, 2.0)  # rank 2's next process said it started: the one in this gang ended
    assert h.restarted() == [2]
    h.heard(2, 3, 2, 3.0)
    assert h.restarted() == [2] and h.silent(3.0) == []  # for good, even though the count moves on


def peer(rank: int, port: int, master: bool, bound_s: float = BOUND_S, real_exit: bool = False) -> subprocess.Popen:
    """Trainer rank `rank` in a process of its own, beating into the store at `port` (serving it
    when `master`), until it is killed; or, with `real_exit`, until its watch ends it (its log on
    stderr)."""
    exit = "os._exit" if real_exit else 'lambda code: print("ended", flush=True)'
    code = textwrap.dedent(
        f"""
        import logging, os, time
        from datetime import timedelta
        import torch.distributed as dist
        from pipelinerl_trainer.peers import PeerWatch
        logging.basicConfig()
        store = dist.TCPStore("127.0.0.1", {port}, None, {master}, timedelta(seconds={bound_s}), wait_for_workers=False)
        PeerWatch(store, {rank}, 2, {bound_s}, exit={exit})
        print("beating", flush=True)
        time.sleep(600)
        """
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "services/trainer")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline() == "beating\n"
    return proc


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=BOUND_S), wait_for_workers=False)


def until(done, seconds: float) -> float:
    t0 = time.monotonic()
    while not done() and time.monotonic() - t0 < seconds:
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.slow  # each of these waits out bounds of a few seconds, beside real processes
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_rank_0_ends_its_process_once_rank_1_died_or_froze_past_the_bound(fault, caplog):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=BOUND_S), wait_for_workers=False)
    one = peer(1, port, master=False)
    exits: list[int] = []
    watch = PeerWatch(client(port), 0, 2, BOUND_S, exit=exits.append)
    try:
        assert until(lambda: exits, BOUND_S + 1) >= BOUND_S + 1 and exits == []  # both beat: nothing
        os.kill(one.pid, fault)
        t0 = time.monotonic()
        until(lambda: exits, 3 * BOUND_S)
        assert exits == [1] and BOUND_S - 1.0 <= time.monotonic() - t0 <= BOUND_S + 2.0
        assert "trainer rank 1 said nothing for 3 s" in caplog.text and "restarts and resumes" in caplog.text
    finally:
        one.kill()
        watch.close()
        del server


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_rank_1_ends_its_process_once_rank_0_and_its_store_died_or_froze(fault, caplog):
    port = free_port()
    zero = peer(0, port, master=True)
    exits: list[int] = []
    watch = PeerWatch(client(port), 1, 2, BOUND_S, exit=exits.append)
    try:
        assert until(lambda: exits, 1.5) >= 1.5 and exits == []
        os.kill(zero.pid, fault)
        t0 = time.monotonic()
        until(lambda: exits, 3 * BOUND_S)
        # Dead: its store's connection closes at once; frozen: a beat waits past the bound.
        assert exits[:1] == [1] and time.monotonic() - t0 <= (2.0 if fault == signal.SIGKILL else BOUND_S + 2.0)
        assert "trainer rank 0's store" in caplog.text
    finally:
        zero.kill()
        watch.close()


@pytest.mark.slow
def test_a_rank_leaving_while_rank_0_is_frozen_ends_within_the_bound(caplog):
    """A rank's last word to rank 0's store, after its watch thread ended (its loop finished):
    rank 0 frozen then (a paused node), the store never answers; the rank's process ends at the
    bound rather than wait for it forever (a store op has no timeout of its own)."""
    port = free_port()
    zero = peer(0, port, master=True)
    exits: list[int] = []
    watch = PeerWatch(client(port), 1, 2, BOUND_S, exit=exits.append)
    closing = threading.Thread(target=watch.close, daemon=True)
    try:
        watch._stop.set()  # its loop ended (as close() stops it first), so no beat of its own is in flight
        watch._thread.join()
        os.kill(zero.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        closing.start()
        until(lambda: exits, 3 * BOUND_S)
        assert exits[:1] == [1] and time.monotonic() - t0 <= BOUND_S + 2.0
        assert "leaving trainer rank 0's store" in caplog.text
    finally:
        zero.kill()  # its store's connection closes: the add blocked in it ends
        closing.join(10)


@pytest.mark.slow
def test_a_rank_that_left_is_not_waited_for_and_rank_0_leaves_once_the_others_said_so():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=BOUND_S), wait_for_workers=False)
    exits: list[int] = []
    zero = PeerWatch(client(port), 0, 2, BOUND_S, exit=exits.append)
    one = PeerWatch(client(port), 1, 2, BOUND_S, exit=exits.append)
    time.sleep(1.5)
    one.close()  # rank 1's loop ended; it stops beating
    time.sleep(BOUND_S + 1.5)
    assert exits == []
    t0 = time.monotonic()
    zero.close()
    assert time.monotonic() - t0 < 1.5 and exits == []
    del server


@pytest.mark.slow
def test_a_whole_gang_frozen_past_the_bound_goes_on_when_thawed():
    """Both ranks frozen together (a paused VM) for longer than the bound: rank 0 counts the freeze
    one slice of its awake time, so it does not take rank 1 for gone on thawing. (A bound of 4 s:
    up to a beat's second before the freeze and one after it count.)"""
    port, bound_s = free_port(), 4.0
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=bound_s), wait_for_workers=False)
    one = peer(1, port, master=False, bound_s=bound_s)
    exits: list[int] = []
    watch = PeerWatch(client(port), 0, 2, bound_s, exit=exits.append)
    try:
        time.sleep(1.5)
        me = os.getpid()
        both = f"kill -STOP {one.pid} {me}; sleep {bound_s + 2}; kill -CONT {one.pid} {me}"
        subprocess.run(["sh", "-c", both], check=True, timeout=30)
        time.sleep(bound_s)
        assert exits == []
    finally:
        one.kill()
        watch.close()
        del server


@pytest.mark.slow
def test_a_rank_started_again_ends_the_old_gang_at_once_and_joins_the_next():
    """A container restarted in place: rank 1's process killed and a new one started, while rank 0
    still runs the old gang (on a GPU, NCCL within a node would not notice). The new process's
    word ends rank 0 within a beat or two, far inside the silence bound (20 s here), and the new
    process goes on once the old gang's store is gone; against a store whose gang is still
    forming it goes on at once."""
    port, bound_s = free_port(), 20.0
    zero = peer(0, port, master=True, bound_s=bound_s, real_exit=True)
    one = peer(1, port, master=False, bound_s=bound_s)
    store = client(port)
    try:
        assert until(lambda: store.check([FORMED_KEY]), 5.0) < 5.0  # every rank beat: the gang formed
        one.kill()
        t0 = time.monotonic()
        say_started("127.0.0.1", port, 1, bound_s)  # rank 1's next process
        assert time.monotonic() - t0 < 4.0
        assert zero.wait(timeout=5) == 1
        assert "trainer rank 1 started again" in zero.stderr.read()
    finally:
        zero.kill()
        one.kill()
    fresh = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=BOUND_S), wait_for_workers=False)
    t0 = time.monotonic()
    say_started("127.0.0.1", port, 1, bound_s)  # the next gang's store: forming, so no wait
    assert time.monotonic() - t0 < 1.0 and fresh.add(start_key(1), 0) == 1
