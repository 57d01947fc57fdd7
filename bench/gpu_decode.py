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

Two attentions, side by side (`--attentions`): `sdpa`, transformers' own, which on CUDA with a
mask (a static cache always has one) copies each KV head once per query head sharing it
(`repeat_kv`) and falls back from the flash kernel, so its context cost is far above what a
serving engine's decode kernel reads; and `grouped` (`grouped_attention` below), each KV head's
cache read once by a matmul for all the query heads that share it, as vLLM's paged decode
kernels do. Before timing, the two are checked to agree on one step (`agree` in the JSON).
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
ATTENTIONS = ("sdpa", "grouped")


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with grouped KV heads without copying them: query head h uses KV head h // g (as
    transformers' `repeat_kv` has it), so the g query heads of a KV head are its rows of one
    matmul over the cache. `attention_mask`: sdpa's (True attends) or an additive one, either
    (batch, 1, q, kv); None: causal over several queries (as sdpa's `is_causal`), else every
    position. Returns (batch, q, heads, dim), None."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * q_len, dim)  # row i: query head i // q_len of the group
    scores = torch.matmul(rows, key.transpose(-1, -2)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is None and q_len > 1 and getattr(module, "is_causal", True):  # sdpa's is_causal
        keys = key.shape[2]
        attention_mask = torch.ones(q_len, keys, dtype=torch.bool, device=query.device).tril(keys - q_len)
        attention_mask = attention_mask.expand(batch, 1, -1, -1)
    if attention_mask is not None:
        mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, 1, group * q_len, -1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def register_grouped() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("grouped", grouped_attention)
    AttentionMaskInterface.register("grouped", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # the same mask as sdpa's


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


def use(model, attention: str) -> None:
    """Switch `model` (and its masks) to one of ATTENTIONS."""
    if attention == "grouped":
        register_grouped()
    model.set_attn_implementation(attention)


def agreement(model, batch: int = 2, prompt: int = 64) -> float:
    """How far the grouped attention's logits are from sdpa's, relative to their size (0:
    identical): a prompt's prefill (causal) and the next token's decode step over its cache."""
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + 1), device=model.device)
    logits = {}
    with torch.inference_mode():
        for attention in ATTENTIONS:
            use(model, attention)
            first = model(input_ids=ids[:, :-1], use_cache=True)
            step = model(input_ids=ids[:, -1:], past_key_values=first.past_key_values, use_cache=True)
            logits[attention] = torch.cat([first.logits, step.logits], dim=1).float()
    return float((logits["grouped"] - logits["sdpa"]).norm() / logits["sdpa"].norm())


def step_seconds(model, batch: int, context: int, graphs: bool) -> float:
    """The median seconds of one decode step of `batch` sequences at `context` positions."""
    cache = static_cache(model.config, batch, context + 8, model.device, model.dtype)  # a few spare positions
    ids = torch.randint(3, model.config.vocab_size, (batch, 1), device=model.device)
    position = torch.tensor([context], device=model.device)

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


def measure(name: str, batches: list[int], contexts: list[int], attentions: list[str], on_gpu: bool) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = MODELS[name]
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = Qwen2Config(tie_word_embeddings=False, max_position_embeddings=max(contexts) + 8, **arch)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).eval()
    agree = agreement(model)  # in float32, where the two can be held to float32's rounding
    print(f"  {name}: grouped attention's logits within {agree:.1e} of sdpa's (float32)", flush=True)
    model = model.to(dtype)
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
            for attention in attentions:  # side by side, point by point
                use(model, attention)
                point = {"batch": batch, "context": context, "attention": attention}
                try:
                    point["step_s"] = step_seconds(model, batch, context, graphs=on_gpu)
                except torch.OutOfMemoryError:
                    point["skipped"] = "out of memory"
                points.append(point)
                shown = f"{1000 * point['step_s']:.2f} ms per step" if "step_s" in point else point["skipped"]
                print(f"  {name} batch {batch:4d} context {context:5d} {attention:>7}: {shown}", flush=True)
                if on_gpu:
                    torch.cuda.empty_cache()
    del model
    return {
        "weights_bytes": weights, "dtype": str(dtype), "cuda_graphs": on_gpu, "agree": agree, "points": points,
        "fits": {a: fit(points, a) for a in attentions},
    }  # fmt: skip


def fit(points: list[dict], attention: str) -> dict | None:
    """The planner's three decode costs fitted to one attention's points (None where the planner
    cannot be imported: the GPU image without the project's packages)."""
    try:
        from pipelinerl.planner.bound import fit_curve
    except ImportError:
        return None
    mine = [p for p in points if p.get("attention") == attention and "step_s" in p]
    measured = [(p["batch"], p["context"], p["step_s"]) for p in mine]
    if len(measured) < 3:
        return None
    curve = fit_curve(measured)
    return {"decode_base_s": curve.base_s, "decode_per_seq_s": curve.per_seq_s, "decode_per_token_s": curve.per_token_s}


def verdict_lines(result: dict) -> list[str]:
    lines = []
    for name, model in result["models"].items():
        for attention, f in model["fits"].items():
            if f:
                lines.append(
                    f"VERDICT decode {name} ({attention}): {1e3 * f['decode_base_s']:.2f} ms a step"
                    f" + {1e6 * f['decode_per_seq_s']:.1f} us a sequence + {1e9 * f['decode_per_token_s']:.1f} ns"
                    f" a context token (logits within {model['agree']:.1e} of sdpa's)"
                )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="1.5B,7B")
    ap.add_argument("--batches", default="1,8,32,128,512")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--attentions", default=",".join(ATTENTIONS), help=f"of {', '.join(ATTENTIONS)}")
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
        result["models"][name] = measure(name, batches, contexts, args.attentions.split(","), on_gpu)
        result["verdict_lines"] = verdict_lines(result)
        if folder is not None:  # after every model: a run cut short keeps what it measured
            save(args.name, result, "python -m bench.gpu_decode " + " ".join(argv or []), folder)
    for line in result["verdict_lines"]:
        print(line, flush=True)


if __name__ == "__main__":
    main()
