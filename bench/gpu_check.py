"""Benchmark 6's verdict on one CUDA GPU in one command, `bash bench/gpu_check.sh`, made to work
the first time a GPU is lent: 15 minutes of device time in all, one command at most 10 minutes,
only what is under $OUT comes back, and only the last 12,000 characters of the output.

Parts, in order of value, each given what is left of one overall budget (`--budget`, 420 s by
default) up to its own cap, each going on whatever the others did:

1. install: the packages the GPU image lacks (pydantic, hjson, DeepSpeed) from `.whl/`
   (`scripts/gpu-wheels.sh`) into a scratch folder, skipped where they import already;
   DeepSpeed's sdist is built without its ops or CUDA detection, and a failure there only
   skips what needs DeepSpeed;
2. trainer-peers: two trainer ranks on the GPU all-reducing over NCCL in a group of torch's
   default timeout (as DeepSpeed's gradient all-reduce), one killed or frozen: the other is ended
   within the ranks' watch's bound (pipelinerl_trainer.peers), and the NOTE lines say whether
   NCCL noticed a killed peer by itself first (tests/integration/test_trainer_collectives.py);
3. weight-plane: the in-flight update against what a GPU engine runs (torch only, no vLLM): a
   captured CUDA graph computes with the weights each commit brings, staged and in place, and a
   `.data` swap leaves it stale (tests/integration/test_commit_graphs.py); two NCCL ranks on the
   GPU, one killed mid-broadcast: the survivor raises WeightSyncError and sends the next epoch
   exact weights; one killed between joining and connecting: the trainer's watchdog ends it
   within its bound, or NCCL fails by itself first (test_weight_group.py, `killed`); a generator
   worker joining on a thread of its own while its GPU computes, its communicator set up there
   or on the polling thread (test_weight_join.py);
4. gpu-tests: the GPU tests (varlen flash attention, the bf16 forward, the sync-free loop, the
   NCCL transport), 120 s per test at most; their summary lines (-rfEs) printed, all in the log;
5. weight-update: a 1.5B weight update timed end to end (DeepSpeed pack, NCCL, receive): the
   trainers' time per update, which decides the planner's ratio at the paper's scale;
6. checkpoint: the trainer's checkpoints on the GPU (tests/integration/test_checkpoint.py, its
   NCCL variants: two DeepSpeed ranks in bfloat16 on the one GPU): each pod resumes from its own
   volume exactly (ZeRO-1), and a pod that lost its volume goes on from the one that kept it
   (ZeRO-1, and ZeRO-3 from rank 0's Hugging Face copy);
7. commit-7B: the commit of a staged update for a Qwen2.5-7B TP-2 shard, timed (bench/gpu_commit.py);
8. decode-curve: a decode step's time against the running batch (1-512) and the context (1K, 4K)
   for Qwen2.5-1.5B and -7B shapes, bf16, static KV cache, CUDA graphs (bench/gpu_decode.py): the
   curve the planner's decode costs and the throughput bound are fitted from;
9. 0.5B: benchmark 6 at Qwen2-0.5B shapes, sides stock, plain, zero1, zero1+compile, with a
   profile (ZeRO-3 only shards, which one GPU does not need: 0.25× stock on an H200);
10. 1.5B: at Qwen2-1.5B shapes, sides stock, zero1, zero1+compile (no compiled side in --smoke);
11. 1.5B-16k: one 1.5B ZeRO-1 step of 16,384-token micro-batches under an 80 GB memory cap.

The parts whose code changed since the last GPU loan come first (the trainer ranks' watch, never
run on a GPU; the weight plane's staging stream and ring, the NCCL receive given up), then the
figure the planner turns on; the parts passed on 2026-12-04 after them.

Everything goes to $OUT as it happens (a temporary folder where $OUT is unset): the whole output
in gpu_check.log, each benchmark's JSON (written by the benchmark after each side), and
gpu_check.json, the parts' status, rewritten after each part. The printed output leaves out
progress bars, DeepSpeed's INFO lines and Python warnings (the log keeps them) and ends with a
compact summary: each part's status and every VERDICT line.

`--smoke` runs the same parts on CPU (tiny shapes, gloo, no install where the packages
import), in a few minutes: it keeps the script from rotting between GPU loans. Its pytest parts
only collect their selections (none matching fails them): the test suite runs those tests itself.

This file (and bench/gpu_probe.py) imports nothing outside the standard library: it runs before
anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_probe import MODULES

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420  # the device call: timeout_s=450, leaving a fresh machine and a rerun in 15 minutes
SMOKE_BUDGET_S = 900  # on a shared 2-core CPU, where starting Python with torch alone takes 10-40 s
SMOKE_CAP_FACTOR = 3  # the parts' caps, likewise
GRACE_S = 10  # SIGTERM to SIGKILL: a benchmark saves what it has
MIN_PART_S = 30  # a part that would get less is skipped
SUMMARY_S = 5  # kept back for the summary
PART_NAMES = (
    "trainer-peers",
    "weight-plane",
    "gpu-tests",
    "weight-update",
    "checkpoint",
    "commit-7B",
    "decode-curve",
    "0.5B",
    "1.5B",
    "1.5B-16k",
)
SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/pipelinerl-gpu-site"))  # where .whl/ is installed
WHEELS = Path(os.environ.get("GPU_CHECK_WHEELS", ROOT / ".whl"))  # scripts/gpu-wheels.sh fills it
MEMORY_CAP_GB = "80"


@dataclass
class Part:
    name: str
    argv: list[str]  # after the Python executable
    cap_s: int
    result: str | None = None  # the JSON the part writes into the output folder (its name, no .json)
    needs_deepspeed: bool = False
    pytest: bool = False


@dataclass
class Record:
    """What became of one part (gpu_check.json)."""

    name: str
    status: str = "pending"  # ok, failed, timeout, skipped
    seconds: float = 0.0
    timeout_s: float | None = None
    rc: int | None = None
    command: str = ""
    note: str = ""
    verdict_lines: list[str] = field(default_factory=list)
    summary_lines: list[str] = field(default_factory=list)


def plan(smoke: bool, out: Path) -> list[Part]:
    """The parts after install, with their exact command lines (tests parse them)."""
    outdir = ["--results-dir", str(out)]
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider"] + (["--collect-only"] if smoke else [])
    if smoke:  # the tiny shape on CPU; the 16k part's micro-batches twice the others'
        size = {"0.5B": ["--smoke"], "1.5B": ["--smoke"], "16k": ["--smoke", "--micro-batch-tokens", "512"]}
        update = ["--smoke", "--rounds", "2"]
    else:
        size = {
            "0.5B": ["--size", "0.5B", "--samples", "64", "--repeats", "2"],
            "1.5B": ["--size", "1.5B", "--samples", "64", "--repeats", "2"],
            "16k": ["--size", "1.5B", "--samples", "64", "--repeats", "1", "--micro-batch-tokens", "16384"],
        }
        update = ["--size", "1.5B", "--rounds", "2"]
    trainer = ["-m", "bench.gpu_trainer"]

    def sides(names: str) -> str:  # compiling for a CPU takes minutes there and measures nothing
        return ",".join(s for s in names.split(",") if not (smoke and s.endswith("+compile")))

    return [
        Part(
            "trainer-peers",
            pytest + ["--timeout", "90", "-rfEsP", "--tb=short"]  # P: the NOTE lines (what ended the rank)
            + ["tests/integration/test_trainer_collectives.py", "-k", "gloo" if smoke else "nccl"],
            80,
            pytest=True,
        ),
        Part(
            "weight-plane",
            pytest + ["--timeout", "90", "-rfEsP", "--tb=short"]  # P: what a test prints (NOTE lines)
            + ["tests/integration/test_commit_graphs.py", "tests/integration/test_weight_group.py"]
            + ["tests/integration/test_weight_join.py"]
            + ["-k", ("cpu" if smoke else "cuda") + " or killed"],  # the smoke: the CPU stand-ins, gloo
            100,
            pytest=True,
        ),
        Part(
            "gpu-tests",
            pytest + ["--timeout", "120", "-rfEs", "--tb=short"]
            + ["tests/gpu", "tests/integration/test_weight_group.py", "-k", "gpu or nccl"],
            150,
            pytest=True,
        ),
        Part(
            "weight-update",
            ["-m", "bench.gpu_weight_update"] + update + ["--name", "gpu_weight_update-1.5B"] + outdir,
            120,
            result="gpu_weight_update-1.5B",
            needs_deepspeed=True,
        ),
        Part(
            "checkpoint",
            pytest + ["--timeout", "150", "-rfEs", "--tb=short", "tests/integration/test_checkpoint.py"]
            + ["-k", "gloo" if smoke else "nccl"],  # the smoke: the CPU variants, collected
            150,
            needs_deepspeed=True,
            pytest=True,
        ),
        Part(
            "commit-7B",
            ["-m", "bench.gpu_commit"] + (["--smoke"] if smoke else []) + ["--name", "gpu_commit-7B"] + outdir,
            60,
            result="gpu_commit-7B",
        ),
        Part(
            "decode-curve",
            ["-m", "bench.gpu_decode"] + (["--smoke"] if smoke else []) + ["--name", "gpu_decode"] + outdir,
            150,
            result="gpu_decode",
        ),
        Part(
            "0.5B",
            trainer + size["0.5B"] + ["--sides", sides("stock,plain,zero1,zero1+compile"), "--profile"]
            + ["--targets", "1.5,0.20", "--name", "gpu_trainer-0.5B"] + outdir,
            180,
            result="gpu_trainer-0.5B",
            needs_deepspeed=True,
        ),
        Part(
            "1.5B",
            trainer + size["1.5B"] + ["--sides", sides("stock,zero1,zero1+compile"), "--targets", "1.5,0.30"]
            + ["--memory-cap-gb", MEMORY_CAP_GB, "--name", "gpu_trainer-1.5B"] + outdir,
            150,
            result="gpu_trainer-1.5B",
            needs_deepspeed=True,
        ),
        Part(
            "1.5B-16k",
            trainer + size["16k"] + ["--sides", "zero1", "--memory-cap-gb", MEMORY_CAP_GB]
            + ["--name", "gpu_trainer-1.5B-16k"] + outdir,
            120,
            result="gpu_trainer-1.5B-16k",
            needs_deepspeed=True,
        ),
    ]  # fmt: skip


def without_deepspeed(part: Part) -> tuple[Part | None, str]:
    """The part as it can run without DeepSpeed, and what was left out: the ZeRO sides dropped
    (plain in their place where no project side would be left); None where nothing is left."""
    if "--sides" not in part.argv:
        return None, "skipped: it needs DeepSpeed, which did not install"
    i = part.argv.index("--sides") + 1
    sides = part.argv[i].split(",")
    kept = [s for s in sides if not s.startswith("zero")]
    if not any(s != "stock" for s in kept):
        if "stock" not in kept:
            return None, "skipped: all its sides need DeepSpeed, which did not install"
        kept.append("plain")
    dropped = [s for s in sides if s not in kept]
    argv = part.argv[:i] + [",".join(kept)] + part.argv[i + 1 :]
    note = f"sides {','.join(dropped)} skipped: DeepSpeed did not install" + (
        "; plain instead" if "plain" in kept and "plain" not in sides else ""
    )
    return Part(part.name, argv, part.cap_s, part.result, False, part.pytest), note


def part_timeout(cap_s: float, left_s: float) -> float | None:
    """A part's time limit: its cap, or what is left of the budget less the grace period and the
    summary's time; None (skip it) when that is under MIN_PART_S."""
    limit = min(cap_s, left_s - GRACE_S - SUMMARY_S)
    return limit if limit >= MIN_PART_S else None


# --- what is printed (the log keeps every line) ------------------------------------------------

PROGRESS = re.compile(r"\d+%\||\d+/\d+ \[[\d:<?]+|it/s\]|s/it\]")
LOG_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(INFO|DEBUG|WARNING)\]")
PY_WARNING = re.compile(r"\b\w*Warning: ")
PYTEST_SHOWN = re.compile(
    r"^(FAILED|ERROR|SKIPPED|NOTE)\b|\b\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s"
)


class Filter:
    """Decides, line by line, what of a part's output is printed: not progress bars, DeepSpeed's
    INFO/WARNING log lines, Python warnings (and the source line printed under each) or blank
    lines; of pytest's output only its FAILED/ERROR/SKIPPED summary lines, the NOTE lines a test prints
    (what it found that a pass alone does not say) and its totals."""

    def __init__(self, pytest: bool = False) -> None:
        self.pytest = pytest
        self.after_warning = False
        self.kept: list[str] = []  # pytest's lines shown: the part's summary

    def shown(self, line: str) -> bool:
        text = line.rstrip("\n")
        if self.after_warning:
            self.after_warning = False
            if text.startswith("  "):  # the source line Python prints under a warning
                return False
        if PY_WARNING.search(text):
            self.after_warning = True
            return False
        if not text.strip() or PROGRESS.search(text) or LOG_NOISE.match(text):
            return False
        if not self.pytest:
            return True
        if PYTEST_SHOWN.search(text):
            self.kept.append(text)
            return True
        return False


# --- running ------------------------------------------------------------------------------------


class Check:
    def __init__(self, args) -> None:
        self.args = args
        self.start = time.monotonic()
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "gpu_check.log", "a", buffering=1)
        self.records: list[Record] = []
        self.install: dict = {}
        self.env = child_env(args.smoke)

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        """gpu_check.json, rewritten after every part (a cut run keeps the parts it finished)."""
        payload = {
            "smoke": self.args.smoke,
            "budget_s": self.args.budget,
            "elapsed_s": round(time.monotonic() - self.start, 1),
            "install": self.install,
            "parts": [vars(r) for r in self.records],
        }
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(self.out / "gpu_check.json")

    def run(
        self, argv: list[str], limit_s: float, show: Filter, env: dict[str, str] | None = None
    ) -> tuple[int | None, bool, float]:
        """One child process (its own process group), its output logged and filtered live;
        SIGTERM at `limit_s`, SIGKILL GRACE_S later. (exit code, timed out, seconds)."""
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=env or self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        assert proc.stdout is not None

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                self.log.write(line)
                if show.shown(line):
                    print(line.rstrip("\n")[:400], flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                stop(proc, signal.SIGKILL)
                proc.wait()
        reader.join(5)
        return proc.returncode, timed_out, time.monotonic() - t0

    def do_install(self) -> None:
        """The packages the parts need, from .whl/ where they do not import yet."""
        rec = Record("install", command=f"pip install --target {SITE} {WHEELS}/*")
        self.records.append(rec)
        self.say(f"\n== install (at {self.elapsed():.0f} s)")
        t0 = time.monotonic()
        self.gpu()
        missing = self.probe()
        notes = []
        if missing:
            wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
            sdists = sorted(str(p) for p in WHEELS.glob("deepspeed-*.tar.gz"))
            pip = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
            pip += ["--upgrade", "--target", str(SITE)]
            if not wheels and not sdists:
                notes.append("no .whl/: run scripts/gpu-wheels.sh where PyPI is reachable, and carry .whl")
            if wheels:  # all of them: DeepSpeed's build may need `wheel` from there
                rc, timed_out, _ = self.run(pip + wheels, max(30.0, min(60.0, self.left() / 4)), Filter())
                notes.append(f"wheels: {'ok' if rc == 0 else f'FAILED (exit {rc}, timed out {timed_out})'}")
            if sdists and "deepspeed" in missing:
                # No ops built (they JIT-compile when used; the trainer uses none), and no CUDA
                # probing: a build that depends on the machine's nvcc is one more way to fail.
                env = dict(self.env, DS_BUILD_OPS="0", DS_IGNORE_CUDA_DETECTION="1", DS_SKIP_CUDA_CHECK="1")
                limit = max(30.0, min(120.0, self.left() / 3))
                rc, timed_out, _ = self.run(pip + ["--no-build-isolation", sdists[-1]], limit, Filter(), env)
                notes.append(f"DeepSpeed sdist: {'ok' if rc == 0 else f'FAILED (exit {rc}, timed out {timed_out})'}")
            missing = self.probe()
            if "deepspeed" in missing and (moved := quarantine(SITE, "deepspeed")):
                # A DeepSpeed that installed but does not import would still be found by
                # accelerate's checks, which transformers runs in save_pretrained: every side fails.
                notes.append(f"a DeepSpeed that does not import moved out of the way: {', '.join(moved)}")
        self.install = {"missing_after": missing, "notes": notes, "deepspeed": "deepspeed" not in missing}
        rec.status = "ok" if not missing else "failed"
        rec.note = "; ".join(notes) or "nothing to install: every package imports"
        if missing:
            rec.note += "; still missing: " + ", ".join(f"{m} ({e})" for m, e in missing.items())
        rec.seconds = round(time.monotonic() - t0, 1)
        self.say(f"install: {rec.status}: {rec.note}")
        self.save()

    def probe(self) -> dict[str, str]:
        """The modules the parts need that do not import (bench/gpu_probe.py), with the first
        line of each one's error; the versions found go to the output."""
        env = dict(self.env, DS_ACCELERATOR="cpu") if self.args.smoke else self.env
        cmd = [sys.executable, "-m", "bench.gpu_probe"]
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return {m: "the import check timed out" for m in MODULES}
        self.log.write(done.stdout + done.stderr)
        found = [ln for ln in done.stdout.splitlines() if ln.startswith('{"missing"')]
        if not found:
            return {m: f"the import check failed (exit {done.returncode})" for m in MODULES}
        probe = json.loads(found[-1])
        self.say(probe["versions"])
        return probe["missing"]

    def gpu(self) -> None:
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
            self.say(smi.stdout.strip() or smi.stderr.strip())

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def do_part(self, part: Part) -> None:
        rec = Record(part.name)
        self.records.append(rec)
        if part.needs_deepspeed and not self.install.get("deepspeed"):
            reduced, rec.note = without_deepspeed(part)
            if reduced is None:
                rec.status = "skipped"
                self.say(f"\n== {part.name}: {rec.note}")
                self.save()
                return
            part = reduced
        rec.command = shlex.join(["python", *part.argv])
        cap = part.cap_s * (SMOKE_CAP_FACTOR if self.args.smoke else 1)
        limit = part_timeout(cap, self.left())
        if limit is None:
            rec.status, rec.note = (
                "skipped",
                f"skipped: {max(0, self.left()):.0f} s left of the {self.args.budget} s budget",
            )
            self.say(f"\n== {part.name}: {rec.note}")
            self.save()
            return
        rec.timeout_s = round(limit)
        self.say(f"\n== {part.name} (at {self.elapsed():.0f} s, up to {limit:.0f} s): {rec.command}")
        if rec.note:
            self.say(rec.note)
        show = Filter(pytest=part.pytest)
        rc, timed_out, took = self.run(part.argv, limit, show)
        rec.rc, rec.seconds = rc, round(took, 1)
        rec.status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        if part.result:
            path = self.out / f"{part.result}.json"
            if path.is_file():
                report = json.loads(path.read_text())
                rec.verdict_lines = report.get("verdict_lines", [])
                if "sides" in report:
                    rec.summary_lines = [sides_line(part.name, report["sides"])]
            else:
                rec.note = (rec.note + "; " if rec.note else "") + f"no {path.name} written"
        if part.pytest:
            rec.summary_lines = show.kept[:8] + (
                [f"... {len(show.kept) - 8} more in the log"] if len(show.kept) > 8 else []
            )
        self.say(f"== {part.name}: {rec.status} in {took:.0f} s" + (f" (exit {rc})" if rc else ""))
        self.save()

    def summary(self) -> None:
        self.say(f"\n== summary ({self.elapsed():.0f} s of the {self.args.budget} s budget; all in {self.out})")
        for r in self.records:
            extra = f"  {r.note}" if r.note else ""
            self.say(f"{r.name:>14}  {r.status:<8} {r.seconds:6.0f} s{extra}"[:300])
        for r in self.records:
            for line in r.summary_lines + r.verdict_lines:
                self.say(line[:300])
        self.save()


def quarantine(site: Path, package: str) -> list[str]:
    """Move `package` (and its dist-info) out of `site` into a folder beside it; what was moved."""
    found = sorted(p for p in site.glob(f"{package}*") if p.name == package or p.name.startswith(f"{package}-"))
    if not found:
        return []
    aside = site.with_name(site.name + "-broken")
    aside.mkdir(parents=True, exist_ok=True)
    for p in found:
        target = aside / p.name
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        p.rename(target)
    return [p.name for p in found]


def sides_line(name: str, sides: dict[str, dict]) -> str:
    """One line of a trainer part's sides: tokens/s, × stock, MFU, peak memory, or the error."""
    parts = []
    for side, r in sides.items():
        if "error" in r:
            parts.append(f"{side} FAILED ({r['error'][:60]})")
            continue
        text = f"{side} {r['tokens_per_second']:,.0f} tok/s"
        if r.get("vs_stock") is not None and side != "stock":
            text += f" {r['vs_stock']:.2f}×"
        if r.get("mfu") is not None:
            text += f" MFU {r['mfu']:.0%}"
        if r.get("peak_memory_gb") is not None:
            text += f" {r['peak_memory_gb']:.0f} GB"
        parts.append(text)
    return f"{name}: " + " | ".join(parts)


def stop(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def child_env(smoke: bool) -> dict[str, str]:
    paths = [str(SITE), str(ROOT)] + [
        str(ROOT / p) for p in ("operator", "services/generator", "services/preprocessor", "services/trainer", "cli")
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env |= {
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' loading bars too
        "TRANSFORMERS_VERBOSITY": "error",
    }
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="on CPU: tiny shapes, gloo (checks the script)")
    ap.add_argument(
        "--budget", type=int, help=f"seconds for everything, install included ({BUDGET_S}; smoke {SMOKE_BUDGET_S})"
    )
    ap.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated, of {', '.join(PART_NAMES)}")
    ap.add_argument("--out", type=Path, help="where the log and JSON go (default $OUT, else a temporary folder)")
    args = ap.parse_args(argv)
    args.part_list = [p for p in args.parts.split(",") if p]
    if unknown := [p for p in args.part_list if p not in PART_NAMES]:
        ap.error(f"--parts: unknown {unknown} (of {', '.join(PART_NAMES)})")
    if args.budget is None:
        args.budget = SMOKE_BUDGET_S if args.smoke else BUDGET_S
    if args.budget < MIN_PART_S:
        ap.error(f"--budget: at least {MIN_PART_S} s")
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check = Check(args)
    check.say(
        f"GPU check{' (smoke: CPU)' if args.smoke else ''}: budget {args.budget} s, parts {','.join(args.part_list)};"
        f" log and JSON in {check.out}"
    )

    def cut(signum, frame) -> None:  # the device tool's limit: say so in the JSON, then go
        check.say(f"\n== stopped by signal {signum} at {check.elapsed():.0f} s")
        check.save()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, cut)
    check.do_install()
    for part in plan(args.smoke, check.out):
        if part.name in args.part_list:
            check.do_part(part)
    check.summary()
    bad = [r.name for r in check.records if r.status not in ("ok", "skipped")]
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
