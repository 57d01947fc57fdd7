"""Trainer overhead: the trainer's DeepSpeed step against a plain PyTorch loop on the same model
and micro-batches (target ≤ 1.15×), and packed rows of several lengths against a padded batch.

    .venv/bin/python -m bench.trainer_overhead [--repeats 10] [--threads 1]

One step = the tiny job's step: 128 samples of an 8-token prompt and a 4-6 token completion,
the tiny-arith model, the project's loss code (micro_batch_loss) and AdamW. Every side starts
from the same weights; step times are interleaved A B C … per round. Packed rows use the
trainer's packed-row attention (pipelinerl_trainer.packed_attention); one side runs the same rows
through Hugging Face's stock SDPA, which masks each whole row, to show what that saves.
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.common import alternate, one_rank_distributed_env, paired_ratios, save, summary, table, timed
from pipelinerl import messages as m
from pipelinerl.spec import load_job
from pipelinerl.tiny_model import resolve_model_path
from pipelinerl_preprocessor.packing import StepSample, pack_wave, step_weight
from pipelinerl_trainer.loss import policy_loss, token_logprobs
from pipelinerl_trainer.step import StepTally, micro_batch_loss, step_config

JOB = "examples/tiny-cpu.yaml"


def synthetic_step(samples: int, seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        prompt, completion = (
            [rng.randrange(2, 12) for _ in range(8)],
            [rng.randrange(2, 12) for _ in range(rng.randint(4, 6))],
        )
        out.append(
            StepSample(
                m.Sample(
                    tokens=prompt + completion,
                    mask=[0] * len(prompt) + [1] * len(completion),
                    logprobs=[0.0] * len(prompt) + [-rng.uniform(0.01, 2.0) for _ in completion],
                    versions=[-1] * len(prompt) + [0] * len(completion),
                    reward=float(rng.random() < 0.3),
                ),
                rng.gauss(0, 1),
            )
        )
    return out


def packed_step(model, optimizer_step, batches: list[m.MicroBatch], cfg, backward) -> None:
    tally = StepTally(cfg.max_lag)
    for mb in batches:
        backward(micro_batch_loss(model, mb, 0, cfg, tally))
    optimizer_step()


def padded_step(model, opt, items: list[StepSample], cfg, clip: float) -> None:
    """The same samples as one right-padded [B, T] batch (one forward, attention mask)."""
    width = max(len(s.sample.tokens) for s in items)
    ids = torch.zeros((len(items), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    w = torch.zeros((len(items), width))
    old = torch.zeros((len(items), width))
    adv = torch.zeros((len(items), width))
    for i, s in enumerate(items):
        n = len(s.sample.tokens)
        ids[i, :n], attn[i, :n] = torch.tensor(s.sample.tokens), 1
        w[i, :n] = torch.tensor(s.sample.mask, dtype=torch.float) / len(items)
        old[i, :n], adv[i, :n] = torch.tensor(s.sample.logprobs), s.advantage
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    loss = 0.0
    for i in range(len(items)):  # per-row: the loss code is written for 1-D rows
        lp, ent = token_logprobs(logits[i], ids[i], cfg.temperature)
        loss = (
            loss
            + policy_loss(
                lp, old[i], adv[i], w[i], cfg.loss, entropy=ent, sample_ids=torch.zeros(width, dtype=torch.long)
            )[0]
        )  # a row: one sample
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    one_rank_distributed_env()
    from pipelinerl_trainer.model import build_engine, init_distributed, load_model

    job = load_job(JOB)
    t = job.spec.trainer
    path = resolve_model_path(job.spec.model.path)
    cfg = step_config(job)
    items = synthetic_step(args.samples)
    tokens = sum(len(s.sample.tokens) for s in items)
    row_tokens = t.micro_batch_tokens
    weight = step_weight(items, job.spec.rl.token_weighting, len(items))
    packed = pack_wave(0, items, 1, row_tokens, weight, last=True)[0]
    one_row = pack_wave(0, items, 1, tokens, weight, last=True)[0]

    init_distributed(False, 60)
    engine = build_engine(job.spec.trainer, job.spec.weights_dtype, path)

    def plain(stock_attention: bool = False):
        # The trainer's model (packed-row attention), or with Hugging Face's stock SDPA masking the row
        model = load_model(path).train()
        if stock_attention:
            model.set_attn_implementation("sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)

        def step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, opt, step

    p_model, p_opt, p_step = plain()
    s_model, _, s_step = plain(stock_attention=True)
    r_model, _, r_step = plain()
    d_model, d_opt, _ = plain(stock_attention=True)  # a padded batch: stock SDPA with its padding mask
    engine.train()
    sides = {
        f"deepspeed ZeRO-{t.zero_stage}, packed {row_tokens}": lambda: timed(
            lambda: packed_step(engine, engine.step, packed, cfg, engine.backward)
        ),
        f"plain PyTorch, packed {row_tokens}": lambda: timed(
            lambda: packed_step(p_model, p_step, packed, cfg, lambda loss: loss.backward())
        ),
        f"plain PyTorch, packed {row_tokens}, stock SDPA row mask": lambda: timed(
            lambda: packed_step(s_model, s_step, packed, cfg, lambda loss: loss.backward())
        ),
        f"plain PyTorch, one packed row of {tokens}": lambda: timed(
            lambda: packed_step(r_model, r_step, one_row, cfg, lambda loss: loss.backward())
        ),
        "plain PyTorch, padded batch": lambda: timed(lambda: padded_step(d_model, d_opt, items, cfg, t.grad_clip)),
    }
    times = alternate(sides, args.repeats, warmup=2)
    names = list(sides)
    base = times[names[1]]
    rows, result = (
        [],
        {
            "tokens_per_step": tokens,
            "samples_per_step": len(items),
            "threads": args.threads,
            "micro_batches": len(packed),
            "sides": {},
        },
    )
    for name in names:
        s = summary(times[name])
        ratio = paired_ratios(times[name], base)
        result["sides"][name] = {"seconds": s, "tokens_per_second": tokens / s["median"], "vs_plain_packed": ratio}
        rows.append(
            [
                name,
                s["median"],
                f"{s['min']:.3f}-{s['max']:.3f}",
                tokens / s["median"],
                ratio["median"],
                f"{ratio['min']:.2f}-{ratio['max']:.2f}",
            ]
        )
    ds = result["sides"][names[0]]["vs_plain_packed"]["median"]
    result["deepspeed_overhead"] = ds
    result["target_met"] = ds <= 1.15
    print(table(["side", "step s (median)", "spread", "tokens/s", "× plain packed", "spread"], rows))
    print(f"DeepSpeed / plain PyTorch: {ds:.2f}× (target ≤ 1.15×: {'met' if ds <= 1.15 else 'MISSED'})")
    save(
        "trainer_overhead",
        result,
        "python -m bench.trainer_overhead " + f"--repeats {args.repeats} --threads {args.threads}",
    )


if __name__ == "__main__":
    main()
