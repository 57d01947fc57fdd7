"""`pipelinerl plan --calibrate-from` on a real `pipelinerl run` folder: a short job (random
tiny model, real vLLM, DeepSpeed and NATS), then the plan from what it left behind: its
metrics.jsonl and summary.json, and the micro-batches its NATS store still holds."""

import json

import pytest

from jobs import tiny_job  # tests/e2e/jobs.py

from pipelinerl.planner.calibration import load_calibration
from pipelinerl.planner.pilot import derive_calibration, train_rows
from pipelinerl.spec import load_job, parse_job
from pipelinerl_cli.calibrate_from import calibration_from_run
from pipelinerl_cli.local import run_local
from pipelinerl_cli.main import main

pytestmark = pytest.mark.slow


def test_plan_calibrates_from_a_local_run_folder(tmp_path, capsys):
    run = tmp_path / "pilot"
    assert run_local(parse_job(tiny_job("pilot", trainer={"maxSteps": 6})), run, quiet=True) == 0
    capsys.readouterr()
    rows = train_rows((run / "metrics.jsonl").read_text())
    summary = json.loads((run / "summary.json").read_text())
    pilot = load_job(run / "job.yaml")

    calib, report = calibration_from_run(str(run), pilot)
    # Every trained sample's completion length, read back from the run's BATCHES stream (each
    # step's micro-batches are kept for a resumed trainer to replay).
    assert calib.lengths.distribution == "empirical"
    assert len(calib.lengths.values) == sum(r["samples"] for r in rows)
    assert sum(calib.lengths.values) == sum(r["tokens"] for r in rows)
    # The rest from the files, as the pure derivation reads them.
    expected, _ = derive_calibration(
        rows, pilot, load_calibration("cpu-tiny"), calib.lengths.values, summary, where=str(run)
    )
    assert calib == expected
    assert "the stored micro-batches" in report and "generator_busy_fraction" in report

    job_file = run / "job.yaml"
    assert main(["plan", str(job_file), "--gpus", "2", "--max-k", "2", "--calibrate-from", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"calibration from {run}" in err and "recommendation:" in out
