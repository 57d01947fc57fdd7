"""Trainer service: consume packed micro-batches, take RL optimizer steps with DeepSpeed,
push the new weights into the running generators, announce the version, checkpoint.

Every rank consumes its own subject and runs forward/backward on each micro-batch as it
arrives (in pipeline mode a step streams in while it is generated); the optimizer steps after
the one marked last. All ranks take the same number of micro-batches per step (sentinels
included), so DeepSpeed's collectives stay in lock-step.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from pipelinerl import messages as m
from pipelinerl.contracts import MASTER_PORT, Env, ServiceEnv, TrainerStatus
from pipelinerl.learning import WINDOW, learning_alarm
from pipelinerl.runtime import HealthServer, exit_soon
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import sends_weights
from pipelinerl.tracking import Tracker
from pipelinerl.tiny_model import resolve_model_path
from pipelinerl.weight_group import open_store
from pipelinerl_trainer import checkpoint
from pipelinerl_trainer import metrics as prom
from pipelinerl_trainer.bridge import NatsBridge
from pipelinerl_trainer.checks import bad_samples, describe, without
from pipelinerl_trainer.model import build_engine, init_distributed, load_model
from pipelinerl_trainer.output import Output
from pipelinerl_trainer.step import ComputeClock, StepTally, micro_batch_loss, step_config
from pipelinerl_trainer.weight_sender import NO_UPDATE, WeightSender

log = logging.getLogger("pipelinerl.trainer")
DATA_LOG_S = 30.0  # log a "waiting for data" line this often
DATA_TIMEOUT_S = float(os.environ.get(Env.DATA_TIMEOUT_S, "1800"))
FINAL_EVAL_WAIT_S = 300.0  # for the trackers: the final evaluation comes after the last step


class Trainer:
    def __init__(self, job: PipelineRLJob, env: ServiceEnv):
        self.job, self.spec, self.env = job, job.spec, env
        self.rank, self.world = env.rank, env.world_size or 1
        self.subjects = job.subjects
        self.ckpt_dir = env.run_dir / "checkpoints"
        self.step_cfg = step_config(job)
        self.stop = threading.Event()
        self.progress = TrainerStatus(rank=self.rank, max_steps=self.spec.trainer.max_steps)
        self.recent: collections.deque[dict] = collections.deque(maxlen=WINDOW)  # newest steps' metrics
        self.group_gauges = prom.WeightGroupGauges()

    def status(self) -> TrainerStatus:
        return self.progress

    def run(self) -> int:
        http = HealthServer("trainer", self.env.http_port, self.status).start()
        self._join_torch_group()
        model_path = resolve_model_path(self.spec.model.path)
        self._build(model_path)
        self._restore()
        prom.started(self.spec.trainer.max_steps, self.version, self.spec.max_lag)
        self.bridge = NatsBridge(self.job, self.env, f"{self.job.name}-trainer-{self.rank}")
        self._open_outputs()
        self._join_weight_group()
        self.bridge.consume_batches(self.rank, self.consumed_seq)
        http.ready = True
        log.info(
            "trainer rank %d/%d ready at step %d (ZeRO-%d, model %s)",
            self.rank,
            self.world,
            self.version,
            self.spec.trainer.zero_stage,
            model_path,
        )
        while self.version < self.spec.trainer.max_steps and not self.stop.is_set():
            metrics = self._train_step()
            if metrics is None:
                break
            self._after_step(metrics)
        self._wind_down()
        return 0

    # -- phases of run ----------------------------------------------------------------------
    def _join_torch_group(self) -> None:
        """This rank in the trainers' torch.distributed group (DeepSpeed's), on its GPU if any."""
        on_gpu = self.spec.trainer.gpus > 0
        local_rank = self.env.local_rank or 0
        os.environ.update(
            {
                Env.TORCH_RANK: str(self.rank),
                Env.TORCH_WORLD_SIZE: str(self.world),
                Env.TORCH_LOCAL_RANK: str(local_rank),
                Env.MASTER_ADDR: self.env.master_addr or "127.0.0.1",
                Env.MASTER_PORT: str(self.env.master_port or MASTER_PORT),
            }
        )
        if on_gpu:
            torch.cuda.set_device(local_rank)
        init_distributed(on_gpu, self.spec.weight_sync.timeout_seconds * 5)

    def _build(self, model_path: str) -> None:
        self.engine = build_engine(self.spec.trainer, self.spec.model.dtype, model_path)
        self.ref_model = self._reference(model_path)
        module = self.engine.module
        self.vocab_size = module.get_input_embeddings().num_embeddings
        self.max_positions = getattr(module.config, "max_position_embeddings", None)

    def _restore(self) -> None:
        """The newest checkpoint's weights, optimizer and books (none: step 0)."""
        state = checkpoint.load(self.engine, self.ckpt_dir)
        self.version = state.get("step", 0)
        self.trained_groups: dict[str, int] = state.get("trained_groups", {})
        self.consumed_seq = state.get("consumed_seq", {}).get(str(self.rank), 0)
        self.step_seq = self.consumed_seq  # the stream position after the last whole step trained
        self.checkpointed = self.version
        self.samples_total = state.get("samples", 0)
        self.rejected_total = state.get("rejected", {"groups": 0, "samples": 0})  # dead-lettered, whole run

    def _open_outputs(self) -> None:
        """Trackers, the model output folder, and (rank 0) what the generators report."""
        self.tracker = Tracker(self.job, self.env.run_dir) if self.rank == 0 else None
        output = self.spec.output
        self.output = Output(self.env.output_dir, output.best if output else True) if self.env.output_dir else None
        # Rank 0 takes the evaluations, for the trackers and to keep the best version.
        self.wants_evals = self.tracker is not None and (
            self.tracker.enabled or bool(self.output and self.output.keep_best)
        )
        if self.rank == 0:
            self.bridge.listen_to_generators()
            if self.wants_evals:
                self.bridge.listen_to_evaluations()

    def _join_weight_group(self) -> None:
        """Rank 0 opens the weight group's rendezvous; then the weights this trainer holds go out,
        so every generator has them before it generates (also those that kept running through a
        restart of the trainer)."""
        weight_sync = self.spec.weight_sync
        store = None
        if self.rank == 0:
            store = open_store("0.0.0.0", self.env.weights_port, True, weight_sync.timeout_seconds)
            log.info(
                "weight group (%s) rendezvous on port %d; generators join as they come",
                self.spec.weight_transport,
                self.env.weights_port,
            )
        # A restarted trainer first replays the steps its predecessor took after the checkpoint,
        # from their micro-batches still in the stream: the same data, each step once in the
        # lineage that goes on. Until it is past the newest version announced it sends and
        # announces nothing, so no generator's weights nor any announced version go back.
        self.floor = self._announced_version()
        if self.floor > self.version:
            log.info(
                "replaying steps %d-%d (trained before the restart): no weights sent nor versions "
                "announced until version %d",
                self.version + 1,
                self.floor,
                self.floor,
            )
        self.sender = WeightSender(
            self.engine,
            self.rank,
            self.bridge,
            backend=self.spec.weight_transport,
            bucket_mb=weight_sync.bucket_mb,
            timeout_s=weight_sync.timeout_seconds,
            store=store,
            workers_per_generator=self.spec.generator.tensor_parallel,
            floor=self.floor,
            token=self.env.weights_token or "",
        )
        if sends_weights(self.version, self.spec.steps_per_generation, last=False):
            self.sender.send(self.version)  # (restarted mid-phase: the generators keep the phase's weights)
        if self.rank == 0:
            self._group_status()
        if self.version:
            self._announce(finished=False)

    def _after_step(self, metrics: dict) -> None:
        """A step was taken: send its weights, save what is due, report and announce it."""
        self.version += 1
        prom.stepped(self.version)
        self.step_seq = self.consumed_seq
        last = self.version >= self.spec.trainer.max_steps
        # Pipeline mode trains on while the generators load the weights (but for the last
        # step's); sync mode's next phase must be generated with them, and gets them once per phase.
        if sends_weights(self.version, self.spec.steps_per_generation, last):
            metrics |= self.sender.send(self.version, wait=last or self.spec.waits_for_weights)
        else:
            metrics |= NO_UPDATE
        if last and self.rank == 0:
            self._await_final_weights()
        self._save(last)
        metrics["replayed"] = int(self.version <= self.floor)
        if self.rank == 0:
            self._report(metrics)  # before the announcement, which lets the generators finish
            self._announce(finished=last)

    def _save(self, last: bool) -> None:
        """Checkpoint, export and output copies due at this version."""
        interval = self.spec.trainer.checkpoint_interval
        if last or (interval and self.version % interval == 0):
            self._checkpoint()
        export = self.spec.trainer.export_interval
        if export and self.version % export == 0:
            checkpoint.export(self.engine, self.ckpt_dir / "export" / f"version-{self.version}", self.rank)
        if self.output is not None:
            if self.output.wants_candidate(self.version, self.spec.eval.interval, last):
                checkpoint.export(self.engine, self.output.candidate(self.version), self.rank)
            if last:
                checkpoint.export(self.engine, self.output.final, self.rank)

    def _wind_down(self) -> None:
        """Stopped or done: keep every step taken, the final evaluation, close."""
        if self.stop.is_set() and self.version > self.checkpointed:
            # Stopped (suspend, a drain, Ctrl-C): keep every step taken, within the grace period.
            log.info("stopping: checkpointing step %d (the last one was %d)", self.version, self.checkpointed)
            self._checkpoint()
        self.progress.finished = self.version >= self.spec.trainer.max_steps
        if self.tracker is not None:
            if self.wants_evals:
                self._take_evaluations(wait_for_final=self.progress.finished and self.spec.eval.interval > 0)
            self.tracker.close()
        self.bridge.close()

    def _await_final_weights(self) -> None:
        """The final evaluation needs a generator holding the final weights: if none does yet
        (none was up, or all were dropped), keep sending them to whoever comes, for a while."""
        deadline = time.monotonic() + self.spec.weight_sync.timeout_seconds * 5
        while not self.sender.holders(self.version) and not self.stop.is_set():
            if time.monotonic() > deadline:
                log.warning("no generator holds the final weights (version %d): no final evaluation", self.version)
                return
            if not self.sender.resync():
                time.sleep(1.0)

    # -- data ------------------------------------------------------------------------------
    def _next_batch(self) -> m.MicroBatch | None:
        """The next micro-batch of step `self.version` (older replayed ones are skipped); None
        once stopping."""
        since = last_log = time.monotonic()
        while not self.stop.is_set():
            try:
                seq, mb = self.bridge.batches.get(timeout=1.0)
            except queue.Empty:
                if self.rank == 0:
                    self.sender.resync()  # generators that joined or fell behind: get them going
                    self._group_status()
                waited = time.monotonic() - since
                if time.monotonic() - last_log >= DATA_LOG_S:
                    log.info("step %d: waiting for data (%.0fs)", self.version, waited)
                    last_log = time.monotonic()
                if waited >= DATA_TIMEOUT_S:
                    raise TimeoutError(
                        f"rank {self.rank}: no training data for step {self.version} in "
                        f"{DATA_TIMEOUT_S:.0f}s (are the generators and the preprocessor running?)"
                    )
                continue
            self.consumed_seq = seq
            if mb.step < self.version:
                continue
            if mb.step > self.version:
                raise RuntimeError(f"rank {self.rank}: got step {mb.step} while step {self.version} is incomplete")
            return mb
        return None

    # -- training --------------------------------------------------------------------------
    def _reference(self, model_path: str):
        if self.spec.rl.kl_coef <= 0:
            return None
        return load_model(model_path, self.spec.model.dtype).eval().requires_grad_(False)

    def _train_step(self) -> dict | None:
        """Step `self.version` on its micro-batches as they arrive; None if stopped first.
        `train_seconds` counts computing only, not waiting for data."""
        self.engine.train()
        tally = StepTally(self.spec.max_lag, self.engine.device)
        clock = ComputeClock(self.engine.device)
        count = 0
        while True:
            mb = self._next_batch()
            if mb is None:
                return None
            count += 1
            if mb.last:
                self._consumed(mb)
            bad = bad_samples(mb, self.vocab_size, self.max_positions)
            if bad:
                mb = self._reject(mb, bad, tally)
            with clock:
                loss = micro_batch_loss(self.engine, mb, self.version, self.step_cfg, tally, self.ref_model)
                # DeepSpeed averages gradients over data-parallel ranks; weights already sum over them.
                self.engine.backward(loss * self.world)
            if mb.last:
                break
        optimizer = ComputeClock(self.engine.device)
        with optimizer:
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        metrics = tally.finish(self.world).metrics()  # the step's one read of the device
        optimizer_s = optimizer.seconds()
        elapsed = clock.seconds() + optimizer_s
        ledger = mb.ledger  # the step's books, as its final micro-batch carries them
        metrics["dropped_for_lag"] += ledger.stale_samples  # the preprocessor's, whole groups
        self.samples_total += metrics["samples"]
        self.rejected_total = {
            "groups": self.rejected_total["groups"] + ledger.dead_lettered,
            "samples": self.rejected_total["samples"] + metrics["samples_rejected"],
        }
        return {
            "step": self.version + 1,
            **metrics,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "groups_filtered": ledger.filtered,
            "groups_rejected": ledger.dead_lettered,
            "samples_stale": ledger.stale_samples,
            "micro_batches": count,
            "train_seconds": elapsed,
            # settled by this step (trained, or dead-lettered or stale while it was built)
            **{f"groups_from_generator_{g}": n for g, n in ledger.credits.items()},
            "optimizer_seconds": optimizer_s,
            "trainer_tokens_per_second": metrics["tokens"] / elapsed,
        }  # all ranks together

    def _reject(self, mb: m.MicroBatch, bad: dict[int, str], tally: StepTally) -> m.MicroBatch:
        """Dead-letter a micro-batch with samples the model cannot take; train it without them."""
        reason = describe(mb, bad)
        log.error(
            "step %d: micro-batch %d of rank %d dead-lettered, trained without %d sample(s): %s",
            mb.step,
            mb.index,
            mb.rank,
            len(bad),
            reason,
        )
        self.bridge.dead_letter(m.encode(mb), reason, f"batch-{mb.step}-{mb.rank}-{mb.index}")
        prom.REJECTED.inc(len(bad))
        tally.add(rejected=len(bad))
        return without(mb, set(bad))

    def _consumed(self, last: m.MicroBatch) -> None:
        """The whole step is here: credit its groups to their generators."""
        for g, c in last.ledger.credits.items():
            self.trained_groups[g] = self.trained_groups.get(g, 0) + c
        if self.rank == 0 and not self.spec.waits_for_weights:
            # Pipeline mode: this step's groups are consumed now, so generators may start the
            # next ones while we train; the update after the step then lands on running requests.
            self._announce(finished=False, training=True)

    # -- outputs ---------------------------------------------------------------------------
    def _announced_version(self) -> int:
        """The newest version announced on the job's stream (by a predecessor, if this trainer was
        restarted), as every rank sees it: rank 0 reads it."""
        newest = 0
        if self.rank == 0:
            announced = self.bridge.last_announcement()
            newest = announced.version if announced else 0
        if self.world > 1:
            value = torch.tensor([newest], dtype=torch.long, device=self.engine.device)
            dist.broadcast(value, src=0)
            newest = int(value.item())
        return newest

    def _announce(self, finished: bool, training: bool = False) -> None:
        if self.version < self.floor:
            return  # replaying: the predecessor announced this step already
        self.bridge.publish(
            self.subjects.version,
            m.PolicyVersion(
                version=self.version,
                finished=finished,
                training=training,
                timestamp=time.time(),
                trained_groups=dict(self.trained_groups),
            ),
        )

    def _group_status(self) -> dict:
        group = self.sender.status()
        self.group_gauges.update(group["generators_in_group"], group["weight_epoch"], self.sender.failures)
        self.progress = self.progress.model_copy(
            update=dict(weight_sync_ready=group["generators_in_group"] > 0, **group)
        )
        return group

    def _report(self, metrics: dict) -> None:
        metrics |= self._group_status()
        self.recent.append(metrics)
        alarm = learning_alarm(list(self.recent))
        prom.reported(metrics, alarm is not None)
        if alarm:
            log.warning("step %d: not learning: %s", self.version, alarm)
        self.progress = self.progress.model_copy(
            update=dict(
                step=self.version,
                version=self.version,
                samples=self.samples_total,
                reward=metrics["reward"],
                groups_rejected=self.rejected_total["groups"],
                samples_rejected=self.rejected_total["samples"],
                lag_mean=metrics["lag_mean"],
                lag_max=metrics["lag_max"],
                tokens_per_second=metrics["trainer_tokens_per_second"],
                learning_alarm=alarm,
                last_update=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
        )
        self.bridge.publish(
            self.subjects.metrics("train"),
            m.Metrics(source="trainer", kind="train", values=metrics, timestamp=time.time()),
        )
        if self.tracker is not None and self.tracker.enabled:
            self.tracker.log("train", metrics)
        if self.wants_evals:
            self._take_evaluations()
        log.info(
            "step %d: loss %.4f reward %.3f ess %.3f lag %.2f/%d sync %.0fms",
            self.version,
            metrics["loss"],
            metrics["reward"],
            metrics["ess"],
            metrics["lag_mean"],
            metrics["lag_max"],
            1000 * metrics["weight_sync_seconds"],
        )

    def _take_evaluations(self, wait_for_final: bool = False) -> None:
        """Hand the evaluations that came in to the trackers and the output (at the end: until the
        final one, bounded)."""
        deadline = time.monotonic() + (FINAL_EVAL_WAIT_S if wait_for_final else 0)
        while True:
            try:
                row = self.bridge.evals.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline or self.stop.is_set():
                    return
                continue
            if self.tracker is not None and self.tracker.enabled:
                self.tracker.log("eval", row.values)
            if self.output is not None:
                version, accuracy = int(row.values["version"]), float(row.values["accuracy"])  # type: ignore[arg-type]
                if self.output.evaluated(version, accuracy):
                    log.info(
                        "version %d is the best on evaluation so far (accuracy %.3f): %s",
                        version,
                        accuracy,
                        self.output.root / "best",
                    )
            if row.values.get("final"):
                deadline = 0.0

    def _checkpoint(self) -> None:
        # Where the last whole step ended: a step cut short by a stop is trained again in full.
        mine = torch.tensor([self.step_seq], dtype=torch.long, device=self.engine.device)
        seqs = [torch.zeros_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(seqs, mine)
        else:
            seqs = [mine]
        state = {
            "step": self.version,
            "samples": self.samples_total,
            "trained_groups": self.trained_groups,
            "rejected": self.rejected_total,
            "consumed_seq": {str(r): int(s.item()) for r, s in enumerate(seqs)},
        }
        checkpoint.save(self.engine, self.ckpt_dir, self.version, state, self.rank, self.env.local_rank or 0)
        self.checkpointed = self.version


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    trainer = Trainer(job, env)

    def on_sigterm(*_) -> None:
        trainer.stop.set()
        exit_soon(60)

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(env.torch_threads or 1)
    return trainer.run()
