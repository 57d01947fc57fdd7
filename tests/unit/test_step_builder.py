"""The preprocessor's step builder (pure) on a delivery lost on the way: a connection dropped with
a message in flight, JetStream delivers the later ones first and that one again only after the
acknowledgement wait. (The books' property test draws such losses at random, among every other
fault; this is the case it found, spelled out.)"""

from pipelinerl import books
from pipelinerl import messages as m
from pipelinerl.spec import parse_job
from pipelinerl_preprocessor.builder import StepBuilder


def spec(samples: int, tokens: int):
    """A job of groups of two samples of 3 tokens, `samples` a step, micro-batches of `tokens`."""
    job = {
        "model": {"maxSeqLen": 8},
        "generator": {"sampling": {"maxTokens": 4}},
        "rl": {"attempts": 2},
        "trainer": {"samplesPerStep": samples, "microBatchTokens": tokens},
    }
    return parse_job({"metadata": {"name": "builder"}, "spec": job}).spec


SPEC = spec(4, 64)  # two groups a step


def group(n: int) -> m.RolloutGroup:
    s = m.Sample(tokens=[3, 4, 5], mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], reward=1.0)
    return m.RolloutGroup(group_id=f"p#{n}@0", generator=0, samples=[s, s.model_copy(update={"reward": 0.0})])


def marks(wave) -> tuple[int, list[int]]:
    """The settled sequences its ledger carries: the mark, and those settled above it."""
    return wave.batches[0].ledger.settled_through, wave.batches[0].ledger.settled_above


def deliver(b: StepBuilder, seq: int) -> bool:
    """As the service takes a message: True where it is new (taken)."""
    if b.returned(seq, f"p#{seq}@0", seq):
        return False
    assert b.take(seq, group(seq)) is None
    return True


def test_a_delivery_lost_on_the_way_is_new_when_it_comes_again_after_later_ones():
    b = StepBuilder(SPEC, 1, books.restore([None]), caught_up=True)
    assert all(deliver(b, seq) for seq in (1, 2, 3, 5))  # 4 lost on the way
    first, second = b.next_wave(), b.next_wave()
    assert first and second and sorted(first.acks + second.acks) == [1, 2, 3, 5]
    assert marks(second) == (3, [5])  # 4 not seen: the mark stops there
    b.gone_below(4)  # the stream still holds 4 (unacknowledged): nothing passed
    assert (b.mark, b.settled_seqs) == (3, {5})
    assert deliver(b, 4)  # after the wait: taken, not mistaken for settled and acknowledged untrained
    assert deliver(b, 6) and not deliver(b, 5)  # 5 was settled: delivered again (a lost ack), not taken
    wave = b.next_wave()
    assert wave and sorted(wave.acks) == [4, 5, 6] and wave.batches[0].group_ids == ["p#4@0"] * 2 + ["p#6@0"] * 2
    assert marks(wave) == (6, [])


def test_the_mark_passes_sequences_never_seen_once_the_stream_holds_none_below():
    b = StepBuilder(SPEC, 1, books.restore([None]), caught_up=True)
    assert all(deliver(b, seq) for seq in (1, 2, 7, 8))  # 3-6 never delivered: gone from the stream
    b.next_wave()
    assert marks(b.next_wave()) == (2, [7, 8])
    b.gone_below(9)
    assert (b.mark, b.settled_seqs) == (8, set())  # what the next wave's ledger carries
    assert not deliver(b, 5)  # below the mark: settled


def test_a_wave_stored_in_part_that_packs_differently_now_is_refused_by_name():
    """A wave a kill left stored in part is packed again from the same groups; packed differently
    now (the job's micro-batch size changed across the restart), even to fewer micro-batches than
    were stored, the builder says so, naming the rank and micro-batch, instead of going on."""
    import pytest

    b = StepBuilder(spec(8, 8), 1, books.restore([None]), caught_up=True)
    assert all(deliver(b, seq) for seq in (1, 2, 3, 4))
    wave = b.next_wave()
    assert wave and len(wave.batches) >= 3  # 8 samples of 3 tokens, two to a row of 8
    restored = books.restore([wave.batches[1]])  # killed after its second micro-batch was stored
    again = StepBuilder(spec(8, 32), 1, restored, caught_up=True)  # now all in one micro-batch
    assert all(deliver(again, seq) for seq in (1, 2, 3, 4))
    with pytest.raises(RuntimeError, match=r"rank 0, micro-batch 1: nothing where \['p#"):
        again.next_wave()


def test_a_step_continued_under_a_job_of_fewer_groups_a_step_closes_with_what_it_holds():
    """samplesPerStep lowered across a restart, with the step in progress holding more groups than
    a step now takes: it is closed with what it holds (a wave of the books alone), not handed a
    negative count of groups to take (all but the last few pending, before)."""

    b = StepBuilder(spec(8, 8), 1, books.restore([None]), caught_up=True)  # four groups a step
    stored = []
    for seq in (1, 2):  # each group more than a row holds: a wave of its own, the step not ended
        assert deliver(b, seq)
        wave = b.next_wave()
        assert wave is not None and not wave.last and wave.groups == 1
        stored += wave.batches
    again = StepBuilder(spec(2, 8), 1, books.restore([stored[-1]]), caught_up=True)  # now one group a step
    assert deliver(again, 3)
    closing = again.next_wave()
    assert closing is not None and closing.last and (closing.step, closing.groups) == (0, 0)
    taken = again.next_wave()  # the next step takes the pending group
    assert taken is not None and (taken.step, taken.groups, taken.last) == (1, 1, True)


def test_a_step_of_many_filtered_groups_carries_a_ledger_of_bounded_size():
    """A step closes only once its groups are trained: on a task the policy always or never solves,
    it settles many times that many filtered groups first, in waves of the books alone. Their
    ledgers name the untrained groups of their own wave only, the earlier folded into counts and
    index ranges (`books.Folded`): a ledger naming all of them on every micro-batch grew with the
    square of the step and passed NATS's largest message. The books read the same."""
    b = StepBuilder(SPEC, 1, books.restore([None]), caught_up=True)
    solved = m.Sample(tokens=[3, 4, 5], mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0], reward=1.0)
    sizes, seq = [], 0
    for seq in range(1, 2001):
        filtered = m.RolloutGroup(group_id=f"p#{seq}@0", generator=0, samples=[solved, solved])
        assert b.take(seq, filtered) == books.Outcome.FILTERED
        wave = b.next_wave()
        if wave is not None:
            assert wave.groups == 0 and len(wave.acks) == SPEC.groups_per_step
            sizes.append(len(m.encode(wave.batches[0])))
    assert len(sizes) == 1000 and max(sizes) < 700, sizes[-1]  # wholly named, the last was 66 KB
    assert deliver(b, 2001) and deliver(b, 2002)
    closing = b.next_wave()
    assert closing is not None and closing.last and closing.groups == 2
    ledger = closing.batches[-1].ledger
    assert (ledger.trained_groups, ledger.filtered, ledger.credits, ledger.sampled_reward) == (
        2,
        2000,
        {"0": 2},
        4002 / 4004,
    )
    assert ledger.settled_indices() == [(1, 2003)]
    assert all(ledger.settles(f"p#{n}@0") for n in (1, 999, 2000, 2002)) and not ledger.settles("p#2003@0")
