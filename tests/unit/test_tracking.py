"""Experiment trackers against their real libraries, offline: W&B (offline mode), MLflow (a
local file store), TensorBoard (event files) — the rows `metrics.jsonl` holds, read back."""

import json
import math
import os
import subprocess
import sys
import threading
import time

from wandb_records import wandb_history  # tests/wandb_records.py

from pipelinerl import tracking
from pipelinerl.spec import parse_job
from pipelinerl.tracking import WANDB_FINISH_TIMEOUT_S, Feed, Tracker, Wandb, default_mlflow_uri, scalars


def job(**tracking):
    return parse_job({"metadata": {"name": "tracked"}, "spec": {"tracking": tracking}})


def test_rows_become_prefixed_numbers_at_their_axis():
    assert scalars(
        "train", {"step": 3, "loss": 0.5, "samples": 16, "grad_norm": None, "final": True, "reward": math.nan}
    ) == (3, {"train/step": 3.0, "train/loss": 0.5, "train/samples": 16.0})
    assert scalars("eval", {"version": 50, "accuracy": 0.4, "final": False}) == (
        50,
        {"eval/version": 50.0, "eval/accuracy": 0.4},
    )
    assert scalars("generator", {"step": 1}) is None and scalars("train", {"loss": 1.0}) is None


def test_no_tracking_asked_for_is_a_no_op(tmp_path):
    tracker = Tracker(job(), tmp_path)
    assert not tracker.enabled
    tracker.log("train", {"step": 1, "loss": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []


class Hung:
    """A tracker whose server stopped answering: each call waits until the test ends."""

    def __init__(self):
        self.released = threading.Event()

    def log(self, kind, x, values):
        self.released.wait(60)

    def close(self):
        self.released.wait(60)


class Kept:
    def __init__(self):
        self.rows = []
        self.closed = False

    def log(self, kind, x, values):
        self.rows.append((kind, x))

    def close(self):
        self.closed = True


def test_a_tracker_that_hangs_costs_the_trainer_and_the_other_trackers_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "QUEUE_ROWS", 100)
    tracker = Tracker(job(), tmp_path)
    hung, kept = Hung(), Kept()
    tracker.feeds = [Feed(hung), Feed(kept)]
    started = time.monotonic()
    for step in range(1, 151):  # beyond a tracker's queue
        tracker.log("train", {"step": step, "loss": 1.0})
        time.sleep(0.001)
    assert time.monotonic() - started < 10  # the trainer never waited
    tracker.close(timeout_s=2)  # gives up on the hung tracker's rows left, and does not close it
    assert [x for _, x in kept.rows] == list(range(1, 151)) and kept.closed  # all, in order
    assert tracker.feeds[0].dropped > 0 and tracker.feeds[1].dropped == 0 and not hung.released.is_set()
    assert time.monotonic() - started < 20
    hung.released.set()


def test_every_tracker_gets_the_rows_and_a_restart_continues_the_same_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = dict(wandb={"project": "p", "mode": "offline"}, mlflow={}, tensorboard={})
    tracker = Tracker(job(**spec), tmp_path)
    (wandb_backend,) = [b for b in tracker.backends if isinstance(b, Wandb)]
    assert wandb_backend.run.settings.finish_timeout == WANDB_FINISH_TIMEOUT_S  # never waits forever on uploads
    for step in (1, 2, 3):
        tracker.log("train", {"step": step, "loss": 1.0 / step, "reward": 0.1 * step})
    tracker.log("eval", {"version": 2, "accuracy": 0.3, "final": False})  # later than train step 3
    tracker.close()
    ids = json.loads((tmp_path / "tracking.json").read_text())

    again = Tracker(job(**spec), tmp_path)  # the trainer restarted in the same run directory
    again.log("train", {"step": 4, "loss": 0.2, "reward": 0.5})
    again.close()
    assert json.loads((tmp_path / "tracking.json").read_text()) == ids

    import mlflow

    client = mlflow.MlflowClient(default_mlflow_uri(tmp_path))
    history = client.get_metric_history(ids["mlflow"], "train/loss")
    assert [(h.step, round(h.value, 3)) for h in history] == [(1, 1.0), (2, 0.5), (3, 0.333), (4, 0.2)]
    assert [(h.step, h.value) for h in client.get_metric_history(ids["mlflow"], "eval/accuracy")] == [(2, 0.3)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("train/loss")][:3] == [(1, 1.0), (2, 0.5), (3, 0.333)]
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("eval/accuracy")] == [(2, 0.3)]

    # W&B: one offline directory per process, the same run id (`wandb sync` resumes the run).
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    history = [row for run in runs for row in wandb_history(run)]
    assert [(r["train/step"], r["train/loss"]) for r in history if "train/step" in r] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
        (4, 0.2),
    ]
    assert [(r["eval/version"], r["eval/accuracy"]) for r in history if "eval/version" in r] == [(2, 0.3)]


KILLED_TRACKER = """
import os, sys, time
from pathlib import Path
from pipelinerl.spec import parse_job
from pipelinerl.tracking import Tracker
job = parse_job({"metadata": {"name": "tracked"}, "spec": {"tracking": {"wandb": {"project": "p", "mode": "offline"}}}})
tracker = Tracker(job, Path(sys.argv[1]))
for step in range(1, 6):
    tracker.log("train", {"step": step, "loss": 1.0})
time.sleep(3)  # a few seconds pass before the kill (a checkpoint, then more steps)
os.killpg(0, 9)  # the trainer's process group, W&B's service with it, as a pod is killed
"""


def test_a_tracker_killed_outright_keeps_the_steps_logged_seconds_before(tmp_path):
    """W&B wrote its run file every 15 s by default; a trainer killed within that window lost the
    steps before its checkpoint (test_resume, once). Now it writes every second."""
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_TRACKER, str(tmp_path)],
        env={**os.environ, "WANDB_SILENT": "true"},
        start_new_session=True,
        timeout=120,
    )
    assert proc.returncode == -9
    ids = json.loads((tmp_path / "tracking.json").read_text())
    (run,) = (tmp_path / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    assert [r["train/step"] for r in wandb_history(run) if "train/step" in r] == [1, 2, 3, 4, 5]
