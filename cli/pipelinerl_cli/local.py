"""`pipelinerl run job.yaml`: the whole job on this machine.

Starts an embedded nats-server and the same three services the pods run, as separate
processes (`supervisor`: their cores, restarts and failures); shows live progress from the
job's metrics stream; writes metrics.jsonl, summary.json and progress.png into the run folder.
Ctrl-C stops everything cleanly; a service that dies for good stops the rest, and its cause and
log tail are shown with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

import httpx
from nats.js.api import ConsumerConfig, DeliverPolicy

from pipelinerl import messages as m
from pipelinerl.capacity import stream_bytes
from pipelinerl.contracts import ROLES, STOP_GRACE_S, STOPPED_EXIT, GeneratorStatus, ServiceEnv
from pipelinerl.steps import is_final
from pipelinerl_cli.embedded_nats import EmbeddedNats
from pipelinerl.learning import learning_alarm
from pipelinerl.phases import decomposition
from pipelinerl.ports import free_port
from pipelinerl.spec import PipelineRLJob, SpecError, dump_job, immutable_changes, load_job, spec_value
from pipelinerl.streams import close, connect
from pipelinerl.store import ensure_streams
from pipelinerl.tiny_model import model_info, model_path_problem, resolve_model_path
from pipelinerl.tracking import write_text_whole, write_whole
from pipelinerl_cli.supervisor import (
    CANNOT_RUN,
    Cores,
    RestartPolicy,
    Service,
    ServiceDied,
    cause,
    core_plan,
    role_environ,
    tail,
)

FINAL_EVAL_TIMEOUT_S = 300.0
# `pipelinerl run`'s exit code for a run that finished without learning (`learning.learning_alarm`);
# 2 (CANNOT_RUN) is a job that cannot run as written, 1 a failure, 130 a stop.
NOT_LEARNING = 3
ROWS_IN_FLIGHT_S = 5.0  # the services gone, the rows they published are this close behind
# A service's exit 0 with the end not announced here is judged early after this long: an ordered
# consumer's recovery after a NATS restart (two missed heartbeats), with margin.
EARLY_EXIT_S = 30.0
NATS_HEALTH_S = 2.0  # how often nats-server's JetStream health is asked
NATS_ROOM_BYTES = 64 << 20  # free space on its store's disk before a JetStream that cannot write is restarted
NATS_FULL_SAY_S = 30.0  # how often "waiting for room" is said
PRINT_EVERY_S = 3.0


class Running:
    """A total of per-process counters that survives restarts: a restarted process (a new key)
    counts again from 0, and a dead one keeps what it added, so the total never goes back."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], float] = {}
        self.total = 0.0

    def add(self, process: tuple[str, int], value: float) -> None:
        self.total += max(0.0, value - self.last.get(process, 0.0))
        self.last[process] = value


class LocalRun:
    def __init__(
        self,
        job: PipelineRLJob,
        run_dir: Path,
        quiet: bool = False,
        cores: str = "default",
        restart: RestartPolicy | None = None,
        nats: EmbeddedNats | None = None,
    ):
        self.job, self.spec, self.run_dir = job, job.spec, run_dir
        self.cores = cores
        self.restart = restart or RestartPolicy(limit=job.spec.run_policy.backoff_limit)
        self.nats, self.nats_restarts = nats, 0
        self.nats_health_restarts = 0  # of those, for a JetStream that could not write (`_check_jetstream`)
        self.nats_restart_at: float | None = None
        self.nats_checked = self.nats_full_said = 0.0  # monotonic: JetStream's health asked, "disk full" said
        self.services_unwritten_said = False
        # (run time, generators' summed busy seconds, their summed tokens generated)
        self.busy: list[tuple[float, float, float]] = []
        self.first_group: float | None = None  # run time the first generator began generating
        self.subjects = job.subjects
        self.quiet = quiet
        self.services: list[Service] = []
        self.train: list[dict] = []
        self.evals: list[dict] = []
        self.earlier_evals: list[dict] = []  # a resumed run's, from its metrics.jsonl (the warm start's)
        self.announced_end = False  # the trainer announced its last step (`steps.is_final`)
        self.exited_at: dict[str, float] = {}  # services seen exited 0 before the end, when (monotonic)
        self.held: tuple[int, ...] = ()  # descriptors its processes keep open: the run folder's lock
        self.metrics_file: TextIO | None = None  # metrics.jsonl, open for appending while the run is watched
        self.metrics_unwritten = 0  # rows the disk would not take (kept for the summary all the same)
        self.gen_tokens, self.gen_busy = Running(), Running()  # summed over generators, across restarts
        self.gen_polled: tuple[float, float] | None = None  # (time, tokens) at the last poll
        self.gen_rate = 0.0
        self.t0 = time.time()

    def say(self, text: str) -> None:
        if not self.quiet:
            tell(text)

    # -- processes -------------------------------------------------------------------------
    def start_services(self, nats_url: str) -> None:
        write_text_whole(self.run_dir / "job.yaml", dump_job(self.job))  # what a resumed run is started from
        # The runner's record, which the services (and their restarts) read: job.yaml may be
        # edited meanwhile, for the next run.
        ran = self.run_dir / RAN_JOB
        write_text_whole(ran, dump_job(self.job))
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        gens, trainers = self.spec.generator_engines, self.spec.trainer_ranks
        output = self.spec.output
        weights_port, master_port = free_port(), free_port()
        token = secrets.token_hex(16)  # the weight group's members prove they hold it, as in a cluster
        plan = core_plan(self.cores, sorted(os.sched_getaffinity(0)), trainers, gens)
        layout = (
            [("trainer", r, trainers) for r in range(trainers)]
            + [("preprocessor", 0, 1)]
            + [("generator", r, gens) for r in range(gens)]
        )
        role_envs = {
            role: role_environ(getattr(self.spec, role).env, os.environ, self.say)
            for role in ("trainer", "preprocessor", "generator")
        }
        for role, rank, world in layout:
            trainer = role == "trainer"
            cores = plan.get((role, rank), Cores(None, 1))
            env = ServiceEnv(
                role,
                rank=rank,
                world_size=world if trainer else None,
                nats_url=nats_url,
                weights_addr=f"127.0.0.1:{weights_port}",
                weights_token=token,
                run_dir=self.run_dir,
                http_port=free_port(),
                listen_host="127.0.0.1",
                exit_when_done=True,
                torch_threads=cores.threads,
                output_dir=Path(output.path).expanduser().resolve() if trainer and output and output.path else None,
                local_rank=rank if trainer else None,  # one machine: trainer rank r on GPU r
                master_addr="127.0.0.1" if trainer else None,
                master_port=master_port if trainer else None,
            )
            name = role if world == 1 else f"{role}-{rank}"
            self.services.append(Service(name, env, logs / f"{name}.log", ran, cores, role_envs[role], self.held))
        self._record_services()

    def check_services(self) -> bool:
        """True when the trainers have all finished. A process that failed is restarted after a
        backoff (nats-server too); ServiceDied once the restart policy gives up on it. A generator
        or the preprocessor exits 0 once the trainer announced the end: one that exits 0 with no
        word of that announcement here within EARLY_EXIT_S (this run's consumer may be catching up
        after a NATS restart) stopped before the end (a signal: `kill` of its pid), and is
        restarted as a failure, as Kubernetes restarts a container whatever its code."""
        self._check_nats()
        trainers_done = all(s.proc.poll() == 0 and s.restart_at is None for s in self.services if s.role == "trainer")
        ended = trainers_done or self.announced_end
        now = time.monotonic()
        for s in self.services:
            if s.restart_at is not None:
                if now >= s.restart_at:
                    s.restart_at = None
                    s.start()
                    self._record_services()
                continue
            code = s.proc.poll()
            early = code == 0 and s.role != "trainer" and not ended
            if code is None or (code == 0 and not early):
                continue
            if early and now - self.exited_at.setdefault(s.name, now) < EARLY_EXIT_S:
                continue  # the end may be announced to this run yet
            self.exited_at.pop(s.name, None)
            s.reap()
            s.restart_at = now + self._backoff(s.name, s.failures, code, s.log_path)
            s.restarts += 1
            s.failures += int(code != STOPPED_EXIT)
        return trainers_done

    def _check_nats(self) -> None:
        """nats-server is supervised like the services (its streams are kept on disk)."""
        if self.nats is None:
            return
        now = time.monotonic()
        if self.nats_restart_at is not None:
            if now >= self.nats_restart_at:
                self.nats_restart_at = None
                self._start_nats(now)
            return
        assert self.nats.proc is not None  # started with the run
        code = self.nats.proc.poll()
        if code is not None:
            self._nats_exited(now, code)
        elif now - self.nats_checked >= NATS_HEALTH_S:
            self.nats_checked = now
            self._check_jetstream(now)

    def _start_nats(self, now: float) -> None:
        """nats-server started again; one that dies starting, or never listens, is a crash."""
        assert self.nats is not None
        try:
            self.nats.start()
        except (OSError, RuntimeError) as err:
            tell(f"  nats-server did not start again: {err}", file=sys.stderr)
            self._nats_exited(now, self.nats.proc.returncode if self.nats.proc else None)
        self._record_services()

    def _nats_exited(self, now: float, code: int | None) -> None:
        """nats-server ended (`code`; None: unknown): restarted after a backoff counted by its
        crashes only (not the restarts for a disk that had been full), or ServiceDied."""
        assert self.nats is not None
        crashes = self.nats_restarts - self.nats_health_restarts
        log_path = self.nats.store_dir / "nats.log"
        self.nats_restart_at = now + self._backoff("nats-server", crashes, 1 if code is None else code, log_path, False)
        self.nats_restarts += 1

    def _check_jetstream(self, now: float) -> None:
        """JetStream that cannot write (a full disk) refuses writes until nats-server restarts,
        even once the disk has room again: restart it then, as a pod's liveness probe would."""
        assert self.nats is not None
        problem = self.nats.jetstream_problem()
        if not problem:
            return
        free = shutil.disk_usage(self.nats.store_dir).free
        if free < NATS_ROOM_BYTES:
            if now - self.nats_full_said >= NATS_FULL_SAY_S:
                self.nats_full_said = now
                tell(
                    f"  nats-server: JetStream cannot write ({problem}); its disk has {free >> 20} MiB free: "
                    f"waiting for room",
                    file=sys.stderr,
                )
            return
        # Spaced as a crash's restarts (a restart that does not help, a stream damaged otherwise,
        # is not repeated every NATS_HEALTH_S).
        wait = self.restart.spacing(self.nats_health_restarts)
        tell(
            f"  nats-server: JetStream cannot write ({problem}); restarting it, its disk has room again "
            f"({free >> 20} MiB free); next look in {wait:.0f}s",
            file=sys.stderr,
        )
        self.nats.stop()
        self.nats_restarts += 1
        self.nats_health_restarts += 1
        self.nats_checked = now + wait
        self._start_nats(now)

    def _backoff(self, name: str, failures: int, code: int, log_path: Path, service: bool = True) -> float:
        """Seconds until `name` (a `service`, or nats-server), which exited with `code` after
        `failures` restarts that followed a failure, is started again; ServiceDied (with its log's
        tail) once the restart policy gives up on it."""
        delay = self.restart.delay(failures, code, service)
        if delay is None:
            raise ServiceDied(name, code, log_path, tail(log_path), service)
        if code == STOPPED_EXIT:  # a trainer rank: the gang stopped (one of its processes was asked to)
            tell(f"  {name} stopped with its gang, its checkpoint written: starting it again")
            return delay
        why = cause(tail(log_path)) if code > 0 else None  # a crash, not a kill: say what it died of
        tell(  # a warning, even when quiet
            f"  {name} exited with code {code}{f' ({why})' if why else ''}: restarting it in {delay:.0f}s "
            f"(restart {failures + 1} of {self.restart.limit})",
            file=sys.stderr,
        )
        return delay

    def _record_services(self) -> None:
        """services.json: each process of the run, for `ps`/`kill`, scrapers (its HTTP port:
        /metrics, /status) and tests."""
        record = {
            s.name: {
                "pid": s.proc.pid,
                "restarts": s.restarts,
                "role": s.role,
                "rank": s.rank,
                "http_port": s.http_port,
                **({"master_port": s.env.master_port} if s.env.master_port and s.rank == 0 else {}),
            }
            for s in self.services
        }
        if self.nats is not None and self.nats.proc is not None:
            record["nats-server"] = {
                "pid": self.nats.proc.pid,
                "restarts": self.nats_restarts,
                "role": "nats",
                "url": self.nats.url,
            }
        try:
            write_whole(self.run_dir / "services.json", record, indent=1)  # readers never see half a file
        except OSError as err:  # a full disk: the run goes on (its checkpoint's failure says why)
            if not self.services_unwritten_said:
                self.say(f"  warning: {self.run_dir / 'services.json'} not written ({err.strerror}): the run goes on")
                self.services_unwritten_said = True

    def stop_services(self) -> None:
        # All at once, as Kubernetes deletes a job's pods: one after another took 13-17 s (a vLLM
        # engine's shutdown alone 4-6 s), and each service's grace period runs from the same start.
        for s in self.services:
            s.terminate()
        deadline = time.monotonic() + STOP_GRACE_S + 5  # one grace period for all, as for a job's pods
        for s in reversed(self.services):
            s.stop(max(0.0, deadline - time.monotonic()), terminated=True)

    # -- progress --------------------------------------------------------------------------
    def take_metric(self, row: m.Metrics, seq: int | None = None) -> None:
        """A metrics row: kept for the summary and the plot, appended to metrics.jsonl, an
        evaluation said. Once the disk refuses a row the file is closed where it stands (a row
        left in its buffer could be written torn later) and that row and every later one is
        counted, the first said; the run goes on (and so do the rows, in the job's METRICS stream
        where that has room)."""
        record = {"kind": row.kind, "source": row.source, "time": row.timestamp - self.t0, **row.values}
        if seq is not None:  # its METRICS stream sequence: a resumed run reads on after the last one written
            record["seq"] = seq
        if self.metrics_file is None:
            self.metrics_unwritten += 1
        else:
            size = None
            try:
                size = os.fstat(self.metrics_file.fileno()).st_size  # appended at: the file's end
                self.metrics_file.write(json.dumps(record) + "\n")
                self.metrics_file.flush()
            except OSError as err:
                self.metrics_unwritten += 1
                self.say(f"  warning: metrics.jsonl takes no more rows ({err.strerror}): the run goes on without them")
                name = self.metrics_file.name
                self._close_metrics()
                if size is not None and os.path.isfile(name):  # a row written in part is cut off
                    with contextlib.suppress(OSError):
                        os.truncate(name, size)
        if row.timestamp < self.t0:  # an earlier runner's, published as it stopped: in the file alone
            return
        if row.kind == "train":
            # A trainer restarted from its checkpoint trains the steps after it again: each step's
            # newest row counts (the summary's samples, drops and lags once, its clock the run's).
            while self.train and self.train[-1]["step"] >= record["step"]:
                self.train.pop()
            self.train.append(record)
        elif row.kind == "eval":
            self.evals.append(record)
            tag = "warm start" if record["version"] == 0 else ("final" if record.get("final") else "eval")
            lo, hi = record.get("weights_version_min"), record.get("weights_version_max")
            newer = lo is not None and (lo, hi) != (record["version"], record["version"])
            weights = f" (made with the weights of versions {lo}-{hi})" if newer else ""
            self.say(
                f"  [{tag}] version {record['version']}: held-out accuracy {record['accuracy']:.1%} "
                f"on {record['problems']} problems{weights}"
            )

    def _close_metrics(self) -> None:
        metrics_file, self.metrics_file = self.metrics_file, None
        if metrics_file is not None:
            try:
                metrics_file.close()
            except OSError:
                pass  # rows it still held were counted as their writes failed

    async def watch(self, nc, nats_url: str) -> None:
        js = nc.jetstream()
        await ensure_streams(js, self.subjects, self.spec.nats.max_payload_mb, sizes=stream_bytes(self.spec))
        earlier = _rows(self.run_dir / "metrics.jsonl")
        self.earlier_evals = [r for r in earlier if r.get("kind") == "eval"]
        self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")

        async def on_metric(msg) -> None:
            self.take_metric(m.decode(msg.data, m.Metrics), msg.metadata.sequence.stream)

        async def on_version(msg) -> None:  # the trainer's announcements: the end among them
            self.announced_end = self.announced_end or is_final(m.decode(msg.data, m.PolicyVersion), max_steps)

        max_steps = self.spec.trainer.max_steps
        await js.subscribe(
            self.subjects.version, cb=on_version, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ordered_consumer=True
        )

        first = first_unread(earlier, (await js.stream_info(self.subjects.stream("METRICS"))).state.last_seq)
        await js.subscribe(
            self.subjects.metrics(">"),
            cb=on_metric,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first),
        )
        self.start_services(nats_url)
        self.say(f"  services: {', '.join(s.name for s in self.services)}; logs in {self.run_dir / 'logs'}")
        last_print = 0.0
        async with httpx.AsyncClient(timeout=1.0) as http:
            while True:
                finished = self.check_services()
                await self.poll_generators(http)
                if time.time() - last_print > PRINT_EVERY_S and self.train:
                    self.say(self.progress_line())
                    last_print = time.time()
                if finished:
                    break
                await asyncio.sleep(0.5)
            # The trainers are done: their last rows (the last step's, unless a trainer restarted
            # after its final checkpoint; the final evaluation the trainer waited for) are
            # published, maybe still on their way here. Waited for as long as a generator runs
            # (its final evaluation), a moment once none does.
            deadline = time.time() + FINAL_EVAL_TIMEOUT_S

            def final_missing() -> bool:
                return bool(self.spec.eval.interval) and not any(e.get("final") for e in self.evals)

            while not (self.train and self.train[-1]["step"] >= self.spec.trainer.max_steps) or final_missing():
                self.check_services()
                if all(s.proc.poll() is not None for s in self.services if s.role == "generator"):
                    deadline = min(deadline, time.time() + ROWS_IN_FLIGHT_S)
                if time.time() > deadline:
                    if final_missing():
                        self.say("  (no final evaluation arrived in time)")
                    break
                await asyncio.sleep(0.2)
        self._close_metrics()

    async def poll_generators(self, http) -> None:
        for s in self.services:
            if s.role != "generator" or s.proc.poll() is not None:
                continue
            try:
                status = GeneratorStatus.model_validate(
                    (await http.get(f"http://127.0.0.1:{s.http_port}/status")).json()
                )
            except (httpx.HTTPError, ValueError):  # starting (or restarting): its counts as last read
                continue
            self.gen_tokens.add((s.name, s.proc.pid), status.tokens)
            self.gen_busy.add((s.name, s.proc.pid), status.busy_seconds)
            if status.first_group_at is not None:
                began = status.first_group_at - self.t0
                self.first_group = began if self.first_group is None else min(self.first_group, began)
        now, total = time.time(), self.gen_tokens.total
        self.busy.append((now - self.t0, self.gen_busy.total, total))
        if self.gen_polled and now > self.gen_polled[0]:
            self.gen_rate = 0.7 * self.gen_rate + 0.3 * (total - self.gen_polled[1]) / (now - self.gen_polled[0])
        self.gen_polled = (now, total)

    def progress_line(self) -> str:
        t = self.train[-1]
        acc = f"{self.evals[-1]['accuracy']:.1%}" if self.evals else "-"
        recent = self.train[-10:]
        reward = sum(r["reward"] for r in recent) / len(recent)
        return (
            f"[{time.time() - self.t0:6.0f}s] step {t['step']:4d}/{self.spec.trainer.max_steps} "
            f"version {t['step']:4d} | train reward {reward:.3f} | test acc {acc} | "
            f"lag {t['lag_mean']:.2f} (max {t['lag_max']:.0f}) | ess {t['ess']:.3f} | "
            f"gen {self.gen_rate:,.0f} tok/s | trainer {t['trainer_tokens_per_second']:,.0f} tok/s"
        )

    # -- results ---------------------------------------------------------------------------
    def summary(self) -> dict:
        first = next((e for e in [*self.earlier_evals, *self.evals] if e["version"] == 0), None)
        final = next((e for e in reversed(self.evals) if e.get("final")), self.evals[-1] if self.evals else None)
        lags = [t["lag_max"] for t in self.train]
        return {
            "job": self.job.name,
            "mode": self.spec.mode,
            "max_lag": self.spec.max_lag,
            "steps": self.train[-1]["step"] if self.train else 0,
            "wall_seconds": time.time() - self.t0,
            "started_at": self.t0,  # Unix seconds; rows' "time" counts from it
            "first_group_seconds": self.first_group,  # when generation began, on the rows' clock
            "warm_start_accuracy": first["accuracy"] if first else None,
            "final_accuracy": final["accuracy"] if final else None,
            "accuracy_gain_points": 100 * (final["accuracy"] - first["accuracy"]) if first and final else None,
            "updates_with_requests_in_flight": sum(t.get("updates_with_running_requests", 0) for t in self.train),
            "lag_max": max(lags) if lags else None,
            "samples_dropped_for_lag": sum(t.get("dropped_for_lag", 0) for t in self.train),
            "mean_ess": sum(t["ess"] for t in self.train) / len(self.train) if self.train else None,
            "samples_rejected": sum(t.get("samples_rejected", 0) for t in self.train),
            "learning_alarm": learning_alarm(self.train),
            **({"metrics_rows_unwritten": self.metrics_unwritten} if self.metrics_unwritten else {}),
            **self.throughput(),
        }

    def write_summary(self, summary: dict) -> tuple[Path | None, str]:
        """summary.json, whole or not at all (a full disk leaves no half summary for `plan
        --calibrate-from` to misread), then progress.png: the plot's path, and what could not be
        written ("" where all was)."""
        try:
            write_whole(self.run_dir / "summary.json", summary, indent=1)
        except OSError as err:
            return None, f"{self.run_dir / 'summary.json'}: {err.strerror}: the summary below is all there is"
        try:
            return self.plot(), ""
        except OSError as err:
            return None, f"{self.run_dir / 'progress.png'}: {err.strerror} (summary.json is written)"

    def throughput(self) -> dict:
        """Rates over the steady part of the run: from the end of the first step to the end of
        the last (start-up and the first step's wait for data are left out)."""
        if len(self.train) < 2:
            return {}
        first, last = self.train[0], self.train[-1]
        window = last["time"] - first["time"]
        steps = self.train[1:]
        trainer_busy = sum(t["train_seconds"] + t.get("weight_sync_seconds", 0.0) for t in steps)
        lags: dict[str, int] = {}
        for t in self.train:
            for k, v in t.items():
                if k.startswith("tokens_lag_"):
                    lags[k[len("tokens_lag_") :]] = lags.get(k[len("tokens_lag_") :], 0) + v
        out = {
            "samples_per_second": sum(t["samples"] for t in steps) / window,
            "seconds_per_step": window / len(steps),
            "trainer_busy_fraction": trainer_busy / window,
            "lag_token_counts": dict(sorted(lags.items(), key=lambda kv: int(kv[0]))),
        }
        busy = [b for b in self.busy if first["time"] <= b[0] <= last["time"]]
        if len(busy) >= 2:
            polled = busy[-1][0] - busy[0][0]
            out["generator_busy_fraction"] = (busy[-1][1] - busy[0][1]) / polled
            out["generated_tokens_per_second"] = (busy[-1][2] - busy[0][2]) / polled
        # waiting, training and updating per phase (a step, in pipeline mode)
        out["phases"] = decomposition(self.train, self.spec.steps_per_generation)
        return out

    def plot(self) -> Path | None:
        if not self.train:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
        rewards = [t["reward"] for t in self.train]
        k = 10
        smooth = [
            sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
            for i in range(len(rewards))
        ]
        # The same curves against optimizer steps and against wall-clock time (what is paid for).
        for ax, train_x, eval_x, label in (
            (
                axes[0],
                [t["step"] for t in self.train],
                [e["version"] for e in self.evals],
                "optimizer step (policy version)",
            ),
            (
                axes[1],
                [t["time"] / 60 for t in self.train],
                [e["time"] / 60 for e in self.evals],
                "wall-clock minutes since the run started",
            ),
        ):
            ax.plot(train_x, rewards, color="tab:blue", alpha=0.25, label="train reward")
            ax.plot(train_x, smooth, color="tab:blue", label="train reward (10-step mean)")
            if self.evals:
                ax.plot(eval_x, [e["accuracy"] for e in self.evals], "o-", color="tab:red", label="held-out accuracy")
            ax.set_xlabel(label)
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[1].legend(loc="lower right")
        fig.suptitle(f"{self.job.name}: {self.spec.mode} mode, max lag {self.spec.max_lag}")
        path = self.run_dir / "progress.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def tell(*args: object, file: TextIO | None = None) -> None:
    """print (flushed), where a terminal gone (closed, or its session detached) cannot end the run: EIO."""
    with contextlib.suppress(OSError):
        print(*args, file=file or sys.stdout, flush=True)


RAN_JOB = ".job.yaml"  # in a run's folder: the job it last ran, which `resumed_job_problem` compares with
# The fields that cannot change on a cluster that a local run does not read (its NATS is its own,
# its checkpoints in its folder).
NOT_READ_HERE = ("storage", "nats.url")


def resumed_job_problem(
    run_dir: Path, job: PipelineRLJob, instead: str = "give this one another --run-dir"
) -> str | None:
    """Why `job` cannot go on from the run in `run_dir`, whose checkpoints, streams and claims it
    would take for its own: another job's, or one a field that cannot change differs from
    (IMMUTABLE: the API server refuses such an update of a job as well). Compared with the job the
    folder last ran (RAN_JOB; job.yaml beside it may have been edited). None for a new folder; one
    whose job no longer reads (an older release's) is said and not compared. `instead`: the way out."""
    stored = run_dir / RAN_JOB
    if not stored.exists():
        return None
    try:
        old = load_job(stored)
    except SpecError as err:
        tell(
            f"warning: {stored} no longer reads, so the fields that cannot change were not compared:\n{err}",
            file=sys.stderr,
        )
        return None
    if (old.namespace, old.name) != (job.namespace, job.name):
        return f"{run_dir} holds the run of job {old.namespace}/{old.name}, not {job.namespace}/{job.name}: {instead}"
    changed = [path for path in immutable_changes(old, job) if path not in NOT_READ_HERE]
    if changed:
        shown = {
            path: [json.dumps(spec_value(j, path), separators=(",", ":"), sort_keys=True) for j in (old, job)]
            for path in changed
        }
        was = "; ".join(f"spec.{path}: {then} now {now}" for path, (then, now) in shown.items())
        return (
            f"{run_dir} holds this job's run with fields that cannot change (its checkpoints and streams are "
            f"of them) as they were: {was}. Set them as they were, or {instead}"
        )
    return None


def lock_run_dir(run_dir: Path, instead: str) -> TextIO:
    """One process per run folder: a second `pipelinerl run` there, or a command opening its
    store (`dead-letters`, `recover-store`), would start a NATS of its own on the same store.
    Held until the returned file is closed (or the process ends), and by the processes given its
    descriptor (a run's services and NATS: until the last has ended, a runner killed outright
    leaving them to wind down)."""
    lock = open(run_dir / ".run.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise SpecError(f"{run_dir} is in use by another `pipelinerl run`: {instead}") from None
    return lock


def _rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (a line cut short, or none at all, skipped)."""
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    return rows


def first_unread(rows: list[dict], last_seq: int) -> int:
    """The METRICS stream sequence a run reads from, given the rows its metrics.jsonl holds: the
    one after the last written, so that rows published after an earlier runner stopped reading
    (the trainer's step in progress as it stopped) are not lost; else (none recorded, or the
    stream made again since: it is behind them) only what comes from now on."""
    written = next((r["seq"] for r in reversed(rows) if isinstance(r.get("seq"), int)), None)
    return written + 1 if written is not None and written <= last_seq else last_seq + 1


def run_local(
    job: PipelineRLJob,
    run_dir: str | Path | None = None,
    quiet: bool = False,
    cores: str = "default",
    restart: bool = True,
) -> int:
    """Run the job here; `cores`: see `core_plan`; `restart=False`: the first process to fail
    stops the run (else each is restarted up to runPolicy.backoffLimit times, as its pod would be)."""
    problem, _ = model_path_problem(job.spec.model.path, runs_here=True)
    if problem:  # else each service fails after its start-up, with the model hub's word for it
        raise SpecError(problem)
    if gpus := [f"spec.{role}.gpus" for role in ROLES if getattr(job.spec, role).gpus]:
        raise SpecError(  # else each process fails at its start, its restarts spent first
            f"{', '.join(gpus)}: `pipelinerl run` runs every process on this machine's cores (the CPU builds of "
            "torch and vLLM) and gives none a GPU of its own: a job with GPUs runs on a cluster"
        )
    try:  # the cores asked for, before anything starts
        core_plan(cores, sorted(os.sched_getaffinity(0)), job.spec.trainer_ranks, job.spec.generator_engines)
    except ValueError as err:
        raise SpecError(f"{err}: run it unpinned (without --pin-cores, or --cores default)") from None
    run_dir = Path(run_dir or Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    in_use = lock_run_dir(run_dir, "stop it, or give this one another --run-dir")
    try:
        if problem := resumed_job_problem(run_dir, job):
            raise SpecError(problem)
        return _run_in(job, run_dir, quiet, cores, restart, in_use.fileno())
    finally:
        in_use.close()


def _run_in(job: PipelineRLJob, run_dir: Path, quiet: bool, cores: str, restart: bool, lock: int) -> int:
    """The run itself, in `run_dir`, which this process holds (`lock`: its lock's descriptor)."""
    policy = RestartPolicy(on_failure=restart, limit=job.spec.run_policy.backoff_limit)
    run = LocalRun(job, run_dir, quiet=quiet, cores=cores, restart=policy)
    run.held = (lock,)
    run.say(f"pipelinerl: running {job.name!r} ({job.spec.mode} mode, max lag {job.spec.max_lag}) in {run_dir}")
    model_path = resolve_model_path(job.spec.model.path)
    run.say(f"  model {model_path} {model_info(model_path) or ''}")
    nats = run.nats = EmbeddedNats.of_job(run_dir / "nats", job.spec)
    nats.held = run.held
    nats.start()
    code = 0

    async def main() -> None:
        nc = await connect(nats.url, "pipelinerl-run")
        try:
            await run.watch(nc, nats.url)
        finally:
            await close(nc)

    def _terminate(*_) -> None:
        raise KeyboardInterrupt  # SIGTERM, or the terminal closed: stopped like Ctrl-C, children too

    # SIGHUP: the terminal closed; not where it is ignored (nohup: the run outlives the terminal)
    hangup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else []
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, *hangup)}
    try:
        run.t0 = time.time()
        asyncio.run(main())
    except KeyboardInterrupt:
        run.say(
            "\ninterrupted: stopping services (to go on from its last checkpoint: "
            f"pipelinerl run {run_dir / 'job.yaml'} --run-dir {run_dir})"
        )
        code = 130
    except ServiceDied as err:
        why = cause(err.tail)
        tell(
            f"\nerror: {err}{f' ({why})' if why else ''}; stopping the other services. "
            f"Last lines of {err.log_path}:\n{err.tail}",
            file=sys.stderr,
        )
        code = CANNOT_RUN if err.hopeless else 1
    except (OSError, RuntimeError) as err:  # the run's own NATS lost for good (restarted and not listening)
        tell(f"\n{traceback.format_exc()}error: {type(err).__name__}: {err}; stopping the services", file=sys.stderr)
        code = 1
    finally:
        # A second Ctrl-C, SIGTERM or hang-up must not abort the clean-up: the trainer may be
        # writing its stop checkpoint, under the run folder's lock.
        for sig in (signal.SIGINT, *previous):
            signal.signal(sig, signal.SIG_IGN)
        try:
            run.stop_services()
            nats.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    summary = run.summary()
    plot, unwritten = run.write_summary(summary)
    if unwritten:
        tell(f"\nerror: {unwritten}", file=sys.stderr)
        code = code or 1
    run.say("\nsummary: " + json.dumps(summary, indent=1))
    if plot:
        run.say(f"plot: {plot}")
    if code == 0 and summary["learning_alarm"]:
        tell(f"\nerror: the run ended without learning: {summary['learning_alarm']}", file=sys.stderr)
        code = NOT_LEARNING
    return code
