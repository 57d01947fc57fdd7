"""Benchmark 7: the elastic weight plane. A tiny job run by `pipelinerl run` (a random 3M model:
the machinery, not learning), one generator killed with SIGKILL mid-run and restarted by the
runner. Measured per round:

- death → next trained step: from the kill to the next step the trainer finishes, and the
  longest time between two steps from the kill to the end: the stall it caused (two
  generators: the survivor goes on; one generator: the trainer waits for the restart once the
  data already generated is trained);
- restart → generating at the current version: from the restarted process's start to its
  "ready at version V" (engine start, hello, join, first weights), and from joining to ready;
- the cost of an epoch change: the trainer's weight_sync_seconds on steps that opened a new
  membership epoch against steps that did not.

    python -m bench.elastic [--rounds 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

from bench.common import save, summary
from bench.run_process import RunProcess  # also the fault tests' harness

KILL_AT_STEP = 8
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def job(name: str, generators: int, steps: int) -> dict:
    return {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "builtin:tiny-random", "maxSeqLen": 40},
            "rl": {"attempts": 4, "filterZeroVariance": False, "maxLag": 1},
            "generator": {"replicas": generators, "sampling": {"maxTokens": 24}},
            "trainer": {"samplesPerStep": 16, "microBatchTokens": 256, "maxSteps": steps, "checkpointInterval": 0},
            "weightSync": {"timeoutSeconds": 20},
            "eval": {"interval": 0},
        },
    }


def log_time(line: str) -> float:
    return datetime.strptime(LOG_TIME.match(line)[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_round(root: Path, generators: int, steps: int, timeout_s: float) -> dict:
    name = f"elastic{generators}"
    run = RunProcess(root / f"{name}-{time.time_ns()}", job(name, generators, steps), timeout_s)
    victim = f"generator-{generators - 1}" if generators > 1 else "generator"
    run.wait_step(KILL_AT_STEP)
    _, killed_step = run.kill(victim)
    killed = time.time()
    seen, stamps, started = killed_step, [], None  # wall times new steps were seen; the restart's start
    while run.proc.poll() is None and seen < steps:
        last = run.train()[-1]["step"]
        if last > seen:
            seen = last
            stamps.append(time.time())
        if started is None and run.services()[victim]["restarts"]:
            started = psutil.Process(run.services()[victim]["pid"]).create_time()
        time.sleep(0.02)
    gaps = [b - a for a, b in zip([killed, *stamps], stamps)]
    run.finish()
    log = (run.dir / "logs" / f"{victim}.log").read_text().splitlines()
    joined = next(log_time(x) for x in log if "joined weight group" in x and log_time(x) >= started)
    ready = next(x for x in log if " ready at version " in x and log_time(x) >= started)
    train = run.train()
    epochs = [(b["weight_epoch"] > a["weight_epoch"], b["weight_sync_seconds"]) for a, b in zip(train, train[1:])]
    return {
        "generators": generators,
        "killed_after_step": killed_step,
        "death_to_next_step_s": gaps[0],
        "longest_step_gap_s": max(gaps),
        "restart_to_ready_s": log_time(ready) - started,
        "join_to_ready_s": log_time(ready) - joined,
        "ready_version": int(ready.rsplit(" ready at version ", 1)[1].split()[0]),
        "epoch_change_sync_s": [s for new, s in epochs if new],
        "plain_sync_s": [s for new, s in epochs if not new],
        "final_epoch": train[-1]["weight_epoch"],
        "steps": [r["step"] for r in train],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of each scenario (one and two generators)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    rounds = []
    root = Path(tempfile.mkdtemp(prefix="pipelinerl-elastic-"))
    print(f"runs (logs, metrics) in {root}")
    for i in range(args.rounds):
        for generators in (2, 1):  # alternated
            r = one_round(root, generators, args.steps, timeout_s=600)
            print(
                f"round {i + 1}, {generators} generator(s): death -> next step {r['death_to_next_step_s']:.2f}s "
                f"(longest gap between steps after it {r['longest_step_gap_s']:.1f}s), "
                f"restart -> ready {r['restart_to_ready_s']:.1f}s (join -> ready {r['join_to_ready_s']:.2f}s), "
                f"epochs {r['final_epoch']}",
                flush=True,
            )
            rounds.append(r)
    out = {}
    for generators in (2, 1):
        rs = [r for r in rounds if r["generators"] == generators]
        out[f"{generators}_generators"] = {
            "death_to_next_step_s": summary([r["death_to_next_step_s"] for r in rs]),
            "longest_step_gap_s": summary([r["longest_step_gap_s"] for r in rs]),
            "restart_to_ready_s": summary([r["restart_to_ready_s"] for r in rs]),
            "join_to_ready_s": summary([r["join_to_ready_s"] for r in rs]),
        }
    changes = [s for r in rounds for s in r["epoch_change_sync_s"]]
    plain = [s for r in rounds for s in r["plain_sync_s"]]
    out["epoch_change_sync_s"], out["plain_sync_s"] = summary(changes), summary(plain)
    out["epoch_change_vs_plain"] = statistics.median(changes) / statistics.median(plain)
    print(
        f"epoch change: weight sync {out['epoch_change_sync_s']['median'] * 1000:.0f} ms (median of {len(changes)}) "
        f"vs plain update {out['plain_sync_s']['median'] * 1000:.0f} ms ({out['epoch_change_vs_plain']:.1f}x)"
    )
    save(
        "elastic",
        {"summary": out, "rounds": rounds},
        f"python -m bench.elastic --rounds {args.rounds} --steps {args.steps}",
    )


if __name__ == "__main__":
    main()
