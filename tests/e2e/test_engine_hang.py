"""A generator whose vLLM engine hangs while its process goes on, in a running job (`pipelinerl
run` in its own process, as tests/e2e/test_faults.py; a file of its own so that pytest's workers
can run it beside that one)."""

from __future__ import annotations

import pytest
from faults import SAMPLES, changes, fault_job, groups_from, stall_engine  # tests/e2e/faults.py
from jobs import RUN_TIMEOUT_S  # tests/e2e/jobs.py

pytestmark = pytest.mark.slow


def test_a_generator_whose_engine_hangs_is_left_out_and_the_other_trains_on_until_it_answers(start_run):
    """Only generator-1's vLLM engine core stops (a hung kernel, a device that stopped answering):
    its process still answers and says hello, and the update it was applying, or its liveness
    check between updates, runs past the deadline. The trainer drops it and invites it to no new
    epoch while its hellos say its engine does not answer, and generator-0 counts it gone:
    generator-0 alone feeds the trainer. (A stall between updates held generator-0's admission
    with generator-1's old groups in flight, and nothing trained: the rehearsal of 2026-12-07.) Once
    the core answers again, the same process joins a newer epoch of two and feeds steps. (Before:
    the trainer invited it to each new epoch and waited out the join windows, no generator got
    weights, generator-0's admission waited on the stuck one's old groups: nothing trained until
    the core came back, or the generator stopped itself, 2 x timeout + 30 s later.)"""
    timeout_s = 6.0
    job = fault_job("hang", 1000, generator={"replicas": 2}, weightSync={"timeoutSeconds": timeout_s})
    run = start_run(job, RUN_TIMEOUT_S)
    run.wait_until(lambda t: any(groups_from(r, 1) > 0 for r in t), "a step fed by generator-1")
    hung_at, epoch = run.train()[-1]["step"], run.train()[-1]["weight_epoch"]
    pid = run.services()["generator-1"]["pid"]

    def alone(train: list[dict]) -> list[int]:
        """Fed by generator-0 alone, in an epoch of it alone (groups generator-1 published before it
        hung may still be trained meanwhile: those steps do not count)."""
        return [
            r["step"]
            for r in train
            if r["step"] > hung_at
            and r["weight_epoch"] > epoch
            and r["generators_in_group"] == 1
            and not groups_from(r, 1)
        ]

    # Five steps: the stall is capped at 32 s (`stall_engine`), which a loaded machine's hang detection
    # and slower steps of one generator share.
    stall_engine(run, "generator-1", lambda: len(alone(run.train())) >= 5, weight_sync_timeout_s=timeout_s)
    train = run.train()
    assert len(alone(train)) >= 5, f"hung after step {hung_at} in epoch {epoch}; changes: {changes(train)}"
    trainer_log = (run.dir / "logs" / "trainer.log").read_text()
    assert "generator 1's engine has not answered for " in trainer_log
    back = max(r["weight_epoch"] for r in train)
    run.wait_until(
        lambda t: (
            sum(r["weight_epoch"] > back and r["generators_in_group"] == 2 and groups_from(r, 1) > 0 for r in t) >= 2
        ),
        "two steps fed by generator-1 again, in an epoch of two",
        lambda t: f"changes: {changes(t)}",
    )
    run.stop()
    assert (
        "generator 1: its engine answers again, it joins the next epoch"
        in (run.dir / "logs" / "trainer.log").read_text()
    )
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)
    services = run.services()  # the same processes throughout
    assert services["generator-1"]["pid"] == pid and services["generator-1"]["restarts"] == 0
    assert services["generator-0"]["restarts"] == 0 and services["trainer"]["restarts"] == 0
