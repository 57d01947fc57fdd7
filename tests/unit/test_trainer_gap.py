"""What a trainer rank takes from its stream of micro-batches (`Trainer._next_batch`): a step
whose micro-batches are gone from the stream (it went on from an older checkpoint than the
stream's replay covers: a pod's checkpoint volume lost, every rank afresh) stops it with an error
that says so, not with "got step 31 while step 1 is incomplete"; a micro-batch stored twice is
taken once; one missing or unreadable stops it. Micro-batches come as stored, decoded as each is
taken: a restarted rank's replay comes all at once, held at ~36 bytes a token, not ~185."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest

from pipelinerl import messages as m
from pipelinerl.steps import step_version


def reader() -> tuple:
    """A trainer with only what `_next_batch` reads, and the queue its micro-batches come in."""
    from pipelinerl_trainer.position import Position
    from pipelinerl_trainer.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    batches: queue.Queue = queue.Queue()
    letters: list = []  # what it dead-letters
    dead_letter = lambda *letter: letters.append(letter)  # noqa: E731
    trainer.bridge = SimpleNamespace(batches=batches, now=time.monotonic, dead_letter=dead_letter, letters=letters)
    trainer.position, trainer.rank, trainer.stop, trainer.peers = Position(), 1, threading.Event(), None
    return trainer, batches


def test_a_step_missing_from_the_stream_names_the_checkpoint_and_the_lost_volume() -> None:
    trainer, batches = reader()
    step = step_version(0)
    batches.put((7, m.encode(m.MicroBatch(step=step - 1, rank=1, index=0))))  # older: skipped
    batches.put((8, m.encode(m.MicroBatch(step=step, rank=1, index=0))))
    assert trainer._next_batch().step == step
    batches.put((40, m.encode(m.MicroBatch(step=step + 30, rank=1, index=0))))
    with pytest.raises(RuntimeError) as error:
        trainer._next_batch()
    assert f"step {step}'s micro-batches are no longer in the job's BATCHES stream" in str(error.value)
    assert f"step {step + 30}'s" in str(error.value) and "no checkpoint" in str(error.value)
    assert "checkpoint volume was lost" in str(error.value) and trainer.position.consumed_seq == 40


def test_a_micro_batch_stored_twice_is_taken_once_and_one_missing_stops_the_rank() -> None:
    """A preprocessor restarted past the stream's duplicate window stores a wave again: the rank
    takes each index once. An index missing (lost) stops it, naming it: going on, this rank would
    run fewer passes than the others (their collectives out of step), or step without the last."""
    trainer, batches = reader()
    step = step_version(0)
    for seq, index in ((1, 0), (2, 1), (3, 0), (4, 1), (5, 2)):  # indices 0 and 1 stored again
        batches.put((seq, m.encode(m.MicroBatch(step=step, rank=1, index=index))))
    assert [trainer._next_batch(i).index for i in range(3)] == [0, 1, 2]
    assert trainer.position.consumed_seq == 5
    batches.put((6, m.encode(m.MicroBatch(step=step, rank=1, index=4))))
    with pytest.raises(RuntimeError, match=f"step {step}'s micro-batch 3 is not in the job's BATCHES stream"):
        trainer._next_batch(3)


def test_an_unreadable_micro_batch_stops_the_rank_naming_it() -> None:
    trainer, batches = reader()
    batches.put((9, b"\x81\xa1v\x01"))  # another build's
    with pytest.raises(RuntimeError, match="micro-batch at sequence 9 of the job's BATCHES stream cannot be read"):
        trainer._next_batch()
    [(data, reason, msg_id)] = trainer.bridge.letters  # kept aside, as it came
    assert (data, msg_id) == (b"\x81\xa1v\x01", "batch-9") and "schema version 1 unsupported" in reason
    assert trainer.position.consumed_seq == 9


def test_a_micro_batch_of_a_newer_build_stops_the_rank_for_its_restart_on_it_and_is_not_kept_aside() -> None:
    trainer, batches = reader()
    body = msgpack.unpackb(m.encode(m.MicroBatch(step=step_version(0), rank=1, index=0))) | {"v": m.SCHEMA_VERSION + 1}
    batches.put((9, msgpack.packb(body)))
    with pytest.raises(RuntimeError, match="micro-batch at sequence 9 of the job's BATCHES stream is of a newer build"):
        trainer._next_batch()
    assert trainer.bridge.letters == []  # not dead-lettered: the newer trainer trains it


def test_the_final_weights_are_sent_again_until_the_generator_that_evaluates_holds_them() -> None:
    """Generator 0 evaluates, the final evaluation too. Dropped from the last update while
    generator 1 took it, it held older weights: the trainer, seeing a holder, announced the finish,
    and generator 0 waited for weights that never came (no final evaluation, the trainer waiting
    for one). The trainer sends them again until generator 0 holds them."""
    from pipelinerl.spec import parse_job
    from pipelinerl_trainer.membership import Member
    from pipelinerl_trainer.trainer import Trainer

    trainer, _ = reader()
    trainer.spec = parse_job({"metadata": {"name": "t"}, "spec": {}}).spec
    trainer.position.version = 5
    holds = {Member(1, "b"): 5, Member(0, "a"): 4}
    sent = []

    def resync() -> bool:
        sent.append(True)
        holds[Member(0, "a")] = 5  # it takes them the next time they are sent
        return True

    holders = lambda version: [g for g, v in holds.items() if v >= version]  # noqa: E731
    trainer.sender = SimpleNamespace(holders=holders, resync=resync)
    Trainer._await_final_weights(trainer)
    assert sent == [True] and holds[Member(0, "a")] == 5
