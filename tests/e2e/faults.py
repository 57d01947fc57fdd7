"""What the fault tests share (tests/e2e/test_faults.py, test_engine_hang.py, test_store_faults.py,
test_watched_run.py): their jobs, which generators fed a step, a generator's engine core stalled,
reads of a running run's nats-server, and the audit of what a finished run stored."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from jobs import stored, tiny_job  # tests/e2e/jobs.py

from bench.run_process import RunProcess
from pipelinerl import messages as m
from pipelinerl.books import Outcome

SAMPLES = 16  # per step in tiny_job


def fault_job(name: str, steps: int, **spec) -> dict:
    # Short weight-sync deadlines: a dead member costs at most that long.
    base = {"weightSync": {"timeoutSeconds": 20}, "eval": {"interval": 0}, "rl": {"maxLag": 1}}
    return tiny_job(name, **(base | spec | {"trainer": {"maxSteps": steps} | spec.get("trainer", {})}))


def groups_from(row: dict, generator: int) -> int:
    return row.get(f"groups_from_generator_{generator}", 0)


def changes(train: list[dict]) -> list[tuple[int, int, int, bool]]:
    """(step, weight epoch, generators in the group, generator 1 fed it) where any but the step changed."""
    out: list[tuple[int, int, int, bool]] = []
    for r in train:
        row = (r["step"], r["weight_epoch"], r["generators_in_group"], groups_from(r, 1) > 0)
        if not out or out[-1][1:] != row[1:]:
            out.append(row)
    return out


def engine_core(run: RunProcess, name: str) -> int:
    """The pid of a generator's vLLM engine core: the one child of its process."""
    pid = run.services()[name]["pid"]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    cores = [int(c) for c in children if Path(f"/proc/{c}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]
    assert len(cores) == 1, f"{name} (pid {pid}): children {children}, engine cores {cores}"
    return cores[0]


def stall_engine(run: RunProcess, name: str, until, weight_sync_timeout_s: float) -> None:
    """SIGSTOP only a generator's engine core (a hung kernel, a device that stopped answering)
    while its process answers scrapes and says hello, until `until()` holds. At most 10 s short
    of the bound after which the generator stops itself (a call into its core waited that long
    in its awake time: `rpc_timeout_s`), so that it is the same process that goes on."""
    from pipelinerl_generator.engine import rpc_timeout_s

    core = engine_core(run, name)
    os.kill(core, signal.SIGSTOP)
    try:
        end = time.monotonic() + rpc_timeout_s(weight_sync_timeout_s) - 10
        while not until() and time.monotonic() < end:
            time.sleep(0.5)
    finally:
        os.kill(core, signal.SIGCONT)


def on_running_nats(run: RunProcess, read):
    """`read(js)` against the running run's nats-server."""
    import asyncio

    from pipelinerl.streams import connect

    async def go():
        nc = await connect(run.services()["nats-server"]["url"], "test")
        try:
            return await read(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(go())


def newest_stored(run: RunProcess, name: str) -> m.MicroBatch | None:
    """The newest micro-batch stored for trainer rank 0, read from the run's nats-server."""
    from pipelinerl.contracts import JobSubjects
    from pipelinerl.streams import last_message

    subjects = JobSubjects(name)
    data = on_running_nats(run, lambda js: last_message(js, subjects.stream("BATCHES"), subjects.batches(0), 5))
    return m.decode(data, m.MicroBatch) if data is not None else None


def mid_step(run: RunProcess, name: str) -> bool:
    """The preprocessor holds groups and the step it builds is stored in part (the newest
    micro-batch stored does not end a step): a kill now is the one that used to lose them."""
    import httpx

    port = run.services()["preprocessor"]["http_port"]
    try:
        held = httpx.get(f"http://127.0.0.1:{port}/status", timeout=1).json()["pendingGroups"]
    except (httpx.HTTPError, ValueError):  # starting or restarting
        return False
    newest = newest_stored(run, name)
    return bool(held) and newest is not None and not newest.last


def audit_streams(run: RunProcess, name: str, steps: int, ranks_n: int) -> tuple[dict, dict[str, int]]:
    """A finished run's streams (`audit_batches`); the ledgers add up to what the trainer
    announced last. (micro-batches by step and rank, the step each group was trained in)."""
    batches = [m.decode(x.data, m.MicroBatch) for x in stored(run.dir, name, "BATCHES")]
    by_step, trained, credits = audit_batches(batches, steps, ranks_n)
    (announced,) = [
        m.decode(x.data, m.PolicyVersion) for x in stored(run.dir, name, "CONTROL") if x.subject.endswith("version")
    ]
    assert announced.finished and announced.trained_groups == credits
    return by_step, trained


def audit_batches(batches: list[m.MicroBatch], steps: int, ranks_n: int) -> tuple[dict, dict[str, int], dict]:
    """Steps 0..steps-1: every step once per rank, its micro-batches numbered 0..k with only k
    last, the ranks alike; each step a full batch of trained groups, none stale; each group
    trained in one step only, whole. (micro-batches by step and rank, the step each group was
    trained in, the credits of the steps' ledgers summed by generator)."""
    by_step: dict[int, dict[int, list[m.MicroBatch]]] = {}
    for mb in batches:
        if mb.step < steps:  # (the preprocessor may have begun one more)
            by_step.setdefault(mb.step, {}).setdefault(mb.rank, []).append(mb)
    assert sorted(by_step) == list(range(steps))
    groups_per_step = SAMPLES // 4
    trained: dict[str, int] = {}
    credits: dict[str, int] = {}
    for step, ranks in by_step.items():
        assert sorted(ranks) == list(range(ranks_n))
        counts = {len(mbs) for mbs in ranks.values()}
        assert len(counts) == 1, (step, counts)
        for mbs in ranks.values():
            assert [mb.index for mb in mbs] == list(range(len(mbs))) and [mb.last for mb in mbs][-1]
            assert not any(mb.last for mb in mbs[:-1])
        final = ranks[0][-1].ledger
        assert all(mbs[-1].ledger == final for mbs in ranks.values())
        assert final.trained_groups == groups_per_step and final.samples == SAMPLES
        assert not final.entries(Outcome.STALE)
        samples = [g for mbs in ranks.values() for mb in mbs for g in mb.group_ids]
        assert sorted(samples) == sorted(e.id for e in final.entries(Outcome.TRAINED) for _ in range(4))
        for g in set(samples):
            assert g not in trained, f"group {g} trained in steps {trained[g]} and {step}"
            trained[g] = step
        for g, c in final.credits.items():
            credits[g] = credits.get(g, 0) + c
    return by_step, trained, credits
