"""Bounds and silences counted in the process's awake time (`awake.wait_awake`,
`awake.AwakeClock`): what a frozen process (a paused pod) waited does not count; what it
waited awake does. The real freeze of a generator and its vLLM core by SIGSTOP is in
tests/integration/test_inflight_update.py; of this process, below."""

import asyncio
import os
import subprocess
import threading
import time

import pytest
from pipelinerl_trainer.membership import Member, Membership

from pipelinerl.admission import Admission
from pipelinerl.awake import AWAKE_SLICE_S, LATE_S, AwakeClock, awake_seconds, wait_awake


def test_a_look_on_time_counts_whole_and_a_late_one_only_the_slice_asked_for():
    assert awake_seconds(0.25, 0.25) == 0.25
    assert awake_seconds(0.25 + LATE_S, 0.25) == 0.25 + LATE_S  # a busy machine: still awake
    assert awake_seconds(300.0, 0.25) == 0.25  # frozen for five minutes
    assert awake_seconds(0.1, 0.1) == 0.1


async def test_the_answer_comes_through_and_a_missing_one_times_out_in_the_bound():
    assert await wait_awake(asyncio.sleep(0.1, result="answer"), 2.0) == "answer"
    never = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 1 s awake"):
        await wait_awake(never, 1.0)
    assert 1.0 <= time.monotonic() - t0 < 1.0 + 2 * AWAKE_SLICE_S
    assert never.cancelled()  # given up on: cancelled, as wait_for does


async def test_an_error_of_the_call_is_raised_as_is():
    async def fails():
        raise ValueError("the call's own")

    with pytest.raises(ValueError, match="the call's own"):
        await wait_awake(fails(), 1.0)


async def test_a_loop_held_past_the_bound_goes_on_waiting_for_what_was_held_with_it():
    """The loop held 1.2 s (as a frozen process's is) against a bound of 0.5 s, the call's answer
    coming in during the hold and finishing 50 ms after it (a core frozen along, or an answer
    that takes a few loop turns to arrive): taken. asyncio.wait_for gives up on it."""
    loop = asyncio.get_running_loop()

    async def call() -> str:
        answer = loop.create_future()
        threading.Timer(0.6, loop.call_soon_threadsafe, (answer.set_result, "late")).start()
        value = await answer
        await asyncio.sleep(0.05)
        return value

    for bounded, thawed in ((wait_awake, "late"), (asyncio.wait_for, None)):
        waiting = asyncio.ensure_future(bounded(call(), 0.5))
        await asyncio.sleep(0.1)
        time.sleep(1.2)  # the loop held: no look at the clock meanwhile
        if thawed:
            assert await waiting == thawed
        else:
            with pytest.raises(TimeoutError):
                await waiting


def test_the_awake_clock_counts_ticks_on_time_whole_a_freeze_as_one_slice_and_never_goes_back():
    t = [100.0]
    clock = AwakeClock(lambda: t[0])
    for _ in range(4):
        t[0] += AWAKE_SLICE_S
        clock.tick()
    assert clock.now() == pytest.approx(1.0)
    t[0] += 0.1
    assert clock.now() == pytest.approx(1.1)  # read between ticks: the time since the last one
    t[0] += 300.0  # frozen for five minutes
    assert clock.now() == pytest.approx(1.0 + AWAKE_SLICE_S)
    clock.tick()
    assert clock.now() == pytest.approx(1.0 + AWAKE_SLICE_S)
    t[0] += AWAKE_SLICE_S + LATE_S  # a tick late on a busy machine: still awake
    assert clock.now() == pytest.approx(1.0 + 2 * AWAKE_SLICE_S + LATE_S)
    t[0] += 0.1  # later still, now taken for a freeze: the clock stays where it was read
    assert clock.now() == pytest.approx(1.0 + 2 * AWAKE_SLICE_S + LATE_S)


def test_a_process_frozen_past_the_liveness_bound_still_hears_its_peer_alive_on_thawing():
    """Judgements of peers by their silence, in awake time, the clock ticked by an event loop in
    its own thread (as the trainer's NATS bridge and the generator's loop tick theirs): the
    trainer's of its generators (`Membership`) and a generator's of its peers (`Admission`), both
    taking a peer silent for 2 s here for gone. The whole process SIGSTOPped for 3 s (a paused
    pod) right after a hello: on thawing, before a newer hello is read, the peer is still alive by
    the awake clock; by the wall clock it is gone (the trainer would re-form its weight group
    without it, then again with it; the generator would admit groups without counting its peer's)."""
    clock, stop = AwakeClock(), threading.Event()

    async def tick_until_stopped() -> None:
        ticking = asyncio.ensure_future(clock.tick_forever())
        while not stop.is_set():
            await asyncio.sleep(0.05)
        ticking.cancel()

    ticker = threading.Thread(target=asyncio.run, args=(tick_until_stopped(),))
    ticker.start()
    try:
        time.sleep(2 * AWAKE_SLICE_S)
        generator = Member(0, "a")
        awake, wall = Membership(2.0), Membership(2.0)
        awake.hello(generator, 0, clock.now())
        wall.hello(generator, 0, time.monotonic())
        admissions = [
            Admission(groups_per_step=4, generators=2, max_lag=1, max_inflight=4, peer_ttl_s=2.0) for _ in range(2)
        ]  # awake, wall
        admissions[0].on_peer(1, 3, 0, clock.now())
        admissions[1].on_peer(1, 3, 0, time.monotonic())
        t0, a0 = time.monotonic(), clock.now()
        me = os.getpid()
        subprocess.run(["sh", "-c", f"kill -STOP {me}; sleep 3; kill -CONT {me}"], check=True, timeout=20)
        assert time.monotonic() - t0 >= 3.0
        assert clock.now() - a0 < 1.5  # the freeze counted as one slice
        assert awake.alive(clock.now()) == (generator,)
        assert wall.alive(time.monotonic()) == ()
        admissions[0].expire_peers(clock.now())
        admissions[1].expire_peers(time.monotonic())
        assert [list(a.peers) for a in admissions] == [[1], []]
    finally:
        stop.set()
        ticker.join(5)
