"""What every service process shares: its environment (set by the operator or the local
runner), the HTTP endpoints (/healthz, /readyz, /metrics, /status), logging and dispatch."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipelinerl.spec import PipelineRLJob

log = logging.getLogger("pipelinerl")


@dataclass(frozen=True)
class ServiceEnv:
    role: str
    rank: int
    world_size: int
    nats_url: str
    weights_host: str
    weights_port: int
    run_dir: Path
    http_port: int
    generators: int  # generator engines in the weight group (ranks 1..generators)
    local_rank: int = 0  # the GPU of a multi-GPU trainer pod this rank runs on (pipelinerl.pod_ranks)

    @classmethod
    def from_environ(cls, role: str, job: PipelineRLJob) -> ServiceEnv:
        e = os.environ
        host, _, port = e.get("PIPELINERL_WEIGHTS_ADDR", f"127.0.0.1:{job.spec.weight_sync.port}").rpartition(":")
        return cls(
            role=role,
            rank=int(e.get("PIPELINERL_RANK", "0")),
            world_size=int(e.get("PIPELINERL_WORLD_SIZE", "1")),
            local_rank=int(e.get("PIPELINERL_LOCAL_RANK", "0")),
            nats_url=e.get("PIPELINERL_NATS_URL", job.spec.nats.url or "nats://127.0.0.1:4222"),
            weights_host=host or "127.0.0.1",
            weights_port=int(port),
            run_dir=Path(e.get("PIPELINERL_RUN_DIR", "runs") ),
            http_port=int(e.get("PIPELINERL_HTTP_PORT", "8000")),
            generators=int(e.get("PIPELINERL_GENERATORS", str(job.spec.generator.replicas))),
        )


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("PIPELINERL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class HealthServer:
    """FastAPI app with the four standard endpoints, served by uvicorn in a daemon thread
    (so it answers even while the service's own thread is busy in torch code)."""

    def __init__(self, role: str, port: int, status: Callable[[], dict[str, Any]]):
        from fastapi import FastAPI, Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.ready = False
        self.healthy = True
        app = FastAPI(title=f"pipelinerl-{role}")

        @app.get("/healthz")
        def healthz() -> Response:
            return Response("ok" if self.healthy else "unhealthy", status_code=200 if self.healthy else 503)

        @app.get("/readyz")
        def readyz() -> Response:
            return Response("ready" if self.ready else "not ready", status_code=200 if self.ready else 503)

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/status")
        def status_() -> dict[str, Any]:
            return status()

        self.app, self.port = app, port

    def start(self) -> HealthServer:
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(self.app, host="0.0.0.0", port=self.port, log_level="warning"))
        threading.Thread(target=server.run, name="http", daemon=True).start()
        return self


def exit_soon(seconds: float = 20.0) -> None:
    """Called on SIGTERM: if the clean shutdown stalls (e.g. NATS is already gone), exit anyway."""
    timer = threading.Timer(seconds, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


def die_with_parent() -> None:
    """preexec_fn for child services: SIGTERM when the parent (the local runner) dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_service(role: str, job: PipelineRLJob) -> int:
    env = ServiceEnv.from_environ(role, job)
    setup_logging(f"{role}-{env.rank}")
    if role == "generator":
        from pipelinerl_generator.main import main
    elif role == "preprocessor":
        from pipelinerl_preprocessor.main import main
    elif role == "trainer":
        from pipelinerl_trainer.main import main
    else:
        raise ValueError(f"unknown role {role!r}")
    code = main(job, env)
    if code == 0 and os.environ.get("PIPELINERL_EXIT_WHEN_DONE") != "1":
        # In a StatefulSet an exited pod is restarted: a finished service stays up (serving
        # /status with finished: true) until it is stopped. The local runner sets EXIT_WHEN_DONE.
        log.info("%s finished; staying up until stopped", role)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        stop.wait()
    return code
