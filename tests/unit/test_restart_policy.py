"""The local runner's restart policy (pure): backoff that doubles up to a cap, a limit, fail-stop,
no restart of a job that cannot run; and how it names a failure, in its own output."""

import pytest

from pipelinerl_cli.supervisor import CANNOT_RUN, RestartPolicy, ServiceDied, cause


def test_backoff_doubles_up_to_the_cap_then_gives_up():
    p = RestartPolicy(limit=6, base_s=1.0, max_s=8.0)
    assert [p.delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, None]


def test_fail_stop_never_restarts():
    assert RestartPolicy(on_failure=False).delay(0) is None


def test_limit_zero_is_fail_stop_too():
    assert RestartPolicy(limit=0).delay(0) is None


def test_a_service_that_cannot_run_the_job_is_not_restarted():
    # `pipelinerl service` exits 2 for a job it cannot run (its "error: ..."): it would fail again.
    assert RestartPolicy(limit=3).delay(0, code=CANNOT_RUN) is None
    assert RestartPolicy(limit=3).delay(0, code=1) == 1.0
    assert "cannot run as written" in str(ServiceDied("generator", CANNOT_RUN, None, ""))  # type: ignore[arg-type]


def test_a_trainer_rank_stopped_with_its_gang_is_started_again_as_no_failure():
    """STOPPED_EXIT: its checkpoint written, it resumes from there (as the operator, which counts no
    failure for it), whatever the policy and the failures before."""
    from pipelinerl.contracts import STOPPED_EXIT

    for policy in (RestartPolicy(limit=3), RestartPolicy(on_failure=False), RestartPolicy(limit=0)):
        assert policy.delay(5, code=STOPPED_EXIT) == policy.base_s


def test_a_failure_is_named_by_the_last_exception_its_log_shows():
    log = """Traceback (most recent call last):
  File "x.py", line 3, in <module>
    raise KeyError("a")
KeyError: 'a'

During handling of the above exception, another exception occurred:
  File "y.py", line 9, in main
nats.errors.NoServersError: nats: no servers available for connection
(EngineCore pid=12) INFO shutting down"""
    assert cause(log) == "nats.errors.NoServersError: nats: no servers available for connection"
    assert cause("INFO all good\nready") is None
    # A torch.distributed rank's lines carry its prefix: the exception is named without it.
    assert cause("[rank0]:     raise ValueError(\n[rank0]: ValueError: Unrecognized model") == (
        "ValueError: Unrecognized model"
    )
    # The command line's own "error: ..." for a job it cannot run (a SpecError, exit code 2).
    spec_error = "INFO loading the tokenizer\nerror: spec.model.maxSeqLen: 12 leaves no room for a completion"
    assert cause(spec_error) == "spec.model.maxSeqLen: 12 leaves no room for a completion"


def test_the_runner_names_why_a_service_exited_in_its_own_output(tmp_path, capsys):
    from pipelinerl.spec import parse_job
    from pipelinerl_cli.local import LocalRun

    run = LocalRun(parse_job({"metadata": {"name": "t"}}), tmp_path, quiet=True)
    log = tmp_path / "generator.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\nValueError: no tokenizer in /models/x\n")
    assert run._backoff("generator", 0, 1, log) == 1.0
    assert (
        "generator exited with code 1 (ValueError: no tokenizer in /models/x): restarting it in 1s (restart 1 of 3)"
        in capsys.readouterr().err
    )
    log.write_text("INFO starting\nerror: spec.model.maxSeqLen: 12 leaves no room for a completion\n")
    with pytest.raises(ServiceDied, match="generator exited with code 2 \\(the job cannot run as written") as died:
        run._backoff("generator", 0, CANNOT_RUN, log)
    assert cause(died.value.tail) == "spec.model.maxSeqLen: 12 leaves no room for a completion"


class Exited:
    """A service process as the runner sees it, exited with `code` (None: running)."""

    def __init__(self, name: str, role: str, code: int | None, log) -> None:
        self.name, self.role, self.log_path = name, role, log
        self.proc = type("Proc", (), {"poll": lambda _self: code})()
        self.restart_at, self.failures, self.restarts = None, 0, 0

    def reap(self) -> None:
        pass


def test_a_service_that_exits_0_before_the_runs_end_is_restarted_and_after_it_is_not(tmp_path, capsys):
    """A generator stopped by a signal (`kill` of its pid) exits 0 as at the run's end: restarted,
    as Kubernetes restarts a container whatever its code, once EARLY_EXIT_S passed with no word
    here of the trainer's announcement of its last step (this run's consumer may lag after a NATS
    restart; a finished run resumed hears it at once; a trainer restarted after its final
    checkpoint announces it again, with no row of the last step)."""
    from pipelinerl_cli import local
    from pipelinerl.spec import parse_job
    from pipelinerl_cli.local import LocalRun

    run = LocalRun(parse_job({"metadata": {"name": "t"}, "spec": {"trainer": {"maxSteps": 5}}}), tmp_path, quiet=True)
    (log := tmp_path / "generator.log").write_text("INFO stopped\n")
    trainer, generator = Exited("trainer", "trainer", None, log), Exited("generator", "generator", 0, log)
    run.services = [trainer, generator]  # type: ignore[list-item]
    run.train = [{"step": 5}]  # the last step's row alone says nothing: the announcement comes after it
    assert not run.check_services() and generator.restart_at is None  # the end may be announced yet
    run.exited_at["generator"] -= local.EARLY_EXIT_S
    assert not run.check_services()
    assert generator.restart_at is not None and generator.restarts == generator.failures == 1
    assert "generator exited with code 0: restarting it in 1s (restart 1 of 3)" in capsys.readouterr().err
    ended = Exited("generator", "generator", 0, log)
    run.services, run.train, run.announced_end = [trainer, ended], [], True  # type: ignore[list-item]
    assert not run.check_services() and ended.restart_at is None  # the end announced: left as it is


class FakeNats:
    """nats-server as the runner supervises it: exits with `code`; a start that fails while `broken`."""

    def __init__(self, store_dir) -> None:
        self.store_dir, self.code, self.broken, self.starts, self.url = store_dir, None, False, 0, "nats://x"
        self.proc = type("Proc", (), {"poll": lambda _s: self.code, "returncode": property(lambda _s: self.code)})()
        self.proc.pid = 1

    def start(self) -> None:
        self.starts += 1
        if self.broken:
            self.code = 1
            raise RuntimeError("nats-server exited with 1")
        self.code = None

    problem = ""

    def jetstream_problem(self) -> str:
        return self.problem

    def stop(self) -> None:
        self.code = -15


def test_nats_server_crashes_are_counted_apart_from_restarts_for_a_full_disk_and_a_panic_is_a_crash(tmp_path, capsys):
    """nats-server's restarts for a JetStream that could not write (a disk that had been full) do
    not use up its crashes' allowance; its exit 2 is a Go panic (restarted, never "the job cannot
    run as written"); a restart that fails to start is a crash too, restarted after a backoff,
    until the policy gives up: ServiceDied, not hopeless (the run exits 1)."""
    from pipelinerl.spec import parse_job
    from pipelinerl_cli.local import LocalRun

    nats = FakeNats(tmp_path)
    (tmp_path / "nats.log").write_text("panic: runtime error\n")
    run = LocalRun(parse_job({"metadata": {"name": "t"}}), tmp_path, quiet=True, nats=nats)  # type: ignore[arg-type]
    run.nats_restarts = run.nats_health_restarts = 3  # the disk was full three times
    nats.code = CANNOT_RUN  # a panic
    run._check_nats()
    assert (
        run.nats_restart_at is not None
        and "nats-server exited with code 2: restarting it in 1s (restart 1 of 3)" in (capsys.readouterr().err)
    )
    nats.broken = True
    for restart in (2, 3):
        run.nats_restart_at = 0.0  # due
        run._check_nats()  # starts, fails: scheduled again
        assert run.nats_restart_at is not None and f"(restart {restart} of 3)" in capsys.readouterr().err
    run.nats_restart_at = 0.0
    with pytest.raises(ServiceDied, match="nats-server exited with code 1$") as died:
        run._check_nats()
    assert not died.value.hopeless and nats.starts == 3


def test_a_restart_for_a_disk_that_had_been_full_that_fails_to_start_is_a_crash_restarted_after_a_backoff(
    tmp_path, capsys
):
    """JetStream that could not write is restarted once its disk has room; a start that fails then
    (it died starting, or never listened) is a crash like any other, not the run's end."""
    from pipelinerl.spec import parse_job
    from pipelinerl_cli.local import LocalRun

    nats = FakeNats(tmp_path)
    (tmp_path / "nats.log").write_text("[ERR] JetStream write error\n")
    run = LocalRun(parse_job({"metadata": {"name": "t"}}), tmp_path, quiet=True, nats=nats)  # type: ignore[arg-type]
    nats.problem, nats.broken = "JetStream stream write error", True
    run._check_jetstream(0.0)
    assert nats.starts == 1 and run.nats_restart_at is not None
    assert (run.nats_restarts, run.nats_health_restarts) == (2, 1)
    assert "did not start again" in capsys.readouterr().err
