"""Real nats-server: stream set-up, round trip, de-duplication, redelivery, crash recovery."""

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from pipelinerl import messages as m
from pipelinerl.contracts import STREAM_SUFFIXES, JobSubjects
from pipelinerl_cli.embedded_nats import EmbeddedNats
from pipelinerl.streams import close, connect
from pipelinerl.store import ensure_streams

SUBJECTS = JobSubjects("t-job")


def group(i: int) -> m.RolloutGroup:
    s = m.Sample(tokens=[1, 2, 3], mask=[0, 1, 1], logprobs=[0, -1, -2], versions=[-1, 0, 0], reward=float(i % 2))
    return m.RolloutGroup(group_id=f"g{i}", generator=0, samples=[s, s])


async def publish(js, i: int):
    return await js.publish(SUBJECTS.rollouts(0), m.encode(group(i)), headers={"Nats-Msg-Id": f"g{i}"}, timeout=5)


async def published(url: str, count: int):
    """A connection to a job's streams with `count` rollout groups published, and a pull
    consumer that redelivers after 1 s without an ack."""
    nc = await connect(url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    for i in range(count):
        await publish(js, i)
    sub = await js.pull_subscribe(
        SUBJECTS.rollouts(">"), durable="pre", config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0)
    )
    return nc, sub


async def test_streams_are_idempotent_and_round_trip(nats_server):
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    await ensure_streams(js, SUBJECTS, 8)  # a second service doing the same is harmless
    names = {s.config.name for s in await js.streams_info()}
    assert names == set(SUBJECTS.streams) == {f"PRL_DEFAULT_T-JOB_{s}" for s in STREAM_SUFFIXES}
    for i in range(5):
        await publish(js, i)
    dup = await publish(js, 3)  # a retried publish is recognised and not stored twice
    assert dup.duplicate
    sub = await js.pull_subscribe(SUBJECTS.rollouts(">"), durable="pre")
    msgs = await sub.fetch(10, timeout=2)
    got = [m.decode(x.data, m.RolloutGroup) for x in msgs]
    assert [g.group_id for g in got] == [f"g{i}" for i in range(5)]
    assert got[2] == group(2)
    await nc.close()


async def test_unacked_messages_are_redelivered(nats_server):
    nc, sub = await published(nats_server.url, 3)
    first = await sub.fetch(3, timeout=2)
    await first[0].ack()
    await first[2].ack()
    await asyncio.sleep(1.5)  # past ack_wait: only the unacked one comes back
    again = await sub.fetch(3, timeout=2)
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in again] == ["g1"]
    assert again[0].metadata.num_delivered == 2
    await again[0].ack()
    await nc.close()


async def test_server_crash_keeps_acked_and_unacked_state(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    nc, sub = await published(server.url, 4)
    msgs = await sub.fetch(4, timeout=2)
    for x in msgs[:2]:
        await x.ack_sync()
    await nc.close()
    server.stop(kill=True)  # kill -9: no clean shutdown
    server = EmbeddedNats(tmp_path / "nats", port=server.port).start()
    nc = await connect(server.url, "test")
    js = nc.jetstream()
    sub = await js.pull_subscribe(SUBJECTS.rollouts(">"), durable="pre")
    await asyncio.sleep(1.2)
    again = await sub.fetch(4, timeout=3)
    assert sorted(m.decode(x.data, m.RolloutGroup).group_id for x in again) == ["g2", "g3"]
    await nc.close()
    server.stop()


async def test_an_acknowledgement_the_server_forgot_delivering_is_not_waited_on(nats_server):
    """A nats-server killed before it stored its consumer's newest deliveries (a kill -9 just after
    a fetch; CI saw the preprocessor wait its whole 120 s on three such acknowledgements, then
    crash) never confirms an acknowledgement of them, and delivers them again. `acknowledge` sees
    the consumer's next delivery at or before the message and stops waiting after one try; the
    message comes again. Modelled here by the consumer made again, which leaves its next delivery
    at the stream's first message as such a restart does (a real kill -9 leaves it so only
    sometimes); with the server hung, the consumer's state unreadable, it waits to its bound."""
    from pipelinerl.streams import ACK_TRY_S, acknowledge

    nc, sub = await published(nats_server.url, 3)
    js = nc.jetstream()
    first = await sub.fetch(3, timeout=2)
    await acknowledge(first[0], js)  # confirmed: g0 leaves the work queue
    stream = SUBJECTS.stream("ROLLOUTS")
    config = (await js.consumer_info(stream, "pre")).config
    await js.delete_consumer(stream, "pre")
    await js.add_consumer(stream, config)  # its next delivery: g1 again
    started = time.monotonic()
    await acknowledge(first[1], js, timeout_s=60)
    assert time.monotonic() - started < 2 * ACK_TRY_S + 2  # one try and one read, not 60 s
    again = await sub.fetch(3, timeout=2)
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in again] == ["g1", "g2"]
    await acknowledge(again[0], js)  # the new delivery's is confirmed
    hang(nats_server)
    try:
        seq = again[1].metadata.sequence.stream  # named, with its stream
        with pytest.raises(TimeoutError, match=f"acknowledgement of message {seq} of {stream} not confirmed in 1s"):
            await acknowledge(again[1], js, timeout_s=1)
    finally:
        resume(nats_server)
    await nc.close()


def hang(server: EmbeddedNats) -> None:
    """SIGSTOP the server and wait until it is stopped: the signal takes effect only when its
    threads next run, and on a loaded machine a request sent meanwhile still gets a reply."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    status = Path(f"/proc/{server.proc.pid}/status")
    deadline = time.monotonic() + 10
    while "State:\tT" not in status.read_text():
        assert time.monotonic() < deadline, "nats-server did not stop in 10 s"
        time.sleep(0.01)


def resume(server: EmbeddedNats) -> None:
    os.kill(server.proc.pid, signal.SIGCONT)


async def test_a_read_that_times_out_is_retried_never_taken_for_empty(nats_server):
    from pipelinerl.streams import last_message

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    await publish(js, 7)
    stream = SUBJECTS.stream("ROLLOUTS")
    assert await last_message(js, stream, SUBJECTS.rollouts(1)) is None  # truly empty
    hang(nats_server)  # the server hangs: every request times out
    try:
        read = asyncio.ensure_future(last_message(js, stream, SUBJECTS.rollouts(0)))
        await asyncio.sleep(7)  # past the client's 5 s request timeout: a failed attempt is behind us
        assert not read.done()
    finally:
        resume(nats_server)
    data = await asyncio.wait_for(read, 30)
    assert m.decode(data, m.RolloutGroup).group_id == "g7"
    hang(nats_server)
    try:
        with pytest.raises(TimeoutError, match="could not read the last message"):
            await last_message(js, stream, SUBJECTS.rollouts(0), timeout_s=3)
    finally:
        resume(nats_server)
    await nc.close()


async def test_a_stream_not_found_is_no_answer_never_taken_for_empty(nats_server):
    # The job's streams gone (its store lost, or JetStream still recovering it after a restart):
    # the claims read as 0 once made a checkpoint tell a recovered store to draw every problem
    # again. The read is retried and names the missing stream when its time runs out; a stream
    # made again meanwhile is read.
    from pipelinerl.streams import claim_problems, delete_streams, last_message, problems_claimed

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    await claim_problems(js, SUBJECTS, 20)
    assert await problems_claimed(js, SUBJECTS) == 20
    await delete_streams(js, SUBJECTS)
    with pytest.raises(TimeoutError, match="stream not found"):
        await problems_claimed(js, SUBJECTS, timeout_s=2)
    read = asyncio.ensure_future(last_message(js, SUBJECTS.stream("CONTROL"), SUBJECTS.problems, timeout_s=30))
    await asyncio.sleep(1)
    assert not read.done()
    await ensure_streams(js, SUBJECTS, 8)
    assert await asyncio.wait_for(read, 30) is None  # the new store holds no claim yet
    await nc.close()


def test_a_checkpoint_takes_its_problem_claims_from_its_own_store_only(nats_server):
    """A trainer checkpoint keeps the job's problem claims (a recovered store claims past them).
    Read from a store that replaced the trainer's under the run, they would be the new store's,
    and a store recovered from that checkpoint would draw trained problems again: StoreLost."""
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.spec import parse_job
    from pipelinerl.streams import claim_problems, delete_streams
    from pipelinerl_trainer.bridge import NatsBridge
    from pipelinerl_trainer.position import Position, StoreLost
    from pipelinerl_trainer.trainer import problems_claimed

    job = parse_job({"metadata": {"name": SUBJECTS.job}, "spec": {}})
    bridge = NatsBridge(job, ServiceEnv("trainer", nats_url=nats_server.url), "test")  # makes the streams
    try:
        position = Position(store=bridge.store_identity().id)
        bridge.call(claim_problems(bridge.js, job.subjects, 20), 30)
        assert problems_claimed(bridge, position) == 20
        bridge.call(delete_streams(bridge.js, job.subjects), 30)  # the store replaced: a service made it anew
        bridge.call(ensure_streams(bridge.js, job.subjects, 8), 30)
        bridge.call(claim_problems(bridge.js, job.subjects, 4), 30)  # and a generator claimed in it
        with pytest.raises(StoreLost, match=f"belongs to the job's NATS store {position.store}"):
            problems_claimed(bridge, position)
        assert bridge.problems_claimed() == 4  # what the checkpoint would have kept
    finally:
        bridge.close()


async def test_a_claim_whose_read_times_out_is_retried_never_a_crash(nats_server):
    # A generator claims problems while nats-server restarts: a read with no reply (the client's
    # 5 s request timeout) is tried again until the claim's deadline, then names the subject.
    from pipelinerl.streams import claim_problems

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    assert await claim_problems(js, SUBJECTS, 4) == [0, 1, 2, 3]
    hang(nats_server)
    try:
        claim = asyncio.ensure_future(claim_problems(js, SUBJECTS, 4))
        await asyncio.sleep(7)  # past the read's 5 s timeout: a failed attempt is behind us
        assert not claim.done()
    finally:
        resume(nats_server)
    assert await asyncio.wait_for(claim, 30) == [4, 5, 6, 7]
    hang(nats_server)
    try:
        with pytest.raises(TimeoutError, match=f"could not claim training problems on {SUBJECTS.problems}"):
            await claim_problems(js, SUBJECTS, 4, timeout_s=3)
    finally:
        resume(nats_server)
    assert min(await claim_problems(js, SUBJECTS, 4)) >= 8  # a claim stored without its ack is a gap
    await nc.close()


async def test_a_publish_whose_ack_is_lost_is_sent_again_and_stored_once(nats_server):

    from pipelinerl.streams import publish_once, recent_unacknowledged, stored_messages

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    hang(nats_server)  # no reply to the first attempt
    try:
        pub = asyncio.ensure_future(publish_once(js, SUBJECTS.rollouts(0), m.encode(group(7)), "g7", timeout_s=2))
        await asyncio.sleep(3)
        assert not pub.done()
    finally:
        resume(nats_server)
    await asyncio.wait_for(pub, 30)  # the retry's ack (or the first one's, the retry a duplicate)
    stored = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in stored] == ["g7"]  # sent twice, stored once
    hang(nats_server)
    try:  # bounded: a server that never answers fails the publish after its attempts
        with pytest.raises(TimeoutError, match="g8 .* not acknowledged in 2 tries .*JetStream unable to write"):
            await publish_once(js, SUBJECTS.rollouts(0), m.encode(group(8)), "g8", timeout_s=1, attempts=2)
        assert "rollouts.0 not acknowledged" in recent_unacknowledged()  # for the trainer's /status
        assert recent_unacknowledged(within_s=-1) == ""
    finally:
        resume(nats_server)
    await nc.close()


async def test_a_publish_a_clustered_stream_is_still_applying_is_sent_again_not_a_failure(nats_server):
    """A clustered stream answers a try of a message id it is still applying (an earlier try's,
    unanswered) with 10158, "duplicate message id is in process": the publish is sent again as
    one unanswered, and stored once (it raised, and the generator or preprocessor restarted)."""
    import nats.js.errors

    from pipelinerl.streams import publish_once, stored_messages

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    publish, tries = js.publish, []

    async def in_process(subject, *args, **kwargs):
        tries.append(subject)
        if len(tries) == 1:
            await publish(subject, *args, **kwargs)  # stored, its answer still to come
            raise nats.js.errors.APIError(code=409, err_code=10158, description="duplicate message id is in process")
        return await publish(subject, *args, **kwargs)

    js.publish = in_process
    ack = await publish_once(js, SUBJECTS.rollouts(0), m.encode(group(9)), "g9", timeout_s=2)
    js.publish = publish
    assert len(tries) == 2 and ack.duplicate
    stored = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in stored] == ["g9"]
    await nc.close()


@pytest.mark.parametrize(
    "window_s, frozen_s",
    [(2.0, 2.5), (0.9, 0.0)],
    ids=["frozen-before-its-ack", "frozen-in-its-back-off"],
)
async def test_a_publish_unanswered_past_half_the_duplicate_window_is_not_sent_again(
    nats_server, monkeypatch, window_s, frozen_s
):
    """A publisher frozen between a publish JetStream stored and its ack (a paused pod) finds the
    try unanswered when it thaws. Sent again past the stream's duplicate window, it would be
    stored twice (a group trained twice); the publish fails instead, once half the window has gone,
    and the service restarts from what its streams hold. Within it, a retry is stored once (above).
    The window is looked at right before each send: frozen in the back-off (1 s, past a 0.9 s
    window) counts as much as frozen before the ack. The freeze is the test's stand-in, the server
    real."""
    import nats

    from pipelinerl import streams
    from pipelinerl.streams import publish_once, stored_messages

    monkeypatch.setattr(streams, "DUPLICATE_WINDOW_S", window_s)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)

    class Frozen:
        tries = 0

        async def publish(self, *args, **kwargs):
            self.tries += 1
            ack = await js.publish(*args, **kwargs)
            if self.tries == 1:  # stored; the process frozen past the window before it reads the ack
                await asyncio.sleep(frozen_s)
                raise nats.errors.TimeoutError
            return ack

    frozen = Frozen()
    with pytest.raises(TimeoutError, match=r"g5 to .* not acknowledged for \d s .*not sent again"):
        await publish_once(frozen, SUBJECTS.rollouts(0), m.encode(group(5)), "g5", timeout_s=1)
    stored = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
    assert frozen.tries == 1 and [m.decode(x.data, m.RolloutGroup).group_id for x in stored] == ["g5"]
    await nc.close()


async def test_a_full_stream_is_waited_on_past_the_window_of_an_earlier_unanswered_try(nats_server, monkeypatch):
    """A try unanswered (not stored: it never reached the server), then the stream full for longer
    than half the duplicate window: "full" says no try was stored, so the wait for room goes on
    (a restarted generator would lose every group it is writing) and the message is stored once."""
    import nats.errors
    import nats.js.errors

    from pipelinerl import streams
    from pipelinerl.streams import publish_once, stored_messages

    monkeypatch.setattr(streams, "DUPLICATE_WINDOW_S", 3.0)  # half of it: past the 1 s back-off, before 2.5 s
    monkeypatch.setattr(streams, "ROOM_POLL_S", 0.2)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)

    class LostThenFull:
        tries, full_until = 0, 0.0

        async def publish(self, *args, **kwargs):
            self.tries += 1
            if self.tries == 1:
                self.full_until = time.monotonic() + 2.5
                raise nats.errors.TimeoutError
            if time.monotonic() < self.full_until:
                raise nats.js.errors.ServiceUnavailableError(
                    code=503, err_code=10077, description="maximum bytes exceeded"
                )
            return await js.publish(*args, **kwargs)

    stub = LostThenFull()
    ack = await publish_once(stub, SUBJECTS.rollouts(0), m.encode(group(7)), "g7", timeout_s=1)
    assert not ack.duplicate and stub.tries > 3
    stored = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
    assert [m.decode(x.data, m.RolloutGroup).group_id for x in stored] == ["g7"]
    await nc.close()


async def test_a_publish_to_a_full_work_queue_waits_for_room_and_is_stored_once(nats_server, monkeypatch):
    """ROLLOUTS refuses new groups when full (it drops nothing queued): a generator's publish
    waits for the preprocessor to take some, where it failed and restarted the generator, which
    lost every group it was writing. Bounded: a stream that stays full fails it, naming why."""
    from pipelinerl import streams
    from pipelinerl.capacity import stream_bytes
    from pipelinerl.spec import JobSpec
    from pipelinerl.streams import publish_once, stored_messages

    monkeypatch.setattr(streams, "ROOM_POLL_S", 0.2)
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8, sizes=stream_bytes(JobSpec()) | {"ROLLOUTS": 1200})
    i = 0

    async def fill() -> None:
        nonlocal i
        while True:
            try:
                await publish(js, i)
            except Exception as err:  # noqa: BLE001
                assert streams.stream_full(err), err
                return
            i += 1

    await fill()
    full = i
    waiting = asyncio.ensure_future(publish_once(js, SUBJECTS.rollouts(0), m.encode(group(99)), "g99"))
    await asyncio.sleep(4)  # past the tries a publish JetStream does not acknowledge gets
    assert not waiting.done()
    sub = await js.pull_subscribe(SUBJECTS.rollouts(">"), durable="pre")
    for msg in await sub.fetch(2, timeout=5):  # the preprocessor takes two: room for one more
        await msg.ack_sync()
    await asyncio.wait_for(waiting, 10)
    stored = [m.decode(x.data, m.RolloutGroup).group_id for x in await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))]
    assert stored.count("g99") == 1 and len(stored) == full - 1
    await fill()
    with pytest.raises(TimeoutError, match="full for 1s: g100 not stored .*maximum bytes exceeded"):
        await publish_once(js, SUBJECTS.rollouts(0), m.encode(group(100)), "g100", room_wait_s=1)
    await nc.close()


async def test_the_newest_version_sent_is_kept_in_the_store_and_forgotten_with_it(nats_server):
    """The trainer's record of the version it began to broadcast (`WeightsSent`, its successor's
    floor) is the store's newest one, and a store made again to go on from a checkpoint
    (`recover_store`) holds none, as it holds only the checkpoint's announcement."""
    from pipelinerl.claims import Claims
    from pipelinerl.spec import JobSpec
    from pipelinerl.store import recover_store
    from pipelinerl.streams import last_announcement, last_sent

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    assert await last_sent(js, SUBJECTS) == 0
    for version in (6, 7):
        await js.publish(SUBJECTS.sent, m.encode(m.WeightsSent(version=version)), timeout=5)
    assert await last_sent(js, SUBJECTS) == 7
    await recover_store(js, SUBJECTS, JobSpec(), adopt="lost", step=4, claims=Claims(40))
    assert await last_sent(js, SUBJECTS) == 0 and (await last_announcement(js, SUBJECTS)).version == 4
    await nc.close()


class _CutAfter:
    """A JetStream context whose `calls`-th request, and every one after, times out: a restore cut
    short there (the operator bounds each by its NATS timeout)."""

    def __init__(self, js, calls: int) -> None:
        self.js, self.left = js, calls

    def __getattr__(self, name: str):
        method = getattr(self.js, name)

        async def call(*args, **kwargs):
            self.left -= 1
            if self.left < 0:
                raise asyncio.TimeoutError(f"cut short at {name}")
            return await method(*args, **kwargs)

        return call


async def test_a_restore_cut_short_anywhere_is_never_taken_as_made_and_the_next_one_makes_it_whole(nats_server):
    """`recover_store` cut short after each of its requests in turn (streams deleted, some made,
    the version or the claims written): the store is never taken as made from the checkpoint
    (`made_from`, which the operator's next pass asks), and the next restore makes the same store
    an uncut one does: the step announced, claims going on past the checkpoint's with its
    unsettled ones first, the checkpoint told, the identity adopting it."""
    from pipelinerl.claims import Claims
    from pipelinerl.spec import JobSpec
    from pipelinerl.store import made_from, recover_store
    from pipelinerl.streams import claim_problems, last_announcement, last_checkpoint
    from pipelinerl_operator.job_streams import RESTORE_REQUESTS

    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    try:
        cuts = 0
        while True:
            await ensure_streams(js, SUBJECTS, 8)
            await js.publish(SUBJECTS.rollouts(0), m.encode(group(1)))  # the lost store's leftovers
            cut = _CutAfter(js, cuts)
            try:
                await recover_store(cut, SUBJECTS, JobSpec(), "lost", 4, Claims.of(40, "7"))
            except asyncio.TimeoutError:
                assert await made_from(js, SUBJECTS, "lost", 4) is None, f"taken as made, cut after {cuts} requests"
                made = await recover_store(js, SUBJECTS, JobSpec(), "lost", 4, Claims.of(40, "7"))
            else:
                break  # no request left to cut after
            assert await made_from(js, SUBJECTS, "lost", 4) == made
            assert (await last_announcement(js, SUBJECTS)).version == 4
            told = await last_checkpoint(js, SUBJECTS, 5.0)
            assert (told.store, told.step, told.problems, told.redraw) == ("lost", 4, 40, "7")
            assert await claim_problems(js, SUBJECTS, 3) == [7, 40, 41]
            await js.purge_stream(SUBJECTS.stream("CONTROL"))  # the next round's store has no identity
            cuts += 1
        # every request of a restore was cut after in turn; the operator bounds a restore by their number
        assert cuts == RESTORE_REQUESTS
    finally:
        await nc.close()


def test_a_server_that_cannot_take_its_port_is_not_mistaken_for_the_one_there(tmp_path, nats_server):
    # Another server took the port between free_port() and the start (tests and benchmarks side
    # by side): this one fails to bind, and its start says so instead of handing out the
    # address of a server that is someone else's.
    with pytest.raises(RuntimeError, match="nats-server exited"):
        EmbeddedNats(tmp_path / "second", port=nats_server.port).start()


def test_recover_store_on_a_cluster_makes_the_new_store_adopt_the_checkpoint(nats_server, tmp_path):
    """`pipelinerl recover-store JOB --nats URL --adopt --step --problems --redraw` (the job
    suspended; what the trainer's StoreLost names), against a real nats-server: whatever the
    services made in the new store since the loss is gone; the store's identity adopts the lost
    one at that step, the step is announced with nothing credited, claims go on past the
    checkpoint's, those it did not settle drawn again first."""
    import subprocess
    import sys

    import yaml

    from pipelinerl.claims import Claims
    from pipelinerl.spec import JobSpec
    from pipelinerl.streams import claim_problems, last_announcement, stored_messages
    from pipelinerl.store import recover_store, store_identity

    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob",
                                        "metadata": {"name": "t-job"}, "spec": {}}))  # fmt: skip

    async def before():
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await ensure_streams(js, SUBJECTS, 8)
        fresh = await store_identity(js, SUBJECTS)  # a service made it, on the empty store
        await js.publish(SUBJECTS.rollouts(0), m.encode(group(1)))  # and generated from nothing
        await nc.close()
        return fresh

    fresh = asyncio.run(before())

    def cli(*more: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "pipelinerl_cli", "recover-store", str(manifest), *more]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    # Without the options: the checkpoint the trainer told on the store (as it found it lost); none there, refused.
    none_told = cli("--nats", nats_server.url)
    assert none_told.returncode == 2 and "no checkpoint told on the job's store" in none_told.stderr
    cmd = ["recover-store", str(manifest), "--nats", nats_server.url, "--adopt", "lost", "--step", "4"]
    missing = subprocess.run([sys.executable, "-m", "pipelinerl_cli", *cmd], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--problems" in missing.stderr  # all three, or nothing
    cmd += ["--problems", "40", "--redraw"]
    bad = subprocess.run(
        [sys.executable, "-m", "pipelinerl_cli", *cmd, "30-41"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--redraw: 30-41 reaches past the 40 problems claimed" in bad.stderr, bad.stderr
    done = subprocess.run(
        [sys.executable, "-m", "pipelinerl_cli", *cmd, "7,30-31"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "problem claims from 40, the 3 claimed then but not settled by its steps drawn again first" in done.stdout

    async def after():
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            identity = await store_identity(js, SUBJECTS)
            announced = await last_announcement(js, SUBJECTS)
            rollouts = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
            return identity, announced, rollouts, await claim_problems(js, SUBJECTS, 8)
        finally:
            await nc.close()

    identity, announced, rollouts, claimed = asyncio.run(after())
    assert identity.id != fresh.id and (identity.adopts, identity.adopted_step) == ("lost", 4)
    assert (announced.version, announced.trained_groups, announced.finished) == (4, {}, False)
    assert rollouts == [] and claimed == [7, 30, 31, 40, 41, 42, 43, 44]  # those not settled first

    async def again():  # the operator's record of the restore not written: its next pass restores again
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            await js.publish(SUBJECTS.rollouts(0), m.encode(group(2)))  # the resumed pods at work in it
            await recover_store(js, SUBJECTS, JobSpec(), "lost", 4, Claims.of(40, "7,30-31"))
            rollouts = await stored_messages(js, SUBJECTS.stream("ROLLOUTS"))
            return await store_identity(js, SUBJECTS), rollouts, await claim_problems(js, SUBJECTS, 8)
        finally:
            await nc.close()

    kept, rollouts, claimed = asyncio.run(again())
    assert kept == identity and len(rollouts) == 1 and claimed == list(range(45, 53))  # made once: nothing undone

    # The store holds the checkpoint it goes on from, told: without the options, that one, made already.
    same = cli("--nats", nats_server.url)
    assert same.returncode == 0 and "goes on from the checkpoint of step 4 (store lost)" in same.stdout, same.stdout
    assert asyncio.run(after())[0] == identity

    # The checkpoint's own store (never lost) left as it is; the options alone with --nats.
    async def tell(record: m.Checkpointed) -> None:
        nc = await connect(nats_server.url, "test")
        await nc.jetstream().publish(SUBJECTS.checkpoint, m.encode(record))
        await nc.close()

    asyncio.run(tell(m.Checkpointed(store=identity.id, step=9, problems=60)))
    own = cli("--nats", nats_server.url)
    assert own.returncode == 0 and f"store {identity.id} is the checkpoint's own (step 9): nothing" in own.stdout
    asyncio.run(tell(m.Checkpointed(store="lost-2", step=6, problems=60, redraw="50")))
    told = cli("--nats", nats_server.url)
    assert (
        told.returncode == 0
        and "the checkpoint of step 6 (store lost-2); problem claims from 60, the 1 " in told.stdout
    )
    identity, _, _, claimed = asyncio.run(after())
    assert (identity.adopts, identity.adopted_step) == ("lost-2", 6) and claimed == [50, *range(60, 67)]
    local = cli("--run-dir", str(tmp_path), "--redraw", "3")
    assert local.returncode == 2 and "--redraw: with --nats only" in local.stderr, local.stderr


def test_a_store_that_lost_a_stream_of_positions_is_another_store_to_the_trainer(nats_server):
    """A store whose identity is written but which lost its BATCHES (or ROLLOUTS) stream: the
    first service to make it again empty gives the store a new identity first, once however many
    find it together, so the trainer's checkpoint is StoreLost there, naming what was lost, never
    gone on from with positions reset. A lost record stream (METRICS) is only made again."""
    from pipelinerl.store import store_identity
    from pipelinerl_trainer.position import Position

    async def scenario():
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            await ensure_streams(js, SUBJECTS, 8)
            first = await store_identity(js, SUBJECTS)
            await js.delete_stream(SUBJECTS.stream("METRICS"))
            await ensure_streams(js, SUBJECTS, 8)
            after_metrics = await store_identity(js, SUBJECTS)
            seq = (await js.get_last_msg(SUBJECTS.stream("CONTROL"), SUBJECTS.store)).seq
            await js.delete_stream(SUBJECTS.stream("BATCHES"))
            await asyncio.gather(*(ensure_streams(js, SUBJECTS, 8) for _ in range(4)))  # services starting together
            replaced = await js.get_last_msg(SUBJECTS.stream("CONTROL"), SUBJECTS.store)
            await js.stream_info(SUBJECTS.stream("BATCHES"))  # made again
            await ensure_streams(js, SUBJECTS, 8)  # a later start in the new store: nothing replaced
            again = await store_identity(js, SUBJECTS)
            return first, after_metrics, seq, replaced, again
        finally:
            await nc.close()

    first, after_metrics, seq, replaced, again = asyncio.run(scenario())
    assert after_metrics == first  # METRICS made again, the store the same
    assert replaced.seq == seq + 1  # one new identity
    new = m.decode(replaced.data, m.StoreIdentity)
    assert new.id != first.id and new == again and new.adopts is None
    assert new.replaced == f"store {first.id} lost its stream(s) {SUBJECTS.stream('BATCHES')}"
    checkpoint = Position.restored({"step": 4, "consumed_seq": {"0": 57}, "store": first.id}, 0)
    lost = checkpoint.check_store(new)
    assert lost.startswith("StoreLost") and new.replaced in lost and f"--adopt {first.id} --step 4" in lost


def test_dead_letters_reads_a_namespaced_job_with_its_own_credentials(tmp_path):
    """`pipelinerl dead-letters job.yaml --nats URL -n NAMESPACE` on a server that wants a login
    (as the chart's does): the job's streams are named by the namespace given, and the login is the
    job's, from PIPELINERL_NATS_USER / PIPELINERL_NATS_PASSWORD (never on the command line)."""
    import subprocess
    import sys

    import yaml

    from pipelinerl.contracts import Env
    from pipelinerl.ports import free_port
    from pipelinerl.streams import dead_letter

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "nats-server"), "-js", "-a", "127.0.0.1", "-p", str(port),
         "-sd", str(tmp_path / "js"), "--user", "team-b.demo", "--pass", "secret"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"nats://127.0.0.1:{port}"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob",
                                        "metadata": {"name": "demo"}, "spec": {}}))  # fmt: skip
    subjects = JobSubjects("demo", "team-b")

    async def letter():
        for _ in range(50):
            try:
                nc = await connect(url, "test", "team-b.demo", "secret")
                break
            except Exception:  # noqa: BLE001 - starting
                await asyncio.sleep(0.1)
        await ensure_streams(nc.jetstream(), subjects, 1)
        await dead_letter(nc.jetstream(), subjects, "rollout", b"{}", "reward is NaN", "r-1")
        await nc.close()

    def run(*extra: str, **env: str):
        cmd = [sys.executable, "-m", "pipelinerl_cli", "dead-letters", str(manifest), "--nats", url, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **env})

    try:
        asyncio.run(letter())
        login = {Env.NATS_USER: "team-b.demo", Env.NATS_PASSWORD: "secret"}
        listed = run("-n", "team-b", **login)
        assert listed.returncode == 0 and "rollout: reward is NaN" in listed.stdout, listed.stderr
        assert "1 dead letter(s)" in listed.stderr
        refused = run("-n", "team-b")  # no login
        assert refused.returncode != 0 and "Authorization" in refused.stderr + refused.stdout
    finally:
        server.kill()
        server.wait()


async def test_a_stalled_server_bounds_a_publish_and_a_close(nats_server, capsys, monkeypatch):
    """A server that reads nothing (a frozen node): nats-py waits with no bound for its socket to
    take a publish past its buffer (`PENDING_BYTES`, 2 MiB here) queued, and for the queue at
    close; `connect`'s timeout bounds the first, `close`'s the second."""
    from pipelinerl import streams

    monkeypatch.setattr(streams, "PENDING_BYTES", 2 << 20)
    nc = await connect(nats_server.url, "stalled", timeout_s=0.5)
    os.kill(nats_server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for _ in range(32):  # more than the sockets' buffers hold: the rest stays queued in the client
            await nc.publish("stalled", b"x" * (1 << 20))
        assert time.monotonic() - started < 30
        assert "[stalled] nats: nats: flush timeout" in capsys.readouterr().err
        started = time.monotonic()
        await close(nc, timeout_s=1.0)
        assert 1.0 <= time.monotonic() - started < 5
        assert "[stalled] nats: not closed within 1 s" in capsys.readouterr().err
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)


async def test_joining_a_server_that_accepts_and_never_answers_times_out_naming_it(monkeypatch):
    """A service's first connection: nats-py retries a refused one for about a minute, but waits
    far longer on a listener that never sends its INFO (a wedged server, a wrong port)."""
    import socket

    from pipelinerl import runtime
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.spec import parse_job

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setattr(runtime, "JOIN_TIMEOUT_S", 1.0)
    job = parse_job({"metadata": {"name": "silent"}, "spec": {}})
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=f"timed out after 1s waiting for the job's NATS at {url}"):
            await runtime.join_job(job, ServiceEnv("generator", nats_url=url, weights_addr="127.0.0.1:1"), "test")
    finally:
        silent.close()
    assert time.monotonic() - started < 5


async def test_a_job_whose_messages_the_server_would_refuse_is_refused_at_its_join(nats_server):
    """The embedded server takes messages of 8 MiB (its default), the job says they may be 16."""
    from pipelinerl import runtime
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.spec import parse_job

    job = parse_job({"metadata": {"name": "big"}, "spec": {"nats": {"maxPayloadMb": 16}}})
    env = ServiceEnv("generator", nats_url=nats_server.url, weights_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"nats.maxPayloadMb \(16\) is over the max_payload .* \(8 MiB\)"):
        await runtime.join_job(job, env, "test")


async def test_the_largest_message_a_job_may_publish_is_stored_and_read_back(tmp_path):
    """JetStream's file store refuses a record of 32 MiB or more whatever the server's max_payload:
    `nats.maxPayloadMb` stops below (MAX_PAYLOAD_MB). A message that large, with its headers, is
    stored and read back; one MiB more is refused."""
    from nats.js.errors import APIError

    from pipelinerl.spec_sections import MAX_PAYLOAD_MB

    server = EmbeddedNats(tmp_path / "nats", max_payload_mb=MAX_PAYLOAD_MB + 2).start()  # past the store's limit
    nc = await connect(server.url, "test")
    try:
        js = nc.jetstream(timeout=30)
        await ensure_streams(js, SUBJECTS, MAX_PAYLOAD_MB + 2, sizes={s: 128 << 20 for s in STREAM_SUFFIXES})
        largest = os.urandom(MAX_PAYLOAD_MB << 20)
        await js.publish(SUBJECTS.rollouts(0), largest, headers={"Nats-Msg-Id": "largest"}, timeout=30)
        with pytest.raises(APIError, match="message too large"):
            await js.publish(
                SUBJECTS.rollouts(0), largest + bytes(1 << 20), headers={"Nats-Msg-Id": "over"}, timeout=30
            )
        sub = await js.pull_subscribe(SUBJECTS.rollouts(">"), durable="pre")
        [msg] = await sub.fetch(1, timeout=30)
        assert msg.data == largest
    finally:
        await nc.close()
        server.stop()


async def test_joining_a_server_too_loaded_to_answer_a_stream_request_in_time_asks_again(
    nats_server, monkeypatch, caplog
):
    """nats-server frozen for 7 s as a service makes the job's streams (a loaded CI machine took
    5.7 s over one stream update): nats-py gives up on the request after its 5 s and join_job asks
    again, within its own deadline, instead of failing the service's start (the trainer's, then
    reported as join_job's 120 s, which had not passed)."""
    from pipelinerl import runtime
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.spec import parse_job

    tries = []

    async def frozen_at_first(js, *args, **kwargs):
        if not tries:
            os.kill(nats_server.proc.pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(7.0, os.kill, nats_server.proc.pid, signal.SIGCONT)
        tries.append(time.monotonic())
        await ensure_streams(js, *args, **kwargs)

    monkeypatch.setattr(runtime, "ensure_streams", frozen_at_first)
    job = parse_job({"metadata": {"name": "loaded"}, "spec": {}})
    env = ServiceEnv("generator", nats_url=nats_server.url, weights_addr="127.0.0.1:1")
    try:
        nc = await runtime.join_job(job, env, "test")
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    try:
        info = await nc.jetstream().stream_info(job.subjects.stream("ROLLOUTS"))
        assert info.config.name == job.subjects.stream("ROLLOUTS")
    finally:
        await nc.close()
    assert len(tries) >= 2 and tries[1] - tries[0] >= 5
    assert "did not answer a stream request in time; asking again" in caplog.text


async def test_a_timeout_of_the_awaited_call_is_not_reported_as_the_wait_s_own():
    import nats.errors

    from pipelinerl.streams import wait_for

    async def unanswered():
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await wait_for(unanswered(), 60, "the job's NATS")
    with pytest.raises(TimeoutError, match="timed out after 0s waiting for a sleeper"):
        await wait_for(asyncio.sleep(5), 0.1, "a sleeper")


def test_a_service_connection_outlives_any_outage_and_what_it_publishes_meanwhile_is_stored(tmp_path):
    """nats-server down for longer than nats-py's default number of reconnect tries (here with a
    short wait between them: 120 tries took ~60 s at the services' 0.5 s): the client is not
    closed for good (a service then waited on its subscriptions forever), and a publish larger
    than nats-py's default reconnect buffer (2 MiB), made during the outage, is stored once the
    server is back instead of refused at once."""
    from pipelinerl.streams import publish_once, stored_messages

    server = EmbeddedNats(tmp_path / "nats").start()

    async def scenario():
        nc = await connect(server.url, "outage", reconnect_wait_s=0.02)
        js = nc.jetstream()
        await ensure_streams(js, SUBJECTS, 8)
        server.stop()
        await asyncio.sleep(1)
        big = os.urandom(3 << 20)
        publishing = asyncio.create_task(publish_once(js, SUBJECTS.batches(0), big, "big", timeout_s=30, attempts=1))
        tries_wait = time.monotonic() + 12  # well past 120 tries
        while time.monotonic() < tries_wait:
            assert not nc.is_closed, "the client gave up reconnecting"
            await asyncio.sleep(0.5)
        server.start()
        ack = await asyncio.wait_for(publishing, 40)
        stored = await stored_messages(js, SUBJECTS.stream("BATCHES"))
        await nc.close()
        return ack, stored, big

    try:
        ack, stored, big = asyncio.run(scenario())
    finally:
        server.stop()
    assert not ack.duplicate and [x.data for x in stored] == [big]


def test_a_local_runs_store_is_sized_by_its_job_not_by_the_disks_free_space(tmp_path):
    """Left to itself nats-server sizes JetStream's store at 75% of the disk's free space at its
    start: restarted on a disk that filled up (the local runner restarts it once 64 MiB are free),
    it refused the job's streams ("insufficient storage resources"). Given the job's room, it
    takes them whatever the disk has free."""
    import json
    import urllib.request

    server = EmbeddedNats(tmp_path / "nats", store_bytes=5 << 40).start()  # 5 TiB: more than this disk
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/jsz", timeout=5) as answer:
            assert json.load(answer)["config"]["max_storage"] == 5 << 40
    finally:
        server.stop()


async def test_calibrating_from_the_store_of_another_build_says_so(nats_server):
    """`plan --calibrate-from` a job whose store holds micro-batches of another schema version:
    a PilotError naming the job and the version, not a traceback."""
    import msgpack

    from pipelinerl.planner.pilot import PilotError
    from pipelinerl.spec import parse_job
    from pipelinerl_cli.calibrate_from import _read

    job = parse_job({"metadata": {"name": "t-job"}, "spec": {}})
    nc = await connect(nats_server.url, "test")
    js = nc.jetstream()
    await ensure_streams(js, SUBJECTS, 8)
    body = msgpack.unpackb(m.encode(m.MicroBatch(step=0, rank=0, index=0)))
    body["v"] = min(m.UPGRADES) - 1  # the newest this build does not read
    await js.publish(SUBJECTS.batches(0), msgpack.packb(body), timeout=5)
    await close(nc)
    with pytest.raises(PilotError, match=rf"job t-job: a stored message this build cannot read: .*version {body['v']}"):
        await _read(nats_server.url, job)
