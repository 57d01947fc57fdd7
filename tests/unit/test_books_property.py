"""The books under random interleavings (seeded): generators publish groups of every outcome
(trainable, zero-variance, too old, not trainable, not even decodable), the preprocessor takes
them in fetches of any size and stores waves, the trainer consumes steps, and any service is
killed at any point and restarted from what is stored: the preprocessor (its acknowledgements of
the newest wave lost or not, or in the middle of storing a wave), the trainer (back to its
checkpoint, replaying), a generator (just after a publish it never counted), nats-server (its
newest acknowledgements and deliveries forgotten: those groups come again, to the living
preprocessor, whatever steps settled them); a delivery lost on the way (a connection dropped
with it in flight: it comes again after later ones, once the acknowledgement wait has passed);
and the preprocessor paused at any point for longer than the acknowledgement wait, so that
everything it holds is delivered to it again while it lives. (It is the only service a pause can harm so: the trainer
reads its micro-batches through an ordered consumer that acknowledges nothing, a generator reads
no work queue; paused, they are only slow, which the random interleavings already are.)

The services' own logic runs: `StepBuilder` (the preprocessor's, pure), `books.restore`,
`books.credit`, the micro-batches' wire format. What is simulated is only the I/O: JetStream's
work queue (a new consumer is handed every unacknowledged message in stream order; an
acknowledgement sent before a later publish is stored with it, one not yet flushed dies with
the process), the batches stream (a wave's publishes are stored in the order sent, so a kill
stores a prefix), and the checks of the preprocessor's service (`_intake`).

After each run: every group is trained at most once and in one step only, whole; none is lost
(every group published is settled in exactly one stored step or still waiting); every step
holds a full batch; the trainer's credits are the ledgers'; and every generator's admission
queue, continued from the books, is exactly its groups not yet settled by a trained step.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pipelinerl import books
from pipelinerl import messages as m
from pipelinerl.books import Outcome
from pipelinerl.spec import parse_job
from pipelinerl.steps import counts_as_discarded, newest_weights
from pipelinerl_preprocessor.builder import StepBuilder
from pipelinerl.group_checks import GroupLimits, group_problem

ATTEMPTS = 2
ROLLOUTS_STEPS = 4  # ROLLOUTS holds this many steps of groups (maxLag + pendingSteps + 2)


class Killed(Exception):
    pass


class WorkQueue:
    """ROLLOUTS and its one durable consumer."""

    def __init__(self) -> None:
        self.msgs: dict[int, tuple[int, bytes]] = {}  # seq -> (generator, data): stored, not acknowledged
        self.last_seq = 0
        self.delivered: set[int] = set()  # to the current consumer
        self.acked: list[tuple[int, tuple[int, bytes]]] = []  # the newest acknowledgements applied
        self.forgotten: set[int] = set()  # delivered before a restart forgot it: acks dropped till delivered again
        self.lost: set[int] = set()  # delivered, lost on the way (a dropped connection): come again after the wait

    def publish(self, generator: int, data: bytes) -> int:
        self.last_seq += 1
        self.msgs[self.last_seq] = (generator, data)
        return self.last_seq

    def new_consumer(self) -> None:
        self.delivered, self.lost = set(), set()

    def fetch(self, n: int, rnd: random.Random | None = None) -> list[tuple[int, int]]:
        """(seq, messages still pending after it), in stream order; with `rnd`, a delivery now and
        then lost on the way (the connection dropped with it in flight: the consumer counts it
        delivered, and later ones are delivered before it comes again)."""
        pending = sorted(s for s in self.msgs if s not in self.delivered)
        got = pending[:n]
        self.delivered.update(got)
        self.forgotten.difference_update(got)
        lost = {s for s in got if rnd is not None and rnd.random() < 0.05}
        self.lost |= lost
        return [(s, len(pending) - i - 1) for i, s in enumerate(got) if s not in lost]

    def wait_passed(self) -> None:
        """The acknowledgement wait passed for the deliveries lost on the way: they come again."""
        self.delivered -= self.lost
        self.lost = set()

    def expire(self) -> None:
        """The acknowledgement wait passed for everything the consumer holds (its process was paused
        for longer: SIGSTOP, a frozen node): JetStream delivers it again, to the same live consumer."""
        self.delivered = {s for s in self.delivered if s not in self.msgs}
        self.lost = set()

    def ack(self, seq: int) -> None:
        if seq in self.forgotten:  # at or past the consumer's next delivery: dropped, unanswered
            return  # (`streams.acknowledge` then returns: the message comes again)
        if seq in self.msgs:
            self.acked = [*self.acked[-40:], (seq, self.msgs.pop(seq))]

    def restart_server(self, rnd: random.Random) -> None:
        """nats-server killed and started again before it stored its newest state: the newest
        acknowledgements are lost (those messages are in the stream again) and the consumer's
        delivered pointer goes back before them, so it hands over again everything delivered since;
        until then, an acknowledgement of one of those is dropped with no answer."""
        lost = self.acked[len(self.acked) - rnd.randint(0, len(self.acked)) :]
        self.acked = self.acked[: len(self.acked) - len(lost)]
        self.msgs.update(lost)
        back = min([s for s, _ in lost] + [max(self.delivered, default=0) + 1 - rnd.randint(0, 3)])
        self.forgotten |= {s for s in self.delivered if s >= back}
        self.delivered = {s for s in self.delivered if s < back}

    def newest(self, generator: int) -> bytes | None:
        mine = [s for s, (g, _) in self.msgs.items() if g == generator]
        return self.msgs[max(mine)][1] if mine else None


class World:
    def __init__(self, rnd: random.Random, spec, ranks: int, generators: int):
        self.rnd, self.spec, self.ranks = rnd, spec, ranks
        self.queue = WorkQueue()
        self.batches: list[list[bytes]] = [[] for _ in range(ranks)]
        self.stored_keys: set[tuple[int, int, int]] = set()
        self.published: dict[str, m.RolloutGroup] = {}  # every group stored in ROLLOUTS
        self.announced = m.PolicyVersion(version=0, timestamp=0)
        self.problems = 0  # claimed problems: ids never repeat
        self.trainer = Trainer(self)
        self.generators = [Generator(self, g) for g in range(generators)]
        self.pre = Preprocessor(self)

    def newest_batches(self) -> list[m.MicroBatch | None]:
        return [m.decode(b[-1], m.MicroBatch) if b else None for b in self.batches]

    def store(self, mb: m.MicroBatch) -> None:
        key = (mb.step, mb.rank, mb.index)
        assert key not in self.stored_keys, f"micro-batch {key} stored twice"
        self.stored_keys.add(key)
        self.batches[mb.rank].append(m.encode(mb))


class Generator:
    def __init__(self, world: World, rank: int):
        self.world, self.rank = world, rank
        self.restart()

    def restart(self) -> None:
        """As `Generator._restore_books`: from its newest group still queued, or the preprocessor's record."""
        data = self.world.queue.newest(self.rank)
        queued = m.decode(data, m.RolloutGroup).books if data is not None else None  # only groups on its subject
        taken = books.restore(self.world.newest_batches()).generators.get(str(self.rank))
        newest = books.newest_books(queued, taken) or books.GeneratorBooks()
        self.published, self.discarded = newest.published, newest.discarded
        mine = [g for g in self.world.published.values() if g.generator == self.rank]
        assert self.published == len(mine), "a restarted generator's books are not its groups"
        assert self.discarded == sum(counts_as_discarded(self.world.spec, g) for g in mine)

    def publish(self, dies: bool) -> None:
        w, rnd = self.world, self.world.rnd
        if rnd.random() < 0.03:  # not even a group: dead-lettered undecodable, counted by nobody
            w.queue.publish(-1, b"\x93garbage")  # (on a subject of its own: not this generator's newest)
            return
        w.problems += 1
        version = max(0, w.announced.version - rnd.choice([0, 0, 0, 1, 2]))  # the weights it holds, maybe old
        if rnd.random() < 0.03:  # ahead of the trainer: dead-lettered, but its generator cannot tell
            version = w.announced.version + 2
        rewards = rnd.choice([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, float("nan")]])
        if rnd.random() < 0.02:  # one sample: dead-lettered (no leave-one-out baseline)
            rewards = rewards[:1]
        samples = []
        for reward in rewards:
            n = 7 if rnd.random() < 0.02 else rnd.randint(1, 4)  # 7: longer than maxSeqLen, dead-lettered
            samples.append(
                m.Sample(
                    tokens=[3] * (2 + n),
                    mask=[0, 0] + [1] * n,
                    logprobs=[0.0, 0.0] + [-1.0] * n,
                    versions=[-1, -1] + [version] * n,
                    reward=reward,
                )  # fmt: skip
            )
        group = m.RolloutGroup(group_id=f"p{w.problems}#{w.problems}@{self.rank}", generator=self.rank, samples=samples)
        discarded = counts_as_discarded(w.spec, group)
        group.books = books.GeneratorBooks(published=self.published + 1, discarded=self.discarded + discarded)
        w.queue.publish(self.rank, m.encode(group))
        w.published[group.group_id] = group
        if dies:  # stored, its acknowledgement never reached this incarnation
            raise Killed
        self.published, self.discarded = self.published + 1, self.discarded + discarded


class Preprocessor:
    """The service around `StepBuilder`, as `pipelinerl_preprocessor.main` does its I/O."""

    def __init__(self, world: World):
        self.world = world
        self.builder = StepBuilder(world.spec, world.ranks, books.restore(world.newest_batches()))
        self.version = world.announced.version
        world.queue.new_consumer()
        self.backlog = world.queue.last_seq
        self.builder.caught_up = self.backlog == 0
        self.unflushed: list[int] = []  # acknowledgements sent, not yet known to be stored
        self.waited = False  # the acknowledgement wait has passed since it started consuming

    def fetch(self, n: int, lossy: bool) -> None:
        got = self.world.queue.fetch(n, self.world.rnd if lossy else None)
        for seq, _ in got:
            self.intake(seq)
        # `_catch_up`: and the consumer counts no more delivered unacknowledged than it holds (a
        # delivery lost on the way comes again only after the wait).
        # A group of a wave stored in part not back: waited for past the ack wait of every delivery
        # lost on the way (the service: past the ack wait from its start, when they are delivered).
        q = self.world.queue
        ack_pending = sum(s in q.msgs for s in q.delivered)
        num_pending = sum(s not in q.delivered for s in q.msgs)
        reached = num_pending == 0 or any(seq >= self.backlog or pending == 0 for seq, pending in got)
        waited = self.waited and not q.lost
        if reached and ack_pending <= len(self.builder.held()) and (waited or not self.builder.torn_waits()):
            self.builder.caught_up = True

    def intake(self, seq: int) -> None:
        b, data = self.builder, self.world.queue.msgs[seq][1]
        try:
            group = m.decode(data, m.RolloutGroup)
        except m.MessageError:
            if not b.returned(seq, books.undecodable_id(seq), seq):
                b.dead_lettered(seq, books.undecodable_id(seq), None)
            return
        b.note_books(group)
        if b.returned(seq, group.group_id, seq):
            return
        problem = group_problem(group, self.limits())
        if problem:
            self.version = self.world.announced.version  # `_refresh_trainer_version`
            problem = group_problem(group, self.limits())
        if problem:
            b.dead_lettered(seq, group.group_id, group)
        else:
            b.take(seq, group)

    def limits(self) -> GroupLimits:
        return GroupLimits(max_seq_len=self.world.spec.model.max_seq_len, newest_version=newest_weights(self.version))

    def behind(self) -> bool:
        self.version = self.world.announced.version
        return self.builder.step >= self.version + self.world.spec.pending_steps

    def waves(self, torn: bool) -> None:
        """Store every wave due; `torn`: killed in the middle of storing one (of several micro-batches)."""
        while not self.behind():
            self.builder.drop_stale()
            wave = self.builder.next_wave()
            if wave is None:
                return
            assert not wave.lost
            cut = self.world.rnd.randint(1, len(wave.batches) - 1) if torn and len(wave.batches) > 1 else None
            for i, mb in enumerate(wave.batches):
                if i == cut:
                    raise Killed
                self.flush()  # sent before this publish: stored by the time it is
                self.world.store(mb)
            self.unflushed = list(wave.acks)

    def flush(self) -> None:
        for seq in self.unflushed:
            self.world.queue.ack(seq)
        self.unflushed = []


class Trainer:
    """Every rank consumes its micro-batches in order; a step is taken once all have its final one."""

    def __init__(self, world: World):
        self.world = world
        self.checkpoint: tuple[int, list[int], Counter] = (0, [0] * world.ranks, Counter())
        self.restart()
        self.steps: dict[int, list[m.MicroBatch]] = {}  # each step trained, as trained

    def restart(self) -> None:
        version, cursors, trained = self.checkpoint
        self.version, self.cursors, self.trained = version, list(cursors), Counter(trained)

    def save(self) -> None:
        self.checkpoint = (self.version, list(self.cursors), Counter(self.trained))

    def train(self) -> None:
        while True:
            took = []
            for rank, stored in enumerate(self.world.batches):
                mbs, i = [], self.cursors[rank]
                while i < len(stored):
                    mbs.append(m.decode(stored[i], m.MicroBatch))
                    i += 1
                    if mbs[-1].last:
                        break
                if not mbs or not mbs[-1].last:
                    return
                took.append((i, mbs))
            step = [mb for _, mbs in took for mb in mbs]
            assert {mb.step for mb in step} == {self.version}, "a rank got another step"
            assert len({mbs[-1].index for _, mbs in took}) == 1, "the ranks took different numbers of passes"
            finals = [mbs[-1].ledger for _, mbs in took]
            assert all(f == finals[0] for f in finals)
            if self.version in self.steps:  # replayed after a restart: the same step
                assert [mb.group_ids for mb in step] == [mb.group_ids for mb in self.steps[self.version]]
            self.steps[self.version] = step
            self.trained.update(finals[0].credits)  # `Trainer._consumed`
            self.cursors = [i for i, _ in took]
            self.version += 1
            if self.version > self.world.announced.version:  # a replay announces nothing (`floor`)
                self.world.announced = m.PolicyVersion(
                    version=self.version, timestamp=0, trained_groups=dict(self.trained)
                )


def run(seed: int, spec, ranks: int, generators: int, steps: int) -> World:
    rnd = random.Random(seed)
    w = World(rnd, spec, ranks, generators)
    kills = Counter()
    for tick in range(20_000):
        if w.trainer.version >= steps:
            break
        quiet = tick > 1500  # no more faults: let the run finish
        event = rnd.random()
        try:
            if event < 0.3:
                gen = rnd.choice(w.generators)
                # Admission, roughly: the groups queued, those settled (filtered ones) left out; and
                # ROLLOUTS full refuses the publish (`capacity.stream_bytes`: a few steps of groups).
                admitted = len(w.queue.msgs) - len(w.pre.builder.settled) < 3 * spec.groups_per_step
                if admitted and len(w.queue.msgs) < ROLLOUTS_STEPS * spec.groups_per_step:
                    gen.publish(dies=not quiet and rnd.random() < 0.02)
            elif event < 0.5:
                w.pre.fetch(rnd.randint(1, 6), lossy=not quiet)
            elif event < 0.7:
                w.pre.waves(torn=not quiet and rnd.random() < 0.05)
            elif event < 0.78:
                w.pre.flush()
            elif event < 0.9:
                w.trainer.train()
                if rnd.random() < 0.3:
                    w.trainer.save()
            elif not quiet and event < 0.915:
                raise Killed
            elif not quiet and event < 0.925:
                kills["trainer"] += 1
                w.trainer.restart()
                w.trainer.train()
            elif not quiet and event < 0.94:  # the preprocessor paused past the ack wait, then goes on
                kills["paused"] += 1
                if rnd.random() < 0.5:  # the acknowledgements it had sent arrived before the wait ran out
                    w.pre.flush()
                w.queue.expire()
                w.pre.waited = True
            elif not quiet and event < 0.95:
                kills["nats-server"] += 1
                w.queue.restart_server(rnd)
            elif event < 0.96:
                w.queue.wait_passed()
                w.pre.waited = True
            elif event < 0.97:  # the service reads the stream's first sequence (`_watch_streams`)
                w.pre.builder.gone_below(min(w.queue.msgs, default=w.queue.last_seq + 1))
        except Killed:
            if event < 0.3:
                kills["generator"] += 1
                gen.restart()
                continue
            kills["preprocessor"] += 1
            if rnd.random() < 0.5:  # the acknowledgements in flight reach the server, or die with it
                w.pre.flush()
            w.pre = Preprocessor(w)
    assert w.trainer.version >= steps, f"seed {seed}: only {w.trainer.version} steps trained ({dict(kills)})"
    check_books(w)
    return w


def check_books(w: World) -> None:
    spec, trainer = w.spec, w.trainer
    trained_steps = [trainer.steps[s] for s in range(trainer.version)]
    settled: Counter = Counter()  # group id -> steps that settled it
    credited: Counter = Counter()
    for step, mbs in enumerate(trained_steps):
        ledger = mbs[-1].ledger
        # A full batch, and the samples are those of the ledger's trained groups, each whole.
        samples = Counter(g for mb in mbs for g in mb.group_ids)
        assert sum(samples.values()) == ledger.samples == spec.trainer.samples_per_step, step
        assert samples == {e.id: e.samples for e in ledger.entries(Outcome.TRAINED)}, step
        assert ledger.trained_groups == spec.groups_per_step
        settled.update(gid for gid in w.published if ledger.settles(gid))  # untrained ones folded too
        credited.update(ledger.credits)
    # Trained at most once, settled once, the trainer's credits are the ledgers'.
    assert max(settled.values()) == 1, [g for g, n in settled.items() if n > 1]
    assert trainer.trained == credited
    # None lost: every group is settled by a trained step or by one stored and not yet trained
    # (once: the newest ledger of each stored step), or still waiting in the stream.
    newest: dict[int, books.StepLedger] = {}
    for stored in w.batches:
        for mb in (m.decode(d, m.MicroBatch) for d in stored):
            if mb.step not in newest or mb.ledger.waves > newest[mb.step].waves:
                newest[mb.step] = mb.ledger
    everywhere = Counter(gid for ledger in newest.values() for gid in w.published if ledger.settles(gid))
    assert max(everywhere.values()) == 1, [g for g, n in everywhere.items() if n > 1]
    waiting = set()
    for _, data in w.queue.msgs.values():
        try:
            waiting.add(m.decode(data, m.RolloutGroup).group_id)
        except m.MessageError:
            pass
    lost = [gid for gid in w.published if gid not in everywhere and gid not in waiting]
    assert not lost, f"groups lost: {lost}"
    # Every generator's admission queue, continued from the books, is its groups not settled yet.
    for gen in w.generators:
        gen.restart()
        mine = [g for g in w.published.values() if g.generator == gen.rank]
        unsettled = [g for g in mine if not counts_as_discarded(spec, g) and g.group_id not in settled]
        queued = gen.published - gen.discarded - w.announced.trained_groups.get(str(gen.rank), 0)
        assert queued == len(unsettled), (gen.rank, queued, [g.group_id for g in unsettled])


def job(**spec):
    base = {
        "model": {"maxSeqLen": 8},
        "generator": {"sampling": {"maxTokens": 4}},
        "rl": {"attempts": ATTEMPTS, "maxLag": 1},
        "trainer": {"samplesPerStep": 8, "microBatchTokens": 16},
    }
    for key, value in spec.items():
        base[key] = base.get(key, {}) | value if isinstance(value, dict) else value
    return parse_job({"metadata": {"name": "books"}, "spec": base}).spec


CASES = {
    # Waves of rows of 16 tokens (several per step), on one to three ranks.
    "pipeline, 1 rank": (job(), 1, 2),
    "pipeline, 3 ranks": (job(), 3, 1),
    "pipeline, 2 ranks, filter off": (job(rl={"filterZeroVariance": False}), 2, 2),
    # One wave a step (token weighting), and the conventional baseline's phases of 2 steps.
    "token weighting, 2 ranks": (job(rl={"tokenWeighting": "token"}), 2, 1),
    "sync, 2 steps a phase": (job(mode="sync", rl={"maxLag": None, "stepsPerGeneration": 2}), 2, 2),
}


# Seeds that found a fault the first 16 miss (as the model draws now): 444, a group of a wave
# stored in part whose delivery was lost on the way, hidden by a nats-server restart from the
# catch-up's count (`StepBuilder.torn_waits`).
FOUND = {"pipeline, 3 ranks": [444]}


@pytest.mark.parametrize("case", CASES)
def test_the_books_balance_whatever_fails_when(case):
    spec, ranks, generators = CASES[case]
    for seed in [*range(16), *FOUND.get(case, [])]:
        run(seed, spec, ranks, generators, steps=10)
