"""Held-out evaluations, by generator 0: greedy completions of the task's test problems with the
weights of a version, at every `eval.interval` versions and the final one; each version evaluated
once however often asked, each kind of report (periodic, final) published once on the job's
metrics stream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from pipelinerl import messages as m
from pipelinerl.contracts import EVALUATING_GENERATOR, JobSubjects
from pipelinerl.spec import JobSpec
from pipelinerl.streams import publish_once
from pipelinerl.tasks import PromptTooLong
from pipelinerl_generator.engine import Engine
from pipelinerl_generator.metrics import BusyClock

log = logging.getLogger("pipelinerl.generator")


class Evaluator:
    def __init__(
        self, spec: JobSpec, rank: int, subjects: JobSubjects, js, engine: Engine, task, tokenizer, busy: BusyClock
    ) -> None:
        self.spec, self.rank, self.subjects, self.js = spec, rank, subjects, js
        self.engine, self.task, self.tokenizer, self.busy = engine, task, tokenizer, busy
        self.evaluations: dict[int, asyncio.Future] = {}  # version -> its evaluation (shared by reports)
        self.reported: set[tuple[int, bool]] = set()  # (version, final) published
        self.newest: dict | None = None  # the evaluation of the highest version so far (/metrics)
        self.last_report: asyncio.Future | None = None  # done once the report asked for last is out (or given up)

    async def maybe_eval(self, version: int, final: bool = False) -> None:
        """Evaluate `version` at the eval interval and the final one, on generator 0 only (none
        with eval.interval 0: the trainer waits for no final one then)."""
        interval = self.spec.eval.interval
        if self.rank != EVALUATING_GENERATOR or (version, final) in self.reported:
            return
        if interval == 0 or (not final and version % interval):
            return
        self.reported.add((version, final))
        # Reports go out in the order they were asked for (versions as announced), whichever
        # evaluation ends first: the trainer drops every best-model candidate up to a version
        # whose result comes in (`Output.evaluated`), so an earlier one's result coming later
        # would find its candidate gone.
        before, done = self.last_report, asyncio.get_running_loop().create_future()
        self.last_report = done
        try:
            if version not in self.evaluations:
                self.evaluations[version] = asyncio.ensure_future(self._evaluate(version))
            values = await self.evaluations[version]
            if before is not None:
                await asyncio.shield(before)
            if values is not None:
                await self._report(version, final, values)
        finally:
            done.set_result(None)

    async def _report(self, version: int, final: bool, values: dict) -> None:
        if self.newest is None or version >= self.newest["version"]:
            self.newest = values
        log.info(
            "eval at version %d (weights %d-%d): accuracy %.3f%s",
            version,
            values["weights_version_min"],
            values["weights_version_max"],
            values["accuracy"],
            " (final)" if final else "",
        )
        row = m.Metrics(
            source=f"generator-{self.rank}", kind="eval", values=values | {"final": final}, timestamp=time.time()
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
        max_tokens = self.spec.generator.sampling.max_tokens
        self.busy.enter()
        try:
            scored = await asyncio.gather(*[self._scored(p, max_tokens) for p in problems])
        finally:
            self.busy.leave()
        samples = [s for s in scored if s is not None]
        if not samples:
            log.warning("no evaluation of version %d: every held-out prompt is too long for model.maxSeqLen", version)
            return None
        # Updates land while it runs (generation never stops): the weights each token was made
        # with, so a row of `version` is read as what it is, the weights of version..newest.
        made_with = [v for s in samples for v in s.versions if v >= 0] or [version]
        return {
            "version": version,
            "weights_version_min": min(made_with),
            "weights_version_max": max(made_with),
            "accuracy": sum(s.success for s in samples) / len(samples),
            "reward": sum(s.reward for s in samples) / len(samples),
            "problems": len(samples),
            "skipped": len(scored) - len(samples),
            "seconds": time.time() - t0,
        }

    async def _scored(self, problem, max_tokens: int):
        """A held-out problem's greedy sample; None where its prompt is too long (`PromptTooLong`)."""
        try:
            return await self.task.rollout(self.engine, self.tokenizer, problem, max_tokens, greedy=True)
        except PromptTooLong as err:
            log.warning("held-out problem %s skipped: %s", problem.id, err)
            return None
