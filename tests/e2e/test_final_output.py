"""The trainer killed after its final checkpoint, before the trained model was written out
(`pipelinerl run` in its own process, restarted as its pod would be): the restart finds the run
trained through, writes spec.output's final model (and the exportInterval copy), announces the
run finished and waits for the final evaluation; it never reports success with the job's output
missing."""

from __future__ import annotations

import json

import pytest
from jobs import RUN_TIMEOUT_S, tiny_job  # tests/e2e/jobs.py

from pipelinerl.contracts import Env

pytestmark = pytest.mark.slow


def test_a_trainer_killed_after_its_final_checkpoint_still_writes_the_model_out(start_run, tmp_path):
    steps = 2
    models = tmp_path / "models"
    job = tiny_job(
        "final",
        trainer={
            "maxSteps": steps,
            "exportInterval": steps,
            "env": [{"name": Env.FAILPOINT, "value": "trainer-final-checkpointed"}],
        },
        eval={"interval": steps, "problems": 8},
        output={"path": str(models)},
    )
    run = start_run(job, RUN_TIMEOUT_S)
    run.finish()
    assert run.services()["trainer"]["restarts"] == 1  # the failure point's kill
    assert "resumed from" in (run.dir / "logs" / "trainer.log").read_text()
    assert (models / "final" / "config.json").exists() and (models / "best" / "pipelinerl-best.json").exists()
    assert (run.dir / "checkpoints" / "export" / f"version-{steps}" / "config.json").exists()  # exportInterval's copy
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1]  # step 2's row went with the kill
    final = [r for r in rows if r["kind"] == "eval" and r.get("final")]
    assert [r["version"] for r in final] == [steps]  # the final evaluation ran, on the final weights
