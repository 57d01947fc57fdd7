"""The conventional baseline with k optimizer steps per generation phase (`mode: sync`,
`rl.stepsPerGeneration: 4`), end to end through `pipelinerl run`: each phase is generated whole
on the weights of its first step, the trainer takes 4 steps on consecutive mini-batches of it
(step j of the phase at lag j, importance-weighted), and the weights go out once per phase."""

import json

import pytest

from jobs import stored, tiny_job  # tests/e2e/jobs.py

from pipelinerl import messages as m
from pipelinerl_cli.local import run_local
from pipelinerl.spec import parse_job

pytestmark = pytest.mark.slow

K, STEPS, SAMPLES = 4, 8, 32  # two phases


def test_conventional_rl_takes_k_steps_on_each_generation_phase(tmp_path):
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
    assert run_local(parse_job(job), tmp_path, quiet=True) == 0, (tmp_path / "logs" / "trainer.log").read_text()[-3000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))

    # Step s (1-based) is step j = (s - 1) % K of its phase and trains every token at lag j.
    for r in train:
        j = (r["step"] - 1) % K
        assert (r["lag_min"], r["lag_max"]) == (j, j), r
        assert r["samples"] == SAMPLES and r["dropped_for_lag"] == 0
        # The weights go out once per phase, after its last step.
        assert (r["weight_sync_seconds"] > 0) == (j == K - 1), r
    # On-policy at the first step of each phase; the later ones are corrected for the drift.
    first = [r["ess"] for r in train if (r["step"] - 1) % K == 0]
    last = [r["ess"] for r in train if (r["step"] - 1) % K == K - 1]
    assert all(e == pytest.approx(1.0, abs=1e-3) for e in first)
    assert max(last) < 0.999

    # What each micro-batch held: the phase's version on every token, the step's samples in full.
    batches = [m.decode(msg.data, m.MicroBatch) for msg in stored(tmp_path, "conv", "BATCHES")]
    by_step: dict[int, list[m.MicroBatch]] = {}
    for mb in batches:
        by_step.setdefault(mb.step, []).append(mb)
    assert sorted(by_step) == list(range(STEPS))
    for step, mbs in by_step.items():
        phase = step - step % K
        generated = {v for mb in mbs for v, trained in zip(mb.versions, mb.mask) if trained}
        assert generated == {phase}, step  # so the step trains them at lag step - phase
        assert sum(len(mb.lengths) for mb in mbs) == SAMPLES
        trained = next(r for r in train if r["step"] == step + 1)
        assert trained["tokens"] == sum(sum(mb.mask) for mb in mbs)

    evals = [r for r in map(json.loads, lines) if r["kind"] == "eval"]
    assert {r["version"] for r in evals} >= {0, K, STEPS}  # only versions the generator holds
