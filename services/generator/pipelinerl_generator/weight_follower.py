"""The generator's side of the weight group, mirroring the trainer's `WeightSender`: it says hello
(alive, the weights it holds, its admission queue) every second and after starting groups; on a
`WeightUpdate` that lists this process it joins the update's membership epoch where new, has the
engine receive and load the weights (staged beside generation, or inside a pause that keeps the
running requests), tells admission, and replies `WeightUpdateDone`. Only the newest update waiting
is applied: each carries all the weights."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from pipelinerl import messages as m
from pipelinerl.admission import Admission
from pipelinerl.awake import AwakeClock
from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl.spec import JobSpec
from pipelinerl.steps import weight_group_rank, weight_group_size
from pipelinerl_generator.engine import Engine, EngineStuck, WeightsKept
from pipelinerl_generator.metrics import UPDATE_PAUSE, VERSION

log = logging.getLogger("pipelinerl.generator")
HELLO_S = 1.0  # the trainer takes a generator silent for LIVENESS_S (10 s) for gone


class WeightFollower:
    def __init__(
        self,
        spec: JobSpec,
        env: ServiceEnv,
        subjects: JobSubjects,
        nc,
        engine: Engine,
        admission: Admission,
        wake: Callable[[], None],
        fail: Callable[[BaseException], None],
    ) -> None:
        self.spec, self.env, self.subjects, self.nc, self.engine, self.admission = (
            spec,
            env,
            subjects,
            nc,
            engine,
            admission,
        )
        self.wake, self.fail = wake, fail  # the admission loop: work may start; a fatal error: stop
        self.incarnation = uuid.uuid4().hex[:12]  # this process, to the weight group's membership
        # Peers are judged by their silence in this process's awake time: a generator frozen past
        # the peers' time to live forgets none on thawing before it reads their hellos.
        self.clock = AwakeClock()
        self.group: str | None = None  # the weight group (membership epoch) joined
        self.holds_weights = asyncio.Event()  # the trainer's weights are loaded
        self.started_groups = asyncio.Event()  # the peers should hear of this one's queue now
        self.updates_in_flight = 0  # updates applied while requests were running
        self.next_update: m.WeightUpdate | None = None
        self.update_waiting = asyncio.Event()
        self.applying_since: float | None = None  # on `clock`: when the update being applied began
        self.checking_since: float | None = None  # on `clock`: when the pending liveness check began

    async def listen(self) -> list[asyncio.Task]:
        """Subscribe to updates and hellos; the hello, update and clock loops, to cancel at the end."""
        await self.nc.subscribe(self.subjects.weights_update, cb=self._on_weight_update)
        await self.nc.subscribe(self.subjects.weights_hello, cb=self._on_hello)
        loops = (self._say_hello(), self._apply_updates(), self.clock.tick_forever())
        return [asyncio.create_task(loop) for loop in loops]

    async def first_weights(self, timeout_s: float, stopping: asyncio.Event) -> bool:
        """Wait for the first weights from the trainer: True once loaded, False if stopped first."""
        waits = [asyncio.ensure_future(self.holds_weights.wait()), asyncio.ensure_future(stopping.wait())]
        done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if not done:
            raise TimeoutError(
                f"generator {self.env.rank}: no weights from the trainer in {timeout_s:.0f}s "
                f"(is the trainer running? weight group at {self.env.weights_addr})"
            )
        return self.holds_weights.is_set()

    async def _say_hello(self) -> None:
        """Tell trainer rank 0 and the other generators that this process is alive, which weights
        it holds and its admission queue; forget the peers that stopped saying hello."""
        a = self.admission
        while True:
            self.started_groups.clear()
            hello = m.GeneratorHello(
                generator=self.env.rank,
                incarnation=self.incarnation,
                version=a.weights_version,
                queued=a.queued,
                oldest=min(a.running, default=None),
                busy_seconds=self.busy_seconds(),
            )
            try:
                await self.nc.publish(self.subjects.weights_hello, m.encode(hello))
            except Exception as err:  # NATS reconnecting: the next hello will do
                log.warning("hello not sent: %s", err)
            try:
                await asyncio.wait_for(self.started_groups.wait(), HELLO_S)
            except asyncio.TimeoutError:
                pass
            a.expire_peers(self.clock.now())

    def busy_seconds(self) -> float:
        """How long the engine has not answered (awake seconds): the update being applied, or a
        liveness check (`check_engine`); 0: neither is under way."""
        since = [t for t in (self.applying_since, self.checking_since) if t is not None]
        return self.clock.now() - min(since) if since else 0.0

    async def check_engine(self) -> None:
        """That the engine's core answers (`Engine.check_alive`), counted in `busy_seconds` while it
        does not. A core stalled between updates holds its groups in flight, and with them every
        peer's admission (their version is the cluster's oldest), until this process gives up on
        it (`Engine.rpc_timeout_s`); past weightSync.timeoutSeconds its hellos say it is stuck, as
        in an update, and the trainer and its peers leave it out until it answers."""
        self.checking_since = self.clock.now()
        try:
            await self.engine.check_alive()
        finally:
            self.checking_since = None

    async def _on_hello(self, msg) -> None:
        """A peer's queue and oldest group in flight, for the cluster-wide admission rule."""
        hello = m.decode(msg.data, m.GeneratorHello)
        if hello.generator == self.env.rank:
            return
        if hello.stuck(self.spec.weight_sync.timeout_seconds):
            self.admission.forget_peer(hello.generator)
        else:
            self.admission.on_peer(hello.generator, hello.queued, hello.oldest, self.clock.now())
        self.wake()

    async def _on_weight_update(self, msg) -> None:
        """Keep only the newest update: one that arrives while another is applied supersedes any
        still waiting (each carries all the weights; a stale epoch's rendezvous is long over)."""
        self.next_update = m.decode(msg.data, m.WeightUpdate)
        self.update_waiting.set()

    async def _apply_updates(self) -> None:
        while True:
            await self.update_waiting.wait()
            self.update_waiting.clear()
            update, self.next_update = self.next_update, None
            if update is not None:
                self.applying_since = self.clock.now()
                try:
                    await self._apply(update)
                finally:
                    self.applying_since = None

    async def _apply(self, update: m.WeightUpdate) -> None:
        me = (self.env.rank, self.incarnation)
        if me not in update.members:  # not (yet, or no longer) in this epoch: keep the weights we hold
            if update.group != self.group:
                self.group = None
            return
        if update.group != self.group and not await self._join(update):
            return
        reply = m.WeightUpdateDone(
            version=update.version,
            generator=self.env.rank,
            incarnation=self.incarnation,
            pause_seconds=0.0,
            running_requests=0,
        )
        if self.holds_weights.is_set() and update.version < self.engine.version:  # never expected: say so
            log.warning("weights go back from version %d to %d", self.engine.version, update.version)
        try:
            stats = await self.engine.update_weights(update.version, update.buckets)
            reply.pause_seconds, reply.running_requests = stats.pause_seconds, stats.running_requests
            self.updates_in_flight += int(stats.running_requests > 0)
            self.admission.on_weights(update.version, generators=len(update.members))
            self.holds_weights.set()
            VERSION.set(update.version)
            UPDATE_PAUSE.set(stats.pause_seconds)
        except WeightsKept as err:  # the trainer drops us; the next epoch sends the weights again
            log.warning("%s", err)
            reply.error, self.group = str(err), None
        except Exception as err:  # the live weights may be half-loaded: stop (and be restarted)
            log.exception("weight update to version %d failed", update.version)
            reply.error = f"{type(err).__name__}: {err}"
            self.fail(err)
        try:
            await self.nc.publish(self.subjects.weights_done, m.encode(reply))
        except Exception as err:  # NATS reconnecting: the trainer takes the silence for a failure, sends again
            log.warning("weight update %d's reply not sent: %s", update.version, err)
        self.wake()

    async def _join(self, update: m.WeightUpdate) -> bool:
        """Join the update's weight group (a new membership epoch); False if that failed."""
        tp = self.spec.generator.tensor_parallel
        rank = weight_group_rank(update.members.index((self.env.rank, self.incarnation)), tp)
        size = weight_group_size(len(update.members), tp)
        try:
            await self.engine.join_weight_group(
                self.env.weights_host,
                self.env.weights_port,
                update.group,
                rank,
                size,
                self.spec.weight_sync.timeout_seconds,
                self.env.weights_token or "",
            )
        except EngineStuck:  # the engine itself is blocked: stop (and be restarted)
            raise
        except Exception as err:  # aborted or timed out: the trainer forms another epoch
            log.warning("could not join weight group %s: %s", update.group, err)
            self.group = None
            return False
        self.group = update.group
        log.info("joined weight group %s as rank %d of %d", update.group, rank, size)
        return True
