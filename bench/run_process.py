"""`pipelinerl run` as a process of its own, watched from outside: its train metrics, its
processes (services.json), SIGKILL to one of them. The fault tests and the elastic benchmark
drive jobs through it."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml


class RunProcess:
    def __init__(self, tmp_path: Path, job: dict, timeout_s: float):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.dir = tmp_path / "run"
        manifest = tmp_path / "job.yaml"
        manifest.write_text(yaml.safe_dump(job))
        self.out = open(tmp_path / "run.out", "wb")
        # SIGHUP as a terminal's process has it: under nohup (as CI may run) it is inherited
        # ignored, and the run would rightly outlive a hang-up (`stop(signal.SIGHUP)`)
        main = (
            "import runpy, signal; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
            "runpy.run_module('pipelinerl_cli', run_name='__main__', alter_sys=True)"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", main, "run", str(manifest), "--run-dir", str(self.dir)],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s

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
        self.wait_until(lambda train: train and train[-1]["step"] >= step, f"step {step}")

    def wait_until(self, done, what: str, shown=None) -> None:
        """Until `done(train rows)` holds, while the run goes on; a failure names `what` and
        `shown(train rows)` where given."""
        self._until(lambda: done(self.train()), what, lambda: f"\n{shown(self.train())}" if shown else "")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the run as Ctrl-C does (every service stops; the trainer checkpoints first):
        SIGTERM, or SIGHUP (its terminal closed)."""
        os.kill(self.proc.pid, sig)
        code = self.proc.wait(timeout=120)
        self.out.close()
        assert code == 130, self.output()

    def abandon(self) -> None:
        """A test failed midway: stop the run and every service it started, without asserting."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.out.close()

    def kill(self, name: str) -> tuple[int, int]:
        """SIGKILL a service and everything it started; its pid, and the last step trained then."""
        pid = self.services()[name]["pid"]
        os.killpg(pid, signal.SIGKILL)
        return pid, self.train()[-1]["step"]

    def kill_everything(self) -> None:
        """SIGKILL the runner, every service's process group and nats-server at once (a power cut);
        returns once the run folder's lock is free (each of those processes held it)."""
        pids = [s["pid"] for s in self.services().values()]
        for pid in [self.proc.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.out.close()
        deadline = time.monotonic() + 30
        with open(self.dir / ".run.lock", "a") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return  # released as the file closes
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the killed run's processes still hold its folder"
                    time.sleep(0.05)

    def restarted(self, name: str, pid: int) -> int:
        """The pid of `name`'s next process once the runner has started it in place of `pid`."""
        self._until(lambda: self.services()[name]["pid"] != pid, f"restart of {name}", every_s=0.05)
        return self.services()[name]["pid"]

    def _until(self, ok, what: str, seen=lambda: "", every_s: float = 0.2) -> None:
        """Poll `ok()` while the run goes on, within its deadline; a failure names `what`, then `seen()`."""
        while not ok():
            assert self.proc.poll() is None, f"the run ended before {what}:{seen()}\n{self.output()}"
            assert time.monotonic() < self.deadline, f"no {what} in time:{seen()}\n{self.output()}"
            time.sleep(every_s)

    def finish(self) -> None:
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
            raise AssertionError(f"the run did not finish in {self.timeout_s}s:\n{self.output()}") from None
        finally:
            self.out.close()
        assert code == 0, self.output()
