"""A trainer of two ranks (two pods) when one of them stops answering: `pipelinerl run` in its own
process, one rank's whole process group frozen with SIGSTOP (a node that stops answering keeps
its connections open, so no collective fails), restarted by the runner's policy as Kubernetes
restarts a pod. Without the ranks' watch (pipelinerl_trainer.peers) rank 0 waited in DeepSpeed's
gradient all-reduce past the run's 900 s deadline (that group has torch's default timeout, 30
minutes for gloo); with it, rank 0 ends within `weightSync.timeoutSeconds`, the frozen rank,
thawed, finds its gang gone and ends too, and both resume from the checkpoint together: the steps
after it are trained once more from the same stored micro-batches, nothing lost."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from faults import SAMPLES, audit_streams, fault_job  # tests/e2e/faults.py
from jobs import RUN_TIMEOUT_S  # tests/e2e/jobs.py

pytestmark = pytest.mark.slow

TIMEOUT_S = 10  # weightSync.timeoutSeconds: the bound on a silent rank


def test_a_frozen_trainer_rank_ends_its_gang_which_resumes_together_from_the_checkpoint(start_run):
    steps, name = 16, "rank"
    job = fault_job(
        name, steps, trainer={"replicas": 2, "checkpointInterval": 4}, weightSync={"timeoutSeconds": TIMEOUT_S}
    )
    run = start_run(job, RUN_TIMEOUT_S)
    run.wait_step(6)
    frozen = run.services()["trainer-1"]["pid"]
    os.killpg(frozen, signal.SIGSTOP)
    t0, at = time.monotonic(), run.train()[-1]["step"]
    try:
        run.wait_until(lambda _: run.services()["trainer-0"]["restarts"] == 1, "rank 0 ended by its watch")
        waited = time.monotonic() - t0
    finally:
        os.killpg(frozen, signal.SIGCONT)  # the node answers again
    # Within the bound (and a beat, and the runner's look), not torch's default timeout.
    assert TIMEOUT_S - 2 <= waited <= TIMEOUT_S + 15, waited
    run.finish()

    train = run.train()
    logs = [(run.dir / f"logs/trainer-{r}.log").read_text() for r in (0, 1)]
    assert f"trainer rank 1 said nothing for {TIMEOUT_S} s" in logs[0]
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", "".join(logs))]
    assert len(resumed) == 2 and len(set(resumed)) == 1, resumed  # both ranks, from the same checkpoint
    resumed_at = resumed[0]
    assert resumed_at % 4 == 0 and 4 <= resumed_at <= at
    # The first gang's rows up to where it stopped, then the new gang's from the checkpoint: each
    # step once, full.
    second = train[len(train) - (steps - resumed_at) :]
    first = train[: len(train) - len(second)]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= at
    assert [r["step"] for r in second] == list(range(resumed_at + 1, steps + 1))
    assert all(r["samples"] == SAMPLES for r in train)
    assert all(r["lag_max"] <= 1 for r in train) and sum(r["dropped_for_lag"] for r in train) == 0
    # The streams: every step once per rank, whole; each group trained in one step only.
    audit_streams(run, name, steps, 2)
    restarts = {n: s["restarts"] for n, s in run.services().items()}
    # The frozen rank, thawed, found its gang gone and ended too (restarted once); nothing else did.
    assert restarts == {"trainer-0": 1, "trainer-1": 1, "preprocessor": 0, "generator": 0, "nats-server": 0}, restarts


def test_a_drained_trainer_rank_stops_its_gang_with_every_step_kept(start_run):
    """One trainer pod drained (SIGTERM to rank 1 only): rank 1 says so in the ranks' store, the
    ranks vote before each micro-batch and stop at the same one, and both write the stop
    checkpoint of the step they reached (with no interval checkpoint, the run would otherwise go
    back to step 0). Both exit STOPPED_EXIT and are started again by the runner, as a drained
    pod is made again and its peers restart: the gang resumes from the stop checkpoint, every
    step trained once, nothing lost."""
    steps, name = 12, "drain"
    trainer = {"replicas": 2, "checkpointInterval": 0, "microBatchTokens": 128}  # several micro-batches a step
    job = fault_job(name, steps, trainer=trainer, weightSync={"timeoutSeconds": TIMEOUT_S})
    run = start_run(job, RUN_TIMEOUT_S)
    run.wait_step(4)
    os.kill(run.services()["trainer-1"]["pid"], signal.SIGTERM)
    run.finish()

    logs = [(run.dir / f"logs/trainer-{r}.log").read_text() for r in (0, 1)]
    stopped_at = [[int(s) for s in re.findall(r"stopping: checkpointing step (\d+)", log)] for log in logs]
    assert stopped_at[0] == stopped_at[1] and len(stopped_at[0]) == 1, stopped_at
    (at,) = stopped_at[0]
    assert at >= 4
    assert "another rank was asked to" in logs[0] and "this rank was asked to" in logs[1]
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", "".join(logs))]
    assert resumed == [at, at], resumed  # both ranks, from the stop checkpoint
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # each step once
    assert all(r["samples"] == SAMPLES for r in train)
    audit_streams(run, name, steps, 2)
    restarts = {n: s["restarts"] for n, s in run.services().items()}
    assert restarts == {"trainer-0": 1, "trainer-1": 1, "preprocessor": 0, "generator": 0, "nats-server": 0}, restarts
    assert "stopped with its gang, its checkpoint written" in (run.dir.parent / "run.out").read_text()
