"""The processes of a local run (`pipelinerl run`): where each runs (`core_plan`), what it is
given (`role_environ`), how it is started and stopped (`Service`), restarted after a failure as
its pod would be (`RestartPolicy`), and how a failure is named (`cause`, `ServiceDied`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.contracts import STOPPED_EXIT, ServiceEnv
from pipelinerl_cli.processes import die_with_parent

CORES = ("default", "split", "colocated")


@dataclass(frozen=True)
class Cores:
    """Where a service process runs: `cpus` it is pinned to (None: anywhere), its compute
    threads (the trainer's torch threads; a generator's vLLM engine threads), and whether its
    idle threads sleep at once (`passive`: OpenMP's passive wait) rather than spin for a while,
    as libgomp's do by default: a trainer whose threads spin between its many small ops on the
    cores its generators decode on took ~1.4 of 2 cores while waiting on them, and a tiny job's
    steps took ~18% longer (docs/architecture.md)."""

    cpus: list[int] | None
    threads: int
    passive: bool = False


def core_plan(mode: str, cpus: list[int], trainers: int, generators: int) -> dict[tuple[str, int], Cores]:
    """The cores of each trainer rank and generator, by `pipelinerl run`'s `--cores`:

    - split (`--pin-cores`): dedicated cores, one per generator, the rest shared out among the
      trainer ranks, each with as many threads as cores: neither stage slows the other, and in
      sync mode each phase leaves the other stage's cores idle;
    - colocated: every process may use every core, with that many threads (shared out among the
      trainer ranks, and among the generators): the conventional baseline as the paper runs it,
      each phase on the whole machine (the phases alternate, so they never compete; in pipeline
      mode they would);
    - default: unpinned, the trainer ranks share the cores out, a generator has one thread;
      their threads wait passively, as both stages run at once on the same cores.

    The light preprocessor is left unpinned, single-threaded."""
    if mode == "split":
        if len(cpus) < trainers + generators:
            raise ValueError(
                f"--pin-cores needs a core per trainer rank and generator ({trainers + generators}), "
                f"this process may use {len(cpus)}"
            )
        plan = {("generator", r): Cores([cpus[r]], 1) for r in range(generators)}
        rest = cpus[generators:]
        for r in range(trainers):
            plan["trainer", r] = Cores(rest[r::trainers], len(rest[r::trainers]))
        return plan
    if mode not in CORES:
        raise ValueError(f"cores: one of {', '.join(CORES)}, not {mode!r}")
    per_trainer = max(1, len(cpus) // trainers)
    per_generator = max(1, len(cpus) // generators) if mode == "colocated" else 1
    passive = mode == "default"
    return {("trainer", r): Cores(None, per_trainer, passive) for r in range(trainers)} | {
        ("generator", r): Cores(None, per_generator, passive) for r in range(generators)
    }


@dataclass(frozen=True)
class RestartPolicy:
    """What the local runner does when a process exits too early (a pod's restart, locally):
    restart it after a backoff, at most `limit` times per process; `on_failure=False` stops the
    whole run at the first failure instead."""

    on_failure: bool = True
    limit: int = 3
    base_s: float = 1.0
    max_s: float = 30.0

    def delay(self, restarts: int, code: int = 1, service: bool = True) -> float | None:
        """Seconds to wait before restart number `restarts` + 1 of a process that exited with
        `code`; None: give up (also at once for a `service`'s CANNOT_RUN: it would fail the same
        way again; nats-server's 2 is a Go panic, a crash like any other)."""
        if code == STOPPED_EXIT:  # a trainer rank stopped with its gang, its checkpoint written: no failure
            return self.base_s
        if not self.on_failure or restarts >= self.limit or (service and code == CANNOT_RUN):
            return None
        return self.spacing(restarts)

    def spacing(self, restarts: int) -> float:
        """The backoff before restart number `restarts` + 1: doubling from base_s, capped at max_s."""
        return min(self.base_s * 2**restarts, self.max_s)


# A service's exit code when the job cannot run as written (`pipelinerl service` prints
# "error: ..." and exits 2, as for any bad input): restarting it cannot help.
CANNOT_RUN = 2


def role_environ(entries, shell: Mapping[str, str], say=print) -> dict[str, str]:
    """`spec.<role>.env` as `pipelinerl run` gives it to that role's processes: `value` entries as
    written; a `valueFrom` entry (a Secret or ConfigMap key, which exists only on Kubernetes) from
    the shell's variable of that name, or unset, said so."""
    out = {}
    for e in entries:
        if e.value is not None:
            out[e.name] = e.value
        elif e.name in shell:
            out[e.name] = shell[e.name]
        else:
            kind = "Secret" if e.value_from and e.value_from.secret_key_ref else "ConfigMap"
            say(
                f"  note: {e.name} is read from a {kind} on Kubernetes; locally it is unset "
                f"(export {e.name}=... in this shell to give it)"
            )
    return out


def service_environ(
    shell: Mapping[str, str], env: ServiceEnv, role_env: Mapping[str, str], passive: bool = False
) -> dict[str, str]:
    """A service's environment: the shell's, then its role's `spec.<role>.env`, then the
    service contract (`ServiceEnv`), each over the one before. `passive` (`Cores.passive`):
    OpenMP's passive wait, unless the shell or the role sets a policy of its own."""
    return {
        **({"OMP_WAIT_POLICY": "PASSIVE"} if passive else {}),
        # Not the W&B service of the process that launched the run (WANDB_SERVICE): it would hold
        # a killed trainer's run, and the restarted trainer's run would be refused as "in use".
        # Each service starts its own.
        **{k: v for k, v in shell.items() if k != "WANDB_SERVICE"},
        "PYTHONUNBUFFERED": "1",
        # gloo's groups (the weight group, DeepSpeed's) listen where the host's name resolves,
        # often its network address, and NCCL's bootstrap on the first interface it finds: a run
        # on loopback keeps its collectives there too
        **({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} if env.listen_host in ("127.0.0.1", "::1") else {}),
        # the vLLM engine's threads (the trainer sets its own from torch_threads)
        "OMP_NUM_THREADS": str(env.torch_threads or 1) if env.role == "generator" else "1",
        **role_env,
        **env.to_environ(),
    }


class Service:
    """One service process, in a process group of its own: stopping or reaping it ends every
    process it started (e.g. a vLLM engine core)."""

    def __init__(
        self,
        name: str,
        env: ServiceEnv,
        log_path: Path,
        job_file: Path,
        cores: Cores,
        role_env: dict[str, str] | None = None,
        held: tuple[int, ...] = (),
    ):
        self.name, self.role, self.rank, self.log_path = name, env.role, env.rank, log_path
        self.held = held  # descriptors the process keeps open: the run folder's lock (`lock_run_dir`)
        self.env, self.job_file, self.cores = env, job_file, cores
        self.role_env = role_env or {}  # spec.<role>.env (role_environ)
        self.http_port = env.http_port
        self.restarts = 0
        self.failures = 0  # of those, after a failure (a STOPPED_EXIT is none): what the restart policy counts
        self.restart_at: float | None = None  # monotonic time of a scheduled restart
        self.start()

    def start(self) -> None:
        cpus, runner = self.cores.cpus, os.getpid()

        def setup() -> None:
            die_with_parent(runner)
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipelinerl_cli", "service", self.role, str(self.job_file)],
                env=service_environ(os.environ, self.env, self.role_env, self.cores.passive),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=setup,
                pass_fds=self.held,
            )

    def reap(self) -> None:
        """After the service exited: end whatever it left running in its process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to its process group, as Kubernetes stops a pod (a trainer checkpoints first)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float, terminated: bool = False) -> None:
        """Terminate it (unless `terminated` already), give it `timeout_s` to exit (a trainer's stop
        checkpoint may take its whole grace period, past which it ends itself), then kill whatever
        is left of its process group."""
        if not terminated:
            self.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.reap()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # in an uninterruptible wait (a driver, NFS): the others still stop
            with contextlib.suppress(OSError):  # the terminal gone
                print(f"  {self.name} did not end on SIGKILL within 10 s; left to the system", file=sys.stderr)


def tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


EXCEPTION_LINE = re.compile(r"(?:\[\w+\]:\s*)?((?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Exit|Timeout|Interrupt)\b.*)")
ERROR_LINE = re.compile(r"error: (.+)")  # the command line's own word for bad input (`pipelinerl_cli.main`)


def cause(log_tail: str) -> str | None:
    """The last exception a log shows ("TimeoutError: ..."; torch's "[rank0]: " prefix dropped),
    or the command line's "error: ..." (a job it cannot run), to name a failure first."""
    found = [
        m[1]
        for line in log_tail.splitlines()
        if (m := EXCEPTION_LINE.fullmatch(line.strip()) or ERROR_LINE.fullmatch(line.strip()))
    ]
    return found[-1] if found else None


class ServiceDied(RuntimeError):
    """A process the restart policy gave up on."""

    def __init__(self, name: str, code: int | None, log_path: Path, tail: str, service: bool = True):
        self.hopeless = service and code == CANNOT_RUN  # the job cannot run as written
        said = " (the job cannot run as written: a restart would fail the same way)" if self.hopeless else ""
        super().__init__(f"{name} exited with code {code}{said}")
        self.code, self.log_path, self.tail = code, log_path, tail
