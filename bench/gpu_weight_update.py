"""A timed in-flight weight update on one GPU (benchmark 6's companion): a Qwen2-shaped model's
weights packed from the trainer's DeepSpeed engine (ZeRO-1, bf16) into the trainer's snapshot,
broadcast over NCCL to a receiver process on the same GPU and received into a generator's
buffers, the way `WeightSender` and the generator's receiver do it (`full_parameters`,
`Snapshot.pack`, `WeightGroup.form/join`, `receive_buckets`). Every bucket is checked exact (a
checksum on each side).

One GPU holds both ranks: NCCL refuses two ranks of one host on one device, so each process
names its own NCCL_HOSTID and NCCL takes them for two hosts (its socket transport, slower than
NVLink between two GPUs: an upper bound on the broadcast's cost).

    python -m bench.gpu_weight_update [--size 1.5B] [--rounds 3] [--bucket-mb 256]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import torch

from bench.common import save, summary, table
from bench.gpu_trainer import SIZES, job_for
from pipelinerl.ports import free_port

TOKEN = "bench-token"


def checksums(tensors) -> list[float]:
    return [float(t.double().sum()) for t in tensors]


def snapshot_tensors(snapshot, buckets):
    for buf, b in zip(snapshot.buffers, buckets):
        for t in b["tensors"]:
            yield buf[t["offset"] : t["offset"] + t["numel"]]


def _receiver(port: int, buckets: list[dict], rounds: int, out: mp.Queue) -> None:
    try:
        os.environ["NCCL_HOSTID"] = "generator"
        torch.cuda.set_device(0)
        from pipelinerl.weight_group import WeightGroup

        group = WeightGroup.join("127.0.0.1", port, "bench", 1, 2, 120.0, "nccl", TOKEN)
        for _ in range(rounds):
            sums = checksums(t for _, t in group.receive_buckets(buckets))
            out.put(("ok", sums))
        group.close()
    except BaseException as e:  # report instead of hanging the sender
        out.put(("err", repr(e)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["0.5B", "1.5B"], default="1.5B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_weight_update needs a CUDA GPU")
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NCCL_HOSTID="trainer",
    )
    torch.cuda.set_device(0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl.weight_group import Snapshot, WeightGroup, dtype_name, open_store, plan_buckets
    from pipelinerl_trainer.model import build_engine, full_parameters, init_distributed, named_weights

    with tempfile.TemporaryDirectory(prefix="gpu-weights-") as path:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **SIZES[args.size])).save_pretrained(path)
        job = job_for(path, "bfloat16", 1, 8192, False)
        init_distributed(True, 600)
        engine = build_engine(job.spec.trainer, "bfloat16", path)
    params = named_weights(engine)
    by_name = dict(params)
    buckets = plan_buckets([(n, list(p.shape), dtype_name(p.dtype)) for n, p in params], args.bucket_mb << 20)
    snapshot = Snapshot(buckets, torch.device("cuda", 0))
    nbytes = sum(b.numel() * b.element_size() for b in snapshot.buffers)

    port = free_port()
    store = open_store("127.0.0.1", port, True, 120.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, buckets, args.rounds + 1, out), daemon=True)
    proc.start()
    group = WeightGroup.form(store, "bench", 2, 120.0, "nccl", token=TOKEN)
    times: dict[str, list[float]] = {"pack": [], "broadcast": [], "update": []}  # update: until received
    exact = True
    for r in range(args.rounds + 1):  # the first round warms NCCL up and is not counted
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, bucket in enumerate(buckets):
            tensors = [by_name[t["name"]] for t in bucket["tensors"]]
            with full_parameters(engine, tensors):
                snapshot.pack(i, {t["name"]: p.data for t, p in zip(bucket["tensors"], tensors)})
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        group.broadcast(snapshot)
        torch.cuda.synchronize()  # the collective is done on both ranks
        t2 = time.perf_counter()
        status, payload = out.get(timeout=300)
        t3 = time.perf_counter()  # the receiver has every tensor (and its checksum)
        if status != "ok":
            raise SystemExit(f"receiver failed: {payload}")
        exact &= payload == checksums(snapshot_tensors(snapshot, buckets))
        if r:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t0)):
                times[k].append(v)
    group.close()
    proc.join(30)
    rows = [[k, summary(v)["median"], f"{min(v):.3f}-{max(v):.3f}"] for k, v in times.items()]
    gbps = nbytes / summary(times["broadcast"])["median"] / 1e9
    print(
        f"{args.size}: {nbytes / 2**30:.2f} GiB of bf16 weights in {len(buckets)} buckets of ≤ {args.bucket_mb} MiB; "
        f"NCCL on one GPU (two NCCL_HOSTIDs)"
    )
    print(table(["phase", "seconds (median)", "spread"], rows))
    print(f"broadcast {gbps:.1f} GB/s; received exactly: {exact}")
    save(
        f"gpu_weight_update-{args.size}",
        {
            "size": args.size,
            "bytes": nbytes,
            "buckets": len(buckets),
            "seconds": {k: summary(v) for k, v in times.items()},
            "broadcast_gb_per_s": gbps,
            "exact": exact,
        },
        f"python -m bench.gpu_weight_update --size {args.size} --rounds {args.rounds} --bucket-mb {args.bucket_mb}",
    )
    if not exact:
        raise SystemExit("the received weights differ from the snapshot")


if __name__ == "__main__":
    main()
