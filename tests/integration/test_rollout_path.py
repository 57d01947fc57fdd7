"""Benchmark 12's rollout path (`bench/rollout_path.py`): the tiny job's real path (its task
through the generator's vLLM engine, groups published to a real nats-server, the preprocessor's
step builder taking them) pinned to one core, with and without the job's weight updates."""

import os

import pytest

from bench.rollout_path import measure

pytestmark = pytest.mark.slow


def test_the_rollout_path_runs_on_one_core_and_says_where_a_samples_time_goes_and_what_an_update_costs():
    trainer_cpu = 1 if (os.cpu_count() or 1) > 1 else 0
    got = measure("examples/tiny-cpu.yaml", groups=64, repeats=1, trainer_cpu=trainer_cpu, per_step=2)
    assert got["attempts"] == 8 and len(got["seconds_per_sample"]) == 1
    assert 1 <= got["tokens_per_sample_median"] <= 8  # the job's maxTokens
    assert got["steps_built"] >= 4  # the intake built steps from the groups (about half are filtered)
    cpu = got["cpu_per_sample"][0]
    assert cpu["engine core"] > 0 and cpu["client"] > 0 and "nats-server" in cpu
    # Pinned: every process of the path shares one core, so together they used at most its time
    # (the weight sender is on the other core).
    on_core = sum(v for k, v in cpu.items() if k != "weight sender")
    assert on_core <= 1.1 * got["seconds_per_sample_median"]
    # The paired run with updates: one sent at each step it built but its last and one after
    # half of each step's groups (`per_step=2`), each applied by the engine before the next run
    # (else `settle` fails it), each send timed by the trainer. Its ~2 steps send 3 or more (when
    # the intake took a run's 64 groups at once, it sent none: every step completed at the end).
    updated = got["with_updates"]
    assert updated["updates"][0] >= 3 and len(updated["sends"]) == updated["updates"][0]
    assert all(s["weight_sync_seconds"] > 0 and s["weight_updates"] == 1 for s in updated["sends"])
    costs = got["update_costs"]
    assert costs["trainer_s"] > 0 and len(costs["generator_s_runs"]) == 1
