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

With `--trainer-cpu`, each run is paired with one in which the job's weight updates land at its
steps: a trainer process on that core sends the job's model with the project's `WeightSender`
each time the builder completes a step, and the engine applies each as the generator service
does (staged while requests run). What the paired run took beyond its pair, per update, is each
engine's cost of an update on its core (the planner's `pause_s`); the seconds the sender holds
its caller up (packing, and the previous update's thread when it outlasted a step) are the
trainer's (`weight_sync_s`). One update a step is a few percent of a run, within the pairs'
spread; `--updates-per-step 4` sends more (14-35 a run of 192 groups) and resolves it.

    python -m bench.rollout_path [--job examples/tiny-cpu.yaml] [--groups 192] [--repeats 3] [--trainer-cpu 1]
                                 [--updates-per-step 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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
SETTLE_S = 60.0  # for the engine to apply the updates sent (a failed one never is)


class StepUpdates:
    """The job's weight updates at its steps' rate: a trainer process on its own core
    (`bench.inflight_update.step_sender_main`: the project's `WeightSender` on the job's model)
    sends a version each time `step` is called; this process applies each as the
    generator service does (`bench.inflight_update.serve`: joins the group, `Engine.update_weights`,
    staged while requests run)."""

    def __init__(self, engine, path: str, bucket_mb: int, cpu: int):
        from bench.inflight_update import serve, step_sender_main
        from pipelinerl.ports import free_port

        ctx = mp.get_context("spawn")
        self.gen_q, done_q, self.steps_q, self.res_q = (ctx.Queue() for _ in range(4))
        port = free_port()
        args = (path, port, bucket_mb, cpu, self.gen_q, done_q, self.steps_q, self.res_q)
        self.sender = ctx.Process(target=step_sender_main, args=args, daemon=True)
        self.sender.start()
        self.serving = asyncio.create_task(serve(engine, self.gen_q, done_q, self.sender, port))
        self.version = 0  # the newest sent

    def step(self) -> None:
        self.version += 1
        self.steps_q.put(self.version)

    async def settle(self, engine) -> None:
        """Until the engine has applied every version sent (so none lands in the next run)."""
        deadline = time.monotonic() + SETTLE_S
        while engine.version < self.version:
            if time.monotonic() > deadline or self.serving.done():
                raise RuntimeError(f"the engine applied version {engine.version} of {self.version}")
            await asyncio.sleep(0.01)

    async def close(self) -> list[dict]:
        """Each update's send statistics (the sender's, in version order)."""
        self.steps_q.put(None)
        try:
            status, out = await asyncio.to_thread(self.res_q.get, True, RUN_TIMEOUT_S)
            await asyncio.wait_for(self.serving, RUN_TIMEOUT_S)
        finally:
            self.sender.join(30)
            if self.sender.is_alive():
                self.sender.kill()
        if status != "ok":
            raise RuntimeError(f"the weight sender failed:\n{out}")
        return out


async def run_path(job_file: str, groups: int, repeats: int, trainer_cpu: int | None = None, per_step: int = 1) -> dict:
    """In the pinned child: the job's rollout path, `repeats` timed runs of `groups` groups
    (after one untimed run of a quarter as many). With `trainer_cpu`, each run is followed by one
    with the job's weight updates landing at its steps (`StepUpdates`, the sender on that core),
    so that their cost to the path's core is the difference; the untimed run is then as long as
    a timed one, with updates (the weight group forms at its first). `per_step` > 1: besides each
    step's update, one after each 1/per_step of a step's groups taken (up to per_step a step; more
    updates a run, so that their cost stands out of the runs' spread)."""
    import nats

    from pipelinerl import books
    from pipelinerl import messages as m
    from pipelinerl.spec import load_job
    from pipelinerl.streams import close, publish_once
    from pipelinerl.store import ensure_streams
    from pipelinerl.tasks import make_task
    from pipelinerl.tiny_model import load_tokenizer, resolve_model_path
    from pipelinerl_cli.embedded_nats import EmbeddedNats
    from pipelinerl_generator.engine import Engine
    from pipelinerl.claims import group_id
    from pipelinerl_preprocessor.builder import StepBuilder

    job = load_job(job_file)
    spec, subjects = job.spec, job.subjects
    path = resolve_model_path(spec.model.path)
    engine = Engine(job, path)  # first: its core process is forked while no thread of ours runs
    await engine.start(0)
    updates = None if trainer_cpu is None else StepUpdates(engine, path, spec.weight_sync.bucket_mb, trainer_cpu)
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
                index = next(drawn)
                problem = task.train_problem(index)
                samples = await asyncio.gather(
                    *[task.rollout(engine, tokenizer, problem, max_tokens) for _ in range(attempts)]
                )
                g = m.RolloutGroup(group_id=group_id(problem.id, index, 0), generator=0, samples=list(samples))
                await publish_once(js, subjects.rollouts(0), m.encode(g), g.group_id)
                return sum(s.num_generated for s in samples)

        builder = StepBuilder(spec, spec.trainer_ranks, books.restore([]), caught_up=True)

        # Groups between extra updates, and the most taken at once: a step completes between two
        # fetches with groups still to take, so its update is sent (taking all of a run's groups
        # in one fetch, every step completed at its end and no update was sent).
        every = max(1, spec.trainer.samples_per_step // attempts // per_step)

        async def take(n: int, updated: bool) -> None:  # the preprocessor's loop, its trainer always ready
            send = updates.step if updated and updates is not None else None
            seen, since = builder.step, 0  # groups taken since the last step began
            while n:
                for msg in await intake.fetch(min(n, every), timeout=30):
                    builder.take(msg, m.decode(msg.data, m.RolloutGroup))
                    n, since = n - 1, since + 1
                    if send and n and per_step > 1 and since % every == 0 and since < every * per_step:
                        send()
                while (wave := builder.next_wave()) is not None:
                    await asyncio.gather(
                        *(
                            publish_once(js, subjects.batches(b.rank), m.encode(b), f"{b.step}-{b.rank}-{b.index}")
                            for b in wave.batches
                        )
                    )
                    for msg in wave.acks:
                        await msg.ack()
                    if builder.step > seen:
                        seen, since = builder.step, 0
                        if send and n:  # a step's data is in: its update (the run's last would land after it)
                            send()

        async def one_run(n: int, updated: bool = False) -> tuple[float, int, dict[str, float], int]:
            sender = updates.sender.pid if updates is not None else None
            first = updates.version if updates is not None else 0
            cpu0, t0 = cpu_seconds(sender), time.perf_counter()
            tokens, _ = await asyncio.gather(asyncio.gather(*(group() for _ in range(n))), take(n, updated))
            seconds, cpu1 = time.perf_counter() - t0, cpu_seconds(sender)
            if updates is not None:
                await updates.settle(engine)
            sent = (updates.version if updates is not None else 0) - first
            return seconds, sum(tokens), {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}, sent

        warmup = await one_run(groups if updates is not None else max(1, groups // 4), updated=updates is not None)
        runs, updated = [], []
        for _ in range(repeats):
            runs.append(await one_run(groups))
            if updates is not None:
                updated.append(await one_run(groups, updated=True))
        built = builder.step
        sends = await updates.close() if updates is not None else []
    finally:
        if updates is not None and updates.sender.is_alive():  # a failure before `close`
            updates.sender.kill()
        await close(nc)
        server.stop()
        shutil.rmtree(server.store_dir, ignore_errors=True)
        engine.shutdown()
    samples = groups * attempts

    def per_sample(rs: list) -> dict:
        return {
            "seconds_per_sample": [s / samples for s, _, _, _ in rs],
            "tokens_per_sample": [t / samples for _, t, _, _ in rs],
            # CPU seconds per sample of each process: where a sample's time on the core goes
            "cpu_per_sample": [{k: v / samples for k, v in c.items()} for _, _, c, _ in rs],
        }

    out = {
        "groups": groups,
        "attempts": attempts,
        **per_sample(runs),
        "max_inflight_groups": spec.generator.max_inflight_groups,
        "steps_built": built,  # by the preprocessor's builder, every run's groups
    }
    if trainer_cpu is not None:
        timed = sends[warmup[3] :]  # the warm-up's formed the group
        out["with_updates"] = per_sample(updated) | {"updates": [n for _, _, _, n in updated], "sends": timed}
    return out


def cpu_seconds(sender: int | None = None) -> dict[str, float]:
    """CPU seconds so far of this process ("client": the generator's and the intake's work) and
    of its children by name (vLLM's engine core, nats-server; the weight sender, pid `sender`,
    on its own core, and multiprocessing's resource tracker apart)."""
    import psutil

    me = psutil.Process()
    out = {"client": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            if child.pid == sender:
                name = "weight sender"
            elif "resource_tracker" in " ".join(child.cmdline()):
                name = "resource tracker"
            else:
                name = "nats-server" if "nats" in child.name() else "engine core"
            out[name] = out.get(name, 0.0) + sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def measure(
    job: str, groups: int, repeats: int, cpu: int = 0, trainer_cpu: int | None = None, per_step: int = 1
) -> dict:
    """The job's rollout path in a child process pinned to core `cpu` (one torch thread): its
    seconds and completion tokens per sample (medians over `repeats` runs), and the runs; with
    `trainer_cpu`, also the weight updates' costs (`update_costs`), `per_step` updates a step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.rollout_path", "--child", "--job", job]
    cmd += ["--groups", str(groups), "--repeats", str(repeats), "--cpu", str(cpu)]
    if trainer_cpu is not None:
        cmd += ["--trainer-cpu", str(trainer_cpu), "--updates-per-step", str(per_step)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=RUN_TIMEOUT_S, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    got["cpu"] = cpu
    got["seconds_per_sample_median"] = summary(got["seconds_per_sample"])["median"]
    got["tokens_per_sample_median"] = summary(got["tokens_per_sample"])["median"]
    if "with_updates" in got:
        got["update_costs"] = update_costs(got)
    return got


def update_costs(got: dict) -> dict:
    """What each weight update cost (medians): the path's core, the seconds the paired runs with
    updates took beyond those without, per update (`generator_s`: receiving, loading and
    re-packing beside decoding, and the pause); the trainer, its send (`trainer_s`: packing,
    confirming the previous update, broadcasting); the generator's pause as it reported it."""
    samples = got["groups"] * got["attempts"]
    u = got["with_updates"]
    extra = [
        (b - a) * samples / n for a, b, n in zip(got["seconds_per_sample"], u["seconds_per_sample"], u["updates"]) if n
    ]
    if not extra:
        raise RuntimeError(f"no run with updates sent one ({u['updates']}): give it more groups than a step's")
    sends = u["sends"]
    return {
        "generator_s": summary(extra)["median"],
        "generator_s_runs": extra,
        "trainer_s": summary([s["weight_sync_seconds"] for s in sends])["median"],
        "pause_s": summary([s["weight_pause_max_seconds"] for s in sends])["median"],  # of the update before each
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", default=JOB)
    ap.add_argument("--groups", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--trainer-cpu", type=int, help="also runs with the job's weight updates, sent from this core")
    ap.add_argument("--updates-per-step", type=int, default=1, help="with --trainer-cpu: updates sent per step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the pinned process
    args = ap.parse_args()
    from bench.models import project_caches

    project_caches()
    if args.child:
        os.sched_setaffinity(0, {args.cpu})  # before the engine: its core process inherits it
        run = run_path(args.job, args.groups, args.repeats, args.trainer_cpu, args.updates_per_step)
        print(json.dumps(asyncio.run(run)))
        return
    if args.updates_per_step < 1:
        ap.error(f"--updates-per-step: at least 1, not {args.updates_per_step}")
    got = measure(args.job, args.groups, args.repeats, args.cpu, args.trainer_cpu, args.updates_per_step)
    print(
        f"{args.job}, its rollout path on one core: {1000 * got['seconds_per_sample_median']:.2f} ms per sample "
        f"({got['tokens_per_sample_median']:.1f} completion tokens)"
    )
    if "update_costs" in got:
        c = got["update_costs"]
        runs = c["generator_s_runs"]
        print(
            f"each weight update: {1000 * c['generator_s']:.1f} ms of the path's core ({len(runs)} pairs, "
            f"{min(got['with_updates']['updates'])}-{max(got['with_updates']['updates'])} updates a run: "
            f"{1000 * min(runs):.0f} to {1000 * max(runs):.0f} ms), {1000 * c['trainer_s']:.1f} ms "
            f"of the trainer's (its send), the generator paused {1000 * c['pause_s']:.1f} ms"
        )


if __name__ == "__main__":
    main()
