"""Generation throughput: vLLM as the generator service runs it vs Hugging Face `generate`.

Same model, same requests: 64 arith prompts x 4 samples, temperature 1, 64 new tokens each
(eos is masked until then on both sides: vLLM `min_tokens`, HF `min_new_tokens`), sampled-token
logprobs returned by both. vLLM is the AsyncLLM built by the project's `Engine` wrapper (same
engine arguments as the service: V1, eager, prefix caching, single-process worker on CPU), fed one
request per sample like `Engine.generate` (only `min_tokens` added, so lengths are equal). HF runs
all 256 sequences as one batch (`num_return_sequences=4`) with its KV cache. Sides alternate.

    python -m bench.engine                      # tiny-arith and a random 30M model
    python -m bench.engine --models tiny-arith --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

# Before torch loads OpenMP: on a shared machine, spin-waiting OpenMP threads (the default) slow
# small-model work ~15x whenever other processes hold the cores; passive waiting keeps the figures
# meaningful under contention. Set OMP_WAIT_POLICY=ACTIVE to measure the default on a quiet machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

PROMPTS, SAMPLES, MAX_TOKENS, TEMPERATURE = 64, 4, 64, 1.0
MODELS = ("tiny-arith", "30M")
VLLM_KIND = "vllm AsyncLLM (V1) via pipelinerl_generator.engine.Engine, one request per sample"


def prompts(tokenizer) -> list[list[int]]:
    from pipelinerl.tasks.arith import ArithTask

    return [tokenizer.encode(p.prompt) for p in ArithTask(digits=3, seed=0).test_problems(PROMPTS)]


async def vllm_round(engine, batch: list[list[int]]) -> int:
    """All requests at once, as the generator's admission loop would submit them; tokens made."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Engine.generate's parameters, plus min_tokens so every sample has MAX_TOKENS tokens.
    params = SamplingParams(
        temperature=TEMPERATURE,
        top_p=1.0,
        max_tokens=MAX_TOKENS,
        min_tokens=MAX_TOKENS,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        stop_token_ids=[engine.eos],
    )

    async def one(prompt: list[int]) -> int:
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
            final = out
        c = final.outputs[0]
        assert len(c.token_ids) == len(c.logprobs) == MAX_TOKENS
        return len(c.token_ids)

    return sum(await asyncio.gather(*(one(p) for p in batch for _ in range(SAMPLES))))


@torch.no_grad()
def hf_round(model, batch: list[list[int]], eos: int) -> int:
    width = max(map(len, batch))  # left-pad (arith prompts share one length, so usually a no-op)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        num_return_sequences=SAMPLES,
        pad_token_id=0,
        eos_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, width:]
    logprobs = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new[..., None])  # as vLLM returns
    assert new.shape == (len(batch) * SAMPLES, MAX_TOKENS) and logprobs.isfinite().all()
    return new.numel()


def model_path(name: str, tmp: Path) -> str:
    from bench.models import save_model
    from pipelinerl.tiny_model import resolve_model_path

    if name == "tiny-arith":
        return resolve_model_path("builtin:tiny-arith")
    return save_model(tmp / name, name)[0]


def run_model(name: str, repeats: int, tmp: Path) -> dict:
    from bench.common import paired_ratios, summary

    path = model_path(name, tmp)
    params, prompt_len, runs = asyncio.run(measure(path, repeats))
    return {
        "path": path,
        "parameters": params,
        "prompt_tokens": prompt_len,
        "tokens_per_round": PROMPTS * SAMPLES * MAX_TOKENS,
        "vllm_tokens_per_s": runs["vllm"],
        "hf_tokens_per_s": runs["hf"],
        "vllm": summary(runs["vllm"]),
        "hf": summary(runs["hf"]),
        "vllm_over_hf": paired_ratios(runs["vllm"], runs["hf"]),
    }


async def measure(path: str, repeats: int) -> tuple[int, int, dict[str, list[float]]]:
    from transformers import Qwen2ForCausalLM

    from bench.common import alternate
    from pipelinerl.spec import parse_job
    from pipelinerl_generator.engine import Engine

    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "bench"},
            "spec": {
                "model": {"path": path, "maxSeqLen": 128, "dtype": "float32"},
                "generator": {"sampling": {"maxTokens": MAX_TOKENS, "temperature": TEMPERATURE}},
            },
        }
    )
    engine = Engine(job, path)
    try:
        await engine.start(0)
        hf = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        batch = prompts(engine.llm.tokenizer)
        loop = asyncio.get_running_loop()

        def rate(fn):
            def measure_once():
                t0 = time.perf_counter()
                tokens = fn()
                return tokens / (time.perf_counter() - t0)

            return measure_once

        # The harness is synchronous: it runs in a thread while this loop (idle during the HF
        # side) serves the engine; vLLM rounds are handed to the loop and awaited from there.
        sides = {
            "vllm": rate(lambda: asyncio.run_coroutine_threadsafe(vllm_round(engine, batch), loop).result()),
            "hf": rate(lambda: hf_round(hf, batch, engine.eos)),
        }
        runs = await asyncio.to_thread(alternate, sides, repeats)
    finally:
        engine.shutdown()
    return sum(p.numel() for p in hf.parameters()), len(batch[0]), runs


def main() -> None:
    from bench.common import save, table
    from bench.models import project_caches

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    project_caches()
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for name in args.models:
            r = results[name] = run_model(name, args.repeats, Path(tmp))
            k = lambda s: f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"  # noqa: E731
            q = r["vllm_over_hf"]
            rows.append(
                [
                    name,
                    f"{r['parameters'] / 1e6:.1f}M",
                    k(r["vllm"]),
                    k(r["hf"]),
                    f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})",
                ]
            )
    print(
        f"\nGeneration throughput, {PROMPTS} prompts x {SAMPLES} samples x {MAX_TOKENS} tokens, temperature "
        f"{TEMPERATURE}; tokens/s median (min-max) over {args.repeats} alternated rounds\nvLLM side: {VLLM_KIND}"
    )
    print(table(["model", "params", "vLLM tok/s", "HF tok/s", "vLLM/HF"], rows))
    path = save(
        "engine",
        {
            "settings": {
                "prompts": PROMPTS,
                "samples": SAMPLES,
                "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE,
                "repeats": args.repeats,
                "vllm": VLLM_KIND,
                "hf": "transformers generate, one batch, num_return_sequences, KV cache",
            },
            "models": results,
        },
        command=f"python -m bench.engine {' '.join(sys.argv[1:])}".strip(),
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
