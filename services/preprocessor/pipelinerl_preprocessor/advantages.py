"""Group-relative advantages (pure)."""

from __future__ import annotations

import math

STD_EPS = 1e-4


def group_advantages(rewards: list[float], normalize_std: bool = False) -> list[float]:
    """A_i = r_i − mean of the *other* attempts' rewards (leave-one-out baseline).

    Leave-one-out keeps the baseline independent of the sample it is subtracted from (an
    unbiased estimator); it equals G/(G−1)·(r_i − mean). With `normalize_std` the result is
    divided by the group's standard deviation (+1e-4 so equal rewards stay finite).
    """
    g = len(rewards)
    if g < 2:
        raise ValueError("a group needs at least 2 attempts for a leave-one-out baseline")
    total = sum(rewards)
    adv = [r - (total - r) / (g - 1) for r in rewards]
    if normalize_std:
        mean = total / g
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / g)
        adv = [a / (std + STD_EPS) for a in adv]
    return adv
