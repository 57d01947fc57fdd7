"""Benchmark 6's report (bench/gpu_trainer.py): each side's figures (tokens/s, TFLOP/s, MFU, ×
stock), its table, the result JSON and the verdicts against the targets and the memory cap. Pure,
but for the device's name."""

from __future__ import annotations

from typing import Any

from bench.common import machine
from bench.gpu_shapes import Shape, peak_tflops, step_flops


class Run:
    """The figures of one run, derived from the sides' results (pure, but for the device name)."""

    def __init__(self, args, shape: Shape, bench: Any, on_gpu: bool, memory: dict):
        self.args, self.shape, self.on_gpu, self.memory = args, shape, on_gpu, memory
        lengths = [len(s.sample.tokens) for s in bench.items]
        self.samples, self.micro_batches = len(bench.items), len(bench.batches)
        self.tokens, self.flops = sum(lengths), step_flops(shape, lengths)
        self.device = str(machine()["device"])
        self.peak = args.peak_tflops or (peak_tflops(self.device) if on_gpu else None)
        self.label = args.name.removeprefix("gpu_trainer-")

    def header(self) -> str:
        a = self.args
        return (
            f"{a.size} ({self.shape.matmul_params():,} matmul weights) on {self.device}: {self.samples} samples, "
            f"{self.tokens} tokens, {self.micro_batches} micro-batches of ≤ {a.micro_batch_tokens} tokens per step"
            f"{', activation checkpointing' if a.gradient_checkpointing else ''}; sides {','.join(a.side_list)}"
        )

    def figures(self, results: dict[str, dict]) -> dict[str, dict]:
        """Each side's result with its rates: tokens/s, TFLOP/s, MFU, × stock."""
        stock = results.get("stock", {}).get("seconds", {}).get("median")
        out = {}
        for side, r in results.items():
            r = dict(r)
            if "seconds" in r:
                s = r["seconds"]["median"]
                tflops = self.flops / s / 1e12
                r |= {
                    "tokens_per_second": self.tokens / s,
                    "tflops": tflops,
                    "mfu": tflops / self.peak if self.peak else None,
                    "vs_stock": stock / s if stock else None,
                }
            out[side] = r
        return out

    def row_text(self, side: str, results: dict[str, dict], took: float) -> str:
        r = self.figures(results)[side]
        if "error" in r:
            return f"{side}: FAILED after {took:.0f} s: {r['error']}"
        parts = [f"{r['seconds']['median']:.3g} s/step", f"{r['tokens_per_second']:,.0f} tokens/s"]
        if r["mfu"] is not None:
            parts.append(f"MFU {r['mfu']:.1%}")
        if r["vs_stock"] is not None and side != "stock":
            parts.append(f"{r['vs_stock']:.2f}× stock")
        if "peak_memory_gb" in r:
            parts.append(f"peak {r['peak_memory_gb']:.1f} GB")
        if "host_syncs_per_micro_batch" in r:
            parts.append(f"{r['host_syncs_per_micro_batch']:.1f} syncs/mb")
        return f"{side}: {', '.join(parts)} ({took:.0f} s)"

    def table(self, results: dict[str, dict]) -> tuple[list[str], list[list[object]]]:
        rows: list[list[object]] = []
        for side, r in self.figures(results).items():
            if "error" in r:
                rows.append([side, r["error"][:60], "", "", "", "", "", ""])
                continue
            rows.append(
                [
                    side,
                    r["seconds"]["median"],
                    r["tokens_per_second"],
                    r["tflops"],
                    f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                    f"{r['vs_stock']:.2f}×" if r["vs_stock"] is not None else "-",
                    f"{r['peak_memory_gb']:.1f}" if "peak_memory_gb" in r else "-",
                    f"{r['host_syncs_per_micro_batch']:.1f}" if "host_syncs_per_micro_batch" in r else "-",
                ]
            )
        return ["side", "step s", "tokens/s", "TFLOP/s", "MFU", "× stock", "peak GB", "syncs/mb"], rows

    def print_profiles(self, results: dict[str, dict]) -> None:
        for side, r in results.items():
            if "profile" in r:
                p = r["profile"]
                print(f"profile of {side}: GPU busy {p['gpu_busy_fraction']:.0%} of {p['wall_ms']:.0f} ms")
                for k in p["top_kernels"]:
                    print(f"  {k['share']:6.1%} {k['ms']:8.1f} ms {k['calls']:6d}×  {k['name']}")
                calls = p.get("runtime_calls", {}).items()
                print("  runtime calls: " + ", ".join(f"{k} {v['calls']}× {v['host_ms']:.1f} ms" for k, v in calls))

    def report(self, results: dict[str, dict]) -> dict:
        sides = self.figures(results)
        verdict_, lines = verdict(self.label, sides, self.args.target_pair)
        cap = self.memory.get("memory_cap_gb")
        lines += memory_verdicts(self.label, sides, cap) if self.args.memory_cap_gb else []
        a = self.args
        return {
            "size": a.size,
            "matmul_parameters": self.shape.matmul_params(),
            "samples_per_step": self.samples,
            "tokens_per_step": self.tokens,
            "micro_batches": self.micro_batches,
            "flops_per_step": self.flops,
            "micro_batch_tokens": a.micro_batch_tokens,
            "gradient_checkpointing": a.gradient_checkpointing,
            "peak_tflops": self.peak,
            **self.memory,
            "sides_asked": a.side_list,
            "sides": sides,
            "verdict": verdict_,
            "verdict_lines": lines,
        }

    def command(self) -> str:
        a = self.args
        return (
            f"python -m bench.gpu_trainer --size {a.size} --sides {a.sides} --samples {a.samples} "
            f"--micro-batch-tokens {a.micro_batch_tokens} --repeats {a.repeats} --warmup {a.warmup} --name {a.name}"
            + (f" --targets {a.targets}" if a.targets else "")
            + (f" --memory-cap-gb {a.memory_cap_gb:g}" if a.memory_cap_gb else "")
            + (" --gradient-checkpointing" if a.gradient_checkpointing else "")
            + (" --smoke" if a.smoke else "")
        )


def verdict(label: str, sides: dict[str, dict], targets: tuple[float, float] | None) -> tuple[dict | None, list[str]]:
    """The targets' verdict from the sides so far (with their rates, `Run.figures`): the fastest
    project side against stock HF and its MFU; each part said unknown where its figure is
    missing (stock failed or not run yet, no peak for the device), never left out."""
    if targets is None:
        return None, []
    ratio_target, mfu_target = targets
    done = {s: r for s, r in sides.items() if s != "stock" and "error" not in r}
    best = max(done, key=lambda s: done[s]["tokens_per_second"], default=None)
    if best is None:
        why = "; ".join(f"{s}: {r['error']}" for s, r in sides.items() if s != "stock") or "none has run"
        return (
            {"best_side": None, "vs_stock": None, "mfu": None, "ratio_met": None, "mfu_met": None},
            [f"VERDICT {label}: no project side ran ({why}): both targets unknown"],
        )
    b = done[best]
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    v = {"best_side": best, "vs_stock": b["vs_stock"], "mfu": b["mfu"], "ratio_met": None, "mfu_met": None}
    if b["vs_stock"] is not None:
        v["ratio_met"] = b["vs_stock"] >= ratio_target
        ratio = f"{b['vs_stock']:.2f}× stock HF (target ≥ {ratio_target:g}×: {met(v['ratio_met'])})"
    else:
        stock = sides.get("stock", {})
        why = f"stock failed: {stock['error'][:80]}" if "error" in stock else "no stock figure"
        ratio = f"× stock HF unknown ({why}; target ≥ {ratio_target:g}×)"
    if b["mfu"] is not None:
        v["mfu_met"] = b["mfu"] >= mfu_target
        mfu = f"MFU {b['mfu']:.1%} (target ≥ {mfu_target:.0%}: {met(v['mfu_met'])})"
    else:
        mfu = f"MFU unknown (no peak for this device; target ≥ {mfu_target:.0%})"
    return v, [f"VERDICT {label}: best project side {best}: {ratio}, {mfu}"]


def memory_verdicts(label: str, sides: dict[str, dict], cap_gb: float | None) -> list[str]:
    """Per side: FITS under the memory cap (with its peak), OOM, or unknown (it failed otherwise,
    or ran where there are no GPU memory figures)."""
    cap = f"{cap_gb:g} GB" if cap_gb else "the cap"
    lines = []
    for side, r in sides.items():
        if "error" not in r and "peak_reserved_gb" in r:
            what = (
                f"FITS in {cap} (peak {r['peak_reserved_gb']:.1f} GB reserved, {r['peak_memory_gb']:.1f} GB allocated)"
            )
        elif r.get("error", "").startswith("out of memory"):
            what = f"OOM at {cap}" + (
                f" (peak {r['peak_memory_gb']:.1f} GB allocated)" if "peak_memory_gb" in r else ""
            )
        elif "error" in r:
            what = f"unknown ({r['error'][:80]})"
        else:
            what = "unknown (no GPU memory figures on CPU)"
        lines.append(f"VERDICT {label} memory: {side} {what}")
    return lines
