"""The watchdog (`pipelinerl.awake.Watchdog`): a section past its bound of the process's awake
time ends the process; one that ends in time, or whose process was only frozen (a paused pod),
does not. The exit is a stand-in here; the trainer ended by it while blocked in a native wait of
torch.distributed: tests/integration/test_weight_group.py."""

from __future__ import annotations

import logging
import os
import subprocess
import time

from pipelinerl.awake import Watchdog


def test_a_section_past_its_bound_exits_once_naming_it_and_one_ended_in_time_never(caplog):
    exits: list[int] = []
    dog = Watchdog(exit=exits.append)
    with dog.bound("a quick call", 1.0):
        time.sleep(0.1)
    time.sleep(1.5)  # past the first section's bound, after it ended
    assert exits == []
    t0 = time.monotonic()
    with caplog.at_level(logging.CRITICAL, logger="pipelinerl"), dog.bound("forming weight group x", 1.0):
        while not exits and time.monotonic() - t0 < 10:
            time.sleep(0.05)  # blocked past the bound
    assert exits == [1]
    assert 1.0 <= time.monotonic() - t0 < 2.5
    assert "forming weight group x: not done within 1 s" in caplog.text
    time.sleep(0.6)
    assert exits == [1]  # once


def test_a_process_frozen_inside_a_section_past_its_bound_goes_on_when_thawed():
    """SIGSTOP for 3 s inside a 2 s section that ends right after the thaw: the freeze counts one
    slice of awake time, so the process is not ended (by the wall clock it would have been)."""
    exits: list[int] = []
    dog = Watchdog(exit=exits.append)
    me = os.getpid()
    t0 = time.monotonic()
    with dog.bound("a call across a pause", 2.0):
        subprocess.run(["sh", "-c", f"kill -STOP {me}; sleep 3; kill -CONT {me}"], check=True, timeout=20)
        time.sleep(0.5)  # the watchdog looks on, awake, after the thaw
    assert time.monotonic() - t0 >= 3.0
    time.sleep(0.5)
    assert exits == []
