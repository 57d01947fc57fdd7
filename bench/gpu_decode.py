"""The decode curve on a GPU (the GPU check's `decode-curve` part): one decode step's seconds
against the running batch and the context, for randomly initialised Qwen2.5-1.5B and -7B shapes
(their config.json; nothing downloaded), in bf16, with a static KV cache and the step replayed
as a CUDA graph, as a serving engine runs it. Torch and transformers only.

    python -m bench.gpu_decode [--models 1.5B,7B] [--batches 1,8,32,128,512] [--contexts 1024,4096]
    python -m bench.gpu_decode --smoke        # CPU, tiny shapes, eager: checks the script only

Each point: the cache holds `context` positions (their values do not change the cost: the static
cache attends over its whole length, masked), one step of `batch` sequences is captured once and
replayed; the median of the replays' times. A point whose KV cache does not fit in the memory
left after the weights is recorded as skipped, with the bytes it needed: the running batch is
bounded by KV memory. Written to `gpu_decode.json` with the points the planner's decode curve is
fitted from (`pipelinerl.planner.bound.fit_curve`: base + per sequence + per context token).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from bench.common import gpu_or_smoke, machine, save
from bench.gpu_shapes import SIZES

NAME = re.compile(r"[A-Za-z0-9._-]+")
# Qwen2.5-1.5B (the shape of Qwen2-1.5B) and Qwen2.5-7B (its config.json); "smoke": a CPU-sized check.
MODELS: dict[str, dict] = {
    "1.5B": SIZES["1.5B"],
    "7B": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152_064,
    ),
    "smoke": SIZES["smoke"],
}  # fmt: skip
REPLAYS = 20


def kv_bytes(arch: dict, batch: int, positions: int, dtype_bytes: int = 2) -> int:
    """The static KV cache of `batch` sequences of `positions`: keys and values, every layer."""
    head_dim = arch["hidden_size"] // arch["num_attention_heads"]
    return 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * batch * positions * dtype_bytes


def static_cache(config, batch: int, length: int, device, dtype):
    from transformers import StaticCache

    try:  # transformers >= 5: the batch is taken from the first update
        return StaticCache(config=config, max_cache_len=length)
    except TypeError:  # 4.x
        return StaticCache(config=config, max_batch_size=batch, max_cache_len=length, device=device, dtype=dtype)


def step_seconds(model, batch: int, context: int, graphs: bool) -> float:
    """The median seconds of one decode step of `batch` sequences at `context` positions."""
    device, dtype = model.device, model.dtype
    cache = static_cache(model.config, batch, context + 8, device, dtype)  # a few spare positions
    ids = torch.randint(3, model.config.vocab_size, (batch, 1), device=device)
    position = torch.tensor([context], device=device)

    def step() -> None:
        model(input_ids=ids, past_key_values=cache, cache_position=position, use_cache=True)

    with torch.inference_mode():
        step()  # allocates the cache; warms the kernels
        run = step
        if graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        times = []
        for _ in range(REPLAYS):
            if graphs:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if graphs:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, batches: list[int], contexts: list[int], on_gpu: bool) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = MODELS[name]
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = Qwen2Config(tie_word_embeddings=False, max_position_embeddings=max(contexts) + 8, **arch)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    points = []
    for context in contexts:
        for batch in batches:
            need = kv_bytes(arch, batch, context + 1, 2 if on_gpu else 4)
            free = torch.cuda.mem_get_info()[0] if on_gpu else None
            if free is not None and need > 0.9 * free:
                points.append({"batch": batch, "context": context, "skipped": f"KV cache {need / 1e9:.1f} GB"})
                print(f"  {name} batch {batch} context {context}: skipped (KV {need / 1e9:.1f} GB)", flush=True)
                continue
            try:
                seconds = step_seconds(model, batch, context, graphs=on_gpu)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                points.append({"batch": batch, "context": context, "skipped": "out of memory"})
                continue
            points.append({"batch": batch, "context": context, "step_s": seconds})
            print(f"  {name} batch {batch:4d} context {context:5d}: {1000 * seconds:.2f} ms per step", flush=True)
            if on_gpu:
                torch.cuda.empty_cache()
    del model
    return {"weights_bytes": weights, "dtype": str(dtype), "cuda_graphs": on_gpu, "points": points}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1.5B,7B")
    ap.add_argument("--batches", default="1,8,32,128,512")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager")
    ap.add_argument("--name", default="gpu_decode", type=lambda s: s if NAME.fullmatch(s) else ap.error(s))
    ap.add_argument("--results-dir", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.batches, args.contexts = "smoke", "1,4", "16,32"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu, folder = gpu_or_smoke(args, "gpu_decode")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {"device": str(machine()["device"]), "replays": REPLAYS, "models": {}}
    for name in args.models.split(","):
        result["models"][name] = measure(name, batches, contexts, on_gpu)
        if folder is not None:  # after every model: a run cut short keeps what it measured
            save(args.name, result, "python -m bench.gpu_decode " + " ".join(argv or []), folder)


if __name__ == "__main__":
    main()
