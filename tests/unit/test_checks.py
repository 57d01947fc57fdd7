"""The checks a rollout group and a micro-batch's samples pass before training (pure): each
failure named, with the sample, token or field at fault."""

import math

import pytest

from pipelinerl import messages as m
from pipelinerl.books import StepLedger
from pipelinerl.group_checks import GroupLimits, group_problem
from pipelinerl_trainer.checks import bad_samples, describe, without

LIMITS = GroupLimits(max_seq_len=8, newest_version=5)


def sample(**change) -> m.Sample:
    base = dict(
        tokens=[3, 4, 5, 6], mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -1e-7], versions=[-1, -1, 4, 5], reward=1.0
    )
    return m.Sample(**(base | change))


def group(*samples: m.Sample) -> m.RolloutGroup:
    return m.RolloutGroup(group_id="p1@0", generator=0, samples=list(samples))


def test_a_sound_group_passes():
    assert group_problem(group(sample(), sample(reward=0.0)), LIMITS) is None
    assert group_problem(group(sample(), sample(logprobs=[0.0, 0.0, -0.5, 5e-4])), LIMITS) is None  # engine rounding


def test_a_group_of_one_sample_is_refused():
    """One sample has no leave-one-out baseline: taken, it crashed the preprocessor on every
    redelivery. (Groups of another size than rl.attempts are trained: a job whose rl.attempts
    changed still has the old size's groups queued, counted in its generators' queues.)"""
    assert (
        group_problem(group(sample()), LIMITS)
        == "1 sample: a group needs at least 2 (its advantages' leave-one-out baseline)"
    )
    assert group_problem(group(sample(), sample(), sample(reward=0.0)), LIMITS) is None


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(reward=math.nan), "sample 1: reward is nan"),
        (dict(reward=math.inf), "sample 1: reward is inf"),
        (
            dict(tokens=list(range(9)), mask=[0] * 8 + [1], logprobs=[0.0] * 9, versions=[-1] * 8 + [5]),
            "sample 1: 9 tokens, more than model.maxSeqLen (8)",
        ),
        (dict(tokens=[3, -1, 5, 6]), "sample 1: negative token id -1"),
        (dict(mask=[0, 2, 1, 1]), "sample 1: mask 2 at token 1 (0 or 1)"),
        (dict(mask=[1, 0, 1, 1], versions=[5, -1, 5, 5]), "sample 1: its first token is generated"),
        (dict(logprobs=[0.0, 0.0, math.nan, -1.0]), "sample 1: logprob nan at token 2"),
        (dict(logprobs=[0.0, 0.0, -math.inf, -1.0]), "sample 1: logprob -inf at token 2"),
        (dict(logprobs=[0.0, 0.0, 0.7, -1.0]), "sample 1: logprob 0.7 at token 2"),
        (dict(versions=[-1, -1, -1, 5]), "sample 1: version -1 at generated token 2"),
        (dict(versions=[-1, -1, 4, 1_000_000]), "sample 1: version 1000000 at token 3 is ahead of the trainer"),
    ],
)
def test_each_poison_is_named(change, expected):
    assert group_problem(group(sample(), sample(**change)), LIMITS).startswith(expected)


def test_versions_up_to_the_newest_weights_pass_and_prompt_tokens_are_not_versioned():
    assert group_problem(group(sample(), sample(versions=[-1, -1, 5, 5])), LIMITS) is None
    assert group_problem(group(sample(), sample(versions=[-1, -1, 5, 6])), LIMITS) is not None
    assert (
        group_problem(group(sample(), sample(logprobs=[7.0, 0.0, -0.5, -0.5])), LIMITS) is None
    )  # prompt: not sampled


def micro_batch(**change) -> m.MicroBatch:
    """Two packed samples: tokens 0-2 are sample 0 (group a), 3-5 sample 1 (group b)."""
    base = dict(
        step=3,
        rank=0,
        index=2,
        last=True,
        tokens=[1, 2, 3, 1, 4, 5],
        positions=[0, 1, 2, 0, 1, 2],
        mask=[0, 1, 1, 0, 1, 1],
        advantages=[0.0, 1.0, 1.0, 0.0, -1.0, -1.0],
        logprobs=[0.0, -1.0, -2.0, 0.0, -0.5, -0.5],
        versions=[-1, 2, 2, -1, 2, 2],
        weights=[0.0, 0.1, 0.1, 0.0, 0.1, 0.1],
        lengths=[3, 3],
        rewards=[1.0, 0.0],
        group_ids=["a", "b"],
        ledger=StepLedger(waves=1, wave_last=2, closed=True),
    )
    return m.MicroBatch(**(base | change))


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(tokens=[1, 2, 3, 1, 4, 100]), "token id 100 is outside the model's vocabulary (size 100)"),
        (dict(tokens=[1, 2, 3, 1, -3, 5]), "token id -3 is outside"),
        (dict(positions=[0, 1, 2, 0, 1, 64]), "position id 64 is outside the model's 0..64"),
        (dict(advantages=[0.0, 1.0, 1.0, 0.0, math.nan, -1.0]), "non-finite advantage at token 4"),
        (dict(weights=[0.0, 0.1, 0.1, 0.0, 0.1, math.inf]), "non-finite weight at token 5"),
        (dict(logprobs=[0.0, -1.0, -2.0, 0.0, -math.inf, -0.5]), "non-finite logprob at token 4"),
    ],
)
def test_a_sample_the_model_cannot_take_is_named(change, expected):
    assert bad_samples(micro_batch(), 100, 64) == {}
    bad = bad_samples(micro_batch(**change), 100, 64)
    assert list(bad) == [1] and bad[1].startswith(expected)
    assert describe(micro_batch(), bad).startswith(f"sample 1 (group b): {expected}")


def test_bad_samples_are_blanked_and_the_rest_of_the_row_is_kept():
    mb = without(micro_batch(tokens=[1, 2, 3, 1, 4, 100]), {1})
    assert bad_samples(mb, 100, 64) == {}
    assert mb.tokens == [1, 2, 3, 0, 0, 0] and mb.weights == [0.0, 0.1, 0.1, 0.0, 0.0, 0.0]
    assert mb.logprobs[:3] == [0.0, -1.0, -2.0] and mb.versions == [-1, 2, 2, -1, -1, -1]
    assert len(mb.tokens) == 6 and mb.lengths == [3, 3]  # same shape, same place in the step
    assert (mb.step, mb.index, mb.last, mb.ledger) == (3, 2, True, micro_batch().ledger)
