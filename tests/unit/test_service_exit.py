"""A failed service exits (`pipelinerl.runtime.serve`) whatever it leaves running: a thread stuck
in the default executor (a reward function's remote call with no timeout of its own) would hold
asyncio.run's teardown, and the pod, alive and healthy, forever. Run as its own process."""

from __future__ import annotations

import subprocess
import sys
import time

SERVICE = """
import asyncio, time
from pipelinerl.runtime import serve

async def run():
    asyncio.get_running_loop().run_in_executor(None, time.sleep, 600)  # a thread no one can stop
    await asyncio.sleep(0.1)
    raise RuntimeError("the reward timed out")

serve(run, lambda: None, failed_exit_s=1)
"""


def test_a_failed_service_exits_with_1_even_with_a_thread_stuck_in_the_executor():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SERVICE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert time.monotonic() - started < 60  # not the stuck thread's 600 s
    assert "service failed: RuntimeError('the reward timed out'); exiting within 1 s" in done.stderr
