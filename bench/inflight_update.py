"""In-flight weight update cost: the project's real update path against the bare-gloo limit.

Per model size (random Qwen2-architecture models, bench/models.py) this starts:
- the generator: the project's `Engine` (AsyncLLM, weight-receiver worker extension) with a few
  long greedy requests kept running the whole time (a request that finishes is restarted);
- a trainer process: the project's `WeightSender` over a real `WeightGroup`, sending the weights
  of a Hugging Face model loaded from the same folder. Only the DeepSpeed engine and the NATS
  bridge are stand-ins (a ZeRO-1 engine needs no gather; an mp queue carries the same encoded
  WeightUpdate / WeightUpdateDone messages NATS would).

Alternated in the same run, per round:
- update, staged (the default, `weightSync.staged: true`): `WeightSender.send` wall time on the
  trainer (announce, flatten + broadcast the buckets, reply). The generator receives, loads and
  re-packs into its staging copy of the weights while the requests keep generating, then pauses
  only to copy it into the live weights and relabel; its pause time (pause -> resume, from
  `Engine.update_weights`) comes back in the reply;
- update, in the pause (`staged: false`): the same, but the generator pauses first and receives,
  loads and re-packs inside the pause;
- raw: the same bytes, in the same bucket sizes, broadcast over a bare `ProcessGroupGloo` from
  the trainer process to the same vLLM worker process, into preallocated buffers (no flatten
  copy, no load): the transport's physical limit on this machine.
The worker also times the transfer + load + CPU GEMM re-pack itself ("load").

Target: update (and pause) <= 1.5 x raw + 30 ms. A bucket sweep (one tensor per send, 1, 16,
128 MB) runs staged updates and raw on one model. Every request must finish by length with all
its tokens (none aborted).

    python -m bench.inflight_update            # full settings
    python -m bench.inflight_update --sizes 3M --repeats 2 --sweep-repeats 1 --sweep-size 3M
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

# Before torch loads OpenMP: on a shared machine, spin-waiting OpenMP threads (the default) slow
# small-model work ~15x whenever other processes hold the cores; passive waiting keeps the figures
# meaningful under contention. Set OMP_WAIT_POLICY=ACTIVE to measure the default on a quiet machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from pipelinerl.ports import free_port  # noqa: E402
from pipelinerl_generator.weight_receiver import WeightReceiverExtension  # noqa: E402

HOST = "127.0.0.1"
INCARNATION = "bench"  # the one generator's process id in the weight group
TIMEOUT_S = 300.0  # generous: engine start of the largest model under load counts against the rendezvous
RUN_TIMEOUT_S = 600.0  # the step sender's wait for its next version
STREAMS = 4  # long requests kept running through every update
MAX_TOKENS, MAX_SEQ = 256, 512
GAP_S = 0.2  # between measurements, so requests make progress and every update lands mid-generation
SWEEP = {"per-tensor": 0, "1MB": 1, "16MB": 16, "128MB": 128}  # MB per bucket; 0: one tensor per send
TARGET_FACTOR, TARGET_FIXED_S = 1.5, 0.030
MODES = ("staged", "in pause")  # weightSync.staged true / false


# --- generator side: the project's extension plus a bare-gloo receive for the raw limit ------


class BenchReceiver(WeightReceiverExtension):
    """The project's extension, plus a timer around its in-place load (transfer + load + re-pack,
    staged or in the pause) and a bare-gloo receive for the raw limit."""

    _bench_receive_s = 0.0

    def _pipelinerl_load_in_place(self, model, packed, weights) -> None:
        t0 = time.perf_counter()
        super()._pipelinerl_load_in_place(model, packed, weights)
        self._bench_receive_s = time.perf_counter() - t0

    def bench_last_receive_s(self) -> float:
        return self._bench_receive_s

    def bench_join_raw(self, host: str, port: int, timeout_s: float) -> None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=timeout_s))
        self._bench_raw = (store, dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=timeout_s)))
        self._bench_buf = torch.empty(0)

    def bench_raw_receive(self, numels: list[int]) -> None:
        pg = self._bench_raw[1]
        if self._bench_buf.numel() < sum(numels):  # allocated once: the limit excludes allocation
            self._bench_buf = torch.zeros(sum(numels))
        flag = torch.zeros(1)
        _bcast(pg, flag, root=1)  # "ready": the trainer starts its clock after this
        off = 0
        for n in numels:
            _bcast(pg, self._bench_buf[off : off + n], root=0)
            off += n
        _bcast(pg, flag, root=1)  # "all bytes in": the trainer stops its clock


def _bcast(pg, t: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()


# --- trainer side (a spawned process) -----------------------------------------------------


class _DeepSpeedStandIn:
    """What WeightSender needs of a DeepSpeed engine: the module; stage < 3 means no gather."""

    def __init__(self, module):
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 1


class _Replies:
    """bridge.done: WeightUpdateDone messages, decoded as the NATS bridge does."""

    def __init__(self, q):
        self.q = q

    def empty(self) -> bool:
        return self.q.empty()

    def get_nowait(self):
        from pipelinerl import messages as m

        return m.decode(self.q.get_nowait(), m.WeightUpdateDone)

    def get(self, timeout=None):
        from pipelinerl import messages as m

        return m.decode(self.q.get(timeout=timeout), m.WeightUpdateDone)


class _BridgeStandIn:
    class subjects:  # noqa: N801 - mirrors JobSubjects' attributes
        weights_update = "weights.update"
        sent = "control.sent"  # the record of the version sent: kept by the store, which this has none of

    def __init__(self, gen_q, done_q):
        import queue as queue_

        from pipelinerl import messages as m

        self.gen_q, self.done = gen_q, _Replies(done_q)
        self.staged = True  # which way the generator applies the next update
        # The one generator (the main process) is there from the start.
        self.hellos = queue_.Queue()
        self.hellos.put((time.monotonic(), m.GeneratorHello(generator=0, incarnation=INCARNATION, version=0)))

    def now(self) -> float:
        return time.monotonic()  # one process, never paused

    def publish(self, subject, msg, stream=True) -> None:
        from pipelinerl import messages as m

        if subject == self.subjects.weights_update:
            self.gen_q.put(("staged" if self.staged else "in pause", m.encode(msg)))


@contextlib.contextmanager
def _trainer_side(gen_q, res_q):
    """A trainer process's body: a failure is reported on `res_q` (never leaving the generator
    side waiting), and the generator's `serve` is told to stop however the body ends."""
    try:
        yield
    except BaseException as e:
        import traceback

        res_q.put(("err", traceback.format_exc()))
        raise SystemExit(1) from e
    finally:
        gen_q.put(("stop", None))


def _sender(model, bridge: _BridgeStandIn, bucket_mb: int, port: int):
    """The project's `WeightSender` on `model` (rank 0, gloo), serving the weight group's
    rendezvous on `port`; the generator joins at the first update."""
    from pipelinerl.weight_group import open_store
    from pipelinerl_trainer.weight_sender import WeightSender

    return WeightSender(
        _DeepSpeedStandIn(model),
        0,
        bridge,
        backend="gloo",
        bucket_mb=bucket_mb,
        timeout_s=TIMEOUT_S,
        store=open_store(HOST, port, True, TIMEOUT_S),
        liveness_s=float("inf"),
    )


def _trainer_main(path: str, port: int, raw_port: int, gen_q, done_q, res_q, cfg: dict) -> None:
    with _trainer_side(gen_q, res_q):
        from transformers import Qwen2ForCausalLM

        from bench.common import alternate
        from pipelinerl.weight_group import plan_buckets
        from pipelinerl.weight_snapshot import Snapshot

        model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
        bridge = _BridgeStandIn(gen_q, done_q)
        # The generator joins the weight group at the first update (a warm-up round, not measured).
        sender = _sender(model, bridge, cfg["bucket_mb"], port)
        store = dist.TCPStore(HOST, raw_port, 2, is_master=True, timeout=timedelta(seconds=TIMEOUT_S))
        raw_pg = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=TIMEOUT_S))
        default_plan = sender.buckets
        shapes = [(n, list(p.shape), "float32") for n, p in sender.params]
        flat = torch.cat([p.detach().reshape(-1) for _, p in sender.params])  # the same bytes
        version, extra = 0, {}  # extra[label]: (version, pause, generators with running requests) per update

        def update(label, plan, staged=True):
            def fn():
                nonlocal version
                time.sleep(GAP_S)
                version += 1
                if sender.buckets is not plan:  # the snapshot is packed by its plan: a new plan, a new one
                    sender.buckets, sender.snapshot = plan, Snapshot(plan, torch.device("cpu"))
                bridge.staged = staged
                stats = sender.send(version)
                extra.setdefault(label, []).append(
                    (version, stats["weight_pause_max_seconds"], stats["updates_with_running_requests"])
                )
                return stats["weight_sync_seconds"]

            return fn

        def raw(plan):
            numels = [b["numel"] for b in plan]

            def fn():
                time.sleep(GAP_S)
                gen_q.put(("raw", numels))
                flag = torch.zeros(1)
                _bcast(raw_pg, flag, root=1)
                t0 = time.perf_counter()
                off = 0
                for n in numels:
                    _bcast(raw_pg, flat[off : off + n], root=0)
                    off += n
                _bcast(raw_pg, flag, root=1)
                return time.perf_counter() - t0

            return fn

        def collect(runs, label, plan, update_key, raw_key):
            recs = extra[label][1:]  # alternate() ran each side once as warm-up first
            return {
                "update_s": runs[update_key],
                "raw_s": runs[raw_key],
                "versions": [v for v, _, _ in recs],
                "pause_s": [p for _, p, _ in recs],
                "with_running_requests": [r for _, _, r in recs],
                "buckets": len(plan),
                "bytes": 4 * sum(b["numel"] for b in plan),
            }

        out = {"parameters": int(flat.numel())}
        runs = alternate(
            {
                MODES[0]: update(MODES[0], default_plan),
                MODES[1]: update(MODES[1], default_plan, False),
                "raw": raw(default_plan),
            },
            cfg["repeats"],
        )
        out["headline"] = {mode: collect(runs, mode, default_plan, mode, "raw") for mode in MODES}
        if cfg["sweep"]:
            plans = {lab: plan_buckets(shapes, max(1, mb << 20)) for lab, mb in SWEEP.items()}
            sides = {}
            for lab, plan in plans.items():
                sides[f"update {lab}"] = update(lab, plan)
                sides[f"raw {lab}"] = raw(plan)
            runs = alternate(sides, cfg["sweep_repeats"])
            out["sweep"] = {lab: collect(runs, lab, plan, f"update {lab}", f"raw {lab}") for lab, plan in plans.items()}
        res_q.put(("ok", out))


def step_sender_main(path: str, port: int, bucket_mb: int, cpu: int | None, gen_q, done_q, steps_q, res_q) -> None:
    """A trainer process for the rollout path with updates (`bench/rollout_path.py`): on its own
    core (`cpu`), the project's `WeightSender` sends the weights of each version `steps_q` names
    as a run's trainer does after a step (`wait=False`: sent from a thread, the previous update
    finished and confirmed at the next); a None ends it, and its send statistics go to `res_q`."""
    with _trainer_side(gen_q, res_q):
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM

        sender = _sender(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            _BridgeStandIn(gen_q, done_q),
            bucket_mb,
            port,
        )
        sent = []
        while (version := steps_q.get(timeout=RUN_TIMEOUT_S)) is not None:
            sent.append({"version": version, **sender.send(version, wait=False)})
        sender.finish()
        sender.confirm()
        res_q.put(("ok", sent))


# --- generator side: the main process ----------------------------------------------------------


async def keep_generating(engine, prompt: list[int], stop: asyncio.Event, done: list, errors: list) -> None:
    while not stop.is_set():
        try:
            done.append(await engine.generate(prompt, MAX_TOKENS, greedy=True))
        except Exception as e:  # a failed request is a finding, not a crash (this stream stops)
            errors.append(repr(e))
            return


async def serve(engine, gen_q, done_q, trainer, port: int, receive_s: dict | None = None) -> None:
    """The generator's part: join the weight group and apply WeightUpdates as the service does;
    run raw receives. With `receive_s` (this benchmark's own measurement), the benchmark's
    receiver times each load into it, and an update applied otherwise than the round asked
    (staged or in the pause) fails the round; without, as the service does, an update with no
    request running is received in the pause."""
    from pipelinerl import messages as m

    group = None
    while True:
        try:
            kind, body = await asyncio.to_thread(gen_q.get, True, 1.0)
        except queue.Empty:
            if not trainer.is_alive():
                raise RuntimeError(f"trainer process died (exit code {trainer.exitcode})") from None
            continue
        if kind == "stop":
            return
        if kind == "raw":
            await engine.llm.collective_rpc("bench_raw_receive", args=(body,))
            continue
        await engine.choose_staged(kind == "staged")
        update = m.decode(body, m.WeightUpdate)
        if update.group != group:
            group = update.group
            await engine.join_weight_group(HOST, port, group, 1, 2, TIMEOUT_S)
        reply = m.WeightUpdateDone(
            version=update.version, generator=0, incarnation=INCARNATION, pause_seconds=0.0, running_requests=0
        )
        try:
            stats = await engine.update_weights(update.version, update.buckets)
            if receive_s is not None and stats.staged != engine.staged:
                raise RuntimeError(f"asked for staged={engine.staged}, the engine did staged={stats.staged}")
            reply.pause_seconds, reply.running_requests = stats.pause_seconds, stats.running_requests
        except Exception as e:
            reply.error = f"{type(e).__name__}: {e}"
        done_q.put(m.encode(reply))
        if receive_s is None:
            continue
        # After the reply, so outside the trainer's clock (it sleeps GAP_S before the next one).
        receive_s[update.version] = (await engine.llm.collective_rpc("bench_last_receive_s"))[0]


async def run_size(size: str, cfg: dict, tmp: Path) -> dict:
    from bench.models import save_model
    from pipelinerl.spec import parse_job
    from pipelinerl.tiny_model import make_tokenizer
    from pipelinerl_generator.engine import Engine

    path, _ = save_model(tmp / size, size)
    ctx = mp.get_context("spawn")
    gen_q, done_q, res_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port, raw_port = free_port(), free_port()
    trainer = ctx.Process(target=_trainer_main, args=(path, port, raw_port, gen_q, done_q, res_q, cfg), daemon=True)
    trainer.start()
    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "bench"},
            "spec": {
                "model": {"path": path, "maxSeqLen": MAX_SEQ, "dtype": "float32"},
                "generator": {"sampling": {"maxTokens": MAX_TOKENS}},
                "weightSync": {"backend": "gloo", "timeoutSeconds": TIMEOUT_S},
            },
        }
    )
    # The benchmark's receiver replaces PipelineRL's extension (validation refuses that from a manifest).
    job.spec.generator.engine_args["worker_extension_cls"] = "bench.inflight_update.BenchReceiver"
    engine = Engine(job, path)
    tok = make_tokenizer()
    stop, done, errors = asyncio.Event(), [], []
    pool = []
    try:
        await engine.start(0)
        await engine.llm.collective_rpc("bench_join_raw", args=(HOST, raw_port, TIMEOUT_S))
        pool = [
            asyncio.create_task(keep_generating(engine, tok.encode(f"{i}{i}+{i}="), stop, done, errors))
            for i in range(STREAMS)
        ]
        receive_s = {}
        await serve(engine, gen_q, done_q, trainer, port, receive_s)
        status, out = await asyncio.to_thread(res_q.get, True, 60)
        if status != "ok":
            raise RuntimeError(f"trainer side failed:\n{out}")
        stop.set()
        await asyncio.gather(*pool)  # let running requests finish by themselves
    finally:
        stop.set()
        for t in pool:
            t.cancel()
        engine.shutdown()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    for r in [*out["headline"].values(), *out.get("sweep", {}).values()]:
        r["receive_s"] = [receive_s[v] for v in r.pop("versions")]
    bad = [c for c in done if c.finish_reason != "length" or len(c.tokens) != MAX_TOKENS]
    out["requests"] = {
        "finished": len(done),
        "not_full_length": len(bad),
        "errors": errors,
        "spanning_updates": sum(len(set(c.versions)) > 1 for c in done),
    }
    return out


# --- report -----------------------------------------------------------------------------------


def target_s(raw_s: float) -> float:
    return TARGET_FACTOR * raw_s + TARGET_FIXED_S


def analyse(r: dict) -> dict:
    from bench.common import paired_ratios, summary

    up, pause, raw = r["update_s"], r["pause_s"], r["raw_s"]
    med_raw = summary(raw)["median"]
    out = {
        "update": summary(up),
        "raw": summary(raw),
        "pause": summary(pause),
        "receive": summary(r["receive_s"]),
        "ratio": paired_ratios(up, raw),
        "target_s": target_s(med_raw),
        "raw_gb_per_s": r["bytes"] / med_raw / 1e9,
    }
    for key, xs in (("update", up), ("pause", pause)):
        out[f"{key}_target_met"] = summary(xs)["median"] <= target_s(med_raw)
        out[f"{key}_rounds_within_target"] = sum(x <= target_s(w) for x, w in zip(xs, raw))
    return out


def ms(s: dict) -> str:
    return f"{1e3 * s['median']:.1f} ({1e3 * s['min']:.1f}-{1e3 * s['max']:.1f})"


def met(r: dict, a: dict, key: str) -> str:
    return f"{'yes' if a[f'{key}_target_met'] else 'NO'} {a[f'{key}_rounds_within_target']}/{len(r['update_s'])}"


def rows_for(label: str, r: dict, a: dict) -> list:
    return [
        label,
        f"{r['bytes'] / 2**20:.0f}",
        r["buckets"],
        ms(a["pause"]),
        ms(a["receive"]),
        ms(a["update"]),
        ms(a["raw"]),
        f"{a['ratio']['median']:.2f} ({a['ratio']['min']:.2f}-{a['ratio']['max']:.2f})",
        f"{1e3 * a['target_s']:.0f}",
        met(r, a, "pause"),
        met(r, a, "update"),
        f"{a['raw_gb_per_s']:.2f}",
    ]


HEADERS = [
    "model",
    "MB",
    "buckets",
    "pause ms",
    "load ms",
    "update ms",
    "raw ms",
    "update/raw",
    "target ms",
    "pause met (rounds)",
    "update met (rounds)",
    "raw GB/s",
]


def main() -> None:
    from bench.common import save, table
    from bench.models import SIZES, project_caches

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sweep-size", default="120M", choices=[*SIZES, "none"])
    p.add_argument("--sweep-repeats", type=int, default=5)
    args = p.parse_args()
    project_caches()
    from pipelinerl.spec import WeightSyncSpec

    bucket_mb = WeightSyncSpec().bucket_mb  # the project's default bucket size
    results, rows, sweep_rows = {}, [], []
    with tempfile.TemporaryDirectory(prefix="bench-inflight-") as tmp:
        for size in args.sizes:
            cfg = {
                "bucket_mb": bucket_mb,
                "repeats": args.repeats,
                "sweep": size == args.sweep_size,
                "sweep_repeats": args.sweep_repeats,
            }
            t0 = time.time()
            out = asyncio.run(run_size(size, cfg, Path(tmp)))
            for mode, r in out["headline"].items():
                r["analysis"] = analyse(r)
                rows.append(rows_for(f"{size} ({out['parameters'] / 1e6:.0f}M), {mode}", r, r["analysis"]))
            for lab, r in out.get("sweep", {}).items():
                r["analysis"] = analyse(r)
                sweep_rows.append(rows_for(f"{size} {lab}", r, r["analysis"]))
            req = out["requests"]
            print(
                f"{size}: done in {time.time() - t0:.0f}s; requests finished {req['finished']}, "
                f"spanning updates {req['spanning_updates']}, not full length {req['not_full_length']}, "
                f"errors {len(req['errors'])}",
                flush=True,
            )
            results[size] = out
    print(
        f"\nIn-flight update (AsyncLLM via the project's Engine, {STREAMS} greedy requests running, "
        f"default bucket {bucket_mb} MB); median (min-max) over {args.repeats} alternated rounds"
    )
    print(table(HEADERS, rows))
    if sweep_rows:
        print(f"\nBucket size sweep ({args.sweep_size}, {args.sweep_repeats} alternated rounds)")
        print(table(HEADERS, sweep_rows))
    aborted = sum(r["requests"]["not_full_length"] + len(r["requests"]["errors"]) for r in results.values())
    print(f"\nrequests not finished by length (aborted or failed): {aborted}")
    path = save(
        "inflight_update",
        {
            "settings": {
                "streams": STREAMS,
                "max_tokens": MAX_TOKENS,
                "gap_s": GAP_S,
                "bucket_mb": bucket_mb,
                "repeats": args.repeats,
                "sweep_size": args.sweep_size,
                "sweep_repeats": args.sweep_repeats,
                "target": f"update, pause <= {TARGET_FACTOR} x raw + {1e3 * TARGET_FIXED_S:.0f} ms",
                "engine": "vllm AsyncLLM via pipelinerl_generator.engine.Engine (V1, enforce_eager)",
            },
            "sizes": results,
            "requests_aborted_or_failed": aborted,
        },
        command=f"python -m bench.inflight_update {' '.join(sys.argv[1:])}".strip(),
    )
    print(f"saved {path}")
    if aborted:
        raise SystemExit("some requests were aborted or failed")


if __name__ == "__main__":
    main()
