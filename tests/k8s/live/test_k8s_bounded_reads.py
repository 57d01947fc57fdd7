"""What the operator reads from job pods and webhook callers is bounded: a trainer's `/status`
(the job author's code answers it) and an admission review (anyone reaching the port sends it)."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
from aiohttp import web

from pipelinerl_operator.progress import MAX_STATUS_BYTES, fetch_trainer_status

REPORT = {"step": 3, "version": 3, "finished": False, "weightSyncReady": True}


async def serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/status", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/status"  # type: ignore[union-attr]


async def test_a_trainer_status_body_is_read_up_to_a_cap_only() -> None:
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        """A body without end, chunked (no Content-Length to refuse it by): what it managed to send."""
        nonlocal sent
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"[" + b"0," * 32767
        try:
            while sent < 400 << 20:
                await resp.write(chunk)
                sent += len(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return resp

    async def padded(request: web.Request) -> web.Response:  # valid JSON, one byte too long
        body = json.dumps(REPORT).encode()
        return web.Response(body=body + b" " * (MAX_STATUS_BYTES + 1 - len(body)), content_type="application/json")

    async def plain(request: web.Request) -> web.Response:
        return web.json_response(REPORT)

    async def hop(request: web.Request) -> web.Response:
        """A redirect to a report (another team's trainer, say; here its own, which answers): not followed."""
        if request.query.get("hop"):
            return await plain(request)
        raise web.HTTPFound(str(request.url.with_query(hop=1)))

    for handler, expected in ((plain, 3), (padded, None), (endless, None), (hop, None)):
        runner, url = await serve(handler)
        try:
            status = await fetch_trainer_status(url, timeout_s=10)
            assert (status.step if status else None) == expected, handler.__name__
        finally:
            await runner.cleanup()
    assert sent < 8 << 20, f"the operator let the pod send {sent} bytes"  # it stopped reading at the cap


async def test_the_webhook_refuses_an_oversized_review_before_reading_it(cluster) -> None:
    """Bodies beyond what a review of the largest job admitted can be are refused with 413, unread."""
    from operator_harness import running_operator

    from pipelinerl_operator.handlers import MAX_REVIEW_BYTES

    emulator, _, _ = cluster
    url = f"http://127.0.0.1:{os.environ['PIPELINERL_WEBHOOK_PORT']}/validate-job"
    async with running_operator(str(emulator.url)):
        async with aiohttp.ClientSession() as session:
            for _ in range(50):  # kopf opens the server once it has discovered the resources
                try:
                    async with session.post(
                        url, data=b"{" + b" " * MAX_REVIEW_BYTES + b"}", timeout=aiohttp.ClientTimeout(total=10)
                    ) as resp:
                        assert resp.status == 413
                        break
                except aiohttp.ClientConnectorError:
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"no webhook server at {url}")
