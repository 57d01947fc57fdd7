"""One trainer rank's loop: consume this rank's micro-batches, step the optimizer, send the new
weights to the generators, announce the version, checkpoint.

Every rank consumes its own subject and runs forward/backward on each micro-batch as it
arrives (in pipeline mode a step streams in while it is generated); the optimizer steps after
the one marked last. All ranks take the same number of micro-batches per step (sentinels
included), so DeepSpeed's collectives stay in lock-step.

Everything a `Trainer` holds is given to it, assembled in order by `main.assemble` (the torch
group, the model, the checkpoint's `Position`, NATS, the weight sender); what changes as it
trains is its `Position`. The phases read them: `start` (the weights go out, the data comes
in), then `run`: per step `_train_step` (waiting for data, `_while_waiting` keeps the weight
group going) and `_after_step` (send, save, report, announce), and `_wind_down`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl import messages as m
from pipelinerl.contracts import EVALUATING_GENERATOR, STOPPED_EXIT, Env, ServiceEnv
from pipelinerl.runtime import failpoint
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import sends_weights, step_version
from pipelinerl_trainer import checkpoint
from pipelinerl_trainer import metrics as prom
from pipelinerl_trainer.bridge import NatsBridge
from pipelinerl_trainer.checks import bad_samples, describe, without
from pipelinerl_trainer.output import Output
from pipelinerl_trainer.peers import PeerWatch
from pipelinerl_trainer.position import Position, StoreLost
from pipelinerl_trainer.reporting import Reporter
from pipelinerl_trainer.step import ComputeClock, StepTally, backward, micro_batch_loss, step_config
from pipelinerl_trainer.stopping import StopVote
from pipelinerl_trainer.weight_sender import NO_UPDATE, WeightSender

log = logging.getLogger("pipelinerl.trainer")
DATA_LOG_S = 30.0  # log a "waiting for data" line this often
DATA_TIMEOUT_S = float(os.environ.get(Env.DATA_TIMEOUT_S, "1800"))
STORE_CHECK_S = 2.0  # while waiting for data: how often the job's store is checked (`_while_waiting`)


def from_rank0(value: int, world: int, device) -> int:
    """Rank 0's `value` on every rank (what a collective call that follows depends on)."""
    if world == 1:
        return value
    tensor = torch.tensor([int(value)], dtype=torch.long, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


@dataclass(frozen=True)
class Model:
    """The model being trained (a DeepSpeed engine), its frozen reference (KL; None without), and
    what the checks of a micro-batch need of it."""

    engine: Any
    reference: Any
    vocab_size: int
    max_positions: int | None


def in_its_store(bridge: NatsBridge, position: Position) -> None:
    """StoreLost where the job's store is no longer the one `position` belongs to."""
    lost = position.check_store(bridge.store_identity(), starting=False)
    if lost:
        raise StoreLost(lost)


def problems_claimed(bridge: NatsBridge, position: Position) -> int:
    """The job's problem claims for a checkpoint, from the store `position` belongs to: read, then
    that store checked to be the job's still (a store's id never comes back, so it held the count
    read). From a store lost or replaced under the run, a checkpoint would tell a recovered store
    to claim from its count (0 in a new one) and problems trained would be drawn again: StoreLost
    instead, before saving, and the restart resumes from the previous checkpoint."""
    claimed = bridge.problems_claimed()
    in_its_store(bridge, position)
    return claimed


class Trainer:
    def __init__(
        self,
        job: PipelineRLJob,
        env: ServiceEnv,
        model: Model,
        position: Position,
        bridge: NatsBridge,
        sender: WeightSender,
        reporter: Reporter,
        output: Output | None,
        floor: int,
        stop: threading.Event,
        peers: PeerWatch | None,
        vote: StopVote,
    ):
        self.job, self.spec, self.env = job, job.spec, env
        self.rank, self.world = env.rank, env.world_size or 1
        self.ckpt_dir = env.run_dir / "checkpoints"
        self.step_cfg = step_config(job)
        self.model, self.engine = model, model.engine
        self.position = position
        self.bridge, self.sender, self.reporter, self.output = bridge, sender, reporter, output
        # The newest version already announced (by a predecessor): nothing is sent or announced
        # below it while the steps after the checkpoint are replayed.
        self.floor = floor
        self.stop = stop  # this rank asked to stop (its signal)
        self.peers = peers  # the other ranks' watch (their asks to stop), to close when this rank's loop ends
        self.vote, self.stopped = vote, False  # stopped: every rank agreed to, at the same micro-batch
        self.store_checked = time.monotonic()  # when the job's store was last checked (`_while_waiting`)

    def run(self) -> int:
        """0 once finished; STOPPED_EXIT once stopped before the end (this rank's signal or
        another's), its stop checkpoint written: a process started again resumes from it (a pod
        not being deleted restarts, to join the next gang)."""
        while self.position.version < self.spec.trainer.max_steps:
            metrics = self._train_step()
            if metrics is None:
                break
            self._after_step(metrics)
        self._wind_down()
        if dist.is_initialized():
            # Every torch group (DeepSpeed's, the vote's) ends here: left to the interpreter's
            # exit, gloo's threads now and then aborted the process (SIGABRT, 1 run in 16 of two
            # ranks here), which took its exit code.
            dist.destroy_process_group()
        if self.position.version < self.spec.trainer.max_steps:
            asked = "this rank" if self.stop.is_set() else "another rank"
            log.info("stopped with the other ranks (%s was asked to): exiting with %d", asked, STOPPED_EXIT)
            return STOPPED_EXIT
        return 0

    def _asked_to_stop(self) -> bool:
        return self.stop.is_set() or bool(self.peers and self.peers.asked.is_set())

    # -- phases --------------------------------------------------------------------------------
    def start(self) -> None:
        """The weights this trainer holds go out, so every generator has them before it generates
        (also those that kept running through a restart of the trainer); then the micro-batches
        after the checkpoint's position come in."""
        version = self.position.version
        done = version >= self.spec.trainer.max_steps  # restarted after its final checkpoint
        if sends_weights(version, self.spec.steps_per_generation, last=done):
            self.sender.send(version)  # (restarted mid-phase: the generators keep the phase's weights)
        if self.rank == 0:
            self.reporter.group_status(self.sender)
        if version:
            self._export_missing(version, last=done)
        if done and self.rank == 0:  # the final evaluation needs the final weights held
            self._await_final_weights()
        if version and (self.rank == 0 or not done):  # the finish: rank 0's, once its weights are held
            self._announce(finished=done)
        self.bridge.consume_batches(self.rank, self.position.consumed_seq)

    def _train_step(self) -> dict | None:
        """Step `version` on its micro-batches as they arrive; None if stopped first.
        `train_seconds` counts computing only, not waiting for data."""
        version = step_version(self.position.version)
        self.engine.train()
        tally = StepTally(self.spec.max_lag, self.engine.device)
        clock = ComputeClock(self.engine.device)
        count = 0
        while True:
            mb = self._next_batch(count)
            if self.vote(mb is None, self._while_waiting):
                self.stopped = True
                return None
            assert mb is not None  # (the rank without one voted to stop)
            count += 1
            if mb.last:
                self._consumed(mb)
            bad = bad_samples(mb, self.model.vocab_size, self.model.max_positions)
            if bad:
                mb = self._reject(mb, bad, tally)
            with clock:
                loss = micro_batch_loss(self.engine, mb, version, self.step_cfg, tally, self.model.reference)
                backward(self.engine, loss, self.world)
            if mb.last:
                break
        optimizer = ComputeClock(self.engine.device)
        with optimizer:
            self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        # Non-finite gradients (or an fp16 loss-scale overflow): DeepSpeed applied no update, alike
        # on every rank (the overflow is reduced over them). The version goes on, its weights the
        # same; the step's samples are consumed, not learned.
        skipped = not self.engine.was_step_applied()
        if skipped:
            log.warning("step %d: the optimizer applied no update (gradient norm %s)", version, grad_norm)
        metrics = tally.finish(self.world).metrics()  # the step's one read of the device
        optimizer_s = optimizer.seconds()
        elapsed = clock.seconds() + optimizer_s
        ledger = mb.ledger  # the step's books, as its final micro-batch carries them
        reward = ledger.sampled_reward
        metrics["dropped_for_lag"] += ledger.stale_samples  # the preprocessor's, whole groups
        self.position.stepped(metrics["samples"], ledger.dead_lettered, metrics["samples_rejected"])
        return {
            "step": self.position.version,
            **metrics,
            # the policy's reward: the trained samples' (`reward_trained`) with the filtered ones'
            "reward": reward if reward is not None else metrics["reward_trained"],
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "step_skipped": int(skipped),
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

    def _next_batch(self, index: int = 0) -> m.MicroBatch | None:
        """The step's micro-batch `index` on this rank (older replayed ones, and one of a step
        stored again by a preprocessor restarted past the stream's duplicate window, are skipped);
        None once stopping. While none comes, `_while_waiting`. One missing, or unreadable, stops
        the trainer: the ranks run the same passes, and a rank that went on without it would
        train on, out of step with the others or without the step's last."""
        step = step_version(self.position.version)
        since, last_log = self.bridge.now(), time.monotonic()  # waited: in awake time (a paused pod)
        while not self._asked_to_stop():
            try:
                seq, data = self.bridge.batches.get(timeout=1.0)
            except queue.Empty:
                self._while_waiting()
                waited = self.bridge.now() - since
                if time.monotonic() - last_log >= DATA_LOG_S:
                    log.info("step %d: waiting for data (%.0fs)", step, waited)
                    last_log = time.monotonic()
                if waited >= DATA_TIMEOUT_S:
                    raise TimeoutError(
                        f"rank {self.rank}: no training data for step {step} in "
                        f"{DATA_TIMEOUT_S:.0f}s (are the generators and the preprocessor running?)"
                    )
                continue
            self.position.took(seq)
            mb = self._decoded(seq, data)
            if mb.step < step or mb.step == step and mb.index < index:
                continue
            if mb.step > step:
                raise RuntimeError(self._gap(step, mb.step))
            if mb.index > index:
                raise RuntimeError(
                    f"rank {self.rank}: step {step}'s micro-batch {index} is not in the job's BATCHES stream "
                    f"(the next there is its micro-batch {mb.index}, at sequence {seq})"
                )
            return mb
        return None

    def _decoded(self, seq: int, data: bytes) -> m.MicroBatch:
        """The micro-batch at stream sequence `seq`; one that cannot be read stops the trainer: the
        step cannot be trained without it. Kept aside (dead-lettered) where it is not from this
        job's preprocessor; one of a newer build (an upgrade: the preprocessor rolled onto it
        first) is read by this trainer's restart on that build."""
        try:
            return m.decode(data, m.MicroBatch)
        except m.NewerSchema as err:
            raise RuntimeError(
                f"rank {self.rank}: the micro-batch at sequence {seq} of the job's BATCHES stream is of a newer "
                f"build ({err}): the preprocessor runs a newer image than this trainer, whose restart on it reads it"
            ) from None
        except m.MessageError as err:
            try:
                self.bridge.dead_letter(data, str(err), f"batch-{seq}")
            except Exception as failed:  # noqa: BLE001 - the refusal below says what matters
                log.error("micro-batch %d not dead-lettered: %r", seq, failed)
            raise RuntimeError(
                f"rank {self.rank}: the micro-batch at sequence {seq} of the job's BATCHES stream cannot be "
                f"read ({err}): the step cannot be trained without it"
            ) from None

    def _gap(self, step: int, got: int) -> str:
        """Why step `got`'s micro-batch came while step `step` is incomplete: the stream holds the
        steps since the newest checkpoint (`capacity.stream_bytes`), older ones are gone."""
        since = f"checkpoint step-{self.position.checkpointed}" if self.position.checkpointed else "no checkpoint"
        return (
            f"rank {self.rank}: step {step}'s micro-batches are no longer in the job's BATCHES stream (the next "
            f"it holds is step {got}'s), and this trainer goes on from {since}. The stream keeps the steps since "
            "the newest checkpoint: a trainer pod whose checkpoint volume was lost or replaced makes every rank "
            "start afresh (its log says so), which the stream cannot replay. Put the volume back, or start the "
            "job again under a new name"
        )

    def _while_waiting(self) -> None:
        """While no data comes: every STORE_CHECK_S, is the job's store still the one this rank's
        position belongs to (a store lost and replaced under a running job sends nothing it can
        train: StoreLost, rather than waiting out the data timeout)? Rank 0: generators that
        joined or fell behind get the weights (their generation is what the trainer waits for),
        and the weight group's state is shown."""
        if self._asked_to_stop():
            return  # voting to stop: the stop checkpoint, within the grace period, comes first
        if time.monotonic() - self.store_checked >= STORE_CHECK_S:
            self.store_checked = time.monotonic()
            in_its_store(self.bridge, self.position)
        if self.rank == 0:
            self.sender.resync()
            self.reporter.group_status(self.sender)

    def _consumed(self, last: m.MicroBatch) -> None:
        """The whole step is here: credit its groups to their generators."""
        self.position.consumed(last.ledger)
        if self.rank == 0 and not self.spec.waits_for_weights:
            # Pipeline mode: this step's groups are consumed now, so generators may start the
            # next ones while we train; the update after the step then lands on running requests.
            self._announce(finished=False, training=True)

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

    def _after_step(self, metrics: dict) -> None:
        """A step was taken: send its weights, save what is due, report and announce it."""
        version = self.position.version
        prom.stepped(version)
        last = version >= self.spec.trainer.max_steps
        # Pipeline mode trains on while the generators load the weights (but for the last
        # step's); sync mode's next phase must be generated with them, and gets them once per phase.
        if sends_weights(version, self.spec.steps_per_generation, last):
            metrics |= self.sender.send(version, wait=last or self.spec.waits_for_weights)
        else:
            metrics |= NO_UPDATE
        self._save(last)
        if last and self.rank == 0:
            # After the checkpoint's collectives: the other ranks wait in them only as long as the
            # default group's timeout, which this wait for a generator could outlast.
            self._await_final_weights()
        metrics["replayed"] = int(version <= self.floor)
        if self.rank == 0:
            self.reporter.step(
                metrics, self.position, self.sender
            )  # before the announcement, which lets the generators finish
            self._announce(finished=last)

    def _save(self, last: bool) -> None:
        """Checkpoint, export and output copies due at this version."""
        version = self.position.version
        interval = self.spec.trainer.checkpoint_interval
        if last or (interval and version % interval == 0):
            self._checkpoint()
        if last:  # (tests: a kill after the final checkpoint, before the model is out)
            failpoint("trainer-final-checkpointed")
        if self._exports(version):
            checkpoint.export(self.engine, self._export_copy(version), self.rank)
        self._export_outputs(version, last)

    def _exports(self, version: int) -> bool:
        """Whether `version`'s weights are copied out (trainer.exportInterval)."""
        export = self.spec.trainer.export_interval
        return bool(export) and version % export == 0

    def _export_copy(self, version: int) -> Path:
        return self.ckpt_dir / "export" / f"version-{version}"

    def _export_missing(self, version: int, last: bool) -> None:
        """Restarted from the checkpoint of `version`: the copies a kill between that checkpoint and
        its exports (`_save`) left unwritten. Each is collective: the ranks go by rank 0's folders."""
        copy = self._export_copy(version)
        if self._exports(version) and not from_rank0(copy.exists(), self.world, self.engine.device):
            checkpoint.export(self.engine, copy, self.rank)
        out = self.output
        if out is None:
            return
        if last and not from_rank0(out.final.exists(), self.world, self.engine.device):
            self._export_outputs(version, last=True)
        elif not last and out.wants_candidate(version, self.spec.eval.interval):
            # Its evaluation, asked for again as the version is announced again, finds it (one whose
            # result was taken and not promoted is dropped by the next result).
            taken = out.candidate(version).exists() or (out.best or {}).get("version", -1) >= version
            if not from_rank0(taken, self.world, self.engine.device):
                checkpoint.export(self.engine, out.candidate(version), self.rank)

    def _export_outputs(self, version: int, last: bool) -> None:
        """spec.output's copies due at this version: an evaluated version's candidate, the final model."""
        if self.output is None:
            return
        if self.output.wants_candidate(version, self.spec.eval.interval, last):
            checkpoint.export(self.engine, self.output.candidate(version), self.rank)
        if last:
            checkpoint.export(self.engine, self.output.final, self.rank)

    def _await_final_weights(self) -> None:
        """The final evaluation needs the generator that evaluates holding the final weights: if it
        does not yet (it was not up, or was dropped from the last update while another took it),
        keep sending them to whoever comes, for a while."""
        version = self.position.version
        deadline = time.monotonic() + self.spec.weight_sync.timeout_seconds * 5
        while not self.stop.is_set():
            if any(g.generator == EVALUATING_GENERATOR for g in self.sender.holders(version)):
                return
            if time.monotonic() > deadline:
                log.warning(
                    "generator %d does not hold the final weights (version %d): no final evaluation",
                    EVALUATING_GENERATOR,
                    version,
                )
                return
            if not self.sender.resync():
                time.sleep(1.0)

    def _wind_down(self) -> None:
        """Stopped or done: keep every step taken, the final evaluation, close."""
        p = self.position
        if self.stopped and p.version > p.checkpointed:
            # Stopped (suspend, a drain, Ctrl-C): keep every step taken, within the grace period.
            log.info("stopping: checkpointing step %d (the last one was %d)", p.version, p.checkpointed)
            self._checkpoint()
        if self.peers:  # after the last collective: a rank lost in it still ends the others
            self.peers.close()
        if self.rank == 0:  # the update in flight ends before the bridge it talks over closes
            try:
                self.sender.finish()
            except Exception as err:  # noqa: BLE001 - stopping anyway; the generators go on without it
                log.warning("the weight update in flight failed as the trainer stopped: %r", err)
        finished = p.version >= self.spec.trainer.max_steps
        self.reporter.board.update(finished=finished)
        self.reporter.close(finished, self.stop.is_set)
        self.bridge.close()

    # -- what goes out ---------------------------------------------------------------------------
    def _announce(self, finished: bool, training: bool = False) -> None:
        p = self.position
        if p.version < self.floor:
            return  # replaying: the predecessor announced this step already
        self.bridge.publish(
            self.job.subjects.version,
            m.PolicyVersion(
                version=p.version,
                finished=finished,
                training=training,
                timestamp=time.time(),
                trained_groups=dict(p.trained_groups),
            ),
        )

    def _checkpoint(self) -> None:
        # Every rank's end of its last whole step (a step cut short by a stop is trained again in
        # full), and the job's problem claims, read by rank 0 and kept by every rank: a pod with a
        # volume of its own resumes from its own copy, and its StoreLost message names them.
        # Rank 0's failure to read them (StoreLost, NATS gone) is every rank's, after the gather:
        # the others would wait in it for the group's timeout.
        claimed, failure = 0, None
        if self.rank == 0:
            try:
                claimed = problems_claimed(self.bridge, self.position)
            except Exception as err:  # noqa: BLE001 - raised below, on every rank
                claimed, failure = -1, err
        mine = torch.tensor([self.position.step_seq, claimed], dtype=torch.long, device=self.engine.device)
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(rows, mine)
        else:
            rows = [mine]
        if failure is not None:
            raise failure
        if int(rows[0][1]) < 0:
            raise RuntimeError(
                "trainer rank 0 could not read the job's problem claims for the checkpoint (its log says why)"
            )
        state = self.position.kept({str(r): int(row[0]) for r, row in enumerate(rows)}, int(rows[0][1]))
        checkpoint.save(
            self.engine,
            self.ckpt_dir,
            self.position.version,
            state,
            self.rank,
            self.env.local_rank or 0,
            previous=self.position.checkpointed,
        )
        self.position.saved(state)
        if self.rank == 0:  # saved: what a store must go on from to resume this job (the operator reads it)
            self.bridge.publish(self.job.subjects.checkpoint, self.position.record(state["store"]))
