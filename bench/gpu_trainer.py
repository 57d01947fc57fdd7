"""GPU trainer throughput (benchmark 6): the trainer's step against stock Hugging Face training on
the same tokens, for a Qwen2-architecture model in bf16 on one GPU, with tokens/s, model FLOP
utilisation, peak GPU memory and host syncs per side, and a profile of the trainer's step.

    python -m bench.gpu_trainer [--size 0.5B|1.5B] [--sides stock,plain,zero1,zero3] [--repeats 3]
                                [--micro-batch-tokens 8192] [--gradient-checkpointing] [--profile]
    python -m bench.gpu_trainer --smoke      # CPU, a tiny model in fp32: checks the script only

The model is random-init (throughput does not depend on the weights) with Qwen2-0.5B/1.5B shapes
and their 151,936-token vocabulary. A step is a synthetic RL batch with long-tailed completion
lengths, packed into rows by the preprocessor's `pack_wave`. Sides (each built, warmed up, timed
and freed in turn, so the GPU runs one thing at a time and a 1.5B model's sides need not fit
together):

- stock: stock Hugging Face training of the same tokens: dense rows of micro-batch-tokens, SDPA
  causal attention over the whole row, HF's own cross-entropy (labels), fp32 weights with bf16
  autocast, AdamW, gradient clipping. The floor any GPU trainer must beat.
- plain: the trainer's model (packed variable-length attention, fused log-prob head) and loss
  code (`micro_batch_loss`), fp32 weights, bf16 autocast, AdamW.
- zero1, zero3: the trainer's DeepSpeed engine (`build_engine`: bf16 weights, fp32 master copy
  kept by ZeRO, client AdamW) at ZeRO-1 and ZeRO-3; zero1+compile: with `trainer.compile` (the
  MLPs and norms compiled; the warm-up step pays the compilation).

MFU = model FLOPs / step time / the device's dense bf16 peak (989 TFLOP/s for H100 SXM and
H200, from the device name, or `--peak-tflops`); model FLOPs = 6 · N · T for the N weights every
token multiplies (layers and LM head) over T tokens, plus causal attention within each sample,
the same useful work for every side (stock computes more attention: across samples too).
Host syncs: one extra step per project side under `torch.cuda.set_sync_debug_mode("warn")`,
counting the warnings. `--profile`: one step of the first project side under torch.profiler:
the GPU's busy fraction and its top kernels. With `--targets RATIO,MFU` it ends with a verdict.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import machine, save, summary, table
from pipelinerl import messages as m
from pipelinerl.spec import load_job, parse_job
from pipelinerl_preprocessor.packing import StepSample, pack_wave, step_weight
from pipelinerl_trainer.step import StepTally, micro_batch_loss, step_config

VOCAB = 151_936
# Qwen2-0.5B and Qwen2-1.5B shapes (their config.json); "smoke" is a CPU-sized check of the script.
SIZES: dict[str, dict] = {
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    ),
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
    ),
}
# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts), matched on the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
SIDES = ("stock", "plain", "zero1", "zero3", "zero1+compile")


@dataclass
class Shape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, arch: dict) -> Shape:
        return cls(
            arch["hidden_size"],
            arch["intermediate_size"],
            arch["num_hidden_layers"],
            arch["num_attention_heads"],
            arch["num_key_value_heads"],
            arch["vocab_size"],
        )

    def matmul_params(self) -> int:
        """Weights every token multiplies: q, k, v, o, the gated MLP, and the LM head."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.inter) + self.vocab * self.hidden


def step_flops(shape: Shape, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward = 3 × forward) of one step over sequences of `lengths`."""
    tokens = sum(lengths)
    # Causal scores and weighted values: 2 matmuls × 2 FLOPs × heads·head_dim × s(s+1)/2 pairs
    attention = 2 * shape.layers * shape.hidden * sum(s * (s + 1) for s in lengths)
    return 3 * (2 * shape.matmul_params() * tokens + attention)


def peak_tflops(device: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)


def synthetic_step(samples: int, prompt: int, max_completion: int, vocab: int, seed: int = 0) -> list[StepSample]:
    """RL samples whose completion lengths are long-tailed (log-normal, median max/8, capped)."""
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        n = min(max_completion, max(16, int(rng.lognormvariate(0, 0.8) * max_completion / 8)))
        tokens = [rng.randrange(2, vocab) for _ in range(prompt + n)]
        out.append(
            StepSample(
                m.Sample(
                    tokens=tokens,
                    mask=[0] * prompt + [1] * n,
                    logprobs=[0.0] * prompt + [-rng.uniform(0.01, 2.0)] * n,
                    versions=[-1] * prompt + [0] * n,
                    reward=float(rng.random() < 0.5),
                ),
                rng.gauss(0, 1),
            )
        )
    return out


def dense_rows(items: list[StepSample], width: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same tokens as stock HF training takes them: concatenated, cut into rows of `width`;
    labels are the generated tokens (-100 elsewhere; HF shifts them itself)."""
    ids = torch.tensor([t for s in items for t in s.sample.tokens])
    mask = torch.tensor([k for s in items for k in s.sample.mask], dtype=torch.bool)
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return [
        (ids[a : a + width][None].to(device), labels[a : a + width][None].to(device)) for a in range(0, len(ids), width)
    ]


def job_for(
    model_path: str, dtype: str, zero_stage: int, micro_batch_tokens: int, checkpointing: bool, compile: bool = False
):
    data = load_job("examples/tiny-cpu.yaml").model_dump(mode="json", by_alias=True, exclude_none=True)
    data["spec"]["model"] |= {"path": model_path, "dtype": dtype, "maxSeqLen": micro_batch_tokens}
    data["spec"]["trainer"] |= {
        "zeroStage": zero_stage,
        "microBatchTokens": micro_batch_tokens,
        "warmupSteps": 0,
        "gradientCheckpointing": checkpointing,
        "compile": compile,
    }
    return parse_job(data, "gpu_trainer job")


class Bench:
    """Builds each side, times it, frees it."""

    def __init__(self, args, path: str, on_gpu: bool):
        self.args, self.path, self.on_gpu = args, path, on_gpu
        self.device = torch.device("cuda" if on_gpu else "cpu")
        self.dtype = "bfloat16" if on_gpu else "float32"
        self.items = synthetic_step(
            args.samples, args.prompt_tokens, args.max_completion, SIZES[args.size]["vocab_size"]
        )
        job = self.job(1)
        self.cfg = step_config(job)
        weight = step_weight(self.items, job.spec.rl.token_weighting, len(self.items))
        self.batches = pack_wave(0, self.items, 1, args.micro_batch_tokens, weight, last=True)[0]

    def job(self, stage: int, compile: bool = False):
        return job_for(
            self.path, self.dtype, stage, self.args.micro_batch_tokens, self.args.gradient_checkpointing, compile
        )

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()

    def build(self, side: str) -> tuple[Callable[[], None], Callable[[], None] | None, list]:
        """(one training step, the micro-batch loop alone or None, the objects to free)."""
        from transformers import AutoModelForCausalLM

        from pipelinerl_trainer.model import build_engine, load_model

        t = self.job(1).spec.trainer
        autocast = dict(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.on_gpu)
        if side.startswith("zero"):
            engine = build_engine(self.job(int(side[4]), side.endswith("+compile")).spec.trainer, self.dtype, self.path)
            engine.train()

            def loop() -> None:
                tally = StepTally(self.cfg.max_lag, engine.device)
                for mb in self.batches:
                    engine.backward(micro_batch_loss(engine, mb, 0, self.cfg, tally))

            def step() -> None:
                loop()
                engine.step()
                self.sync()

            return step, loop, [engine]
        if side == "plain":
            model = load_model(self.path, gradient_checkpointing=self.args.gradient_checkpointing).to(self.device)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.path, attn_implementation="sdpa").to(self.device)
            if self.args.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay, betas=(0.9, 0.999))
        rows = dense_rows(self.items, self.args.micro_batch_tokens, self.device) if side == "stock" else None

        def loop() -> None:
            tally = StepTally(self.cfg.max_lag, self.device)
            with torch.autocast(**autocast):
                if rows is not None:
                    for ids, labels in rows:
                        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
                else:
                    for mb in self.batches:
                        micro_batch_loss(model, mb, 0, self.cfg, tally).backward()

        def step() -> None:
            loop()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.sync()

        return step, (loop if side == "plain" else None), [model]

    def run(self, side: str, profile: bool) -> dict:
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        keep: list = []
        try:
            step, loop, keep = self.build(side)
            build_s = time.perf_counter() - t0
            for _ in range(self.args.warmup):
                step()
            times = []
            for _ in range(self.args.repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out = {"seconds": summary(times), "build_seconds": build_s}
            if self.on_gpu:
                out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                if profile:
                    out["profile"] = profile_step(step)
                if loop is not None:
                    out["host_syncs_per_micro_batch"] = self.count_syncs(loop)
        except torch.OutOfMemoryError as e:
            out = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        for obj in keep:  # a DeepSpeed engine holds hooks and buffers until destroyed
            if hasattr(obj, "destroy"):
                obj.destroy()
        return out

    def count_syncs(self, loop: Callable[[], None]) -> float:
        """Host syncs the device reported during one pass of the micro-batch loop (sync debug mode)."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loop()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        self.sync()
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        if syncs:
            print(f"  host syncs seen: {sorted({f'{w.filename}:{w.lineno}' for w in syncs})[:8]}")
        return len(syncs) / len(self.batches)


def profile_step(step: Callable[[], None], top: int = 8) -> dict:
    """One step under torch.profiler: the GPU's busy fraction (kernel time / wall time) and the top
    kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [
        e
        for e in prof.key_averages()
        if getattr(e, "self_device_time_total", 0) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")
    ]
    busy_us = sum(e.self_device_time_total for e in kernels)
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {
        "wall_ms": wall_us / 1000,
        "gpu_busy_fraction": min(1.0, busy_us / wall_us),
        "top_kernels": [
            {
                "name": e.key[:90],
                "ms": e.self_device_time_total / 1000,
                "calls": e.count,
                "share": e.self_device_time_total / busy_us,
            }
            for e in ranked
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=[s for s in SIZES if s != "smoke"], default="0.5B")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--samples", type=int, default=128, help="samples per optimizer step")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-completion", type=int, default=4096)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="profile one step of the first project side")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    ap.add_argument("--targets", help="RATIO,MFU: print a verdict (best project side vs stock, and its MFU)")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.samples, args.prompt_tokens, args.max_completion = "smoke", 8, 16, 64
        args.micro_batch_tokens, args.repeats, args.sides = 256, 2, "stock,plain,zero1"
    sides = [s for s in args.sides.split(",") if s]
    if unknown := set(sides) - set(SIDES):
        raise SystemExit(f"--sides: unknown {sorted(unknown)} (of {', '.join(SIDES)})")
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        raise SystemExit("bench.gpu_trainer needs a CUDA GPU (or --smoke to check the script on CPU)")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29518")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl_trainer.model import init_distributed

    shape = Shape.of(SIZES[args.size])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-trainer-") as path:
        torch.manual_seed(0)
        config = Qwen2Config(
            tie_word_embeddings=True,
            max_position_embeddings=max(args.micro_batch_tokens, 8192),
            rope_theta=1e6,
            **SIZES[args.size],
        )
        Qwen2ForCausalLM(config).save_pretrained(path)
        bench = Bench(args, path, on_gpu)
        init_distributed(on_gpu, 600)
        first_project = next((s for s in sides if s != "stock"), None)
        for side in sides:
            t0 = time.perf_counter()
            results[side] = bench.run(side, profile=args.profile and side == first_project)
            print(f"  {side}: {time.perf_counter() - t0:.0f} s", flush=True)
    report(args, shape, bench, results, on_gpu)


def report(args, shape: Shape, bench: Bench, results: dict[str, dict], on_gpu: bool) -> None:
    lengths = [len(s.sample.tokens) for s in bench.items]
    tokens, flops = sum(lengths), step_flops(shape, lengths)
    dev_name = str(machine()["device"])
    peak = args.peak_tflops or (peak_tflops(dev_name) if on_gpu else None)
    stock = results.get("stock", {}).get("seconds", {}).get("median")
    rows = []
    for side, r in results.items():
        if "error" in r:
            rows.append([side, r["error"][:60], "", "", "", "", "", ""])
            continue
        s = r["seconds"]["median"]
        r |= {
            "tokens_per_second": tokens / s,
            "tflops": flops / s / 1e12,
            "mfu": flops / s / 1e12 / peak if peak else None,
            "vs_stock": stock / s if stock else None,
        }
        rows.append(
            [
                side,
                s,
                tokens / s,
                r["tflops"],
                f"{r['mfu']:.1%}" if r["mfu"] else "-",
                f"{r['vs_stock']:.2f}×" if r["vs_stock"] else "-",
                f"{r['peak_memory_gb']:.1f}" if "peak_memory_gb" in r else "-",
                f"{r['host_syncs_per_micro_batch']:.1f}" if "host_syncs_per_micro_batch" in r else "-",
            ]
        )
    print(
        f"{args.size} ({shape.matmul_params():,} matmul weights) on {dev_name}: {len(bench.items)} samples, "
        f"{tokens} tokens, {len(bench.batches)} micro-batches of ≤ {args.micro_batch_tokens} tokens per step"
        f"{', activation checkpointing' if args.gradient_checkpointing else ''}"
    )
    print(table(["side", "step s", "tokens/s", "TFLOP/s", "MFU", "× stock", "peak GB", "syncs/mb"], rows))
    for side, r in results.items():
        if "profile" in r:
            p = r["profile"]
            print(f"profile of {side}: GPU busy {p['gpu_busy_fraction']:.0%} of {p['wall_ms']:.0f} ms")
            for k in p["top_kernels"]:
                print(f"  {k['share']:6.1%} {k['ms']:8.1f} ms {k['calls']:6d}×  {k['name']}")
    verdict = None
    if args.targets and stock:
        ratio_target, mfu_target = (float(x) for x in args.targets.split(","))
        done = {s: r for s, r in results.items() if s != "stock" and "error" not in r}
        best = max(done, key=lambda s: done[s]["tokens_per_second"], default=None)
        if best:
            b = done[best]
            verdict = {
                "best_side": best,
                "vs_stock": b["vs_stock"],
                "mfu": b["mfu"],
                "ratio_met": b["vs_stock"] >= ratio_target,
                "mfu_met": (b["mfu"] or 0) >= mfu_target,
            }
            mfu = f"{b['mfu']:.1%}" if b["mfu"] is not None else "unknown (no peak for this device)"
            print(
                f"VERDICT {args.size}: best project side {best}: {b['vs_stock']:.2f}× stock HF "
                f"(target ≥ {ratio_target}×: {'met' if verdict['ratio_met'] else 'MISSED'}), MFU {mfu} "
                f"(target ≥ {mfu_target:.0%}: {'met' if verdict['mfu_met'] else 'MISSED'})"
            )
    if not args.smoke:
        command = (
            f"python -m bench.gpu_trainer --size {args.size} --sides {args.sides} --samples {args.samples} "
            f"--micro-batch-tokens {args.micro_batch_tokens} --repeats {args.repeats}"
            + (" --gradient-checkpointing" if args.gradient_checkpointing else "")
        )
        save(
            f"gpu_trainer-{args.size}{args.tag}",
            {
                "size": args.size,
                "matmul_parameters": shape.matmul_params(),
                "samples_per_step": len(bench.items),
                "tokens_per_step": tokens,
                "micro_batches": len(bench.batches),
                "flops_per_step": flops,
                "micro_batch_tokens": args.micro_batch_tokens,
                "gradient_checkpointing": args.gradient_checkpointing,
                "peak_tflops": peak,
                "sides": results,
                "verdict": verdict,
            },
            command,
        )


if __name__ == "__main__":
    main()
