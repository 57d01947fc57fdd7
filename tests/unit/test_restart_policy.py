"""The local runner's restart policy (pure): backoff that doubles up to a cap, a limit, fail-stop;
and how it names a failure."""

from pipelinerl_cli.local import RestartPolicy


def test_backoff_doubles_up_to_the_cap_then_gives_up():
    p = RestartPolicy(limit=6, base_s=1.0, max_s=8.0)
    assert [p.delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, None]


def test_fail_stop_never_restarts():
    assert RestartPolicy(on_failure=False).delay(0) is None


def test_limit_zero_is_fail_stop_too():
    assert RestartPolicy(limit=0).delay(0) is None


def test_a_failure_is_named_by_the_last_exception_its_log_shows():
    from pipelinerl_cli.local import cause

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
