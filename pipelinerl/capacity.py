"""What a job holds in JetStream (pure): each stream's size, derived from the job, and their sum,
which the job reserves in the store (JetStream reserves a stream's max_bytes when it is made).

The chart's NATS store is shared by every job of the install. A job holds a reservation only
while it runs (admitted, not suspended, not finished); the operator grants its NATS account that
much (its JetStream limit) and admits a job only where the reservations held, its own added, fit
in the store and in its namespace's share of it (`admission_problem`): so the accounts the NATS
server loads never add up to more than its store, and it can always start. A job waiting for room,
suspended, finished or refused holds nothing and has no account.
"""

from __future__ import annotations

from typing import Any

from pipelinerl.contracts import BATCH_BYTES_PER_TOKEN, ROLLOUT_BYTES_PER_TOKEN

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
    """The job's room in the store (its NATS account's limit): its streams' sizes, and one largest
    message beside each. nats-server checks an account's limit with the incoming message counted,
    before a full stream drops its oldest: an account of exactly its streams' sizes refused every
    write once they were full (its micro-batches and metrics, with the rollouts queued)."""
    streams = stream_bytes(spec)
    return sum(streams.values()) + len(streams) * (spec.nats.max_payload_mb << 20)


def admission_problem(
    store_bytes: int, namespace_share: float, held: dict[str, tuple[str, int]], namespace: str, need: int
) -> str | None:
    """Why a job needing `need` bytes in `namespace` cannot hold them now beside the reservations
    `held` (a job's id → its namespace and bytes; the job's own left out); None if it can."""
    gib = 1 << 30
    total = sum(b for _, b in held.values())
    if total + need > store_bytes:
        return (
            f"the chart's NATS store ({store_bytes / gib:.2f} GiB) cannot hold this job's streams "
            f"({need / gib:.2f} GiB) beside the running jobs' ({total / gib:.2f} GiB reserved): it starts once "
            "there is room (a job finishes or is deleted); or lower trainer.checkpointInterval, "
            "trainer.samplesPerStep or model.maxSeqLen, or give NATS a larger volume (the chart's nats.storageGi)"
        )
    mine = sum(b for ns, b in held.values() if ns == namespace)
    if mine + need > store_bytes * namespace_share:
        return (
            f"the jobs of namespace {namespace} may reserve {namespace_share:.0%} of the chart's NATS store "
            f"({store_bytes * namespace_share / gib:.2f} GiB: jobPolicy.namespaceShare); its running jobs hold "
            f"{mine / gib:.2f} GiB and this one needs {need / gib:.2f} GiB: it starts once there is room"
        )
    return None
