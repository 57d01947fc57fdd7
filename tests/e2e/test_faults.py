"""Faults survived by a running job: `pipelinerl run` in its own process, one of its processes
killed with SIGKILL mid-run (its whole process group, as a pod dies), restarted by the runner's
restart policy as a StatefulSet would. Each test asserts what went on: steps, samples per step,
which generators fed which steps, weight-group epochs, restarts and process ids."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobs import tiny_job  # tests/e2e/jobs.py

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 420


class Run:
    def __init__(self, tmp_path: Path, job: dict):
        self.dir = tmp_path / "run"
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(job))
        self.out = open(tmp_path / "run.out", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "run", str(manifest), "--run-dir",
                                      str(self.dir)], stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.deadline = time.monotonic() + RUN_TIMEOUT_S

    def output(self) -> str:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((self.dir / "logs").glob("*.log")))
        return (self.dir.parent / "run.out").read_text()[-3000:] + "\n" + logs

    def train(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return [r for r in rows if r["kind"] == "train"]

    def services(self) -> dict:
        return json.loads((self.dir / "services.json").read_text())

    def wait_step(self, step: int) -> None:
        while not (self.train() and self.train()[-1]["step"] >= step):
            assert self.proc.poll() is None, f"the run ended before step {step}:\n{self.output()}"
            assert time.monotonic() < self.deadline, f"no step {step} in time:\n{self.output()}"
            time.sleep(0.2)

    def kill(self, name: str) -> tuple[int, int]:
        """SIGKILL a service and everything it started; its pid, and the last step trained then."""
        pid = self.services()[name]["pid"]
        os.killpg(pid, signal.SIGKILL)
        return pid, self.train()[-1]["step"]

    def finish(self) -> None:
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
            raise AssertionError(f"the run did not finish in {RUN_TIMEOUT_S}s:\n{self.output()}") from None
        finally:
            self.out.close()
        assert code == 0, self.output()


def groups_from(row: dict, generator: int) -> int:
    return row.get(f"groups_from_generator_{generator}", 0)


def fault_job(name: str, **spec) -> dict:
    # Short weight-sync deadlines: a dead member costs at most that long.
    base = {"weightSync": {"timeoutSeconds": 20}, "eval": {"interval": 0}, "rl": {"maxLag": 1}}
    return tiny_job(name, **(base | spec))


def test_one_generator_of_two_dies_and_rejoins(tmp_path):
    steps = 16
    run = Run(tmp_path, fault_job("gen2", generator={"replicas": 2}, trainer={"maxSteps": steps}))
    run.wait_step(3)
    pid, killed_at = run.kill("generator-1")
    run.finish()
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # the trainer never stopped nor repeated
    assert all(r["samples"] == 16 and r["tokens"] > 0 for r in train)  # every step trained a full batch
    # Training went on without the dead generator (groups it published before dying may still
    # be trained a few steps later), then it came back and fed steps again.
    alone = [r["step"] for r in train if r["step"] > killed_at and groups_from(r, 1) == 0]
    back = [r["step"] for r in train if alone and r["step"] > alone[0] and groups_from(r, 1) > 0]
    assert alone and back, [(r["step"], groups_from(r, 0), groups_from(r, 1)) for r in train]
    assert all(r["lag_max"] <= 1 for r in train)  # its tokens carry the version of the weights it was sent
    services = run.services()
    assert services["generator-1"]["restarts"] == 1 and services["generator-1"]["pid"] != pid
    assert services["generator-0"]["restarts"] == 0 and services["trainer"]["restarts"] == 0
    assert train[-1]["weight_epoch"] >= 3 and train[-1]["generators_in_group"] == 2  # left, rejoined


def test_the_only_generator_dies_the_trainer_waits_then_goes_on(tmp_path):
    steps = 10
    run = Run(tmp_path, fault_job("gen1", trainer={"maxSteps": steps}))
    run.wait_step(3)
    run.kill("generator")
    run.finish()
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["samples"] == 16 and r["tokens"] > 0 for r in train)
    assert all(r["lag_max"] <= 1 for r in train)
    services = run.services()
    assert services["generator"]["restarts"] == 1 and services["trainer"]["restarts"] == 0
    assert train[-1]["weight_epoch"] >= 2 and train[-1]["generators_in_group"] == 1


def test_the_trainer_dies_resumes_from_its_checkpoint_and_generators_rejoin(tmp_path):
    steps = 12
    run = Run(tmp_path, fault_job("trainer", trainer={"maxSteps": steps, "checkpointInterval": 3}))
    run.wait_step(4)  # past the checkpoint of step 3
    generator_pid = run.services()["generator"]["pid"]
    _, killed_at = run.kill("trainer")
    run.finish()
    train = run.train()
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", (run.dir / "logs/trainer.log").read_text())[1])
    assert resumed_at % 3 == 0 and resumed_at <= killed_at  # the newest checkpoint when it died
    # The first trainer's rows, then the restarted one's: each step once from its checkpoint on.
    first, second = train[:len(train) - (steps - resumed_at)], train[len(train) - (steps - resumed_at):]
    assert [r["step"] for r in first] == list(range(1, len(first) + 1)) and len(first) >= killed_at
    assert [r["step"] for r in second] == list(range(resumed_at + 1, steps + 1))
    assert all(r["samples"] == 16 and r["tokens"] > 0 for r in train)
    services = run.services()
    assert services["trainer"]["restarts"] == 1
    # The generator kept running and rejoined the new trainer's weight group.
    assert services["generator"]["restarts"] == 0 and services["generator"]["pid"] == generator_pid
    assert second[-1]["generators_in_group"] == 1 and groups_from(second[-1], 0) > 0
    latest = run.dir / "checkpoints" / (run.dir / "checkpoints" / "latest").read_text()
    assert json.loads((latest / "state.json").read_text())["step"] == steps
