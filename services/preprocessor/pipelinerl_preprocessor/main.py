"""Preprocessor service: rollout groups in, packed per-rank micro-batches out; the I/O around
the step being built (`builder.StepBuilder`, pure).

In pipeline mode a step goes out in waves as its groups arrive (`steps.next_wave`), so the
trainer computes on them while the rest of the step is generated; sync mode, the conventional
baseline, publishes the k steps of a generation phase once the phase is generated whole.
Input groups are acked only after every micro-batch of the wave they went into is stored by
JetStream (publish acks awaited), so a crash loses nothing: unacked groups are handed to the
restarted preprocessor at once, ahead of newer ones, and go into the step it continues, the one
its predecessor was building (`books.restore`); those of the newest stored step whose acks the
crash lost are settled again, neither trained nor counted twice (their ids are in its ledger).
Groups that go into no micro-batch (filtered, stale, rejected) are acked after the next wave too:
its micro-batches carry the step's ledger, with these groups and the books of every generator's
newest group taken so far, which a restarted generator continues from once its groups have left
the rollout stream.
Backpressure: at most `maxPendingSteps` steps (a whole phase in sync mode) are published ahead
of the trainer's version.
A group that cannot be trained (`pipelinerl.group_checks`) or decoded goes to the dead-letter stream with its
reason and is acknowledged: one bad message never stops the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter as Tally

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.errors import NoRespondersError
from nats.js.errors import NotFoundError, ServiceUnavailableError
from prometheus_client import Counter, Gauge

from pipelinerl import books
from pipelinerl import messages as m
from pipelinerl.books import Outcome
from pipelinerl.contracts import STREAM_SUFFIXES, Env, PreprocessorStatus, ServiceEnv
from pipelinerl.runtime import HealthServer, failpoint, join_job, serve
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import is_final, newest_weights
from pipelinerl.streams import (
    READ_TIMEOUT_S,
    acknowledge,
    close,
    dead_letter,
    last_announcement,
    newest_batches,
    publish_once,
)
from pipelinerl.store import store_identity
from pipelinerl_preprocessor.builder import StepBuilder, Wave
from pipelinerl.group_checks import GroupLimits, group_problem

log = logging.getLogger("pipelinerl.preprocessor")
GROUPS_IN = Counter("pipelinerl_preprocessor_groups_total", "Rollout groups consumed", ["outcome"])
STEPS_OUT = Counter("pipelinerl_preprocessor_steps_total", "Steps of micro-batches published")
PENDING = Gauge("pipelinerl_preprocessor_pending_groups", "Accepted groups waiting for a full step")
OUTCOMES = ("accepted", "filtered", "stale", "dead_lettered")
for _outcome in OUTCOMES:  # an outcome not seen yet is a 0, not a missing series
    GROUPS_IN.labels(_outcome)
# The job's streams, read from JetStream by its one preprocessor (the job's pods share a server).
STREAM_BYTES = Gauge("pipelinerl_stream_bytes", "Bytes stored in one of the job's JetStream streams", ["stream"])
STREAM_LIMIT = Gauge(
    "pipelinerl_stream_limit_bytes",
    "A stream's max_bytes: when full, ROLLOUTS refuses new groups, the others drop their oldest messages",
    ["stream"],
)
STREAM_MESSAGES = Gauge(
    "pipelinerl_stream_messages", "Messages stored in one of the job's JetStream streams", ["stream"]
)
STREAMS_EVERY_S = 15.0
# A restarting nats-server's JetStream answers a fetch 503 (no responders) until it has recovered
# its streams: the preprocessor waits it out (its connection reconnects for as long as it takes).
UNAVAILABLE = (ServiceUnavailableError, NoRespondersError)
RETRY_S = 1.0
# A group this preprocessor took but has not published would be redelivered this long after it
# died (its restarted self takes them back at once, see run); while alive it keeps them with a
# keep-alive every quarter of it. A pause longer than this (SIGSTOP, a frozen node, a stall) has
# them delivered again to the living preprocessor, which takes each once (`StepBuilder.returned`).
ACK_WAIT_S = float(os.environ.get(Env.ACK_WAIT_S, "30"))
TORN_MARGIN_S = 10.0  # past the ack wait, for a group of a wave stored in part to come again


class ConsumerLost(RuntimeError):
    """The preprocessor's consumer of the work queue is gone (the store lost, or its stream made
    again): nothing would make it again but the preprocessor's restart."""


class NewerBuild(RuntimeError):
    """A rollout written by a newer build than this preprocessor's: it stops without refusing or
    acknowledging it (a failure, restarted; in an upgrade, onto the newer image that reads it)."""


async def fetch(sub) -> list[Msg]:
    """The next rollout groups from the work queue; none when none came in a second, or while
    JetStream is unavailable (answered at once: a pause, not a busy loop). ConsumerLost where it
    is unavailable because the consumer is gone (a pull to no consumer is answered 503 too)."""
    try:
        return await sub.fetch(batch=64, timeout=1.0)
    except TimeoutError:  # nats' and asyncio's timeouts both derive from it
        return []
    except UNAVAILABLE as err:
        try:
            await asyncio.wait_for(sub.consumer_info(), READ_TIMEOUT_S)
        except NotFoundError as gone:
            raise ConsumerLost(f"the rollouts consumer is gone ({gone}): restarting makes it again") from None
        except (TimeoutError, nats.errors.Error):
            pass  # JetStream itself unavailable (recovering after a restart): waited out
        log.warning("JetStream unavailable (%s): fetching again in %.0fs", type(err).__name__, RETRY_S)
        await asyncio.sleep(RETRY_S)
        return []


class Preprocessor:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv, trainer_ranks: int):
        self.job, self.spec, self.env = job, job.spec, env
        self.subjects = job.subjects
        self.ranks = trainer_ranks
        self.trainer_version = 0
        self.finished = False
        self.stopping = asyncio.Event()
        self.builder = StepBuilder(self.spec, trainer_ranks, books.restore([]))  # until `_resume` reads the streams
        self.backlog = 0  # the rollout stream's last sequence at the start: handed over whole before any wave
        self.answered_since = 0.0  # since when JetStream answers the rollout consumer (made, or read)
        self.storing: list[Msg] = []  # the messages of the wave being stored, acknowledged once it is
        self.fetched: list[Msg] = []  # the messages of the last fetch, not all taken yet
        self.stats: Tally = Tally()  # counts named as PreprocessorStatus fields

    def status(self) -> PreprocessorStatus:
        b = self.builder
        now = {"next_step": b.step, "trainer_version": self.trainer_version, "pending_groups": len(b.accepted)}
        return PreprocessorStatus.model_validate(now | dict(self.stats))

    async def run(self) -> None:
        http = HealthServer("preprocessor", self.env.http_port, self.status, self.env.listen_address).start()
        self.nc = await join_job(self.job, self.env, f"{self.job.name}-preprocessor")
        self.js = self.nc.jetstream()
        await self._resume()
        await self.js.subscribe(
            self.subjects.version,
            cb=self._on_version,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ordered_consumer=True,
        )
        # Groups a dead predecessor took but never acknowledged would come back only after
        # ACK_WAIT_S, behind every newer group, and reach their step too old for it (dropped for
        # lag). A new consumer of the work queue is handed what is left, those first, at once.
        # Safe because one preprocessor runs (a StatefulSet of one): no live one loses its groups.
        rollouts = self.subjects.stream("ROLLOUTS")
        self.backlog = (await self.js.stream_info(rollouts)).state.last_seq
        self.builder.caught_up = self.backlog == 0
        self.answered_since = time.monotonic()
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(rollouts, "preprocessor")
        sub = await self.js.pull_subscribe(
            self.subjects.rollouts(">"),
            durable="preprocessor",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_ack_pending=100_000),
        )
        http.ready = True
        log.info("preprocessor ready; next step %d, %d trainer ranks", self.builder.step, self.ranks)
        watch, alive = asyncio.create_task(self._watch_streams()), asyncio.create_task(self._keep_alive())
        while not self.stopping.is_set() and not self.finished:
            if self._trainer_behind():
                await asyncio.sleep(0.05)
                continue
            msgs = self.fetched = await fetch(sub)
            for msg in msgs:  # (one may wait long: a dead letter's publish, the trainer's version read)
                await self._intake(msg)
            self.fetched = []
            await self._catch_up(sub, msgs)
            while not self._trainer_behind():
                for group in self.builder.drop_stale():
                    self._dropped_stale(group)
                wave = self.builder.next_wave()
                if wave is None:
                    break
                await self._store(wave)
        watch.cancel()
        alive.cancel()
        await close(self.nc)

    async def _catch_up(self, sub, msgs: list[Msg]) -> None:
        """Every group left in the stream at the start has been handed over once a fetch reaches
        the stream's end then (the consumer delivers in stream order), or the consumer says it
        has nothing more to deliver; and has been taken here: the consumer counts no more
        delivered and unacknowledged than this preprocessor holds (a delivery lost on the way, in
        a reconnect, comes again only after the ack wait). An empty fetch alone says nothing:
        JetStream may not have answered (recovering after a restart, a reconnecting client), and
        a wave stored in part before the restart would then be evened out with sentinels while its
        groups still wait."""
        if self.builder.caught_up:
            return
        reached = any(msg.metadata.sequence.stream >= self.backlog or msg.metadata.num_pending == 0 for msg in msgs)
        if msgs and not reached:
            return
        try:
            info = await asyncio.wait_for(sub.consumer_info(), READ_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error) as err:
            log.warning("the rollouts consumer's state not read (%s): asking again", type(err).__name__)
            self.answered_since = time.monotonic()  # (a lost delivery comes again an ack wait after it answers)
            return
        # A group of the wave stored in part not back yet is waited for past the ack wait since
        # JetStream last answered: a nats-server restart can make the consumer count fewer held
        # than this preprocessor holds, hiding one whose delivery was lost on the way.
        if self.builder.torn_waits() and time.monotonic() - self.answered_since < ACK_WAIT_S + TORN_MARGIN_S:
            return
        # Past the end: what is pending now is newer (generators publish on).
        if (reached or info.num_pending == 0) and (info.num_ack_pending or 0) <= len(self.builder.held()):
            self.builder.caught_up = True
            log.info("took every group left in the stream at the start (%d pending)", len(self.builder.accepted))

    async def _keep_alive(self) -> None:
        """Every ACK_WAIT_S / 4, the messages held (fetched and not all taken yet, waiting for a
        wave, or in the wave being stored) told in progress, whatever the loop waits on (the trainer
        behind, a store slower than the ack wait: a full disk): JetStream then delivers none of
        them again to this live process. (Told of one acknowledged meanwhile, JetStream ignores it.)"""
        while True:
            await asyncio.sleep(ACK_WAIT_S / 4)
            if not self.nc.is_connected:  # (buffered meanwhile, they would fill the reconnect buffer)
                continue
            for msg in self.fetched + self.builder.held() + self.storing:
                try:
                    await msg.in_progress()
                except Exception as err:  # noqa: BLE001 - never ends the task: the next round
                    log.info("keep-alive of held rollouts not sent (%r)", err)
                    break

    async def _watch_streams(self) -> None:
        """Every STREAMS_EVERY_S, how full each of the job's streams is (for the store alert and
        the queue panels), and the rollout stream's first sequence, below which no message can
        come again (`StepBuilder.gone_below`); a read that fails is logged and tried again next time."""
        while True:
            for suffix in STREAM_SUFFIXES:
                try:
                    info = await asyncio.wait_for(self.js.stream_info(self.subjects.stream(suffix)), 5.0)
                except Exception as err:  # noqa: BLE001 - NATS restarting: the next round reads it
                    log.warning("stream %s not read: %r", suffix, err)
                    continue
                STREAM_BYTES.labels(suffix).set(info.state.bytes)
                STREAM_MESSAGES.labels(suffix).set(info.state.messages)
                STREAM_LIMIT.labels(suffix).set(info.config.max_bytes or 0)
                if suffix == "ROLLOUTS":
                    self.builder.gone_below(info.state.first_seq)
            await asyncio.sleep(STREAMS_EVERY_S)

    def _trainer_behind(self) -> bool:
        """Backpressure: enough steps are already waiting for the trainer."""
        return self.builder.step >= self.trainer_version + self.spec.pending_steps

    async def _resume(self) -> None:
        """Go on from the books of the newest micro-batches stored (`books.restore`): the step a
        predecessor was building is continued, not closed short, and a wave it stored in part is
        published again; and from the trainer's newest announcement."""
        newest = await newest_batches(self.js, self.subjects, self.ranks)
        restored = books.restore(newest)
        await self._refresh_trainer_version()
        if not any(newest):
            adopted = (await store_identity(self.js, self.subjects)).adopted_step
            if adopted:  # a store recovered for a trainer checkpoint (`pipelinerl recover-store`)
                log.info("a store that goes on from the trainer's checkpoint: building its step %d first", adopted)
                restored = dataclasses.replace(restored, step=adopted)
        self.builder = StepBuilder(self.spec, self.ranks, restored)
        if restored.ledger.waves and not restored.ledger.closed or restored.torn:
            log.warning(
                "step %d was left partial by a restart (%d group(s), %d samples stored%s): continuing it",
                restored.step,
                restored.ledger.trained_groups,
                restored.ledger.samples,
                "; a wave stored in part is published again first" if restored.torn else "",
            )

    async def _on_version(self, msg) -> None:
        self._on_announcement(m.decode(msg.data, m.PolicyVersion))

    def _on_announcement(self, pv: m.PolicyVersion) -> None:
        self.trainer_version = max(self.trainer_version, pv.version)
        self.finished = self.finished or is_final(pv, self.spec.trainer.max_steps)

    async def _refresh_trainer_version(self) -> None:
        announced = await last_announcement(self.js, self.subjects)
        if announced is not None:
            self._on_announcement(announced)

    def _limits(self) -> GroupLimits:
        return GroupLimits(max_seq_len=self.spec.model.max_seq_len, newest_version=newest_weights(self.trainer_version))

    async def _intake(self, msg) -> None:
        b, seq = self.builder, msg.metadata.sequence.stream
        try:
            group = m.decode(msg.data, m.RolloutGroup)
        except m.NewerSchema as err:
            # A generator rolled onto a newer build first (an upgrade): neither refused nor
            # acknowledged, the group waits in the stream for this preprocessor's restart on it.
            raise NewerBuild(
                f"the rollout at sequence {seq} is of a newer build ({err}): a generator runs a newer image than "
                "this preprocessor; it stops, and its restart on that image takes the group"
            ) from None
        except m.MessageError as err:
            if not self._returned(msg, books.undecodable_id(seq)):
                self.stats["malformed"] += 1
                await self._reject(msg, str(err), None)
            return
        b.note_books(group)
        if self._returned(msg, group.group_id):
            return
        problem = group_problem(group, self._limits())
        if problem:  # before refusing: is our news of the trainer's version late?
            await self._refresh_trainer_version()
            problem = group_problem(group, self._limits())
        if problem:
            await self._reject(msg, f"group {group.group_id} from generator {group.generator}: {problem}", group)
            return
        self.stats["truncated_samples"] += sum(s.truncated for s in group.samples)
        if b.take(msg, group) == Outcome.FILTERED:
            self.stats["filtered_groups"] += 1
            GROUPS_IN.labels("filtered").inc()
            return
        GROUPS_IN.labels("accepted").inc()
        PENDING.set(len(b.accepted))

    def _returned(self, msg, entry_id: str) -> bool:
        """Taken or settled already, delivered again (a kill lost its acknowledgement, or a pause
        outlasted the acknowledgement wait): taken once, never again, never counted twice."""
        if not self.builder.returned(msg, entry_id, msg.metadata.sequence.stream):
            return False
        log.warning(
            "%s delivered again (delivery %d): taken already, not again (a restart lost its acknowledgement, "
            "or a pause outlasted the %g s acknowledgement wait)",
            entry_id,
            msg.metadata.num_delivered,
            ACK_WAIT_S,
        )
        self.stats["settled_before"] += 1
        return True

    def _dropped_stale(self, group: m.RolloutGroup) -> None:
        log.info(
            "group %s from generator %d: too old for step %d (max lag %d), dropped",
            group.group_id,
            group.generator,
            self.builder.step,
            self.spec.max_lag,
        )
        self.stats["stale_groups"] += 1
        GROUPS_IN.labels("stale").inc()

    async def _reject(self, msg, reason: str, group: m.RolloutGroup | None) -> None:
        """Dead-letter a rollout message with its reason, kept for inspection; it is acked with
        the next wave and never trained (it would fail forever)."""
        seq = msg.metadata.sequence.stream
        log.error("rollout message %d dead-lettered: %s", seq, reason)
        await dead_letter(self.js, self.subjects, "rollout", msg.data, reason, f"rollout-{seq}")
        self.stats["dead_lettered"] += 1
        GROUPS_IN.labels("dead_lettered").inc()
        self.builder.dead_lettered(msg, group.group_id if group is not None else books.undecodable_id(seq), group)

    async def _publish_in_order(self, batches: list[m.MicroBatch]) -> None:
        for mb in batches:
            await self._publish(mb)

    def _publish(self, mb: m.MicroBatch):
        return publish_once(self.js, self.subjects.batches(mb.rank), m.encode(mb), f"{mb.step}-{mb.rank}-{mb.index}")

    async def _store(self, wave: Wave) -> None:
        if wave.lost:
            log.error(
                "step %d: groups %s of the wave stored in part before the restart never came back: "
                "the ranks are evened out with empty micro-batches, the samples not stored are lost",
                wave.step,
                wave.lost,
            )
        elif wave.again:
            log.warning("step %d: publishing again the wave stored in part before the restart", wave.step)
        # Stored durably before the inputs are released; each rank's in order, the ranks side by
        # side: a rank's newest stored micro-batch must be its furthest (`books.restore` reads a
        # wave as stored through it), and a try sent again lands after those sent beside it.
        ranks: dict[int, list[m.MicroBatch]] = {}
        for mb in wave.batches:
            ranks.setdefault(mb.rank, []).append(mb)
        self.storing = wave.acks  # kept alive meanwhile (`_keep_alive`)
        await asyncio.gather(*(self._publish_in_order(batches) for batches in ranks.values()))
        if wave.last:  # (tests: a kill that loses the acknowledgements of a step's last wave)
            failpoint(f"preprocessor-stored-step-{wave.step}")
        # Confirmed before the next wave is stored: only the newest stored wave's can be lost
        # (`books.restore`), and a group handed back is known by the step that settled it.
        await asyncio.gather(*(acknowledge(msg, self.js) for msg in wave.acks))
        self.storing = []
        PENDING.set(len(self.builder.accepted))
        if not wave.last:
            return
        ledger = wave.batches[-1].ledger if wave.batches else None
        log.info(
            "published step %d: %d samples in %d waves (%d groups filtered)",
            wave.step,
            ledger.samples if ledger else 0,
            ledger.waves if ledger else 0,
            ledger.filtered if ledger else 0,
        )
        self.stats["steps"] += 1
        STEPS_OUT.inc()


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    pre = Preprocessor(job, env, job.spec.trainer_ranks)
    return serve(pre.run, pre.stopping.set)
