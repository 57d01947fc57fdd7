"""Generator service: rollouts with max-lag admission, in-flight weight updates, evaluation.

`assemble` builds what a generator uses (engine, task, tokenizer, NATS, its admission books as
the stored record has them) and hands it to `Generator`, whose loops all run on one asyncio loop:
- admission: start prompt groups while the lag budget allows (this generator's share, and the
  cluster's: peers' queues come with their hellos); each group runs G attempts
  concurrently through the engine and is published to JetStream (msg id = group id, the job's
  alone: a retried publish is de-duplicated) with the generator's books, from which a restarted
  generator continues (`restore_admission`);
- weights (`weight_follower.WeightFollower`): hellos, membership epochs, in-flight updates.
  Nothing is generated before the first weights from the trainer arrive;
- the engine's liveness: a core that stops answering stops the generator (to be restarted);
- versions: the trainer's announcements free admission budget and trigger evaluations
  (`evaluator.Evaluator`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from nats.js.api import DeliverPolicy

from pipelinerl import books
from pipelinerl import messages as m
from pipelinerl.admission import Admission
from pipelinerl.claims import Range, group_id, indices, ranges_text, with_indices, without_index
from pipelinerl.contracts import GeneratorStatus, JobSubjects, ServiceEnv
from pipelinerl.prompt_fit import prompt_fit
from pipelinerl.runtime import HealthServer, join_job, serve
from pipelinerl.spec import JobSpec, PipelineRLJob, SpecError
from pipelinerl.steps import FINAL_EVAL_WAIT_S, counts_as_discarded, is_final, training_step
from pipelinerl.streams import (
    claim_problems,
    close,
    give_back_problems,
    held_problems,
    hold_problems,
    last_announcement,
    last_message,
    newest_batches,
    publish_once,
)
from pipelinerl.tasks import PromptTooLong, make_task
from pipelinerl.tiny_model import load_tokenizer, resolve_model_path
from pipelinerl_generator.engine import Engine
from pipelinerl_generator.evaluator import Evaluator
from pipelinerl_generator.metrics import GROUPS, INFLIGHT, SCRAPED, SKIPPED, TOKENS, BusyClock
from pipelinerl_generator.weight_follower import WeightFollower

log = logging.getLogger("pipelinerl.generator")
ENGINE_CHECK_S = 30.0
GIVE_BACK_S = 10.0  # well within a stop's own bound (runtime.exit_soon's 20 s), the engine's shutdown after


class Generator:
    def __init__(
        self,
        job: PipelineRLJob,
        env: ServiceEnv,
        nc,
        engine: Engine,
        task,
        tokenizer,
        admission: Admission,
        http: HealthServer,
        stopping: asyncio.Event,
        wakeup: asyncio.Event,
        held: list[Range] | None = None,
    ) -> None:
        self.job, self.env, self.spec, self.subjects = job, env, job.spec, job.subjects
        self.nc, self.js, self.engine, self.task, self.tokenizer = nc, nc.jetstream(), engine, task, tokenizer
        self.admission, self.http, self.stopping, self.wakeup = admission, http, stopping, wakeup
        self.busy = BusyClock()
        self.weights = WeightFollower(
            self.spec, env, self.subjects, nc, engine, admission, wake=self.wakeup.set, fail=self._fail
        )
        self.evaluator = Evaluator(self.spec, env.rank, self.subjects, self.js, engine, task, tokenizer, self.busy)
        self.first_group_at: float | None = None  # wall clock: when generation began (benchmarks' clocks)
        self.finished_version: int | None = None
        self.errors: list[BaseException] = []
        self.tasks: set[asyncio.Task] = set()
        self.rollouts: set[asyncio.Task] = set()  # of those, the groups being generated
        # Training problems this rank holds (`streams.hold_problems`): claimed, by this incarnation or
        # one before it, and no group of them published; and of those, the ones not yet drawn.
        self.held: list[Range] = held or []
        self.problems: collections.deque[int] = collections.deque(indices(self.held))
        self.holding = asyncio.Lock()  # one record of them written at a time, the newest last
        self.held_changes = self.held_written = 0  # changes made to `held`; of those, recorded
        self.publishing = asyncio.Lock()  # one publish at a time: each group carries the books after it

    # -- status ----------------------------------------------------------------------------
    def status(self) -> GeneratorStatus:
        a = self.admission
        return GeneratorStatus(
            rank=self.env.rank,
            version=self.engine.version,
            groups_started=a.started,
            groups_finished=a.finished,
            groups_published=a.published,
            groups_discarded=a.discarded,
            groups_trained=a.trained,
            inflight_groups=a.inflight,
            queued_groups=a.queued,
            tokens=self.engine.tokens_generated,
            updates_with_requests_in_flight=self.weights.updates_in_flight,
            busy_seconds=self.busy.seconds(),
            first_group_at=self.first_group_at,
        )

    # -- main ------------------------------------------------------------------------------
    async def run(self) -> None:
        SCRAPED.generator = self
        await self.js.subscribe(
            self.subjects.version,
            cb=self._on_version,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ordered_consumer=True,
        )
        # Not in self.tasks: these run until the end.
        loops = [*await self.weights.listen(), asyncio.create_task(self._watch_engine())]
        for t in loops:
            t.add_done_callback(self._done)  # a crash stops the generator, loudly
        # Whatever it loaded from disk, a generator generates only with weights the trainer sent
        # (and labels its tokens with their version).
        first = await self.weights.first_weights(self.spec.weight_sync.timeout_seconds * 5, self.stopping)
        if self.errors:
            raise self.errors[0]
        if first:
            self.http.ready = True
            log.info("generator %d ready at version %d", self.env.rank, self.engine.version)
            self._spawn(self.evaluator.maybe_eval(self.engine.version))
            await self._admission_loop()
        if self.stopping.is_set() and self.finished_version is None and not self.errors:
            await self._give_back()
        for t in loops:
            t.cancel()
        self.engine.shutdown()
        await close(self.nc)

    async def _watch_engine(self) -> None:
        """Every ENGINE_CHECK_S (half weightSync.timeoutSeconds where that is shorter), that the
        engine's core still answers (`WeightFollower.check_engine`): a core stalled in a step would
        otherwise leave every rollout waiting, with no error, and its peers' admission with them."""
        every = min(ENGINE_CHECK_S, self.spec.weight_sync.timeout_seconds / 2)
        while True:
            await asyncio.sleep(every)
            await self.weights.check_engine()

    def _spawn(self, coro, rollout: bool = False) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        if rollout:
            self.rollouts.add(t)
        t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task) -> None:
        self.tasks.discard(t)
        self.rollouts.discard(t)
        error = None if t.cancelled() else t.exception()
        if error is not None:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
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
                self._spawn(self._group(await self._next_problem(), started_at), rollout=True)
                self.weights.started_groups.set()  # tell the peers at once
                continue
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        if self.errors:
            raise self.errors[0]
        if self.finished_version is not None:
            # Finished: rollouts still running are abandoned (nobody will train them) before the
            # final evaluation is waited for, which they would slow, as long as the trainer waits.
            for t in list(self.rollouts):
                t.cancel()
            if self.tasks:
                _, pending = await asyncio.wait(list(self.tasks), timeout=FINAL_EVAL_WAIT_S)
                if pending:
                    log.warning("the final evaluation did not end within %.0f s: given up", FINAL_EVAL_WAIT_S)
        for t in list(self.tasks):
            t.cancel()
        for error in self.errors:  # since the finish (the final evaluation's publish, say): training is done
            log.error("after the trainer finished: %r", error)

    async def _give_back(self) -> None:
        """Told to stop (a restart, a scale-down, a drained node): the problems this rank holds are
        given back for the next claims to take first (`streams.give_back_problems`), once its
        groups cancelled have ended (none is let go meanwhile; one that has not is left, and what
        it holds with it, to its restart). Where that fails (NATS away), its restart draws them,
        or a recovery where its record was emptied already. All within GIVE_BACK_S."""
        deadline = time.monotonic() + GIVE_BACK_S
        if self.tasks:
            _, pending = await asyncio.wait(list(self.tasks), timeout=GIVE_BACK_S / 3)
            if pending:
                log.warning("generator %d: groups still ending; what it holds is left to its restart", self.env.rank)
                return
        if not self.held:
            return
        held = list(self.held)
        try:
            await give_back_problems(self.js, self.subjects, self.env.rank, held, deadline - time.monotonic())
        except Exception as err:  # noqa: BLE001 - stopping either way
            log.warning(
                "generator %d could not give back the problems it held (%s): %r", self.env.rank, ranges_text(held), err
            )
            return
        log.info("generator %d gave back the problems it held: %s", self.env.rank, ranges_text(held))

    async def _next_problem(self) -> int:
        """The next training problem: from a block claimed for this generator alone (a step's
        share), so that whatever the generators' number, restarts or arrivals, each problem is
        drawn once. What an incarnation killed outright held and did not publish (its unused block,
        its groups in flight) its restart draws first (one told to stop gives it back:
        `_give_back`). Lost are only a block claimed by one killed before it recorded it, and the
        groups of one killed inside its publish (that one's, and those finished behind it, waiting
        to publish): drawn again where the store is made to go on from a checkpoint (`claims`)."""
        if not self.problems:
            taken = await claim_problems(self.js, self.subjects, max(1, self.admission.share))
            await self._hold(lambda held: with_indices(held, taken))
            self.problems.extend(taken)
        return self.problems.popleft()

    async def _hold(self, change: Callable[[list[Range]], list[Range]]) -> None:
        """Make `change` to what this rank holds and return once a record of it is stored. Changes
        are made at once, in turn (groups finishing together each take their index off what the
        others left: one computed from what it read before another's write would put that index
        back, and a restart would draw it twice); one record is written at a time, the newest
        whole, so a burst of groups finishing together costs two writes, not one each."""
        self.held = change(self.held)
        self.held_changes += 1
        mine = self.held_changes
        async with self.holding:
            if self.held_written >= mine:  # a record written since carried this change
                return
            changes, held = self.held_changes, self.held
            await hold_problems(self.js, self.subjects, self.env.rank, held)
            self.held_written = changes

    async def _let_go(self, index: int) -> None:
        """Before its group is published (or it is skipped): a restart draws it again only if
        its group was never published, never a second time."""
        await self._hold(lambda held: without_index(held, index))

    async def _group(self, index: int, started_at: int) -> None:
        INFLIGHT.inc()
        self.busy.enter()
        try:
            problem = self.task.train_problem(index)
            max_tokens = self.spec.generator.sampling.max_tokens
            attempts = [
                asyncio.ensure_future(self.task.rollout(self.engine, self.tokenizer, problem, max_tokens))
                for _ in range(self.spec.rl.attempts)
            ]
            try:
                samples = await asyncio.gather(*attempts)
            except PromptTooLong as err:
                for attempt in attempts:  # the others would generate on, for nothing
                    attempt.cancel()
                log.warning("training problem %s (%d) skipped: %s", problem.id, index, err)
                SKIPPED.inc()
                await self._let_go(index)
                self.admission.abandon(started_at)
                return
            group = m.RolloutGroup(
                group_id=group_id(problem.id, index, self.env.rank), generator=self.env.rank, samples=list(samples)
            )
            await self._publish(group, started_at, index)
            TOKENS.inc(sum(s.num_generated for s in samples))
        finally:
            INFLIGHT.dec()
            self.busy.leave()
            self.wakeup.set()

    async def _publish(self, group: m.RolloutGroup, started_at: int, index: int) -> None:
        """Publish the group of problem `index`."""
        await self._let_go(index)
        a = self.admission
        discarded = counts_as_discarded(self.spec, group)
        async with self.publishing:
            group.books = books.GeneratorBooks(published=a.published + 1, discarded=a.discarded + discarded)
            # A duplicate is this call's own earlier try, stored with its ack lost: published.
            await publish_once(self.js, self.subjects.rollouts(self.env.rank), m.encode(group), group.group_id)
            a.on_finish(started_at, discarded=discarded)
        GROUPS.inc()

    async def _on_version(self, msg) -> None:
        pv = m.decode(msg.data, m.PolicyVersion)
        self.admission.on_trained(pv.trained_groups.get(str(self.env.rank), 0), training_step=training_step(pv))
        self.wakeup.set()
        final = is_final(pv, self.spec.trainer.max_steps)
        if final:
            self.finished_version = pv.version
        self._spawn(self.evaluator.maybe_eval(pv.version, final=final))


async def assemble(
    job: PipelineRLJob, env: ServiceEnv, stopping: asyncio.Event, wakeup: asyncio.Event, status
) -> Generator:
    """Build what a generator uses and hand it in. On the CPU build the engine comes first, while
    no thread of ours runs (its core process is then forked, not spawned: `engine.core_start_method`;
    it starts in seconds); even the task waits (a dataset task's loader, pyarrow, starts threads).
    On GPUs the health server answers while the model downloads and loads, which can take long
    (the core is then spawned: a fork would copy the server's thread mid-way).
    `status`: what the health server's /status serves until the generator exists."""
    spec = job.spec
    model_path = resolve_model_path(spec.model.path)
    seed = spec.trainer.seed + 1000 * env.rank
    cpu = not spec.generator.gpus
    engine = Engine(job, model_path, seed=seed) if cpu else None
    task = make_task(spec.task.name, spec.task.params, seed=spec.task.seed)
    http = HealthServer("generator", env.http_port, status, env.listen_address).start()
    nc = await join_job(job, env, f"{job.name}-generator-{env.rank}")
    engine = engine or Engine(job, model_path, seed=seed)
    tokenizer = load_tokenizer(model_path)  # prompts are tokenized here; vLLM takes token ids
    check_prompts_fit(spec, task, tokenizer)
    await engine.prepare_updates()  # the staging copy, allocated now: one that does not fit fails here
    admission = await restore_admission(spec, job.subjects, nc.jetstream(), env.rank)
    held = await held_problems(nc.jetstream(), job.subjects, env.rank)
    if held:
        log.info("generator %d draws first the problems it held before: %s", env.rank, ranges_text(held))
    log.info("generator %d assembled (model %s)", env.rank, model_path)
    return Generator(job, env, nc, engine, task, tokenizer, admission, http, stopping, wakeup, held)


def check_prompts_fit(spec: JobSpec, task, tokenizer) -> None:
    """A job whose prompts leave no room for a completion cannot run: say so, by field."""
    errors, warnings = prompt_fit(task, tokenizer, spec.model.max_seq_len, spec.generator.sampling.max_tokens)
    for w in warnings:
        log.warning("spec.%s", w)
    if errors:
        raise SpecError("; ".join(f"spec.{e}" for e in errors))


async def restore_admission(spec: JobSpec, subjects: JobSubjects, js, rank: int) -> Admission:
    """Continue the books of this generator's earlier incarnations (groups published and
    discarded) from its newest group: the newest still in the rollout stream, or the newest
    the preprocessor took, recorded in its micro-batches (`books.restore`, as the preprocessor
    reads them). Groups trained come from the trainer's newest announcement. A group of
    theirs still queued counts as queued. (No problem of theirs is drawn again: problems are
    claimed, `Generator._next_problem`.)"""
    a = Admission(
        groups_per_step=spec.groups_per_step,
        generators=spec.generator_engines,
        max_lag=spec.max_lag,
        max_inflight=spec.generator.max_inflight_groups,
        steps_per_generation=spec.steps_per_generation,
        max_steps=spec.trainer.max_steps,
    )
    queued = None
    data = await last_message(js, subjects.stream("ROLLOUTS"), subjects.rollouts(rank))
    try:
        queued = m.decode(data, m.RolloutGroup).books if data is not None else None
    except m.MessageError as err:  # not ours to trust (it is dead-lettered downstream)
        log.error("the newest message on %s is not ours: %s", subjects.rollouts(rank), err)
    # Not readable (MessageError): raised, as the preprocessor does: books taken from nothing would
    # count every group published as still queued.
    taken = books.restore(await newest_batches(js, subjects, spec.trainer_ranks))
    newest = books.newest_books(queued, taken.generators.get(str(rank)))
    if newest is not None:
        a.published, a.discarded = newest.published, newest.discarded
    announced = await last_announcement(js, subjects)
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
    return a


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    stopping, wakeup = asyncio.Event(), asyncio.Event()
    built: list[Generator] = []

    def status() -> GeneratorStatus:
        return built[0].status() if built else GeneratorStatus(rank=env.rank)

    async def run() -> None:
        built.append(await assemble(job, env, stopping, wakeup, status))
        await built[0].run()

    def stop() -> None:
        stopping.set()
        wakeup.set()

    return serve(run, stop)
