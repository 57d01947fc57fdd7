"""Rollout groups per second through JetStream + the real preprocessor, against raw JetStream.

Both sides publish the same encoded RolloutGroup payloads (shaped like the tiny job's: 8
attempts, ~8 prompt + ~5 completion tokens, logprobs and versions) to a fresh job's ROLLOUTS
stream and time until the last one has come out the other end:

  preprocessor: the preprocessor service (`run_service("preprocessor", job)`, its own process
                as in a deployment) consumes them, computes advantages, packs and publishes
                MicroBatch messages; a subscriber standing in for the trainer decodes them and
                counts groups/samples. The clock stops when every group has arrived.
  raw:          a consumer process pulls and acks the same bytes, nothing else; it reports on
                a core NATS subject when it has acked the last one.

The preprocessor's margin is its rate over the demand: the groups/s the tiny job's generator
produced in a real run (accepted + zero-variance-filtered groups, from the trainer's `train`
records in metrics.jsonl), or --demand.

  python -m bench.transport             # full settings
  python -m bench.transport --quick     # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.common import alternate, paired_ratios, save, summary, table
from pipelinerl import messages as m
from pipelinerl.spec import dump_job, load_job
from pipelinerl.ports import free_port
from pipelinerl.contracts import JobSubjects, ServiceEnv
from pipelinerl_cli.embedded_nats import EmbeddedNats
from pipelinerl.streams import connect, delete_streams, ensure_streams, wait_for

ROOT = Path(__file__).resolve().parent.parent
TINY_JOB = ROOT / "examples" / "tiny-cpu.yaml"
DEMAND_RUN = Path("/tmp/main-run6")
# Groups/s the generator produced in /tmp/main-run6 (tiny job, this machine: 92 steps of 16
# accepted + ~11 filtered groups in 154 s); used when that run folder is gone.
DEFAULT_DEMAND = 17.6
PUBLISH_WINDOW = 32  # publishes in flight, like the generator's concurrent group tasks
READY_TIMEOUT_S = 60.0
HUGE_VERSION = 10**9  # announced trainer version: backpressure never engages (we measure capacity)

_names = itertools.count()


def job_name() -> str:
    """A new job per round: fresh streams and consumers, nothing carried over."""
    return f"bench-transport-{os.getpid()}-{next(_names)}"


def make_payloads(n: int, attempts: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """(group_id, encoded RolloutGroup) like the tiny job's. Every group has reward variance,
    so none is filtered: all take the preprocessor's full path (the heavier case)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        samples = []
        for a in range(attempts):
            p, c = rng.randint(7, 9), rng.randint(3, 7)
            samples.append(
                m.Sample(
                    tokens=[rng.randrange(16) for _ in range(p + c)],
                    mask=[0] * p + [1] * c,
                    logprobs=[0.0] * p + [-rng.random() * 2 for _ in range(c)],
                    versions=[-1] * p + [0] * c,
                    reward=float(a % 2),
                    success=bool(a % 2),
                )
            )
        group = m.RolloutGroup(group_id=f"g{i}", generator=0, samples=samples)
        out.append((group.group_id, m.encode(group)))
    return out


async def publish_all(js, subject: str, payloads: list[tuple[str, bytes]]) -> None:
    for k in range(0, len(payloads), PUBLISH_WINDOW):
        await asyncio.gather(
            *[
                js.publish(subject, data, headers={"Nats-Msg-Id": gid}, timeout=30)
                for gid, data in payloads[k : k + PUBLISH_WINDOW]
            ]
        )


async def wait_consumer(js, subjects: JobSubjects, durable: str, proc) -> None:
    """Until the child process has created its consumer (it is then ready to pull)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.returncode is not None:
            raise RuntimeError(f"consumer process exited with {proc.returncode} before it was ready")
        try:
            await js.consumer_info(subjects.stream("ROLLOUTS"), durable)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer {durable!r} not created within {READY_TIMEOUT_S:.0f}s") from None
            await asyncio.sleep(0.1)


async def stop_process(proc, timeout_s: float = 15.0) -> None:
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 10)


async def run_side(side: str, url: str, payloads: list[tuple[str, bytes]], workdir: Path, timeout_s: float) -> float:
    """One round of one side: groups/s from the first publish to the last group out."""
    name = job_name()
    subjects = JobSubjects(name)
    nc = await connect(url, "bench")
    js = nc.jetstream()
    await ensure_streams(js, subjects, 8)
    n = len(payloads)
    done = asyncio.Event()
    log = open(workdir / f"{name}.log", "wb")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    try:
        if side == "preprocessor":
            job = load_job(TINY_JOB)
            job.metadata.name = name
            job_file = workdir / f"{name}.yaml"
            job_file.write_text(dump_job(job))
            await js.publish(subjects.version, m.encode(m.PolicyVersion(version=HUGE_VERSION, timestamp=0)))
            seen = {"groups": 0, "samples": 0}
            expected = n * len(m.decode(payloads[0][1], m.RolloutGroup).samples)

            async def on_batch(msg) -> None:  # the trainer's consumer: ordered push, decode each
                mb = m.decode(msg.data, m.MicroBatch)
                seen["samples"] += len(mb.rewards)
                if mb.index == 0:
                    seen["groups"] += sum(mb.ledger.credits.values())
                if seen["samples"] >= expected:  # the last step's last micro-batch
                    done.set()

            await js.subscribe(subjects.batches(0), cb=on_batch, ordered_consumer=True)
            env |= ServiceEnv(
                "preprocessor", nats_url=url, run_dir=workdir, http_port=free_port(), exit_when_done=True
            ).to_environ()
            code = (
                "import sys; from pipelinerl_cli.main import main; "
                f"sys.exit(main(['service', 'preprocessor', {str(job_file)!r}]))"
            )
            durable = "preprocessor"
            if n % job.spec.groups_per_step:
                raise ValueError(f"--groups must be a multiple of {job.spec.groups_per_step} (groups per step)")
        else:

            async def on_done(msg) -> None:
                done.set()

            await nc.subscribe(f"bench.{name}.done", cb=on_done)
            code = f"from bench.transport import raw_consumer; raw_consumer({url!r}, {name!r}, {n})"
            durable = "raw"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, cwd=ROOT, env=env, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
        try:
            await wait_consumer(js, subjects, durable, proc)
            t0 = time.perf_counter()
            await publish_all(js, subjects.rollouts(0), payloads)
            await wait_for(done.wait(), timeout_s, f"{side}: {n} groups out")
            elapsed = time.perf_counter() - t0
            if side == "preprocessor":
                assert seen == {"groups": n, "samples": expected}, seen
                # Let the service finish the way it does in a job: the trainer says it is done.
                await js.publish(
                    subjects.version, m.encode(m.PolicyVersion(version=HUGE_VERSION, finished=True, timestamp=0))
                )
        finally:
            await stop_process(proc)
        return n / elapsed
    finally:
        log.close()
        await delete_streams(js, subjects)  # keep the embedded server's store small
        await nc.close()


def raw_consumer(url: str, job: str, n: int) -> None:
    """Child process of the raw side: pull and ack `n` messages as the preprocessor would."""
    from nats.js.api import AckPolicy, ConsumerConfig

    async def main() -> None:
        subjects = JobSubjects(job)
        nc = await connect(url, "bench-raw")
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subjects.rollouts(">"),
            durable="raw",
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=600, max_ack_pending=100_000),
        )
        got = 0
        deadline = time.monotonic() + 600
        while got < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consumer: {got}/{n} messages in 600s")
            try:
                msgs = await sub.fetch(batch=64, timeout=1.0)  # same batch as the preprocessor
            except Exception as err:
                if "timeout" not in type(err).__name__.lower():
                    raise
                continue
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await nc.publish(f"bench.{job}.done", b"")
        await nc.flush(timeout=10)
        await nc.close()

    asyncio.run(main())


def measured_demand(run_dir: Path) -> dict | None:
    """Groups/s the generator(s) produced in a real run: accepted (samples/attempts) plus
    zero-variance-filtered groups per step, over the span of the trainer's `train` records
    (the first record marks the start of steady state, so start-up is not counted)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    attempts = load_job(run_dir / "job.yaml").spec.rl.attempts if (run_dir / "job.yaml").exists() else 8
    train = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "train"]
    if len(train) < 3:
        return None
    span = train[-1]["time"] - train[0]["time"]
    accepted = sum(r["samples"] / attempts for r in train[1:])
    filtered = sum(r.get("groups_filtered", 0) for r in train[1:])
    return {
        "source": str(metrics),
        "steps": len(train),
        "seconds": span,
        "accepted_groups_per_s": accepted / span,
        "groups_per_s": (accepted + filtered) / span,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2000, help="groups per round (a multiple of groups per step, 16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--run-dir", type=Path, default=DEMAND_RUN, help="real run whose metrics.jsonl gives the demand")
    p.add_argument("--demand", type=float, help=f"generator groups/s (default: from --run-dir, else {DEFAULT_DEMAND})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one round")
    p.add_argument("--quick", action="store_true", help="smoke run: 320 groups, 2 repeats, no warm-up")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.repeats, args.warmup = 320, 2, 0

    demand_info = None if args.demand else measured_demand(args.run_dir)
    demand = args.demand or (demand_info["groups_per_s"] if demand_info else DEFAULT_DEMAND)
    attempts = load_job(TINY_JOB).spec.rl.attempts
    payloads = make_payloads(args.groups, attempts)
    print(
        f"{args.groups} groups of {attempts} attempts per round ({sum(len(d) for _, d in payloads) / args.groups:.0f}"
        f" bytes each), {args.repeats} rounds + {args.warmup} warm-up, sides alternated",
        flush=True,
    )

    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp, EmbeddedNats(Path(tmp) / "nats") as server:

        def side(name: str):
            def fn() -> float:
                rate = asyncio.run(run_side(name, server.url, payloads, Path(tmp), args.timeout))
                print(f"  {name:12s} {rate:8.0f} groups/s", flush=True)
                return rate

            return fn

        rates = alternate({"preprocessor": side("preprocessor"), "raw": side("raw")}, args.repeats, args.warmup)

    pre, raw = summary(rates["preprocessor"]), summary(rates["raw"])
    ratio = paired_ratios(rates["preprocessor"], rates["raw"])
    margin = {k: v / demand for k, v in pre.items() if k != "n"}
    print()
    print(
        table(
            ["side", "groups/s median", "min", "max"],
            [
                ["preprocessor", pre["median"], pre["min"], pre["max"]],
                ["raw JetStream", raw["median"], raw["min"], raw["max"]],
            ],
        )
    )
    print(
        f"\npreprocessor / raw (paired): median {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f})"
    )
    where = demand_info["source"] if demand_info else ("--demand" if args.demand else "built-in default")
    print(f"demand: {demand:.1f} groups/s produced by the generator ({where})")
    print(
        f"margin: {margin['median']:.0f}x the demand (min {margin['min']:.0f}x) — target ≥ 10x: "
        f"{'met' if margin['min'] >= 10 else 'NOT met'}"
    )
    if not args.no_save:
        command = "python -m bench.transport" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
        path = save(
            "transport",
            {
                "groups_per_round": args.groups,
                "attempts": attempts,
                "rates": rates,
                "preprocessor": pre,
                "raw": raw,
                "ratio": ratio,
                "demand_groups_per_s": demand,
                "demand": demand_info,
                "margin": margin,
            },
            command.strip(),
        )
        print(f"saved {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
