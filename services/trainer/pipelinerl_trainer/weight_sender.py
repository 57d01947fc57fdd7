"""Trainer side of in-flight weight updates: announce, broadcast bucketed tensors, collect
every generator's reply, all within the weight-sync timeout (a missing or failing generator
is a clear error, never a hang).

The trainer need not wait for the replies: once the bytes are sent it can train on while the
generators load them, and the replies are collected before the next update (a generator
takes one update at a time). Generators only admit work the lag budget allows for the weights
they actually hold, so this never makes data staler than `maxLag`."""

from __future__ import annotations

import logging
import queue
import time
from typing import Protocol

from pipelinerl import messages as m
from pipelinerl.contracts import JobSubjects
from pipelinerl.weight_group import WeightGroup, WeightSyncTimeout, dtype_name, plan_buckets
from pipelinerl_trainer.model import TrainingEngine, full_parameters, named_weights

log = logging.getLogger("pipelinerl.trainer")


class ReplyBridge(Protocol):
    """What the sender uses of the trainer's NATS bridge: publish the update, read the replies."""

    subjects: JobSubjects
    done: queue.Queue[m.WeightUpdateDone]

    def publish(self, subject: str, msg: m.Message, stream: bool = True) -> None: ...


class WeightSender:
    """Runs on every trainer rank (ZeRO-3 gathers are collectives); only rank 0 talks."""

    def __init__(self, engine: TrainingEngine, rank: int, bridge: ReplyBridge, group: WeightGroup | None,
                 generators: int, bucket_mb: int, timeout_s: float):
        self.engine, self.rank, self.bridge, self.group = engine, rank, bridge, group
        self.generators, self.timeout_s = generators, timeout_s
        self.params = named_weights(engine)
        self.buckets = plan_buckets(
            [(n, list(_full_shape(p)), _wire_dtype(p)) for n, p in self.params], bucket_mb << 20)
        self.by_name = dict(self.params)
        self.pending: tuple[int, float] | None = None  # (version, deadline) of unconfirmed weights

    def send(self, version: int, wait: bool = True) -> dict[str, float]:
        """Broadcast the weights of `version`; with `wait`, also until every generator has them.
        The pause statistics are those of the latest update confirmed (this one with `wait`)."""
        t0 = time.perf_counter()
        stats = {"weight_pause_max_seconds": 0.0, "updates_with_running_requests": 0}
        if self.rank == 0:
            stats |= self.confirm()
            self.bridge.publish(self.bridge.subjects.weights_update,
                                m.WeightUpdate(version=version, buckets=self.buckets), stream=False)
        for bucket in self.buckets:
            params = [self.by_name[t["name"]] for t in bucket["tensors"]]
            with full_parameters(self.engine, params):
                if self.rank == 0:
                    self.group.broadcast_buckets(((t["name"], p.data) for t, p in zip(bucket["tensors"], params)),
                                                 [bucket])
        if self.rank == 0:
            self.pending = (version, time.monotonic() + self.timeout_s)
            if wait:
                stats |= self.confirm()
        stats["weight_sync_seconds"] = time.perf_counter() - t0
        return stats

    def confirm(self) -> dict[str, float]:
        """Rank 0: wait for every generator's reply to the update not yet confirmed, if any."""
        if self.pending is None:
            return {}
        replies = self._collect(*self.pending)
        self.pending = None
        return {"weight_pause_max_seconds": max(r.pause_seconds for r in replies),
                "updates_with_running_requests": sum(r.running_requests > 0 for r in replies)}

    def _collect(self, version: int, deadline: float) -> list[m.WeightUpdateDone]:
        replies: dict[int, m.WeightUpdateDone] = {}
        while len(replies) < self.generators:
            try:
                r = self.bridge.done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.generators)) - set(replies))
                raise WeightSyncTimeout(
                    f"generators {missing} did not confirm weights of version {version} "
                    f"within {self.timeout_s:.0f}s") from None
            if r.version != version:
                continue
            if r.error:
                raise RuntimeError(f"generator {r.generator} failed to load version {version}: {r.error}")
            replies[r.generator] = r
        return list(replies.values())


def _full_shape(p) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape in ds_shape


def _wire_dtype(p) -> str:
    return dtype_name(p.dtype)
