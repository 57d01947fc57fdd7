"""What every service process shares: its environment (set by the operator or the local
runner), the HTTP endpoints (/healthz, /readyz, /metrics, /status), logging, joining the job's
NATS, serving until stopped, shutdown."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import nats.errors
from pydantic import BaseModel

from pipelinerl.capacity import stream_bytes
from pipelinerl.contracts import DEFAULT_NATS_URL, Env, ServiceEnv
from pipelinerl.spec import PipelineRLJob
from pipelinerl.streams import connect, wait_for
from pipelinerl.store import ensure_streams

log = logging.getLogger("pipelinerl")
JOIN_TIMEOUT_S = 120.0  # a service's first connection and streams (join_job)
JOIN_RETRY_S = 1.0  # between join_job's tries at the streams, where a request went unanswered
# An asyncio service whose loop has not run for this long once it is ready is stuck (a call that
# blocks it, with no timeout): /healthz says so, and its pod's liveness probe restarts it.
LOOP_STALL_S = 120.0
LOOP_BEAT_S = 1.0
SERVER_STOP_S = 5.0  # the health server's wait for its last requests at exit
SERVER_START_S = 30.0  # the health server's wait to listen, at a service's start


class LoopBeat:
    """When the serving loop last ran (`serve` beats it; None where no loop is served, as in the
    trainer, whose steps may hold its thread for long)."""

    at: float | None = None

    @classmethod
    def stalled_s(cls, now: float) -> float:
        """Seconds the loop has been stalled beyond LOOP_STALL_S's allowance (0: it is running)."""
        return 0.0 if cls.at is None or now - cls.at < LOOP_STALL_S else now - cls.at


def service_env(role: str, job: PipelineRLJob, environ: Mapping[str, str] = os.environ) -> ServiceEnv:
    """This process's `ServiceEnv`; what its starter left unset falls back to the job's values."""
    defaults = ServiceEnv(
        role, nats_url=job.spec.nats.url or DEFAULT_NATS_URL, weights_addr=f"127.0.0.1:{job.spec.weight_sync.port}"
    )
    return ServiceEnv.from_environ(role, environ, defaults)


def memory_limit_bytes(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This container's memory limit: cgroup v2's `memory.max`, or v1's `memory.limit_in_bytes`;
    None where it has none (v2's "max", v1's page-rounded 2^63) or neither can be read."""
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 1 << 62 else None
    return None


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get(Env.LOG_LEVEL, "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
    for noisy in ("uvicorn.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class HealthServer:
    """FastAPI app with the four standard endpoints, served by uvicorn in a daemon thread
    (so it answers even while the service's own thread is busy in torch code)."""

    def __init__(self, role: str, port: int, status: Callable[[], BaseModel], host: str = "0.0.0.0"):
        from fastapi import FastAPI, Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self.ready = False
        self.healthy = True
        app = FastAPI(title=f"pipelinerl-{role}")

        @app.get("/healthz")
        def healthz() -> Response:
            # Watched once ready: before, a GPU generator's loop loads its model (minutes).
            stalled = LoopBeat.stalled_s(time.monotonic()) if self.ready else 0.0
            if stalled:
                return Response(f"event loop stalled for {stalled:.0f} s", status_code=503)
            return Response("ok" if self.healthy else "unhealthy", status_code=200 if self.healthy else 503)

        @app.get("/readyz")
        def readyz() -> Response:
            return Response("ready" if self.ready else "not ready", status_code=200 if self.ready else 503)

        @app.get("/metrics")
        def metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/status")
        def status_() -> dict[str, Any]:
            return status().model_dump(mode="json", by_alias=True)

        self.app, self.port, self.host = app, port, host

    def start(self) -> HealthServer:
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="http", daemon=True)
        thread.start()
        # Stopped at exit, before the interpreter tears its modules down: a daemon thread still
        # in uvicorn's loop then can crash the process (SIGSEGV), a clean exit read as a failure.
        atexit.register(_stop_server, server, thread)
        # Listening, or the service fails: uvicorn ends its thread where it cannot bind the port
        # (sys.exit there ends the thread alone), and the service would run on with no probes to
        # answer and no /status for its runner to read.
        deadline = time.monotonic() + SERVER_START_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server could not listen on {self.host}:{self.port} (the port in use?)")
            time.sleep(0.01)
        return self


def _stop_server(server, thread: threading.Thread) -> None:
    server.should_exit = True  # its loop looks every 0.1 s; requests in flight are answered
    thread.join(SERVER_STOP_S)


async def join_job(job: PipelineRLJob, env: ServiceEnv, client: str) -> Any:
    """This service's NATS connection (as `client`), the job's streams made sure of (created or
    updated in place, at the sizes the job reserves); TimeoutError after JOIN_TIMEOUT_S (a server
    that accepts the connection and never answers is waited on far longer than a refused one).
    A server whose max_payload is below the job's `nats.maxPayloadMb` is refused at once: it would
    refuse the job's largest messages at every retry, whenever one came."""

    async def join() -> Any:
        nc = await connect(env.nats_url, client, env.nats_user, env.nats_password)
        sizes, payload_mb = stream_bytes(job.spec), job.spec.nats.max_payload_mb
        if nc.max_payload < payload_mb << 20:
            await nc.close()
            raise ValueError(
                f"nats.maxPayloadMb ({payload_mb}) is over the max_payload of the job's NATS at {env.nats_url} "
                f"({nc.max_payload / 2**20:g} MiB): lower the job's, or raise the server's max_payload (the chart's "
                "nats.maxPayloadMb, where the chart runs it)"
            )
        while True:
            try:
                await ensure_streams(nc.jetstream(), job.subjects, payload_mb, env.stream_replicas, sizes)
                return nc
            except nats.errors.TimeoutError:  # one request unanswered in its 5 s: a loaded server
                log.warning("the job's NATS did not answer a stream request in time; asking again")
                await asyncio.sleep(JOIN_RETRY_S)

    return await wait_for(join(), JOIN_TIMEOUT_S, f"the job's NATS at {env.nats_url}")


FAILED_EXIT_S = 30.0  # a failed service's wind-down, at most, before the process exits anyway


def serve(run: Callable[[], Awaitable[None]], stop: Callable[[], None], failed_exit_s: float = FAILED_EXIT_S) -> int:
    """Runs an asyncio service to its end; SIGTERM or SIGINT calls `stop` (the service winds
    down) and exits anyway if that stalls (`exit_soon`). A service that fails exits with 1 within
    `failed_exit_s` whatever it leaves running: asyncio.run's teardown joins the default
    executor's threads without a bound, and one stuck there (a task's reward function waiting on
    a remote call with no timeout of its own) would keep a failed pod alive and healthy."""

    def stopped() -> None:
        stop()
        exit_soon()

    async def beat() -> None:
        while True:
            LoopBeat.at = time.monotonic()
            await asyncio.sleep(LOOP_BEAT_S)

    async def _main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopped)
        beating = asyncio.create_task(beat())
        try:
            await run()
        except BaseException as err:
            log.error("service failed: %r; exiting within %.0f s", err, failed_exit_s)
            ExitCode.failed = True  # a SIGTERM's timer, if it fires first, exits with 1 too
            trace = "".join(traceback.format_exception(err))
            exit_soon(failed_exit_s, code=1, why=f"the wind-down did not end; the failure:\n{trace}")
            raise
        finally:
            beating.cancel()
            LoopBeat.at = None  # a finished service stays up, not stuck (stay_up_until_stopped)

    asyncio.run(_main())
    return 0


def failpoint(name: str) -> None:
    """A kill -9 at exactly this point, for the fault tests: with `PIPELINERL_FAILPOINT` set to
    `name`, the process sends itself SIGKILL here (nothing runs after it, as in a real kill);
    otherwise nothing."""
    if os.environ.get(Env.FAILPOINT) == name:
        log.warning("failure point %s: killing this process", name)
        os.kill(os.getpid(), signal.SIGKILL)


class ExitCode:
    """Whether the service has failed: then a forced exit leaves with 1 whichever timer fires,
    a SIGTERM's included (a failure in its wind-down is still a failure)."""

    failed = False


LEAVING = threading.Event()  # a stop (or a failure) is under way: `exit_soon` armed


def exit_soon(seconds: float = 20.0, code: int = 0, why: str = "") -> None:
    """Called on SIGTERM (or a failure, `code` 1): if the shutdown stalls (e.g. NATS is already
    gone, a thread no one can stop), exit anyway, saying `why` (a failure's traceback, which the
    stalled shutdown would never print)."""

    def leave() -> None:
        exit_code = 1 if ExitCode.failed else code
        if why:
            log.error("exiting with %d: %s", exit_code, why)
        os._exit(exit_code)

    LEAVING.set()
    timer = threading.Timer(seconds, leave)
    timer.daemon = True
    timer.start()


def stay_up_until_stopped(role: str) -> None:
    """In a StatefulSet an exited pod is restarted: a finished service stays up (serving /status
    with finished: true) until it is stopped."""
    log.info("%s finished; staying up until stopped", role)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if LEAVING.is_set():  # told to stop already, as it finished (its SIGTERM's timer would end it)
        return
    stop.wait()
