"""A generator's books live in the stream, carried by each group it publishes: a restarted
generator continues them (real nats-server; the generator without its engine)."""

import asyncio
from types import SimpleNamespace

import nats.errors

from pipelinerl import messages as m
from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl.spec import parse_job
from pipelinerl.streams import connect, held_problems, hold_problems, last_message, problems_claimed, stored_messages
from pipelinerl.store import ensure_streams
from pipelinerl.tasks.dataset import DatasetTask
from pipelinerl.claims import group_id, indices
from pipelinerl.tasks import PromptTooLong
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


async def incarnation(nats_server, tmp_path, job=JOB) -> Generator:
    """A generator as `assemble` builds one, from what the stream holds (no engine, task or HTTP)."""
    env = ServiceEnv("generator", rank=1, nats_url=nats_server.url, run_dir=tmp_path, http_port=0)
    nc = await connect(nats_server.url, "generator-1")
    await ensure_streams(nc.jetstream(), job.subjects, 8)
    admission = await restore_admission(job.spec, job.subjects, nc.jetstream(), env.rank)
    held = await held_problems(nc.jetstream(), job.subjects, env.rank)
    return Generator(job, env, nc, None, None, None, admission, None, asyncio.Event(), asyncio.Event(), held)


async def start_and_publish(gen: Generator, rewards: list[float]) -> int:
    problem = await gen._next_problem()
    started_at = gen.admission.on_start()
    await gen._publish(group(problem, rewards), started_at, problem)
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
    # It draws first the problem the dead one was generating (held, its group never published),
    # then problems nobody drew: never one whose group was published.
    assert second.held == [(drawn[3], drawn[3] + 1)]
    assert await second._next_problem() == drawn[3]
    unpublished = await second._next_problem()
    assert unpublished not in drawn
    # A publish stored with its acknowledgement lost: sent again, stored once, counted once.
    problem = await second._next_problem()
    publish = second.js.publish

    async def ack_lost(subject, *args, **kwargs):
        await publish(subject, *args, **kwargs)
        if subject.startswith(JobSubjects("books").rollouts("")):
            second.js.publish = publish
            raise nats.errors.TimeoutError

    second.js.publish = ack_lost
    await second._publish(group(problem, [0, 1]), a.on_start(), problem)
    assert second.js.publish == publish  # the group's publish was the one that lost its ack
    assert (a.published, a.finished, a.queued) == (4, 1, 2)
    stored = await stored_messages(second.js, JobSubjects("books").stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).books.published for x in stored] == [1, 2, 3, 4]  # one each
    await second.nc.close()

    third = await incarnation(nats_server, tmp_path)
    assert (third.admission.published, third.admission.discarded) == (4, 1)
    assert indices(third.held) == sorted([drawn[3], unpublished])  # the published one let go
    await third.nc.close()


async def test_a_restart_draws_first_the_block_and_groups_its_predecessor_held(nats_server, tmp_path):
    """Problems are claimed a block at a time (a step's share, 3 here); what an incarnation held
    when it died (the rest of its block, its groups in flight) its restart draws first, each once.
    A skipped problem (its prompt too long) is let go like a published one. Through
    `Generator._group`, the task's rollouts stood in for (no engine)."""
    job = parse_job({"metadata": {"name": "held"}, "spec": {"rl": {"attempts": 2}, "trainer": {"samplesPerStep": 6}}})
    sample = group(0, [1]).samples[0]

    async def rollout(policy, tokenizer, problem, max_tokens, greedy=False):
        if problem.id == "too-long":
            raise PromptTooLong("a prompt of 9 tokens leaves no room")
        return sample

    task = SimpleNamespace(rollout=rollout, train_problem=lambda i: SimpleNamespace(id="too-long" if i == 1 else "p"))
    first = await incarnation(nats_server, tmp_path, job)
    first.task = task
    assert first.admission.share == 3 and first.held == []
    assert await first._next_problem() == 0 and first.held == [(0, 3)]  # the block, recorded before it is drawn
    await first._group(0, first.admission.on_start())  # published
    assert await first._next_problem() == 1 and first.held == [(1, 3)]
    await first._group(1, first.admission.on_start())  # skipped
    assert await first._next_problem() == 2 and first.held == [(2, 3)]  # in flight when it dies
    assert await first._next_problem() == 3 and first.held == [(2, 6)]  # of the next block
    await first.nc.close()  # it dies

    second = await incarnation(nats_server, tmp_path, job)
    assert second.held == [(2, 6)]
    assert [await second._next_problem() for _ in range(5)] == [2, 3, 4, 5, 6]  # a block claimed for 6
    assert await problems_claimed(second.js, job.subjects) == 9
    second.task = task
    await second._group(3, second.admission.on_start())
    assert second.held == [(2, 3), (4, 9)]
    stored = await stored_messages(second.js, job.subjects.stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in stored] == ["p#0@1", "p#3@1"]
    await second.nc.close()


async def test_groups_published_together_each_let_their_problem_go(nats_server, tmp_path, monkeypatch):
    """Six groups of a block finishing at once: each takes its index off what the others left, so
    the record holds none of them after (before, one computed from what it read while another
    wrote put that one's index back: its restart drew a published problem again, and the
    duplicate's books stalled its admission). The burst costs two record writes, not six: the
    first group's, and one carrying the five changes made while it was written."""
    from pipelinerl_generator import main

    job = parse_job(
        {"metadata": {"name": "together"}, "spec": {"rl": {"attempts": 2}, "trainer": {"samplesPerStep": 12}}}
    )
    gen = await incarnation(nats_server, tmp_path, job)
    drawn = [await gen._next_problem() for _ in range(6)]
    assert gen.held == [(0, 6)] and drawn == list(range(6))
    written: list[list] = []

    async def counted(js, subjects, rank, held, *args):
        written.append(list(held))
        await hold_problems(js, subjects, rank, held, *args)

    monkeypatch.setattr(main, "hold_problems", counted)
    await asyncio.gather(*(gen._publish(group(i, [1, 0]), gen.admission.on_start(), i) for i in drawn))
    assert gen.held == [] and await held_problems(gen.js, job.subjects, 1) == []
    assert written == [[(1, 6)], []]
    await gen.nc.close()


async def test_a_stopping_generator_gives_back_what_it_holds_for_the_next_claims_each_drawn_once(nats_server, tmp_path):
    """Told to stop (a scale-down, a drained node), a generator cancels its groups in flight and
    gives back what it holds (the rest of its block, those groups): the next claims, a peer's,
    take them first, and its record is empty, so its own restart draws none of them. Its give-back
    stored with the acknowledgement lost, then a peer's claim of two of them: the retry is answered
    as a duplicate, not made again, so neither is drawn twice. Through `Generator._group` and the
    admission loop's end, rollouts that never end stood in for (no engine)."""
    from pipelinerl.claims import Claims
    from pipelinerl.streams import claim_problems

    job = parse_job({"metadata": {"name": "back"}, "spec": {"rl": {"attempts": 2}, "trainer": {"samplesPerStep": 8}}})

    async def rollout(policy, tokenizer, problem, max_tokens, greedy=False):
        await asyncio.Event().wait()  # generating when the stop comes

    gen = await incarnation(nats_server, tmp_path, job)
    gen.task = SimpleNamespace(rollout=rollout, train_problem=lambda i: SimpleNamespace(id="p"))
    for _ in range(2):
        gen._spawn(gen._group(await gen._next_problem(), gen.admission.on_start()), rollout=True)
    await asyncio.sleep(0.1)
    assert gen.held == [(0, 4)] and len(gen.rollouts) == 2  # a block of 4: two in flight, two unused
    gen.stopping.set()
    await gen._admission_loop()  # ends: its groups cancelled

    peer = await connect(nats_server.url, "generator-0")
    drawn_by_peer: list[int] = []
    publish = gen.js.publish

    async def ack_lost(subject, *args, **kwargs):
        await publish(subject, *args, **kwargs)
        if subject == job.subjects.problems:
            gen.js.publish = publish
            drawn_by_peer.extend(await claim_problems(peer.jetstream(), job.subjects, 2))
            raise nats.errors.TimeoutError

    gen.js.publish = ack_lost
    await gen._give_back()
    assert gen.js.publish == publish and drawn_by_peer == [0, 1]  # the groups it had in flight, first
    assert not gen.rollouts and await held_problems(gen.js, job.subjects, 1) == []
    last = await last_message(gen.js, job.subjects.stream("CONTROL"), job.subjects.problems)
    assert Claims.parse(last.decode()) == Claims(4, ((2, 4),))  # given back once: 0 and 1 not again
    assert await claim_problems(peer.jetstream(), job.subjects, 4) == [2, 3, 4, 5]
    restarted = await incarnation(nats_server, tmp_path, job)
    assert restarted.held == [] and not list(restarted.problems)
    for nc in (gen.nc, peer, restarted.nc):
        await nc.close()


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
