"""Preprocessor service: rollout groups in, packed per-rank micro-batches out.

In pipeline mode a step goes out in waves as its groups arrive (`steps.next_wave`), so the
trainer computes on them while the rest of the step is generated; sync mode, the conventional
baseline, publishes the k steps of a generation phase once the phase is generated whole.
Input groups are acked only after every micro-batch of the wave they went into is stored by
JetStream (publish acks awaited), so a crash loses nothing: unacked groups are handed to the
restarted preprocessor at once, ahead of newer ones (those of the newest stored step whose acks
the crash lost are not trained again), re-published batches are de-duplicated by their message
ids, and a step left partial is closed on restart (`packing.close_step`).
Groups that go into no micro-batch (filtered, stale, rejected) are acked after the next wave too:
its micro-batches carry the books of every generator's newest group taken so far, which a
restarted generator continues from once its groups have left the rollout stream, and these
groups' ids, so that a restart whose kill lost their acks does not count them twice.
Backpressure: at most `maxPendingSteps` steps (a whole phase in sync mode) are published ahead
of the trainer's version.
A group that cannot be trained (`checks`) or decoded goes to the dead-letter stream with its
reason and is acknowledged: one bad message never stops the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter as Tally

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge

from pipelinerl import messages as m
from pipelinerl.contracts import STREAM_SUFFIXES, PreprocessorStatus, ServiceEnv
from pipelinerl.runtime import HealthServer, join_job, serve
from pipelinerl.spec import PipelineRLJob
from pipelinerl.streams import dead_letter, last_announcement, last_message, publish_once, stored_messages
from pipelinerl_preprocessor.advantages import group_advantages
from pipelinerl_preprocessor.checks import GroupLimits, group_problem, hopelessly_stale
from pipelinerl.steps import counts_as_discarded, next_wave, steps_left_in_phase
from pipelinerl_preprocessor.packing import StepSample, close_step, pack_wave, step_weight

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
# A group this preprocessor took but has not published would be redelivered this long after it
# died (its restarted self takes them back at once, see run); while alive it keeps them with a
# keep-alive every quarter of it.
ACK_WAIT_S = 30.0


class Preprocessor:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv, trainer_ranks: int):
        self.job, self.spec, self.env = job, job.spec, env
        self.subjects = job.subjects
        self.ranks = trainer_ranks
        self.trainer_version = 0
        self.finished = False
        self.stopping = asyncio.Event()
        self.accepted: list[tuple[Msg, m.RolloutGroup]] = []  # (nats msg, group), unacked
        # (nats msg, group id or None if undecodable) of groups in no micro-batch: acked after the next wave
        self.settled: list[tuple[Msg, str | None]] = []
        self.books: dict[str, m.GeneratorBooks] = {}  # each generator's newest taken so far
        self.settled_before: set[str] = set()  # the groups of the newest step a predecessor stored or settled
        self.step = 0
        self._new_step()
        self.stats: Tally = Tally()  # counts named as PreprocessorStatus fields

    def _new_step(self) -> None:
        self.index = 0  # next micro-batch index of the step, on every rank
        self.waves = 0
        self.in_step = 0  # groups in the waves of the step published so far
        self.step_samples = 0
        self.by_generator: Tally = Tally()
        self.filtered = 0  # zero-variance groups dropped since the previous step ended
        self.rejected = 0  # groups dead-lettered since the previous step ended
        self.stale = 0  # samples of groups too old for the step, dropped since the previous step ended

    def status(self) -> PreprocessorStatus:
        now = {"next_step": self.step, "trainer_version": self.trainer_version, "pending_groups": len(self.accepted)}
        return PreprocessorStatus.model_validate(now | dict(self.stats))

    async def run(self) -> None:
        http = HealthServer("preprocessor", self.env.http_port, self.status).start()
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
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(self.subjects.stream("ROLLOUTS"), "preprocessor")
        sub = await self.js.pull_subscribe(
            self.subjects.rollouts(">"),
            durable="preprocessor",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_ack_pending=100_000),
        )
        http.ready = True
        log.info("preprocessor ready; next step %d, %d trainer ranks", self.step, self.ranks)
        watch = asyncio.create_task(self._watch_streams())
        last_keepalive = time.monotonic()
        while not self.stopping.is_set() and not self.finished:
            if time.monotonic() - last_keepalive > ACK_WAIT_S / 4:  # also while the trainer is behind
                for msg, _ in self.accepted + self.settled:  # waiting for a wave: not abandoned
                    await msg.in_progress()
                last_keepalive = time.monotonic()
            if self._trainer_behind():
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await sub.fetch(batch=64, timeout=1.0)
            except TimeoutError:  # nats' and asyncio's timeouts both derive from it
                msgs = []
            for msg in msgs:
                await self._intake(msg)
            while not self._trainer_behind():
                self._drop_stale()
                n, last = next_wave(
                    [[len(s.tokens) for s in g.samples] for _, g in self.accepted],
                    self.in_step,
                    self.spec.groups_per_step,
                    self.ranks,
                    self.spec.trainer.micro_batch_tokens,
                    self.spec.streams_steps,
                    steps_left_in_phase(self.step, self.spec.steps_per_generation),
                )
                if not n:
                    break
                await self._publish_wave(n, last)
        watch.cancel()
        await asyncio.wait_for(self.nc.close(), 10)  # every publish was already acked: no drain needed

    async def _watch_streams(self) -> None:
        """Every STREAMS_EVERY_S, how full each of the job's streams is (for the store alert and
        the queue panels); a read that fails is logged and tried again next time."""
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
            await asyncio.sleep(STREAMS_EVERY_S)

    def _trainer_behind(self) -> bool:
        """Backpressure: enough steps are already waiting for the trainer."""
        return self.step >= self.trainer_version + self.spec.pending_steps

    async def _resume(self) -> None:
        """Continue after the last step already published (batches are never re-numbered), and
        from the trainer's newest announcement."""
        lasts = []
        for rank in range(self.ranks):
            data = await last_message(self.js, self.subjects.stream("BATCHES"), self.subjects.batches(rank))
            lasts.append(m.decode(data, m.MicroBatch) if data is not None else None)
        await self._refresh_trainer_version()
        for mb in lasts:
            for generator, books in (mb.generator_books if mb else {}).items():
                self.books[generator] = m.newest_books(books, self.books.get(generator))
        self.settled_before = await self._groups_settled_with_the_last_step(lasts)
        self.step, closing = close_step(lasts)
        for mb in closing:
            mb.generator_books = dict(self.books)
        if closing:
            log.warning(
                "step %d was left partial by a restart: closing it with the %d samples already published",
                self.step - 1,
                closing[0].step_samples,
            )
            await asyncio.gather(*(self._publish(mb) for mb in closing))

    async def _groups_settled_with_the_last_step(self, lasts: list[m.MicroBatch | None]) -> set[str]:
        """The groups in, or settled with, the newest step stored: a kill can have lost only its
        last wave's acknowledgements (each wave's are sent before the next wave is stored, on the
        same connection), so these are the only settled groups NATS may hand back (`_intake`)."""
        stored = [mb for mb in lasts if mb is not None]
        if not stored:
            return set()
        step = max(mb.step for mb in stored)
        # Steps are stored one after another: the step's micro-batches are the stream's newest.
        count = sum(mb.index + 1 for mb in stored if mb.step == step)
        msgs = await stored_messages(self.js, self.subjects.stream("BATCHES"), newest=count)
        batches = [m.decode(msg.data, m.MicroBatch) for msg in msgs]
        return {g for mb in batches for g in mb.group_ids + mb.settled_group_ids}

    async def _on_version(self, msg) -> None:
        self._on_announcement(m.decode(msg.data, m.PolicyVersion))

    def _on_announcement(self, pv: m.PolicyVersion) -> None:
        self.trainer_version = max(self.trainer_version, pv.version)
        self.finished = self.finished or (pv.finished and pv.version >= self.spec.trainer.max_steps)

    async def _refresh_trainer_version(self) -> None:
        announced = await last_announcement(self.js, self.subjects)
        if announced is not None:
            self._on_announcement(announced)

    def _limits(self) -> GroupLimits:
        return GroupLimits(max_seq_len=self.spec.model.max_seq_len, newest_version=self.trainer_version + 1)

    async def _intake(self, msg) -> None:
        try:
            group = m.decode(msg.data, m.RolloutGroup)
        except m.MessageError as err:
            self.stats["malformed"] += 1
            await self._reject(msg, str(err))
            return
        key = str(group.generator)
        self.books[key] = m.newest_books(group.books, self.books.get(key))
        if group.group_id in self.settled_before:  # already credited to its generator, too
            log.warning("group %s was settled before a restart: its acknowledgement was lost", group.group_id)
            self.stats["settled_before"] += 1
            self.settled.append((msg, group.group_id))
            return
        problem = group_problem(group, self._limits())
        if problem:  # before refusing: is our news of the trainer's version late?
            await self._refresh_trainer_version()
            problem = group_problem(group, self._limits())
        # Its generator counts a group as queued until a step consumes it (unless it counted it
        # discarded itself): one that goes into no step is consumed by the step being built.
        discarded = counts_as_discarded(self.spec.rl.filter_zero_variance, group)
        if problem:
            self.by_generator[key] += not discarded
            reason = f"group {group.group_id} from generator {group.generator}: {problem}"
            await self._reject(msg, reason, group.group_id)
            return
        self.stats["truncated_samples"] += sum(s.truncated for s in group.samples)
        if discarded:
            self.filtered += 1
            self.stats["filtered_groups"] += 1
            GROUPS_IN.labels("filtered").inc()
            self.settled.append((msg, group.group_id))
            return
        self.accepted.append((msg, group))
        GROUPS_IN.labels("accepted").inc()
        PENDING.set(len(self.accepted))

    def _drop_stale(self) -> None:
        """Groups too old for the step being built take no place in it (their generator's
        queue counts them as consumed by it)."""
        keep = []
        for msg, group in self.accepted:
            if not hopelessly_stale(group, self.step, self.spec.max_lag):
                keep.append((msg, group))
                continue
            log.info(
                "group %s from generator %d: too old for step %d (max lag %d), dropped",
                group.group_id,
                group.generator,
                self.step,
                self.spec.max_lag,
            )
            self.by_generator[str(group.generator)] += 1
            self.stale += len(group.samples)
            self.stats["stale_groups"] += 1
            GROUPS_IN.labels("stale").inc()
            self.settled.append((msg, group.group_id))
        self.accepted = keep

    async def _reject(self, msg, reason: str, group_id: str | None = None) -> None:
        """Dead-letter a rollout message with its reason, kept for inspection; it is acked with
        the next wave and never trained (it would fail forever)."""
        seq = msg.metadata.sequence.stream
        log.error("rollout message %d dead-lettered: %s", seq, reason)
        await dead_letter(self.js, self.subjects, "rollout", msg.data, reason, f"rollout-{seq}")
        self.stats["dead_lettered"] += 1
        self.rejected += 1
        GROUPS_IN.labels("dead_lettered").inc()
        self.settled.append((msg, group_id))

    def _publish(self, mb: m.MicroBatch):
        return publish_once(self.js, self.subjects.batches(mb.rank), m.encode(mb), f"{mb.step}-{mb.rank}-{mb.index}")

    async def _publish_wave(self, n: int, last: bool) -> None:
        take, self.accepted = self.accepted[:n], self.accepted[n:]
        samples = []
        for _, group in take:
            adv = group_advantages([s.reward for s in group.samples], self.spec.rl.normalize_advantages)
            samples += [StepSample(s, a, group.group_id) for s, a in zip(group.samples, adv)]
        self.in_step += n
        self.step_samples += len(samples)
        self.by_generator.update(str(g.generator) for _, g in take)
        weight = step_weight(samples, self.spec.rl.token_weighting, self.spec.trainer.samples_per_step)
        per_rank = pack_wave(
            self.step, samples, self.ranks, self.spec.trainer.micro_batch_tokens, weight, self.index, last
        )
        batches = [mb for rank in per_rank for mb in rank]
        settled_ids = [g for _, g in self.settled if g is not None]
        for mb in batches:
            mb.settled_group_ids = settled_ids
            mb.step_samples, mb.step_groups_filtered = self.step_samples, self.filtered
            mb.step_groups_rejected, mb.step_samples_stale = self.rejected, self.stale
            mb.step_groups_by_generator = dict(self.by_generator)
            mb.generator_books = dict(self.books)
        await asyncio.gather(*(self._publish(mb) for mb in batches))  # stored durably before the inputs are released
        settled, self.settled = self.settled, []
        for msg, _ in take + settled:
            await msg.ack()
        self.index += len(per_rank[0])
        self.waves += 1
        PENDING.set(len(self.accepted))
        if not last:
            return
        log.info(
            "published step %d: %d samples in %d micro-batches/rank, %d wave(s) (%d groups filtered since last)",
            self.step,
            self.step_samples,
            self.index,
            self.waves,
            self.filtered,
        )
        self.step += 1
        self._new_step()
        self.stats["steps"] += 1
        STEPS_OUT.inc()


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    pre = Preprocessor(job, env, job.spec.trainer_ranks)
    return serve(pre.run, pre.stopping.set)
