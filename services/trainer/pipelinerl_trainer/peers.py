"""Whether the other trainer ranks are still there, and the end of a rank whose gang lost one.

A collective waits for a rank that stopped answering without closing its connections (its node
frozen or powered off; with NCCL also one that died where its transport does not see it go: NCCL
reports a lost peer from its socket and InfiniBand transports, read in its documentation, not
measured here) for as long as its group's timeout, and DeepSpeed runs ZeRO's
gradient all-reduce in a group of its own (a clone of the world group) made with torch's default
timeout: 30 minutes for gloo, 10 for NCCL. Measured here: rank 0 of two waited in it for more
than 14 minutes, until the test gave up, while rank 1 was frozen (SIGSTOP). So each rank beats,
once a second, a counter of its own in the store trainer rank 0 serves for the ranks'
rendezvous; rank 0 takes a rank whose counter stood still for `weightSync.timeoutSeconds` of its
own awake time for gone and ends its process; the others end theirs when rank 0's store stops
answering (at once where rank 0 died; past the same bound where it froze). Every rank is then
restarted (its pod; locally, by the runner) and the gang resumes from the checkpoint together, as
it must: the lost rank's part of the ZeRO state since the checkpoint is gone with it. A rank that
leaves (its loop ended: finished or stopped) says so first, and rank 0 waits for that before
leaving itself. A rank alive but stuck (a hung kernel) beats on: torch's timeouts still end it.

A rank asked to stop (its SIGTERM) says so in the store with its next beat, and every rank that
hears it is asked too (`asked`): a drain ends one pod, and the gang then stops together, each
rank with the stop checkpoint (`stopping`), rather than losing the steps since the last one.

A rank whose process ended and was started again (a container restarted in place: a crash, an
out-of-memory kill) says so in the store it finds before it joins the ranks' group
(`say_started`); rank 0 ends the old gang at once on that word, and the new process waits for
that store to go before it joins, so that it joins the next gang, not the old one.

`Hearing` (pure) is rank 0's account of the others; `PeerWatch` is the thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pipelinerl.awake import AWAKE_SLICE_S, AwakeClock, Watchdog, end_process

log = logging.getLogger("pipelinerl.trainer")
BEAT_S = 1.0
LEFT = 1 << 40  # added to a rank's count when it leaves: never taken for silent after that
FORMED_KEY = "pipelinerl/trainer-gang-formed"  # set by rank 0 once every rank of its gang beat
STOP_KEY = "pipelinerl/trainer-stop"  # counts the ranks asked to stop by their own signal


def beat_key(rank: int) -> str:
    return f"pipelinerl/trainer-beat/{rank}"


def start_key(rank: int) -> str:
    return f"pipelinerl/trainer-starts/{rank}"


@dataclass
class Hearing:
    """Rank 0's account of the other ranks (pure), from what each wrote in the store: its beat
    count and how many of its processes started. A rank whose count has not moved for `bound_s`
    (seconds of the caller's clock, since `since` for a rank not heard yet) is silent, unless it
    said it left. The gang is formed once every rank beat; a rank that started again after that
    is no longer the process in this gang."""

    ranks: tuple[int, ...]
    bound_s: float
    since: float
    counts: dict[int, int] = field(default_factory=dict)
    moved: dict[int, float] = field(default_factory=dict)  # when each count last changed
    starts: dict[int, int] = field(default_factory=dict)  # the processes started, as the gang formed

    def heard(self, rank: int, count: int, starts: int, now: float) -> None:
        formed = self.formed
        if count != self.counts.get(rank):
            self.counts[rank], self.moved[rank] = count, now
        if not formed:
            self.starts[rank] = starts
        elif starts != self.starts[rank]:
            self.starts[rank] = -1  # started again: never the same process again

    @property
    def formed(self) -> bool:
        return all(self.counts.get(r, 0) > 0 for r in self.ranks)

    def restarted(self) -> list[int]:
        return [r for r in self.ranks if self.starts.get(r) == -1]

    def silent(self, now: float) -> list[int]:
        return [r for r in self.ranks if not self.left(r) and now - self.moved.get(r, self.since) > self.bound_s]

    def left(self, rank: int) -> bool:
        return self.counts.get(rank, 0) >= LEFT

    def all_left(self) -> bool:
        return all(self.left(r) for r in self.ranks)


def rendezvous_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the store trainer rank 0 serves for the ranks' rendezvous: it waits up to
    `timeout_s` for the store to be up, and each of its waits for a key is bounded the same."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)


def say_started(host: str, port: int, rank: int, bound_s: float, exit: Callable[[int], Any] = os._exit) -> None:
    """Before a rank other than 0 joins the ranks' group: count this process's start in the store
    rank 0 serves. Where that store's gang had formed, its rank 0 still runs the gang this rank's
    previous process was in, and ends it on this word: wait for the store to go (a beat of rank
    0's, a moment), so that this rank joins the next gang. The whole within a bound of awake time
    (a store whose node stopped answering answers no call), or the process ends to start again."""
    wait_s = 5 * bound_s  # for rank 0 to start serving its store: as long as torch's rendezvous waits
    with Watchdog(exit).bound(
        f"trainer rank {rank} saying it started, in trainer rank 0's store", wait_s + 2 * bound_s
    ):
        store = rendezvous_client(host, port, wait_s)
        store.add(start_key(rank), 1)
        if not store.check([FORMED_KEY]):
            return  # a gang forming: this rank joins it
        log.info("trainer rank 0 still runs the gang of this rank's previous process: waiting for it to end")
        end = time.monotonic() + bound_s
        while time.monotonic() < end:
            try:
                store.add(start_key(rank), 0)
            except RuntimeError:  # the old gang's store is gone
                return
            time.sleep(AWAKE_SLICE_S)
        log.warning("the old gang's store is still up %.0f s after this rank started: joining anyway", bound_s)


class PeerWatch:
    """This rank's beat and, on rank 0, the account of the others', on a thread of its own (it
    needs the GIL, which torch's collectives release while they wait). `store`: a client of the
    ranks' rendezvous store (`rendezvous_client`); `stop`: set when this rank is asked to stop (its
    signal), which the others hear; `asked`: set when another rank was; `exit`: the tests'
    stand-in for `os._exit`."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        bound_s: float,
        stop: threading.Event | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.store, self.rank, self.bound_s, self._exit = store, rank, bound_s, exit
        self.stop, self.asked, self._said_stop = stop or threading.Event(), threading.Event(), False
        self.clock = AwakeClock()
        heard = tuple(range(1, world)) if rank == 0 else ()  # rank 0 hears the others; they hear its store
        self.hearing = Hearing(heard, bound_s, self.clock.now())
        self.watchdog = Watchdog(exit)
        self._stop = threading.Event()
        self.store.add(beat_key(rank), 1)
        self._thread = threading.Thread(target=self._run, name="trainer-peers", daemon=True)
        self._thread.start()

    @classmethod
    def of_ranks(
        cls, host: str, port: int, rank: int, world: int, bound_s: float, stop: threading.Event | None = None
    ) -> PeerWatch | None:
        """The watch of a rank in a gang of `world`, over the rendezvous store at host:port (its
        torch group formed, so the store is up); None for a gang of one."""
        if world == 1:
            return None
        return cls(rendezvous_client(host, port, bound_s), rank, world, bound_s, stop)

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.wait(AWAKE_SLICE_S):
            self.clock.tick()
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + BEAT_S
            try:
                self._beat()
            except RuntimeError as err:  # the store's errors (DistError): rank 0 gone
                if not self._stop.is_set():
                    self._end(f"trainer rank 0's store did not answer ({err!r})")
                return
            why = self._why_end()
            if why and not self._stop.is_set():
                self._end(why)
                return

    def _why_end(self) -> str | None:
        restarted, silent = self.hearing.restarted(), self.hearing.silent(self.clock.now())
        if restarted:
            return f"trainer rank {_names(restarted)} started again (the process in this gang ended)"
        if silent:
            return (
                f"trainer rank {_names(silent)} said nothing for {self.bound_s:.0f} s of this process's awake "
                f"time (its process died, or its node stopped answering)"
            )
        return None

    def _beat(self) -> None:
        # A store op has no timeout of its own while its server does not answer (a frozen node).
        with self.watchdog.bound(
            "a beat into trainer rank 0's store (rank 0 or its node stopped answering)", self.bound_s
        ):
            self.store.add(beat_key(self.rank), 1)
            self._hear_stop()
            if self.rank == 0:
                self._hear()

    def _hear_stop(self) -> None:
        """Say this rank was asked to stop, once; hear whether another was."""
        say = self.stop.is_set() and not self._said_stop
        asked = self.store.add(STOP_KEY, int(say))
        self._said_stop |= say
        if asked > int(self._said_stop):
            self.asked.set()

    def _hear(self) -> None:
        formed, now = self.hearing.formed, self.clock.now()
        for r in self.hearing.ranks:
            self.hearing.heard(r, self.store.add(beat_key(r), 0), self.store.add(start_key(r), 0), now)
        if self.hearing.formed and not formed:
            self.store.set(FORMED_KEY, "1")

    def _end(self, why: str) -> None:
        end_process(
            self._exit,
            f"{why}: exiting so that every trainer rank restarts and resumes from the checkpoint together "
            f"(a collective would wait for it up to the group's timeout)",
        )

    def close(self) -> None:
        """This rank leaves (its loop ended: finished or stopped). Rank 0 first waits, up to the
        bound, until every other rank said it left, so that its store outlives their watches."""
        self._stop.set()
        self._thread.join()
        try:
            if self.rank == 0:
                end = time.monotonic() + self.bound_s
                while not self.hearing.all_left() and time.monotonic() < end:
                    self._hear()
                    time.sleep(AWAKE_SLICE_S)
            else:  # its watch thread ended: its own bound, for rank 0 frozen as this rank leaves
                with self.watchdog.bound(
                    "leaving trainer rank 0's store (rank 0 or its node stopped answering)", self.bound_s
                ):
                    self.store.add(beat_key(self.rank), LEFT)
        except Exception as err:  # noqa: BLE001 - leaving anyway
            log.warning("trainer rank %d left without the others' word: %r", self.rank, err)


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
