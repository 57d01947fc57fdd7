"""What a micro-batch must satisfy before the model sees it (pure): what the preprocessor cannot
check without the model. A micro-batch that fails is dead-lettered and trained as an empty
sentinel, so the ranks' collectives stay in step and a replay cannot crash the trainer again."""

from __future__ import annotations

import math

from pipelinerl import messages as m


def micro_batch_problem(mb: m.MicroBatch, vocab_size: int, max_positions: int | None) -> str | None:
    """Why `mb` cannot be trained by a model with this vocabulary and position range, or None."""
    if mb.is_sentinel:
        return None
    bad = next((t for t in mb.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the model's vocabulary (size {vocab_size})"
    if min(mb.positions) < 0 or (max_positions is not None and max(mb.positions) >= max_positions):
        return f"position ids {min(mb.positions)}..{max(mb.positions)} outside the model's 0..{max_positions}"
    for name in ("logprobs", "advantages", "weights"):
        if not all(math.isfinite(x) for x in getattr(mb, name)):
            return f"non-finite {name}"
    return None


def as_sentinel(mb: m.MicroBatch) -> m.MicroBatch:
    """`mb` with no tokens: the same place in the step (index, last, step facts), zero contribution."""
    return mb.model_copy(update=dict(tokens=[], positions=[], mask=[], advantages=[], logprobs=[], versions=[],
                                     weights=[], sample_ids=[], rewards=[]))
