"""Preprocessor service: rollout groups in, packed per-rank micro-batches out.

Input groups are acked only after every micro-batch of the step they went into is stored by
JetStream (publish acks awaited), so a crash loses nothing: unacked groups are redelivered
and re-published batches are de-duplicated by their message ids. Backpressure: at most
`maxPendingSteps` steps are published ahead of the trainer's announced version.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter as Tally

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Gauge

from pipelinerl import messages as m
from pipelinerl.services import HealthServer, ServiceEnv, exit_soon
from pipelinerl.spec import PipelineRLJob
from pipelinerl.streams import JobSubjects, connect, ensure_streams
from pipelinerl_preprocessor.advantages import group_advantages, is_zero_variance
from pipelinerl_preprocessor.packing import StepSample, pack_step

log = logging.getLogger("pipelinerl.preprocessor")
GROUPS_IN = Counter("pipelinerl_preprocessor_groups_total", "Rollout groups consumed", ["outcome"])
STEPS_OUT = Counter("pipelinerl_preprocessor_steps_total", "Steps of micro-batches published")
PENDING = Gauge("pipelinerl_preprocessor_pending_groups", "Accepted groups waiting for a full step")
ACK_WAIT_S = 600.0


class Preprocessor:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv, trainer_ranks: int):
        self.job, self.spec, self.env = job, job.spec, env
        self.subjects = JobSubjects(job.name)
        self.ranks = trainer_ranks
        self.trainer_version = 0
        self.finished = False
        self.stopping = asyncio.Event()
        self.accepted: list[tuple[object, m.RolloutGroup]] = []  # (nats msg, group), unacked
        self.filtered = 0
        self.step = 0
        self.stats = Tally()

    def status(self) -> dict:
        return {"role": "preprocessor", "nextStep": self.step, "trainerVersion": self.trainer_version,
                "pendingGroups": len(self.accepted), **dict(self.stats)}

    async def run(self) -> None:
        http = HealthServer("preprocessor", self.env.http_port, self.status).start()
        self.nc = await connect(self.env.nats_url, f"{self.job.name}-preprocessor")
        self.js = self.nc.jetstream()
        await ensure_streams(self.js, self.subjects, self.spec.nats.max_payload_mb)
        self.step = await self._next_step()
        await self.js.subscribe(self.subjects.version, cb=self._on_version,
                                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ordered_consumer=True)
        sub = await self.js.pull_subscribe(
            self.subjects.rollouts, durable="preprocessor",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_ack_pending=100_000),
        )
        http.ready = True
        log.info("preprocessor ready; next step %d, %d trainer ranks", self.step, self.ranks)
        last_keepalive = time.monotonic()
        while not self.stopping.is_set() and not self.finished:
            if self._trainer_behind():
                await asyncio.sleep(0.05)
                continue
            try:
                msgs = await sub.fetch(batch=64, timeout=1.0)
            except asyncio.TimeoutError:
                msgs = []
            except Exception as err:  # nats.errors.TimeoutError is not asyncio's
                if "timeout" not in type(err).__name__.lower():
                    raise
                msgs = []
            for msg in msgs:
                await self._intake(msg)
            while len(self.accepted) >= self.spec.groups_per_step and not self._trainer_behind():
                await self._publish_step()
            if time.monotonic() - last_keepalive > ACK_WAIT_S / 4:
                for msg, _ in self.accepted:  # still waiting for a full step: not abandoned
                    await msg.in_progress()
                last_keepalive = time.monotonic()
        await asyncio.wait_for(self.nc.close(), 10)  # every publish was already acked: no drain needed

    def _trainer_behind(self) -> bool:
        """Backpressure: enough steps are already waiting for the trainer."""
        return self.step >= self.trainer_version + self.spec.preprocessor.max_pending_steps

    async def _next_step(self) -> int:
        """Resume after the last step already published (batches are never re-numbered)."""
        try:
            last = await self.js.get_last_msg(self.subjects.stream("BATCHES"), self.subjects.batches(0))
        except Exception:
            return 0
        return m.decode(last.data, m.MicroBatch).step + 1

    async def _on_version(self, msg) -> None:
        pv = m.decode(msg.data, m.PolicyVersion)
        self.trainer_version = max(self.trainer_version, pv.version)
        self.finished = self.finished or (pv.finished and pv.version >= self.spec.trainer.max_steps)

    async def _intake(self, msg) -> None:
        try:
            group = m.decode(msg.data, m.RolloutGroup)
        except m.MessageError as err:
            # Undecodable data would fail forever: terminate it (no redelivery) and say so.
            log.error("dropping rollout message %s: %s", msg.metadata.sequence.stream, err)
            self.stats["malformed"] += 1
            GROUPS_IN.labels("malformed").inc()
            await msg.term()
            return
        rewards = [s.reward for s in group.samples]
        self.stats["truncatedSamples"] += sum(s.truncated for s in group.samples)
        if self.spec.rl.filter_zero_variance and is_zero_variance(rewards):
            self.filtered += 1
            self.stats["filteredGroups"] += 1
            GROUPS_IN.labels("filtered").inc()
            await msg.ack()
            return
        self.accepted.append((msg, group))
        GROUPS_IN.labels("accepted").inc()
        PENDING.set(len(self.accepted))

    async def _publish_step(self) -> None:
        take, self.accepted = self.accepted[: self.spec.groups_per_step], self.accepted[self.spec.groups_per_step:]
        samples = []
        for _, group in take:
            adv = group_advantages([s.reward for s in group.samples], self.spec.rl.normalize_advantages)
            samples += [StepSample(s, a) for s, a in zip(group.samples, adv)]
        by_generator = Tally(str(g.generator) for _, g in take)
        per_rank = pack_step(self.step, samples, self.ranks, self.spec.trainer.micro_batch_tokens,
                             self.spec.rl.token_weighting, groups_filtered=self.filtered)
        acks = []
        for batches in per_rank:
            for mb in batches:
                mb.step_groups_by_generator = dict(by_generator)
                acks.append(self.js.publish(
                    self.subjects.batches(mb.rank), m.encode(mb),
                    headers={"Nats-Msg-Id": f"{self.step}-{mb.rank}-{mb.index}"}, timeout=30))
        await asyncio.gather(*acks)  # stored durably before the inputs are released
        for msg, _ in take:
            await msg.ack()
        log.info("published step %d: %d samples in %d micro-batches/rank (%d groups filtered since last)",
                 self.step, len(samples), len(per_rank[0]), self.filtered)
        self.filtered = 0
        self.step += 1
        self.stats["steps"] += 1
        STEPS_OUT.inc()
        PENDING.set(len(self.accepted))


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    pre = Preprocessor(job, env, job.spec.trainer_ranks)

    async def _run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: (pre.stopping.set(), exit_soon()))
        await pre.run()

    asyncio.run(_run())
    return 0
