"""The preprocessor service against a real nats-server: filtering, packing per rank, acking
only after publishing, backpressure from the trainer's version, malformed input."""

import asyncio
import time

from pipelinerl import messages as m
from pipelinerl.services import ServiceEnv
from pipelinerl.spec import parse_job
from pipelinerl.streams import JobSubjects, connect, ensure_streams
from pipelinerl_preprocessor.main import Preprocessor


def rollout(i: int, rewards: list[float]) -> m.RolloutGroup:
    samples = [m.Sample(tokens=[3, 4, 5, 1], mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1], versions=[-1, -1, 0, 0],
                        reward=r) for r in rewards]
    return m.RolloutGroup(group_id=f"g{i}", problem_id=f"p{i}", generator=i % 2, samples=samples, start_version=0)


async def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_preprocessor_service(nats_server, tmp_path):
    job = parse_job({"metadata": {"name": "pp"}, "spec": {
        "rl": {"attempts": 2}, "trainer": {"replicas": 2, "samplesPerStep": 4, "microBatchTokens": 64},
        "preprocessor": {"maxPendingSteps": 1}}})
    subjects = JobSubjects("pp")
    env = ServiceEnv(role="preprocessor", rank=0, world_size=1, nats_url=nats_server.url, weights_host="",
                     weights_port=0, run_dir=tmp_path, http_port=0, generators=2)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, subjects, 8)
    groups = [rollout(0, [1, 0]), rollout(1, [1, 1]), rollout(2, [0, 1]), rollout(3, [1, 0]), rollout(4, [0, 1]),
              rollout(5, [1, 0])]
    for g in groups:
        await js.publish(subjects.rollouts, m.encode(g), headers={"Nats-Msg-Id": g.group_id})
    await js.publish(subjects.rollouts, b"\x93garbage")

    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    await wait_until(lambda: pre.step == 1 and pre.stats["malformed"] == 1 and pre.stats["filteredGroups"] == 1)
    await asyncio.sleep(0.5)
    assert pre.step == 1  # backpressure: trainer at version 0, one pending step allowed
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=1, step=1, timestamp=0)))
    await wait_until(lambda: pre.step == 2)
    assert len(pre.accepted) == 1  # the fifth signal-carrying group waits for a full step

    per_rank = {}
    for rank in (0, 1):
        sub = await js.pull_subscribe(subjects.batches(rank), durable=f"r{rank}")
        per_rank[rank] = [m.decode(x.data, m.MicroBatch) for x in await sub.fetch(10, timeout=2)]
    for rank in (0, 1):
        steps = [b.step for b in per_rank[rank]]
        assert steps == sorted(steps) and set(steps) == {0, 1}
    for step in (0, 1):
        counts = {b.count for r in (0, 1) for b in per_rank[r] if b.step == step}
        assert len(counts) == 1  # same number of micro-batches on every rank
        real = [b for r in (0, 1) for b in per_rank[r] if b.step == step and not b.is_sentinel]
        assert sum(len(b.rewards) for b in real) == 4
        advs = [a for b in real for a, msk in zip(b.advantages, b.mask) if msk]
        assert sorted(set(advs)) == [-1.0, 1.0]  # leave-one-out on rewards {1, 0}
        first = next(b for r in (0, 1) for b in per_rank[r] if b.step == step)
        assert sum(first.step_groups_by_generator.values()) == 2
    # Acked inputs are gone from the work queue; the waiting group is still held (unacked).
    info = await js.consumer_info(subjects.stream("ROLLOUTS"), "preprocessor")
    assert info.num_ack_pending == 1 and info.num_pending == 0
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()
