"""What a job holds in JetStream (pure): each stream's size, derived from the job, and their sum,
which the job reserves in the store (JetStream reserves a stream's max_bytes when it is made).

The chart's NATS store is shared by every job of the install: the operator grants each job's
account this much (its JetStream limit), and refuses a job the store cannot hold beside the jobs
created before it (`fits`), instead of letting its streams fail at start-up.
"""

from __future__ import annotations

from typing import Any

# Encoded sizes per token, with a margin over what was measured (a micro-batch's token 36 bytes,
# a rollout's 17: msgpack of the token, its mask, logprob, version, advantage and weight).
BATCH_BYTES_PER_TOKEN = 48
ROLLOUT_BYTES_PER_TOKEN = 24
MIN_STREAM_BYTES = 16 << 20
SMALL_STREAM_BYTES = {"CONTROL": 1 << 20, "METRICS": 64 << 20, "DEADLETTER": 64 << 20}


def stream_bytes(spec: Any) -> dict[str, int]:
    """Each stream's max_bytes, by its short name (`JobSubjects.stream`)."""
    step_tokens = spec.trainer.samples_per_step * spec.model.max_seq_len
    pending = spec.pending_steps
    # Batches: what a trainer restarted from its last checkpoint replays, and what is queued ahead.
    replay = (spec.trainer.checkpoint_interval or spec.trainer.max_steps) + pending + 1
    # Rollouts: groups generated but not yet taken; admission keeps them within the lag budget.
    queued = spec.max_lag + pending + 2
    return {
        "ROLLOUTS": max(MIN_STREAM_BYTES, queued * step_tokens * ROLLOUT_BYTES_PER_TOKEN),
        "BATCHES": max(MIN_STREAM_BYTES, replay * step_tokens * BATCH_BYTES_PER_TOKEN),
        **SMALL_STREAM_BYTES,
    }


def reserved_bytes(spec: Any) -> int:
    return sum(stream_bytes(spec).values())


def fits(store_bytes: int, jobs: list[tuple[str, str, int]], job: str) -> tuple[bool, int]:
    """Whether `job` fits in a store of `store_bytes` beside the jobs created before it; `jobs`:
    (creation time, name, reserved bytes) of every job, `job` included. Also: the bytes reserved
    before it."""
    before = 0
    for created, name, reserved in sorted(jobs):
        if name == job:
            return before + reserved <= store_bytes, before
        before += reserved
    raise KeyError(job)
