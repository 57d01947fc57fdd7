"""Multi-GPU trainer pods (pipelinerl/pod_ranks.py): each rank's environment, and the supervisor
run on real child processes (a failing rank stops the pod's others and fails the pod)."""

from __future__ import annotations

import json
import sys
import time

from pipelinerl_cli.pod_ranks import rank_envs, run_pod_ranks

POD = {"PIPELINERL_RANK": "1", "PIPELINERL_RANKS_PER_POD": "4", "PIPELINERL_HTTP_PORT": "8000", "KEEP": "x"}


def test_ranks_of_a_pod_follow_its_index():
    envs = rank_envs(POD)
    assert [e["PIPELINERL_RANK"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["PIPELINERL_LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    # Rank 0 keeps the pod's port (probes, metrics); the others must not collide with it.
    assert [e["PIPELINERL_HTTP_PORT"] for e in envs] == ["8000", "0", "0", "0"]
    assert all(e["PIPELINERL_RANKS_PER_POD"] == "1" and e["KEEP"] == "x" for e in envs)  # no re-spawning


def test_single_rank_pod_is_unchanged():
    (env,) = rank_envs({"PIPELINERL_RANK": "3"})
    assert env["PIPELINERL_RANK"] == "3" and env["PIPELINERL_LOCAL_RANK"] == "0"


def test_all_ranks_run_and_the_pod_succeeds(tmp_path):
    script = (
        "import json, os, sys; json.dump({k: os.environ[k] for k in ('PIPELINERL_RANK', 'PIPELINERL_LOCAL_RANK')},"
        f" open(os.path.join({str(tmp_path)!r}, os.environ['PIPELINERL_LOCAL_RANK']), 'w'))"
    )
    assert run_pod_ranks([sys.executable, "-c", script], POD) == 0
    seen = sorted((json.loads((tmp_path / str(r)).read_text()) for r in range(4)), key=lambda d: d["PIPELINERL_RANK"])
    assert seen == [{"PIPELINERL_RANK": str(4 + r), "PIPELINERL_LOCAL_RANK": str(r)} for r in range(4)]


def test_a_failing_rank_stops_the_others_and_fails_the_pod():
    # Local rank 2 fails; the others would wait for it forever (as in a collective).
    script = (
        "import os, sys, time; r = os.environ['PIPELINERL_LOCAL_RANK']; sys.exit(7) if r == '2' else time.sleep(600)"
    )
    t0 = time.monotonic()
    assert run_pod_ranks([sys.executable, "-c", script], POD) == 7
    assert time.monotonic() - t0 < 30


def test_a_generator_pod_runs_one_engine_per_tensor_parallel_gpus():
    """A generator pod of 4 GPUs at tensorParallel 2: two engines, each a generator of its own on
    its two GPUs (of those the pod sees), none left idle."""
    pod = {"PIPELINERL_RANK": "1", "PIPELINERL_RANKS_PER_POD": "2", "PIPELINERL_HTTP_PORT": "8000"}
    envs = rank_envs(pod, "generator", gpus_per_rank=2)
    assert [(e["PIPELINERL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("2", "0,1"), ("3", "2,3")]
    envs = rank_envs(pod | {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "generator", gpus_per_rank=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in rank_envs(POD))  # a trainer rank picks its GPU itself
