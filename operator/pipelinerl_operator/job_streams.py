"""The operator's calls on a job's NATS streams (as the job's own NATS user, where it has one):
delete them (a deleted or finished job's, a suspended one's once its pods are gone), read the
trainer's newest checkpoint record first (what a suspended job resumes from), and make a resumed
job's new store go on from it (`streams.recover_store`).

Bounded: each gives up after `timeout_s` and raises; the caller reports it and tries again at its
next pass (or, for a deleted job, lets it go: the streams are then left behind on the server).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pipelinerl.contracts import JobSubjects
from pipelinerl.streams import connect, delete_streams, last_checkpoint, recover_store

T = TypeVar("T")


async def _as_job(
    url: str, user: str | None, password: str | None, timeout_s: float, call: Callable[[Any], Awaitable[T]]
) -> T:
    async def run() -> T:
        nc = await connect(url, "pipelinerl-operator", user, password, reconnect=False, timeout_s=min(3.0, timeout_s))
        try:
            return await call(nc.jetstream(timeout=min(3.0, timeout_s)))
        finally:
            await nc.close()

    return await asyncio.wait_for(run(), timeout_s)


async def delete_job_streams(
    url: str,
    job_name: str,
    namespace: str,
    user: str | None = None,
    password: str | None = None,
    timeout_s: float = 10.0,
) -> list[str]:
    """Names of the deleted streams; raises on failure (TimeoutError, connection errors)."""
    subjects = JobSubjects(job_name, namespace)
    return await _as_job(url, user, password, timeout_s, lambda js: delete_streams(js, subjects))


async def read_checkpoint(
    url: str, job_name: str, namespace: str, user: str | None, password: str | None, timeout_s: float = 10.0
) -> dict[str, Any] | None:
    """The trainer's newest checkpoint record, as status.suspendedStore keeps it (None: none yet)."""
    subjects = JobSubjects(job_name, namespace)
    told = await _as_job(url, user, password, timeout_s, lambda js: last_checkpoint(js, subjects, timeout_s))
    return {"store": told.store, "step": told.step, "problems": told.problems} if told is not None else None


async def restore_store(
    url: str, job: Any, user: str | None, password: str | None, record: dict[str, Any], replicas: int | None,
    timeout_s: float = 10.0,
) -> None:  # fmt: skip
    """The resumed job's streams made again, going on from its trainer's checkpoint `record`."""
    subjects = JobSubjects(job.name, job.namespace or "default")

    async def restore(js: Any) -> None:
        await recover_store(js, subjects, job.spec, record["store"], record["step"], record["problems"], replicas)

    await _as_job(url, user, password, timeout_s, restore)
