"""Poll trainer rank 0's `/status` for progress; an unreachable trainer yields None, never an exception."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from pipelinerl.contracts import HTTP_PORT, TrainerStatus

DEFAULT_URL = f"http://{{host}}:{HTTP_PORT}/status"


def status_url(template: str, job: str, namespace: str, host: str) -> str:
    return template.format(job=job, namespace=namespace, host=host)


# A report is a few hundred bytes; the pod answering is the job author's code: read no more
# than this (a body of hundreds of MiB would otherwise sit in the operator's memory).
MAX_STATUS_BYTES = 64 * 1024


# The keys a `TrainerStatus` reads: others, a trainer of another release's (a job's own
# trainer.image, an upgrade rolling the operator and the pods apart), are left out, not refused:
# refused, the job's trainer read as unreachable and its finish was never seen.
KNOWN_KEYS = {f.alias or name for name, f in TrainerStatus.model_fields.items()} | set(TrainerStatus.model_fields)


def read_trainer_status(body: bytes) -> TrainerStatus:
    """The report in `body`, keys this build does not know left out; ValueError if it is not one."""
    data = json.loads(body)
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k in KNOWN_KEYS}
    return TrainerStatus.model_validate(data)


async def fetch_trainer_status(url: str, timeout_s: float = 3.0) -> TrainerStatus | None:
    """None also for a body that is not a `TrainerStatus` (`read_trainer_status`), or longer than
    MAX_STATUS_BYTES (a malformed report must not break reconciliation, nor fill the operator's
    memory), or a redirect: the job author's code answers, and followed, it would have the
    operator read another team's trainer (its report copied into this job's status) or any host
    the operator reaches."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_STATUS_BYTES:
                    return None
                body = await resp.content.read(MAX_STATUS_BYTES + 1)  # what has come, up to the cap
                while len(body) <= MAX_STATUS_BYTES and not resp.content.at_eof():
                    body += await resp.content.read(MAX_STATUS_BYTES + 1 - len(body))
                if len(body) > MAX_STATUS_BYTES:
                    return None
                return read_trainer_status(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):  # pydantic's error is a ValueError
        return None
