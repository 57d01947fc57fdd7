"""Engines side by side: the tokens/s one vLLM engine makes alone and each of several makes at
once, each a process of its own with one thread, unpinned, as the colocated conventional
baseline's generators run (`pipelinerl run --cores colocated`, one generator per core). Where
the engines share the memory bus, each makes less than it would alone: the conventional
phase's generation is that much slower than "cores x one engine", and the throughput bound
(`pipelinerl.planner.bound.Machine.engine_scaling`) counts it.

Part of benchmark 12 (`python -m bench.decode_curve`); one measurement alone:

    python -m bench.engines_side_by_side [--engines 2] [--batch 64] [--seconds 20] [--repeats 2]

Every engine starts first (start-up is not measured); then all of them decode rounds of
`--batch` requests of 64 tokens each from the same moment for `--seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/decode_curve.py

from bench.common import summary  # noqa: E402

TOKENS = 64  # per request and round
START_TIMEOUT_S = 180.0  # a vLLM CPU engine starts in ~10-40 s here
TRIES = 2  # of a measurement whose engines did not all start (each try kills its engines first)


class NotStarted(RuntimeError):
    """An engine process that did not say it was ready in time, or died first."""


async def decode_for(path: str, batch: int, seconds: float) -> dict:
    """In a child: start an engine, say "ready", read the common start (Unix seconds) from
    stdin, wait for it, decode rounds until `seconds` later."""
    import numpy as np

    from bench.tiny_engine import decode_round, tiny_engine

    engine = await tiny_engine(path)
    try:
        rng = np.random.default_rng(os.getpid())
        vocab = engine.llm.tokenizer.vocab_size if engine.llm.tokenizer else 64
        prompts = [[int(t) for t in rng.integers(3, vocab, 16)] for _ in range(batch)]
        print("ready", flush=True)
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        tokens = 0
        while time.time() < start_at + seconds:
            await decode_round(engine, prompts, TOKENS)
            tokens += batch * TOKENS
        return {"tokens": tokens, "seconds": time.time() - start_at}
    finally:
        engine.shutdown()


def wait_ready(p: subprocess.Popen, deadline: float) -> None:
    """Read `p`'s stdout until its line "ready" (vLLM logs to stdout before it), by the
    deadline. Read from the pipe itself: a buffered readline can take "ready" into its buffer
    with the line before it, and the pipe then stays silent (the start looked hung)."""
    assert p.stdout is not None
    fd, seen = p.stdout.fileno(), b""
    while b"\nready\n" not in b"\n" + seen:
        if not select.select([fd], [], [], max(0.0, deadline - time.time()))[0]:
            raise NotStarted(f"an engine did not start in {START_TIMEOUT_S:.0f} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise NotStarted(f"an engine process failed before it was ready ({p.wait()})")
        seen = seen[-64:] + chunk  # enough to hold a line split across two reads


@contextlib.contextmanager
def running_engines(engines: int, batch: int, seconds: float):
    """`engines` engine processes (1 thread each, unpinned), each started and then decoding
    rounds from the same moment for `seconds`; yields the processes once they have begun (each
    prints its tokens and seconds when done) and kills them, their engine cores too, on leaving."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.engines_side_by_side", "--child", "--batch", str(batch)]
    cmd += ["--seconds", str(seconds)]
    procs = [  # each in a session of its own: a hung one is killed with its engine core process
        subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        for _ in range(engines)
    ]
    try:
        deadline = time.time() + START_TIMEOUT_S
        for p in procs:
            wait_ready(p, deadline)
        start_at = time.time() + 1.0
        for p in procs:
            p.stdin.write(f"{start_at}\n")
            p.stdin.flush()
        time.sleep(1.0)
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # vLLM's engine core outlives a killed parent


def side_by_side(engines: int, batch: int, seconds: float) -> list[float]:
    """Tokens/s of each of `engines` engine processes decoding at once (`running_engines`)."""
    rates = []
    with running_engines(engines, batch, seconds) as procs:
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)
            if p.returncode:
                raise SystemExit(f"an engine process failed ({p.returncode})")
            got = json.loads(out.strip().splitlines()[-1])
            rates.append(got["tokens"] / got["seconds"])
    return rates


def measure(engines: int, batch: int, seconds: float, repeats: int) -> dict:
    """One engine alone and `engines` at once, alternated `repeats` times: each engine's tokens/s
    at once over one's alone (the median of the rounds), and the rounds."""
    alone, together = [], []

    def tried(n: int) -> list[float]:
        for attempt in range(1, TRIES + 1):
            try:
                return side_by_side(n, batch, seconds)
            except NotStarted as err:
                if attempt == TRIES:
                    raise SystemExit(f"{err} ({TRIES} tries)") from None
                print(f"  {err}; trying again", flush=True)
        raise AssertionError("unreachable")

    for r in range(repeats):
        alone.append(tried(1)[0])
        together.append(tried(engines))
        print(
            f"  round {r + 1}: one engine alone {alone[-1]:,.0f} tok/s; {engines} at once "
            + ", ".join(f"{x:,.0f}" for x in together[-1])
            + " tok/s",
            flush=True,
        )
    per_round = [sum(t) / len(t) / a for a, t in zip(alone, together)]
    scaling = summary(per_round)["median"]
    return {
        "engines": engines,
        "batch": batch,
        "seconds": seconds,
        "alone_tokens_per_s": alone,
        "together_tokens_per_s": together,
        "engine_scaling": scaling,  # each engine's rate beside the others, over its rate alone
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # an engine's process
    args = ap.parse_args()
    from bench.models import project_caches
    from pipelinerl.tiny_model import resolve_model_path

    project_caches()
    path = resolve_model_path("builtin:tiny-arith")
    if args.child:
        print(json.dumps(asyncio.run(decode_for(path, args.batch, args.seconds))))
        return
    got = measure(args.engines, args.batch, args.seconds, args.repeats)
    print(f"each of {args.engines} engines at once: {got['engine_scaling']:.2f}x its tokens/s alone")


if __name__ == "__main__":
    main()
