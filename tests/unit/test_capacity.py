"""A job's JetStream reservation (pure): derived from the job, and a store's jobs counted in the
order they were created."""

import pytest

from pipelinerl.capacity import MIN_STREAM_BYTES, fits, reserved_bytes, stream_bytes
from pipelinerl.spec import parse_job


def spec(**s):
    return parse_job({"metadata": {"name": "t"}, "spec": s}).spec


def test_batches_hold_what_a_restarted_trainer_replays():
    big = spec(
        model={"maxSeqLen": 4096}, trainer={"samplesPerStep": 512, "checkpointInterval": 20, "microBatchTokens": 8192}
    )
    # 20 steps since the checkpoint, 2 queued ahead, the step in progress: 23 steps of 512 × 4096 tokens
    assert stream_bytes(big)["BATCHES"] == 23 * 512 * 4096 * 48
    assert stream_bytes(big)["ROLLOUTS"] == (4 + 2 + 2) * 512 * 4096 * 24  # the lag budget's groups
    assert stream_bytes(spec())["ROLLOUTS"] == MIN_STREAM_BYTES  # small jobs: a floor
    assert reserved_bytes(big) == sum(stream_bytes(big).values())
    assert stream_bytes(spec(trainer={"checkpointInterval": 0, "maxSteps": 7}))["BATCHES"] == MIN_STREAM_BYTES


def test_jobs_fit_in_creation_order():
    jobs = [("2026-01-02", "b", 40), ("2026-01-01", "c", 50), ("2026-01-03", "a", 20)]
    assert fits(100, jobs, "c") == (True, 0)
    assert fits(100, jobs, "b") == (True, 50)
    assert fits(100, jobs, "a") == (False, 90)  # created last: the one refused
    with pytest.raises(KeyError):
        fits(100, jobs, "d")
