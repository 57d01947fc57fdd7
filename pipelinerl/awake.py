"""Time as this process lives it: bounds and silences counted in its awake time, which stops
while the process is frozen (SIGSTOP, a paused container or VM, a held event loop), and the
watchdog that ends the process when a section blocks past its bound. The standard library only."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

log = logging.getLogger("pipelinerl")

AWAKE_SLICE_S = 0.25  # how often a bounded wait (`wait_awake`) looks at the clock
LATE_S = 1.0  # a look later than this past its time: the process was not running meanwhile


def awake_seconds(elapsed: float, asked: float, late_s: float = LATE_S) -> float:
    """Of the `elapsed` seconds of a wait of `asked`, those this process was awake: all, unless
    it woke more than `late_s` after it asked to (frozen: a SIGSTOP, a paused container or VM, or
    its event loop held); then only what it asked for."""
    return elapsed if elapsed <= asked + late_s else asked


async def wait_awake(aw: Awaitable[Any], seconds: float) -> Any:
    """`asyncio.wait_for(aw, seconds)` with `seconds` of this process's awake time. asyncio's
    clock runs on while the process is frozen, so a bound counted in it fires on thawing, before
    what was frozen along with it (a pod's other processes) could answer. Cancels `aw` and raises
    TimeoutError when the bound passes."""
    task = asyncio.ensure_future(aw)
    awake, last = 0.0, time.monotonic()
    try:
        while True:
            asked = min(AWAKE_SLICE_S, seconds - awake)
            done, _ = await asyncio.wait({task}, timeout=asked)
            if done:
                return task.result()
            now = time.monotonic()
            awake, last = awake + awake_seconds(now - last, asked), now
            if awake >= seconds:
                raise TimeoutError(f"not done within {seconds:.0f} s awake")
    finally:
        task.cancel()  # nothing once it is done


class AwakeClock:
    """Seconds of this process's awake time, for judging peers by their silence: a process
    frozen past the bound (a paused pod) must not, on thawing, take for gone every peer it could
    not hear meanwhile, before its own thread reads what they sent. Ticked by an event loop
    (`tick_forever`) every AWAKE_SLICE_S, a tick later than LATE_S counting only the slice;
    read (`now`) from any thread. Never goes back."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()  # the wall reading of the last tick
        self._awake = 0.0  # awake seconds up to the last tick
        self._read = 0.0  # the highest reading given

    def tick(self) -> None:
        with self._lock:
            t = self._clock()
            self._awake += awake_seconds(t - self._last, AWAKE_SLICE_S)
            self._last = t

    def now(self) -> float:
        with self._lock:
            since = awake_seconds(self._clock() - self._last, AWAKE_SLICE_S)
            self._read = max(self._read, self._awake + since)
            return self._read

    async def tick_forever(self) -> None:
        while True:
            await asyncio.sleep(AWAKE_SLICE_S)
            self.tick()


class Watchdog:
    """Sections of this process that must end within a bound of its awake time, or the process
    exits (code 1) to be restarted (its pod; locally, by its supervisor): for a call that can
    block in native code past every timeout of ours, where nothing can be raised into it (NCCL
    setting up a communicator while a peer it waits for is dead). Its HTTP thread would go on
    answering the liveness probe meanwhile. A daemon thread, started at the first section, ticks
    the clock and looks every AWAKE_SLICE_S; it needs the GIL, which torch's collectives and
    store waits release while they block. `exit`: the tests' stand-in for `os._exit`."""

    def __init__(self, exit: Callable[[int], Any] = os._exit) -> None:
        self.clock = AwakeClock()
        self._exit = exit
        self._lock = threading.Lock()
        self._sections: dict[int, tuple[str, float, float]] = {}  # id: (what, bound, deadline)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def bound(self, what: str, seconds: float) -> Iterator[None]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
                self._thread.start()
            key = next(self._ids)
            self._sections[key] = (what, seconds, self.clock.now() + seconds)
        try:
            yield
        finally:
            with self._lock:
                del self._sections[key]

    def overdue(self) -> tuple[str, float] | None:
        """A section past its bound: (what, bound), or None."""
        now = self.clock.now()
        with self._lock:
            return next(((what, s) for what, s, deadline in self._sections.values() if now >= deadline), None)

    def _watch(self) -> None:
        while True:
            time.sleep(AWAKE_SLICE_S)
            self.clock.tick()
            late = self.overdue()
            if late is not None:
                what, bound = late
                end_process(
                    self._exit,
                    f"{what}: not done within {bound:.0f} s of this process's awake time (blocked past every "
                    f"timeout of ours): exiting so that the process is restarted",
                )
                return


def end_process(exit: Callable[[int], Any], why: str) -> None:
    """End this process from a thread of its own (code 1, to be restarted), saying why: its main
    thread may be blocked in native code that nothing can be raised into."""
    log.critical("%s", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    exit(1)
