"""The preprocessor service against a real nats-server: filtering, packing per rank, acking
only after publishing, backpressure from the trainer's version, malformed input."""

import asyncio
import time

import pytest

from pipelinerl import messages as m
from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl.spec import parse_job
from pipelinerl.streams import connect, stored_messages
from pipelinerl.store import ensure_streams
from pipelinerl_preprocessor.main import Preprocessor


def rollout(i: int, rewards: list[float]) -> m.RolloutGroup:
    samples = [
        m.Sample(tokens=[3, 4, 5, 1], mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1], versions=[-1, -1, 0, 0], reward=r)
        for r in rewards
    ]
    return m.RolloutGroup(group_id=f"g{i}", generator=i % 2, samples=samples)


async def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


# Pipeline mode with rows of 16 tokens and 4 groups of 8 tokens a step: a step leaves in waves.
WAVES = {
    "model": {"maxSeqLen": 8},
    "generator": {"sampling": {"maxTokens": 4}},
    "rl": {"attempts": 2},
    "trainer": {"samplesPerStep": 8, "microBatchTokens": 16},
}


async def publish_group(js, subjects, i: int) -> None:
    """Group g<i> from generator 0, rewards 1 and 0."""
    await js.publish(subjects.rollouts(0), m.encode(rollout(i, [1, 0])), headers={"Nats-Msg-Id": f"g{i}"})


async def all_acknowledged(js, subjects, timeout_s: float = 5.0) -> None:
    """Until the preprocessor holds nothing unacknowledged and nothing waits for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = await js.consumer_info(subjects.stream("ROLLOUTS"), "preprocessor")
        if info.num_ack_pending == info.num_pending == 0:
            return
        assert time.monotonic() < deadline, f"{info.num_ack_pending} held, {info.num_pending} waiting"
        await asyncio.sleep(0.1)


async def one_step(out, timeout: float = 10.0) -> list[m.MicroBatch]:
    """The micro-batches of the next step on `out` (rank 0's), up to its last."""
    got = [m.decode((await out.fetch(1, timeout=timeout))[0].data, m.MicroBatch)]
    while not got[-1].last:
        got.append(m.decode((await out.fetch(1, timeout=10))[0].data, m.MicroBatch))
    return got


async def start(nats_server, tmp_path, name: str, spec: dict):
    """The job, the preprocessor's environment, and a JetStream client with the job's streams."""
    job = parse_job({"metadata": {"name": name}, "spec": spec})
    env = ServiceEnv("preprocessor", nats_url=nats_server.url, run_dir=tmp_path, http_port=0)
    subjects = JobSubjects(name)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, subjects, 8)
    return job, env, nc, js, subjects


async def test_preprocessor_service(nats_server, tmp_path):
    job, env, nc, js, subjects = await start(
        nats_server,
        tmp_path,
        "pp",
        {
            "rl": {"attempts": 2},
            "trainer": {"replicas": 2, "samplesPerStep": 4, "microBatchTokens": 64},
            "preprocessor": {"maxPendingSteps": 1},
        },
    )
    groups = [
        rollout(0, [1, 0]),
        rollout(1, [1, 1]),
        rollout(2, [0, 1]),
        rollout(3, [1, 0]),
        rollout(4, [0, 1]),
        rollout(5, [1, 0]),
    ]
    for g in groups:
        await js.publish(subjects.rollouts(g.generator), m.encode(g), headers={"Nats-Msg-Id": g.group_id})
    await js.publish(subjects.rollouts(0), b"\x93garbage")

    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    await wait_until(
        lambda: pre.builder.step == 1 and pre.stats["malformed"] == 1 and pre.stats["filtered_groups"] == 1
    )
    await asyncio.sleep(0.5)
    assert pre.builder.step == 1  # backpressure: trainer at version 0, one pending step allowed
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=1, timestamp=0)))
    await wait_until(lambda: pre.builder.step == 2)
    assert len(pre.builder.accepted) == 1  # the fifth signal-carrying group waits for a full step

    per_rank = {}
    for rank in (0, 1):
        sub = await js.pull_subscribe(subjects.batches(rank), durable=f"r{rank}")
        per_rank[rank] = [m.decode(x.data, m.MicroBatch) for x in await sub.fetch(10, timeout=2)]
    for rank in (0, 1):
        steps = [b.step for b in per_rank[rank]]
        assert steps == sorted(steps) and set(steps) == {0, 1}
    for step in (0, 1):
        counts = {len([b for b in per_rank[r] if b.step == step]) for r in (0, 1)}
        assert len(counts) == 1  # same number of micro-batches on every rank
        assert all([b.last for b in per_rank[r] if b.step == step][-1] for r in (0, 1))
        real = [b for r in (0, 1) for b in per_rank[r] if b.step == step and not b.is_sentinel]
        assert sum(len(b.rewards) for b in real) == 4
        advs = [a for b in real for a, msk in zip(b.advantages, b.mask) if msk]
        assert sorted(set(advs)) == [-1.0, 1.0]  # leave-one-out on rewards {1, 0}
        final = next(b for b in per_rank[0] if b.step == step and b.last)
        assert sum(final.ledger.credits.values()) == 2
        # The policy's reward: step 0 took g1 (1, 1) too, filtered, beside two groups of 1 and 0.
        assert final.ledger.sampled_reward == (4 / 6 if step == 0 else 1 / 2)
    # Acked inputs are gone from the work queue; the waiting group is still held (unacked).
    info = await js.consumer_info(subjects.stream("ROLLOUTS"), "preprocessor")
    assert info.num_ack_pending == 1 and info.num_pending == 0
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_steps_stream_in_waves_and_a_restart_continues_a_partial_step(nats_server, tmp_path):
    """Pipeline mode: micro-batches leave before their step is complete; a preprocessor stopped
    between two waves is followed by one that continues that step where it was, with the group
    its predecessor held (handed back) and the next ones: the step is whole, not closed short."""
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "pw", WAVES)
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=5, timestamp=0)))  # no backpressure
    out = await js.pull_subscribe(subjects.batches(0), durable="t")

    async def batches(n):
        got = []
        while len(got) < n:
            got += [m.decode(x.data, m.MicroBatch) for x in await out.fetch(n - len(got), timeout=5)]
        return got

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    # 4 groups of 8 tokens per step, rows of 16: a wave leaves once 2 groups are pending (the
    # first of them: a second one would not be sure to fit next to it).
    await publish_group(js, subjects, 0)
    await asyncio.sleep(1.0)
    assert pre.builder.index == 0 and pre.builder.ledger.trained_groups == 0
    await publish_group(js, subjects, 1)
    (w0,) = await batches(1)
    assert (w0.step, w0.index, w0.last, len(w0.rewards), w0.ledger.samples) == (0, 0, False, 2, 2)
    for i in (2, 3):
        await publish_group(js, subjects, i)
    w1, w2 = await batches(2)
    assert [(b.index, b.last) for b in (w1, w2)] == [(1, False), (2, True)]
    assert w2.ledger.samples == 8 and w2.ledger.credits == {"0": 2, "1": 2}
    assert sum(len(b.rewards) for b in (w0, w1, w2)) == 8
    # Step 1: one wave out (g4; g5 held for the next), then the preprocessor stops.
    for i in (4, 5):
        await publish_group(js, subjects, i)
    (w3,) = await batches(1)
    assert (w3.step, w3.index, w3.last, w3.group_ids) == (1, 0, False, ["g4", "g4"])
    pre.stopping.set()
    await asyncio.wait_for(task, 10)

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    await wait_until(lambda: pre.builder.caught_up and len(pre.builder.accepted) == 1)
    assert (pre.builder.step, pre.builder.index, pre.builder.ledger.trained_groups) == (1, 1, 1)
    for i in (6, 7):
        await publish_group(js, subjects, i)
    rest = await batches(2)
    assert [(b.step, b.index, b.last) for b in rest] == [(1, 1, False), (1, 2, True)]
    assert {g for b in [w3, *rest] for g in b.group_ids} == {"g4", "g5", "g6", "g7"}
    assert rest[-1].ledger.samples == 8 and rest[-1].ledger.credits == {"0": 2, "1": 2}
    await wait_until(lambda: pre.builder.step == 2)
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_ranks_micro_batches_are_stored_in_order_whatever_their_publishes_take(
    nats_server, tmp_path, monkeypatch
):
    """A wave of two micro-batches for one rank, the first one's publish slow (a try unanswered
    and sent again): the second waits for it. Stored the other way round, a restarted
    preprocessor would read the wave as stored through the newest (`books.restore`), and the
    trainer would step after it without the first."""
    from pipelinerl_preprocessor import main as preprocessor

    sent = preprocessor.publish_once

    async def first_slow(js, subject, data, msg_id, **kw):
        if msg_id == "0-0-0":
            await asyncio.sleep(0.5)
        return await sent(js, subject, data, msg_id, **kw)

    monkeypatch.setattr(preprocessor, "publish_once", first_slow)
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "po", WAVES)
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=5, timestamp=0)))  # no backpressure
    for i in range(4):  # in the stream before it starts: one wave of two rows (g0 + g1, g2 + g3)
        await publish_group(js, subjects, i)
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for _ in range(100):
        stored = [m.decode(x.data, m.MicroBatch) for x in await stored_messages(js, subjects.stream("BATCHES"))]
        if len(stored) == 2:
            break
        await asyncio.sleep(0.1)
    assert [(b.step, b.index, b.last) for b in stored] == [(0, 0, False), (0, 1, True)]
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_groups_held_by_a_dead_preprocessor_come_back_at_once_and_first(nats_server, tmp_path):
    """A preprocessor that dies (its connection drops) while holding groups that wait for a full
    step: the next one gets them at once, before newer groups, not after ACK_WAIT_S (30 s) behind
    them (in pipeline mode they would then reach a step too old for it, and be dropped)."""
    from pipelinerl_preprocessor.main import ACK_WAIT_S

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "rd", WAVES | {"mode": "sync"})
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(3):  # 3 groups of a 4-group step: accepted, held unacknowledged
        await publish_group(js, subjects, i)
    await wait_until(lambda: len(pre.builder.accepted) == 3)
    task.cancel()  # dies without acknowledging or closing cleanly
    await asyncio.gather(task, return_exceptions=True)
    await pre.nc.close()
    t0 = time.monotonic()
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(3, 8):  # newer groups: more than a step's
        await publish_group(js, subjects, i)
    step = await one_step(out, timeout=ACK_WAIT_S + 20)
    assert time.monotonic() - t0 < ACK_WAIT_S / 3
    assert {b.step for b in step} == {0} and step[-1].ledger.samples == 8
    assert {g for b in step for g in b.group_ids} == {"g0", "g1", "g2", "g3"}  # the held groups first
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_groups_whose_acknowledgements_were_lost_are_not_trained_or_counted_twice(
    nats_server, tmp_path, monkeypatch
):
    """A preprocessor killed after storing a step but before NATS had the acks of the groups it
    settled with it (trained, filtered as zero-variance, dead-lettered): the next one is handed
    those groups again and settles them untrained and uncounted (their ids are in the stored
    step); its first step holds only newer groups, and credits only them to their generators."""
    import nats.aio.msg

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "la", WAVES)
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=5, timestamp=0)))  # no backpressure
    out = await js.pull_subscribe(subjects.batches(0), durable="t")

    def steps_and_groups(batches):
        return {b.step for b in batches}, {g for b in batches for g in b.group_ids}

    async def lost(msg, timeout=None):  # killed before the acknowledgements reached NATS
        pass

    monkeypatch.setattr(nats.aio.msg.Msg, "ack_sync", lost)
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    too_long = m.Sample(tokens=[3] * 9, mask=[0] * 7 + [1, 1], logprobs=[0] * 9, versions=[-1] * 7 + [0, 0], reward=1)
    settled = [  # in no micro-batch: the first filtered (zero variance), the second dead-lettered
        rollout(8, [1, 1]),
        m.RolloutGroup(group_id="long", generator=1, samples=[too_long, too_long.model_copy(update={"reward": 0})]),
    ]
    for group in settled:
        await js.publish(subjects.rollouts(0), m.encode(group), headers={"Nats-Msg-Id": group.group_id})
    for i in range(4):
        await publish_group(js, subjects, i)
    assert steps_and_groups(await one_step(out)) == ({0}, {"g0", "g1", "g2", "g3"})
    assert pre.stats["filtered_groups"] == pre.stats["dead_lettered"] == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await pre.nc.close()
    monkeypatch.undo()

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(4, 8):
        await publish_group(js, subjects, i)
    got = await one_step(out)
    assert steps_and_groups(got) == ({1}, {"g4", "g5", "g6", "g7"})
    # g4..g7 only: the dead-lettered group, credited to generator 1 in step 0, is not credited again
    ledger = got[-1].ledger
    assert (ledger.credits, ledger.filtered, ledger.dead_lettered) == ({"0": 2, "1": 2}, 0, 0)
    assert set(ledger.returned) == {"g0", "g1", "g2", "g3", "g8", "long"}  # settled again, counted nowhere
    assert pre.stats["settled_before"] == 6
    assert pre.stats["filtered_groups"] == pre.stats["dead_lettered"] == 0
    await all_acknowledged(js, subjects)  # the handed-back groups, with the wave after them
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_acknowledgements_lost_in_transit_are_sent_again_and_no_group_is_trained_twice(
    nats_server, tmp_path, monkeypatch
):
    """A living preprocessor whose acknowledgements of a step's groups are lost on the way (a
    connection dropped, a server restarting): sent and forgotten, they came back after the ack
    wait, steps later, where no step knew them any more, and were trained again. Each is now
    confirmed, and sent again until it is, before the next wave is stored."""
    import nats.aio.client

    from pipelinerl import streams
    from pipelinerl_preprocessor import main as service

    monkeypatch.setattr(service, "ACK_WAIT_S", 2.5)
    monkeypatch.setattr(streams, "ACK_TRY_S", 0.5)
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "lt", WAVES)
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=5, timestamp=0)))  # no backpressure
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    publish, dropped = nats.aio.client.Client.publish, []

    async def lossy(self, subject, payload=b"", reply="", headers=None):
        if subject.startswith("$JS.ACK.") and len(dropped) < 4 and subject not in dropped:
            dropped.append(subject)  # the first acknowledgement of each of step 0's groups: lost
            return
        await publish(self, subject, payload, reply, headers)

    monkeypatch.setattr(nats.aio.client.Client, "publish", lossy)
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(12):
        await publish_group(js, subjects, i)
    steps = [await one_step(out) for _ in range(3)]
    with pytest.raises(nats.errors.TimeoutError):  # nothing comes back past the ack wait to be trained again
        await one_step(out, timeout=service.ACK_WAIT_S + 3)
    trained = sorted(g for step in steps for b in step for g in set(b.group_ids))
    assert len(dropped) == 4 and trained == sorted(f"g{i}" for i in range(12))
    await all_acknowledged(js, subjects)
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_poison_groups_are_dead_lettered_with_their_reason_and_the_step_goes_on(nats_server, tmp_path):
    """Each kind of bad group, published into the job's stream: kept aside with its reason,
    acknowledged (never redelivered), counted; a full step of good groups still goes out, and
    each rejected group is settled for its generator's admission exactly once."""
    from pipelinerl.contracts import DEADLETTER_REASON

    job, env, nc, js, subjects = await start(
        nats_server,
        tmp_path,
        "poison",
        {
            "model": {"maxSeqLen": 8},
            "generator": {"sampling": {"maxTokens": 4}},
            "rl": {"attempts": 2},
            "trainer": {"samplesPerStep": 4, "microBatchTokens": 16},
        },
    )
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=3, timestamp=0)))

    def bad(i: int, **change) -> m.RolloutGroup:
        g = rollout(i, [1, 0])
        g.generator = 1
        g.samples[1] = g.samples[1].model_copy(update=change)
        return g

    poison = {
        "g10": bad(10, reward=float("nan")),
        "g11": bad(11, tokens=list(range(9)), mask=[0] * 8 + [1], logprobs=[0.0] * 9, versions=[-1] * 8 + [3]),
        "g12": bad(12, versions=[-1, -1, 0, 1_000_000]),
        "g13": bad(13, logprobs=[0, 0, float("-inf"), -1]),
    }
    for gid, g in poison.items():
        await js.publish(subjects.rollouts(1), m.encode(g), headers={"Nats-Msg-Id": gid})
    await js.publish(subjects.rollouts(0), b"\x93garbage")
    for i in (0, 2):
        await publish_group(js, subjects, i)

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    await wait_until(lambda: pre.builder.step == 1)
    assert pre.stats["dead_lettered"] == 5 and pre.stats["malformed"] == 1
    dead = await js.pull_subscribe(subjects.deadletter("rollout"), durable="inspect")
    letters = await dead.fetch(10, timeout=2)
    reasons = [x.headers[DEADLETTER_REASON] for x in letters]
    assert reasons[:4] == [
        "group g10 from generator 1: sample 1: reward is nan",
        "group g11 from generator 1: sample 1: 9 tokens, more than model.maxSeqLen (8)",
        "group g12 from generator 1: sample 1: version 1000000 at token 3 is ahead of the trainer "
        "(newest weights: version 4)",
        "group g13 from generator 1: sample 1: logprob -inf at token 2 (a finite value <= 0)",
    ]
    assert reasons[4].startswith("rollout_group: not valid msgpack")
    assert m.decode(letters[0].data, m.RolloutGroup).group_id == "g10"  # the message itself, for inspection
    (step,) = [
        m.decode(x.data, m.MicroBatch)
        for x in await (await js.pull_subscribe(subjects.batches(0), durable="t")).fetch(5, timeout=2)
    ]
    assert step.last and step.ledger.samples == 4  # the two good groups
    # Of the rejected ones, only the group with a version ahead of the trainer is consumed at the
    # step: its generator cannot see that. The others fail checks their generator makes too, so it
    # counted them discarded itself (steps.counts_as_discarded) and they held no place.
    assert step.ledger.credits == {"0": 2, "1": 1}
    info = await js.consumer_info(subjects.stream("ROLLOUTS"), "preprocessor")
    assert info.num_ack_pending == 0 and info.num_pending == 0  # nothing will come back
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_group_too_old_for_its_step_takes_no_place_in_it(nats_server, tmp_path):
    """Steps fill in arrival order: a group that waited behind others' backlog until every token
    of it is past the lag bound would be dropped whole by the trainer. It is dropped here
    instead (counted, credited to its generator), and the step fills with fresh groups."""
    job, env, nc, js, subjects = await start(
        nats_server,
        tmp_path,
        "stale",
        {"rl": {"attempts": 2, "maxLag": 1}, "trainer": {"samplesPerStep": 4, "microBatchTokens": 64}},
    )
    await js.publish(subjects.version, m.encode(m.PolicyVersion(version=10, timestamp=0)))  # no backpressure

    def at(i: int, version: int) -> m.RolloutGroup:
        g = rollout(i, [1, 0])
        for s in g.samples:
            s.versions = [-1, -1, version, version]
        return g

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i, version in enumerate([0, 0, 0, 1, 0, 2, 2]):  # steps 0 and 1, then one too old for step 2
        g = at(i, version)
        await js.publish(subjects.rollouts(g.generator), m.encode(g), headers={"Nats-Msg-Id": g.group_id})
    await wait_until(lambda: pre.builder.step == 3)
    assert pre.stats["stale_groups"] == 1
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    step2 = [b for b in (m.decode(x.data, m.MicroBatch) for x in await out.fetch(10, timeout=2)) if b.step == 2]
    assert step2[-1].last and step2[-1].ledger.samples == 4 and step2[-1].ledger.stale_samples == 2
    assert set(v for b in step2 for v, k in zip(b.versions, b.mask) if k) == {2}
    assert step2[-1].ledger.credits == {"0": 2, "1": 1}  # groups 4 (stale), 5 and 6
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_the_preprocessor_reports_how_full_the_job_streams_are(nats_server, tmp_path):
    from prometheus_client import REGISTRY

    from pipelinerl.capacity import stream_bytes

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "fill", WAVES)
    sizes = stream_bytes(job.spec)
    await ensure_streams(js, subjects, 8, sizes=sizes)  # as the services make them: at the job's sizes
    for i in range(3):  # read by nobody here: they stay
        await js.publish(subjects.deadletter("rollout"), b"x" * 1000, headers={"Nats-Msg-Id": f"d{i}"})

    def gauge(name: str, stream: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"stream": stream})

    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    await wait_until(lambda: gauge("pipelinerl_stream_messages", "DEADLETTER") == 3)
    info = await js.stream_info(subjects.stream("DEADLETTER"))
    assert gauge("pipelinerl_stream_bytes", "DEADLETTER") == info.state.bytes > 3000
    for suffix, size in sizes.items():  # every stream of the job, at the size the job reserves
        assert gauge("pipelinerl_stream_limit_bytes", suffix) == size, suffix
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_wave_stored_on_some_ranks_only_is_published_again_as_it_was(nats_server, tmp_path, monkeypatch):
    """A preprocessor that dies while storing a wave (here: its micro-batch for rank 1 is never
    stored, rank 0's is) leaves the step torn between the ranks; the wave's groups were not
    acknowledged. The next one packs the same groups again the same way and stores only what
    is missing: each rank gets the step once, whole, and the trainer's two ranks stay alike."""
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "torn", WAVES | {"mode": "sync"})
    outs = [await js.pull_subscribe(subjects.batches(r), durable=f"t{r}") for r in (0, 1)]
    packed: list[m.MicroBatch] = []
    publish = Preprocessor._publish

    async def killed() -> None:
        await asyncio.sleep(1.0)  # rank 0's is stored by then
        raise ConnectionError("killed while storing the wave")

    def dies_on_rank_1(self, mb):
        packed.append(mb)
        return killed() if mb.rank == 1 else publish(self, mb)

    monkeypatch.setattr(Preprocessor, "_publish", dies_on_rank_1)
    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    for i in range(4):  # one step, one wave (sync mode): one row per rank
        await publish_group(js, subjects, i)
    await asyncio.gather(task, return_exceptions=True)
    assert task.exception() is not None
    await pre.nc.close()
    monkeypatch.undo()
    (first,) = [m.decode(x.data, m.MicroBatch) for x in await outs[0].fetch(5, timeout=2)]
    assert first.last and first.ledger.trained_groups == 4

    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    (again,) = [m.decode(x.data, m.MicroBatch) for x in await outs[1].fetch(5, timeout=10)]
    lost = next(mb for mb in packed if mb.rank == 1)
    assert (again.step, again.index, again.last, again.group_ids) == (0, 0, True, lost.group_ids)
    assert again.tokens == lost.tokens and again.ledger == first.ledger
    assert {g for mb in (first, again) for g in mb.group_ids} == {"g0", "g1", "g2", "g3"}
    await wait_until(lambda: pre.builder.step == 1)
    with pytest.raises(TimeoutError):  # rank 0's micro-batch was not stored twice
        await outs[0].fetch(1, timeout=1)
    await all_acknowledged(js, subjects)  # the wave's groups, now
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_torn_wave_is_not_given_up_on_while_jetstream_cannot_answer_yet(nats_server, tmp_path, monkeypatch):
    """The restarted preprocessor's first fetches fail (JetStream still recovering after a restart
    of its own, or the connection reconnecting): an empty answer is not taken for a stream with
    nothing left in it, so the torn wave's groups, still in ROLLOUTS, are packed again when they
    come, not replaced by sentinels (losing their samples while the books count them trained)."""
    from pipelinerl_preprocessor import main as service

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "tornu", WAVES | {"mode": "sync"})
    outs = [await js.pull_subscribe(subjects.batches(r), durable=f"t{r}") for r in (0, 1)]
    publish = Preprocessor._publish

    async def killed() -> None:
        await asyncio.sleep(1.0)  # rank 0's is stored by then
        raise ConnectionError("killed while storing the wave")

    monkeypatch.setattr(Preprocessor, "_publish", lambda self, mb: killed() if mb.rank == 1 else publish(self, mb))
    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    for i in range(4):  # one step, one wave (sync mode): one row per rank
        await publish_group(js, subjects, i)
    await asyncio.gather(task, return_exceptions=True)
    await pre.nc.close()
    monkeypatch.undo()
    unanswered = 3

    async def recovering(sub):
        nonlocal unanswered
        if unanswered:
            unanswered -= 1
            return []  # as `fetch` answers a 503 (or a timeout) after its pause
        return await fetch(sub)

    fetch = service.fetch
    monkeypatch.setattr(service, "fetch", recovering)
    pre = Preprocessor(job, env, trainer_ranks=2)
    task = asyncio.create_task(pre.run())
    (again,) = [m.decode(x.data, m.MicroBatch) for x in await outs[1].fetch(5, timeout=10)]
    assert unanswered == 0 and again.group_ids and again.tokens  # packed again, not a sentinel
    await wait_until(lambda: pre.builder.step == 1)
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_preprocessor_frozen_past_its_acknowledgement_wait_takes_each_held_group_once(
    nats_server, tmp_path, monkeypatch
):
    """The preprocessor's process stops (SIGSTOP, a frozen node, a stall: here its event loop is
    blocked, its NATS client with it) for longer than its acknowledgement wait while it holds
    groups: JetStream delivers them again to the same, living consumer. Each is taken once:
    every group is trained in one step only, each step's ledger credits its four groups."""
    from pipelinerl_preprocessor import main as service

    monkeypatch.setattr(service, "ACK_WAIT_S", 2.5)  # (its keep-alive: every ACK_WAIT_S / 4, on the event loop)
    # A step goes out whole (token weighting: its loss weights need all of it), so groups are held.
    spec = WAVES | {"rl": {"attempts": 2, "tokenWeighting": "token"}}
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "fz", spec)
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(3):  # 3 groups of a 4-group step: held, unacknowledged
        await publish_group(js, subjects, i)
    await wait_until(lambda: len(pre.builder.accepted) == 3)
    time.sleep(6)  # frozen: no keep-alive goes out; the held groups are delivered again meanwhile
    await asyncio.sleep(1)  # the copies come in
    for i in range(3, 8):
        await publish_group(js, subjects, i)
    steps = [await one_step(out), await one_step(out)]
    trained = [g for step in steps for b in step for g in set(b.group_ids)]
    assert sorted(trained) == [f"g{i}" for i in range(8)]  # each once, none twice
    for n, step in enumerate(steps):
        assert {b.step for b in step} == {n} and step[-1].ledger.credits == {"0": 2, "1": 2}
    assert pre.stats["settled_before"] >= 3  # the copies of the held groups, recognised
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_store_slower_than_the_acknowledgement_wait_keeps_its_groups(nats_server, tmp_path, monkeypatch):
    """Storing a wave takes longer than the acknowledgement wait (JetStream slow to answer: a full
    disk, a loaded server): the groups it holds, in the wave and waiting for the next, are told in
    progress meanwhile, so JetStream delivers none of them again to the living preprocessor."""
    from pipelinerl_preprocessor import main as service

    monkeypatch.setattr(service, "ACK_WAIT_S", 2.5)
    sent, slow = service.publish_once, asyncio.Event()

    async def slow_publish(*args, **kwargs):
        if not slow.is_set():  # the step's first micro-batch: 3 acknowledgement waits
            slow.set()
            await asyncio.sleep(7.5)
        return await sent(*args, **kwargs)

    monkeypatch.setattr(service, "publish_once", slow_publish)
    spec = WAVES | {"rl": {"attempts": 2, "tokenWeighting": "token"}}  # a step goes out whole
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "sl", spec)
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(6):  # a step of four, and two waiting for the next
        await publish_group(js, subjects, i)
    step = await one_step(out, timeout=30)
    assert slow.is_set() and {g for b in step for g in b.group_ids} == {f"g{i}" for i in range(4)}
    assert pre.stats["settled_before"] == 0, "held groups were delivered again"
    for i in range(6, 8):
        await publish_group(js, subjects, i)
    assert {g for b in await one_step(out) for g in b.group_ids} == {f"g{i}" for i in range(4, 8)}
    assert pre.stats["settled_before"] == 0
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_groups_fetched_behind_a_slow_dead_letter_are_kept_alive_meanwhile(nats_server, tmp_path, monkeypatch):
    """One message of a fetch takes longer than the acknowledgement wait to settle (its dead
    letter's publish rides out a NATS restart): the groups fetched with it, not taken yet, are told
    in progress meanwhile. Before, their wait ran out then, and JetStream delivered them again
    while they waited for the rest of their step (each copy logged as a restart's lost
    acknowledgement)."""
    from pipelinerl_preprocessor import main as service

    monkeypatch.setattr(service, "ACK_WAIT_S", 2.5)
    sent = service.dead_letter

    async def slow_dead_letter(*args, **kwargs):
        await asyncio.sleep(7.5)  # 3 acknowledgement waits
        return await sent(*args, **kwargs)

    monkeypatch.setattr(service, "dead_letter", slow_dead_letter)
    job, env, nc, js, subjects = await start(nats_server, tmp_path, "dl", WAVES)
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    await js.publish(subjects.rollouts(0), b"\x93garbage")
    for i in range(2):  # fetched with it: half a step, held after (the fetches go on meanwhile)
        await publish_group(js, subjects, i)
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    await wait_until(lambda: pre.stats["dead_lettered"] == 1, timeout=15)
    await asyncio.sleep(2)
    for i in range(2, 4):
        await publish_group(js, subjects, i)
    step = await one_step(out, timeout=30)
    assert {g for b in step for g in b.group_ids} == {f"g{i}" for i in range(4)} and pre.stats["dead_lettered"] == 1
    assert pre.stats["settled_before"] == 0, "groups fetched behind the dead letter were delivered again"
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_a_fetch_jetstream_cannot_answer_yet_is_waited_out_not_fatal(tmp_path, caplog):
    """A restarting nats-server answers a fetch 503 until its JetStream has recovered its streams:
    here a real server without JetStream answers every fetch so. The preprocessor's fetch comes
    back empty after a pause (it raised, and the preprocessor restarted)."""
    import subprocess
    import sys
    from pathlib import Path

    import nats

    from pipelinerl.ports import free_port
    from pipelinerl_preprocessor.main import RETRY_S, fetch

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "nats-server"), "-p", str(port)], cwd=tmp_path)
    try:
        nc = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=20, reconnect_time_wait=0.1)
        sub = await nc.jetstream().pull_subscribe_bind("preprocessor", stream="ROLLOUTS")
        began = time.monotonic()
        assert await fetch(sub) == [] and time.monotonic() - began >= RETRY_S
        assert "JetStream unavailable (ServiceUnavailableError)" in caplog.text
        await nc.close()
    finally:
        server.kill()
        server.wait()


async def test_a_preprocessor_whose_consumer_is_gone_stops_to_be_restarted(nats_server, tmp_path):
    """Its stream made again (or the store lost), the work queue's consumer is gone: a pull is
    answered 503 as while JetStream recovers, but nothing would make the consumer again. The
    preprocessor stops, saying so, and its restart (as Kubernetes would) takes the groups."""
    from nats.js.errors import NotFoundError

    from pipelinerl_preprocessor.main import ConsumerLost

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "cl", WAVES | {"mode": "sync"})
    out = await js.pull_subscribe(subjects.batches(0), durable="t")
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    # Its consumer made (caught_up is set before: the stream was empty at the start).
    deadline = time.monotonic() + 10
    while True:
        try:
            await js.consumer_info(subjects.stream("ROLLOUTS"), "preprocessor")
            break
        except NotFoundError:
            assert time.monotonic() < deadline, "the preprocessor made no consumer"
            await asyncio.sleep(0.05)
    await js.delete_consumer(subjects.stream("ROLLOUTS"), "preprocessor")
    with pytest.raises(ConsumerLost, match="the rollouts consumer is gone"):
        await asyncio.wait_for(task, 15)
    await pre.nc.close()
    pre = Preprocessor(job, env, trainer_ranks=1)
    task = asyncio.create_task(pre.run())
    for i in range(4):
        await publish_group(js, subjects, i)
    step = await one_step(out)
    assert {g for b in step for g in b.group_ids} == {"g0", "g1", "g2", "g3"}
    pre.stopping.set()
    await asyncio.wait_for(task, 10)
    await nc.close()


async def test_groups_delivered_but_not_taken_keep_a_restart_from_counting_itself_caught_up(nats_server, tmp_path):
    """The groups left in the stream at a restart are all delivered (the consumer has none
    pending) but not all taken: delivered on a connection that dropped, they come again only after
    the ack wait. Until they do, the preprocessor is not caught up (it would even out a wave
    stored in part with sentinels while its groups still wait)."""
    from nats.js.api import ConsumerConfig as Config

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "cu", WAVES)
    for i in range(2):
        await publish_group(js, subjects, i)
    rollouts = subjects.stream("ROLLOUTS")
    pre = Preprocessor(job, env, trainer_ranks=1)
    pre.js, pre.backlog = js, 2
    sub = await js.pull_subscribe(subjects.rollouts(">"), durable="preprocessor", config=Config(ack_wait=30))
    lost = await js.pull_subscribe_bind("preprocessor", stream=rollouts)  # the connection that dropped
    delivered = await lost.fetch(2, timeout=5)
    await pre._catch_up(sub, [])
    assert not pre.builder.caught_up
    for i in (2, 3):  # newer groups, pending: generators publish on
        await publish_group(js, subjects, i)
    for msg in delivered:  # what their redelivery hands over, taken (the stream's end at the start)
        pre.builder.accepted.append((msg, None))
    await pre._catch_up(sub, delivered)
    assert pre.builder.caught_up
    await nc.close()


async def test_a_group_of_a_newer_build_is_neither_refused_nor_acknowledged_the_preprocessor_stops(
    nats_server, tmp_path
):
    """A generator rolled onto a newer build before the preprocessor (an upgrade) writes a schema
    this one cannot read: not dead-lettered as malformed (its credit lost, its generator's
    admission place held for good; in a conventional phase, the phase never whole), nor
    acknowledged: the preprocessor stops (NewerBuild) and the group waits in the stream for its
    restart on the newer image."""
    import msgpack

    from pipelinerl.streams import stored_messages
    from pipelinerl_preprocessor.main import NewerBuild

    job, env, nc, js, subjects = await start(nats_server, tmp_path, "newer", WAVES)
    body = msgpack.unpackb(m.encode(rollout(0, [1, 0]))) | {"v": m.SCHEMA_VERSION + 1}
    await js.publish(subjects.rollouts(0), msgpack.packb(body), headers={"Nats-Msg-Id": "g0"})
    pre = Preprocessor(job, env, trainer_ranks=1)
    with pytest.raises(NewerBuild, match="rollout at sequence 1 is of a newer build .*schema version"):
        await asyncio.wait_for(pre.run(), 15)
    await pre.nc.close()
    assert await stored_messages(js, subjects.stream("DEADLETTER")) == []
    assert [x.data for x in await stored_messages(js, subjects.stream("ROLLOUTS"))] == [msgpack.packb(body)]
    await nc.close()
