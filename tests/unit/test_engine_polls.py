"""How the engine polls its workers for work beside generation (a join, a staged transfer): every
worker's answer counts (None: still running; "": done; else why it failed), never the first's
alone; an NCCL engine with tensor parallelism connects its workers' new group in one call; a
call that raises all the same stops a generator of several workers. The
engine core is a stand-in answering per worker; the real one: tests/integration/test_inflight_update.py
(one worker, as the CPU build runs) and test_weight_join.py (the workers' side)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipelinerl.spec import parse_job
from pipelinerl.weight_group import WeightSyncError
from pipelinerl_generator import engine as engine_module
from pipelinerl_generator.engine import Engine, EngineStuck, WorkersOutOfStep


def engine_answering(answers: dict[str, list[list]], backend: str = "gloo", tp: int = 1) -> tuple[Engine, list]:
    """An Engine whose workers answer each method's calls in turn; the calls made, in order."""
    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "polls"},
            "spec": {
                "model": {"path": "Qwen/Qwen2.5-0.5B"},
                "weightSync": {"backend": backend},
                "generator": {"tensorParallel": tp, "gpus": tp},
                "trainer": {"gpus": 1},
            },
        }
    )
    engine = object.__new__(Engine)  # no vLLM: only the calls into the core are under test
    engine.job, engine.rpc_timeout_s = job, 60.0
    calls: list = []

    async def rpc(method: str, *args):
        calls.append((method, *args))
        return answers[method].pop(0) if answers.get(method) else [""] * tp

    engine._rpc = rpc  # type: ignore[method-assign]
    return engine, calls


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(engine_module, "POLL_S", 0.0)


async def test_a_join_waits_for_every_worker_then_connects_them_in_one_call():
    engine, calls = engine_answering({"weight_group_joined": [[None, None], ["", None], ["", ""]]}, "nccl", tp=2)
    await engine.join_weight_group("h", 1, "e1", 1, 3, 30.0, "t")
    assert [c[0] for c in calls] == ["init_weight_group"] + ["weight_group_joined"] * 3 + ["accept_weight_group"]
    assert calls[0][-1] is False  # NCCL with tensor parallelism: connected together, not on the threads


async def test_a_join_connects_on_the_workers_threads_where_it_may():
    engine, calls = engine_answering({}, "gloo", tp=2)
    await engine.join_weight_group("h", 1, "e1", 1, 3, 30.0)
    assert calls[0][-1] is True and calls[-1] == ("accept_weight_group",)


async def test_one_workers_failed_join_fails_the_join_and_connects_nobody():
    failed = "GroupAborted: weight group e1: called off by the trainer"
    engine, calls = engine_answering({"weight_group_joined": [[None, None], ["", failed]]}, tp=2)
    with pytest.raises(WeightSyncError, match="called off by the trainer"):
        await engine.join_weight_group("h", 1, "e1", 1, 3, 30.0)
    assert "accept_weight_group" not in [c[0] for c in calls]


async def test_a_connection_that_fails_fails_the_join():
    engine, _ = engine_answering({"accept_weight_group": [["", "WeightSyncTimeout: no peer"]]}, tp=2)
    with pytest.raises(WeightSyncError, match="no peer"):
        await engine.join_weight_group("h", 1, "e1", 1, 3, 30.0)


async def test_staged_weights_not_ready_by_the_deadline_time_out_naming_the_setting():
    engine, calls = engine_answering({"staged_weights_ready": [["", None]] * 3})
    with pytest.raises(TimeoutError, match="not received and loaded within weightSync.timeoutSeconds"):
        await engine._wait_staged(deadline=0.0)
    assert [c[0] for c in calls] == ["staged_weights_ready"]


@pytest.mark.parametrize("tp", [1, 2])
async def test_a_worker_call_that_raises_with_several_workers_stops_the_generator(tp):
    """vLLM's multiprocess executor reads no further answers once one worker's says it raised:
    the others' then answer the calls that follow. The engine stops (EngineStuck), where one
    worker (the one-worker executor) raises as any call."""
    engine, _ = engine_answering({}, tp=tp)

    async def collective_rpc(method, args=()):
        raise Exception("Worker failed with error 'TimeoutError: an abandoned transfer'")

    engine.llm = SimpleNamespace(collective_rpc=collective_rpc)
    del engine._rpc  # the real one, over the stand-in core
    with pytest.raises(WorkersOutOfStep if tp > 1 else Exception, match="an abandoned transfer") as err:
        await engine._rpc("init_weight_group")
    assert isinstance(err.value, EngineStuck) == (tp > 1)


async def test_workers_that_can_take_no_weights_stop_the_generator():
    cannot = "TimeoutError: an abandoned weight update still receives after 60 s"
    engine, calls = engine_answering({"init_weight_group": [["", cannot]]}, tp=2)
    with pytest.raises(EngineStuck, match="can take no weights: TimeoutError: an abandoned"):
        await engine.join_weight_group("h", 1, "e1", 1, 3, 30.0)
    assert [c[0] for c in calls] == ["init_weight_group"]
