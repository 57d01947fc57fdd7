"""GPU trainer throughput: tokens/s and model FLOP utilisation of the trainer's DeepSpeed step for a
Qwen2-architecture model in bf16, against a plain PyTorch loop on the same GPU, model and batch.

    .venv/bin/python -m bench.gpu_trainer [--size 0.5B|1.5B] [--repeats 5] [--peak-tflops 989]
    .venv/bin/python -m bench.gpu_trainer --smoke      # CPU, a tiny model in fp32: checks the script only

The model is random-init (throughput does not depend on the weights) with Qwen2-0.5B/1.5B shapes
and their 151,936-token vocabulary. A step is a synthetic RL batch with long-tailed completion
lengths, packed into rows by the preprocessor's `pack_wave` and trained with the project's loss
code (`micro_batch_loss`), exactly as the trainer service does. Sides, alternated per round:

- the trainer's DeepSpeed engine (`build_engine`: bf16 weights, fp32 master copy in the ZeRO
  optimizer, client AdamW);
- plain PyTorch with the same optimizer arithmetic: fp32 weights, bf16 autocast, AdamW.

MFU = model FLOPs per step / step time / the GPU's dense bf16 peak. Model FLOPs: 6 · N · T for the
N weights that multiply every token (layers and LM head; embedding lookup excluded) over T row
tokens, plus causal attention 6 · layers · heads · head_dim · Σ s(s+1)/2 · 2 over the packed
sequences of length s (forward QKᵀ and AV, backward twice that). The device goes into the JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from dataclasses import dataclass

import torch

from bench.common import alternate, machine, paired_ratios, save, summary, table, timed
from bench.trainer_overhead import packed_step
from pipelinerl import messages as m
from pipelinerl.spec import load_job, parse_job
from pipelinerl_preprocessor.packing import StepSample, pack_wave, step_weight
from pipelinerl_trainer.step import StepTally, micro_batch_loss, step_config

VOCAB = 151_936
# Qwen2-0.5B and Qwen2-1.5B shapes (their config.json); "smoke" is a CPU-sized check of the script.
SIZES: dict[str, dict] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=VOCAB),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=VOCAB),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512),
}
# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts), matched on the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0}


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
        return cls(arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"],
                   arch["num_attention_heads"], arch["num_key_value_heads"], arch["vocab_size"])

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
        out.append(StepSample(m.Sample(
            tokens=tokens, mask=[0] * prompt + [1] * n, logprobs=[0.0] * prompt + [-rng.uniform(0.01, 2.0)] * n,
            versions=[-1] * prompt + [0] * n, reward=float(rng.random() < 0.5)), rng.gauss(0, 1)))
    return out


def job_for(model_path: str, dtype: str, zero_stage: int, micro_batch_tokens: int):
    data = load_job("examples/tiny-cpu.yaml").model_dump(mode="json", by_alias=True, exclude_none=True)
    data["spec"]["model"] |= {"path": model_path, "dtype": dtype, "maxSeqLen": micro_batch_tokens}
    data["spec"]["trainer"] |= {"zeroStage": zero_stage, "microBatchTokens": micro_batch_tokens, "warmupSteps": 0}
    return parse_job(data, "gpu_trainer job")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=[s for s in SIZES if s != "smoke"], default="0.5B")
    ap.add_argument("--samples", type=int, default=128, help="samples per optimizer step")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-completion", type=int, default=4096)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.size, args.samples, args.prompt_tokens, args.max_completion = "smoke", 8, 16, 64
        args.micro_batch_tokens, args.repeats = 256, 2
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        raise SystemExit("bench.gpu_trainer needs a CUDA GPU (or --smoke to check the script on CPU)")
    dtype = "bfloat16" if on_gpu else "float32"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29518")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl_trainer.model import build_engine, init_distributed, load_model

    arch = SIZES[args.size]
    shape = Shape.of(arch)
    device = torch.device("cuda" if on_gpu else "cpu")
    with tempfile.TemporaryDirectory(prefix="gpu-trainer-") as path:
        torch.manual_seed(0)
        config = Qwen2Config(tie_word_embeddings=True, max_position_embeddings=args.micro_batch_tokens,
                             rope_theta=1e6, **arch)
        Qwen2ForCausalLM(config).save_pretrained(path)
        job = job_for(path, dtype, args.zero_stage, args.micro_batch_tokens)
        cfg = step_config(job)
        items = synthetic_step(args.samples, args.prompt_tokens, args.max_completion, shape.vocab)
        weight = step_weight(items, job.spec.rl.token_weighting, len(items))
        batches = pack_wave(0, items, 1, args.micro_batch_tokens, weight, last=True)[0]
        lengths = [len(s.sample.tokens) for s in items]
        tokens, flops = sum(lengths), step_flops(shape, lengths)

        init_distributed(on_gpu, 600)
        engine = build_engine(job.spec.trainer, job.spec.model.dtype, path)  # DeepSpeed places it on the local GPU
        engine.train()
        plain = load_model(path).to(device).train()  # fp32 weights: the same master precision
        t = job.spec.trainer
        opt = torch.optim.AdamW(plain.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay, betas=(0.9, 0.999))
        n_params = sum(p.numel() for p in plain.parameters())

        def sync() -> None:
            if on_gpu:
                torch.cuda.synchronize()

        def deepspeed_step() -> None:
            packed_step(engine, engine.step, batches, cfg, engine.backward)
            sync()

        def plain_step() -> None:
            tally = StepTally()
            for mb in batches:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                    loss = micro_batch_loss(plain, mb, 0, cfg, tally)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()

        sides = {f"deepspeed ZeRO-{args.zero_stage}, {dtype}": lambda: timed(deepspeed_step),
                 "plain PyTorch, bf16 autocast" if on_gpu else "plain PyTorch, float32": lambda: timed(plain_step)}
        times = alternate(sides, args.repeats, warmup=1)

    dev_name = machine()["device"]
    peak = args.peak_tflops or (peak_tflops(str(dev_name)) if on_gpu else None)
    names = list(sides)
    rows, result = [], {"size": args.size, "parameters": n_params, "matmul_parameters": shape.matmul_params(),
                        "dtype": dtype, "zero_stage": args.zero_stage, "samples_per_step": len(items),
                        "tokens_per_step": tokens, "micro_batches": len(batches), "flops_per_step": flops,
                        "peak_tflops": peak, "sides": {}}
    for name in names:
        s = summary(times[name])
        ratio = paired_ratios(times[name], times[names[1]])
        tflops = flops / s["median"] / 1e12
        mfu = tflops / peak if peak else None
        result["sides"][name] = {"seconds": s, "tokens_per_second": tokens / s["median"], "tflops": tflops,
                                 "mfu": mfu, "vs_plain": ratio}
        rows.append([name, s["median"], f"{s['min']:.3f}-{s['max']:.3f}", tokens / s["median"], tflops,
                     f"{mfu:.1%}" if mfu else "-", ratio["median"]])
    overhead = result["sides"][names[0]]["vs_plain"]["median"]
    result["deepspeed_overhead"] = overhead
    print(f"{args.size} ({n_params:,} parameters) on {dev_name}: {len(items)} samples, {tokens} tokens, "
          f"{len(batches)} micro-batches per step")
    print(table(["side", "step s (median)", "spread", "tokens/s", "TFLOP/s", "MFU", "× plain"], rows))
    print(f"DeepSpeed / plain PyTorch: {overhead:.2f}×")
    if not args.smoke:
        command = (f"python -m bench.gpu_trainer --size {args.size} --samples {args.samples} --prompt-tokens "
                   f"{args.prompt_tokens} --max-completion {args.max_completion} --micro-batch-tokens "
                   f"{args.micro_batch_tokens} --zero-stage {args.zero_stage} --repeats {args.repeats}")
        save(f"gpu_trainer-{args.size}", result, command)


if __name__ == "__main__":
    main()
