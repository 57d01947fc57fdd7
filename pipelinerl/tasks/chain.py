"""`chain`: arithmetic worked step by step, with a long tail of steps ("37+6*4=" → "3:43 2:49 1:55 0:61<eos>").

The prompt `s+a*k=` asks for s + a·k, worked as k additions of a: each step writes how many
additions are left, a colon and the running total. The reward is 1 for the whole worked
solution, exactly (every step checked), ending with EOS.

Why it exists: the paper's speed-up comes from long, heterogeneous generations, where a
synchronous step waits for its longest sequence. Here the number of steps k is drawn with
P(k) ∝ k^-tail over 1..max_steps, so completions run from 5 tokens (k = 1) to ~7·max_steps, and
most of a step's samples are short while a few are long (at the defaults, a step of 16 prompts
holds completions 10-15× apart). Every step is a local operation (decrement a counter, add a
single digit to the previous total, stop at 0), which the tiny model learns, but a solution is
right only if all k steps are: per-step accuracy p gives p^k, so the long problems are where RL
has the most to gain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl.messages import Sample
from pipelinerl.tasks.base import Policy, Problem, Tokenizer, check_param, exact_answer_rollout


def worked(start: int, addend: int, steps: int) -> str:
    """The worked solution of start + addend·steps: "left:total" per addition."""
    return " ".join(f"{steps - i}:{start + addend * i}" for i in range(1, steps + 1))


@dataclass
class ChainTask:
    max_steps: int = 12
    tail: float = 1.0  # P(k) ∝ k^-tail: 0 draws k uniformly, larger values make long chains rarer
    start_max: int = 999
    seed: int = 0
    name: str = "chain"

    def __post_init__(self) -> None:
        check_param("max_steps", self.max_steps, 1, 99)
        check_param("tail", self.tail, 0, 100, float)
        check_param("start_max", self.start_max, 0, 10**9)
        self._weights = [k**-self.tail for k in range(1, self.max_steps + 1)]

    @staticmethod
    def is_test(start: int, addend: int, steps: int) -> bool:
        # A fixed arithmetic partition of all problems keeps train and held-out sets disjoint.
        return (start * 7919 + addend * 104729 + steps * 1299709) % 8 == 0

    def _draw(self, rng: random.Random, test: bool) -> tuple[int, int, int]:
        while True:  # rejection keeps each side's draw proportional to the k weights
            start, addend = rng.randint(0, self.start_max), rng.randint(2, 9)
            steps = rng.choices(range(1, self.max_steps + 1), self._weights)[0]
            if self.is_test(start, addend, steps) == test:
                return start, addend, steps

    def _problem(self, kind: str, index: int, start: int, addend: int, steps: int) -> Problem:
        return Problem(
            id=f"{kind}-{index}",
            prompt=f"{start}+{addend}*{steps}=",
            answer=worked(start, addend, steps),
            extra={"steps": steps},
        )

    def test_problems(self, count: int) -> list[Problem]:
        rng = random.Random(f"chain-test-{self.seed}")
        return [self._problem("test", i, *self._draw(rng, test=True)) for i in range(count)]

    def train_problem(self, index: int) -> Problem:
        rng = random.Random(f"chain-train-{self.seed}-{index}")  # per index: resumable, shardable
        return self._problem("train", index, *self._draw(rng, test=False))

    async def rollout(
        self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
    ) -> Sample:
        return await exact_answer_rollout(policy, tokenizer, problem, max_tokens, greedy)
