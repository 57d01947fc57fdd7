"""Generator service: rollouts with max-lag admission, in-flight weight updates, evaluation.

Loops, all on one asyncio loop:
- admission: start prompt groups while the lag budget allows (this generator's share, and the
  cluster's: peers' queues come with their hellos); each group runs G attempts
  concurrently through the engine and is published to JetStream (msg id = group id, so a
  retried publish is de-duplicated) with the generator's books, from which a restarted
  generator continues (`_restore_books`);
- weights: say hello to the trainer and the peers every second (and after starting groups);
  on a `WeightUpdate` that lists this process, join its weight group if it is a new membership
  epoch, receive (staged beside generation, or inside a pause that keeps requests), relabel,
  reply. Nothing is generated before the first weights from the trainer arrive;
- versions: the trainer's announcements free admission budget and trigger evaluations.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

from nats.js.api import DeliverPolicy

from pipelinerl import books
from pipelinerl import messages as m
from pipelinerl.admission import Admission
from pipelinerl.contracts import GeneratorStatus, ServiceEnv
from pipelinerl.runtime import HealthServer, join_job, serve
from pipelinerl.prompt_fit import prompt_fit
from pipelinerl.spec import PipelineRLJob, SpecError
from pipelinerl.steps import counts_as_discarded, training_step, weight_group_rank, weight_group_size
from pipelinerl.streams import claim_problems, last_announcement, last_message, newest_batches, publish_once
from pipelinerl.tasks import make_task
from pipelinerl.tiny_model import load_tokenizer, resolve_model_path
from pipelinerl_generator.engine import Engine, WeightsKept
from pipelinerl_generator.metrics import GROUPS, INFLIGHT, SCRAPED, TOKENS, UPDATE_PAUSE, VERSION, BusyClock

log = logging.getLogger("pipelinerl.generator")
HELLO_S = 1.0  # the trainer takes a generator silent for LIVENESS_S (10 s) for gone


class Generator:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv):
        self.job, self.env, self.spec = job, env, job.spec
        self.subjects = job.subjects
        self.admission = Admission(
            groups_per_step=self.spec.groups_per_step,
            generators=self.spec.generator_engines,
            max_lag=self.spec.max_lag,
            max_inflight=self.spec.generator.max_inflight_groups,
            steps_per_generation=self.spec.steps_per_generation,
        )
        self.wakeup = asyncio.Event()
        self.first_group_at: float | None = None  # wall clock: when generation began (benchmarks' clocks)
        self.started_groups = asyncio.Event()  # the peers should hear of this one's queue now
        self.stopping = asyncio.Event()
        self.finished_version: int | None = None
        self.evaluations: dict[int, asyncio.Future] = {}  # version -> its evaluation (shared by reports)
        self.reported: set[tuple[int, bool]] = set()  # (version, final) published
        self.errors: list[BaseException] = []
        self.tasks: set[asyncio.Task] = set()
        self.busy = BusyClock()
        self.updates_in_flight = 0  # updates applied while requests were running
        self.incarnation = uuid.uuid4().hex[:12]  # this process, to the weight group's membership
        self.group: str | None = None  # the weight group (membership epoch) joined
        self.holds_weights = asyncio.Event()  # the trainer's weights are loaded
        self.next_update: m.WeightUpdate | None = None
        self.update_waiting = asyncio.Event()
        self.problems: collections.deque[int] = collections.deque()  # claimed training problems, not yet drawn
        self.publishing = asyncio.Lock()  # one publish at a time: each group carries the books after it
        self.newest_eval: dict | None = None  # the evaluation of the highest version so far

    def _check_prompts_fit(self) -> None:
        """A job whose prompts leave no room for a completion cannot run: say so, by field."""
        errors, warnings = prompt_fit(
            self.task, self.tokenizer, self.spec.model.max_seq_len, self.spec.generator.sampling.max_tokens
        )
        for w in warnings:
            log.warning("spec.%s", w)
        if errors:
            raise SpecError("; ".join(f"spec.{e}" for e in errors))

    # -- status ----------------------------------------------------------------------------
    def status(self) -> GeneratorStatus:
        a, engine = self.admission, getattr(self, "engine", None)
        return GeneratorStatus(
            rank=self.env.rank,
            version=engine.version if engine else 0,
            groups_started=a.started,
            groups_finished=a.finished,
            groups_published=a.published,
            groups_discarded=a.discarded,
            groups_trained=a.trained,
            inflight_groups=a.inflight,
            queued_groups=a.queued,
            tokens=engine.tokens_generated if engine else 0,
            updates_with_requests_in_flight=self.updates_in_flight,
            busy_seconds=self.busy.seconds(),
            first_group_at=self.first_group_at,
        )

    # -- main ------------------------------------------------------------------------------
    async def run(self) -> None:
        SCRAPED.generator = self
        model_path = resolve_model_path(self.spec.model.path)
        seed = self.spec.trainer.seed + 1000 * self.env.rank
        # On the CPU build the engine comes first, while no thread of ours runs (its core process
        # is then forked, not spawned: `engine.core_start_method`; it starts in seconds). Even the
        # task waits: a dataset task's loader (pyarrow) starts threads. On GPUs the health server
        # answers while the model downloads and loads, which can take long.
        cpu = not self.spec.generator.gpus
        if cpu:
            self.engine = Engine(self.job, model_path, seed=seed)
        self.task = make_task(self.spec.task.name, self.spec.task.params, seed=self.spec.task.seed)
        http = HealthServer("generator", self.env.http_port, self.status).start()
        self.nc = await join_job(self.job, self.env, f"{self.job.name}-generator-{self.env.rank}")
        self.js = self.nc.jetstream()
        if not cpu:
            self.engine = Engine(self.job, model_path, seed=seed)
        self.tokenizer = load_tokenizer(model_path)  # prompts are tokenized here; vLLM takes token ids
        self._check_prompts_fit()
        await self.engine.prepare_updates()  # the staging copy, allocated now: one that does not fit fails here
        await self._restore_books()
        await self.nc.subscribe(self.subjects.weights_update, cb=self._on_weight_update)
        await self.nc.subscribe(self.subjects.weights_hello, cb=self._on_hello)
        await self.js.subscribe(
            self.subjects.version,
            cb=self._on_version,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ordered_consumer=True,
        )
        # Not in self.tasks: these run until the end.
        hello, updates = asyncio.create_task(self._say_hello()), asyncio.create_task(self._apply_updates())
        for t in (hello, updates):
            t.add_done_callback(self._done)  # a crash stops the generator, loudly
        # Whatever it loaded from disk, a generator generates only with weights the trainer sent
        # (and labels its tokens with their version).
        first = await self._first_weights(self.spec.weight_sync.timeout_seconds * 5)
        if first is not None:
            http.ready = True
            log.info("generator %d ready at version %d (model %s)", self.env.rank, first, model_path)
            self._spawn(self._maybe_eval(first))
            await self._admission_loop()
        hello.cancel()
        updates.cancel()
        self.engine.shutdown()
        await asyncio.wait_for(self.nc.close(), 10)  # every publish was already acked: no drain needed

    async def _restore_books(self) -> None:
        """Continue the books of this generator's earlier incarnations (groups published and
        discarded) from its newest group: the newest still in the rollout stream, or the newest
        the preprocessor took, recorded in its micro-batches (`books.restore`, as the preprocessor
        reads them). Groups trained come from the trainer's newest announcement. A group of
        theirs still queued counts as queued. (No problem of theirs is drawn again: problems are
        claimed, `_next_problem`.)"""
        a, rank = self.admission, self.env.rank
        queued = None
        data = await last_message(self.js, self.subjects.stream("ROLLOUTS"), self.subjects.rollouts(rank))
        try:
            queued = m.decode(data, m.RolloutGroup).books if data is not None else None
        except m.MessageError as err:  # not ours to trust (it is dead-lettered downstream)
            log.error("the newest message on %s is not ours: %s", self.subjects.rollouts(rank), err)
        try:
            taken = books.restore(await newest_batches(self.js, self.subjects, self.spec.trainer_ranks))
        except m.MessageError as err:
            log.error("the preprocessor's record is not readable: %s", err)
            taken = books.restore([])
        newest = books.newest_books(queued, taken.generators.get(str(rank)))
        if newest is not None:
            a.published, a.discarded = newest.published, newest.discarded
        announced = await last_announcement(self.js, self.subjects)
        if announced is not None:
            a.on_trained(announced.trained_groups.get(str(rank), 0))
        if a.published:
            log.info(
                "generator %d continues its books: %d groups published (%d discarded, %d trained)",
                rank,
                a.published,
                a.discarded,
                a.trained,
            )

    async def _say_hello(self) -> None:
        """Tell trainer rank 0 and the other generators, every HELLO_S and as soon as this one
        started groups, that this process is alive, which weights it holds and its admission
        queue; forget the peers that stopped saying hello."""
        a = self.admission
        while not self.stopping.is_set():
            self.started_groups.clear()
            hello = m.GeneratorHello(
                generator=self.env.rank,
                incarnation=self.incarnation,
                version=a.weights_version,
                queued=a.queued,
                oldest=min(a.running, default=None),
            )
            try:
                await self.nc.publish(self.subjects.weights_hello, m.encode(hello))
            except Exception as err:  # NATS reconnecting: the next hello will do
                log.warning("hello not sent: %s", err)
            try:
                await asyncio.wait_for(self.started_groups.wait(), HELLO_S)
            except asyncio.TimeoutError:
                pass
            a.expire_peers(time.monotonic())

    async def _on_hello(self, msg) -> None:
        """A peer's queue and oldest group in flight, for the cluster-wide admission rule."""
        hello = m.decode(msg.data, m.GeneratorHello)
        if hello.generator != self.env.rank:
            self.admission.on_peer(hello.generator, hello.queued, hello.oldest, time.monotonic())
            self.wakeup.set()

    async def _first_weights(self, timeout_s: float) -> int | None:
        """The version of the first weights received; None if stopped first."""
        waits = [asyncio.ensure_future(self.holds_weights.wait()), asyncio.ensure_future(self.stopping.wait())]
        done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if self.errors:
            raise self.errors[0]
        if not done:
            raise TimeoutError(
                f"generator {self.env.rank}: no weights from the trainer in {timeout_s:.0f}s "
                f"(is the trainer running? weight group at {self.env.weights_addr})"
            )
        return self.engine.version if self.holds_weights.is_set() else None

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task) -> None:
        self.tasks.discard(t)
        error = None if t.cancelled() else t.exception()
        if error is not None:
            self.errors.append(error)
            self.stopping.set()
            self.wakeup.set()

    async def _admission_loop(self) -> None:
        while not self.stopping.is_set():
            if self.finished_version is not None:
                break
            if self.admission.may_start():
                started_at = self.admission.on_start()
                self.first_group_at = self.first_group_at or time.time()
                self._spawn(self._group(self.task.train_problem(await self._next_problem()), started_at))
                self.started_groups.set()  # tell the peers at once
                continue
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        if self.errors:
            raise self.errors[0]
        if self.finished_version is not None and self.tasks:
            # Finished: let the final evaluation complete (bounded); rollouts still running are
            # abandoned below, nobody will train them.
            await asyncio.wait(list(self.tasks), timeout=self.spec.weight_sync.timeout_seconds)
        for t in list(self.tasks):
            t.cancel()

    async def _next_problem(self) -> int:
        """The next training problem: from a block claimed for this generator alone (a step's
        share), so that whatever the generators' number, restarts or arrivals, each problem is
        drawn once (a claimed block an incarnation did not finish is left unused)."""
        if not self.problems:
            block = max(1, self.admission.share)
            start = await claim_problems(self.js, self.subjects, block)
            self.problems.extend(range(start, start + block))
        return self.problems.popleft()

    async def _group(self, problem, started_at: int) -> None:
        INFLIGHT.inc()
        self.busy.enter()
        try:
            max_tokens = self.spec.generator.sampling.max_tokens
            samples = await asyncio.gather(
                *[
                    self.task.rollout(self.engine, self.tokenizer, problem, max_tokens)
                    for _ in range(self.spec.rl.attempts)
                ]
            )
            # The problem's id (each is drawn once: claim_problems) and the generator's rank.
            group = m.RolloutGroup(
                group_id=f"{problem.id}@{self.env.rank}", generator=self.env.rank, samples=list(samples)
            )
            await self._publish(group, started_at)
            TOKENS.inc(sum(s.num_generated for s in samples))
        finally:
            INFLIGHT.dec()
            self.busy.leave()
            self.wakeup.set()

    async def _publish(self, group: m.RolloutGroup, started_at: int) -> None:
        a = self.admission
        discarded = counts_as_discarded(self.spec, group)
        async with self.publishing:
            group.books = books.GeneratorBooks(published=a.published + 1, discarded=a.discarded + discarded)
            ack = await publish_once(self.js, self.subjects.rollouts(self.env.rank), m.encode(group), group.group_id)
            if ack.duplicate:  # an earlier incarnation published it: it is in the books already
                log.warning("group %s was already published: not counted again", group.group_id)
            a.on_finish(started_at, discarded=discarded, published=not ack.duplicate)
        GROUPS.inc()

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
                await self._apply(update)

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
            self.errors.append(err)
            self.stopping.set()
        await self.nc.publish(self.subjects.weights_done, m.encode(reply))
        self.wakeup.set()

    async def _join(self, update: m.WeightUpdate) -> bool:
        """Join the update's weight group (a new membership epoch); False if that failed."""
        tp = self.spec.generator.tensor_parallel
        rank = weight_group_rank(update.members.index((self.env.rank, self.incarnation)), tp)
        try:
            await self.engine.join_weight_group(
                self.env.weights_host,
                self.env.weights_port,
                update.group,
                rank,
                weight_group_size(len(update.members), tp),
                self.spec.weight_sync.timeout_seconds,
                self.env.weights_token or "",
            )
        except Exception as err:  # aborted or timed out: the trainer forms another epoch
            log.warning("could not join weight group %s: %s", update.group, err)
            self.group = None
            return False
        self.group = update.group
        log.info(
            "joined weight group %s as rank %d of %d", update.group, rank, weight_group_size(len(update.members), tp)
        )
        return True

    async def _on_version(self, msg) -> None:
        pv = m.decode(msg.data, m.PolicyVersion)
        self.admission.on_trained(pv.trained_groups.get(str(self.env.rank), 0), training_step=training_step(pv))
        self.wakeup.set()
        final = pv.finished and pv.version >= self.spec.trainer.max_steps  # not a stale one before a resume
        if final:
            self.finished_version = pv.version
        self._spawn(self._maybe_eval(pv.version, final=final))

    async def _maybe_eval(self, version: int, final: bool = False) -> None:
        """Evaluate `version` (once, however often asked) at the eval interval and the final one;
        each kind of report is published once."""
        interval = self.spec.eval.interval
        if self.env.rank != 0 or (version, final) in self.reported:
            return
        if not final and (interval == 0 or version % interval):
            return
        self.reported.add((version, final))
        if version not in self.evaluations:
            self.evaluations[version] = asyncio.ensure_future(self._evaluate(version))
        values = await self.evaluations[version]
        if values is None:
            return
        if self.newest_eval is None or version >= self.newest_eval["version"]:
            self.newest_eval = values
        log.info("eval at version %d: accuracy %.3f%s", version, values["accuracy"], " (final)" if final else "")
        row = m.Metrics(
            source=f"generator-{self.env.rank}", kind="eval", values=values | {"final": final}, timestamp=time.time()
        )
        await publish_once(self.js, self.subjects.metrics("eval"), m.encode(row), uuid.uuid4().hex)

    async def _evaluate(self, version: int) -> dict | None:
        # The trainer announces a version as soon as its weights are sent: evaluate them once loaded.
        deadline = time.monotonic() + self.spec.weight_sync.timeout_seconds
        while self.engine.version < version:
            if time.monotonic() > deadline:
                log.warning("no evaluation of version %d: its weights never arrived", version)
                return None
            await asyncio.sleep(0.02)
        t0 = time.time()
        problems = self.task.test_problems(self.spec.eval.problems)
        self.busy.enter()
        try:
            samples = await asyncio.gather(
                *[
                    self.task.rollout(
                        self.engine, self.tokenizer, p, self.spec.generator.sampling.max_tokens, greedy=True
                    )
                    for p in problems
                ]
            )
        finally:
            self.busy.leave()
        return {
            "version": version,
            "accuracy": sum(s.success for s in samples) / len(samples),
            "reward": sum(s.reward for s in samples) / len(samples),
            "problems": len(samples),
            "seconds": time.time() - t0,
        }


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    gen = Generator(job, env)

    def stop() -> None:
        gen.stopping.set()
        gen.wakeup.set()

    return serve(gen.run, stop)
