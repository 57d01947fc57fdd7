"""Delete a job's NATS JetStream streams when the job is deleted (the operator's only finalizer work).

Bounded: if NATS is unreachable the cleanup gives up after `timeout_s`, the job is deleted anyway
and the failure is reported (the streams are then left behind on the server).
"""

from __future__ import annotations

import asyncio

import nats

from pipelinerl.contracts import JobSubjects
from pipelinerl.streams import delete_streams


async def _delete(url: str, job_name: str, connect_timeout_s: float) -> list[str]:
    nc = await nats.connect(url, connect_timeout=connect_timeout_s, allow_reconnect=False, max_reconnect_attempts=0)
    try:
        return await delete_streams(nc.jetstream(timeout=connect_timeout_s), JobSubjects(job_name))
    finally:
        await nc.close()


async def delete_job_streams(url: str, job_name: str, timeout_s: float = 10.0) -> list[str]:
    """Names of the deleted streams; raises on failure (TimeoutError, connection errors)."""
    return await asyncio.wait_for(_delete(url, job_name, min(3.0, timeout_s)), timeout_s)
