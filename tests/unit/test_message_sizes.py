"""The encoded sizes per token that size the streams and bound what a job may publish
(`pipelinerl.contracts`: BATCH_BYTES_PER_TOKEN, ROLLOUT_BYTES_PER_TOKEN; `spec`: a rollout group
and a micro-batch must fit in `nats.maxPayloadMb`) hold for the largest values a message carries:
token ids of a 152K vocabulary, versions past 100,000, full-precision floats, long group ids,
short samples packed many to a row."""

from __future__ import annotations

import random

import pytest

from pipelinerl.contracts import BATCH_BYTES_PER_TOKEN, ROLLOUT_BYTES_PER_TOKEN
from pipelinerl.messages import MicroBatch, RolloutGroup, Sample, encode

R = random.Random(0)
GROUP_ID = "openr1-math-train-123456#1234567@1023"


def ids(n: int) -> list[int]:
    return [R.randrange(100_000, 152_000) for _ in range(n)]


def floats(n: int) -> list[float]:
    return [R.gauss(0, 3) for _ in range(n)]


@pytest.mark.parametrize(("attempts", "tokens"), [(4, 256), (8, 4096), (16, 2048)])
def test_a_rollout_group_takes_at_most_its_bytes_per_token(attempts: int, tokens: int) -> None:
    prompt = tokens // 4
    sample = dict(
        mask=[0] * prompt + [1] * (tokens - prompt),
        versions=[-1] * prompt + [R.randrange(10**5, 10**6)] * (tokens - prompt),
        reward=R.random(),
    )
    samples = [Sample(tokens=ids(tokens), logprobs=floats(tokens), **sample) for _ in range(attempts)]
    group = RolloutGroup(group_id=GROUP_ID, generator=1023, samples=samples)
    assert len(encode(group)) <= attempts * tokens * ROLLOUT_BYTES_PER_TOKEN


@pytest.mark.parametrize("per_sample", [12, 64, 4096])
def test_a_micro_batch_takes_at_most_its_bytes_per_token(per_sample: int) -> None:
    samples = 8192 // per_sample
    n = samples * per_sample
    batch = MicroBatch(
        step=10**6,
        rank=63,
        index=1000,
        tokens=ids(n),
        positions=[i % per_sample for i in range(n)],
        mask=[1] * n,
        advantages=floats(n),
        logprobs=floats(n),
        versions=[R.randrange(10**5, 10**6) for _ in range(n)],
        weights=floats(n),
        lengths=[per_sample] * samples,
        rewards=floats(samples),
        group_ids=[GROUP_ID] * samples,
    )
    assert len(encode(batch)) <= n * BATCH_BYTES_PER_TOKEN  # its books (the ledger) are bounded apart
