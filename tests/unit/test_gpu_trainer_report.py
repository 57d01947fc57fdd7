"""Benchmark 6's report (bench/gpu_trainer.py) loses nothing when a side fails: every side's
result or error (any exception, not only out of memory) is kept, the JSON with the verdict so far
is written after every side, a VERDICT line comes even when stock HF failed, SIGTERM (the GPU
check's budget) stops the side in progress and keeps the rest, and the memory verdict says
FITS/OOM against the cap. The sides run for real on CPU (`--smoke`); a failure is injected by
making one side's build raise."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench import gpu_trainer
from bench.gpu_trainer_report import memory_verdicts, verdict

TARGETS = (1.5, 0.20)


def side(tokens_per_second, vs_stock=None, mfu=None, **more):
    return {"seconds": {"median": 1.0}, "tokens_per_second": tokens_per_second, "vs_stock": vs_stock, "mfu": mfu} | more


def test_the_verdict_is_the_fastest_project_side_against_stock_and_its_mfu():
    sides = {"stock": side(100.0, 1.0, 0.1), "plain": side(160.0, 1.6, 0.16), "zero1": side(140.0, 1.4, 0.25)}
    v, lines = verdict("0.5B", sides, TARGETS)
    assert v == {"best_side": "plain", "vs_stock": 1.6, "mfu": 0.16, "ratio_met": True, "mfu_met": False}
    assert lines == [
        "VERDICT 0.5B: best project side plain: 1.60× stock HF (target ≥ 1.5×: met), MFU 16.0% (target ≥ 20%: MISSED)"
    ]


def test_a_verdict_comes_when_stock_failed_with_its_cause():
    sides = {"stock": {"error": "out of memory: CUDA out of memory"}, "zero1": side(140.0, None, 0.31)}
    v, lines = verdict("1.5B", sides, (1.5, 0.30))
    assert v["ratio_met"] is None and v["mfu_met"] is True
    assert lines == [
        "VERDICT 1.5B: best project side zero1: × stock HF unknown (stock failed: out of memory: CUDA out of memory;"
        " target ≥ 1.5×), MFU 31.0% (target ≥ 30%: met)"
    ]


def test_a_verdict_comes_when_no_project_side_ran():
    sides = {"stock": side(100.0, 1.0), "zero1": {"error": "RuntimeError: NCCL error"}}
    v, lines = verdict("1.5B", sides, TARGETS)
    assert v["best_side"] is None
    assert lines == ["VERDICT 1.5B: no project side ran (zero1: RuntimeError: NCCL error): both targets unknown"]
    assert verdict("1.5B", sides, None) == (None, [])  # no --targets, no verdict


def test_memory_verdicts_say_fits_oom_or_unknown_per_side():
    sides = {
        "zero1": side(1.0, peak_memory_gb=61.2, peak_reserved_gb=63.9),
        "zero3": {"error": "out of memory: CUDA out of memory", "peak_memory_gb": 79.9},
        "plain": {"error": "RuntimeError: boom"},
        "stock": side(1.0),  # on CPU: no memory figures
    }
    assert memory_verdicts("1.5B-16k", sides, 80.0) == [
        "VERDICT 1.5B-16k memory: zero1 FITS in 80 GB (peak 63.9 GB reserved, 61.2 GB allocated)",
        "VERDICT 1.5B-16k memory: zero3 OOM at 80 GB (peak 79.9 GB allocated)",
        "VERDICT 1.5B-16k memory: plain unknown (RuntimeError: boom)",
        "VERDICT 1.5B-16k memory: stock unknown (no GPU memory figures on CPU)",
    ]


def run_main(monkeypatch, tmp_path, sides, fail):
    """gpu_trainer.main on CPU (--smoke) with `fail[side]()` called in that side's build; the JSON
    as it stood when each side began."""
    build, run = gpu_trainer.Bench.build, gpu_trainer.Bench.run
    before: dict[str, dict | None] = {}

    def failing_build(self, side):
        if side in fail:
            fail[side]()
        return build(self, side)

    def recording_run(self, side, profile):
        path = tmp_path / "gpu_trainer-smoke.json"
        before[side] = json.loads(path.read_text()) if path.exists() else None
        return run(self, side, profile)

    monkeypatch.setattr(gpu_trainer.Bench, "build", failing_build)
    monkeypatch.setattr(gpu_trainer.Bench, "run", recording_run)
    gpu_trainer.main(["--smoke", "--sides", sides, "--targets", "1.5,0.2", "--results-dir", str(tmp_path)])
    return json.loads((tmp_path / "gpu_trainer-smoke.json").read_text()), before


def test_any_error_is_that_sides_result_and_the_json_is_written_after_every_side(monkeypatch, tmp_path, capsys):
    def crash():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")

    report, before = run_main(monkeypatch, tmp_path, "stock,plain", {"stock": crash})
    assert before["stock"] is None  # nothing yet
    assert list(before["plain"]["sides"]) == ["stock"]  # written after stock, before plain began
    assert report["sides"]["stock"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert report["sides"]["plain"]["tokens_per_second"] > 0  # the next side ran
    assert report["verdict_lines"] == [
        "VERDICT smoke: best project side plain: × stock HF unknown (stock failed: RuntimeError: CUDA error: an illegal"
        " memory access was encountered; target ≥ 1.5×), MFU unknown (no peak for this device; target ≥ 20%)"
    ]
    printed = capsys.readouterr()
    assert report["verdict_lines"][0] in printed.out
    assert "stock: FAILED after" in printed.out and "Traceback" in printed.err  # the whole cause, for the log


def test_sigterm_stops_the_side_in_progress_and_keeps_the_others(monkeypatch, tmp_path):
    def budget_runs_out():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        run_main(monkeypatch, tmp_path, "stock,plain,zero1", {"plain": budget_runs_out})
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is the benchmark's own, while it runs
    report = json.loads((tmp_path / "gpu_trainer-smoke.json").read_text())
    assert list(report["sides"]) == ["stock", "plain"]  # zero1 never began
    assert report["sides"]["stock"]["tokens_per_second"] > 0
    assert report["sides"]["plain"]["error"].startswith("stopped: SIGTERM")


@pytest.mark.parametrize(
    ("total", "fraction", "cap"),
    [
        (150.0e9, 80 / 150, 80.0),  # an H200 (141 GB): capped, so a fit means an 80 GB GPU's
        (85.0e9, 80 / 85, 80.0),  # an H100 80GB offers ~85 GB of 10^9 bytes: capped a little
        (40.0e9, None, 40.0),  # a smaller GPU: its own memory is the limit
    ],
)
def test_gpu_memory_is_capped_where_the_gpu_has_more(monkeypatch, total, fraction, cap):
    calls = []

    class Props:
        total_memory = total

    monkeypatch.setattr(gpu_trainer.torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(gpu_trainer.torch.cuda, "set_per_process_memory_fraction", lambda f: calls.append(f))
    got = gpu_trainer.cap_memory(80.0)
    assert got == {"device_memory_gb": total / 1e9, "memory_cap_gb": pytest.approx(cap)}
    assert calls == ([] if fraction is None else [pytest.approx(fraction)])


def test_a_side_that_finds_the_gpu_context_broken_is_recorded_not_fatal(monkeypatch, tmp_path):
    """After a CUDA error the context stays broken and even freeing memory raises: the next side
    records that error instead of ending the run."""
    calls = []

    def free(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return None

    monkeypatch.setattr(gpu_trainer.Bench, "free", free)
    report, _ = run_main(monkeypatch, tmp_path, "stock,plain", {})
    assert report["sides"]["stock"]["tokens_per_second"] > 0
    assert report["sides"]["plain"] == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}


def test_the_profile_counts_the_runtime_calls_that_can_make_the_host_wait():
    waits = [n for n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaHostAlloc",
                         "cudaFreeHost", "cudaMalloc", "cudaLaunchKernel", "cudaEventRecord", "aten::copy_")
             if gpu_trainer.HOST_WAITS.match(n)]  # fmt: skip
    assert waits == ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaHostAlloc",
                     "cudaFreeHost", "cudaMalloc"]  # fmt: skip
