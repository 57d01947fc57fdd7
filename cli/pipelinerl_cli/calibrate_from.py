"""`pipelinerl plan --calibrate-from RUN`: read a pilot run (the I/O; the derivation is
`pipelinerl.planner.pilot`, pure).

RUN is a `pipelinerl run` folder (metrics.jsonl, summary.json, job.yaml and its NATS store,
whose BATCHES stream keeps the trained micro-batches), or the NATS URL of a running job: its
METRICS stream (the trainer's rows) and BATCHES stream, of the job being planned.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pipelinerl.messages import MessageError, Metrics, MicroBatch, decode
from pipelinerl.planner.calibration import Calibration, load_calibration
from pipelinerl.planner.pilot import PilotError, completion_lengths, derive_calibration, format_taken, train_rows
from pipelinerl.spec import PipelineRLJob, load_job
from pipelinerl.streams import close, connect, stored_messages, wait_for

READ_TIMEOUT_S = 60.0  # reading a stream's stored messages


def _base(job: PipelineRLJob, base: str | None) -> Calibration:
    return load_calibration(base or ("h100-7b" if job.spec.generator.gpus else "cpu-tiny"))


async def _read(url: str, job: PipelineRLJob) -> tuple[list[dict], list[MicroBatch]]:
    """The job's trainer metrics rows and its stored micro-batches."""
    subjects = job.subjects
    nc = await wait_for(connect(url, "pipelinerl-calibrate"), READ_TIMEOUT_S, f"a connection to {url}")
    try:
        js = nc.jetstream()
        metrics = await wait_for(stored_messages(js, subjects.stream("METRICS")), READ_TIMEOUT_S, "the METRICS stream")
        batches = await wait_for(stored_messages(js, subjects.stream("BATCHES")), READ_TIMEOUT_S, "the BATCHES stream")
    finally:
        await close(nc)
    try:
        rows = []
        for msg in metrics:
            row = decode(msg.data, Metrics)
            if row.kind == "train":
                rows.append({"kind": row.kind, "time": row.timestamp, **row.values})
        return rows, [decode(msg.data, MicroBatch) for msg in batches]
    except MessageError as e:  # a run of another build (the schema version)
        raise PilotError(f"job {job.name}: a stored message this build cannot read: {e}") from e


def _stored_batches(run: Path, job: PipelineRLJob) -> list[MicroBatch]:
    """The micro-batches a finished local run's store still holds (its nats-server started
    again on the run's store)."""
    from pipelinerl_cli.embedded_nats import EmbeddedNats
    from pipelinerl_cli.local import lock_run_dir

    if not (run / "nats").is_dir():
        return []
    # A run still going: a second nats-server on its store would run beside its own.
    lock = lock_run_dir(run, "wait for it to end, or --calibrate-from its NATS (its URL is in services.json)")
    try:
        server = EmbeddedNats.of_job(run / "nats", job.spec).start()
        try:
            return asyncio.run(_read(server.url, job))[1]
        finally:
            server.stop()
    finally:
        lock.close()


def calibration_from_run(source: str, job: PipelineRLJob, base: str | None = None) -> tuple[Calibration, str]:
    """The calibration a pilot measured, and what came from where (for the user to read)."""
    if "://" in source:
        rows, batches = asyncio.run(_read(source, job))
        pilot, summary, where = job, None, f"job {job.name} at {source}"
    else:
        run = Path(source)
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            raise PilotError(
                f"{run}: no metrics.jsonl (--calibrate-from takes a `pipelinerl run` folder or a NATS URL)"
            )
        pilot = load_job(run / "job.yaml") if (run / "job.yaml").is_file() else job
        rows = train_rows(metrics.read_text(), str(metrics))
        summary_file = run / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
        batches = _stored_batches(run, pilot)
        where = str(run)
    lengths = completion_lengths(batches, rows)
    calib, taken = derive_calibration(rows, pilot, _base(pilot, base), lengths, summary, where)
    return calib, f"calibration from {where} (pilot job {pilot.name!r}):\n{format_taken(taken)}"
