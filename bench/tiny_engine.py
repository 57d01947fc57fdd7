"""The generator's own vLLM engine on a built-in tiny model, and a round of requests that each
decode exactly a given number of tokens: what benchmark 12's curve and its engines side by side
time."""

from __future__ import annotations

import asyncio
import time
import uuid


async def decode_round(engine, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for every prompt to decode exactly `tokens` tokens, all submitted at once."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=1.0,
        max_tokens=tokens,
        min_tokens=tokens,
        output_kind=RequestOutputKind.FINAL_ONLY,
        stop_token_ids=[engine.eos],
    )

    async def one(prompt: list[int]) -> None:
        async for _ in engine.llm.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0


async def tiny_engine(path: str):
    """The generator's own `Engine` on the model at `path`, started (version 0)."""
    from pipelinerl.spec import parse_job
    from pipelinerl_generator.engine import Engine

    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "curve"},
            "spec": {"model": {"path": path, "maxSeqLen": 256, "dtype": "float32"}},
        }
    )
    engine = Engine(job, path)
    await engine.start(0)
    return engine
