"""What every end-to-end test that starts `pipelinerl run` as a process of its own shares."""

import pytest

from bench.run_process import RunProcess


@pytest.fixture
def start_run(tmp_path):
    """`start_run(job, timeout_s)` starts a run in the test's folder; after the test, whatever it
    left running is stopped. A test that failed midway must not leave its job loading the rest of
    the suite (a 1,000-step one ran on for 13 minutes once)."""
    runs: list[RunProcess] = []

    def start(job: dict, timeout_s: float) -> RunProcess:
        runs.append(RunProcess(tmp_path, job, timeout_s))
        return runs[-1]

    yield start
    for run in runs:
        run.abandon()
