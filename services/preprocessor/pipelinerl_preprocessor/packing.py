"""Packing an optimizer step's samples into micro-batches for every trainer rank (pure).

A step is published in waves as its groups arrive (`pipelinerl.steps.next_wave`), so the trainer can compute on
the first micro-batches while the rest is generated. Within a wave, samples go into rows of at
most `micro_batch_tokens` tokens (first-fit decreasing), position ids restart at 0 for every
sample and each sample's length travels with the row (the trainer's attention stays within
it), rows are spread over ranks to balance tokens, and every rank gets the same number of
micro-batches (empty sentinels fill the gaps) so the ranks' collectives stay in lock-step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.messages import MicroBatch, Sample


@dataclass
class StepSample:
    sample: Sample
    advantage: float
    group_id: str = ""


def step_weight(samples: list[StepSample], weighting: str, samples_per_step: int) -> float:
    """Per-token loss weight of a step: 1/samples per step ("sample"), known before the step is
    complete, or 1/its trained tokens ("token"), known only once it is (so it is not streamed)."""
    if weighting == "sample":
        return 1.0 / samples_per_step
    if weighting == "token":
        return 1.0 / max(1, sum(s.sample.num_generated for s in samples))
    raise ValueError(f"unknown token weighting {weighting!r}")


def first_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of items per row; first-fit decreasing bin packing."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"sample of {lengths[i]} tokens exceeds micro-batch of {capacity} tokens")
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def spread_rows(row_tokens: list[int], ranks: int) -> list[list[int]]:
    """Row indices per rank, largest rows first onto the least-loaded rank."""
    per_rank: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for r in sorted(range(len(row_tokens)), key=lambda r: -row_tokens[r]):
        k = min(range(ranks), key=lambda k: (load[k], len(per_rank[k])))
        per_rank[k].append(r)
        load[k] += row_tokens[r]
    return per_rank


def pack_wave(
    step: int,
    samples: list[StepSample],
    ranks: int,
    micro_batch_tokens: int,
    weight: float,
    first_index: int = 0,
    last: bool = False,
) -> list[list[MicroBatch]]:
    """One wave of step `step`: micro-batches for each rank (outer list), numbered from
    `first_index`, the same number on every rank; with `last`, each rank's final one ends the step."""
    lengths = [len(s.sample.tokens) for s in samples]
    rows = first_fit_rows(lengths, micro_batch_tokens)
    per_rank = spread_rows([sum(lengths[i] for i in row) for row in rows], ranks)
    count = max(1, max(len(r) for r in per_rank))
    out: list[list[MicroBatch]] = []
    for rank, row_ids in enumerate(per_rank):
        batches = [
            _row(step, rank, first_index + k, [samples[i] for i in rows[r]], weight) for k, r in enumerate(row_ids)
        ]
        batches += [MicroBatch(step=step, rank=rank, index=first_index + k) for k in range(len(batches), count)]
        batches[-1].last = last
        out.append(batches)
    return out


def fill_ranks(step: int, stored: dict[int, int], last_index: int, last: bool) -> list[MicroBatch]:
    """Sentinels that bring every rank up to micro-batch `last_index` of `step` (`stored`: rank ->
    its last index stored), the final one marked `last`: the ranks' passes stay alike when a wave
    stored in part cannot be published again (`StepBuilder`)."""
    return [
        MicroBatch(step=step, rank=rank, index=index, last=last and index == last_index)
        for rank, through in sorted(stored.items())
        for index in range(through + 1, last_index + 1)
    ]


def _row(step: int, rank: int, index: int, items: list[StepSample], weight: float) -> MicroBatch:
    mb = MicroBatch(step=step, rank=rank, index=index)
    for item in items:
        s = item.sample
        n = len(s.tokens)
        mb.tokens += s.tokens
        mb.positions += list(range(n))
        mb.mask += s.mask
        mb.advantages += [item.advantage] * n
        mb.logprobs += s.logprobs
        mb.versions += s.versions
        mb.weights += [weight * m for m in s.mask]
        mb.lengths.append(n)
        mb.rewards.append(s.reward)
        mb.group_ids.append(item.group_id)
    return mb
