"""Poll trainer rank 0's `/status` for progress; an unreachable trainer yields None, never an exception."""

from __future__ import annotations

import asyncio
import aiohttp

from pipelinerl.contracts import HTTP_PORT, TrainerStatus

DEFAULT_URL = f"http://{{host}}:{HTTP_PORT}/status"


def status_url(template: str, job: str, namespace: str, host: str) -> str:
    return template.format(job=job, namespace=namespace, host=host)


# A report is a few hundred bytes; the pod answering is the job author's code: read no more
# than this (a body of hundreds of MiB would otherwise sit in the operator's memory).
MAX_STATUS_BYTES = 64 * 1024


async def fetch_trainer_status(url: str, timeout_s: float = 3.0) -> TrainerStatus | None:
    """None also for a body that is not a `TrainerStatus`, or longer than MAX_STATUS_BYTES (a
    malformed report must not break reconciliation, nor fill the operator's memory)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_STATUS_BYTES:
                    return None
                body = await resp.content.read(MAX_STATUS_BYTES + 1)  # what has come, up to the cap
                while len(body) <= MAX_STATUS_BYTES and not resp.content.at_eof():
                    body += await resp.content.read(MAX_STATUS_BYTES + 1 - len(body))
                if len(body) > MAX_STATUS_BYTES:
                    return None
                return TrainerStatus.model_validate_json(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):  # pydantic's error is a ValueError
        return None
