"""The in-place commit of a staged weight update, timed for a 7B-sized shard: the parameters one
tensor-parallel worker of Qwen2.5-7B holds at TP 2, in vLLM's layout and bf16 (7.1 GiB), and their
staging copy; `StagingCopy.commit` copies the copy into the live storage, which is what a generator
pauses for (its requests kept) once a staged update has arrived. One device-to-device pass: its
bound is the GPU's memory bandwidth (each byte read once and written once).

    python -m bench.gpu_commit [--rounds 5]        # on a GPU (bash bench/gpu_check.sh runs it)
    python -m bench.gpu_commit --smoke             # CPU: a tiny shape in float32, checks the script

Ends with a VERDICT line and writes its JSON (`--results-dir`, else bench/results)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common import gpu_or_smoke, save
from pipelinerl.generator_memory import KNOWN_MODELS, ModelShape
from pipelinerl_generator.staging import StagingCopy

SMOKE = ModelShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1000, tied=False,
                   qkv_bias=True)  # fmt: skip


def shard(shape: ModelShape, tp: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A module tree holding one worker's parameters under vLLM's names (values arbitrary)."""
    root = torch.nn.Module()
    for name, size in shape.worker_tensors(tp):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(size, dtype=dtype, device=device), False))
    return root


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny shape in float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--name", default="gpu_commit-7B")
    ap.add_argument("--results-dir", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu, folder = gpu_or_smoke(args, "gpu_commit")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = SMOKE if args.smoke else ModelShape.from_config(KNOWN_MODELS["qwen2.5-7b"])
    model = shard(shape, args.tp, dtype, device)
    staging = StagingCopy(model, [])
    for _, staged in staging.pairs:
        staged.data.normal_()
    nbytes = staging.nbytes
    live = [p.data_ptr() for p in model.parameters()]
    seconds = []
    for _ in range(args.rounds + 1):  # the first warms the allocator and the copy kernels: not counted
        sync(device)
        t0 = time.perf_counter()
        staging.commit()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    seconds = seconds[1:]
    exact = all(torch.equal(p, s) for p, s in staging.pairs) and [p.data_ptr() for p in model.parameters()] == live
    median = statistics.median(seconds)
    what = "smoke shape" if args.smoke else f"Qwen2.5-7B at TP {args.tp}"
    verdict = (
        f"VERDICT commit of a staged update ({what}, {nbytes / 2**20:,.0f} MiB of {str(dtype)[6:]} on "
        f"{torch.cuda.get_device_name(device) if on_gpu else 'CPU'}): {median * 1e3:.1f} ms median of {args.rounds} "
        f"({2 * nbytes / median / 1e9:.0f} GB/s read + write), "
        + ("storage kept and values exact" if exact else "FAILED: values or storage differ")
    )
    print(verdict, flush=True)
    result = {
        "shape": what,
        "bytes": nbytes,
        "tensors": len(staging.pairs),
        "seconds": seconds,
        "median_s": median,
        "gb_per_s": 2 * nbytes / median / 1e9,
        "exact": exact,
        "verdict_lines": [verdict],
    }
    command = "python -m bench.gpu_commit" + (" --smoke" if args.smoke else "")
    if folder is not None:
        save(args.name, result, command, folder)
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
