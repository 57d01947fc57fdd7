"""The rollout path on one core (part of benchmark 12): what a sample of a job costs the core
its engine runs on, everything a generator's process does for it included.

A conventional phase on a CPU machine runs an engine per core, and beside each engine's core
process the rest of the rollout path shares the same cores: the generator's own process (vLLM's
client side: requests in, outputs out; the task's rollout and reward; the group's message and
its publish), the broker, the preprocessor. The decode curve's short rounds time an engine whose
client has the other core to itself, so they leave that work out; on the tiny job's 4-token
completions it is a third of a sample's cost. Here the job's real path runs pinned to one core
(this process, its engine core process and its nats-server all inherit the affinity): the job's
task through the generator's `Engine` (its sampling, its attempts per group, as many groups at
once as the job admits), each group published to the job's rollout stream on a real nats-server,
and the preprocessor's `StepBuilder` taking every group, packing its steps' micro-batches and
publishing them, its trainer always ready. Its seconds per sample are what a core gives a
sample; beyond the engine's decode steps on the curve (and the prompt's prefill) they are each
request's own cost, the planner's `request_s` for a machine whose engines share their cores with
the rest (`pipelinerl.planner.bound.path_request_s`). Not in it: the preprocessor's and the
generators' service loops around that work (status, hellos, metrics) and the trainer's fetches
(small on the tiny job: the preprocessor's whole process took ~5% of a phase's CPU, measured with
per-process CPU times).

    python -m bench.rollout_path [--job examples/tiny-cpu.yaml] [--groups 192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/decode_curve.py

from bench.common import summary  # noqa: E402

JOB = "examples/tiny-cpu.yaml"
RUN_TIMEOUT_S = 600.0


async def run_path(job_file: str, groups: int, repeats: int) -> dict:
    """In the pinned child: the job's rollout path, `repeats` timed runs of `groups` groups
    (after one untimed run of a quarter as many)."""
    import nats

    from pipelinerl import books
    from pipelinerl import messages as m
    from pipelinerl.spec import load_job
    from pipelinerl.streams import close, ensure_streams, publish_once
    from pipelinerl.tasks import make_task
    from pipelinerl.tiny_model import load_tokenizer, resolve_model_path
    from pipelinerl_cli.embedded_nats import EmbeddedNats
    from pipelinerl_generator.engine import Engine
    from pipelinerl_preprocessor.builder import StepBuilder

    job = load_job(job_file)
    spec, subjects = job.spec, job.subjects
    path = resolve_model_path(spec.model.path)
    engine = Engine(job, path)  # first: its core process is forked while no thread of ours runs
    await engine.start(0)
    task = make_task(spec.task.name, spec.task.params, seed=spec.task.seed)
    tokenizer = load_tokenizer(path)
    server = EmbeddedNats(Path(tempfile.mkdtemp(prefix="rollout-path-"))).start()
    nc = await nats.connect(server.url, connect_timeout=10)
    try:
        js = nc.jetstream()
        await ensure_streams(js, subjects, 8)
        intake = await js.pull_subscribe(subjects.rollouts(">"), durable="bench-intake")
        max_tokens, attempts = spec.generator.sampling.max_tokens, spec.rl.attempts
        admitted = asyncio.Semaphore(spec.generator.max_inflight_groups)
        drawn = iter(range(10**9))

        async def group() -> int:
            async with admitted:
                problem = task.train_problem(next(drawn))
                samples = await asyncio.gather(
                    *[task.rollout(engine, tokenizer, problem, max_tokens) for _ in range(attempts)]
                )
                g = m.RolloutGroup(group_id=f"{problem.id}@0", generator=0, samples=list(samples))
                await publish_once(js, subjects.rollouts(0), m.encode(g), g.group_id)
                return sum(s.num_generated for s in samples)

        builder = StepBuilder(spec, spec.trainer_ranks, books.restore([]), caught_up=True)

        async def take(n: int) -> None:  # the preprocessor's loop, its trainer always ready
            while n:
                for msg in await intake.fetch(min(n, 64), timeout=30):
                    builder.take(msg, m.decode(msg.data, m.RolloutGroup))
                    n -= 1
                while (wave := builder.next_wave()) is not None:
                    await asyncio.gather(
                        *(
                            publish_once(js, subjects.batches(b.rank), m.encode(b), f"{b.step}-{b.rank}-{b.index}")
                            for b in wave.batches
                        )
                    )
                    for msg in wave.acks:
                        await msg.ack()

        async def one_run(n: int) -> tuple[float, int, dict[str, float]]:
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            tokens, _ = await asyncio.gather(asyncio.gather(*(group() for _ in range(n))), take(n))
            seconds, cpu1 = time.perf_counter() - t0, cpu_seconds()
            return seconds, sum(tokens), {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}

        await one_run(max(1, groups // 4))
        runs = [await one_run(groups) for _ in range(repeats)]
        built = builder.step
    finally:
        await close(nc)
        server.stop()
        shutil.rmtree(server.store_dir, ignore_errors=True)
        engine.shutdown()
    samples = groups * attempts
    return {
        "groups": groups,
        "attempts": attempts,
        "seconds_per_sample": [s / samples for s, _, _ in runs],
        "tokens_per_sample": [t / samples for _, t, _ in runs],
        # CPU seconds per sample of each process: where a sample's time on the core goes
        "cpu_per_sample": [{k: v / samples for k, v in c.items()} for _, _, c in runs],
        "max_inflight_groups": spec.generator.max_inflight_groups,
        "steps_built": built,  # by the preprocessor's builder, every run's groups
    }


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process ("client": the generator's and the intake's work) and
    of its children by name (vLLM's engine core, nats-server)."""
    import psutil

    me = psutil.Process()
    out = {"client": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            name = "nats-server" if "nats" in child.name() else "engine core"
            out[name] = out.get(name, 0.0) + sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def measure(job: str, groups: int, repeats: int, cpu: int = 0) -> dict:
    """The job's rollout path in a child process pinned to core `cpu` (one torch thread): its
    seconds and completion tokens per sample (medians over `repeats` runs), and the runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.rollout_path", "--child", "--job", job]
    cmd += ["--groups", str(groups), "--repeats", str(repeats), "--cpu", str(cpu)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=RUN_TIMEOUT_S, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    got["cpu"] = cpu
    got["seconds_per_sample_median"] = summary(got["seconds_per_sample"])["median"]
    got["tokens_per_sample_median"] = summary(got["tokens_per_sample"])["median"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default=JOB)
    ap.add_argument("--groups", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the pinned process
    args = ap.parse_args()
    from bench.models import project_caches

    project_caches()
    if args.child:
        os.sched_setaffinity(0, {args.cpu})  # before the engine: its core process inherits it
        print(json.dumps(asyncio.run(run_path(args.job, args.groups, args.repeats))))
        return
    got = measure(args.job, args.groups, args.repeats, args.cpu)
    print(
        f"{args.job}, its rollout path on one core: {1000 * got['seconds_per_sample_median']:.2f} ms per sample "
        f"({got['tokens_per_sample_median']:.1f} completion tokens)"
    )


if __name__ == "__main__":
    main()
