"""No single message stops a job: bad rollout groups published into a running job's stream
(with the project's own codec, as a buggy task or environment would) are dead-lettered with
their reason, and the run goes on and finishes every step."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from jobs import stored, tiny_job  # tests/e2e/jobs.py

from bench.run_process import RunProcess
from pipelinerl import messages as m
from pipelinerl.contracts import DEADLETTER_REASON, JobSubjects
from pipelinerl.streams import connect, last_message

pytestmark = pytest.mark.slow
STEPS = 16  # room for more copies of the vocab group
FORGER = 7  # no such generator: the forged groups' credit cannot disturb a real one's admission


def group(gid: str, **change) -> m.RolloutGroup:
    sample = m.Sample(
        tokens=[5, 6, 7, 8], mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.7], versions=[-1, -1, 0, 0], reward=1.0
    )
    return m.RolloutGroup(
        group_id=gid,
        generator=FORGER,
        samples=[sample.model_copy(update=change), sample.model_copy(update={"reward": 0.0})],
    )


POISON = {  # group id: (message, the start of the reason it is dead-lettered for)
    "nan-reward": (
        group("nan-reward", reward=float("nan")),
        "group nan-reward from generator 7: sample 0: reward is nan",
    ),
    "too-long": (
        group("too-long", tokens=[5] * 41, mask=[0] * 40 + [1], logprobs=[0.0] * 41, versions=[-1] * 40 + [0]),
        "group too-long from generator 7: sample 0: 41 tokens, more than model.maxSeqLen (40)",
    ),
    "future": (
        group("future", versions=[-1, -1, 0, 1_000_000]),
        "group future from generator 7: sample 0: version 1000000 at token 3 is ahead of the trainer",
    ),
    "nan-logprob": (
        group("nan-logprob", logprobs=[0.0, 0.0, float("nan"), -0.7]),
        "group nan-logprob from generator 7: sample 0: logprob nan at token 2",
    ),
}


def test_poison_rollouts_are_dead_lettered_and_the_job_finishes(tmp_path, capsys):
    job = tiny_job("poison", trainer={"maxSteps": STEPS}, eval={"interval": 0}, rl={"maxLag": 3})
    run = RunProcess(tmp_path, job, timeout_s=300)
    run.wait_step(2)
    subjects = JobSubjects("poison")

    async def publish(vocab: str | None = None) -> None:
        nc = await connect(run.services()["nats-server"]["url"], "forger")
        js = nc.jetstream()
        if vocab is None:
            for gid, (msg, _) in POISON.items():
                await js.publish(subjects.rollouts(FORGER), m.encode(msg), headers={"Nats-Msg-Id": gid})
            await js.publish(subjects.rollouts(FORGER), b"\x93not msgpack")
        else:  # sound to the preprocessor, and as fresh as the real groups arriving with it
            announced = await last_message(js, subjects.stream("CONTROL"), subjects.version)
            # Weights v + 1 exist once v is announced (sent before); the pause lets the
            # preprocessor see the announcement too, or v + 1 would be ahead of the trainer.
            await asyncio.sleep(0.3)
            v = m.decode(announced, m.PolicyVersion).version + 1
            await js.publish(
                subjects.rollouts(FORGER),
                m.encode(group(vocab, tokens=[5, 6, 10**6, 8], versions=[-1, -1, v, v])),
                headers={"Nats-Msg-Id": vocab},
            )
        await nc.close()

    asyncio.run(publish())
    # A token the model has no embedding for: the trainer's check. The group queues behind the
    # real generator's and may come too old to the step it would go into: then it is dropped
    # as stale (not dead-lettered), and a fresh copy is sent until one is trained.
    logs = run.dir / "logs"
    for attempt in range(5):
        vocab = f"vocab-{attempt}"
        asyncio.run(publish(vocab))
        deadline = time.monotonic() + 60
        while f"(group {vocab})" not in (logs / "trainer.log").read_text():
            if f"group {vocab} from generator {FORGER}: too old" in (logs / "preprocessor.log").read_text():
                break
            assert time.monotonic() < deadline, f"{vocab}: neither trained nor dropped as stale in 60 s"
            time.sleep(0.2)
        else:
            break
    else:
        raise AssertionError("5 copies of the vocab group in a row came too old to their step")
    run.finish()  # exit 0: every step trained, and the newest ones learn
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["tokens"] > 0 for r in train)  # the step with the bad sample trained the others
    assert sum(r["samples_rejected"] for r in train) == 1
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["samples_rejected"] == 1 and summary["learning_alarm"] is None

    letters = stored(run.dir, "poison", "DEADLETTER")
    rollouts = [x for x in letters if x.subject == subjects.deadletter("rollout")]
    reasons = sorted(x.headers[DEADLETTER_REASON] for x in rollouts)
    assert len(reasons) == len(POISON) + 1  # each once, however often it was seen
    for gid, (_, expected) in POISON.items():
        assert any(r.startswith(expected) for r in reasons), (gid, reasons)
    assert any(r.startswith("rollout_group: not valid msgpack") for r in reasons)
    (batch,) = [x for x in letters if x.subject == subjects.deadletter("batch")]
    assert f"(group {vocab}): token id 1000000 is outside the model's vocabulary" in batch.headers[DEADLETTER_REASON]
    assert 10**6 in m.decode(batch.data, m.MicroBatch).tokens  # the micro-batch as it came, for inspection
    # `pipelinerl dead-letters` lists them for the user, reasons first.
    from pipelinerl_cli.main import main

    assert main(["dead-letters", str(tmp_path / "job.yaml"), "--run-dir", str(run.dir)]) == 0
    listed = capsys.readouterr()
    assert "6 dead letter(s) for job 'poison'" in listed.err
    assert " rollout: group nan-reward from generator 7: sample 0: reward is nan" in listed.out
    assert " batch: sample " in listed.out
    pre = (run.dir / "logs" / "preprocessor.log").read_text()
    assert pre.count("dead-lettered") == len(POISON) + 1 and "Traceback" not in pre
