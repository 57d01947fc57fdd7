"""A pod that runs several rank processes: a trainer pod with several GPUs runs one DeepSpeed rank
per GPU, a generator pod with more GPUs than tensorParallel one vLLM engine per tensorParallel
GPUs. Its entrypoint starts that many `pipelinerl service ROLE` processes and supervises them, so
one failing rank fails the pod (and Kubernetes restarts it) instead of leaving the others waiting
in a collective or a generator's GPUs idle.

The operator sets the pod's rank (`ServiceEnv.rank`) to its index and `ranks_per_pod`; rank r of
pod p is global rank p × ranks per pod + r: a trainer rank on GPU r, a generator engine on GPUs
r × tp .. r × tp + tp - 1 (CUDA_VISIBLE_DEVICES). Rank 0 of the pod serves the pod's HTTP port
(probes, /metrics); the others serve on ports of their own choosing.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import threading
import time

from pipelinerl.contracts import STOPPED_EXIT, Env, ServiceEnv
from pipelinerl_cli.processes import dying_with_this_process

log = logging.getLogger("pipelinerl")
POLL_S = 1.0
STOP_GRACE_S = 30.0
# Signalled (or a trainer rank stopped with its gang), the ranks wind down on their own (a
# trainer's stop checkpoint; each ends itself past its service's bound, `runtime.exit_soon`):
# waited for past the pod's grace period, which the kubelet enforces anyway.
SIGNALLED_WAIT_S = 90.0


def rank_envs(env: dict[str, str], role: str = "trainer", gpus_per_rank: int = 1) -> list[dict[str, str]]:
    """The environment of each rank process of this pod (pure: derived from the pod's env). A
    generator engine sees only its own `gpus_per_rank` GPUs (of those the pod sees)."""
    pod = ServiceEnv.from_environ(role, env)
    per_pod = pod.ranks_per_pod or 1
    ranks = [
        dataclasses.replace(
            pod, rank=pod.rank * per_pod + r, local_rank=r, ranks_per_pod=1, http_port=pod.http_port if r == 0 else 0
        ).to_environ()
        for r in range(per_pod)
    ]
    # Only what differs per rank: the rest stays as the pod has it (unset included).
    envs = [env | {k: rank[k] for k in (Env.RANK, Env.LOCAL_RANK, Env.RANKS_PER_POD, Env.HTTP_PORT)} for rank in ranks]
    if role == "generator" and per_pod > 1:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(per_pod * gpus_per_rank)]
        for r, e in enumerate(envs):
            e["CUDA_VISIBLE_DEVICES"] = ",".join(devices[r * gpus_per_rank : (r + 1) * gpus_per_rank])
    return envs


def run_pod_ranks(argv: list[str], env: dict[str, str], role: str = "trainer", gpus_per_rank: int = 1) -> int:
    """Run `argv` once per rank of the pod and wait: 0 once all exit 0; STOPPED_EXIT once all
    ended and some stopped before the end (trainer ranks stop together); else the first
    failure's code, after stopping the rest. SIGTERM/SIGINT are passed on to every rank, which
    are then waited for (up to SIGNALLED_WAIT_S)."""
    procs = [
        subprocess.Popen(argv, env=e, preexec_fn=dying_with_this_process()) for e in rank_envs(env, role, gpus_per_rank)
    ]
    log.info("pod: started %d ranks (pids %s)", len(procs), [p.pid for p in procs])
    stopping = threading.Event()

    def forward(signum, _frame) -> None:
        stopping.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    failed, ending_by = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            # (a rank the forwarded signal ended before its handler was set: stopped, not failed)
            failed = next(
                (c for c in codes if c not in (None, 0, STOPPED_EXIT) and not (stopping.is_set() and c < 0)), 0
            )
            if failed or None not in codes:
                break
            if stopping.is_set() or STOPPED_EXIT in codes:  # ending: the rest follow on their own
                ending_by = ending_by or time.monotonic() + SIGNALLED_WAIT_S
                if time.monotonic() >= ending_by:
                    break
            time.sleep(POLL_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    cut = [p for p in procs if p.poll() is None]
    for p in cut:
        p.terminate()
    for p in procs:
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:  # in an uninterruptible wait (a GPU driver, NFS): the pod's end takes it
                log.error("pod: rank process %d did not die on SIGKILL within %gs; leaving it", p.pid, STOP_GRACE_S)
    codes = [p.returncode for p in procs]
    if failed:
        log.error("pod: a rank exited with code %s; stopped the others (codes %s)", failed, codes)
        return failed
    if cut:  # still winding down at SIGNALLED_WAIT_S: cut off, its checkpoint unwritten
        log.error(
            "pod: %d rank(s) did not end within %gs and were stopped (codes %s)", len(cut), SIGNALLED_WAIT_S, codes
        )
        return 1
    signalled = stopping.is_set() and any(c is not None and c < 0 for c in codes)
    return STOPPED_EXIT if STOPPED_EXIT in codes or signalled else 0
