"""Delete a job's NATS JetStream streams when the job is deleted (the operator's only finalizer work).

Bounded: if NATS is unreachable the cleanup gives up after `timeout_s` and the job is deleted anyway
(the streams carry `max_age` limits set by the services, so leftovers expire).
"""

from __future__ import annotations

import asyncio

import nats
from nats.js.errors import NotFoundError


SUFFIXES = ("ROLLOUTS", "BATCHES", "CONTROL", "METRICS")


def stream_prefix(job_name: str) -> str:
    """Streams are named PRL_<JOB_NAME_UPPER_WITH_UNDERSCORES>_<SUFFIX> (ROLLOUTS, BATCHES, CONTROL, METRICS)."""
    return f"PRL_{job_name.upper().replace('-', '_')}_"


def is_job_stream(stream: str, prefix: str) -> bool:
    # The suffix must match exactly: job "demo"'s prefix PRL_DEMO_ also starts job "demo-2"'s streams.
    return stream.startswith(prefix) and stream[len(prefix):] in SUFFIXES


async def _delete(url: str, prefix: str, connect_timeout_s: float) -> list[str]:
    nc = await nats.connect(
        url, connect_timeout=connect_timeout_s, allow_reconnect=False, max_reconnect_attempts=0,
    )
    try:
        js = nc.jetstream(timeout=connect_timeout_s)
        deleted = []
        for info in await js.streams_info():
            name = info.config.name
            if name and is_job_stream(name, prefix):
                try:
                    await js.delete_stream(name)
                    deleted.append(name)
                except NotFoundError:
                    pass  # deleted concurrently: fine
        return deleted
    finally:
        await nc.close()


async def delete_job_streams(url: str, job_name: str, timeout_s: float = 10.0) -> list[str]:
    """Names of the deleted streams; raises on failure (TimeoutError, connection errors)."""
    return await asyncio.wait_for(_delete(url, stream_prefix(job_name), min(3.0, timeout_s)), timeout_s)
