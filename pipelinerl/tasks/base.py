"""Task plugin interface: problems + an async rollout function + a reward.

A task never talks to vLLM directly: it gets a `Policy` that generates token ids with per-token
logprobs and policy versions. Multi-turn tasks call `policy.generate` several times and splice
environment tokens in between (those are not trained on: mask 0).
"""

from __future__ import annotations

import importlib
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipelinerl.messages import Sample


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" or "length"


class PromptTooLong(ValueError):
    """A prompt that leaves no room for a generated token within model.maxSeqLen (vLLM refuses
    it), raised by `Policy.generate`. `prompt_fit` measures a sample of a task's first prompts
    only: the problem is skipped, not the generator stopped (it would meet the problem again after
    its restart). A multi-turn task's later turn that meets it has run out of context: its episode
    ends there, unsolved."""


class Policy(Protocol):
    async def generate(self, prompt: list[int], max_tokens: int, greedy: bool = False) -> Completion: ...


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Problem:
    id: str
    prompt: str | list[dict[str, Any]]  # text, or chat messages ({"role", "content"} each)
    answer: Any
    extra: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def train_problem(self, index: int) -> Problem:
        """The index-th training problem (an endless, seeded, deterministic stream)."""
        ...

    def test_problems(self, count: int) -> list[Problem]:
        """A fixed held-out set, disjoint from the training stream."""
        ...

    async def rollout(
        self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
    ) -> Sample: ...


def has_chat_template(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# Each tokenizer's last prompts: a group's attempts share one prompt, and tokenizing it (or
# applying the chat template) is a per-request cost the generator's process pays on every one
# (~7% of its CPU on the tiny job, 4-token completions).
PROMPT_CACHE_SIZE = 1024
_prompt_cache: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[bool, str], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[dict[str, Any]], chat_template: bool) -> list[int]:
    """Token ids of a prompt: text, or chat messages ({"role", "content"} each). Through the
    chat template, ending with the assistant's turn; else as plain text (messages one per line).
    Remembered per tokenizer for its last PROMPT_CACHE_SIZE prompts."""
    key = (chat_template, prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True))
    try:
        cache = _prompt_cache.setdefault(tokenizer, OrderedDict())
    except TypeError:  # a tokenizer that takes no weak reference: nothing remembered
        return _prompt_ids(tokenizer, prompt, chat_template)
    if key in cache:
        cache.move_to_end(key)
        return list(cache[key])
    ids = _prompt_ids(tokenizer, prompt, chat_template)
    cache[key] = tuple(ids)
    if len(cache) > PROMPT_CACHE_SIZE:
        cache.popitem(last=False)
    return ids


def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[dict[str, Any]], chat_template: bool) -> list[int]:
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # return_dict=False: transformers 5 returns a BatchEncoding by default.
        return list(
            getattr(tokenizer, "apply_chat_template")(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer.encode(prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt))


async def exact_answer_rollout(
    policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
) -> Sample:
    """One completion of the plain-text prompt, rewarded 1.0 when it stops (EOS, not truncated)
    with exactly the problem's answer, stripped."""
    sample = SampleBuilder(prompt_ids(tokenizer, problem.prompt, chat_template=False))
    completion = await policy.generate(sample.tokens, max_tokens, greedy=greedy)
    sample.add_completion(completion)
    text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
    success = completion.finish_reason == "stop" and text.strip() == problem.answer
    return sample.build(reward=float(success), success=success)


class SampleBuilder:
    """Accumulates a (multi-turn) token sequence: prompt/env tokens are untrained, model tokens trained."""

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)
        self.mask = [0] * len(prompt)
        self.logprobs = [0.0] * len(prompt)
        self.versions = [-1] * len(prompt)
        self.truncated = False

    def add_env(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)

    def add_completion(self, c: Completion) -> None:
        self.tokens += c.tokens
        self.mask += [1] * len(c.tokens)
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.truncated = self.truncated or c.finish_reason == "length"

    def cut(self, length: int) -> None:
        """Keep the first `length` tokens (an environment's reply the episode ended before)."""
        del self.tokens[length:], self.mask[length:], self.logprobs[length:], self.versions[length:]

    def build(self, reward: float, success: bool) -> Sample:
        return Sample(
            tokens=self.tokens,
            mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=reward,
            success=success,
            truncated=self.truncated,
        )


def import_object(path: str, field: str, kind: str) -> Any:
    """`module:name` (a task's class, a reward function), imported; ValueError naming `field` for
    anything that fails, the module's own error included (a syntax error, a missing dependency)."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{field}: {path!r} is not module:{kind}")
    hint = (
        f" (a module's dotted name, not a file: {module[:-3]!r}, its folder on PYTHONPATH)"
        if module.endswith(".py")
        else ""
    )
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises, named by the field
        raise ValueError(f"{field}: cannot import {path!r}: {type(err).__name__}: {err}{hint}") from None


def held_out(problems: list[Problem], rows: int, field: str) -> tuple[list[Problem], list[Problem]]:
    """A training set's problems less its last `rows` (a task's `test_rows`), and those, held out:
    never trained on. ValueError naming `field` where none would be left to train on."""
    check_param("test_rows", rows, 1, 10**7)
    if len(problems) <= rows:
        raise ValueError(
            f"spec.task.params.{field}: {len(problems)} problems, not more than test_rows ({rows}) to hold out; "
            "give a test set or lower test_rows"
        )
    return problems[:-rows], problems[-rows:]


def check_param(name: str, value: object, lo: float, hi: float, kind: type = int) -> None:
    """A built-in task's numeric parameter, of `kind` (int, or float: an int too) within lo..hi:
    ValueError naming it otherwise (a bound keeps what the task computes from it small: the
    operator's admission builds fileless tasks to check a job)."""
    kinds = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"task.params.{name}: must be {what} within {lo:g}..{hi:g}, not {value!r}")
