"""A job's JetStream reservation (pure): derived from the job; admitted only beside the
reservations held, within the store and its namespace's share."""

from pipelinerl.capacity import MIN_STREAM_BYTES, admission_problem, reserved_bytes, stream_bytes
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
    # and one largest message (8 MiB) beside each of the five: the account's limit counts the incoming one
    assert reserved_bytes(big) == sum(stream_bytes(big).values()) + 5 * 8 * 2**20
    assert stream_bytes(spec(trainer={"checkpointInterval": 0, "maxSteps": 7}))["BATCHES"] == MIN_STREAM_BYTES


def test_a_job_is_admitted_beside_the_reservations_held_within_its_namespaces_share():
    held = {"u1": ("team-a", 40), "u2": ("team-b", 30)}
    assert admission_problem(100, 1.0, held, "team-c", 30) is None
    assert "cannot hold this job's streams" in admission_problem(100, 1.0, held, "team-c", 31)
    # A namespace's jobs together within its share, whatever room the store has.
    assert admission_problem(100, 0.5, held, "team-a", 10) is None
    share = admission_problem(100, 0.5, held, "team-a", 11)
    assert share is not None and "namespace team-a may reserve 50%" in share
    # Jobs that hold nothing (waiting, suspended, finished, refused) are simply not in `held`.
    assert admission_problem(100, 1.0, {}, "team-a", 100) is None
