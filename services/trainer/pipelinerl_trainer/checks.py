"""What the samples of a micro-batch must satisfy before the model sees them (pure): what the
preprocessor cannot check without the model. A micro-batch holding bad samples is dead-lettered
as it came, and trained without them: they are blanked in place (valid token and position ids,
zero weight), so the row keeps its shape, the ranks' collectives stay in step, and a replay of
the same batch cannot crash the trainer again."""

from __future__ import annotations

import math

from pipelinerl import messages as m


def spans(mb: m.MicroBatch) -> list[tuple[int, int]]:
    """(start, end) of each packed sample of `mb` in its row."""
    out, start = [], 0
    for n in mb.lengths:
        out.append((start, start + n))
        start += n
    return out


def bad_samples(mb: m.MicroBatch, vocab_size: int, max_positions: int | None) -> dict[int, str]:
    """Sample index → why the model cannot train it, for each such sample of `mb` (C-speed scans
    of each sample's slices; the loop is over samples, not tokens)."""
    bad: dict[int, str] = {}
    for sid, (a, b) in enumerate(spans(mb)):
        tokens, positions = mb.tokens[a:b], mb.positions[a:b]
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            token = next(t for t in tokens if not 0 <= t < vocab_size)
            bad[sid] = f"token id {token} is outside the model's vocabulary (size {vocab_size})"
        elif min(positions) < 0 or (max_positions is not None and max(positions) >= max_positions):
            pos = min(positions) if min(positions) < 0 else max(positions)
            bad[sid] = f"position id {pos} is outside the model's 0..{max_positions}"
        else:
            for name in ("logprobs", "advantages", "weights"):
                values = getattr(mb, name)[a:b]
                if not all(map(math.isfinite, values)):
                    j = a + next(k for k, v in enumerate(values) if not math.isfinite(v))
                    bad[sid] = f"non-finite {name[:-1]} at token {j}"
                    break
    return bad


def describe(mb: m.MicroBatch, bad: dict[int, str]) -> str:
    return "; ".join(
        f"sample {sid} (group {mb.group_ids[sid] if sid < len(mb.group_ids) else '?'}): {why}"
        for sid, why in sorted(bad.items())
    )


def without(mb: m.MicroBatch, bad: set[int]) -> m.MicroBatch:
    """`mb` with the `bad` samples blanked: token 0 at position 0, nothing to learn from (each
    keeps its length, so the row's sequences stay where they were), and no reward: the step's
    trained samples and their reward count them out (`StepTally`: `samples` less `rejected`)."""
    keep = [sid not in bad for sid, n in enumerate(mb.lengths) for _ in range(n)]

    def blank(values: list, zero) -> list:
        return [v if k else zero for v, k in zip(values, keep)]

    return mb.model_copy(
        update=dict(
            tokens=blank(mb.tokens, 0),
            positions=blank(mb.positions, 0),
            mask=blank(mb.mask, 0),
            advantages=blank(mb.advantages, 0.0),
            logprobs=blank(mb.logprobs, 0.0),
            weights=blank(mb.weights, 0.0),
            versions=blank(mb.versions, -1),
            rewards=[0.0 if sid in bad else r for sid, r in enumerate(mb.rewards)],
        )
    )
