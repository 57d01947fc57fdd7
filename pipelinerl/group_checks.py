"""What a rollout group must satisfy before it is trained (pure). The preprocessor sends a group
that fails to the dead-letter stream with the reason returned here, instead of crashing a service
on every redelivery or training on garbage; its generator, which runs the same checks on what it
publishes (all but the version's, which needs the trainer's news), stops counting it as queued
(`steps.counts_as_discarded`), so it holds no place in admission. Token ids against the vocabulary
are the trainer's check (it holds the model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the planner imports the step rules, which call these: no messages there)
    from pipelinerl.messages import RolloutGroup, Sample

LOGPROB_SLACK = 1e-3  # sampling logprobs are ≤ 0; engines round a near-certain token's to a hair above


@dataclass(frozen=True)
class GroupLimits:
    max_seq_len: int  # model.maxSeqLen: a longer sample fits no micro-batch row (rows hold at least as much)
    # The newest weights that exist: the trainer's announced version + 1 (sent before announced);
    # None: not checked (a generator's own check).
    newest_version: int | None = None


def group_problem(group: RolloutGroup, limits: GroupLimits) -> str | None:
    """Why `group` cannot be trained, or None if it can."""
    if len(group.samples) < 2:  # (rl.attempts is at least 2: no generator of the job makes one)
        return "1 sample: a group needs at least 2 (its advantages' leave-one-out baseline)"
    for i, sample in enumerate(group.samples):
        problem = sample_problem(sample, limits)
        if problem:
            return f"sample {i}: {problem}"
    return None


def sample_problem(s: Sample, limits: GroupLimits) -> str | None:
    if not math.isfinite(s.reward):
        return f"reward is {s.reward}"
    if len(s.tokens) > limits.max_seq_len:
        return f"{len(s.tokens)} tokens, more than model.maxSeqLen ({limits.max_seq_len})"
    if min(s.tokens) < 0:
        return f"negative token id {min(s.tokens)}"
    if s.mask and s.mask[0]:  # packed, a sample's first token is predicted from the row before it
        return "its first token is generated (a sample starts with its prompt)"
    for j, (mask, lp, v) in enumerate(zip(s.mask, s.logprobs, s.versions)):
        if mask not in (0, 1):
            return f"mask {mask} at token {j} (0 or 1)"
        if not mask:
            continue
        if not (math.isfinite(lp) and lp <= LOGPROB_SLACK):
            return f"logprob {lp} at token {j} (a finite value <= 0)"
        if v < 0:
            return f"version {v} at generated token {j}"
        if limits.newest_version is not None and v > limits.newest_version:
            return f"version {v} at token {j} is ahead of the trainer (newest weights: version {limits.newest_version})"
    return None
