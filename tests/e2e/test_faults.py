"""Faults survived by a running job: `pipelinerl run` in its own process, one of its processes
killed with SIGKILL mid-run (its whole process group, as a pod dies), restarted by the runner's
restart policy as a StatefulSet would. Each test asserts what went on: steps, samples per step,
which generators fed which steps, weight-group epochs, restarts and process ids."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from faults import (  # tests/e2e/faults.py
    SAMPLES,
    audit_streams,
    changes,
    fault_job,
    groups_from,
    mid_step,
    newest_stored,
)
from jobs import RUN_TIMEOUT_S, stored  # tests/e2e/jobs.py
from listening import listening_addresses  # tests/listening.py

from pipelinerl import messages as m
from pipelinerl.claims import Claims, indices, parse_ranges
from pipelinerl.contracts import JobSubjects

from bench.run_process import RunProcess

pytestmark = pytest.mark.slow


def test_one_generator_of_two_dies_and_rejoins(start_run):
    # Runs until the restarted generator has fed two steps, then stops. One group in flight per
    # generator: the survivor alone then keeps the trainer waiting rather than both cores busy,
    # so the restart's vLLM start is less starved.
    job = fault_job("gen2", 1000, generator={"replicas": 2, "maxInflightGroups": 1})
    run = start_run(job, RUN_TIMEOUT_S)
    # Killed once it has fed a step: generator-0 alone may reach any given step before it joins.
    run.wait_until(lambda train: any(groups_from(r, 1) > 0 for r in train), "a step fed by generator-1")
    epoch = run.train()[-1]["weight_epoch"]  # read before the kill: read after, it may count the epoch the kill started
    # A local run's ports are its own machine's: every service's HTTP port, the trainer's weight
    # rendezvous and its ranks' own, listen on loopback only.
    weights = int(re.search(r"rendezvous on port (\d+)", (run.dir / "logs" / "trainer.log").read_text())[1])
    services = run.services().values()
    ports = [s[k] for s in services for k in ("http_port", "master_port") if k in s] + [weights]
    # (a service restarting, as a loaded machine's may, listens again once it is back)
    run.wait_until(lambda _: all(listening_addresses(p) for p in ports), "every port listening")
    assert [listening_addresses(p) for p in ports] == [{"127.0.0.1"}] * len(ports)
    pid, killed_at = run.kill("generator-1")

    def shown(train: list[dict]) -> str:
        return f"killed after step {killed_at} in epoch {epoch}; changes: {changes(train)}"

    def steps(train: list[dict], after_step: int, after_epoch: int, generators: int, fed: bool) -> list[int]:
        return [
            r["step"]
            for r in train
            if r["step"] > after_step
            and r["weight_epoch"] > after_epoch
            and r["generators_in_group"] == generators
            and (groups_from(r, 1) > 0) == fed
        ]

    # Training goes on without it, in an epoch of the survivor alone: its restart is held stopped
    # until then, as a pod slow to start would be (else, on a loaded machine, the trainer may wait
    # for data until the restart has joined, and nothing shows it went on alone). Groups the dead
    # one published before dying may still be trained meanwhile: those steps do not count.
    restarted = run.restarted("generator-1", pid)
    os.killpg(restarted, signal.SIGSTOP)
    try:
        run.wait_until(lambda t: len(steps(t, killed_at, epoch, 1, False)) >= 2, "two steps fed by one", shown)
    finally:
        os.killpg(restarted, signal.SIGCONT)
    train = run.train()
    alone = steps(train, killed_at, epoch, 1, False)
    alone_epoch = max(r["weight_epoch"] for r in train if r["step"] in alone)
    # Then it joins a newer epoch of two and feeds steps again.
    run.wait_until(lambda t: len(steps(t, alone[-1], alone_epoch, 2, True)) >= 2, "two steps fed by the restart", shown)
    run.stop()
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))  # the trainer never stopped nor repeated
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)  # every step trained a full batch
    assert all(r["lag_max"] <= 1 for r in train)  # its tokens carry the version of the weights it was sent
    # Hardly a sample lost a token to lag: not while both ran (neither overtook the other's groups
    # past maxLag), nor at the rejoin (the restarted one waited behind the survivor's backlog).
    # Before generators heard each other, 16 samples at the rejoin and 16 at step 3 in one run;
    # admission is a forecast, so one group (4 samples) is the bound (test_resume says why).
    assert sum(r["dropped_for_lag"] for r in train) <= 4, [(r["step"], r["dropped_for_lag"]) for r in train]
    services = run.services()
    assert services["generator-1"]["restarts"] == 1 and services["generator-1"]["pid"] == restarted
    assert services["generator-0"]["restarts"] == 0 and services["trainer"]["restarts"] == 0
    assert train[-1]["generators_in_group"] == 2  # ends with both again
    # Stopped, each generator gave back what it held (its unused block, its groups in flight,
    # cancelled): the job's claims draw exactly those first, the generators' records are empty,
    # and no step settled any of them.
    logs = [(run.dir / "logs" / f"generator-{r}.log").read_text() for r in range(2)]
    given = [
        i
        for log in logs
        for text in re.findall(r"gave back the problems it held: (\S+)", log)
        for i in indices(parse_ranges(text, "log"))
    ]
    assert not any("could not give back" in log for log in logs)
    records = {x.subject: x.data for x in stored(run.dir, "gen2", "CONTROL")}
    subjects = JobSubjects("gen2")
    assert [records.get(subjects.held(r)) or b"" for r in range(2)] == [b"", b""]  # (empty: None)
    # (as sets: one stopping as the other gives back may draw those indices and give them back too)
    assert set(indices(Claims.parse(records[subjects.problems].decode()).redraw)) == set(given)
    ledgers = [m.decode(x.data, m.MicroBatch).ledger for x in stored(run.dir, "gen2", "BATCHES")]
    assert not set(given) & {i for ledger in ledgers for i in indices(ledger.settled_indices())}


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


def kill_mid_step(run: RunProcess, name: str) -> bool:
    """SIGKILL the preprocessor as soon as it is mid-step; whether it still seemed to be when it
    died (read at once: a publish it had sent may still reach nats-server after the read; read a
    second later, those publishes, the step's last wave among them, are stored)."""
    run.wait_until(lambda _: mid_step(run, name), "the preprocessor mid-step")
    run.kill("preprocessor")
    newest = newest_stored(run, name)
    return newest is not None and not newest.last


def test_the_preprocessor_killed_mid_step_once_then_twice_loses_nothing(start_run):
    """The preprocessor dies four times or more, with two trainer ranks: at a failure point after storing
    step 2's last wave and before acknowledging its groups (a real kill -9, where it loses the
    acknowledgements); then, from outside, once mid-step, and twice 3 steps apart, each time mid-step
    holding groups for a step stored in part (once more, up to twice, until two restarts found one).
    Each restart continues that step with the groups handed back. Every step trains a full batch,
    nothing is dropped for lag or stale, no group is trained twice or lost, and the streams hold
    each step once per rank, whole."""
    from pipelinerl.contracts import Env

    # The last kill lands near step 11; the steps after it are margin, not more test (40 before).
    steps, name = 28, "pre"
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
    run.wait_step(run.train()[-1]["step"] + 3)  # counted in steps: a fast machine's run outlasts it too
    mid.append(kill_mid_step(run, name))

    def partial() -> int:  # kills the restarted preprocessor found a step stored in part after
        run.wait_step(run.train()[-1]["step"] + 1)  # the restart has resumed, and stored a step
        return (run.dir / "logs/preprocessor.log").read_text().count("left partial by a restart")

    # A kill can land just as the step's last wave is stored (a loaded machine: 1 of 3 once,
    # 2026-12-07): another, while the restart policy and the run's steps leave room for it.
    while partial() < 2 and len(mid) < 5 and run.train()[-1]["step"] < steps - 8:
        mid.append(kill_mid_step(run, name))
    run.finish()
    train = run.train()
    log = (run.dir / "logs/preprocessor.log").read_text()
    # The kills from outside left a step stored in part, and the next preprocessor continued it
    # rather than closing it short: as its restarts say (the test's own reads of the stream race
    # the publishes in flight when it died, either way: they are shown, not counted).
    partial = log.count("left partial by a restart")
    assert partial >= 2, (partial, mid)

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
    assert services["preprocessor"]["restarts"] == 1 + len(mid)  # the failure point's, and each kill
    assert (
        services["trainer-0"]["restarts"] == services["trainer-1"]["restarts"] == services["generator"]["restarts"] == 0
    )
