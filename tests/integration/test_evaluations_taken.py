"""Trainer rank 0 takes the generators' evaluation rows (the best version kept, the trackers, the
final evaluation it waits for) from the job's METRICS stream, going on after the last it took: a
row published while the trainer was down (killed, restarting) is taken by the restarted one, and
no row twice. It listened live before, and missed them: best/ skipped a version, and a final row
missed cost the 300 s wait. Real nats-server, real NatsBridge, Reporter and Output."""

from __future__ import annotations

import time

from pipelinerl import messages as m
from pipelinerl.contracts import ServiceEnv
from pipelinerl.spec import parse_job


def test_rows_published_while_the_trainer_was_down_are_taken_after_its_restart_and_none_twice(nats_server, tmp_path):
    from pipelinerl_trainer.bridge import NatsBridge
    from pipelinerl_trainer.output import Output
    from pipelinerl_trainer.reporting import Board, Reporter

    job = parse_job({"metadata": {"name": "evals"}, "spec": {"eval": {"interval": 2}}})
    env = ServiceEnv("trainer", nats_url=nats_server.url)
    out, run = tmp_path / "output", tmp_path / "run"
    run.mkdir()
    taken: list[int] = []

    def start() -> tuple[NatsBridge, Reporter]:
        bridge = NatsBridge(job, env, "trainer-0")
        output = Output(out, keep_best=True)
        evaluated = output.evaluated
        output.evaluated = lambda version, accuracy: taken.append(version) or evaluated(version, accuracy)
        reporter = Reporter(job, 0, run, Board(0, 6), bridge, output, bridge.store_identity().id)
        return bridge, reporter

    def evaluation(version: int, accuracy: float, final: bool = False) -> m.Metrics:
        values = {"version": version, "accuracy": accuracy, "problems": 8, "final": final}
        return m.Metrics(source="generator-0", kind="eval", values=values, timestamp=time.time())

    for version in (2, 4, 6):
        (out / ".candidates" / f"version-{version}").mkdir(parents=True)
    bridge, reporter = start()
    try:
        bridge.publish(job.subjects.metrics("eval"), evaluation(2, 0.25))
        deadline = time.monotonic() + 10
        while not taken and time.monotonic() < deadline:
            reporter.take_evaluations()
        assert taken == [2] and reporter.output.best == {"version": 2, "accuracy": 0.25}
        # The trainer dies; the generators evaluate on: version 4, then the final one.
        bridge.publish(job.subjects.metrics("eval"), evaluation(4, 0.5))
        bridge.publish(job.subjects.metrics("eval"), evaluation(6, 0.375, final=True))
    finally:
        bridge.close()

    bridge, reporter = start()
    try:
        began = time.monotonic()
        reporter.take_evaluations(wait_for_final=True)
        assert time.monotonic() - began < 10  # the final row was there: no wait for it
        assert taken == [2, 4, 6]  # each once, in order, those of the dead trainer's downtime too
        assert reporter.output.best == {"version": 4, "accuracy": 0.5} and (out / "best").exists()
        assert not list((out / ".candidates").iterdir())  # every candidate settled
    finally:
        bridge.close()


def test_a_best_copy_the_disk_refuses_costs_the_run_the_copy_not_the_run(nats_server, tmp_path, caplog):
    """The output's volume full as a version is promoted: said, naming the folder; the row is
    taken all the same (raised, it stopped the trainer, and every restart took the same row again)."""
    from pipelinerl_trainer.bridge import NatsBridge
    from pipelinerl_trainer.output import BEST_FILE, Output
    from pipelinerl_trainer.reporting import Board, Reporter

    job = parse_job({"metadata": {"name": "full"}, "spec": {"eval": {"interval": 2}}})
    out, run = tmp_path / "output", tmp_path / "run"
    run.mkdir()
    candidate = out / ".candidates" / "version-2"
    candidate.mkdir(parents=True)
    (candidate / BEST_FILE).symlink_to("/dev/full")  # every write: ENOSPC
    bridge = NatsBridge(job, ServiceEnv("trainer", nats_url=nats_server.url), "trainer-0")
    try:
        reporter = Reporter(job, 0, run, Board(0, 6), bridge, Output(out, keep_best=True), bridge.store_identity().id)
        values = {"version": 2, "accuracy": 0.5, "problems": 8, "final": False}
        row = m.Metrics(source="generator-0", kind="eval", values=values, timestamp=time.time())
        bridge.publish(job.subjects.metrics("eval"), row)
        deadline = time.monotonic() + 10
        while not reporter._evals_taken() and time.monotonic() < deadline:
            reporter.take_evaluations()
        assert reporter._evals_taken() > 0 and reporter.output.best is None
        assert f"version 2 not taken as the best in {out}" in caplog.text and "No space left" in caplog.text
    finally:
        bridge.close()
