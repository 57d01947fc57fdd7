"""Trainer service: one DeepSpeed rank of the trainer (`trainer.Trainer` trains), assembled here
in the order its parts need each other: `/status` first (`reporting.Board`), the ranks' torch
group (and the watch over the other ranks: `peers`), the model, the newest checkpoint
(`position.Position`), NATS, what goes out (`reporting.Reporter`), the weight group and its
sender."""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch

from pipelinerl.contracts import MASTER_PORT, STOP_GRACE_S, Env, ServiceEnv
from pipelinerl.runtime import HealthServer, exit_soon
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import version_after
from pipelinerl.tiny_model import resolve_model_path
from pipelinerl.weight_group import open_store
from pipelinerl_trainer import checkpoint
from pipelinerl_trainer import metrics as prom
from pipelinerl_trainer.bridge import NatsBridge
from pipelinerl_trainer.model import build_engine, init_distributed, load_model
from pipelinerl_trainer.output import Output
from pipelinerl_trainer.peers import PeerWatch, say_started
from pipelinerl_trainer.position import Position, StoreLost
from pipelinerl_trainer.reporting import Board, Reporter
from pipelinerl_trainer.stopping import StopVote
from pipelinerl_trainer.trainer import DATA_TIMEOUT_S, Model, Trainer, from_rank0
from pipelinerl_trainer.weight_sender import WeightSender

log = logging.getLogger("pipelinerl.trainer")
STORE_POLL_S = 10.0  # a trainer whose store was lost looks again this often for one recovered for it
# The ranks' world group's collective timeout. Ranks wait in its collectives while rank 0 alone
# works: writing the checkpoint's whole-model copy and syncing its folder (minutes for a large
# model on a network volume), or confirming a weight update and forming the next group at a
# checkpoint step. A rank dead or frozen meanwhile ends every rank within weightSync.timeoutSeconds
# (`peers.PeerWatch`), so this bounds only a collective that hangs with every rank alive.
COLLECTIVE_TIMEOUT_S = 3600.0


def join_torch_group(job: PipelineRLJob, env: ServiceEnv, stop: threading.Event) -> tuple[PeerWatch | None, StopVote]:
    """This rank in the trainers' torch.distributed group (DeepSpeed's), on its GPU if any; the
    watch over the other ranks (`peers`; None for a gang of one), which tells them when `stop` is
    set; and the ranks' vote on stopping (`stopping`)."""
    on_gpu = job.spec.trainer.gpus > 0
    local_rank, world = env.local_rank or 0, env.world_size or 1
    addr, port = env.master_addr or "127.0.0.1", env.master_port or MASTER_PORT
    os.environ.update(
        {
            Env.TORCH_RANK: str(env.rank),
            Env.TORCH_WORLD_SIZE: str(world),
            Env.TORCH_LOCAL_RANK: str(local_rank),
            Env.MASTER_ADDR: addr,
            Env.MASTER_PORT: str(port),
        }
    )
    if on_gpu:
        torch.cuda.set_device(local_rank)
    timeout_s = job.spec.weight_sync.timeout_seconds
    if world > 1 and env.rank > 0:
        say_started(addr, port, env.rank, timeout_s)
    init_distributed(on_gpu, timeout_s * 5, env.listen_address, COLLECTIVE_TIMEOUT_S)
    vote = StopVote.of_ranks(world, DATA_TIMEOUT_S + timeout_s)  # a vote waits for a rank waiting for data
    return PeerWatch.of_ranks(addr, port, env.rank, world, timeout_s, stop), vote


def build_model(job: PipelineRLJob, model_path: str) -> Model:
    spec = job.spec
    engine = build_engine(spec.trainer, spec.weights_dtype, model_path)
    reference = None
    if spec.rl.kl_coef > 0:
        # on the engine's device (loaded on the host; a whole copy on each rank, ZeRO-3 too)
        reference = load_model(model_path, spec.weights_dtype).eval().requires_grad_(False).to(engine.device)
    module = engine.module
    return Model(
        engine,
        reference,
        vocab_size=module.get_input_embeddings().num_embeddings,
        max_positions=getattr(module.config, "max_position_embeddings", None),
    )


def newest_sent(bridge: NatsBridge, rank: int, world: int, device) -> int:
    """The newest version a predecessor announced on the job's stream, or began to broadcast
    (`messages.WeightsSent`: killed before announcing it, its generators may hold it), as every
    rank sees it: rank 0 reads both."""
    newest = 0
    if rank == 0:
        announced = bridge.last_announcement()
        newest = max(announced.version if announced else 0, bridge.last_sent())
    return from_rank0(newest, world, device)


def await_store(position: Position, bridge: NatsBridge, board: Board, env: ServiceEnv, stop: threading.Event) -> None:
    """Go on only in the store the checkpoint belongs to (`Position.check_store`). A lost or
    replaced store stops a local run (StoreLost: the runner does not restart what cannot run);
    a pod trains nothing, says why on /status (the operator's StoreLost condition and Event),
    tells its checkpoint on the new store (rank 0: what the operator makes the store go on from
    when the job is suspended and resumed) and waits. Rank 0 of a trainer that takes a store made
    to go on from its checkpoint tells that checkpoint on it."""
    told, taken = False, position.store
    while lost := position.check_store(bridge.store_identity()):
        board.update(store_lost=lost)
        log.error("%s", lost)
        if env.exit_when_done or stop.is_set():
            raise StoreLost(lost)
        if env.rank == 0 and not told:
            bridge.publish(bridge.subjects.checkpoint, position.record(position.store))
            told = True
        stop.wait(STORE_POLL_S)
    board.update(store_lost="")
    if env.rank == 0 and taken and position.store != taken:
        # A store made to go on from this checkpoint: it is the one a suspend before the next
        # save restores again. `recover_store` tells it as it makes the store; told again here
        # for a store an earlier build made, which holds no record of it until then.
        bridge.publish(bridge.subjects.checkpoint, position.record(taken))


def assemble(job: PipelineRLJob, env: ServiceEnv, board: Board, stop: threading.Event) -> Trainer:
    spec, rank, world = job.spec, env.rank, env.world_size or 1
    # Before the torch group: a built-in's folder is written here, and transformers' save_pretrained
    # writes a model only on torch.distributed's rank 0 (each trainer pod has a cache of its own).
    model_path = resolve_model_path(spec.model.path)
    peers, vote = join_torch_group(job, env, stop)
    model = build_model(job, model_path)
    bridge = NatsBridge(job, env, f"{job.name}-trainer-{rank}")
    ckpts = env.run_dir / "checkpoints"
    resume = checkpoint.step_the_store_goes_on_from(ckpts, bridge.store_identity())
    if resume is not None:
        log.warning(
            "the job's store goes on from this pod's checkpoint of step %d, not from its newest (step %d, "
            "never told to the store): resuming from step %d; the steps after it are trained again",
            resume,
            checkpoint.newest_whole(ckpts),
            resume,
        )
    position = Position.restored(checkpoint.load(model.engine, ckpts, resume), rank)
    prom.started(spec.trainer.max_steps, position.version, spec.max_lag)
    await_store(position, bridge, board, env, stop)
    output = Output(env.output_dir, spec.output.best if spec.output else True) if env.output_dir else None
    reporter = Reporter(job, rank, env.run_dir, board, bridge, output, position.store)
    # Rank 0 serves the weight group's rendezvous for its lifetime (every epoch meets in it).
    store = None
    if rank == 0:
        store = open_store(env.listen_address, env.weights_port, True, spec.weight_sync.timeout_seconds)
        log.info(
            "weight group (%s) rendezvous on port %d; generators join as they come",
            spec.weight_transport,
            env.weights_port,
        )
    # A restarted trainer first replays the steps its predecessor took after the checkpoint,
    # from their micro-batches still in the stream: the same data, each step once in the
    # lineage that goes on. Until it is past the newest version announced or sent it sends and
    # announces nothing, so no generator's weights nor any announced version go back.
    floor = newest_sent(bridge, rank, world, model.engine.device)
    if floor > position.version:
        log.info(
            "replaying the steps that make versions %d-%d (trained before the restart): no weights "
            "sent nor versions announced until version %d",
            version_after(position.version),
            floor,
            floor,
        )
    sender = WeightSender(
        model.engine,
        rank,
        bridge,
        backend=spec.weight_transport,
        bucket_mb=spec.weight_sync.bucket_mb,
        timeout_s=spec.weight_sync.timeout_seconds,
        store=store,
        workers_per_generator=spec.generator.tensor_parallel,
        floor=floor,
        token=env.weights_token or "",
    )
    log.info(
        "trainer rank %d/%d at step %d (ZeRO-%d, model %s)",
        rank,
        world,
        position.version,
        spec.trainer.zero_stage,
        model_path,
    )
    return Trainer(job, env, model, position, bridge, sender, reporter, output, floor, stop, peers, vote)


def main(job: PipelineRLJob, env: ServiceEnv) -> int:
    stop = threading.Event()

    def on_sigterm(*_) -> None:
        stop.set()
        # Past the pods' grace period: stopped without its checkpoint, a failure (STOPPED_EXIT
        # would say it was written; 0, that the run finished).
        exit_soon(STOP_GRACE_S, code=1, why=f"the stop (its vote, its checkpoint) did not end within {STOP_GRACE_S} s")

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(env.torch_threads or 1)
    board = Board(env.rank, job.spec.trainer.max_steps)
    http = HealthServer("trainer", env.http_port, board.status, env.listen_address).start()
    trainer = assemble(job, env, board, stop)
    trainer.start()
    http.ready = True
    log.info("trainer rank %d ready at step %d", env.rank, trainer.position.version)
    return trainer.run()
