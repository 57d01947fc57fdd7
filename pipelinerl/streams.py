"""NATS JetStream plumbing of a job: its streams' configurations (names in
`pipelinerl.contracts.JobSubjects`) and deletion, connections, reads of a service's position,
problem claims and publishes, each with a bounded wait. Which store the streams are, and making
them, is `pipelinerl.store`."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from pipelinerl.capacity import stream_bytes
from pipelinerl.claims import Claims, Range, parse_ranges, ranges_text
from pipelinerl.contracts import DEADLETTER_REASON, JobSubjects
from pipelinerl.spec import JobSpec

log = logging.getLogger("pipelinerl.streams")
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # a restarting service's reads of its position: NATS may be restarting too
# How long JetStream remembers a message id, so that a publish sent again is stored once
# (`publish_once`); a server keeps the ids of this long's messages in memory.
DUPLICATE_WINDOW_S = 600.0


def stream_configs(
    subjects: JobSubjects, max_msg_bytes: int, replicas: int = 1, sizes: dict[str, int] | None = None
) -> list[StreamConfig]:
    """`replicas`: copies kept by a JetStream cluster (the chart's `nats.replicas`): a stream
    outlives the loss of a minority of its servers. `sizes`: each stream's max_bytes
    (`capacity.stream_bytes` of the job; None: of a job with the default spec)."""
    size = sizes or stream_bytes(JobSpec())
    common: dict[str, Any] = dict(
        storage=StorageType.FILE,
        max_msg_size=max_msg_bytes,
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=replicas,
    )
    return [
        # Rollouts: work for the preprocessor, one subject per generator, removed once acked by
        # it (a removal survives a kill -9 of nats-server; an acknowledgement may not). Full:
        # new publishes are refused (and wait for room: `publish_once`), nothing queued is dropped.
        StreamConfig(
            name=subjects.stream("ROLLOUTS"),
            subjects=[subjects.rollouts(">")],
            retention=RetentionPolicy.WORK_QUEUE,
            max_bytes=size["ROLLOUTS"],
            discard=DiscardPolicy.NEW,
            **common,
        ),
        # Batches: kept (bounded) so a trainer restarted from a checkpoint can replay them.
        StreamConfig(
            name=subjects.stream("BATCHES"),
            subjects=[subjects.batches(">")],
            retention=RetentionPolicy.LIMITS,
            max_bytes=size["BATCHES"],
            discard=DiscardPolicy.OLD,
            **common,
        ),
        # Control: the latest policy version, the next training problem unclaimed, the problems
        # each generator holds, which store this is, the trainer's newest checkpoint and the newest
        # version it began to send, only.
        StreamConfig(
            name=subjects.stream("CONTROL"),
            subjects=[
                subjects.version,
                subjects.problems,
                subjects.held(">"),
                subjects.store,
                subjects.checkpoint,
                subjects.sent,
            ],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,
            max_bytes=size["CONTROL"],
            **common,
        ),
        StreamConfig(
            name=subjects.stream("METRICS"),
            subjects=[subjects.metrics(">")],
            retention=RetentionPolicy.LIMITS,
            max_bytes=size["METRICS"],
            discard=DiscardPolicy.OLD,
            **common,
        ),
        # Dead letters: rejected rollouts and micro-batches with their reason (headers).
        StreamConfig(
            name=subjects.stream("DEADLETTER"),
            subjects=[subjects.deadletter(">")],
            retention=RetentionPolicy.LIMITS,
            max_bytes=size["DEADLETTER"],
            discard=DiscardPolicy.OLD,
            **common,
        ),
    ]


async def connect(
    url: str,
    name: str,
    user: str | None = None,
    password: str | None = None,
    reconnect: bool = True,
    timeout_s: float = CONNECT_TIMEOUT_S,
    reconnect_wait_s: float = 0.5,
) -> nats.NATS:
    """A client that reconnects through server restarts, however long they take (every call on
    it has a bound of its own: a client that gave up after a number of tries was closed for good,
    and a service waiting on its subscriptions then waited forever, healthy to its probes),
    unless `reconnect` is False (a one-off call that must fail fast, such as the operator's
    cleanup); `url`: one or more servers, comma-separated (`nats.url`); `user`/`password`: the
    job's NATS credentials, where the server requires them (the chart's NATS does). `timeout_s`
    bounds the connect and a publish's wait for the socket to take what is queued (past
    PENDING_BYTES: nats-py waits with no bound by default on a server that reads nothing; then
    the publish's own timeout runs). The first connection is given FIRST_CONNECT_S (nats-py
    would try a server that is not there for as long as it reconnects: forever)."""

    async def _err(e: Exception) -> None:
        print(f"[{name}] nats: {e}", file=sys.stderr)

    return await wait_for(
        nats.connect(
            servers=url.split(","),
            name=name,
            user=user,
            password=password,
            connect_timeout=timeout_s,
            flush_timeout=timeout_s,
            reconnect_time_wait=reconnect_wait_s,
            max_reconnect_attempts=-1 if reconnect else 0,
            allow_reconnect=reconnect,
            pending_size=PENDING_BYTES,
            error_cb=_err,
        ),
        FIRST_CONNECT_S,
        f"a first connection to NATS at {url}",
    )


FIRST_CONNECT_S = 60.0


# What a client buffers while it reconnects: publishes past it are refused at once
# (OutboundBufferLimitError; nats-py's default is 2 MiB, less than one micro-batch may be). What
# is buffered is what the service holds anyway, each publish awaited: a wave of micro-batches.
PENDING_BYTES = 256 << 20


async def close(nc: nats.NATS, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close `nc`, giving up after `timeout_s`: nats-py's close waits, with no bound, for what is
    queued on a socket that may have stalled. Every caller has had its publishes acknowledged."""
    try:
        await asyncio.wait_for(nc.close(), timeout_s)
    except TimeoutError:
        print(f"[{nc.options.get('name')}] nats: not closed within {timeout_s:g} s; left to the exit", file=sys.stderr)


async def delete_streams(js, subjects: JobSubjects) -> list[str]:
    deleted = []
    for name in subjects.streams:
        try:
            await js.delete_stream(name)
            deleted.append(name)
        except NotFoundError:
            pass
    return deleted


async def last_message(js, stream: str, subject: str, timeout_s: float = READ_TIMEOUT_S) -> bytes | None:
    """The data of the stream's last message on `subject`; None only when there is none. A read
    that times out or finds no connection is retried until `timeout_s`, then raises: it never
    passes for "nothing there" (which would reset a restarting service's books)."""
    last = await read_last(js, stream, subject, time.monotonic() + timeout_s)
    return last.data if last is not None else None


async def read_last(js, stream: str, subject: str, deadline: float):
    """The stream's last message on `subject` (None: none), retried until `deadline`. A stream
    not found is no answer either: the services made it at their start, so the store is lost
    (then the reader's restart finds a new one) or JetStream is still recovering it."""
    delay = 0.5
    while True:
        try:
            return await js.get_last_msg(stream, subject)
        except NotFoundError as err:
            if err.err_code != STREAM_NOT_FOUND:
                return None
            failed: Exception = err
        except Exception as err:  # timeouts, a connection being re-established
            failed = err
        if time.monotonic() + delay > deadline:
            raise TimeoutError(
                f"could not read the last message on {subject}: {type(failed).__name__}: {failed}"
            ) from None
        log.warning("reading the last message on %s failed (%s: %s); retrying", subject, type(failed).__name__, failed)
        await asyncio.sleep(delay)
        delay = min(2 * delay, 5.0)


async def last_announcement(js, subjects: JobSubjects, timeout_s: float = READ_TIMEOUT_S):
    """The newest PolicyVersion announced on the job's CONTROL stream (None: none yet); a read
    that fails is retried, never taken for "none" (`last_message`)."""
    from pipelinerl.messages import PolicyVersion, decode

    data = await last_message(js, subjects.stream("CONTROL"), subjects.version, timeout_s)
    return decode(data, PolicyVersion) if data is not None else None


async def last_sent(js, subjects: JobSubjects, timeout_s: float = READ_TIMEOUT_S) -> int:
    """The newest version trainer rank 0 began to broadcast (0: none); as `last_announcement`."""
    from pipelinerl.messages import WeightsSent, decode

    data = await last_message(js, subjects.stream("CONTROL"), subjects.sent, timeout_s)
    return decode(data, WeightsSent).version if data is not None else 0


async def newest_batches(js, subjects: JobSubjects, ranks: int, timeout_s: float = READ_TIMEOUT_S) -> list:
    """The newest micro-batch stored for each trainer rank (None: none yet), from which the
    books are restored (`books.restore`); reads that fail are retried (`last_message`). One that
    cannot be decoded raises MessageError naming its subject."""
    from pipelinerl.messages import MessageError, MicroBatch, decode

    out = []
    for rank in range(ranks):
        subject = subjects.batches(rank)
        data = await last_message(js, subjects.stream("BATCHES"), subject, timeout_s)
        try:
            out.append(decode(data, MicroBatch) if data is not None else None)
        except MessageError as err:
            raise MessageError(f"the newest message on {subject}: {err}") from None
    return out


async def claim_problems(js, subjects: JobSubjects, count: int, timeout_s: float = READ_TIMEOUT_S) -> list[int]:
    """`count` training problem indices that no generator has drawn or will (those to draw again
    first, `claims.Claims`): the job's claims are one record on the CONTROL stream, replaced by an
    append that JetStream makes only if nobody appended since it was read (`_change_claims`).
    Whatever the generators' number, incarnations or arrivals, no two get one index; a claim left
    undecided leaves its indices unsettled, never given twice."""
    taken, _ = await _change_claims(
        js, subjects, lambda claims: claims.take(count), "claim training problems", timeout_s
    )
    return taken


async def give_back_problems(
    js, subjects: JobSubjects, rank: int, held: Sequence[Range], timeout_s: float = READ_TIMEOUT_S
) -> None:
    """Generator `rank`, stopping, gives back the problems it holds (`hold_problems`): whichever
    generator claims next draws them first, its own restart or, where the job no longer runs it
    (scaled down), a peer. Its record is emptied first: a stop cut short between the two writes,
    or a give-back not made in time (`_change_claims`), leaves them unsettled (drawn again at a
    recovery), never drawn twice. Both writes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    await hold_problems(js, subjects, rank, [], timeout_s)
    change = lambda claims: (None, claims.given_back(held))  # noqa: E731
    await _change_claims(js, subjects, change, "give back problems", max(0.1, deadline - time.monotonic()), True)


async def _change_claims(js, subjects: JobSubjects, change, what: str, timeout_s: float, same_effect: bool = False):
    """`change(claims)` -> (result, claims after), appended to the claims record only if nobody
    appended since it was read (an expected last sequence), made anew from a fresh read until one
    is; not made by `timeout_s`: TimeoutError. An append left undecided (a lost acknowledgement, a
    NATS restart, a clustered stream still applying it) may have been stored. Where whichever
    append is stored has `same_effect` (a give-back), the next carry its message id, so that one
    stored answers them as a duplicate, never made twice over a peer's claim; else (a claim, whose
    indices are its own) each has a fresh id, and one stored undecided leaves a gap, never an index
    given twice. (A refused id is never used again: a clustered stream keeps it as in process.)
    The result of the change stored."""
    subject, stream = subjects.problems, subjects.stream("CONTROL")
    deadline = time.monotonic() + timeout_s
    undecided: str | None = None  # the id of an append perhaps stored, of `same_effect`
    while True:
        try:
            last = await read_last(js, stream, subject, deadline)
        except TimeoutError as err:
            raise TimeoutError(f"could not {what} on {subject} in {timeout_s:.0f}s ({err})") from None
        seq, claims = (last.seq, _claims(last.data, subject)) if last is not None else (0, Claims())
        result, after = change(claims)
        msg_id = undecided or uuid.uuid4().hex
        try:
            await js.publish(
                subject,
                after.text().encode(),
                timeout=5.0,
                headers={"Nats-Expected-Last-Subject-Sequence": str(seq), "Nats-Msg-Id": msg_id},
            )
            return result, after
        except UNACKED:
            undecided = msg_id if same_effect else None
        except nats.js.errors.APIError as err:
            if err.err_code == DUPLICATE_IN_PROCESS:  # (of `same_effect` only: others' ids are fresh)
                undecided = msg_id
            elif err.err_code not in WRONG_LAST_SEQUENCE:
                raise
            # refused: another append came first (perhaps an undecided one of this id, read next)
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not {what} on {subject} in {timeout_s:.0f}s")
        await asyncio.sleep(0.01)


async def held_problems(js, subjects: JobSubjects, rank: int, timeout_s: float = READ_TIMEOUT_S) -> list[Range]:
    """The training problems generator `rank`'s incarnations claimed and did not publish a group of
    (`hold_problems`): its restart draws them first."""
    from pipelinerl.messages import MessageError

    subject = subjects.held(rank)
    data = await last_message(js, subjects.stream("CONTROL"), subject, timeout_s)
    try:
        return parse_ranges(data.decode(errors="replace"), subject) if data is not None else []
    except ValueError as err:
        raise MessageError(str(err)) from None


async def hold_problems(
    js, subjects: JobSubjects, rank: int, held: Sequence[Range], timeout_s: float = READ_TIMEOUT_S
) -> None:
    """Record the problems generator `rank` holds: claimed (or taken over from its predecessor) and
    no group of them published yet. Replaced as a whole (one record per rank, written by its one
    live incarnation), sent again until acknowledged: the same record twice is the record."""
    subject, deadline = subjects.held(rank), time.monotonic() + timeout_s
    while True:
        try:
            await js.publish(subject, ranges_text(held).encode(), timeout=5.0)
            return
        except UNACKED as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not record the problems held on {subject} in {timeout_s:.0f}s") from err
        await asyncio.sleep(0.1)


def _claims(data: bytes, subject: str) -> Claims:
    from pipelinerl.messages import MessageError

    try:
        return Claims.parse(data.decode(errors="replace"))
    except ValueError as err:
        raise MessageError(f"{subject}: {err}") from None


async def last_checkpoint(js, subjects: JobSubjects, timeout_s: float = READ_TIMEOUT_S):
    """The trainer's newest checkpoint (`messages.Checkpointed`; None: none told yet)."""
    from pipelinerl.messages import Checkpointed, decode

    data = await last_message(js, subjects.stream("CONTROL"), subjects.checkpoint, timeout_s)
    return decode(data, Checkpointed) if data is not None else None


async def problems_claimed(js, subjects: JobSubjects, timeout_s: float = READ_TIMEOUT_S) -> int:
    """The job's problem claims' count (`claim_problems`): every index below it was claimed."""
    data = await last_message(js, subjects.stream("CONTROL"), subjects.problems, timeout_s)
    return _claims(data, subjects.problems).next if data is not None else 0


# JetStream's error codes where another append came first (10164: a clustered stream's, for one
# still being applied), and where an append of this message id is still being applied.
WRONG_LAST_SEQUENCE = frozenset({10071, 10164})
DUPLICATE_IN_PROCESS = 10158
STREAM_NOT_FOUND = 10059  # ... and for a stream it does not hold (10037: no message on the subject)

# No reply to a publish: the request or its ack lost while the client reconnects to a restarted
# server, or JetStream still recovering its streams there.
UNACKED = (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


UNACKNOWLEDGED = Counter(
    "pipelinerl_publish_unacknowledged_total",
    "Publishes to the job's streams that JetStream did not acknowledge in time (sent again, or given up)",
)
# What a publish with no acknowledgement usually means, for the log: JetStream unable to write is
# silent to clients (no error reply), and says why only in its own log and /healthz.
NO_ACK_CAUSE = "nats-server restarting, or JetStream unable to write its store (a full disk: its /healthz and log say)"


_unacknowledged: list[tuple[float, str]] = []  # the newest publish left unacknowledged: (wall clock, what)


def recent_unacknowledged(within_s: float = 120.0) -> str:
    """What this process last published unacknowledged, if within `within_s` ("" otherwise): for
    its /status (the trainer's is the job's StoreNotAcknowledging condition)."""
    if not _unacknowledged or time.time() - _unacknowledged[-1][0] > within_s:
        return ""
    return _unacknowledged[-1][1]


ROOM_WAIT_S = 1800.0  # how long a publish waits for room in a full stream (`publish_once`)
ROOM_POLL_S = 2.0


def stream_full(err: Exception) -> bool:
    """JetStream refused a message for its stream's limits (ROLLOUTS, which drops nothing queued:
    `maximum bytes exceeded`), not for a failure of its own."""
    return isinstance(err, nats.js.errors.APIError) and str(err.description or "").startswith("maximum ")


async def publish_once(
    js,
    subject: str,
    data: bytes,
    msg_id: str,
    headers: dict | None = None,
    timeout_s: float = 30.0,
    attempts: int = 3,
    room_wait_s: float = ROOM_WAIT_S,
):
    """Publish to a stream until acknowledged, at most `attempts` tries of `timeout_s` each. The
    message id makes a retry idempotent: JetStream stores it once and acks a repeat as a
    duplicate (`ack.duplicate`), so a publish whose ack was lost is simply sent again. A stream
    full to its limits is waited on, up to `room_wait_s`: ROLLOUTS fills when the preprocessor
    takes nothing (its trainer behind) while generators publish groups admission does not bound
    (those the preprocessor filters), and drains as the trainer goes on; failing, a generator
    would restart and lose every group it is writing.

    A try left unanswered may have been stored: sent again within the stream's duplicate window
    it is a duplicate, past it a second copy. So it is not sent again once half the window has
    gone since the first such try (a process frozen between a publish and its ack: a paused pod,
    a node that stopped answering): TimeoutError instead, and the service restarts from what its
    streams hold."""
    attempt, full_since, unknown_since, unanswered = 1, None, None, None
    while True:
        # Right before each send (a back-off or a wait for room may be where the process froze).
        if unknown_since is not None and time.monotonic() - unknown_since >= DUPLICATE_WINDOW_S / 2:
            raise TimeoutError(
                f"publish of {msg_id} to {subject} not acknowledged for {time.monotonic() - unknown_since:.0f} s "
                f"(this process was frozen, or {NO_ACK_CAUSE}): not sent again, as past the stream's duplicate "
                f"window ({DUPLICATE_WINDOW_S:.0f} s) JetStream could store it twice"
            ) from unanswered
        sent_at = time.monotonic()
        try:
            try:
                return await js.publish(
                    subject, data, timeout=timeout_s, headers={**(headers or {}), "Nats-Msg-Id": msg_id}
                )
            except nats.js.errors.APIError as err:
                if err.err_code != DUPLICATE_IN_PROCESS:
                    raise
                # A clustered stream still applying an earlier try of it: unanswered as yet.
                raise nats.errors.TimeoutError from err
        except UNACKED as err:
            if stream_full(err):
                # Refused, so not stored (JetStream looks for a duplicate before at its limits): no
                # earlier try of it was, and the wait for room is not bounded by the window.
                unknown_since = unanswered = None
                if full_since is None:
                    full_since = time.monotonic()
                    log.warning("%s is full (%s): %s waits for room", subject, err, msg_id)
                elif time.monotonic() - full_since > room_wait_s:
                    raise TimeoutError(f"{subject} full for {room_wait_s:.0f}s: {msg_id} not stored ({err})") from err
                await asyncio.sleep(ROOM_POLL_S)
                continue
            UNACKNOWLEDGED.inc()
            _unacknowledged[:] = [(time.time(), f"a publish to {subject} not acknowledged ({NO_ACK_CAUSE})")]
            if attempt == attempts:
                raise TimeoutError(
                    f"publish of {msg_id} to {subject} not acknowledged in {attempts} tries ({NO_ACK_CAUSE})"
                ) from err
            unknown_since, unanswered = unknown_since or sent_at, err
            log.warning(
                "publish of %s to %s not acknowledged (%s: %s); sending it again (%d of %d)",
                msg_id,
                subject,
                type(err).__name__,
                NO_ACK_CAUSE,
                attempt + 1,
                attempts,
            )
            await asyncio.sleep(attempt)
            attempt += 1


ACK_TRY_S = 5.0  # one try of an acknowledgement's confirmation (`acknowledge`)


async def acknowledge(msg, js, timeout_s: float = READ_TIMEOUT_S) -> None:
    """A JetStream message acknowledged, with the server's confirmation (a plain ack is sent and
    forgotten: one lost with a connection or a server restart came back after the ack wait, when
    the step that settled it may be long gone). A try unanswered is made again until `timeout_s`
    (JetStream confirms an ack of a message already acknowledged too), then TimeoutError; unless
    the consumer no longer counts the message as delivered (`delivery_forgotten`): then no
    confirmation will ever come, and the message comes again as the consumer's next."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await msg.ack_sync(timeout=ACK_TRY_S)
            return
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as err:
            if await delivery_forgotten(js, msg):
                log.warning(
                    "message %d of %s: its delivery was lost with the server's restart, so its acknowledgement is "
                    "never confirmed; it comes again, to be taken once",
                    msg.metadata.sequence.stream,
                    msg.metadata.stream,
                )
                return
            which = f"message {msg.metadata.sequence.stream} of {msg.metadata.stream}"
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the acknowledgement of {which} not confirmed in {timeout_s:.0f}s ({NO_ACK_CAUSE})"
                ) from err
            log.warning("the acknowledgement of %s not confirmed (%s): sending it again", which, type(err).__name__)
            await asyncio.sleep(0.5)


async def delivery_forgotten(js, msg) -> bool:
    """Whether the message's consumer has its next delivery at or before the message: a
    nats-server killed before it stored its consumer's newest deliveries. JetStream then drops an
    acknowledgement of the message with no reply (nats-server's `processAckMsg`: an ack at or past
    the consumer's next sequence is not applied) and delivers the message again. False when the
    consumer's state cannot be read now."""
    md = msg.metadata
    try:
        info = await js.consumer_info(md.stream, md.consumer, timeout=ACK_TRY_S)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.Error):
        return False
    return info.delivered.stream_seq < md.sequence.stream


async def dead_letter(js, subjects: JobSubjects, kind: str, data: bytes, reason: str, msg_id: str) -> None:
    """Keep a rejected message (`kind`: "rollout", "batch") with its reason, once per `msg_id`."""
    reason = " ".join(reason.encode("ascii", "backslashreplace").decode().split())[:4000]  # a header: one ASCII line
    await publish_once(js, subjects.deadletter(kind), data, msg_id, {DEADLETTER_REASON: reason})


async def stored_messages(js, stream: str, newest: int | None = None) -> list:
    """Every message a stream holds (the `newest` ones only: those of the last `newest`
    sequences), oldest first (nats messages: .subject, .data, .headers)."""
    state = (await js.stream_info(stream)).state
    if not state.messages:
        return []
    out = []
    first = state.first_seq if newest is None else max(state.first_seq, state.last_seq - newest + 1)
    for seq in range(first, state.last_seq + 1):
        try:
            out.append(await js.get_msg(stream, seq))
        except NotFoundError:  # deleted (acknowledged work, or over a limit)
            pass
    return out


async def wait_for(coro, timeout_s: float, what: str):
    """await with a timeout that names what it was waiting for. A timeout of the awaited call's own
    (nats-py's is a TimeoutError too: a request unanswered in its 5 s) goes out as it is: it
    is not this wait's, and reported as one it named a deadline that had not passed."""
    scope = asyncio.timeout(timeout_s)
    try:
        async with scope:
            return await coro
    except TimeoutError:
        if scope.expired():
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None
        raise
