"""What a trainer rank tells the world: its `/status` (`Board`, up before the model loads), and on
rank 0 each step's metrics (the METRICS stream, Prometheus, the experiment trackers), the
weight group's state, and the generators' evaluations (trackers, the best version kept)."""

from __future__ import annotations

import collections
import json
import logging
import queue
import time
from datetime import datetime, timezone
from pathlib import Path

from pipelinerl import messages as m
from pipelinerl.contracts import TrainerStatus
from pipelinerl.learning import WINDOW, learning_alarm
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import FINAL_EVAL_WAIT_S
from pipelinerl.streams import recent_unacknowledged
from pipelinerl.tracking import Tracker, write_whole
from pipelinerl_trainer import metrics as prom
from pipelinerl_trainer.bridge import NatsBridge
from pipelinerl_trainer.output import Output
from pipelinerl_trainer.position import Position
from pipelinerl_trainer.weight_sender import WeightSender

log = logging.getLogger("pipelinerl.trainer")
# Rank 0's place in the evaluations (the METRICS stream sequence of the last one taken, in the
# job's store): a restart goes on after it, so rows published while it was down are taken, once.
EVALS_TAKEN = "evaluations-taken.json"


class Board:
    """This rank's `/status`, served from the start (the HealthServer calls `status`)."""

    def __init__(self, rank: int, max_steps: int):
        self.body = TrainerStatus(rank=rank, max_steps=max_steps)

    def status(self) -> TrainerStatus:
        # Read when asked: a rank blocked in a publish JetStream does not acknowledge still says so.
        return self.body.model_copy(update={"store_unacknowledged": recent_unacknowledged()})

    def update(self, **fields) -> None:
        self.body = self.body.model_copy(update=fields)


class Reporter:
    def __init__(
        self,
        job: PipelineRLJob,
        rank: int,
        run_dir: Path,
        board: Board,
        bridge: NatsBridge,
        output: Output | None,
        store: str,
    ):
        self.spec, self.subjects, self.board, self.bridge, self.output = job.spec, job.subjects, board, bridge, output
        self.taken, self.store = run_dir / EVALS_TAKEN, store
        self.tracker = Tracker(job, run_dir) if rank == 0 else None
        # Rank 0 takes the evaluations, for the trackers and to keep the best version.
        self.wants_evals = self.tracker is not None and (self.tracker.enabled or bool(output and output.keep_best))
        self.recent: collections.deque[dict] = collections.deque(maxlen=WINDOW)  # newest steps' metrics
        self.group_gauges = prom.WeightGroupGauges()
        if rank == 0:
            bridge.listen_to_generators()
            if self.wants_evals:
                bridge.listen_to_evaluations(self._evals_taken())

    def group_status(self, sender: WeightSender) -> dict:
        """Rank 0: the weight group, into the gauges and /status."""
        group = sender.status()
        self.group_gauges.update(group["generators_in_group"], group["weight_epoch"], sender.failures)
        self.board.update(weight_sync_ready=group["generators_in_group"] > 0, **group)
        return group

    def step(self, metrics: dict, position: Position, sender: WeightSender) -> None:
        """Rank 0, after step `position.version`: its metrics (all ranks' together) everywhere."""
        version = position.version
        metrics |= self.group_status(sender)
        self.recent.append(metrics)
        alarm = learning_alarm(list(self.recent))
        prom.reported(metrics, alarm is not None)
        if alarm:
            log.warning("step %d: not learning: %s", version, alarm)
        self.board.update(
            step=version,
            version=version,
            samples=position.samples,
            reward=metrics["reward"],
            groups_rejected=position.rejected_groups,
            samples_rejected=position.rejected_samples,
            lag_mean=metrics["lag_mean"],
            lag_max=metrics["lag_max"],
            tokens_per_second=metrics["trainer_tokens_per_second"],
            learning_alarm=alarm,
            last_update=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.bridge.publish(
            self.subjects.metrics("train"),
            m.Metrics(source="trainer", kind="train", values=metrics, timestamp=time.time()),
        )
        if self.tracker is not None and self.tracker.enabled:
            self.tracker.log("train", metrics)
        if self.wants_evals:
            self.take_evaluations()
        log.info(
            "step %d: loss %.4f reward %.3f ess %.3f lag %.2f/%d sync %.0fms",
            version,
            metrics["loss"],
            metrics["reward"],
            metrics["ess"],
            metrics["lag_mean"],
            metrics["lag_max"],
            1000 * metrics["weight_sync_seconds"],
        )

    def take_evaluations(self, wait_for_final: bool = False, stopping=lambda: False) -> None:
        """Hand the evaluations that came in to the trackers and the output (at the end: until the
        final one, bounded)."""
        deadline = time.monotonic() + (FINAL_EVAL_WAIT_S if wait_for_final else 0)
        while True:
            try:
                seq, row = self.bridge.evals.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline or stopping():
                    return
                continue
            if self.tracker is not None and self.tracker.enabled:
                self.tracker.log("eval", row.values)
            if self.output is not None:
                version, accuracy = int(row.values["version"]), float(row.values["accuracy"])  # type: ignore[arg-type]
                try:
                    promoted = self.output.evaluated(version, accuracy)
                except OSError as err:  # the best copy is a convenience: training goes on without it
                    log.error("version %d not taken as the best in %s: %s", version, self.output.root, err)
                    promoted = False
                if promoted:
                    log.info(
                        "version %d is the best on evaluation so far (accuracy %.3f): %s",
                        version,
                        accuracy,
                        self.output.root / "best",
                    )
            self._took_eval(seq)
            if row.values.get("final"):
                deadline = 0.0

    def _evals_taken(self) -> int:
        """The sequence of the last evaluation taken in this store (0: none, or another store's)."""
        taken = json.loads(self.taken.read_text()) if self.taken.exists() else {}
        return taken["seq"] if taken.get("store") == self.store else 0

    def _took_eval(self, seq: int) -> None:
        write_whole(self.taken, {"store": self.store, "seq": seq})

    def close(self, finished: bool, stopping) -> None:
        """The run is over: the final evaluation (when one is due), then the trackers close."""
        if self.tracker is None:
            return
        if self.wants_evals:
            self.take_evaluations(wait_for_final=finished and self.spec.eval.interval > 0, stopping=stopping)
        self.tracker.close()
