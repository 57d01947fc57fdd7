"""Multi-GPU trainer pods (pipelinerl/pod_ranks.py): each rank's environment, and the supervisor
run on real child processes (a failing rank stops the pod's others and fails the pod; ranks
stopped with their gang, or signalled, end on their own)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from pipelinerl.contracts import STOPPED_EXIT
from pipelinerl_cli import pod_ranks
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


def test_trainer_ranks_stopped_with_their_gang_end_the_pod_once_all_have(tmp_path):
    """A rank stopped before the end (STOPPED_EXIT, its gang stopped) is no failure: its siblings,
    which heard the same word, finish their stop checkpoints, and the pod then exits with it."""
    script = (
        "import os, sys, time; r = os.environ['PIPELINERL_LOCAL_RANK']; time.sleep(0 if r == '0' else 2);"
        f" open(os.path.join({str(tmp_path)!r}, r), 'w').close(); sys.exit({STOPPED_EXIT})"
    )
    assert run_pod_ranks([sys.executable, "-c", script], POD) == STOPPED_EXIT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]  # none cut short


def test_a_signalled_pod_waits_for_its_ranks_to_wind_down(tmp_path, monkeypatch):
    """SIGTERM to the pod: every rank gets it and winds down on its own (a stop checkpoint), past
    STOP_GRACE_S: the pod waits for them, up to SIGNALLED_WAIT_S, rather than killing them."""
    monkeypatch.setattr(pod_ranks, "STOP_GRACE_S", 0.5)
    script = (
        "import os, signal, sys, time; asked = []; signal.signal(signal.SIGTERM, lambda *_: asked.append(1))\n"
        "while not asked: time.sleep(0.05)\n"
        f"time.sleep(2); open(os.path.join({str(tmp_path)!r}, os.environ['PIPELINERL_LOCAL_RANK']), 'w').close()\n"
        f"sys.exit({STOPPED_EXIT})"
    )
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert run_pod_ranks([sys.executable, "-c", script], POD) == STOPPED_EXIT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]


def test_ranks_that_do_not_wind_down_in_time_are_cut_off_and_fail_the_pod(monkeypatch):
    """Signalled, a rank that has not ended by SIGNALLED_WAIT_S is stopped: its stop checkpoint
    unwritten, the pod fails (it does not say STOPPED_EXIT, which says the checkpoint is there)."""
    monkeypatch.setattr(pod_ranks, "SIGNALLED_WAIT_S", 1.0)
    monkeypatch.setattr(pod_ranks, "STOP_GRACE_S", 0.5)
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, lambda *_: None); print('up', flush=True); time.sleep(600)"
    )
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    assert run_pod_ranks([sys.executable, "-c", script], POD) == 1
    assert time.monotonic() - t0 < 15
