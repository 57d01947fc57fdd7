"""A bound counted in the process's awake time (`runtime.wait_awake`): what a frozen process (a
paused pod) waited does not count; what it waited awake does. The real freeze, of a generator and
its vLLM core by SIGSTOP, is in tests/integration/test_inflight_update.py."""

import asyncio
import threading
import time

import pytest

from pipelinerl.runtime import AWAKE_SLICE_S, LATE_S, awake_seconds, wait_awake


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
