"""Trainer side of in-flight weight updates over an elastic weight group.

Every rank packs the new weights into rank 0's snapshot (under ZeRO-3 the gather is a
collective); rank 0 then broadcasts it to the generators of the current membership epoch
(`pipelinerl_trainer.membership`), opening a new epoch first when generators joined, left or
were dropped. A generator that does not join, does not confirm within the weight-sync timeout,
or fails to load is dropped and the job goes on with the others; none is ever waited for beyond
a deadline. While the trainer waits for data, `resync` brings generators that joined or fell
behind up to the snapshot's version, without the other ranks.

The trainer need not wait for the broadcast either: rank 0 confirms the previous update and
forms the epoch in its own thread, then broadcasts the snapshot (a copy of its own) from another
while every rank trains the next step, and the generators load it meanwhile; the next update, or
anything else that needs the group, waits for it first (`finish`), so the snapshot is never
packed over while it is sent and a generator takes one update at a time. What the trainer is
held up by an update is then the packing (ZeRO-3's gather), the previous update's confirmation
(its replies usually come during the step) and whatever of the previous broadcast outlasted a
step: at scale, where the broadcast is a large share of a step, that is the trainers' time the
pipeline gains (docs/planner.md). Generators only admit work the lag budget allows for the
weights they actually hold, so this never makes data staler than `maxLag`."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from typing import Protocol

from pipelinerl import messages as m
from pipelinerl.awake import Watchdog
from pipelinerl.contracts import JobSubjects
from pipelinerl.runtime import memory_limit_bytes
from pipelinerl.spec import SpecError
from pipelinerl.steps import generator_of_rank, weight_group_size
from pipelinerl.weight_group import (
    GroupIncomplete,
    WeightGroup,
    WeightSyncError,
    buffer_device,
    bucket_nbytes,
    dtype_name,
    form_bound,
    plan_buckets,
)
from pipelinerl.weight_snapshot import Snapshot, pinned_bytes, snapshot_in_host
from pipelinerl_trainer.membership import Member, Membership
from pipelinerl_trainer.model import TrainingEngine, full_parameters, named_weights

log = logging.getLogger("pipelinerl.trainer")
# A step's weight-update metrics when none was sent (below the floor, or inside a generation phase).
NO_UPDATE: dict[str, float] = {
    "weight_updates": 0,
    "weight_pause_max_seconds": 0.0,
    "updates_with_running_requests": 0,
    "weight_sync_seconds": 0.0,
}
LIVENESS_S = 10.0  # a generator silent for longer is taken for gone (it says hello every second)
FORM_ATTEMPTS = 3  # epochs tried per update when members do not come


class ReplyBridge(Protocol):
    """What the sender uses of the trainer's NATS bridge: publish the update, read the replies
    and the generators' hellos."""

    subjects: JobSubjects
    done: queue.Queue[m.WeightUpdateDone]
    hellos: queue.Queue[tuple[float, m.GeneratorHello]]  # (`now` when received, hello)

    def publish(self, subject: str, msg: m.Message, stream: bool = True) -> None: ...

    def now(self) -> float:
        """The clock of the membership and of the updates' deadlines: this process's awake time."""
        ...


class WeightSender:
    """Runs on every trainer rank (ZeRO-3 gathers are collectives); only rank 0 talks, and only
    rank 0 has a `store` (the rendezvous every epoch's group meets in)."""

    def __init__(
        self,
        engine: TrainingEngine,
        rank: int,
        bridge: ReplyBridge,
        *,
        backend: str,
        bucket_mb: int,
        timeout_s: float,
        store=None,
        workers_per_generator: int = 1,
        liveness_s: float = LIVENESS_S,
        floor: int = 0,
        token: str = "",
    ):
        self.engine, self.rank, self.bridge, self.store = engine, rank, bridge, store
        # Nothing older than this version is sent (a restarted trainer replaying steps its
        # predecessor sent already): a generator's weights never go back.
        self.floor = floor
        self.token = token  # the job's weight token: members prove they hold it (WeightGroup._authenticate)
        self.backend, self.timeout_s, self.workers = backend, timeout_s, workers_per_generator
        self.params = named_weights(engine)
        self.buckets = plan_buckets(
            [(n, list(_full_shape(p)), dtype_name(p.dtype)) for n, p in self.params], bucket_mb << 20
        )
        self.by_name = dict(self.params)
        self.snapshot = snapshot_for(self.buckets, buffer_device(backend)) if rank == 0 else None
        self.membership = Membership(liveness_s)
        self.group: WeightGroup | None = None
        self.group_id = ""
        self.run_id = uuid.uuid4().hex[:8]  # this trainer process: its group ids never repeat a predecessor's
        self.pending: tuple[int, float, tuple[Member, ...]] | None = None  # (version, deadline, members) unconfirmed
        self.broken_broadcasts = 0  # broadcasts a member's failure broke (each re-forms the group)
        # Bounds each `form` (`form_bound`) and the wait for an update in flight: past either the
        # trainer exits and is restarted.
        self.watchdog = Watchdog()
        self.flight: threading.Thread | None = None  # rank 0's broadcast sent while the trainer trains on
        self.flight_error: BaseException | None = None

    # -- all ranks ---------------------------------------------------------------------------
    def send(self, version: int, wait: bool = True) -> dict[str, float]:
        """Pack the weights of `version` (the broadcast in flight finished first); rank 0 confirms
        the previous update and broadcasts this one: with `wait`, here, and until the generators
        have loaded it; without, the broadcast from a thread while the trainer trains on. The
        pause statistics are those of the latest update confirmed. Below the floor: nothing (on
        every rank alike)."""
        t0 = time.perf_counter()
        stats = dict(NO_UPDATE)
        if version < self.floor:
            return stats
        self.finish()
        for i, bucket in enumerate(self.buckets):
            params = [self.by_name[t["name"]] for t in bucket["tensors"]]
            with full_parameters(self.engine, params):
                if self.snapshot is not None:  # rank 0's
                    self.snapshot.pack(i, {t["name"]: p.data for t, p in zip(bucket["tensors"], params)})
        if self.snapshot is not None:
            self.snapshot.version = version
            stats |= self.confirm()
            stats |= self.publish(wait) or {}
        stats["weight_sync_seconds"] = time.perf_counter() - t0
        stats["weight_updates"] = 1
        return stats

    def finish(self) -> None:
        """Rank 0: wait for the broadcast in flight, if one is (within the longest its buckets'
        timeouts allow, else the watchdog ends the process), and raise what it raised (a
        generator's failure only drops it). Elsewhere: nothing to wait for."""
        flight, self.flight = self.flight, None
        if flight is None:
            return
        with self.watchdog.bound("the weight broadcast in flight", (1 + len(self.buckets)) * self.timeout_s):
            flight.join()
        error, self.flight_error = self.flight_error, None
        if error is not None:
            raise error

    # -- rank 0 -------------------------------------------------------------------------------
    def publish(self, wait: bool) -> dict[str, float] | None:
        """Broadcast the snapshot to the generators alive, in a new epoch where membership
        changed: with `wait`, here and until they have loaded it; without, from a thread (`finish`
        waits for it). None if it reached nobody. A generator's failure drops it; it never raises
        for one."""
        snapshot = self.snapshot
        assert snapshot is not None and snapshot.version is not None, "rank 0 publishes what it packed"
        version = snapshot.version
        group = self._current_group(version)
        if group is None:
            return None
        self.bridge.publish(self.bridge.subjects.sent, m.WeightsSent(version=version))  # before it can be held
        if not wait:
            handoff = snapshot.handoff()
            self.flight = threading.Thread(
                target=self._fly, args=(group, version, handoff), name=f"weights-{version}", daemon=True
            )
            self.flight.start()
            return {}
        if not self._broadcast(group, version):
            return None
        return self.confirm()

    def _broadcast(self, group: WeightGroup, version: int) -> bool:
        """Send the snapshot and record it as pending; False if a member's failure broke it."""
        assert self.snapshot is not None
        try:
            group.broadcast(self.snapshot)
        except WeightSyncError as err:  # a member died mid-broadcast: which one, gloo cannot say
            log.warning("weight broadcast of version %d failed, re-forming the group: %s", version, err)
            self.membership.suspect(self.bridge.now())
            self.broken_broadcasts += 1
            self._close_group()  # closes its connections: members still receiving fail at once
            return False
        self.pending = (version, self.bridge.now() + self.timeout_s, self.membership.members)
        return True

    def _fly(self, group: WeightGroup, version: int, handoff: contextlib.AbstractContextManager) -> None:
        """The thread of a broadcast sent while the trainer trains on (`Snapshot.handoff`: on a
        stream of its own); what it raises is kept for `finish`."""
        try:
            with handoff:
                self._broadcast(group, version)
        except BaseException as err:  # noqa: BLE001 - raised in the trainer's thread, by `finish`
            self.flight_error = err

    def _current_group(self, version: int) -> WeightGroup | None:
        """Announce the update and return the group to broadcast it in, forming a new epoch's
        first where needed (members that do not come are dropped, up to FORM_ATTEMPTS epochs)."""
        for _ in range(FORM_ATTEMPTS):
            self._take_hellos()
            members = self.membership.next_members(self.bridge.now())
            if members is not None:
                self._close_group()
                if not members:
                    self.membership.broken = True  # no group at all
                    return None  # nobody to send to: whoever joins later gets the snapshot
                self.group_id = f"{self.run_id}-{self.membership.open(members)}"
            members = self.membership.members
            self.bridge.publish(
                self.bridge.subjects.weights_update,
                m.WeightUpdate(
                    version=version,
                    buckets=self.buckets,
                    group=self.group_id,
                    members=[(g.generator, g.incarnation) for g in members],
                ),
                stream=False,
            )
            if self.group is not None:
                return self.group
            try:
                with self.watchdog.bound(f"forming weight group {self.group_id}", form_bound(self.timeout_s)):
                    self.group = WeightGroup.form(
                        self.store,
                        self.group_id,
                        weight_group_size(len(members), self.workers),
                        self.timeout_s,
                        self.backend,
                        token=self.token,
                    )
                log.info("weight group %s: generators %s", self.group_id, [g.generator for g in members])
                return self.group
            except GroupIncomplete as err:
                gone = sorted({members[generator_of_rank(r, self.workers)] for r in err.missing})
                log.warning("%s: dropping generators %s", err, [g.generator for g in gone])
                self.membership.drop(gone)
            except WeightSyncError as err:  # all came, but one left before connecting: try again
                log.warning("weight group %s failed to connect: %s", self.group_id, err)
                self.membership.broken = True
        return None

    def confirm(self) -> dict[str, float]:
        """Wait (until the update's deadline, or until the generators not heard from are gone
        silent) for the replies of the generators it was sent to; those that did not confirm, or
        failed, are dropped."""
        if self.pending is None:
            return {}
        version, deadline, members = self.pending
        self.pending = None
        replies: dict[Member, m.WeightUpdateDone] = {}
        while len(replies) < len(members):
            try:
                r = self.bridge.done.get(timeout=max(0.0, min(1.0, deadline - self.bridge.now())))
            except queue.Empty:
                self._take_hellos()
                now = self.bridge.now()
                alive = set(self.membership.alive(now))
                if now >= deadline or all(g in replies or g not in alive for g in members):
                    break  # a generator killed mid-update says nothing more: no use waiting for it
                continue
            member = Member(r.generator, r.incarnation)
            if r.version == version and member in members:
                replies[member] = r
        failed = [g for g, r in replies.items() if r.error]
        for g in failed:
            log.error("generator %d failed to load version %d: %s", g.generator, version, replies[g].error)
        missing = [g for g in members if g not in replies]
        if missing:
            log.warning(
                "generators %s did not confirm version %d within %.0fs: dropped",
                [g.generator for g in missing],
                version,
                self.timeout_s,
            )
        self.membership.drop(failed + missing)
        loaded = [r for g, r in replies.items() if not r.error]
        for r in loaded:
            self.membership.hello(Member(r.generator, r.incarnation), version, self.bridge.now())
        return {
            "weight_pause_max_seconds": max((r.pause_seconds for r in loaded), default=0.0),
            "updates_with_running_requests": sum(r.running_requests > 0 for r in loaded),
        }

    def resync(self) -> bool:
        """While waiting for data: send the snapshot again if a generator joined, left or fell
        behind it (a joiner's first weights, or the only generator coming back). True if it
        reached a generator."""
        if self.snapshot is None or self.snapshot.version is None:
            return False
        self.finish()
        self.confirm()
        self._take_hellos()
        now = self.bridge.now()
        if self.membership.next_members(now) is None and not self.membership.behind(self.snapshot.version, now):
            return False
        return self.publish(wait=True) is not None

    def holders(self, version: int) -> list[Member]:
        """Generators alive that hold the weights of `version` (or newer)."""
        self.finish()
        now = self.bridge.now()
        self._take_hellos()
        return [g for g in self.membership.alive(now) if self.membership.holds.get(g, -1) >= version]

    def status(self) -> dict[str, int | bool]:
        """The weight group, for the trainer's /status and metrics."""
        members = 0 if self.membership.broken else len(self.membership.members)
        return {
            "generators_in_group": members,
            "weight_epoch": self.membership.epoch,
            "generators_dropped": self.membership.dropped,
        }

    @property
    def failures(self) -> int:
        """Updates that failed so far: generators dropped (no join, no confirmation, a failed
        load) and broadcasts broken."""
        return self.membership.dropped + self.broken_broadcasts

    def _take_hellos(self) -> None:
        while True:
            try:
                at, hello = self.bridge.hellos.get_nowait()
            except queue.Empty:
                return
            member = Member(hello.generator, hello.incarnation)
            was_stuck, stuck = member in self.membership.stuck, hello.stuck(self.timeout_s)
            self.membership.hello(member, hello.version, at, stuck)
            if stuck and not was_stuck:
                log.warning(
                    "generator %d's engine has not answered for %.0f s (a weight update or a liveness check): "
                    "left out of new epochs until it does",
                    hello.generator,
                    hello.busy_seconds,
                )
            elif was_stuck and not stuck:
                log.info("generator %d: its engine answers again, it joins the next epoch", hello.generator)

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def host_memory_problem(pinned: int, model: int, limit: int | None) -> str:
    """Why a snapshot in host memory cannot be kept within the container's memory `limit` (None:
    no limit): its `pinned` buffers, and beside them at every checkpoint and export the model's
    whole weights (`model` bytes) gathered into host memory to be written, would not fit ("" where
    they do). The trainer then stops at its start, naming the field, rather than being killed for
    memory at its first update or checkpoint."""
    if limit is None or pinned + model <= limit:
        return ""
    return (
        f"trainer.resources.limits.memory: rank 0 keeps the weight snapshot in pinned host memory (the model is "
        f"more than a quarter of its GPU's), {pinned / 2**30:.1f} GiB, and each checkpoint gathers the whole "
        f"model there again to write it, {model / 2**30:.1f} GiB: more than the container may hold "
        f"({limit / 2**30:.1f} GiB); raise it"
    )


def snapshot_for(buckets: list[dict], device) -> Snapshot:
    """Rank 0's snapshot: on the GPU, or in host memory where the model is too large a share of
    it (`snapshot_in_host`), which the log says; SpecError where that cannot fit the container."""
    model = sum(map(bucket_nbytes, buckets))
    if not snapshot_in_host(model, device):
        return Snapshot(buckets, device)
    pinned = pinned_bytes(buckets)
    if problem := host_memory_problem(pinned, model, memory_limit_bytes()):
        raise SpecError(problem)
    log.info(
        "the weight snapshot (%.1f GiB) is kept in host memory (%.1f GiB pinned), each bucket copied to "
        "the GPU as it is sent",
        model / 2**30,
        pinned / 2**30,
    )
    return Snapshot(buckets, device, in_host=True)


def _full_shape(p) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape in ds_shape
