"""The tiny default model (no hub access): a character tokenizer and a ~3M parameter
Qwen2-architecture model that vLLM and Hugging Face both load.

`builtin:tiny-arith` has had a short supervised warm start on `arith`, stopped by held-out
accuracy (deliberately partial, 10-50%) so RL has something to learn; `builtin:tiny-chain` the
same on `chain`. Their weights ship with the package (`builtin_models/<name>.safetensors`, fp16,
with the record of their warm start in `<name>.json`: its steps, its held-out accuracy, the
weights' sha256): a float32 warm start is not the same on every CPU (its kernels sum in
different orders), so it is built once (`python -m pipelinerl.tiny_model tiny-arith tiny-chain`,
`deterministic_build`) and every machine starts from the same weights, checked by hash, and
skips the minutes the build takes. `builtin:tiny-random` is the same model untrained (for fast
tests), made from a seed. Each is written as a Hugging Face folder under PIPELINERL_CACHE on
first use.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelinerl.contracts import Env
from pipelinerl.spec_base import BUILTIN_MODELS

if TYPE_CHECKING:  # torch is imported where a model is built or trained: `pipelinerl validate` and
    import torch  # the runner only read names, paths and the tokenizer (importing it costs 1.4 s)

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<eos>"]
CHARS = list("0123456789+-*=<>?: ")
VOCAB_SIZE = 32  # padded: a multiple of 8 is friendlier to kernels
ARCH: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)
# The warm start learns sums without carry-out (see pipelinerl.tasks.arith): its accuracy jumps
# from ~0 to >50% within ~100 steps, so it is checked every 5 steps to stop inside 10-50%.
# Stopping at >= 25% rather than ~15% leaves fewer prompts that no attempt solves: RL then wastes
# less generation on groups it must discard (1.25 vs 1.57 s per step) and gains as fast.
WARM: dict[str, Any] = dict(
    lr=1e-3,
    batch=128,
    max_steps=3000,
    eval_every=5,
    eval_from=100,
    eval_problems=500,
    target_min=0.25,
    digits=3,
    carry_out=False,
    seed=1234,
)
# `builtin:tiny-chain`, for the long-tail task (pipelinerl.tasks.chain): near 0 for ~300 steps,
# then from 4% to 50% within ~100 (a solution is right only if every step is), so it is checked
# every 5 steps from step 250 to stop near 20%, with the long chains mostly unsolved, for RL.
WARM_CHAIN: dict[str, Any] = dict(
    lr=1e-3,
    batch=128,
    buckets=4,
    max_steps=3000,
    eval_every=5,
    eval_from=250,
    eval_problems=500,
    target_min=0.20,
    chain_steps=12,
    tail=1.0,
    seed=1234,
)
WARM_STARTS = {"tiny-arith": WARM, "tiny-chain": WARM_CHAIN}
SHIPPED = Path(__file__).parent / "builtin_models"  # the warm-started models' weights and records


def cache_root() -> Path:
    return Path(os.environ.get(Env.CACHE, Path.home() / ".cache" / "pipelinerl"))


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="?")


def load_tokenizer(path: str):
    """The tokenizer of a model folder. A built-in model's is loaded as it was saved: transformers'
    AutoTokenizer would build the Qwen2 architecture's (byte-level BPE) instead, which silently
    drops spaces and other characters when encoding."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return (PreTrainedTokenizerFast if model_info(path) else AutoTokenizer).from_pretrained(path)


def make_model(seed: int = 0):
    import torch

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        dtype="float32",
        **ARCH,
    )
    return Qwen2ForCausalLM(config)


def _encode_batch(tokenizer, prompts: list[str], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a loss mask over answer + eos, right-padded."""
    import torch

    rows = [(tokenizer.encode(p), tokenizer.encode(a) + [tokenizer.eos_token_id]) for p, a in zip(prompts, answers)]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) : len(p) + len(a)] = True
    return ids, mask


def supervised_loss(model, ids: torch.Tensor, mask: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    import torch

    logits = model(input_ids=ids).logits[:, :-1]
    target, m = ids[:, 1:], mask[:, 1:]
    return torch.nn.functional.cross_entropy(logits[m], target[m], reduction=reduction)


def batch_loss(model, tokenizer, batch, buckets: int = 1) -> torch.Tensor:
    """Mean cross-entropy over the answer + EOS tokens of the problems in `batch`. With
    `buckets` > 1 the batch runs as that many forwards of problems sorted by length, so short
    ones are not padded to the longest (the same loss; 2-3x faster on the long-tail task)."""
    import torch

    if buckets == 1:
        return supervised_loss(model, *_encode_batch(tokenizer, [p.prompt for p in batch], [p.answer for p in batch]))
    ordered = sorted(batch, key=lambda p: len(p.prompt) + len(p.answer))
    size = -(-len(ordered) // buckets)
    total: torch.Tensor | float
    total, tokens = 0.0, 0
    for i in range(0, len(ordered), size):
        ids, mask = _encode_batch(
            tokenizer, [p.prompt for p in ordered[i : i + size]], [p.answer for p in ordered[i : i + size]]
        )
        total = total + supervised_loss(model, ids, mask, reduction="sum")
        tokens += int(mask[:, 1:].sum())
    return torch.as_tensor(total) / tokens


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int | None = None) -> float:
    """Share of problems whose greedy completion stops (EOS) with exactly the answer (stripped),
    as `exact_answer_rollout` rewards it (`greedy_correct`)."""
    return sum(greedy_correct(model, tokenizer, problems, max_new_tokens)) / len(problems)


def greedy_correct(model, tokenizer, problems, max_new_tokens: int | None = None) -> list[bool]:
    """Per problem, in order: whether its greedy completion stops (EOS) with exactly the answer
    (stripped). Prompts are batched by length (no padding). By default each may write its answer
    and two tokens more."""
    import torch

    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(problems):
        by_length.setdefault(len(tokenizer.encode(p.prompt)), []).append(i)
    right = [False] * len(problems)
    for group in by_length.values():
        ids = torch.tensor([tokenizer.encode(problems[i].prompt) for i in group])
        limit = max_new_tokens or max(len(tokenizer.encode(problems[i].answer)) for i in group) + 2
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=limit,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row, i in zip(out[:, ids.shape[1] :].tolist(), group):
            if tokenizer.eos_token_id in row:
                right[i] = tokenizer.decode(row[: row.index(tokenizer.eos_token_id)]).strip() == problems[i].answer
    return right


def answer_probability(model, tokenizer, problems) -> list[float]:
    """Per problem, in order: the probability that sampling at temperature 1 writes exactly its
    answer and then EOS, i.e. its expected exact-match reward without sampling noise (spellings
    that differ but strip to the answer are not counted). One forward, right-padded: a causal
    model's earlier positions do not see the padding."""
    import torch

    ids, mask = _encode_batch(tokenizer, [p.prompt for p in problems], [p.answer for p in problems])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    chosen = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
    return (chosen * mask[:, 1:]).sum(1).exp().tolist()


def warm_task(name: str):
    """The task a built-in model is warm-started on."""
    from pipelinerl.tasks.arith import ArithTask
    from pipelinerl.tasks.chain import ChainTask

    if name == "tiny-chain":
        return ChainTask(max_steps=WARM_CHAIN["chain_steps"], tail=WARM_CHAIN["tail"], seed=WARM_CHAIN["seed"])
    return ArithTask(digits=WARM["digits"], carry_out=WARM["carry_out"], seed=WARM["seed"])


def warm_start(model, tokenizer, name: str = "tiny-arith", progress=print, max_steps: int | None = None) -> dict:
    """Supervised learning on the model's task (loss on answer + EOS) until its held-out greedy
    accuracy reaches the target: a deliberately partial start, for RL to take on."""
    import torch

    warm, task = WARM_STARTS[name], warm_task(name)
    if max_steps is not None:
        warm = warm | {"max_steps": max_steps}
    test = task.test_problems(warm["eval_problems"])
    opt = torch.optim.AdamW(model.parameters(), lr=warm["lr"])
    t0, acc, index = time.time(), 0.0, 0
    for step in range(1, warm["max_steps"] + 1):
        batch = [task.train_problem(index + i) for i in range(warm["batch"])]
        index += warm["batch"]
        model.train()
        loss = batch_loss(model, tokenizer, batch, warm.get("buckets", 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= warm["eval_from"] and step % warm["eval_every"] == 0:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, test)
            progress(
                f"  warm start step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.1%} "
                f"({time.time() - t0:.0f}s)"
            )
            if acc >= warm["target_min"]:
                break
    return {"warm_start_steps": step, "warm_start_accuracy": acc, "warm_start_seconds": time.time() - t0}


def _fingerprint(name: str) -> str:
    """Names a built-in's cache folder: the shipped weights' hash (warm-started models), or what
    the untrained model is made from."""
    if name in WARM_STARTS:
        return shipped_record(name)["sha256"][:12]
    # tiny-random keeps the fingerprint it had when only tiny-arith was warm-started.
    blob = json.dumps({"name": name, "arch": ARCH, "warm": WARM, "chars": CHARS, "v": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def resolve_model_path(path: str, progress=None) -> str:
    """A model folder for `spec.model.path`: writes (once, under a file lock) the built-ins'."""
    if path not in BUILTIN_MODELS:
        return path
    progress = progress or (lambda msg: print(msg, flush=True))
    name = path.split(":", 1)[1]
    target = cache_root() / "models" / f"{name}-{_fingerprint(name)}"
    if (target / "pipelinerl-model.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing the same model
        if not (target / "pipelinerl-model.json").exists():
            _write(name, target, progress)
    return str(target)


def deterministic_build(name: str, progress=print, max_steps: int | None = None):
    """The built-in model's weights from scratch: seeded, and single-threaded with deterministic
    kernels, so a build does not depend on the machine's thread count (it still depends on the
    CPU's kernels: hence the shipped weights)."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        tokenizer, model = make_tokenizer(), make_model()
        info = {"name": name, "parameters": sum(p.numel() for p in model.parameters())}
        if name in WARM_STARTS:
            info |= warm_start(model, tokenizer, name, progress, max_steps)
        return tokenizer, model, info
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def shipped_record(name: str) -> dict:
    """The record of a shipped warm start: steps, held-out accuracy (of the fp16 weights, on the
    warm start's own held-out problems), the weights file's sha256, where it was built."""
    return json.loads((SHIPPED / f"{name}.json").read_text())


def shipped_weights(name: str) -> dict[str, torch.Tensor]:
    """The shipped fp16 weights of a warm-started built-in, checked against their record."""
    from safetensors.torch import load_file

    path = SHIPPED / f"{name}.safetensors"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != shipped_record(name)["sha256"]:
        raise RuntimeError(f"{path}: sha256 {digest} is not the recorded one (a corrupt or changed file)")
    return load_file(path)


def warm_model(name: str):
    """The warm-started built-in as shipped: fp16 weights in the float32 model."""
    model = make_model()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in shipped_weights(name).items()}, strict=False)
    if unexpected or set(missing) != {"lm_head.weight"}:  # the LM head is tied to the embeddings
        raise RuntimeError(f"{name}: shipped weights do not fit the model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model


def ship(name: str, progress=print) -> dict:
    """Build a warm-started built-in from scratch and write it as the shipped weights and record:
    the accuracy recorded is that of the fp16 weights every machine loads."""
    tokenizer, model, info = deterministic_build(name, progress)
    return _ship(name, tokenizer, model, info, progress)


def _ship(name: str, tokenizer, model, info: dict, progress=print) -> dict:
    import torch

    from safetensors.torch import save_file

    state = {k: v.half().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    SHIPPED.mkdir(exist_ok=True)
    path = SHIPPED / f"{name}.safetensors"
    save_file(state, path)
    warm, task = WARM_STARTS[name], warm_task(name)
    info |= {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "built_on": cpu_model(),
        "torch": torch.__version__,
    }
    (SHIPPED / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
    test = task.test_problems(warm["eval_problems"])
    info["warm_start_accuracy"] = greedy_accuracy(warm_model(name).eval(), tokenizer, test)  # of the fp16 weights
    (SHIPPED / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
    progress(f"shipped {name}: {info}")
    return info


def cpu_model() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _write(name: str, target: Path, progress) -> None:
    """The built-in's Hugging Face folder: the shipped weights of a warm-started one, or the
    seeded untrained model."""
    tokenizer = make_tokenizer()
    if name in WARM_STARTS:
        model, info = warm_model(name), shipped_record(name)
    else:
        model = make_model()
        info = {"name": name, "parameters": sum(p.numel() for p in model.parameters())}
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp)
    if not (tmp / "config.json").exists():  # a folder without it would be taken for the model, for good
        raise RuntimeError(
            f"writing {name} to {target}: transformers wrote no model (its save_pretrained writes only on "
            "torch.distributed's rank 0): write built-ins before joining a process group"
        )
    tokenizer.save_pretrained(tmp)
    (tmp / "pipelinerl-model.json").write_text(json.dumps(info, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    progress(f"wrote {name} to {target}")


def model_path_problem(path: str, runs_here: bool) -> tuple[str | None, str | None]:
    """(error, note) on `model.path`, told from how the path looks, before anything starts (the
    spec has refused relative and ~ paths: MODEL_PATH_PLACED).

    An absolute path may be one only the cluster's pods see (a volume their pod template mounts,
    e.g. a PersistentVolumeClaim): missing here, it is an error only for a job that runs here
    (`runs_here`: `pipelinerl run`); `validate` says it cannot check it. A path that exists here
    must be a model folder. Built-ins and hub ids (`Qwen/Qwen2.5-0.5B`) are left to the engines,
    which download them; a hub id that names a folder here is that folder to `pipelinerl run` and
    a hub id to a pod: `run` asks for the absolute path, `validate` notes it."""
    folder = Path(path)
    if path in BUILTIN_MODELS or not (path.startswith("/") or folder.exists()):
        return None, None
    if not path.startswith("/"):
        here = "a folder" if folder.is_dir() else "a file"
        told = f"model.path: {path!r} is {here} here (relative to the current folder), a hub id in a pod"
        if runs_here:
            return f"{told}: give the folder's absolute path ({folder.resolve()})", None
        return None, f"{told}: give the folder's absolute path if the folder is meant"
    if not folder.exists() and not runs_here:
        return None, (
            f"model.path: {path!r} is not on this machine; an absolute path may be a volume only the "
            "cluster's pods mount (e.g. a PersistentVolumeClaim), which cannot be checked from here "
            "(`pipelinerl run` needs it on this machine)"
        )
    if not folder.is_dir():
        model = "a Hugging Face model folder, or a hub id such as Qwen/Qwen2.5-0.5B"
        return f"model.path: no folder {path!r} on this machine ({model})", None
    if not (folder / "config.json").exists():
        return f"model.path: {path!r} has no config.json (not a Hugging Face model folder)", None
    return None, None


def model_info(path: str) -> dict:
    f = Path(path) / "pipelinerl-model.json"
    return json.loads(f.read_text()) if f.exists() else {}


if __name__ == "__main__":  # python -m pipelinerl.tiny_model tiny-arith tiny-chain: rebuild the shipped weights
    import sys

    for built_in in sys.argv[1:] or list(WARM_STARTS):
        ship(built_in)
