"""Checkpoints: DeepSpeed state (model, optimizer) + Hugging Face weights + what was consumed.

Layout: <dir>/step-<N>/{ds/, hf/, state.json, whole} and <dir>/latest (written last,
atomically), so a crash mid-save leaves the previous checkpoint in force; the newest two are kept (`prune`), and
only one of them while the next is written (`make_room`): a volume needs room for two.
Every file is flushed to the disk before `latest` names it (`durable`): a node that loses power
(not only a killed process) must not leave `latest` naming a checkpoint still in its page cache.
Exports (weights only, for offline evaluation) go to <dir>/export/version-<N>/ (and to
spec.output: output.py). All ranks call save/load/export (DeepSpeed saves its shards
collectively; ZeRO-3 gathers the full weights collectively).

Each trainer pod has a volume of its own, so <dir> is per pod: DeepSpeed writes with node-local
storage (each pod's local rank 0 writes the model states next to its ranks' ZeRO shards), and
each pod's local rank 0 writes state.json, `whole` and `latest`. On load the ranks agree on the
newest step that every pod has whole (a crash between two pods' `latest` leaves them one step
apart; `newest_whole`). A pod
with none at all while another has one (its volume lost or replaced) does not send the job back
to step 0: every rank takes the weights and the consumed-data state of the pod with the newest
checkpoint (`adopt`), and only the Adam moments start afresh (under ZeRO-3 the pods' model files
hold only their partitions: the whole weights come from rank 0's Hugging Face copy, and where
rank 0's pod is the one that lost it, every rank starts afresh).
The full Hugging Face weights (hf/, exports) are written once, by global rank 0.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pipelinerl_trainer.model import full_parameters

log = logging.getLogger("pipelinerl.trainer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


WHOLE = "whole"  # in a step's folder: this pod's part of it is on its disk, whole


def newest_whole(ckpt_dir: Path) -> int | None:
    """This pod's newest checkpoint: the one `latest` names, or a newer one whose part here is
    whole (WHOLE, written once it is on disk; the pod was killed before its `latest` named it).
    The ranks resume from the oldest of their pods' newest (`load`), so a step some pod holds
    only in part is resumed from by none; one every pod holds whole is, named or not. Before, a
    first save cut after its collective on rank 0's pod sent a ZeRO-3 run back to step 0, its
    only whole weights unnamed."""
    marked = [int(d.name[5:]) for d in ckpt_dir.glob("step-*") if d.name[5:].isdigit() and (d / WHOLE).is_file()]
    named = latest_step(ckpt_dir)
    return max([*marked, *([] if named is None else [named])], default=None)


def latest_step(ckpt_dir: Path) -> int | None:
    marker = ckpt_dir / "latest"
    if not marker.exists():
        return None
    return int(marker.read_text().strip().removeprefix("step-"))


def save(
    engine,
    ckpt_dir: Path,
    step: int,
    state: dict,
    rank: int,
    local_rank: int,
    previous: int,
    model_path: str | None = None,
) -> Path:
    """Checkpoint `step`; `previous`: the run's checkpoint before it (the one it resumed from, or
    saved last: 0 for none), which is kept with it (`prune`). Called by every rank after a
    collective that every rank reaches only once its previous save is whole, `latest` included."""
    tag = f"step-{step}"
    target = ckpt_dir / tag
    if local_rank == 0:
        make_room(ckpt_dir, previous)
    with _written(target, f"checkpoint {tag} not written to {ckpt_dir}", CHECKPOINT_ROOM, local_rank == 0):
        engine.save_checkpoint(str(target / "ds"), tag="ds", client_state={"pipelinerl": state})
        _save_hf(engine, target / "hf", rank, model_path)
        if local_rank == 0:
            (target / "state.json").write_text(json.dumps(state, indent=1))
            durable(target)  # this pod's part of the checkpoint, before any pod names it
            (target / WHOLE).write_text(tag)  # ... and then said whole (`newest_whole`)
            durable(target / WHOLE)
            durable_entries(target)
    if dist.is_initialized():
        dist.barrier()
    if local_rank == 0:
        _publish_latest(ckpt_dir, tag)
        prune(ckpt_dir, {step, previous})
    if dist.is_initialized():
        # Every pod's `latest` names it before it returns: the caller then tells the job's store
        # this step (`messages.Checkpointed`), which a suspended job's store goes on from, and the
        # pods must resume from it (they resume from the oldest `latest` among them).
        dist.barrier()
    if rank == 0:
        log.info("checkpoint %s written", target)
    return target


FULL_BELOW = 1 << 28  # free bytes under which a failed write is put down to a full volume
CHECKPOINT_ROOM = (
    "A volume holds two checkpoints (the newest one, and the next while it is written), each the model's "
    "weights and optimizer state: give the trainer pods larger volumes (spec.storage.size; locally, the run "
    "directory's disk), then restart the trainer; it resumes from the newest checkpoint"
)


@contextlib.contextmanager
def _written(folder: Path, what: str, remedy: str, removes: bool):
    """A folder written whole or not at all: a write that fails (torch's RuntimeError,
    safetensors' own error, an OSError) has what it wrote removed where `removes` (this pod's
    writer: nothing names it, and left it keeps the volume full), and a full volume said so."""
    try:
        yield
    except Exception as err:
        full = _full_error(folder.parent, what, err, remedy)
        if removes:
            shutil.rmtree(folder, ignore_errors=True)
        if full is not None:
            raise full from err
        raise


def _full_error(folder: Path, what: str, err: BaseException, remedy: str) -> OSError | None:
    """A write that failed on a full volume (or over its quota), said so with `what` failed and
    `remedy` (torch's and safetensors' own errors name their stream writer, not the folder);
    None where the failure is not the disk's."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:  # no folder to ask about: the error is not the disk's
        return None
    causes: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    refused = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes)
    if usage.free >= FULL_BELOW and not refused:
        return None
    return OSError(
        errno.ENOSPC,
        f"{what}: its volume is full or over its quota ({usage.free >> 20} MiB free of "
        f"{usage.total / 2**30:.1f} GiB). {remedy}",
    )


def make_room(ckpt_dir: Path, previous: int) -> None:
    """Before a save: only the run's previous checkpoint stays, so a volume holds two checkpoints
    at most, the one being written included. Every pod has `previous` whole (the run resumed from
    it, or every pod saved it before the collective this save follows), so no pod can resume from
    anything older. `latest` is pointed at it first (a pod may hold a newer one the run did not
    resume from), so that no crash leaves it naming a folder deleted here. What goes: the
    checkpoint before `previous`, one the run did not resume from, one a crash cut short."""
    kept = ckpt_dir / f"step-{previous}"
    if previous and kept.is_dir():
        if latest_step(ckpt_dir) != previous:
            _publish_latest(ckpt_dir, kept.name)
    elif (ckpt_dir / "latest").exists():
        (ckpt_dir / "latest").unlink()
        durable_entries(ckpt_dir)
    prune(ckpt_dir, {previous})


def _publish_latest(ckpt_dir: Path, tag: str) -> None:
    tmp = ckpt_dir / "latest.tmp"
    tmp.write_text(tag)
    durable(tmp)
    os.replace(tmp, ckpt_dir / "latest")
    durable_entries(ckpt_dir)  # the rename itself


def prune(ckpt_dir: Path, keep: set[int]) -> None:
    """Delete every checkpoint but `keep`: the one just saved and the run's previous one. Pods are
    at most one checkpoint apart (`load` resumes from the newest one every pod has), so that one
    may be the step a pod that missed this save resumes from; one this pod saved and the run did
    not resume from (a stop's, another pod missing it) is not. A volume that kept them all would
    fill up in a long run, and then fail every save from there."""
    for d in ckpt_dir.glob("step-*"):
        if d.name[5:].isdigit() and int(d.name[5:]) not in keep:
            shutil.rmtree(d, ignore_errors=True)


def export(engine, target: Path, rank: int, model_path: str | None = None) -> Path:
    """The current weights as a Hugging Face folder at `target` (no optimizer state): cheap enough
    to take every few steps, so versions can be evaluated offline without slowing the run."""
    tmp = target.with_name(target.name + ".tmp")
    with _written(tmp, f"{target} not written", EXPORT_ROOM, rank == 0):
        _save_hf(engine, tmp, rank, model_path)
        if rank == 0:
            durable(tmp)
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a folder that exists is complete
        durable_entries(target.parent)
    return target


EXPORT_ROOM = (
    "Each exported version, and the output's final model and best candidate, is the model's weights: give "
    "the volume room (spec.output's claim; the trainer's spec.storage.size for trainer.exportInterval's "
    "versions), then restart the trainer; it writes what is missing again"
)


def durable(path: Path) -> None:
    """fsync `path` (a file, or a folder this process wrote with everything under it, files before
    the folders that name them), as a rename that publishes it needs: the data reach the disk
    before the name."""
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            durable(child)
    durable_entries(path)


def durable_entries(path: Path) -> None:
    """fsync `path` alone: for a folder, its entries (a rename or removal in it), not what they
    name. Its parents are another's (the output's folder is a user's own, locally): a walk there
    would open whatever it holds (a FIFO would block it) and grow with every export kept."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_hf(engine, target: Path, rank: int, model_path: str | None) -> None:
    """The whole weights as a Hugging Face folder, written by global rank 0. Under ZeRO-3 every
    rank joins in gathering them one parameter at a time, as `adopt` does (peak device memory: the
    largest parameter, not the model), rank 0 copying each to host memory."""
    module = engine.module
    state = None
    if engine.zero_optimization_stage() == 3:
        state = {}
        for name, param in module.named_parameters():
            with full_parameters(engine, [param]):
                if rank == 0:
                    state[name] = param.data.detach().to("cpu", copy=True)
        if rank == 0:
            persistent = set(module.state_dict())  # names only: the parameters in it are partitions
            state |= {n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers() if n in persistent}
    if rank == 0:
        module.save_pretrained(target, state_dict=state, safe_serialization=True)
        src = Path(model_path or module.config._name_or_path)
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, target / name)


def step_the_store_goes_on_from(ckpt_dir: Path, identity) -> int | None:
    """The checkpoint to resume from where the job's store (`identity`, a StoreIdentity) was made
    to go on from an older one of this pod's than its newest: that one, where the pod still holds
    it (a save keeps the previous checkpoint), else None (the newest). The operator restores a
    resumed job's store from the newest checkpoint the trainer told; a stop that saved a newer one
    but did not tell it (rank 0 killed between the two, NATS unreachable) leaves that record one
    checkpoint behind, and the pods' newest would not be the store's (StoreLost)."""
    newest, step = newest_whole(ckpt_dir), identity.adopted_step
    if newest is None or step is None or step >= newest or identity.adopts is None:
        return None
    if _saved_state(ckpt_dir, newest).get("store") != identity.adopts:
        return None  # the newest belongs to another store: this one goes on from no checkpoint of it
    held = _saved_state(ckpt_dir, step)
    return step if (held.get("store"), held.get("step")) == (identity.adopts, step) else None


def _saved_state(ckpt_dir: Path, step: int) -> dict:
    """The state a checkpoint of this pod's holds ({}: none, or unreadable)."""
    try:
        return json.loads((ckpt_dir / f"step-{step}" / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def load(engine, ckpt_dir: Path, resume: int | None = None) -> dict:
    """Restore the newest checkpoint all ranks have into `engine` (or `resume`, the one the job's
    store goes on from: `step_the_store_goes_on_from`); the consumed-data state, or {} where no
    rank has one. Where some rank has none and another has, `adopt` the newest."""
    mine = newest_whole(ckpt_dir) if resume is None else resume
    # The oldest and (negated) newest step any rank has, in one all-reduce.
    steps = torch.tensor([-1 if mine is None else mine] * 2, dtype=torch.long, device=engine.device)
    steps[1] *= -1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    agreed, newest = int(steps[0]), -int(steps[1])
    if agreed < 0:
        return adopt(engine, ckpt_dir, mine, newest) if newest >= 0 else {}
    target = ckpt_dir / f"step-{agreed}"
    _, client = engine.load_checkpoint(str(target / "ds"), tag="ds")
    state = (client or {}).get("pipelinerl", {})
    log.info("resumed from %s at step %s", target, state.get("step"))
    return state


def adopt(engine, ckpt_dir: Path, mine: int | None, newest: int) -> dict:
    """Some pod has no checkpoint (its first was cut short, or its volume was lost or replaced)
    while another has step `newest`: every rank takes the weights and consumed-data state of the
    lowest rank holding that step, and refreshes its optimizer's fp32 copy from them. The Adam
    moments of the lost pod's ZeRO shard are gone, so every rank's moments start afresh (and the
    learning-rate warm-up again). ZeRO-1/2: that rank loads its model states and broadcasts them.
    ZeRO-3: the pods' model files hold only their ranks' partitions, so the whole weights come from
    the Hugging Face copy global rank 0 writes; where rank 0's pod lost it, every rank starts afresh."""
    here = f"this pod ({ckpt_dir})" if mine is None else "a pod"
    lost = f"{here} has no checkpoint while another trainer pod has step-{newest}"
    step_dir = ckpt_dir / f"step-{newest}"
    zero3 = engine.zero_optimization_stage() == 3
    rank, world = dist.get_rank(), dist.get_world_size()
    holds = mine == newest and (not zero3 or (step_dir / "hf").is_dir())
    source = torch.tensor([rank if holds else world], dtype=torch.long, device=engine.device)
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    src = int(source)
    if src == world:
        log.warning(
            "%s: under ZeRO-3 only global rank 0's pod holds whole weights, and it lost them: every rank starts afresh",
            lost,
        )
        return {}
    shared: list = [{}, []]  # the data state; under ZeRO-3, the parameters rank 0's copy lacks
    weights: dict[str, torch.Tensor] = {}
    if rank == src:
        shared[0] = json.loads((step_dir / "state.json").read_text())
        if zero3:
            for f in sorted((step_dir / "hf").glob("*.safetensors")):
                weights |= load_file(f)
            shared[1] = [n for n, _ in engine.module.named_parameters() if n not in weights]
    dist.broadcast_object_list(shared, src=src, device=engine.device)
    state, missing = shared
    if missing:  # on every rank: none waits in a collective the others left
        raise RuntimeError(
            f"{lost}, but rank 0's Hugging Face copy of it ({step_dir / 'hf'}) lacks {len(missing)} of the model's "
            f"parameters ({', '.join(missing[:3])}): put the lost volume back, or run the job again"
        )
    if zero3:
        _partitions_from(engine, weights, rank, src)
    else:
        _module_from_rank(engine, step_dir, rank, src)
    if hasattr(engine.optimizer, "refresh_fp32_params"):  # the master copy ZeRO or bf16 keeps
        engine.optimizer.refresh_fp32_params()
    log.warning(
        "%s: every rank goes on from that pod's weights and data position at step %s (rank %d's); the "
        "optimizer's moments start afresh",
        lost,
        state.get("step"),
        src,
    )
    return state


def _module_from_rank(engine, step_dir: Path, rank: int, src: int) -> None:
    """ZeRO-1/2: rank `src` loads its own model states (no collective inside DeepSpeed's
    module-only load) and sends every parameter and buffer."""
    if rank == src:
        engine.load_checkpoint(str(step_dir / "ds"), tag="ds", load_module_only=True)
    with torch.no_grad():
        for tensor in [*engine.module.parameters(), *engine.module.buffers()]:
            dist.broadcast(tensor.data, src=src)


def _partitions_from(engine, weights: dict[str, torch.Tensor], rank: int, src: int) -> None:
    """ZeRO-3: each parameter gathered whole, set on rank `src` from `weights` (its Hugging Face
    copy), and partitioned again from it (DeepSpeed broadcasts a modifier rank's values on leaving
    the gather), one at a time so that no rank ever holds the whole model on its device."""
    import deepspeed

    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=src):
                if rank == src:
                    param.data.copy_(weights[name])
        for name, buffer in engine.module.named_buffers():  # whole on every rank under ZeRO-3
            if rank == src and name in weights:
                buffer.copy_(weights[name])
            dist.broadcast(buffer.data, src=src)
