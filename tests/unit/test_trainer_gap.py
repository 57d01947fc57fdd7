"""A trainer whose next step's micro-batches are gone from the stream (it went on from an older
checkpoint than the stream's replay covers: a pod's checkpoint volume lost, every rank afresh)
stops with an error that says so, not with "got step 31 while step 1 is incomplete"."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from pipelinerl import messages as m
from pipelinerl.steps import step_version


def test_a_step_missing_from_the_stream_names_the_checkpoint_and_the_lost_volume() -> None:
    from pipelinerl_trainer.position import Position
    from pipelinerl_trainer.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # only what `_next_batch` reads
    batches: queue.Queue = queue.Queue()
    trainer.bridge = SimpleNamespace(batches=batches, now=time.monotonic)
    trainer.position, trainer.rank, trainer.stop, trainer.peers = Position(), 1, threading.Event(), None
    step = step_version(0)
    batches.put((7, m.MicroBatch(step=step - 1, rank=1, index=0)))  # older: skipped
    batches.put((8, m.MicroBatch(step=step, rank=1, index=0)))
    assert trainer._next_batch().step == step
    batches.put((40, m.MicroBatch(step=step + 30, rank=1, index=0)))
    with pytest.raises(RuntimeError) as error:
        trainer._next_batch()
    assert f"step {step}'s micro-batches are no longer in the job's BATCHES stream" in str(error.value)
    assert f"step {step + 30}'s" in str(error.value) and "no checkpoint" in str(error.value)
    assert "checkpoint volume was lost" in str(error.value) and trainer.position.consumed_seq == 40
