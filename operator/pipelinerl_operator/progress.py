"""Poll trainer rank 0's `/status` for progress; an unreachable trainer yields None, never an exception."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

DEFAULT_URL = "http://{host}:8000/status"


def status_url(template: str, job: str, namespace: str, host: str) -> str:
    return template.format(job=job, namespace=namespace, host=host)


async def fetch_trainer_status(url: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
                return body if isinstance(body, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return None
