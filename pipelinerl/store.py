"""Which store a job's streams are, and what keeps it true: the streams made sure of (a store
that lost one its positions are counted in gets a new identity), the store's identity (written
once), and a lost or replaced store made to go on from a trainer checkpoint (`recover_store`).
The plumbing it stands on (stream configs, reads, publishes) is `pipelinerl.streams`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import nats.js.errors
from nats.js.errors import NotFoundError

from pipelinerl.capacity import stream_bytes
from pipelinerl.claims import Claims
from pipelinerl.contracts import JobSubjects
from pipelinerl.messages import Checkpointed, MessageError, PolicyVersion, StoreIdentity, decode, encode
from pipelinerl.spec import JobSpec
from pipelinerl.streams import (
    READ_TIMEOUT_S,
    UNACKED,
    WRONG_LAST_SEQUENCE,
    read_last,
    delete_streams,
    stream_configs,
)

log = logging.getLogger("pipelinerl.store")


# The streams the services' positions and books are counted in: a store that lost one of them, its
# identity still there, is not the store its identity names. The others (METRICS, DEADLETTER) are
# records: made again where missing, as a stream a later release adds must be.
POSITION_STREAMS = ("ROLLOUTS", "BATCHES")


async def ensure_streams(
    js, subjects: JobSubjects, max_payload_mb: int, replicas: int | None = None, sizes: dict[str, int] | None = None
) -> None:
    """Create the job's streams, or update them in place; safe to call from every service.
    `replicas`: a service's `stream_replicas` (None: one copy); `sizes`: see stream_configs.
    A store whose identity is written (once all its streams were made) but which has lost one of
    its POSITION_STREAMS (a damaged volume, a stream deleted by hand) gets a new identity before
    the stream is made again empty: to the trainer it is another store (StoreLost, then the same
    recovery as a store lost whole), never one gone on from with positions and books reset."""
    identity = await _identity_if_any(js, subjects)  # read first: then a stream missing after it was lost
    missing = []
    for cfg in stream_configs(subjects, max_payload_mb << 20, replicas or 1, sizes):
        try:
            await js.stream_info(cfg.name)
            await js.update_stream(cfg)
        except NotFoundError:
            missing.append(cfg)
    positions = {subjects.stream(s) for s in POSITION_STREAMS}
    lost = [c.name for c in missing if c.name in positions]
    if identity is not None and lost:
        await _replace_identity(js, subjects, identity, f"store {identity[0].id} lost its stream(s) {', '.join(lost)}")
    for cfg in missing:
        try:
            await js.add_stream(cfg)
        except Exception as err:  # another service created it in between
            if "already in use" not in str(err):
                raise


async def _identity_if_any(js, subjects: JobSubjects):
    """(the store's identity, its sequence) where the store has one; None where its CONTROL stream
    or identity is not there (yet)."""
    try:
        last = await js.get_last_msg(subjects.stream("CONTROL"), subjects.store)
    except NotFoundError:
        return None
    return _decoded(last, subjects), last.seq


def _decoded(last, subjects: JobSubjects) -> StoreIdentity:
    """The identity a stored message holds; MessageError naming its subject."""
    try:
        return decode(last.data, StoreIdentity)
    except MessageError as err:
        raise MessageError(f"the job's store identity on {subjects.store}: {err}") from None


def _fresh(**fields) -> StoreIdentity:
    """A new store identity (`fields`: what it adopts, or what it replaced)."""
    return StoreIdentity(id=uuid.uuid4().hex, created=time.time(), **fields)


async def _replace_identity(js, subjects: JobSubjects, identity, why: str) -> None:
    """A new identity in place of `identity` (StoreIdentity, sequence), saying `why`: appended only
    if still the newest (services finding the damage together make one)."""
    new = _fresh(replaced=why)
    try:
        await js.publish(
            subjects.store, encode(new), timeout=5.0, headers={"Nats-Expected-Last-Subject-Sequence": str(identity[1])}
        )
    except nats.js.errors.APIError as err:
        if err.err_code not in WRONG_LAST_SEQUENCE:
            raise
        return  # another service replaced it first
    log.error("the job's store is damaged (%s): it is now store %s, which the trainer's checkpoint is not", why, new.id)


async def store_identity(js, subjects: JobSubjects, adopts=None, timeout_s: float = READ_TIMEOUT_S):
    """The job's store identity (`messages.StoreIdentity`), written here where the store has none
    (its streams were just made: a new job, or a lost store's replacement). Written once: the
    append is made only while the subject is empty (an expected last sequence of 0), so services
    starting together agree on the one written first. `adopts`: (the lost store's id, the
    checkpoint's step) that a new store goes on from (`pipelinerl recover-store`)."""
    stream = subjects.stream("CONTROL")
    deadline = time.monotonic() + timeout_s
    while True:
        last = await read_last(js, stream, subjects.store, deadline)
        if last is not None:
            return _decoded(last, subjects)
        mine = _fresh() if adopts is None else _fresh(adopts=adopts[0], adopted_step=adopts[1])
        try:
            await js.publish(
                subjects.store, encode(mine), timeout=5.0, headers={"Nats-Expected-Last-Subject-Sequence": "0"}
            )
            log.info("the job's store is new: identity %s", mine.id)
            return mine
        except UNACKED:
            pass  # read again: stored or not
        except nats.js.errors.APIError as err:
            if err.err_code not in WRONG_LAST_SEQUENCE:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not read or write the job's store identity on {subjects.store}")
        await asyncio.sleep(0.1)  # a refusal answered at once would otherwise be asked again at once


async def made_from(js, subjects: JobSubjects, adopt: str, step: int):
    """The job's store identity where its store was made to go on from the checkpoint of store
    `adopt` at step `step` (`recover_store`); None where it was not, has none, or cannot be read."""
    made = await current_identity(js, subjects)
    return made if made is not None and (made.adopts, made.adopted_step) == (adopt, step) else None


async def current_identity(js, subjects: JobSubjects):
    """The job's store identity; None where it has none or it cannot be read."""
    try:
        made = await _identity_if_any(js, subjects)
    except MessageError:
        return None
    return made[0] if made is not None else None


async def recover_store(
    js, subjects: JobSubjects, spec: JobSpec, adopt: str, step: int, claims: Claims, replicas: int | None = None
):
    """Make the job's store, lost or replaced, go on from a trainer checkpoint (step `step`, taken
    with store `adopt`, with the job's problem claims then, `claims`): its streams emptied (what the
    services made in it since the loss started from nothing), a store identity that adopts the
    checkpoint's store (the trainer takes it and reads its micro-batches from the start), the
    checkpoint's step announced with no group credited yet (the generators' books start again
    with the store; the preprocessor builds that step first) and problem claims going on past the
    checkpoint's, those claimed then but not settled by its steps drawn again first. With the
    job's services stopped: running ones would keep the state of the store they started in. A
    store made already for this checkpoint is left as it is (the operator's record that it restored it
    may not have been written: its pods may run in it by now). A store is always made anew, even
    from the checkpoint's own store: the operator tells a store its job's pods may run in by its
    adopting the record (`made_from`)."""
    made = await made_from(js, subjects, adopt, step)
    if made is not None:
        return made
    await delete_streams(js, subjects)
    await ensure_streams(js, subjects, spec.nats.max_payload_mb, replicas, stream_bytes(spec))
    await js.publish(subjects.version, encode(PolicyVersion(version=step, timestamp=time.time())), timeout=10.0)
    await js.publish(subjects.problems, claims.text().encode(), timeout=10.0)
    # The checkpoint it goes on from, told as its trainer tells one: a job suspended again before
    # its trainer told any (its pods never started) keeps it, and its next resume goes on from it.
    told = Checkpointed(store=adopt, step=step, problems=claims.next, redraw=claims.redraw_text)
    await js.publish(subjects.checkpoint, encode(told), timeout=10.0)
    # Last: a store is adopted by its identity, so one cut short before it is never gone on from
    # (with claims from 0, problems trained would be drawn again); the command is run again.
    identity = _fresh(adopts=adopt, adopted_step=step)
    await js.publish(subjects.store, encode(identity), timeout=10.0)
    return identity
