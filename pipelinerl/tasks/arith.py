"""`arith`: multi-digit addition with an exact-match reward ("123+456=" → "579<eos>")."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl.tasks.base import Policy, Problem, SampleBuilder, Tokenizer
from pipelinerl.messages import Sample


@dataclass
class ArithTask:
    digits: int = 3
    seed: int = 0
    name: str = "arith"

    def _operands(self, rng: random.Random) -> tuple[int, int]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        return rng.randint(lo, hi), rng.randint(lo, hi)

    def _problem(self, kind: str, index: int, a: int, b: int) -> Problem:
        return Problem(id=f"{kind}-{index}", prompt=f"{a}+{b}=", answer=str(a + b))

    @staticmethod
    def is_test(a: int, b: int) -> bool:
        # A fixed arithmetic partition of all (a, b) pairs keeps train and held-out sets disjoint.
        return (a * 7919 + b * 104729) % 8 == 0

    def _draw(self, rng: random.Random, test: bool) -> tuple[int, int]:
        while self.is_test(*(pair := self._operands(rng))) != test:
            pass
        return pair

    def test_problems(self, count: int) -> list[Problem]:
        rng = random.Random(f"arith-test-{self.seed}")
        return [self._problem("test", i, *self._draw(rng, test=True)) for i in range(count)]

    def train_problem(self, index: int) -> Problem:
        # Per-index RNG: any index can be produced on its own (resumable, shardable).
        rng = random.Random(f"arith-train-{self.seed}-{index}")
        return self._problem("train", index, *self._draw(rng, test=False))

    def reward(self, completion: str, answer: str) -> float:
        return 1.0 if completion.strip() == answer else 0.0

    async def rollout(self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int,
                      greedy: bool = False) -> Sample:
        sample = SampleBuilder(tokenizer.encode(problem.prompt))
        completion = await policy.generate(sample.tokens, max_tokens, greedy=greedy)
        sample.add_completion(completion)
        stopped = completion.finish_reason == "stop"
        text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
        reward = self.reward(text, problem.answer) if stopped else 0.0
        return sample.build(reward=reward, success=reward > 0)
