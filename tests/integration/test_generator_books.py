"""A generator's books live in the stream, carried by each group it publishes: a restarted
generator continues them (real nats-server; the generator without its engine)."""

import asyncio

import nats.errors

from pipelinerl import messages as m
from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl.spec import parse_job
from pipelinerl.streams import connect, last_message, stored_messages
from pipelinerl.store import ensure_streams
from pipelinerl.tasks.dataset import DatasetTask
from pipelinerl.claims import group_id
from pipelinerl_generator.main import Generator, restore_admission
from pipelinerl_preprocessor.main import Preprocessor

JOB = parse_job(
    {
        "metadata": {"name": "books"},
        "spec": {
            "rl": {"attempts": 2, "filterZeroVariance": True},
            "generator": {"replicas": 2},
            "trainer": {"samplesPerStep": 4},
        },
    }
)


def group(problem: int, rewards: list[float]) -> m.RolloutGroup:
    samples = [
        m.Sample(tokens=[3, 4, 5], mask=[0, 1, 1], logprobs=[0, -1, -1], versions=[-1, 0, 0], reward=r) for r in rewards
    ]
    return m.RolloutGroup(group_id=f"p{problem}@1", generator=1, samples=samples)


async def incarnation(nats_server, tmp_path) -> Generator:
    """A generator as `assemble` builds one, from what the stream holds (no engine, task or HTTP)."""
    env = ServiceEnv("generator", rank=1, nats_url=nats_server.url, run_dir=tmp_path, http_port=0)
    nc = await connect(nats_server.url, "generator-1")
    await ensure_streams(nc.jetstream(), JobSubjects("books"), 8)
    admission = await restore_admission(JOB.spec, JOB.subjects, nc.jetstream(), env.rank)
    return Generator(JOB, env, nc, None, None, None, admission, None, asyncio.Event(), asyncio.Event())


async def start_and_publish(gen: Generator, rewards: list[float]) -> int:
    problem = await gen._next_problem()
    started_at = gen.admission.on_start()
    await gen._publish(group(problem, rewards), started_at)
    return problem


async def test_a_restarted_generator_continues_its_books(nats_server, tmp_path):
    first = await incarnation(nats_server, tmp_path)
    assert first.admission.published == 0  # nothing yet
    drawn = [await start_and_publish(first, r) for r in ([1, 0], [1, 1], [0, 1])]  # the second: zero variance
    drawn.append(await first._next_problem())  # a fourth group is being generated when it dies
    first.admission.on_start()
    await first.js.publish(
        JobSubjects("books").version, m.encode(m.PolicyVersion(version=1, timestamp=0, trained_groups={"1": 1, "0": 5}))
    )  # (as the trainer would)
    await first.nc.close()

    second = await incarnation(nats_server, tmp_path)
    a = second.admission
    assert (a.published, a.discarded, a.trained) == (3, 1, 1)
    assert a.queued == 1  # the earlier incarnation's third group is still to be trained
    # It never draws a problem the dead one drew (published or not): problems are claimed.
    assert await second._next_problem() not in drawn
    # A publish stored with its acknowledgement lost: sent again, stored once, counted once.
    publish = second.js.publish

    async def ack_lost(*args, **kwargs):
        await publish(*args, **kwargs)
        second.js.publish = publish
        raise nats.errors.TimeoutError

    second.js.publish = ack_lost
    await start_and_publish(second, [0, 1])
    assert (a.published, a.finished, a.queued) == (4, 1, 2)
    stored = await stored_messages(second.js, JobSubjects("books").stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).books.published for x in stored] == [1, 2, 3, 4]  # one each
    await second.nc.close()

    third = await incarnation(nats_server, tmp_path)
    assert (third.admission.published, third.admission.discarded) == (4, 1)
    await third.nc.close()


async def test_a_problem_drawn_again_in_a_later_epoch_is_a_group_of_its_own(nats_server, tmp_path):
    """A dataset's rows come back with each epoch, under the same problem id: their groups are told
    apart by the claimed index (`group_id`), so JetStream never drops a later epoch's group as a
    duplicate of an earlier one within its window (10 minutes: a small dataset's epochs are shorter).
    Through `Generator._group`, the dataset task's rows with its rollouts stood in for (no engine)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "held out"}\n')
    task = DatasetTask(train=str(rows), reward="builtins:len", test_rows=1)
    sample = group(0, [1]).samples[0]

    async def rollout(policy, tokenizer, problem, max_tokens, greedy=False):
        return sample.model_copy(update={"reward": float(len(problem.prompt) % 2)})

    task.rollout = rollout
    gen = await incarnation(nats_server, tmp_path)
    gen.task = task
    for index in range(4):  # two epochs of two rows
        await gen._group(index, gen.admission.on_start())
    stored = await stored_messages(gen.js, JobSubjects("books").stream("ROLLOUTS"))
    ids = [m.decode(x.data, m.RolloutGroup).group_id for x in stored]
    assert len(ids) == len(set(ids)) == 4 and len({task.train_problem(i).id for i in range(4)}) == 2
    assert ids == [group_id(task.train_problem(i).id, i, 1) for i in range(4)]
    assert gen.admission.published == 4
    await gen.nc.close()


async def test_books_of_consumed_groups_come_from_the_preprocessors_record(nats_server, tmp_path):
    first = await incarnation(nats_server, tmp_path)
    for rewards in ([1, 0], [1, 1], [0, 1]):  # the newest two: filtered, then the step's second
        await start_and_publish(first, rewards)
    pre = Preprocessor(JOB, ServiceEnv("preprocessor", nats_url=nats_server.url, run_dir=tmp_path, http_port=0), 1)
    task = asyncio.create_task(pre.run())
    deadline = asyncio.get_running_loop().time() + 10
    while pre.builder.step < 1 or pre.builder.settled:
        assert asyncio.get_running_loop().time() < deadline, "the preprocessor did not publish step 0"
        await asyncio.sleep(0.05)
    pre.stopping.set()
    await asyncio.wait_for(task, 10)

    # All consumed: the acknowledgements left with the preprocessor's connection, and the server
    # removes what they acknowledge as it processes them, which a read on another connection can
    # precede (it did once in CI, on a loaded machine).
    subjects = JobSubjects("books")
    deadline = asyncio.get_running_loop().time() + 10
    while await last_message(first.js, subjects.stream("ROLLOUTS"), subjects.rollouts(1), 5) is not None:
        assert asyncio.get_running_loop().time() < deadline, "a consumed group is still in the stream"
        await asyncio.sleep(0.1)
    await first.nc.close()
    second = await incarnation(nats_server, tmp_path)
    assert (second.admission.published, second.admission.discarded) == (3, 1)
    await second.nc.close()


async def test_problems_are_drawn_once_whatever_the_generators(nats_server):
    """Generators claim blocks of the problem stream from one record (replaced by an append
    JetStream makes only if nobody appended since it was read): claimers racing, of different
    block sizes (as generators that started with different replica counts), never get one index
    twice. From a store made to go on from a checkpoint (`recover_store`), the indices claimed
    then and not settled by its steps are drawn first, each once, then fresh ones past its count."""
    from pipelinerl.claims import Claims
    from pipelinerl.streams import claim_problems

    subjects = JobSubjects("claims")
    clients = [await connect(nats_server.url, f"claimer-{i}") for i in range(3)]
    await ensure_streams(clients[0].jetstream(), subjects, 8)
    recovered = Claims.of(100, "3-9,20,50-59")
    await clients[0].jetstream().publish(subjects.problems, recovered.text().encode())

    async def claimer(nc, block: int) -> list[list[int]]:
        return [await claim_problems(nc.jetstream(), subjects, block) for _ in range(15)]

    claims = await asyncio.gather(*(claimer(nc, block) for nc, block in zip(clients, (2, 3, 5))))
    assert all(len(c) == block for cs, block in zip(claims, (2, 3, 5)) for c in cs)
    everything = [i for cs in claims for c in cs for i in c]
    redraw = [i for a, b in recovered.redraw for i in range(a, b)]
    assert len(everything) == len(set(everything)) == 15 * (2 + 3 + 5)
    # No gaps either, when no claim is lost.
    assert sorted(everything) == redraw + list(range(100, 100 + len(everything) - len(redraw)))
    # The redrawn first: once a claimer got a fresh index, none was left to draw again.
    for cs in claims:
        fresh = [i >= 100 for c in cs for i in c]
        assert fresh == sorted(fresh)
    for nc in clients:
        await nc.close()
