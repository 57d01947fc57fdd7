"""Faults of the NATS store that a kill does not model, survived by a running job (`pipelinerl
run` in its own process, as tests/e2e/test_faults.py): the store lost, the store's disk full. Each
asserts the audit's counts: nothing trained twice, nothing dropped beyond lag, every step full.
(A preprocessor paused past its acknowledgement wait: tests/integration/test_preprocessor.py.)"""

from __future__ import annotations

import time

import pytest
from faults import RUN_TIMEOUT_S, SAMPLES, audit_streams, fault_job, on_running_nats  # tests/e2e/faults.py
from jobs import stored  # tests/e2e/jobs.py

from pipelinerl import messages as m

pytestmark = pytest.mark.slow


def test_a_lost_store_stops_the_job_and_recover_store_resumes_it_from_the_checkpoint(start_run, tmp_path):
    """The run's NATS store deleted and nats-server restarted empty (a lost or replaced volume):
    the trainer finds its positions belong to another store and stops the run with StoreLost,
    never restarting silently from zero. `pipelinerl recover-store` makes the new store go on
    from the trainer's checkpoint (step 4), and the run resumes there: steps 5.. again, each full,
    no problem of the checkpoint's lineage drawn again, the metrics history kept."""
    import shutil
    import subprocess
    import sys

    steps, name = 9, "lost"
    job = fault_job(name, steps, trainer={"checkpointInterval": 4})
    first = start_run(job, RUN_TIMEOUT_S)
    first.wait_step(5)  # past the checkpoint of step 4
    from pipelinerl.contracts import JobSubjects
    from pipelinerl.streams import stored_messages

    before = on_running_nats(first, lambda js: stored_messages(js, JobSubjects(name).stream("BATCHES")))
    kept = {mb.step: mb.group_ids for mb in (m.decode(x.data, m.MicroBatch) for x in before)}
    trained_before = {g for step in range(4) for g in kept.get(step, [])}  # the checkpoint's lineage
    rows_before = len(first.train())
    shutil.rmtree(first.dir / "nats")  # the store, from under the running server
    first.kill("nats-server")  # restarted by the runner, empty
    code = first.proc.wait(timeout=RUN_TIMEOUT_S)
    out = first.output()
    assert code != 0 and "StoreLost" in out and "recover-store" in out, out
    assert len(first.train()) < rows_before + 3  # it stopped; no silent restart from step 0 trained on

    recovered = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelinerl_cli",
            "recover-store",
            str(tmp_path / "job.yaml"),
            "--run-dir",
            str(first.dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert recovered.returncode == 0, recovered.stderr
    assert "goes on from the checkpoint of step 4" in recovered.stdout

    second = start_run(job, RUN_TIMEOUT_S)
    second.finish()
    train = second.train()
    resumed = [r for r in train[rows_before:] if r["step"] > 4]
    # Every row before the loss is still in the run's metrics; after the recovery steps 5.. again, each full.
    assert [r["step"] for r in train[:rows_before]] == list(range(1, rows_before + 1))
    assert [r["step"] for r in resumed][-(steps - 4) :] == list(range(5, steps + 1))
    assert all(r["samples"] == SAMPLES for r in resumed)
    batches = [m.decode(x.data, m.MicroBatch) for x in stored(second.dir, name, "BATCHES")]
    assert {mb.step for mb in batches} >= set(range(4, steps))  # the new store starts at the checkpoint's step
    drawn_after = {g for mb in batches for g in mb.group_ids}
    assert not drawn_after & trained_before, "a problem of the checkpoint's lineage was drawn again"
    log = (second.dir / "logs/trainer.log").read_text()
    assert "resumed from" in log


def test_a_full_disk_under_the_store_recovers_by_itself_once_freed(start_run, tmp_path):
    """The NATS store on a small filesystem of its own (a 256 MiB tmpfs the test mounts), filled
    to the last byte for 8 s while the job runs, then freed: JetStream, which goes on refusing
    writes after a write error even once there is room, is restarted by the runner when its
    /healthz says so and its disk has room; the services ride the outage out on their publish
    retries (naming the likely cause), and the run finishes with nothing lost or trained twice."""
    import subprocess

    steps, name = 16, "full"
    store = tmp_path / "run" / "nats"
    store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256M", "tmpfs", str(store)], check=True)
    try:
        run = start_run(fault_job(name, steps), RUN_TIMEOUT_S)
        run.wait_step(4)
        filler = store / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError as err:
                assert err.errno == 28  # ENOSPC: the store's disk is full
        full_at = run.train()[-1]["step"]
        time.sleep(8)
        filler.unlink()
        run.finish()
        train = run.train()
        out = run.output()
        assert "JetStream cannot write" in out and "restarting it, its disk has room again" in out, out
        assert run.services()["nats-server"]["restarts"] >= 1
        assert full_at < steps  # it was mid-run
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert all(r["samples"] == SAMPLES for r in train)
        assert sum(r["dropped_for_lag"] for r in train) == 0
        logs = "".join(p.read_text() for p in (run.dir / "logs").glob("*.log"))
        assert "not acknowledged" in logs and "JetStream unable to write its store" in logs
        audit_streams(run, name, steps, 1)
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
