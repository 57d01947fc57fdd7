"""Experiment tracking (`spec.tracking`): W&B, MLflow and TensorBoard, fed by trainer rank 0.

Every metrics row goes to each tracker the job names, under the names `metrics.jsonl` uses:
train rows as `train/<name>` at their step, evaluations as `eval/<name>` at the policy version
they evaluated (W&B: against its own x-axis, so a late evaluation is never dropped as out of
order). Only numbers are logged. Each tracker's run id is kept in the run directory, so a
restarted trainer continues the same run. The trackers' packages are imported only when asked for.

A tracker's outage must not stop training, nor the other trackers: each gets the rows from a
thread of its own, through a bounded queue (rows beyond it are dropped, and counted), so one that
hangs costs the trainer and the others nothing; MLflow's own HTTP retries (120 s a request, 7
tries by default) are cut to what a start-up can wait for, unless set (in this process's
environment, which its children inherit).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from pipelinerl.spec import PipelineRLJob, dump_job

log = logging.getLogger("pipelinerl.tracking")
AXES = {"train": "step", "eval": "version"}  # kind → the field that is its x-axis
WANDB_FINISH_TIMEOUT_S = 60.0
QUEUE_ROWS = 10_000  # rows waiting for the trackers at most (a slow tracker's backlog)
CLOSE_TIMEOUT_S = 60.0  # close waits this long for the rows still queued
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}  # unless set


def scalars(kind: str, values: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(x, {"<kind>/<name>": number}) for a metrics row of a tracked kind; None for other kinds."""
    axis = AXES.get(kind)
    if axis is None or not isinstance(values.get(axis), int):
        return None
    out = {
        f"{kind}/{k}": float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    return values[axis], out


class Backend(Protocol):
    def log(self, kind: str, x: int, values: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class Wandb:
    def __init__(self, job: PipelineRLJob, run_dir: Path, run_id: str):
        import wandb

        spec = job.spec.tracking.wandb
        assert spec is not None  # made only where the job asks for it
        self.run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            mode=spec.mode,
            tags=spec.tags,
            name=job.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=json.loads(job.model_dump_json(by_alias=True)),
            # W&B writes its run file every 15 s by default: a pod killed outright lost up to 15 s
            # of steps, those before the checkpoint it resumes from too, which no replay restores.
            # finish() waits for every upload by default: with W&B unreachable, a finished
            # trainer would never exit. What is not uploaded by then stays on disk (`wandb sync`).
            settings=wandb.Settings(x_transaction_log_flush_interval=1.0, finish_timeout=WANDB_FINISH_TIMEOUT_S),
        )
        for kind, axis in AXES.items():
            self.run.define_metric(f"{kind}/{axis}")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/{axis}")

    def log(self, kind: str, x: int, values: dict[str, float]) -> None:
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()


def default_mlflow_uri(run_dir: Path) -> str:
    """A SQLite store in the run directory (MLflow's file store is frozen)."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class Mlflow:
    def __init__(self, job: PipelineRLJob, run_dir: Path, run_id: str | None):
        import mlflow

        spec = job.spec.tracking.mlflow
        assert spec is not None  # made only where the job asks for it
        for key, value in MLFLOW_HTTP.items():
            os.environ.setdefault(key, value)
        self.client = mlflow.MlflowClient(spec.tracking_uri or default_mlflow_uri(run_dir))
        name = spec.experiment or job.name
        found = self.client.get_experiment_by_name(name)
        # With the default store, artifacts go beside it (else MLflow writes ./mlruns wherever we run).
        artifacts = None if spec.tracking_uri else (run_dir / "mlartifacts").resolve().as_uri()
        experiment = found.experiment_id if found else self.client.create_experiment(name, artifacts)
        if run_id is None:
            run_id = self.client.create_run(experiment, run_name=job.name).info.run_id
            self.client.log_text(run_id, dump_job(job), "job.yaml")
        self.run_id = run_id

    def log(self, kind: str, x: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, x) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Tensorboard:
    def __init__(self, job: PipelineRLJob, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        spec = job.spec.tracking.tensorboard
        assert spec is not None  # made only where the job asks for it
        self.writer = SummaryWriter(spec.log_dir or str(run_dir / "tensorboard"))

    def log(self, kind: str, x: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def write_whole(path: Path, data: object, indent: int | None = None) -> None:
    """`data` as JSON at `path`, whole or not at all (`write_text_whole`)."""
    write_text_whole(path, json.dumps(data, indent=indent))


def write_text_whole(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all: a kill or a full disk mid-write would leave a file
    no restart could read (nor a reader a half-written one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the whole one
        raise
    os.replace(tmp, path)


class Tracker:
    """The job's trackers; `enabled` is False when it names none."""

    def __init__(self, job: PipelineRLJob, run_dir: Path):
        spec = job.spec.tracking
        ids_file = run_dir / "tracking.json"  # run ids, so a restart continues the same runs
        ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        self.backends: list[Backend] = []
        if spec.wandb:
            ids.setdefault("wandb", f"{job.name}-{uuid.uuid4().hex[:8]}")
            self.backends.append(Wandb(job, run_dir, ids["wandb"]))
        if spec.mlflow:
            backend = Mlflow(job, run_dir, ids.get("mlflow"))
            ids["mlflow"] = backend.run_id
            self.backends.append(backend)
        if spec.tensorboard:
            self.backends.append(Tensorboard(job, run_dir))
        if ids:
            write_whole(ids_file, ids)
        self.feeds = [Feed(b) for b in self.backends]  # each tracker's sender

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def log(self, kind: str, values: dict[str, Any]) -> None:
        """Queue the row for each tracker; never waits on them."""
        row = scalars(kind, values)
        if row is None:
            return
        for feed in self.feeds:
            feed.put(kind, row)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send the rows still queued (for `timeout_s` at most, all trackers together), then
        close each tracker that took them all; one still sending is left (closing it would wait
        on the same outage)."""
        deadline = time.monotonic() + timeout_s
        for feed in self.feeds:  # every sender told first, so they all finish meanwhile
            feed.end()
        for feed in self.feeds:
            feed.finish(deadline)


class Feed:
    """One tracker's rows, sent from a thread of its own through a bounded queue: a tracker that
    hangs holds up only its own rows (beyond the queue they are dropped, and counted)."""

    def __init__(self, backend: Backend):
        self.backend, self.dropped, self.ended = backend, 0, False
        self.rows: queue.Queue[tuple[str, tuple[int, dict[str, float]]] | None] = queue.Queue(QUEUE_ROWS)
        self.name = type(backend).__name__
        self.thread = threading.Thread(target=self._send, name=f"tracking-{self.name}", daemon=True)
        self.thread.start()

    def put(self, kind: str, row: tuple[int, dict[str, float]]) -> None:
        try:
            self.rows.put_nowait((kind, row))
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 100, 10_000):
                log.warning("%s: %d rows behind, %d row(s) dropped", self.name, QUEUE_ROWS, self.dropped)

    def _send(self) -> None:
        while (item := self.rows.get()) is not None:
            kind, row = item
            try:
                self.backend.log(kind, *row)
            except BaseException as err:  # a tracker's outage must not stop training, nor this thread
                log.warning("%s: could not log %s row: %s", self.name, kind, err)

    def end(self) -> None:
        """The sender takes the rows queued, then stops (at `finish`, where its queue is full)."""
        try:
            self.rows.put_nowait(None)
            self.ended = True
        except queue.Full:
            self.ended = False

    def finish(self, deadline: float) -> None:
        if self.thread.is_alive():
            try:
                if not self.ended:
                    self.rows.put(None, timeout=max(0.0, deadline - time.monotonic()))
                self.thread.join(max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
            if self.thread.is_alive():
                log.warning(
                    "%s: still sending at close, %d row(s) left unsent; not closed", self.name, self.rows.qsize()
                )
                return
        try:
            self.backend.close()
        except Exception as err:
            log.warning("%s: could not close: %s", self.name, err)
