"""The conventional baseline with k optimizer steps per generation phase (`mode: sync`,
`rl.stepsPerGeneration: 4`), end to end through `pipelinerl run`: each phase is generated whole
on the weights of its first step, the trainer takes 4 steps on consecutive mini-batches of it
(step j of the phase at lag j, importance-weighted), and the weights go out once per phase.

The run is stopped in its second phase (SIGHUP, its terminal closed, stopping it as SIGTERM and Ctrl-C do) and run
again: the trainer checkpoints the step it reached before it exits, and the run goes on from
there, the rest of that phase from its stored micro-batches at the lags they had."""

import json
import math
import signal

import pytest

from jobs import RUN_TIMEOUT_S, stored, tiny_job  # tests/e2e/jobs.py

from pipelinerl import messages as m
from pipelinerl.phases import decomposition

pytestmark = pytest.mark.slow

K, STEPS, SAMPLES = 4, 12, 32  # three phases


def test_conventional_rl_takes_k_steps_on_each_generation_phase_and_resumes_a_stopped_run(start_run):
    # The warm-started model: its samples earn rewards, so the policy moves within a phase and
    # the later steps of a phase are really off-policy.
    job = tiny_job(
        "conv",
        mode="sync",
        model={"path": "builtin:tiny-arith", "maxSeqLen": 32},
        task={"name": "arith", "params": {"digits": 3, "carry_out": False}},
        rl={"stepsPerGeneration": K, "attempts": 8, "filterZeroVariance": True, "importanceWeights": "sequence"},
        generator={"sampling": {"maxTokens": 8}},
        trainer={"samplesPerStep": SAMPLES, "maxSteps": STEPS, "learningRate": 3e-4, "microBatchTokens": 128},
        eval={"interval": K, "problems": 64},
    )
    first = start_run(job, timeout_s=RUN_TIMEOUT_S)
    first.wait_step(K + 1)  # in the second phase (its steps take ~0.3 s: the stop most likely lands in it)
    first.stop(signal.SIGHUP)  # its terminal closed: stopped as SIGTERM and Ctrl-C stop it
    run_dir = first.dir.resolve()
    assert f"pipelinerl run {run_dir / 'job.yaml'} --run-dir {run_dir}" in first.output()  # how to go on
    seen = len(first.train())
    # The trainer may finish a step after the runner stopped listening (its row then read by the
    # next run, from the stream): at least every step seen.
    checkpointed = int((first.dir / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert checkpointed >= seen  # no interval checkpoint came (checkpointInterval 0): the stop's
    assert f"stopping: checkpointing step {checkpointed}" in (first.dir / "logs" / "trainer.log").read_text()

    second = start_run(job, timeout_s=RUN_TIMEOUT_S)
    second.finish()
    train = second.train()  # the first run's rows, then the second's
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # every step's row once: none lost, none repeated
    assert [r["seq"] for r in train] == sorted({r["seq"] for r in train})  # in the stream's order

    # Step s (1-based) is step j = (s - 1) % K of its phase and trains every token at lag j,
    # resumed or not.
    for r in train:
        j = (r["step"] - 1) % K
        assert (r["lag_min"], r["lag_max"]) == (j, j), r
        assert r["samples"] == SAMPLES and r["dropped_for_lag"] == 0
        # The weights go out once per phase, after its last step.
        assert (r["weight_sync_seconds"] > 0) == (j == K - 1), r
    # On-policy at the first step of each phase; the later ones are corrected for the drift.
    first_steps = [r["ess"] for r in train if (r["step"] - 1) % K == 0]
    last_steps = [r["ess"] for r in train if (r["step"] - 1) % K == K - 1]
    assert all(e == pytest.approx(1.0, abs=1e-3) for e in first_steps)
    assert max(last_steps) < 0.999

    # What each micro-batch held: the phase's version on every token, the step's samples in full,
    # each step once (the stopped preprocessor's successor went on where it was).
    batches = [m.decode(msg.data, m.MicroBatch) for msg in stored(second.dir, "conv", "BATCHES")]
    by_step: dict[int, list[m.MicroBatch]] = {}
    for mb in batches:
        by_step.setdefault(mb.step, []).append(mb)
    assert sorted(by_step) == list(range(STEPS))
    for step, mbs in by_step.items():
        phase = step - step % K
        generated = {v for mb in mbs for v, trained in zip(mb.versions, mb.mask) if trained}
        assert generated == {phase}, step  # so the step trains them at lag step - phase
        assert sum(len(mb.lengths) for mb in mbs) == SAMPLES
        for trained in (r for r in train if r["step"] == step + 1):
            assert trained["tokens"] == sum(sum(mb.mask) for mb in mbs)

    # Where the phases' time went: generating (the trainer waiting), training, the update (each
    # run's rows on its own clock; a run's first phase, holding its start-up, left out).
    phases = decomposition(train[:seen], K)
    assert phases["steps_per_phase"] == K and phases["phases"] >= 1
    assert phases["wait_seconds"] > 0 and phases["tokens_per_wait_second"] > 0
    assert phases["wait_share"] + phases["train_share"] + phases["update_share"] == pytest.approx(1.0)
    summary = json.loads((second.dir / "summary.json").read_text())
    # (the second run's own rows: those it read of the first, published as it stopped, came before its start)
    assert summary["phases"] == decomposition([r for r in train[seen:] if r["time"] >= 0], K)

    lines = (second.dir / "metrics.jsonl").read_text().splitlines()
    versions = {r["version"] for r in map(json.loads, lines) if r["kind"] == "eval"}
    # The second run's generator got its first weights at the end of the phase it was stopped in
    # (or at once, stopped at a phase's end): it evaluated them.
    assert {0, K * math.ceil(checkpointed / K), STEPS} <= versions, (checkpointed, versions)
