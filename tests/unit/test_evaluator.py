"""Generator 0's held-out evaluations: reports go out in the order the versions were announced,
whichever evaluation ends first (the trainer's best-model candidates count on it)."""

import asyncio

from pipelinerl.spec import parse_job
from pipelinerl_generator.evaluator import Evaluator


def test_a_later_versions_report_waits_for_the_earlier_ones():
    job = parse_job({"metadata": {"name": "ev"}, "spec": {"eval": {"interval": 10}}})
    evaluator = Evaluator(job.spec, 0, job.subjects, None, None, None, None, None)  # type: ignore[arg-type]
    reported: list[tuple[int, bool]] = []
    lasts = {10: 0.3, 20: 0.0, 30: 0.1}  # version 10's evaluation takes longest; 30's weights never come

    async def evaluate(version: int) -> dict | None:
        await asyncio.sleep(lasts[version])
        return None if version == 30 else {"version": version}

    async def report(version: int, final: bool, values: dict) -> None:
        await asyncio.sleep(0.01)
        reported.append((version, final))

    evaluator._evaluate = evaluate  # type: ignore[method-assign]
    evaluator._report = report  # type: ignore[method-assign]

    async def announced() -> None:
        asked = [evaluator.maybe_eval(10), evaluator.maybe_eval(15), evaluator.maybe_eval(20)]
        asked += [evaluator.maybe_eval(30), evaluator.maybe_eval(20, final=True), evaluator.maybe_eval(10)]
        await asyncio.gather(*(asyncio.ensure_future(a) for a in asked))

    asyncio.run(announced())
    assert reported == [(10, False), (20, False), (20, True)]  # 15 not due, 30 not evaluated, 10 once


def test_no_evaluation_at_all_with_interval_0_not_even_the_final_one():
    """eval.interval 0 disables evaluations: the final one held the generator's finish up to
    FINAL_EVAL_WAIT_S for a row nobody waits for (the trainer does not, with interval 0)."""
    job = parse_job({"metadata": {"name": "ev"}, "spec": {"eval": {"interval": 0}}})
    evaluator = Evaluator(job.spec, 0, job.subjects, None, None, None, None, None)  # type: ignore[arg-type]
    evaluated: list[int] = []

    async def evaluate(version: int) -> dict | None:
        evaluated.append(version)
        return None

    evaluator._evaluate = evaluate  # type: ignore[method-assign]
    asyncio.run(evaluator.maybe_eval(0))
    asyncio.run(evaluator.maybe_eval(20, final=True))
    assert evaluated == []
