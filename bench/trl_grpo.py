"""TRL's GRPOTrainer on a task's JSONL rows, for the peer benchmark (`bench/peer_trl.py`).

Runs inside the benchmark's own TRL environment (`.cache/bench-trl`, made by `bench/peer_trl.py`
from `bench/trl-requirements.txt`), so it imports nothing of this project but the reward
function file it is given. Configured as TRL documents it: `GRPOConfig` + `GRPOTrainer`, Hugging
Face `generate` (no vLLM server), on the CPU. What it adds is bookkeeping only:

- a callback that, every `--export-interval` steps, writes the policy's weights (Hugging Face
  folder) for the offline evaluation, and the time each step ended; the time spent writing is
  taken off the clock (the pipeline writes its exports on the trainer's time, uncounted here:
  any doubt goes to TRL);
- per-step timings of where the step's time goes, from wrappers around GRPOTrainer's own methods
  (generation, rewards, the rest of scoring, the loss's forward, the backward, the optimizer).

    python bench/trl_grpo.py --model DIR --train rows.jsonl --reward FILE.py:function --out DIR
        [--steps 500] [--prompts 16] [--generations 8] [--max-tokens 8] [--lr 1.5e-4] ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch


def reward_function(ref: str):
    path, _, name = ref.rpartition(":")
    spec = importlib.util.spec_from_file_location("rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True, help="JSONL rows: a prompt column and the reward's columns")
    ap.add_argument("--reward", required=True, help="FILE.py:function, TRL's reward-function signature")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export-interval", type=int, default=10)
    ap.add_argument(
        "--set",
        metavar="FIELD=VALUE",
        action="append",
        default=[],
        help="another GRPOConfig field, the value as JSON (e.g. bf16=true)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timing = {"generate": 0.0, "rewards": 0.0, "score": 0.0, "forward": 0.0, "training_step": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer, its phases timed (the same calls, in the same order)."""

        def _timed(self, key, fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timing[key] += time.perf_counter() - t0

        def _generate_and_score_completions(self, inputs):
            return self._timed("score", super()._generate_and_score_completions, inputs)

        def _generate(self, prompts):
            return self._timed("generate", super()._generate, prompts)

        def _calculate_rewards(self, *a, **kw):
            return self._timed("rewards", super()._calculate_rewards, *a, **kw)

        def compute_loss(self, *a, **kw):
            return self._timed("forward", super().compute_loss, *a, **kw)

        def training_step(self, *a, **kw):
            return self._timed("training_step", super().training_step, *a, **kw)

    class Record(TrainerCallback):
        """Step times (seconds since training began, without export writing) and exports."""

        def __init__(self):
            self.log = open(out / "steps.jsonl", "w")
            self.t0 = self.last = 0.0
            self.saving = 0.0  # seconds spent writing exports, off the clock

        def on_train_begin(self, *_, **__):
            (out / "clock.json").write_text(json.dumps({"train_begin": time.time()}))  # the launch clock's offset
            self.t0 = self.last = time.perf_counter()
            self._export(0, trainer.model)

        def on_step_end(self, _args, state, _control, **kw):
            now = time.perf_counter()
            phases = dict(timing)
            for k in timing:
                timing[k] = 0.0
            # Generation and rewards happen inside scoring, scoring and the forward inside the
            # training step; what is left of the step is the optimizer and the Trainer's loop.
            split = {
                "generate_seconds": phases["generate"],
                "reward_seconds": phases["rewards"],
                "score_other_seconds": phases["score"] - phases["generate"] - phases["rewards"],
                "forward_seconds": phases["forward"],
                "backward_seconds": phases["training_step"] - phases["score"] - phases["forward"],
                "optimizer_other_seconds": (now - self.last) - phases["training_step"],
            }
            metrics = trainer._metrics["train"]
            row = {
                "step": state.global_step,
                "time": now - self.t0 - self.saving,
                "seconds": now - self.last,
                **split,
                "reward": metrics["reward"][-1] if metrics.get("reward") else None,
            }
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()
            if state.global_step % args.export_interval == 0:
                self._export(state.global_step, kw["model"])
            self.last = time.perf_counter()

        def _export(self, step, model):
            t0 = time.perf_counter()
            model.save_pretrained(out / "export" / f"version-{step}")
            (out / "export" / f"version-{step}" / "time.json").write_text(
                json.dumps({"version": step, "time": t0 - self.t0 - self.saving})
            )
            self.saving += time.perf_counter() - t0

    data = load_dataset("json", data_files=args.train, split="train")
    batch = args.prompts * args.generations
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    config = GRPOConfig(
        **{
            "output_dir": str(out / "trainer"),
            "seed": args.seed,
            "max_steps": args.steps,
            "report_to": [],
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": 1,
            "num_generations": args.generations,
            "max_completion_length": args.max_tokens,
            "temperature": args.temperature,
            "learning_rate": args.lr,
            "warmup_steps": args.warmup,
            # The pipeline's schedule: linear warm-up, then constant (TRL's default decays to 0 by max_steps).
            "lr_scheduler_type": "constant_with_warmup",
            # Full precision like the pipeline's model, and no recomputation: each is the faster
            # setting for TRL on this model (the defaults are bf16 and gradient checkpointing).
            "bf16": False,
            "gradient_checkpointing": False,
            "save_strategy": "no",
            "logging_steps": 10,
            "use_cpu": True,
            "dataloader_num_workers": 0,
            **overrides,
        }
    )
    # A built-in model's tokenizer as it was saved: AutoTokenizer would build the Qwen2
    # architecture's instead, which drops spaces (pipelinerl.tiny_model.load_tokenizer).
    builtin = (Path(args.model) / "pipelinerl-model.json").exists()
    tokenizer = (PreTrainedTokenizerFast if builtin else AutoTokenizer).from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward_function(args.reward)],
        args=config,
        train_dataset=data,
        callbacks=[Record()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
