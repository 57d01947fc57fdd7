"""NATS from a synchronous training loop: an asyncio loop in a daemon thread, with every call
bounded by a timeout. Micro-batches of this rank arrive through an ordered consumer into a
thread-safe queue, starting right after the last stream sequence a checkpoint consumed."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from typing import Any

import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from pipelinerl import messages as m
from pipelinerl.awake import AwakeClock
from pipelinerl.contracts import ServiceEnv
from pipelinerl.runtime import JOIN_TIMEOUT_S, join_job
from pipelinerl.spec import PipelineRLJob
from pipelinerl.streams import (
    READ_TIMEOUT_S,
    dead_letter,
    last_announcement,
    last_sent,
    problems_claimed,
    publish_once,
)
from pipelinerl.store import store_identity

log = logging.getLogger("pipelinerl.trainer")
# A stream publish's bound (`publish_once`: three tries of 30 s, 3 s of back-off between them);
# a dead letter given 60 s was cut short in a NATS restart its tries would have ridden out.
PUBLISH_S = 100


def after(seq: int) -> ConsumerConfig:
    """A consumer that delivers a stream's messages after sequence `seq` (0: all of them)."""
    if seq:
        return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq + 1)
    return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)


class NatsBridge:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv, client: str):
        self.subjects = job.subjects
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nats", daemon=True)
        self.thread.start()
        # (stream sequence, the micro-batch as stored): decoded by the trainer as it takes each. The
        # ordered consumer pushes a restarted rank's whole replay at once (it holds nothing back
        # for a callback that is slow); decoded here, it held ~185 bytes a token, stored ~36. At most
        # this rank's share of BATCHES, which the job's reservation bounds (`capacity.stream_bytes`).
        self.batches: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self.done: queue.Queue[m.WeightUpdateDone] = queue.Queue()
        self.hellos: queue.Queue[tuple[float, m.GeneratorHello]] = queue.Queue()
        # The generators' silence is judged in this process's awake time, ticked by the loop that
        # reads their hellos: a trainer frozen past the liveness bound drops nobody on thawing.
        self.clock = AwakeClock()
        asyncio.run_coroutine_threadsafe(self.clock.tick_forever(), self.loop)
        self.evals: queue.Queue[tuple[int, m.Metrics]] = queue.Queue()  # (METRICS stream sequence, row)
        self.nc = self.call(join_job(job, env, client), JOIN_TIMEOUT_S + 5)  # join_job says why first
        self.js = self.nc.jetstream()

    def now(self) -> float:
        return self.clock.now()

    def call(self, coro, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self.loop).result()

    def consume_batches(self, rank: int, after_seq: int) -> None:
        async def on_msg(msg) -> None:
            self.batches.put((msg.metadata.sequence.stream, msg.data))

        self.call(
            self.js.subscribe(self.subjects.batches(rank), cb=on_msg, ordered_consumer=True, config=after(after_seq)),
            30,
        )

    def listen_to_generators(self) -> None:
        """Rank 0: the generators' replies to weight updates, and their hellos."""

        async def on_done(msg) -> None:
            self.done.put(m.decode(msg.data, m.WeightUpdateDone))

        async def on_hello(msg) -> None:
            self.hellos.put((self.now(), m.decode(msg.data, m.GeneratorHello)))

        self.call(self.nc.subscribe(self.subjects.weights_done, cb=on_done), 30)
        self.call(self.nc.subscribe(self.subjects.weights_hello, cb=on_hello), 30)

    def listen_to_evaluations(self, after_seq: int) -> None:
        """The generators' evaluation rows from the METRICS stream, after sequence `after_seq`
        (those published while this rank was down too: a live subscription missed them)."""

        async def on_eval(msg) -> None:
            self.evals.put((msg.metadata.sequence.stream, m.decode(msg.data, m.Metrics)))

        self.call(
            self.js.subscribe(
                self.subjects.metrics("eval"), cb=on_eval, ordered_consumer=True, config=after(after_seq)
            ),
            30,
        )

    def store_identity(self) -> m.StoreIdentity:
        """Which store the job's streams are (written by the first service to find none)."""
        return self.call(store_identity(self.js, self.subjects), READ_TIMEOUT_S + 5)

    def problems_claimed(self) -> int:
        return self.call(problems_claimed(self.js, self.subjects), READ_TIMEOUT_S + 5)

    def last_announcement(self) -> m.PolicyVersion | None:
        """The newest version announced on the job's stream (None: none yet)."""
        return self.call(last_announcement(self.js, self.subjects), READ_TIMEOUT_S + 5)

    def last_sent(self) -> int:
        """The newest version rank 0 began to broadcast, in the job's store (0: none)."""
        return self.call(last_sent(self.js, self.subjects), READ_TIMEOUT_S + 5)

    def publish(self, subject: str, msg: m.Message, stream: bool = True) -> None:
        """To a stream: until acknowledged (its id, new per call, makes a resend idempotent), so a
        request lost when nats-server dies is sent again. Core NATS (weight updates): sent, and
        confirmed where the server answers; one a restart lost is not fatal, since a generator
        that misses it is dropped at the weight group's deadline and the next epoch sends again."""
        if stream:
            self.call(publish_once(self.js, subject, m.encode(msg), uuid.uuid4().hex), PUBLISH_S)
            return
        self.call(self.nc.publish(subject, m.encode(msg)), 30)
        try:
            self.call(self.nc.flush(timeout=30), 60)
        except nats.errors.TimeoutError as err:  # FlushTimeoutError derives from it
            log.warning("%s sent while NATS reconnects, not confirmed: %s", type(msg).__name__, err)

    def dead_letter(self, data: bytes, reason: str, msg_id: str) -> None:
        self.call(dead_letter(self.js, self.subjects, "batch", data, reason, msg_id), PUBLISH_S)

    def close(self) -> None:
        try:
            self.call(self.nc.drain(), 30)
            # nats-py leaves its JetStream subscriptions' heartbeat checks running after a drain:
            # stopped with the loop, each was logged as an ERROR ("Task was destroyed but it is pending").
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(5)  # not in call's wait_for
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def _cancel_the_rest() -> None:
    rest = asyncio.all_tasks() - {asyncio.current_task()}
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
