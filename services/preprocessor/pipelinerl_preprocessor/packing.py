"""Packing one optimizer step's samples into micro-batches for every trainer rank (pure).

Samples go into rows of at most `micro_batch_tokens` tokens (first-fit decreasing), position
ids restart at 0 for every sample so attention stays within it, rows are spread over ranks to
balance tokens, and every rank gets the same number of micro-batches (empty sentinels fill
the gaps) so the ranks' collectives stay in lock-step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.messages import MicroBatch, Sample


@dataclass
class StepSample:
    sample: Sample
    advantage: float


def token_weights(samples: list[StepSample], weighting: str) -> float:
    """Per-token loss weight of the step: 1/samples ("sample") or 1/trained tokens ("token")."""
    if weighting == "sample":
        return 1.0 / max(1, len(samples))
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


def pack_step(
    step: int, samples: list[StepSample], ranks: int, micro_batch_tokens: int, weighting: str,
    groups_filtered: int = 0,
) -> list[list[MicroBatch]]:
    """Micro-batches for each rank (outer list) for optimizer step `step`."""
    weight = token_weights(samples, weighting)
    lengths = [len(s.sample.tokens) for s in samples]
    rows = first_fit_rows(lengths, micro_batch_tokens)
    per_rank = spread_rows([sum(lengths[i] for i in row) for row in rows], ranks)
    count = max(1, max(len(r) for r in per_rank))
    out: list[list[MicroBatch]] = []
    for rank, row_ids in enumerate(per_rank):
        batches = [_row(step, rank, k, count, [samples[i] for i in rows[r]], weight) for k, r in enumerate(row_ids)]
        batches += [MicroBatch(step=step, rank=rank, index=k, count=count) for k in range(len(batches), count)]
        for b in batches:
            b.step_samples, b.step_groups_filtered = len(samples), groups_filtered
        out.append(batches)
    return out


def _row(step: int, rank: int, index: int, count: int, items: list[StepSample], weight: float) -> MicroBatch:
    mb = MicroBatch(step=step, rank=rank, index=index, count=count)
    for sid, item in enumerate(items):
        s = item.sample
        n = len(s.tokens)
        mb.tokens += s.tokens
        mb.positions += list(range(n))
        mb.mask += s.mask
        mb.advantages += [item.advantage] * n
        mb.logprobs += s.logprobs
        mb.versions += s.versions
        mb.weights += [weight * m for m in s.mask]
        mb.sample_ids += [sid] * n
        mb.rewards.append(s.reward)
    return mb
