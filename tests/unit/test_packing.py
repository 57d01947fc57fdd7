import pytest

from pipelinerl.messages import MicroBatch, Sample
from pipelinerl.steps import next_wave
from pipelinerl_preprocessor.packing import StepSample, fill_ranks, first_fit_rows, pack_wave, spread_rows, step_weight


def sample(n_prompt: int, n_gen: int, reward: float = 1.0, version: int = 0) -> Sample:
    n = n_prompt + n_gen
    return Sample(
        tokens=list(range(n)),
        mask=[0] * n_prompt + [1] * n_gen,
        logprobs=[0.0] * n_prompt + [-0.5] * n_gen,
        versions=[-1] * n_prompt + [version] * n_gen,
        reward=reward,
    )


def test_first_fit_decreasing():
    rows = first_fit_rows([5, 7, 3, 2, 6], capacity=10)
    # Decreasing order 7, 6, 5, 3, 2: the 3 joins the 7, the 2 joins the 6.
    assert rows == [[1, 2], [4, 3], [0]]
    with pytest.raises(ValueError, match="exceeds micro-batch"):
        first_fit_rows([11], capacity=10)


def test_spread_balances_tokens():
    per_rank = spread_rows([10, 9, 8, 1, 1, 1], ranks=2)
    loads = [sum([10, 9, 8, 1, 1, 1][r] for r in rows) for rows in per_rank]
    assert sorted(loads) == [13, 17]  # the best split of these rows (total 30)


def test_pack_wave_positions_weights_and_equal_counts():
    samples = [StepSample(sample(3, 4 + i % 3), advantage=float(i)) for i in range(7)]
    out = pack_wave(
        step=5,
        samples=samples,
        ranks=3,
        micro_batch_tokens=16,
        weight=step_weight(samples, "sample", 7),
        first_index=4,
        last=True,
    )
    assert len(out) == 3
    counts = {len(r) for r in out}
    assert len(counts) == 1  # every rank runs the same number of micro-batches
    for r in out:  # numbered on from first_index; only each rank's final one ends the step
        assert [mb.index for mb in r] == list(range(4, 4 + len(r)))
        assert [mb.last for mb in r] == [False] * (len(r) - 1) + [True]
    real = [mb for r in out for mb in r if not mb.is_sentinel]
    assert all(len(mb.tokens) <= 16 for mb in real)
    assert sum(len(mb.rewards) for mb in real) == 7  # every sample packed exactly once
    for mb in real:
        starts = [i for i, p in enumerate(mb.positions) if p == 0]
        assert len(starts) == len(mb.rewards)  # positions restart per sample
        # and each sample's length travels with the row: the trainer's sequence boundaries
        assert [sum(mb.lengths[:k]) for k in range(len(mb.lengths))] == starts
        assert MicroBatch.model_validate(mb.model_dump()) == mb  # valid on the wire
        assert all(w == pytest.approx(1 / 7) for w, m in zip(mb.weights, mb.mask) if m)
        assert all(w == 0 for w, m in zip(mb.weights, mb.mask) if not m)
        assert mb.step == 5
    advs = sorted({a for mb in real for a in mb.advantages})
    assert advs == [float(i) for i in range(7)]


def test_token_weighting_sums_to_one_and_sentinels():
    samples = [StepSample(sample(2, 3), 1.0), StepSample(sample(2, 5), -1.0)]
    out = pack_wave(step=0, samples=samples, ranks=4, micro_batch_tokens=64, weight=step_weight(samples, "token", 2))
    total = sum(sum(mb.weights) for r in out for mb in r)
    assert total == pytest.approx(1.0)
    sentinels = [mb for r in out for mb in r if mb.is_sentinel]
    assert len(sentinels) == 3 and all(len(r) == 1 and not r[0].last for r in out)
    # "sample" weighting is known before the step is complete: 1 / samples per step.
    assert step_weight(samples, "sample", 128) == 1 / 128


def test_next_wave_streams_full_rows_and_ends_the_step():
    groups = [[10] * 4] * 5  # five groups of four 10-token samples (40 tokens each)
    # The step (4 groups) is complete: everything it needs goes, and ends it.
    assert next_wave(groups, 0, 4, 1, 64, stream=True) == (4, True)
    assert next_wave(groups[:2], 2, 4, 1, 64, stream=True) == (2, True)
    assert next_wave(groups[:2], 6, 4, 1, 64, stream=True) == (0, True)  # continued with fewer groups a step
    # Not complete: a wave leaves once more is pending than is sure to fit one row per rank
    # (2 ranks x (64 - 10) = 108 tokens: two groups do, the third does not).
    assert next_wave(groups[:2], 0, 8, 2, 64, stream=True) == (0, False)
    assert next_wave(groups[:3], 0, 8, 2, 64, stream=True) == (2, False)
    assert next_wave(groups[:3], 0, 8, 2, 64, stream=False) == (0, False)  # sync: whole steps only
    # A group larger than one row per rank goes alone.
    assert next_wave([[30] * 4, [5]], 0, 8, 1, 64, stream=True) == (1, False)


def test_waves_always_pack_into_one_row_per_rank():
    import random

    rnd = random.Random(0)
    for _ in range(200):
        ranks, cap = rnd.randint(1, 4), rnd.randint(20, 200)
        groups = [[rnd.randint(1, cap // 2) for _ in range(rnd.randint(1, 6))] for _ in range(12)]
        n, last = next_wave(groups, 0, 99, ranks, cap, stream=True)
        if n > 1:  # a single oversized group may take more rows
            samples = [StepSample(sample(0, k), 0.0) for g in groups[:n] for k in g]
            assert all(len(r) == 1 for r in pack_wave(0, samples, ranks, cap, 1.0))


def test_sentinels_bring_every_rank_to_the_end_of_a_wave_stored_in_part():
    # Rank 0 has stored through index 3, rank 1 through 1, rank 2 none of the step; the wave ends at 4.
    out = fill_ranks(4, {0: 3, 1: 1, 2: -1}, 4, last=True)
    assert [(b.rank, b.index, b.last) for b in out] == [
        (0, 4, True),
        (1, 2, False),
        (1, 3, False),
        (1, 4, True),
        (2, 0, False),
        (2, 1, False),
        (2, 2, False),
        (2, 3, False),
        (2, 4, True),
    ]
    assert all(b.step == 4 and b.is_sentinel for b in out)
    assert [(b.rank, b.index, b.last) for b in fill_ranks(4, {0: 3, 1: 2}, 3, last=False)] == [(1, 3, False)]
