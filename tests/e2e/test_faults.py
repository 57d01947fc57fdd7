"""Faults survived by a running job: `pipelinerl run` in its own process, one of its processes
killed with SIGKILL mid-run (its whole process group, as a pod dies), restarted by the runner's
restart policy as a StatefulSet would. Each test asserts what went on: steps, samples per step,
which generators fed which steps, weight-group epochs, restarts and process ids."""

from __future__ import annotations

import json
import re

import pytest
from jobs import tiny_job  # tests/e2e/jobs.py

from run_process import RunProcess  # tests/e2e/run_process.py

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 420
SAMPLES = 16  # per step in tiny_job


def fault_job(name: str, steps: int, **spec) -> dict:
    # Short weight-sync deadlines: a dead member costs at most that long.
    base = {"weightSync": {"timeoutSeconds": 20}, "eval": {"interval": 0}, "rl": {"maxLag": 1}}
    return tiny_job(name, **(base | spec | {"trainer": {"maxSteps": steps} | spec.get("trainer", {})}))


def kill_mid_run(tmp_path, job: dict, victim: str, after_step: int = 3) -> tuple[RunProcess, dict, int]:
    """Run `job`, SIGKILL `victim` once `after_step` is trained, let the run finish (exit 0):
    the run, its processes before the kill, and the last step trained at the kill."""
    run = RunProcess(tmp_path, job, RUN_TIMEOUT_S)
    run.wait_step(after_step)
    before = run.services()
    _, killed_at = run.kill(victim)
    run.finish()
    return run, before, killed_at


def groups_from(row: dict, generator: int) -> int:
    return row.get(f"groups_from_generator_{generator}", 0)


def test_one_generator_of_two_dies_and_rejoins(tmp_path):
    # Runs until the restarted generator has fed two steps (its vLLM start takes 15-20 s), then stops.
    job = fault_job("gen2", 1000, generator={"replicas": 2})
    run = RunProcess(tmp_path, job, RUN_TIMEOUT_S)
    run.wait_step(3)
    before = run.services()
    _, killed_at = run.kill("generator-1")
    run.wait_until(
        lambda train: (
            sum(r["step"] > killed_at and r.get("weight_epoch", 0) >= 3 and groups_from(r, 1) > 0 for r in train) >= 2
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


def test_the_only_generator_then_the_nats_server_die_and_nothing_acknowledged_is_lost(tmp_path):
    # Two faults in one run (each costs a restart, not a run): the trainer waits for the only
    # generator to come back, then every service reconnects to the restarted nats-server.
    steps = 12
    run = RunProcess(tmp_path, fault_job("gen1", steps), RUN_TIMEOUT_S)
    run.wait_step(3)
    run.kill("generator")
    run.wait_step(7)
    run.kill("nats-server")
    run.finish()
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)  # no step lost or short
    assert all(r["lag_max"] <= 1 for r in train)
    services = run.services()
    restarts = {name: s["restarts"] for name, s in services.items()}
    # Nothing else restarted: every service rode out the server's restart.
    assert restarts == {"generator": 1, "nats-server": 1, "trainer": 0, "preprocessor": 0}, run.output()
    assert train[-1]["weight_epoch"] >= 2 and train[-1]["generators_in_group"] == 1


def test_the_trainer_dies_resumes_from_its_checkpoint_and_generators_rejoin(tmp_path):
    steps = 12
    job = fault_job("trainer", steps, trainer={"checkpointInterval": 3})
    run, before, killed_at = kill_mid_run(tmp_path, job, "trainer", after_step=5)  # 2 steps past the step-3 checkpoint
    train = run.train()
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", (run.dir / "logs/trainer.log").read_text())[1])
    assert resumed_at % 3 == 0 and resumed_at <= killed_at  # the newest checkpoint when it died
    # The first trainer's rows, then the restarted one's: each step once from its checkpoint on.
    first, second = train[: len(train) - (steps - resumed_at)], train[len(train) - (steps - resumed_at) :]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= killed_at
    assert [r["step"] for r in second] == list(range(resumed_at + 1, steps + 1))
    assert all(r["samples"] == SAMPLES and r["tokens"] > 0 for r in train)
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
    assert all(r["lag_max"] <= 1 and r["dropped_for_lag"] == 0 for r in second)
    services = run.services()
    assert services["trainer"]["restarts"] == 1
    # The generator kept running and rejoined the new trainer's weight group.
    assert services["generator"]["restarts"] == 0 and services["generator"]["pid"] == before["generator"]["pid"]
    assert second[-1]["generators_in_group"] == 1 and groups_from(second[-1], 0) > 0
    latest = run.dir / "checkpoints" / (run.dir / "checkpoints" / "latest").read_text()
    assert json.loads((latest / "state.json").read_text())["step"] == steps


def test_the_preprocessor_dies_mid_step_with_two_trainer_ranks(tmp_path):
    # Rows of 64 tokens: each step reaches both ranks in several micro-batches, published in
    # waves, so the kill can fall between them; the ranks must still agree on every step.
    steps = 10
    job = fault_job("pre", steps, trainer={"replicas": 2, "microBatchTokens": 64})
    run, _, _ = kill_mid_run(tmp_path, job, "preprocessor")
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # both ranks stepped in lock-step throughout
    assert all(r["tokens"] > 0 for r in train)
    assert sum(r["samples"] for r in train) >= SAMPLES * (steps - 1)  # a step closed early by the restart may be short
    services = run.services()
    assert services["preprocessor"]["restarts"] == 1
    assert services["trainer-0"]["restarts"] == services["trainer-1"]["restarts"] == 0
