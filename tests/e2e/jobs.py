"""The small jobs the end-to-end tests run (a random tiny model: machinery, not learning), and
what a finished run left in its streams."""

from __future__ import annotations

import asyncio
from pathlib import Path

# A bound on one run of these jobs, against a hang, not a measure of speed: on a 2-core machine
# whose cores ran Python 2.5x slower than the one before it (2026-12-04), runs that took ~200 s
# there went past 420 s.
RUN_TIMEOUT_S = 900


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
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": name}, "spec": base}


def stored(run_dir: Path, job_name: str, suffix: str) -> list:
    """Every message left in one of a finished run's streams (its nats-server started again on
    the run's store)."""
    from pipelinerl.contracts import JobSubjects
    from pipelinerl_cli.embedded_nats import EmbeddedNats
    from pipelinerl.streams import connect, stored_messages

    async def read() -> list:
        nc = await connect(server.url, "test")
        try:
            return await stored_messages(nc.jetstream(), JobSubjects(job_name).stream(suffix))
        finally:
            await nc.close()

    server = EmbeddedNats(run_dir / "nats").start()
    try:
        return asyncio.run(read())
    finally:
        server.stop()
