"""Poll trainer rank 0's `/status` for progress; an unreachable trainer yields None, never an exception."""

from __future__ import annotations

import asyncio
import aiohttp

from pipelinerl.contracts import HTTP_PORT, TrainerStatus

DEFAULT_URL = f"http://{{host}}:{HTTP_PORT}/status"


def status_url(template: str, job: str, namespace: str, host: str) -> str:
    return template.format(job=job, namespace=namespace, host=host)


async def fetch_trainer_status(url: str, timeout_s: float = 3.0) -> TrainerStatus | None:
    """None also for a body that is not a `TrainerStatus` (a malformed report must not break
    reconciliation)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    return None
                return TrainerStatus.model_validate(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):  # pydantic's error is a ValueError
        return None
