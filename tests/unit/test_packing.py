import pytest

from pipelinerl.messages import Sample
from pipelinerl_preprocessor.packing import StepSample, first_fit_rows, pack_step, spread_rows


def sample(n_prompt: int, n_gen: int, reward: float = 1.0, version: int = 0) -> Sample:
    n = n_prompt + n_gen
    return Sample(tokens=list(range(n)), mask=[0] * n_prompt + [1] * n_gen,
                  logprobs=[0.0] * n_prompt + [-0.5] * n_gen, versions=[-1] * n_prompt + [version] * n_gen,
                  reward=reward)


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


def test_pack_step_positions_weights_and_equal_counts():
    samples = [StepSample(sample(3, 4 + i % 3), advantage=float(i)) for i in range(7)]
    out = pack_step(step=5, samples=samples, ranks=3, micro_batch_tokens=16, weighting="sample")
    assert len(out) == 3
    counts = {len(r) for r in out}
    assert len(counts) == 1  # every rank runs the same number of micro-batches
    real = [mb for r in out for mb in r if not mb.is_sentinel]
    assert all(len(mb.tokens) <= 16 for mb in real)
    assert sum(len(mb.rewards) for mb in real) == 7  # every sample packed exactly once
    for mb in real:
        starts = [i for i, p in enumerate(mb.positions) if p == 0]
        assert len(starts) == len(mb.rewards)  # positions restart per sample
        assert all(w == pytest.approx(1 / 7) for w, m in zip(mb.weights, mb.mask) if m)
        assert all(w == 0 for w, m in zip(mb.weights, mb.mask) if not m)
        assert mb.step == 5 and mb.step_samples == 7
    advs = sorted({a for mb in real for a in mb.advantages})
    assert advs == [float(i) for i in range(7)]


def test_token_weighting_sums_to_one_and_sentinels():
    samples = [StepSample(sample(2, 3), 1.0), StepSample(sample(2, 5), -1.0)]
    out = pack_step(step=0, samples=samples, ranks=4, micro_batch_tokens=64, weighting="token")
    total = sum(sum(mb.weights) for r in out for mb in r)
    assert total == pytest.approx(1.0)
    sentinels = [mb for r in out for mb in r if mb.is_sentinel]
    assert len(sentinels) == 3 and all(mb.count == 1 for mb in sentinels)
