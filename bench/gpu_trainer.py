"""GPU trainer throughput (benchmark 6): the trainer's step against stock Hugging Face training on
the same tokens, for a Qwen2-architecture model in bf16 on one GPU, with tokens/s, model FLOP
utilisation, peak GPU memory and host syncs per side, and a profile of the trainer's step.

    python -m bench.gpu_trainer [--size 0.5B|1.5B] [--sides stock,plain,zero1,zero3] [--repeats 3]
                                [--micro-batch-tokens 8192] [--gradient-checkpointing] [--profile]
                                [--targets RATIO,MFU] [--memory-cap-gb 80] [--tag=-16k | --name NAME]
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

A side that fails (out of memory, or any other error) is recorded with its error and the others
go on; after every side the result JSON is written again, with the verdict so far, so a run cut
short keeps every side that finished. Peak memory is each side's own: the previous side is freed
and the peak statistics reset before it starts (what was still allocated then is reported
beside it). `--memory-cap-gb 80` caps the process's GPU memory at 80 GB (10^9 bytes, below what
an H100 80GB offers) where the GPU has more, and says per side whether it fits.
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import gpu_or_smoke, one_rank_distributed_env, save, summary, table
from bench.gpu_shapes import GB, SIZES, Shape
from bench.gpu_trainer_report import Run
from pipelinerl import messages as m
from pipelinerl.spec import load_job, parse_job
from pipelinerl_preprocessor.packing import StepSample, pack_wave, step_weight
from pipelinerl_trainer.step import StepTally, micro_batch_loss, step_config

SIDES = ("stock", "plain", "zero1", "zero3", "zero1+compile")
DEFAULT_SIDES = "stock,plain,zero1,zero3"
# --smoke changes these defaults (options given explicitly still apply).
SMOKE_DEFAULTS = dict(
    size="smoke",
    samples=8,
    prompt_tokens=16,
    max_completion=64,
    micro_batch_tokens=256,
    repeats=2,
    warmup=1,
    sides="stock,plain,zero1",
)
NAME = re.compile(r"[A-Za-z0-9._-]+")  # result file names: what the device tool brings back from $OUT


class Stopped(BaseException):
    """SIGTERM (the GPU check's time budget ran out): stop the side in progress, keep the rest."""


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
        self.distributed = False
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
            if not self.distributed:  # only DeepSpeed's sides need it (and DeepSpeed installed)
                from pipelinerl_trainer.model import init_distributed

                init_distributed(self.on_gpu, 600)
                self.distributed = True
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
        """One side: built, warmed up, timed; its figures, or the error that stopped it (any
        exception: the other sides go on)."""
        t0 = time.perf_counter()
        keep: list = []
        out: dict = {}
        try:
            held = self.free()  # raises too after a CUDA error that poisoned the context
            if held is not None:
                out["held_before_gb"] = held  # allocated when this side began (freed sides leave ~0)
            step, loop, keep = self.build(side)
            out["build_seconds"] = time.perf_counter() - t0
            for _ in range(self.args.warmup):
                step()
            times = []
            for _ in range(self.args.repeats):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out["seconds"] = summary(times)
            if self.on_gpu:
                out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / GB
                out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
                if profile:
                    out["profile"] = profile_step(step)
                if loop is not None:
                    out["host_syncs_per_micro_batch"] = self.count_syncs(loop)
        except Exception as e:  # every error is this side's result
            out = {k: v for k, v in out.items() if k in ("held_before_gb", "build_seconds")}
            out["error"] = error_text(e)
            if self.on_gpu:
                try:
                    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / GB
                except Exception:  # the context is gone (a CUDA error): no figure
                    pass
            print(f"  {side} failed: {out['error']}", flush=True)
            traceback.print_exc()  # the whole cause, in the log
        finally:
            for obj in keep:  # a DeepSpeed engine holds hooks and buffers until destroyed
                if hasattr(obj, "destroy"):
                    try:
                        obj.destroy()
                    except Exception as e:  # the side's figures stand; the next side reports what is held
                        print(f"  {side}: could not destroy its engine: {error_text(e)}", flush=True)
            keep.clear()
        return out

    def free(self) -> float | None:
        """Free what earlier sides left and reset the peak statistics; GB still allocated."""
        gc.collect()
        if not self.on_gpu:
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / GB

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
        # Not the mode's own "prototype feature" warning, which set_sync_debug_mode itself raises
        syncs = [w for w in seen if "called a synchronizing" in str(w.message)]
        if syncs:
            print(f"  host syncs seen: {sorted({f'{w.filename}:{w.lineno}' for w in syncs})[:8]}")
        return len(syncs) / len(self.batches)


# CUDA runtime calls that can make the host wait (or show a pageable copy): counted in a profile
HOST_WAITS = re.compile(r"^cuda\w*(Synchronize|Memcpy|HostAlloc|FreeHost|Malloc|Free)")


def profile_step(step: Callable[[], None], top: int = 12) -> dict:
    """One step under torch.profiler: the GPU's busy fraction (kernel time / wall time), the top
    kernels by GPU time, and the runtime calls that can make the host wait (count, host ms)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()  # aggregated once: it walks every recorded event
    kernels = [
        e
        for e in events
        if getattr(e, "self_device_time_total", 0) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")
    ]
    waits = {e.key: {"calls": e.count, "host_ms": e.cpu_time_total / 1000} for e in events if HOST_WAITS.match(e.key)}
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
        "runtime_calls": waits,
    }


def error_text(e: BaseException) -> str:
    """One line: what stopped a side (out of memory told apart: it is the memory verdict)."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory: {first}"
    return f"{type(e).__name__}: {first}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--size", choices=list(SIZES), default="0.5B", help="model shape (smoke: a tiny one, for CPU)")
    ap.add_argument("--sides", default=DEFAULT_SIDES, help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--samples", type=int, default=128, help="samples per optimizer step")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-completion", type=int, default=4096)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps first (3: a compiled side recompiles for dynamic shapes after its first; on an H200 "
        "zero1+compile took 1.56 s/step after one warm-up step, 1.00 s after three)",
    )
    ap.add_argument("--profile", action="store_true", help="profile one step of the first project side")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    ap.add_argument("--targets", help="RATIO,MFU: print a verdict (best project side vs stock, and its MFU)")
    ap.add_argument(
        "--memory-cap-gb", type=float, help="cap GPU memory at this many GB (10^9 bytes); FITS/OOM per side"
    )
    ap.add_argument("--tag", default="", help="suffix of the result file's name (one starting with '-': --tag=-16k)")
    ap.add_argument("--name", help="the result file's name (default gpu_trainer-SIZE plus --tag)")
    ap.add_argument("--results-dir", type=Path, help="where the result JSON goes (default bench/results)")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model, fp32: checks the script (JSON: --results-dir)"
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: each bad one is named."""
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    if "--smoke" in argv:
        ap.set_defaults(**SMOKE_DEFAULTS)
    args = ap.parse_args(argv)
    args.side_list = [s for s in args.sides.split(",") if s]
    if unknown := [s for s in args.side_list if s not in SIDES]:
        ap.error(f"--sides: unknown {unknown} (of {', '.join(SIDES)})")
    if not args.side_list:
        ap.error("--sides: none given")
    args.target_pair = None
    if args.targets:
        try:
            ratio, mfu = (float(x) for x in args.targets.split(","))
        except ValueError:
            ap.error(f"--targets: expected RATIO,MFU (e.g. 1.5,0.20), got {args.targets!r}")
        args.target_pair = (ratio, mfu)
    args.name = args.name or f"gpu_trainer-{args.size}{args.tag}"
    if not NAME.fullmatch(args.name):
        ap.error(f"--name/--tag: {args.name!r} may hold only letters, digits, '.', '_' and '-'")
    for field in ("samples", "repeats", "micro_batch_tokens"):
        if getattr(args, field) < 1:
            ap.error(f"--{field.replace('_', '-')}: must be at least 1")
    return args


def cap_memory(cap_gb: float | None) -> dict:
    """Cap this process's GPU memory at `cap_gb` where the GPU has more (a fit claimed for an
    80 GB GPU must not rest on an H200's 141); the device's total and the cap."""
    total = torch.cuda.get_device_properties(0).total_memory
    out: dict = {"device_memory_gb": total / GB, "memory_cap_gb": None}
    if cap_gb is not None and cap_gb * GB < total:
        torch.cuda.set_per_process_memory_fraction(cap_gb * GB / total)
        out["memory_cap_gb"] = cap_gb
        print(f"GPU memory capped at {cap_gb:g} GB of the device's {total / GB:.1f} GB", flush=True)
    elif cap_gb is not None:
        out["memory_cap_gb"] = total / GB
        print(f"GPU memory: the device's {total / GB:.1f} GB (≤ the {cap_gb:g} GB cap)", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu, folder = gpu_or_smoke(args, "gpu_trainer")
    one_rank_distributed_env()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    memory = cap_memory(args.memory_cap_gb) if on_gpu else {}
    shape = Shape.of(SIZES[args.size])
    results: dict[str, dict] = {}
    stopped = False
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-trainer-") as path:
            torch.manual_seed(0)
            config = Qwen2Config(
                tie_word_embeddings=True,
                max_position_embeddings=max(args.micro_batch_tokens, 8192),
                rope_theta=1e6,
                **SIZES[args.size],
            )
            with torch.device("cuda" if on_gpu else "cpu"):  # random init on the GPU: seconds, not a minute
                Qwen2ForCausalLM(config).save_pretrained(path)  # fp32, as stock HF trains it
            bench = Bench(args, path, on_gpu)
            run = Run(args, shape, bench, on_gpu, memory)
            print(run.header(), flush=True)
            first_project = next((s for s in args.side_list if s != "stock"), None)
            for side in args.side_list:
                t0 = time.perf_counter()
                try:
                    results[side] = bench.run(side, profile=args.profile and side == first_project)
                except Stopped:
                    results[side] = {"error": "stopped: SIGTERM (the GPU check's time budget ran out) during this side"}
                    stopped = True
                print(f"  {run.row_text(side, results, time.perf_counter() - t0)}", flush=True)
                if folder is not None:  # after every side: a run cut short keeps what it measured
                    save(args.name, run.report(results), run.command(), folder)
                if stopped:
                    break
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(table(*run.table(results)))
    run.print_profiles(results)
    for line in run.report(results)["verdict_lines"]:
        print(line)
    if stopped:
        raise SystemExit(143)


def _stop(signum, frame) -> None:
    raise Stopped()


if __name__ == "__main__":
    main()
