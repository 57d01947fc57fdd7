"""Faults survived by a running job: `pipelinerl run` in its own process, one of its processes
killed with SIGKILL mid-run (its whole process group, as a pod dies), restarted by the runner's
restart policy as a StatefulSet would. Each test asserts what went on: steps, samples per step,
which generators fed which steps, weight-group epochs, restarts and process ids."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from jobs import stored, tiny_job  # tests/e2e/jobs.py

from pipelinerl import messages as m
from pipelinerl.books import Outcome
from bench.run_process import RunProcess

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 420
SAMPLES = 16  # per step in tiny_job


def fault_job(name: str, steps: int, **spec) -> dict:
    # Short weight-sync deadlines: a dead member costs at most that long.
    base = {"weightSync": {"timeoutSeconds": 20}, "eval": {"interval": 0}, "rl": {"maxLag": 1}}
    return tiny_job(name, **(base | spec | {"trainer": {"maxSteps": steps} | spec.get("trainer", {})}))


def groups_from(row: dict, generator: int) -> int:
    return row.get(f"groups_from_generator_{generator}", 0)


def test_one_generator_of_two_dies_and_rejoins(start_run):
    # Runs until the restarted generator has fed two steps, then stops. One group in flight per
    # generator: the survivor alone then keeps the trainer waiting rather than both cores busy,
    # so the restart's vLLM start is less starved.
    job = fault_job("gen2", 1000, generator={"replicas": 2, "maxInflightGroups": 1})
    run = start_run(job, RUN_TIMEOUT_S)
    # Killed once it has fed a step: generator-0 alone may reach any given step before it joins.
    run.wait_until(lambda train: any(groups_from(r, 1) > 0 for r in train), "a step fed by generator-1")
    before = run.services()
    # Read before the kill: read after, it may already count the epoch the kill started.
    epoch = run.train()[-1]["weight_epoch"]  # the group left, then the restart joined: 2 epochs on at least
    _, killed_at = run.kill("generator-1")
    run.wait_until(
        lambda train: (
            sum(r["step"] > killed_at and r["weight_epoch"] >= epoch + 2 and groups_from(r, 1) > 0 for r in train) >= 2
        ),
        "two steps fed by the restarted generator, back in the weight group",
    )
    run.stop()
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))  # the trainer never stopped nor repeated
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)  # every step trained a full batch
    # Training went on without the dead generator (groups it published before dying may still
    # be trained a few steps later), then it came back and fed steps again.
    alone = [r["step"] for r in train if r["step"] > killed_at and groups_from(r, 1) == 0]
    back = [r["step"] for r in train if alone and r["step"] > alone[0] and groups_from(r, 1) > 0]
    assert alone and back, [(r["step"], groups_from(r, 0), groups_from(r, 1)) for r in train]
    assert all(r["lag_max"] <= 1 for r in train)  # its tokens carry the version of the weights it was sent
    # Hardly a sample lost a token to lag: not while both ran (neither overtook the other's groups
    # past maxLag), nor at the rejoin (the restarted one waited behind the survivor's backlog).
    # Before generators heard each other, 16 samples at the rejoin and 16 at step 3 in one run;
    # admission is a forecast, so one group (4 samples) is the bound (test_resume says why).
    assert sum(r["dropped_for_lag"] for r in train) <= 4, [(r["step"], r["dropped_for_lag"]) for r in train]
    services = run.services()
    assert services["generator-1"]["restarts"] == 1 and services["generator-1"]["pid"] != before["generator-1"]["pid"]
    assert services["generator-0"]["restarts"] == 0 and services["trainer"]["restarts"] == 0
    # The group changed (the dead process left, its restart joined) and ends with both again.
    assert train[-1]["weight_epoch"] >= 2 and train[-1]["generators_in_group"] == 2


def test_the_generator_then_the_trainer_then_nats_die_and_nothing_acknowledged_is_lost(start_run):
    """Three faults in one run (each costs a restart, not a run): the trainer waits for the only
    generator to come back; the trainer, killed 2 steps past its step-4 checkpoint, resumes from
    it and the running generator rejoins; every service reconnects to the restarted nats-server."""
    steps = 17
    run = start_run(fault_job("gen1", steps, trainer={"checkpointInterval": 4}), RUN_TIMEOUT_S)
    run.wait_step(3)
    run.kill("generator")
    # 2 steps before the next checkpoint: with 1, that step and its checkpoint could finish
    # between the poll and the kill (a step took 0.3 s once), and the run would resume past
    # every step it was seen to take. (After the server's restart the runner hears of steps
    # late, in a burst: the trainer dies before it.)
    run.wait_step(6)
    before = run.services()
    _, killed_at = run.kill("trainer")
    run.wait_step(12)  # the restarted trainer's 8th step: 5 are left after the server's death
    seen_before_nats = len(run.train())
    run.kill("nats-server")
    run.finish()
    train = run.train()
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", (run.dir / "logs/trainer.log").read_text())[1])
    assert resumed_at % 4 == 0 and 3 < resumed_at <= killed_at  # the newest checkpoint when it died
    # The first trainer's rows, then the restarted one's: each step once from its checkpoint on.
    first, second = train[: len(train) - (steps - resumed_at)], train[len(train) - (steps - resumed_at) :]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= killed_at
    assert [r["step"] for r in second] == list(range(resumed_at + 1, steps + 1))
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)  # no step lost or short
    assert all(r["lag_max"] <= 1 for r in train)
    # It replayed the steps the first trainer took past the checkpoint (all but perhaps the last,
    # if it died before announcing it) from the same micro-batches and the same weights: the same
    # tokens, and the same entropy to the last bit.
    replayed = [r for r in second if r["replayed"]]
    taken = {r["step"]: r for r in first[resumed_at:]}
    assert [r["step"] for r in replayed] == list(range(resumed_at + 1, resumed_at + 1 + len(replayed)))
    assert 1 <= len(taken) - 1 <= len(replayed) <= len(taken)
    assert all(
        (r["tokens"], r["entropy"]) == (taken[r["step"]]["tokens"], taken[r["step"]]["entropy"]) for r in replayed
    )
    # Versions never went back: the generator kept the newer weights until the trainer was past
    # them (it logs any step back), so nothing it made was too old.
    assert "go back" not in (run.dir / "logs/generator.log").read_text()
    # The progress lines' generator tok/s never went negative over the generator's restart
    # (its token counter starts again from 0: -184 tok/s was printed once).
    progress = (run.dir.parent / "run.out").read_text()
    assert re.findall(r"gen [\d,]+ tok/s", progress) and " gen -" not in progress
    # Nothing dropped for lag after the trainer's resume, up to the server's death. (After a
    # server restart a group per step may come too old: 4 samples in 4 of 5 steps once, 11-28.)
    assert all(r["dropped_for_lag"] == 0 for r in train[len(first) : seen_before_nats])
    services = run.services()
    restarts = {name: s["restarts"] for name, s in services.items()}
    # Nothing else restarted: every service rode out the trainer's restart and the server's.
    assert restarts == {"generator": 1, "nats-server": 1, "trainer": 1, "preprocessor": 0}, run.output()
    # The first trainer's group changed when the generator died and its restart joined; the
    # generator kept running through the trainer's death and joined the new trainer's group.
    assert first[-1]["weight_epoch"] >= 2 and services["generator"]["pid"] == before["generator"]["pid"]
    assert second[-1]["generators_in_group"] == 1 and groups_from(second[-1], 0) > 0
    latest = run.dir / "checkpoints" / (run.dir / "checkpoints" / "latest").read_text()
    assert json.loads((latest / "state.json").read_text())["step"] == steps


def test_a_full_disk_under_the_store_recovers_by_itself_once_freed(start_run, tmp_path):
    """The NATS store on a small filesystem of its own (a 256 MiB tmpfs the test mounts), filled
    to the last byte for 20 s while the job runs, then freed: JetStream, which goes on refusing
    writes after a write error even once there is room, is restarted by the runner when its
    /healthz says so and its disk has room; the services ride the outage out on their publish
    retries (naming the likely cause), and the run finishes with nothing lost or trained twice."""
    import subprocess

    steps, name = 30, "full"
    store = tmp_path / "run" / "nats"
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256M", "tmpfs", str(store)], check=True)
    try:
        run = start_run(fault_job(name, steps), RUN_TIMEOUT_S)
        run.wait_step(4)
        filler = store / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError as err:
                assert err.errno == 28  # ENOSPC: the store's disk is full
        full_at = run.train()[-1]["step"]
        time.sleep(20)
        filler.unlink()
        run.finish()
        train = run.train()
        out = run.output()
        assert "JetStream cannot write" in out and "restarting it, its disk has room again" in out, out
        assert run.services()["nats-server"]["restarts"] >= 1
        assert full_at < steps  # it was mid-run
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert all(r["samples"] == SAMPLES for r in train)
        assert sum(r["dropped_for_lag"] for r in train) == 0
        logs = "".join(p.read_text() for p in (run.dir / "logs").glob("*.log"))
        assert "not acknowledged" in logs and "JetStream unable to write its store" in logs
        audit_streams(run, name, steps, 1)
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


def on_running_nats(run: RunProcess, read):
    """`read(js)` against the running run's nats-server."""
    import asyncio

    from pipelinerl.streams import connect

    async def go():
        nc = await connect(run.services()["nats-server"]["url"], "test")
        try:
            return await read(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(go())


def newest_stored(run: RunProcess, name: str) -> m.MicroBatch | None:
    """The newest micro-batch stored for trainer rank 0, read from the run's nats-server."""
    from pipelinerl.contracts import JobSubjects
    from pipelinerl.streams import last_message

    subjects = JobSubjects(name)
    data = on_running_nats(run, lambda js: last_message(js, subjects.stream("BATCHES"), subjects.batches(0), 5))
    return m.decode(data, m.MicroBatch) if data is not None else None


def mid_step(run: RunProcess, name: str) -> bool:
    """The preprocessor holds groups and the step it builds is stored in part (the newest
    micro-batch stored does not end a step): a kill now is the one that used to lose them."""
    import httpx

    port = run.services()["preprocessor"]["http_port"]
    try:
        held = httpx.get(f"http://127.0.0.1:{port}/status", timeout=1).json()["pendingGroups"]
    except (httpx.HTTPError, ValueError):  # starting or restarting
        return False
    newest = newest_stored(run, name)
    return bool(held) and newest is not None and not newest.last


def kill_mid_step(run: RunProcess, name: str) -> bool:
    """SIGKILL the preprocessor as soon as it is mid-step; whether it still was when it died."""
    run.wait_until(lambda _: mid_step(run, name), "the preprocessor mid-step")
    run.kill("preprocessor")
    newest = newest_stored(run, name)
    return newest is not None and not newest.last


def test_the_preprocessor_killed_mid_step_once_then_twice_loses_nothing(start_run):
    """The preprocessor dies four times, with two trainer ranks: at a failure point after storing
    step 2's last wave and before acknowledging its groups (a real kill -9, where it loses the
    acknowledgements); then, from outside, once mid-step, and twice 10 s apart, each time mid-step
    holding groups for a step stored in part. Each restart continues that step with the groups handed back. Every step
    trains a full batch, nothing is dropped for lag or stale, no group is trained twice or lost,
    and the streams hold each step once per rank, whole."""
    from pipelinerl.contracts import Env

    steps, name = 40, "pre"
    job = fault_job(
        name,
        steps,
        trainer={"replicas": 2, "microBatchTokens": 128},
        # One group generated at a time: generation is what the trainer waits for, so a step
        # reaches it in waves (a group each: rows of 128 tokens hold less than two groups, so
        # the second waits for the third) and the preprocessor is mid-step, holding a group,
        # most of the time.
        generator={"maxInflightGroups": 1},
        preprocessor={"env": [{"name": Env.FAILPOINT, "value": "preprocessor-stored-step-2"}]},
        runPolicy={"backoffLimit": 6},
    )
    run = start_run(job, RUN_TIMEOUT_S)
    run.wait_until(
        lambda _: (run.dir / "services.json").exists() and run.services()["preprocessor"]["restarts"] == 1,
        "the failure point's kill",
    )
    run.wait_step(6)
    mid = [kill_mid_step(run, name)]
    mid.append(kill_mid_step(run, name))  # as soon as the restarted one is mid-step
    time.sleep(10)
    mid.append(kill_mid_step(run, name))
    run.finish()
    train = run.train()
    log = (run.dir / "logs/preprocessor.log").read_text()
    # Each kill from outside left a step stored in part (checked once the process was dead), and
    # the next preprocessor continued it rather than closing it short.
    assert sum(mid) >= 2 and log.count("left partial by a restart") == sum(mid), mid

    assert [r["step"] for r in train] == list(range(1, steps + 1))  # both ranks in lock-step throughout
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train), [(r["step"], r["samples"]) for r in train]
    assert sum(r["dropped_for_lag"] for r in train) == 0 and sum(r["samples_stale"] for r in train) == 0
    assert all(r["lag_max"] <= 1 for r in train)

    by_step, trained = audit_streams(run, name, steps, 2)
    # The kill at the failure point lost the acknowledgements of step 2's last wave: its groups
    # came back and were settled again, neither trained nor counted twice.
    lost = set(by_step[2][0][-1].ledger.wave_groups(by_step[2][0][-1].ledger.waves - 1))
    returned = {g for ranks in by_step.values() for mb in ranks[0] for g in mb.ledger.returned}
    assert lost and lost <= returned and all(trained[g] == 2 for g in lost)
    assert "delivered again" in log

    services = run.services()
    assert services["preprocessor"]["restarts"] == 4
    assert (
        services["trainer-0"]["restarts"] == services["trainer-1"]["restarts"] == services["generator"]["restarts"] == 0
    )


def test_a_preprocessor_paused_past_its_acknowledgement_wait_trains_nothing_twice(start_run):
    """SIGSTOP to the preprocessor while it holds groups, for longer than its acknowledgement wait
    (a frozen node, a paused container), then SIGCONT: JetStream has delivered the held groups
    again to the same, living consumer. Each is taken once: no group trained twice nor credited
    twice (the generator's admission books stay true, so nothing is dropped for lag afterwards),
    every step full, the run finishes."""
    from pipelinerl.contracts import Env

    steps, name, ack_wait = 24, "paused", 4
    job = fault_job(
        name,
        steps,
        generator={"maxInflightGroups": 1},  # a step reaches the preprocessor in waves: it holds groups
        trainer={"microBatchTokens": 128},
        preprocessor={"env": [{"name": Env.ACK_WAIT_S, "value": str(ack_wait)}]},
    )
    run = start_run(job, RUN_TIMEOUT_S)
    run.wait_step(4)
    run.wait_until(lambda _: mid_step(run, name), "the preprocessor holding groups mid-step")
    pid = run.services()["preprocessor"]["pid"]
    os.killpg(pid, signal.SIGSTOP)
    time.sleep(ack_wait + 10)
    os.killpg(pid, signal.SIGCONT)
    run.finish()
    train = run.train()
    assert run.services()["preprocessor"]["restarts"] == 0 and run.services()["preprocessor"]["pid"] == pid
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train), [(r["step"], r["samples"]) for r in train]
    # Twice-credited groups would over-free the generator's queue: more groups than a step admits,
    # dropped as too old later. None is.
    assert sum(r["dropped_for_lag"] for r in train) == 0 and sum(r["samples_stale"] for r in train) == 0
    audit_streams(run, name, steps, 1)
    log = (run.dir / "logs/preprocessor.log").read_text()
    assert "delivered again (delivery 2)" in log  # the pause did outlast the wait: held groups came back


def test_a_lost_store_stops_the_job_and_recover_store_resumes_it_from_the_checkpoint(start_run, tmp_path):
    """The run's NATS store deleted and nats-server restarted empty (a lost or replaced volume):
    the trainer finds its positions belong to another store and stops the run with StoreLost,
    never restarting silently from zero. `pipelinerl recover-store` makes the new store go on
    from the trainer's checkpoint (step 4), and the run resumes there: steps 5.. again, each full,
    no problem of the checkpoint's lineage drawn again, the metrics history kept."""
    import shutil
    import subprocess
    import sys

    steps, name = 12, "lost"
    job = fault_job(name, steps, trainer={"checkpointInterval": 4})
    first = start_run(job, RUN_TIMEOUT_S)
    first.wait_step(6)  # past the checkpoint of step 4
    from pipelinerl.contracts import JobSubjects
    from pipelinerl.streams import stored_messages

    before = on_running_nats(first, lambda js: stored_messages(js, JobSubjects(name).stream("BATCHES")))
    kept = {mb.step: mb.group_ids for mb in (m.decode(x.data, m.MicroBatch) for x in before)}
    trained_before = {g for step in range(4) for g in kept.get(step, [])}  # the checkpoint's lineage
    rows_before = len(first.train())
    shutil.rmtree(first.dir / "nats")  # the store, from under the running server
    first.kill("nats-server")  # restarted by the runner, empty
    code = first.proc.wait(timeout=RUN_TIMEOUT_S)
    out = first.output()
    assert code != 0 and "StoreLost" in out and "recover-store" in out, out
    assert len(first.train()) < rows_before + 3  # it stopped; no silent restart from step 0 trained on

    recovered = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelinerl_cli",
            "recover-store",
            str(tmp_path / "job.yaml"),
            "--run-dir",
            str(first.dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert recovered.returncode == 0, recovered.stderr
    assert "goes on from the checkpoint of step 4" in recovered.stdout

    second = start_run(job, RUN_TIMEOUT_S)
    second.finish()
    train = second.train()
    resumed = [r for r in train[rows_before:] if r["step"] > 4]
    # Every row before the loss is still in the run's metrics; after the recovery steps 5.. again, each full.
    assert [r["step"] for r in train[:rows_before]] == list(range(1, rows_before + 1))
    assert [r["step"] for r in resumed][-(steps - 4) :] == list(range(5, steps + 1))
    assert all(r["samples"] == SAMPLES for r in resumed)
    batches = [m.decode(x.data, m.MicroBatch) for x in stored(second.dir, name, "BATCHES")]
    assert {mb.step for mb in batches} >= set(range(4, steps))  # the new store starts at the checkpoint's step
    drawn_after = {g for mb in batches for g in mb.group_ids}
    assert not drawn_after & trained_before, "a problem of the checkpoint's lineage was drawn again"
    log = (second.dir / "logs/trainer.log").read_text()
    assert "resumed from" in log


def audit_streams(run: RunProcess, name: str, steps: int, ranks_n: int) -> tuple[dict, dict[str, int]]:
    """The streams: every step once per rank, its micro-batches numbered 0..k with only k last,
    the ranks alike; each step a full batch of trained groups, none stale; each group trained in
    one step only, whole; the ledgers add up to what the trainer announced. (micro-batches by
    step and rank, the step each group was trained in)."""
    batches = [m.decode(x.data, m.MicroBatch) for x in stored(run.dir, name, "BATCHES")]
    by_step: dict[int, dict[int, list[m.MicroBatch]]] = {}
    for mb in batches:
        if mb.step < steps:  # (the preprocessor may have begun one more)
            by_step.setdefault(mb.step, {}).setdefault(mb.rank, []).append(mb)
    assert sorted(by_step) == list(range(steps))
    groups_per_step = SAMPLES // 4
    trained: dict[str, int] = {}
    credits: dict[str, int] = {}
    for step, ranks in by_step.items():
        assert sorted(ranks) == list(range(ranks_n))
        counts = {len(mbs) for mbs in ranks.values()}
        assert len(counts) == 1, (step, counts)
        for mbs in ranks.values():
            assert [mb.index for mb in mbs] == list(range(len(mbs))) and [mb.last for mb in mbs][-1]
            assert not any(mb.last for mb in mbs[:-1])
        final = ranks[0][-1].ledger
        assert all(mbs[-1].ledger == final for mbs in ranks.values())
        assert final.trained_groups == groups_per_step and final.samples == SAMPLES
        assert not final.entries(Outcome.STALE)
        samples = [g for mbs in ranks.values() for mb in mbs for g in mb.group_ids]
        assert sorted(samples) == sorted(e.id for e in final.entries(Outcome.TRAINED) for _ in range(4))
        for g in set(samples):
            assert g not in trained, f"group {g} trained in steps {trained[g]} and {step}"
            trained[g] = step
        for g, c in final.credits.items():
            credits[g] = credits.get(g, 0) + c
    (announced,) = [
        m.decode(x.data, m.PolicyVersion) for x in stored(run.dir, name, "CONTROL") if x.subject.endswith("version")
    ]
    assert announced.finished and announced.trained_groups == credits
    return by_step, trained
