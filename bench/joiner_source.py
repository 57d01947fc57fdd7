"""Where a joining generator should get the current weights from: a broadcast from the trainer,
or the newest export on the checkpoint volume. Benchmark 8.

A joiner needs the whole model once. Both ways end in the same vLLM reload of the same tensors
(measured in benchmark 2), so this times only what differs, per model size, alternated in one run:

  broadcast:  the project's path: the joiner joins a fresh epoch of the weight group
              (`WeightGroup.join`, two-phase rendezvous included) and receives every bucket of
              the trainer's packed snapshot (`Snapshot`, the default bucket size) into fresh
              buffers, as a new generator process does;
  disk, cold: reading the export (the Hugging Face folder `checkpoint.export` writes, safetensors)
              with its pages first dropped from the page cache (posix_fadvise DONTNEED): a volume
              read by a pod that never read it;
  disk, warm: the same read from the page cache: the best a volume can do.

    python -m bench.joiner_source                 # 3M, 30M, 120M; 5 rounds
    python -m bench.joiner_source --sizes 3M --repeats 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
TIMEOUT_S = 300.0


def _sender(path: str, port: int, bucket_mb: int, rounds: int, ready) -> None:
    """The trainer's side: the model packed once into its snapshot, sent to one joiner per round."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.weight_group import Snapshot, WeightGroup, dtype_name, open_store, plan_buckets

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    buckets = plan_buckets([(n, list(p.shape), dtype_name(p.dtype)) for n, p in params.items()], bucket_mb << 20)
    snapshot = Snapshot(buckets, torch.device("cpu"))
    for i, b in enumerate(buckets):
        snapshot.pack(i, {t["name"]: params[t["name"]].data for t in b["tensors"]})
    store = open_store(HOST, port, True, TIMEOUT_S)
    ready.put(buckets)
    for r in range(rounds):
        group = WeightGroup.form(store, f"round-{r}", 2, TIMEOUT_S, join_timeout_s=TIMEOUT_S)
        group.broadcast(snapshot)
        group.close()


def _drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read(files: list[Path]) -> int:
    """Every tensor copied into a fresh buffer, as the broadcast receives them: safetensors maps
    the file, so nothing is read from it before the copy touches it."""
    import torch
    from safetensors.torch import load_file

    return sum(torch.empty_like(t).copy_(t).nbytes for f in files for t in load_file(f).values())


def run_size(size: str, repeats: int, tmp: Path) -> dict:
    from bench.common import alternate
    from bench.models import save_model
    from pipelinerl.ports import free_port
    from pipelinerl.spec import WeightSyncSpec
    from pipelinerl.weight_group import WeightGroup

    path, parameters = save_model(tmp / size, size)
    files = sorted(Path(path).glob("*.safetensors"))
    port, ctx = free_port(), mp.get_context("spawn")
    ready = ctx.Queue()
    rounds = repeats + 1  # alternate() runs one warm-up round
    sender = ctx.Process(target=_sender, args=(path, port, WeightSyncSpec().bucket_mb, rounds, ready), daemon=True)
    sender.start()
    buckets = ready.get(timeout=TIMEOUT_S)
    counter = iter(range(rounds))
    received = {}

    def broadcast() -> float:
        t0 = time.perf_counter()
        group = WeightGroup.join(HOST, port, f"round-{next(counter)}", 1, 2, TIMEOUT_S)
        received["bytes"] = sum(t.numel() * t.element_size() for _, t in group.receive_buckets(buckets))
        group.close()
        return time.perf_counter() - t0

    def disk(cold: bool):
        def read() -> float:
            if cold:
                _drop_cache(files)
            t0 = time.perf_counter()
            received["disk_bytes"] = _read(files)
            return time.perf_counter() - t0

        return read

    try:
        times = alternate({"broadcast": broadcast, "disk_cold": disk(True), "disk_warm": disk(False)}, repeats)
    finally:
        sender.join(60)
        if sender.is_alive():
            sender.kill()
    return {
        "parameters": parameters,
        "bytes": received["bytes"],
        "disk_bytes": received["disk_bytes"],
        "file_bytes": sum(f.stat().st_size for f in files),
        "seconds": times,
    }


def main() -> None:
    from bench.common import paired_ratios, save, summary, table
    from bench.models import SIZES, project_caches

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    project_caches()
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="bench-joiner-") as tmp:
        for size in args.sizes:
            r = results[size] = run_size(size, args.repeats, Path(tmp))
            s = {k: summary(v) for k, v in r["seconds"].items()}
            ms = lambda k: f"{1e3 * s[k]['median']:.0f} ({1e3 * s[k]['min']:.0f}-{1e3 * s[k]['max']:.0f})"  # noqa: E731
            cold = paired_ratios(r["seconds"]["disk_cold"], r["seconds"]["broadcast"])["median"]
            rows.append(
                [
                    f"{size} ({r['parameters'] / 1e6:.0f}M)",
                    f"{r['bytes'] / 2**20:.0f}",
                    ms("broadcast"),
                    ms("disk_cold"),
                    ms("disk_warm"),
                    f"{cold:.2f}",
                    f"{r['bytes'] / s['broadcast']['median'] / 1e9:.2f}",
                ]
            )
    print(
        f"\nA joiner's first weights, median (min-max) ms over {args.repeats} alternated rounds "
        "(the vLLM reload after either is the same, not included)"
    )
    print(table(["model", "MB", "broadcast", "disk, cold", "disk, warm", "cold/broadcast", "broadcast GB/s"], rows))
    path = save(
        "joiner_source",
        {"settings": {"repeats": args.repeats}, "sizes": results},
        command=f"python -m bench.joiner_source {' '.join(sys.argv[1:])}".strip(),
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
