"""Whole jobs through `pipelinerl run`'s code path: embedded nats-server, real vLLM (CPU),
real DeepSpeed ranks, real processes. A random tiny model is enough to check the machinery
(versions advance, lag stays within bounds, in-flight updates, checkpoints; resuming a killed
run: test_resume.py; sync mode and resuming a stopped run: test_conventional.py)."""

import json
import re
from pathlib import Path

import pytest
import torch

from jobs import tiny_job  # tests/e2e/jobs.py

from pipelinerl.planner.calibration import load_calibration
from pipelinerl.planner.pilot import derive_calibration, train_rows
from pipelinerl.spec import SpecError, load_job, parse_job
from pipelinerl_cli.calibrate_from import calibration_from_run
from pipelinerl_cli.local import run_local
from pipelinerl_cli.main import main

pytestmark = pytest.mark.slow


def rows(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def run(job: dict, run_dir: Path) -> dict:
    code = run_local(parse_job(job), run_dir, quiet=True)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert code == 0, logs
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> tuple[Path, dict]:
    """One whole run, read by two tests: two ZeRO-3 ranks, and `plan --calibrate-from` its folder."""
    tmp_path = tmp_path_factory.mktemp("zero3")
    caches = tmp_path / "caches"  # what a compile or vLLM's model inspection would leave (see the test)
    # Rows of 128 tokens: several micro-batches per rank and step (sentinels included), over
    # which both ZeRO-3 ranks must gather parameters in lock-step.
    job = tiny_job(
        "pipe",
        rl={"maxLag": 2},
        trainer={"replicas": 2, "zeroStage": 3, "maxSteps": 6, "exportInterval": 3, "microBatchTokens": 128},
        output={"path": str(tmp_path / "models")},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(caches / "inductor"))
        env.setenv("VLLM_CACHE_ROOT", str(caches / "vllm"))
        return tmp_path, run(job, tmp_path)


def test_pipeline_mode_two_deepspeed_ranks_zero3(zero3_run):
    tmp_path, summary = zero3_run
    train = rows(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # versions advance one per step
    assert all(r["lag_max"] <= 2 for r in train) and summary["samples_dropped_for_lag"] == 0
    assert max(r["lag_max"] for r in train) >= 1  # generation really ran ahead of training
    assert all(r["samples"] == 16 for r in train) and all(r["micro_batches"] >= 2 for r in train)
    # Nothing filtered here: the policy's reward (the ledger's sums) is the trained samples' (the ranks' tallies).
    assert all(r["groups_filtered"] == 0 and r["reward"] == pytest.approx(r["reward_trained"]) for r in train)
    # Whether an update lands on running requests here depends on timing (on this CPU the
    # generator outpaces training and idles at the lag bound): test_inflight_update proves it.
    evals = rows(tmp_path, "eval")
    assert evals[0]["version"] == 0 and evals[-1]["final"] and evals[-1]["version"] == 6
    # Each row says which weights its completions were made with: the version's, or newer ones
    # that landed while it ran; the final one's, once training has ended, only the final weights.
    assert all(e["version"] <= e["weights_version_min"] <= e["weights_version_max"] <= 6 for e in evals)
    assert evals[-1]["weights_version_min"] == evals[-1]["weights_version_max"] == 6
    # The generator's engine core was forked from it (one thread then), not spawned: its start
    # skips vLLM's second import (engine.core_start_method).
    assert "engine core: fork" in (tmp_path / "logs" / "generator.log").read_text()
    # Nothing was compiled: not the model (eager on CPU), nor vLLM's sampler (engine.compile_disabled:
    # ~12 s of a generator's first completion on a machine without inductor's cache). vLLM did not
    # inspect the model in a subprocess, which leaves its answer in its cache (register_model_here).
    assert not [p for p in (tmp_path / "caches").rglob("*") if p.is_file()]
    # The final checkpoint holds Hugging Face weights gathered from both ZeRO-3 shards.
    ckpt = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    assert sum(p.numel() for p in model.parameters()) == 3158272
    assert json.loads((ckpt / "state.json").read_text())["step"] == 6
    # Exports every 3 versions, gathered from the shards the same way: version 6's equals the final checkpoint.
    exports = tmp_path / "checkpoints" / "export"
    assert sorted(p.name for p in exports.iterdir()) == ["version-3", "version-6"]
    exported = AutoModelForCausalLM.from_pretrained(exports / "version-6")
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), model.state_dict().values()))
    assert (exports / "version-3" / "tokenizer.json").exists()
    # spec.output: the final weights, and the trained version that evaluated best (the earliest
    # of equals), both gathered from the shards; no candidate left behind.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "final")
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), model.state_dict().values()))
    best = json.loads((tmp_path / "models" / "best" / "pipelinerl-best.json").read_text())
    scores = {e["version"]: e["accuracy"] for e in evals if e["version"] > 0}
    assert best == {
        "version": min(v for v, a in scores.items() if a == max(scores.values())),
        "accuracy": max(scores.values()),
    }
    AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "best")  # (a random model's rewards are all 0:
    # its weights never change, so which version's they are is checked in tests/unit/test_output.py)
    assert not list((tmp_path / "models" / ".candidates").glob("*"))
    assert (tmp_path / "progress.png").stat().st_size > 10_000
    # A clean run logs no error: each rank's NATS thread once ended with two ERRORs ("Task was
    # destroyed but it is pending": nats-py's heartbeat checks, left running by its drain).
    for log in sorted((tmp_path / "logs").glob("*.log")):
        assert not [line for line in log.read_text().splitlines() if " ERROR " in line], log.name


def test_plan_calibrates_from_a_local_run_folder(zero3_run, capsys):
    """`pipelinerl plan --calibrate-from` on the run's folder: its metrics.jsonl and
    summary.json, and the micro-batches its NATS store still holds."""
    run, _ = zero3_run
    rows = train_rows((run / "metrics.jsonl").read_text())
    summary = json.loads((run / "summary.json").read_text())
    pilot = load_job(run / "job.yaml")

    calib, report = calibration_from_run(str(run), pilot)
    # Every trained sample's completion length, read back from the run's BATCHES stream (each
    # step's micro-batches are kept for a resumed trainer to replay), from both ranks.
    assert calib.lengths.distribution == "empirical"
    assert len(calib.lengths.values) == sum(r["samples"] for r in rows)
    assert sum(calib.lengths.values) == sum(r["tokens"] for r in rows)
    # The rest from the files, as the pure derivation reads them.
    expected, _ = derive_calibration(
        rows, pilot, load_calibration("cpu-tiny"), calib.lengths.values, summary, where=str(run)
    )
    assert calib == expected
    assert "the stored micro-batches" in report and "generator_busy_fraction" in report

    capsys.readouterr()
    job_file = run / "job.yaml"
    assert main(["plan", str(job_file), "--gpus", "2", "--max-k", "2", "--calibrate-from", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"calibration from {run}" in err and "recommendation:" in out


def test_a_missing_model_folder_is_refused_before_anything_starts(tmp_path):
    def job(folder):
        return parse_job(tiny_job("nomodel", model={"path": str(folder), "maxSeqLen": 40}))

    with pytest.raises(SpecError, match=r"model\.path: no folder '.*no-such-model'"):
        run_local(job(tmp_path / "no-such-model"), tmp_path / "run", quiet=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="has no config.json"):
        run_local(job(tmp_path / "empty"), tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


def test_a_dying_service_stops_the_run_with_its_log_tail(tmp_path, capsys):
    broken = tmp_path / "broken-model"  # passes the check before the start; no engine can load it
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    job = tiny_job("dies", model={"path": str(broken), "maxSeqLen": 40}, runPolicy={"backoffLimit": 1})
    code = run_local(parse_job(job), tmp_path / "run", quiet=True)  # one restart each, then it stops
    err = capsys.readouterr().err
    assert code == 1
    # The restart names what the process died of; the second failure stops the run.
    assert re.search(
        r"trainer exited with code 1 \(ValueError: Unrecognized model .+\): restarting it in 1s \(restart 1 of 1\)", err
    ), err
    assert "stopping the other services" in err
    assert "broken-model" in err  # the tail of the failing service's own log
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 0  # a stopped run still sums up
    import psutil

    leftovers = [
        p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "run") in " ".join(p.info["cmdline"] or [])
    ]
    assert not leftovers  # every other service was stopped
