"""The generator's weight follower (pure control flow; the engine is a stand-in with the
`Engine` calls it makes, the real one is exercised by tests/integration/test_inflight_update.py):
a join that fails waits for the trainer's next epoch, an engine whose core is blocked stops
the generator."""

import pytest

from pipelinerl import messages as m
from pipelinerl.admission import Admission
from pipelinerl.contracts import ServiceEnv
from pipelinerl.spec import parse_job
from pipelinerl_generator.engine import EngineStuck
from pipelinerl_generator.weight_follower import WeightFollower

JOB = parse_job({"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": "wf"}})


class Joining:
    """The engine's `join_weight_group`, raising `error`."""

    def __init__(self, error: BaseException | None) -> None:
        self.error, self.joined = error, []

    async def join_weight_group(self, *args) -> None:
        if self.error is not None:
            raise self.error
        self.joined.append(args)


def follower(engine) -> WeightFollower:
    spec = JOB.spec
    admission = Admission(
        groups_per_step=spec.groups_per_step,
        generators=1,
        max_lag=spec.max_lag,
        max_inflight=spec.generator.max_inflight_groups,
    )
    return WeightFollower(spec, ServiceEnv(role="generator"), JOB.subjects, None, engine, admission, print, print)


def update(f: WeightFollower) -> m.WeightUpdate:
    return m.WeightUpdate(version=1, buckets=[], group="epoch-1", members=[(0, f.incarnation)])


async def test_a_join_that_fails_waits_for_the_next_epoch():
    f = follower(Joining(TimeoutError("the trainer called the epoch off")))
    assert await f._join(update(f)) is False and f.group is None


async def test_a_join_the_engine_never_answers_stops_the_generator():
    f = follower(Joining(EngineStuck("the engine did not answer init_weight_group within 270 s")))
    with pytest.raises(EngineStuck, match="init_weight_group"):
        await f._join(update(f))


async def test_a_join_that_succeeds_takes_the_epoch_and_its_rank():
    engine = Joining(None)
    f = follower(engine)
    assert await f._join(update(f)) is True and f.group == "epoch-1"
    assert engine.joined[0][2:4] == ("epoch-1", 1)  # rank 1: the trainer holds 0


async def test_an_engine_that_does_not_answer_a_liveness_check_is_busy_and_past_the_deadline_stuck():
    """A core stalled between updates: its unanswered liveness check counts as busy, so its
    hellos say it is stuck past weightSync.timeoutSeconds, as one stalled in an update (before,
    only an update counted: its groups in flight held its peers' admission until it gave up)."""
    import asyncio

    class Stalled:
        answer = asyncio.Event()

        async def check_alive(self) -> None:
            await self.answer.wait()

    engine = Stalled()
    f = follower(engine)
    assert f.busy_seconds() == 0.0
    check = asyncio.create_task(f.check_engine())
    await asyncio.sleep(0.3)
    busy = f.busy_seconds()
    assert busy >= 0.25
    hello = m.GeneratorHello(generator=1, incarnation="i", version=3, busy_seconds=busy)
    assert hello.stuck(0.2) and not hello.stuck(10.0)
    engine.answer.set()
    await check
    assert f.busy_seconds() == 0.0
