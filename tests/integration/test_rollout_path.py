"""Benchmark 12's rollout path (`bench/rollout_path.py`): the tiny job's real path (its task
through the generator's vLLM engine, groups published to a real nats-server, the preprocessor's
step builder taking them) pinned to one core."""

import pytest

from bench.rollout_path import measure

pytestmark = pytest.mark.slow


def test_the_rollout_path_runs_on_one_core_and_says_where_a_samples_time_goes():
    got = measure("examples/tiny-cpu.yaml", groups=48, repeats=1)
    assert got["attempts"] == 8 and len(got["seconds_per_sample"]) == 1
    assert 1 <= got["tokens_per_sample_median"] <= 8  # the job's maxTokens
    assert got["steps_built"] >= 2  # the intake built steps from the groups (about half are filtered)
    cpu = got["cpu_per_sample"][0]
    assert cpu["engine core"] > 0 and cpu["client"] > 0 and "nats-server" in cpu
    # Pinned: every process of the path shares one core, so together they used at most its time.
    assert sum(cpu.values()) <= 1.1 * got["seconds_per_sample_median"]
