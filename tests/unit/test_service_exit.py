"""A service stuck or failed does not stay up as if healthy (`pipelinerl.runtime`): a failed one
exits whatever it leaves running (a thread stuck in the default executor, a reward function's
remote call with no timeout of its own, would hold asyncio.run's teardown, and the pod, forever),
and one whose event loop is blocked says so on /healthz, which its pod's liveness probe reads;
one that ends stops its health server before the interpreter tears down. Each run as its own
process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

FAILED = """
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
    done = subprocess.run([sys.executable, "-c", FAILED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert time.monotonic() - started < 60  # not the stuck thread's 600 s
    assert "service failed: RuntimeError('the reward timed out'); exiting within 1 s" in done.stderr
    # The teardown never ended, so Python never printed the traceback: the exit says it.
    assert "exiting with 1: the wind-down did not end; the failure:" in done.stderr
    assert 'File "<string>", line 8, in run\nRuntimeError: the reward timed out' in done.stderr


FAILED_WINDING_DOWN = """
import asyncio, os, signal, time
from pipelinerl.runtime import serve

stopping = asyncio.Event()

async def run():
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
    await stopping.wait()
    loop.run_in_executor(None, time.sleep, 600)  # the wind-down leaves a thread no one can stop
    raise RuntimeError("the final checkpoint failed")

serve(run, stopping.set, failed_exit_s=60)
"""


def test_a_service_failing_in_its_sigterm_wind_down_exits_with_1():
    """SIGTERM's timer (20 s) fires before the failure's (60 s here): it exits with 1 too, not
    the 0 of a clean stop."""
    done = subprocess.run([sys.executable, "-c", FAILED_WINDING_DOWN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "service failed: RuntimeError('the final checkpoint failed')" in done.stderr


STALLED = """
import asyncio, json, sys, time, urllib.error, urllib.request
from pydantic import BaseModel
import pipelinerl.runtime as rt

rt.LOOP_STALL_S, rt.LOOP_BEAT_S = 1.0, 0.1
port = int(sys.argv[1])

def health():
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return None, ""

async def run():
    server = rt.HealthServer("test", port, BaseModel).start()
    while health()[0] is None:  # the server's thread starting
        await asyncio.sleep(0.2)
    time.sleep(1.5)  # blocked before it is ready (a GPU generator loading its model): not watched
    seen = [health()]
    server.ready = True
    await asyncio.sleep(0.3)
    seen.append(health())
    time.sleep(1.5)  # a call that blocks the loop
    seen.append(health())  # asked from the loop's own thread, still blocked: the server thread answers
    await asyncio.sleep(0.5)
    seen.append(health())
    print(json.dumps(seen))

rt.serve(run, lambda: None)
"""


def test_a_blocked_event_loop_of_a_ready_service_fails_the_health_check_until_it_runs_again():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", STALLED, str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loading, before, during, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert loading == before == after == [200, "ok"]
    assert during[0] == 503 and during[1].startswith("event loop stalled for")


EXITING = """
import atexit, sys, threading, urllib.request
from pydantic import BaseModel
import pipelinerl.runtime as rt

port = int(sys.argv[1])
# atexit runs last what was registered first: this looks after the server's own stop has run.
atexit.register(lambda: print("http thread at exit:", any(t.name == "http" for t in threading.enumerate())))
rt.HealthServer("test", port, BaseModel).start()
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
        break
    except OSError:
        threading.Event().wait(0.1)
print("answered")
"""


def test_the_health_server_is_stopped_before_the_interpreter_tears_down():
    """Its uvicorn loop runs in a daemon thread: left running while the interpreter finalizes
    its modules, it can crash a process that ends cleanly (once in CI: -11, SIGSEGV, for a
    service whose output was complete). At exit it is stopped and joined first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", EXITING, str(port)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["answered", "http", "thread", "at", "exit:", "False"], done.stdout


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_ends_at_once():
    """The kernel's parent-death signal covers only a death after the request: a child forked
    just before its parent was killed checks the parent's pid, and ends instead of running on."""
    import signal
    import subprocess
    import sys

    from pipelinerl_cli.processes import die_with_parent, dying_with_this_process

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no one's parent now
    orphan = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: die_with_parent(gone.pid))
    assert orphan.wait(timeout=10) == -signal.SIGTERM
    child = subprocess.Popen(["sleep", "0.1"], preexec_fn=dying_with_this_process())
    assert child.wait(timeout=10) == 0  # its parent alive: it runs


TOLD_AS_IT_FINISHED = """
from pipelinerl.runtime import exit_soon, stay_up_until_stopped

# A trainer's SIGTERM during its last step: its stop's timer armed (a failure if it fires), then
# the run ends all the same, finished.
exit_soon(30, code=1, why="the stop did not end")
stay_up_until_stopped("trainer")
print("left")
"""


def test_a_service_told_to_stop_as_it_finished_does_not_stay_up_for_a_second_signal():
    """A finished service stays up (a StatefulSet restarts one that exits) until stopped; one whose
    SIGTERM came while it finished leaves at once, exiting 0 (it waited for a second signal that
    never comes, until its stop's timer ended it with 1: a finished run counted a failure)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", TOLD_AS_IT_FINISHED], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "left") and time.monotonic() - started < 25
