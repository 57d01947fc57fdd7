"""What the samples of a micro-batch must satisfy before the model sees them (pure): what the
preprocessor cannot check without the model. A micro-batch holding bad samples is dead-lettered
as it came, and trained without them: they are blanked in place (valid token and position ids,
zero weight), so the row keeps its shape, the ranks' collectives stay in step, and a replay of
the same batch cannot crash the trainer again."""

from __future__ import annotations

import math

from pipelinerl import messages as m


def bad_samples(mb: m.MicroBatch, vocab_size: int, max_positions: int | None) -> dict[int, str]:
    """Sample id → why the model cannot train it, for each such sample of `mb`."""
    bad: dict[int, str] = {}
    for j, sid in enumerate(mb.sample_ids):
        if sid in bad:
            continue
        token, pos = mb.tokens[j], mb.positions[j]
        if not 0 <= token < vocab_size:
            bad[sid] = f"token id {token} is outside the model's vocabulary (size {vocab_size})"
        elif pos < 0 or (max_positions is not None and pos >= max_positions):
            bad[sid] = f"position id {pos} is outside the model's 0..{max_positions}"
        else:
            name = next((n for n in ("logprobs", "advantages", "weights") if not math.isfinite(getattr(mb, n)[j])), None)
            if name:
                bad[sid] = f"non-finite {name[:-1]} at token {j}"
    return bad


def describe(mb: m.MicroBatch, bad: dict[int, str]) -> str:
    return "; ".join(f"sample {sid} (group {mb.group_ids[sid] if sid < len(mb.group_ids) else '?'}): {why}"
                     for sid, why in sorted(bad.items()))


def without(mb: m.MicroBatch, bad: set[int]) -> m.MicroBatch:
    """`mb` with the `bad` samples blanked: token 0 at position 0, nothing to learn from."""
    keep = [sid not in bad for sid in mb.sample_ids]

    def blank(values: list, zero) -> list:
        return [v if k else zero for v, k in zip(values, keep)]

    return mb.model_copy(update=dict(
        tokens=blank(mb.tokens, 0), positions=blank(mb.positions, 0), mask=blank(mb.mask, 0),
        advantages=blank(mb.advantages, 0.0), logprobs=blank(mb.logprobs, 0.0), weights=blank(mb.weights, 0.0),
        versions=blank(mb.versions, -1)))
