"""Delete a job's NATS JetStream streams when the job is deleted (the operator's only finalizer work).

Bounded: if NATS is unreachable the cleanup gives up after `timeout_s`, the job is deleted anyway
and the failure is reported (the streams are then left behind on the server).
"""

from __future__ import annotations

import asyncio

from pipelinerl.contracts import JobSubjects
from pipelinerl.streams import connect, delete_streams


async def _delete(
    url: str, subjects: JobSubjects, user: str | None, password: str | None, connect_timeout_s: float
) -> list[str]:
    nc = await connect(url, "pipelinerl-operator-cleanup", user, password, reconnect=False, timeout_s=connect_timeout_s)
    try:
        return await delete_streams(nc.jetstream(timeout=connect_timeout_s), subjects)
    finally:
        await nc.close()


async def delete_job_streams(
    url: str,
    job_name: str,
    namespace: str,
    user: str | None = None,
    password: str | None = None,
    timeout_s: float = 10.0,
) -> list[str]:
    """Names of the deleted streams (as the job's NATS user, where it has one); raises on
    failure (TimeoutError, connection errors)."""
    subjects = JobSubjects(job_name, namespace)
    return await asyncio.wait_for(_delete(url, subjects, user, password, min(3.0, timeout_s)), timeout_s)
