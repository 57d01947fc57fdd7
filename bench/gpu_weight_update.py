"""A timed in-flight weight update on one GPU (benchmark 6's companion): a Qwen2-shaped model's
weights packed from the trainer's DeepSpeed engine (ZeRO-1, bf16) into the trainer's snapshot,
broadcast over NCCL to a receiver process on the same GPU and received into a generator's
buffers, the way `WeightSender` and the generator's receiver do it (`full_parameters`,
`Snapshot.pack`, `WeightGroup.form/join`, `receive_buckets`). Two sides, alternating round by
round: the snapshot on the GPU, and in pinned host memory (each bucket copied back through a
ring of two GPU buffers as it is sent: what the trainer does for a model more than
`SNAPSHOT_GPU_SHARE` of its GPU, `snapshot_in_host`). Every bucket is checked exact (a checksum
on each side).

One GPU holds both ranks: NCCL refuses two ranks of one host on one device, so each process
names its own NCCL_HOSTID and NCCL takes them for two hosts (its socket transport, slower than
NVLink between two GPUs: an upper bound on the broadcast's cost).

    python -m bench.gpu_weight_update [--size 1.5B] [--rounds 3] [--bucket-mb 256]
    python -m bench.gpu_weight_update --smoke   # CPU: the tiny shape over gloo, checks the script

It ends with a VERDICT line and writes its JSON (bench/results, or `--results-dir`), also when
the receiver fails (with the error).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import gpu_or_smoke, one_rank_distributed_env, save, summary, table
from bench.gpu_shapes import SIZES
from bench.gpu_trainer import NAME, job_for
from pipelinerl.ports import free_port

TOKEN = "bench-token"
TIMEOUT_S = 120.0  # the group's collectives, and the wait for the receiver to join (a fresh CUDA process)


def checksums(tensors) -> list[float]:
    return [float(t.double().sum()) for t in tensors]


def snapshot_tensors(snapshot, buckets):
    for buf, b in zip(snapshot.buffers, buckets):
        for t in b["tensors"]:
            yield buf[t["offset"] : t["offset"] + t["numel"]]


def _receiver(port: int, buckets: list[dict], rounds: int, backend: str, out: mp.Queue) -> None:
    try:
        if backend == "nccl":
            os.environ["NCCL_HOSTID"] = "generator"
            torch.cuda.set_device(0)
        from pipelinerl.weight_group import WeightGroup

        group = WeightGroup.join("127.0.0.1", port, "bench", 1, 2, TIMEOUT_S, backend, TOKEN)
        for _ in range(rounds):
            sums = checksums(t for _, t in group.receive_buckets(buckets))
            out.put(("ok", sums))
        group.close()
    except BaseException as e:  # report instead of hanging the sender
        out.put(("err", repr(e)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--size", choices=list(SIZES), default="1.5B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--name", help="the result file's name (default gpu_weight_update-SIZE)")
    ap.add_argument("--results-dir", type=Path, help="where the result JSON goes (default bench/results)")
    ap.add_argument("--smoke", action="store_true", help="CPU and gloo, the tiny shape: checks the script")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.smoke and args.size != "smoke":
        args.size = "smoke"
    if args.rounds < 1:
        ap.error("--rounds: must be at least 1")
    if args.bucket_mb < 1:
        ap.error("--bucket-mb: must be at least 1")
    args.name = args.name or f"gpu_weight_update-{args.size}"
    if not NAME.fullmatch(args.name):
        ap.error(f"--name: {args.name!r} may hold only letters, digits, '.', '_' and '-'")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu, folder = gpu_or_smoke(args, "gpu_weight_update")
    backend = "nccl" if on_gpu else "gloo"
    command = (
        f"python -m bench.gpu_weight_update --size {args.size} --rounds {args.rounds} --bucket-mb {args.bucket_mb}"
        + (" --smoke" if args.smoke else "")
    )
    one_rank_distributed_env()
    if on_gpu:
        os.environ["NCCL_HOSTID"] = "trainer"
        torch.cuda.set_device(0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl.weight_group import WeightGroup, bucket_nbytes, dtype_name, open_store, plan_buckets
    from pipelinerl.weight_snapshot import Snapshot
    from pipelinerl_trainer.model import build_engine, full_parameters, init_distributed, named_weights

    dtype = "bfloat16" if on_gpu else "float32"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="gpu-weights-") as path:
        torch.manual_seed(0)
        with device:  # random init on the GPU: seconds, not a minute
            model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **SIZES[args.size]))
            model.to(getattr(torch, dtype)).save_pretrained(path)
        del model
        job = job_for(path, dtype, 1, 8192, False)
        init_distributed(on_gpu, 600)
        engine = build_engine(job.spec.trainer, dtype, path)
    params = named_weights(engine)
    by_name = dict(params)
    buckets = plan_buckets([(n, list(p.shape), dtype_name(p.dtype)) for n, p in params], args.bucket_mb << 20)
    snapshots = {"gpu": Snapshot(buckets, device), "host": Snapshot(buckets, device, in_host=True)}
    nbytes = sum(map(bucket_nbytes, buckets))
    transport = "NCCL on one GPU (two NCCL_HOSTIDs)" if on_gpu else "gloo on the CPU"
    what = (
        f"{args.size}: {nbytes / 2**30:.2f} GiB of {dtype} weights in {len(buckets)} buckets "
        f"of ≤ {args.bucket_mb} MiB; {transport}"
    )
    print(what, flush=True)

    port = free_port()
    store = open_store("127.0.0.1", port, True, TIMEOUT_S)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rounds = (args.rounds + 1) * len(snapshots)
    proc = ctx.Process(target=_receiver, args=(port, buckets, rounds, backend, out), daemon=True)
    proc.start()
    phases = ("pack", "broadcast", "update")  # update: until received
    times: dict[str, dict[str, list[float]]] = {side: {k: [] for k in phases} for side in snapshots}
    exact = True
    error = None
    try:
        # The receiver is a fresh process: importing torch (and a CUDA context) takes seconds.
        group = WeightGroup.form(store, "bench", 2, TIMEOUT_S, backend, join_timeout_s=TIMEOUT_S, token=TOKEN)
        for r, side in ((r, side) for r in range(args.rounds + 1) for side in snapshots):
            snapshot = snapshots[side]  # the first round of each warms the transport up and is not counted
            sync(on_gpu)
            t0 = time.perf_counter()
            for i, bucket in enumerate(buckets):
                tensors = [by_name[t["name"]] for t in bucket["tensors"]]
                with full_parameters(engine, tensors):
                    snapshot.pack(i, {t["name"]: p.data for t, p in zip(bucket["tensors"], tensors)})
            sync(on_gpu)
            t1 = time.perf_counter()
            group.broadcast(snapshot)
            sync(on_gpu)  # the collective is done on both ranks
            t2 = time.perf_counter()
            status, payload = out.get(timeout=300)
            t3 = time.perf_counter()  # the receiver has every tensor (and its checksum)
            if status != "ok":
                raise RuntimeError(f"receiver failed: {payload}")
            # Summed where the receiver sums (the GPU snapshot: both pack the same weights), so the
            # order of a float sum never tells them apart.
            exact &= payload == checksums(snapshot_tensors(snapshots["gpu"], buckets))
            if r:
                for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t0)):
                    times[side][k].append(v)
        group.close()
    except Exception as e:  # recorded: the JSON says what stopped it
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    result: dict = {"size": args.size, "backend": backend, "bytes": nbytes, "buckets": len(buckets)}
    if error is None:
        med = {side: {k: summary(v)["median"] for k, v in t.items()} for side, t in times.items()}
        gbps = {side: nbytes / m["broadcast"] / 1e9 for side, m in med.items()}
        rows = [
            [side, k, med[side][k], f"{min(v):.3f}-{max(v):.3f}"] for side, t in times.items() for k, v in t.items()
        ]
        print(table(["snapshot", "phase", "seconds (median)", "spread"], rows))
        gpu, host = med["gpu"], med["host"]
        verdict = (
            f"VERDICT weight update {args.size}: {gpu['update']:.3g} s end to end (pack {gpu['pack']:.3g} s, "
            f"broadcast {gpu['broadcast']:.3g} s at {gbps['gpu']:.3g} GB/s); kept in host memory "
            f"{host['update']:.3g} s ({host['update'] / gpu['update']:.2f}×: pack {host['pack']:.3g} s, "
            f"broadcast {host['broadcast']:.3g} s), " + ("received exactly" if exact else "RECEIVED WEIGHTS DIFFER")
        )
        result |= {
            "seconds": {side: {k: summary(v) for k, v in t.items()} for side, t in times.items()},
            "broadcast_gb_per_s": gbps,
            "exact": exact,
        }
    else:
        verdict = f"VERDICT weight update {args.size}: FAILED: {error}"
        result["error"] = error
    result["verdict_lines"] = [verdict]
    print(verdict, flush=True)
    if folder is not None:
        save(args.name, result, command, folder)
    if error is not None or not exact:
        raise SystemExit(1)


def sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
