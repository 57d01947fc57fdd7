"""The small jobs the end-to-end tests run (a random tiny model: machinery, not learning), and
what a finished run left in its streams."""

from __future__ import annotations

import asyncio
from pathlib import Path


def tiny_job(name: str, **spec) -> dict:
    base = {
        "model": {"path": "builtin:tiny-random", "maxSeqLen": 40},
        "task": {"name": "arith"},
        "rl": {"attempts": 4, "filterZeroVariance": False},
        "generator": {"sampling": {"maxTokens": 24}},
        "trainer": {"samplesPerStep": 16, "microBatchTokens": 256, "maxSteps": 5, "checkpointInterval": 0},
        "eval": {"interval": 2, "problems": 16},
    }
    for key, value in spec.items():
        base[key] = base.get(key, {}) | value if isinstance(value, dict) else value
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": name},
            "spec": base}


def stored(run_dir: Path, job_name: str, suffix: str) -> list:
    """Every message left in one of a finished run's streams (its nats-server started again on
    the run's store): nats messages, with .data and .headers."""
    from pipelinerl.contracts import JobSubjects
    from pipelinerl.embedded_nats import EmbeddedNats
    from pipelinerl.streams import connect

    async def read() -> list:
        server = EmbeddedNats(run_dir / "nats").start()
        try:
            nc = await connect(server.url, "test")
            js = nc.jetstream()
            stream = JobSubjects(job_name).stream(suffix)
            state = (await js.stream_info(stream)).state
            out = [await js.get_msg(stream, seq) for seq in range(state.first_seq, state.last_seq + 1)] \
                if state.messages else []
            await nc.close()
            return out
        finally:
            server.stop()

    return asyncio.run(read())
