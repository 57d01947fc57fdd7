import pytest

from pipelinerl_preprocessor.advantages import group_advantages


def test_leave_one_out_by_hand():
    # r = [1, 0, 0, 1]: baseline of attempt 0 is mean(0, 0, 1) = 1/3.
    assert group_advantages([1, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert group_advantages([3, 1]) == pytest.approx([2, -2])


def test_std_normalisation_by_hand():
    # mean 0.5, population std 0.5 → LOO advantages (±2/3) divided by 0.5 + 1e-4.
    adv = group_advantages([1, 0, 0, 1], normalize_std=True)
    assert adv == pytest.approx([2 / 3 / 0.5001, -2 / 3 / 0.5001, -2 / 3 / 0.5001, 2 / 3 / 0.5001])


def test_equal_rewards_give_zero():
    assert group_advantages([0.5] * 4, normalize_std=True) == [0, 0, 0, 0]


def test_group_of_one_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])
