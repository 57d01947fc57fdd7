"""`dataset`: your prompts and your reward function, taken the way TRL's GRPOTrainer takes them.

    task:
      name: dataset
      params:
        train: data/train.jsonl          # a path, a glob or a list; .jsonl/.json, .parquet, .arrow
        test: data/test.jsonl            # held-out set; default: the last `test_rows` rows of train
        reward: my_rewards:exact_match   # module:function, or a list of them (summed, `reward_weights`)

Rows are read with Hugging Face `datasets`. The prompt (`prompt_field`, default "prompt") is a
string or a list of chat messages (TRL's conversational format); as in TRL, messages go
through the model's chat template and text is used as it is (`chat_template: true/false` to
force either way). A reward function gets
what TRL passes: `completions` (strings, or assistant messages for conversational prompts),
`prompts`, `completion_ids` and every other column of the row as keyword arguments, each a
list of one; it returns a list of one number (a coroutine function may be used too), or of None
where it does not apply to that completion (TRL's None: it adds nothing). A completion counts as
solved in evaluations when its reward reaches `success_reward` and it ended by itself (one cut
at `maxTokens` is trained with its reward, never counted solved). A reward
function that has not returned within `reward_timeout_s` (default 300; a remote judge that never
answers) stops the generator with an error naming it, as one that raises does.
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import math
import numbers
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipelinerl.messages import Sample
from pipelinerl.tasks.base import (
    Policy,
    Problem,
    SampleBuilder,
    Tokenizer,
    has_chat_template,
    held_out,
    import_object,
    prompt_ids,
)

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def data_files(spec: str | list[str], param: str) -> list[str]:
    """Files named by a path, a glob or a list of them; ValueError naming the param if none."""
    patterns = [spec] if isinstance(spec, str) else list(spec)
    files = sorted({f for p in patterns for f in (glob.glob(p) if glob.has_magic(p) else [p])})
    if not files:
        raise ValueError(f"spec.task.params.{param}: no file matches {spec!r}")
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"spec.task.params.{param}: {f} does not exist")
        if Path(f).suffix not in BUILDERS:
            raise ValueError(f"spec.task.params.{param}: {f}: unknown format (one of {', '.join(BUILDERS)})")
    if len({BUILDERS[Path(f).suffix] for f in files}) > 1:
        raise ValueError(f"spec.task.params.{param}: mixes formats ({', '.join(files)})")
    return files


def load_rows(files: list[str]) -> list[dict[str, Any]]:
    from datasets import load_dataset

    ds = load_dataset(BUILDERS[Path(files[0]).suffix], data_files=files, split="train")
    return list(ds)


def import_function(path: str, param: str) -> Callable:
    fn = import_object(path, f"spec.task.params.{param}", "function")
    if not callable(fn):
        raise ValueError(f"spec.task.params.{param}: {path!r} is not callable")
    return fn


@dataclass
class DatasetTask:
    train: str | list[str] = ""
    reward: str | list[str] = ""
    test: str | list[str] | None = None
    test_rows: int = 100
    prompt_field: str = "prompt"
    reward_weights: list[float] | None = None
    chat_template: bool | None = None
    success_reward: float = 1.0
    reward_timeout_s: float = 300.0
    seed: int = 0
    name: str = "dataset"
    _train: list[Problem] = field(default_factory=list, repr=False)
    _test: list[Problem] = field(default_factory=list, repr=False)
    _rewards: list[tuple[str, Callable]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError("spec.task.params.train is required for the dataset task (files of prompts)")
        if not self.reward:
            raise ValueError("spec.task.params.reward is required for the dataset task (module:function)")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"spec.task.params.reward_timeout_s: must be > 0, got {self.reward_timeout_s!r}")
        names = [self.reward] if isinstance(self.reward, str) else list(self.reward)
        self._rewards = [(n, import_function(n, "reward")) for n in names]
        weights = self.reward_weights or [1.0] * len(names)
        if len(weights) != len(names):
            raise ValueError(
                f"spec.task.params.reward_weights: {len(weights)} weights for {len(names)} reward functions"
            )
        self.reward_weights = [float(w) for w in weights]
        train = self._problems(data_files(self.train, "train"), "train")
        if self.test:
            self._test = self._problems(data_files(self.test, "test"), "test")
        else:
            train, self._test = held_out(train, self.test_rows, "train")
        self._train = train

    def _problems(self, files: list[str], kind: str) -> list[Problem]:
        out = []
        for i, row in enumerate(load_rows(files)):
            where = f"spec.task.params.{kind}: {', '.join(files)} row {i + 1}"
            if self.prompt_field not in row:
                raise ValueError(
                    f"{where}: no field {self.prompt_field!r} (columns: {', '.join(row)}; set prompt_field)"
                )
            prompt = row[self.prompt_field]
            if not (
                isinstance(prompt, str)
                or (
                    isinstance(prompt, list)
                    and prompt
                    and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
                )
            ):
                raise ValueError(
                    f"{where}: field {self.prompt_field!r} must be text or a list of "
                    f"{{role, content}} messages, got {type(prompt).__name__}"
                )
            extra = {k: v for k, v in row.items() if k not in (self.prompt_field, "completion")}
            out.append(Problem(id=f"{kind}-{i}", prompt=prompt, answer=None, extra=extra))
        if not out:
            raise ValueError(f"spec.task.params.{kind}: {', '.join(files)} holds no rows")
        return out

    def train_problem(self, index: int) -> Problem:
        epoch, offset = divmod(index, len(self._train))  # epochs, each in a seeded order
        order = list(range(len(self._train)))
        random.Random(f"dataset-{self.seed}-{epoch}").shuffle(order)
        return self._train[order[offset]]

    def test_problems(self, count: int) -> list[Problem]:
        return self._test[:count]

    async def score(self, problem: Problem, completion: str, ids: list[int]) -> float:
        """The weighted sum of the reward functions, called as TRL calls them (a batch of one)."""
        conversational = isinstance(problem.prompt, list)
        kwargs = {
            "prompts": [problem.prompt],
            "completion_ids": [ids],
            "completions": [[{"role": "assistant", "content": completion}] if conversational else completion],
            **{k: [v] for k, v in problem.extra.items()},
        }
        total = 0.0
        for (name, fn), weight in zip(self._rewards, self.reward_weights or ()):  # set in __post_init__
            call = fn(**kwargs) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, **kwargs)
            try:
                out = await asyncio.wait_for(call, self.reward_timeout_s)
            except TimeoutError:
                raise RuntimeError(
                    f"reward function {name} gave no reward for {problem.id} within {self.reward_timeout_s:g} s "
                    f"(spec.task.params.reward_timeout_s)"
                ) from None
            except Exception as err:
                raise RuntimeError(
                    f"reward function {name} failed on {problem.id}: {type(err).__name__}: {err}"
                ) from err
            one = isinstance(out, (list, tuple)) and len(out) == 1
            if one and out[0] is None:  # not for this completion (TRL's None)
                continue
            if not (one and isinstance(out[0], numbers.Real) and math.isfinite(out[0])):
                raise ValueError(
                    f"reward function {name} returned {out!r} for {problem.id}: expected a list of one finite number"
                )
            total += weight * float(out[0])
        return total

    def prompt_tokens(self, tokenizer: Tokenizer, problem: Problem) -> list[int]:
        chat = self.chat_template
        if chat is None:
            chat = isinstance(problem.prompt, list) and has_chat_template(tokenizer)
        return prompt_ids(tokenizer, problem.prompt, chat)

    async def rollout(
        self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
    ) -> Sample:
        sample = SampleBuilder(self.prompt_tokens(tokenizer, problem))
        completion = await policy.generate(sample.tokens, max_tokens, greedy=greedy)
        sample.add_completion(completion)
        text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
        reward = await self.score(problem, text, completion.tokens)
        return sample.build(reward=reward, success=reward >= self.success_reward and completion.finish_reason == "stop")
