"""`guess`: a multi-turn task. The model guesses a secret number; the environment answers
'<' (the secret is smaller), '>' (larger) or '=' and the model guesses again, up to `turns` times.

Environment replies are spliced into the sequence as untrained tokens (mask 0); every model
turn ends with its own eos, which is trained. Reward 1 for finding the secret, scaled down by
the turns it took.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipelinerl.messages import Sample
from pipelinerl.tasks.base import Policy, Problem, PromptTooLong, SampleBuilder, Tokenizer, check_param, prompt_ids


@dataclass
class GuessTask:
    max_number: int = 99
    turns: int = 4
    seed: int = 0
    name: str = "guess"

    def __post_init__(self) -> None:
        check_param("max_number", self.max_number, 1, 10**9)
        check_param("turns", self.turns, 1, 50)

    def train_problem(self, index: int) -> Problem:
        secret = random.Random(f"guess-train-{self.seed}-{index}").randint(0, self.max_number)
        return Problem(id=f"train-{index}", prompt=":", answer=secret)

    def test_problems(self, count: int) -> list[Problem]:
        rng = random.Random(f"guess-test-{self.seed}")
        return [Problem(id=f"test-{i}", prompt=":", answer=rng.randint(0, self.max_number)) for i in range(count)]

    @staticmethod
    def feedback(guess: str, secret: int) -> str:
        try:
            value = int(guess)
        except ValueError:
            return "?"  # not a number: ask again
        return "=" if value == secret else ("<" if secret < value else ">")

    async def rollout(
        self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
    ) -> Sample:
        sample = SampleBuilder(prompt_ids(tokenizer, problem.prompt, chat_template=False))
        answered = len(sample.tokens)  # the sequence up to the model's last turn
        for turn in range(self.turns):
            try:
                completion = await policy.generate(sample.tokens, max_tokens, greedy=greedy)
            except PromptTooLong:
                if not turn:
                    raise  # the problem's own prompt: skipped
                # Out of context before the secret was found: unsolved, kept up to its last guess
                # (with the reply after it, longer than model.maxSeqLen, its group was refused).
                sample.cut(answered)
                sample.truncated = True
                break
            sample.add_completion(completion)
            answered = len(sample.tokens)
            if completion.finish_reason != "stop":
                break
            reply = self.feedback(tokenizer.decode(completion.tokens, skip_special_tokens=True), problem.answer)
            if reply == "=":
                return sample.build(reward=1.0 - turn / self.turns, success=True)
            sample.add_env(tokenizer.encode(reply))
        return sample.build(reward=0.0, success=False)
