"""`math`: GSM8K-style word problems from JSON-lines files, rewarded on the final number.

Each line: {"question": "...", "answer": "... #### 42"} (GSM8K's format; a bare "42" works too).
The prompt uses the model's chat template when it has one. The completion's last number is
compared with the reference (commas and a trailing ".0" ignored).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipelinerl.messages import Sample
from pipelinerl.tasks.base import Policy, Problem, SampleBuilder, Tokenizer, has_chat_template, prompt_ids

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
INSTRUCTION = "Solve the problem step by step. Put the final answer after '####'."


def final_number(text: str) -> str | None:
    """The answer after '####' if present, else the last number in the text, normalised."""
    tail = text.split("####")[-1] if "####" in text else text
    found = NUMBER.findall(tail)
    if not found:
        return None
    value = found[0] if "####" in text else found[-1]
    value = value.replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def load_problems(path: str | Path, kind: str) -> list[Problem]:
    problems = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answer = final_number(str(row["answer"]))
            problems.append(Problem(id=f"{kind}-{i}", prompt=row["question"], answer=answer))
        except (ValueError, KeyError) as err:
            raise ValueError(f"spec.task.params: {path} line {i + 1}: {err!r}") from None
    if not problems:
        raise ValueError(f"spec.task.params: {path} holds no problems")
    return problems


@dataclass
class MathTask:
    train_file: str = ""
    test_file: str = ""
    seed: int = 0
    name: str = "math"
    _train: list[Problem] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.train_file:
            raise ValueError("spec.task.params.train_file is required for the math task")
        self._train = load_problems(self.train_file, "train")

    def train_problem(self, index: int) -> Problem:
        # Epochs in a seeded order, so any index is reproducible.
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"math-{self.seed}-{epoch}").shuffle(order)
        return self._train[order[offset]]

    def test_problems(self, count: int) -> list[Problem]:
        return load_problems(self.test_file or self.train_file, "test")[:count]

    async def rollout(
        self, policy: Policy, tokenizer: Tokenizer, problem: Problem, max_tokens: int, greedy: bool = False
    ) -> Sample:
        chat = has_chat_template(tokenizer)
        text = f"{INSTRUCTION}\n\n{problem.prompt}" + ("" if chat else "\n")
        sample = SampleBuilder(prompt_ids(tokenizer, text, chat))
        completion = await policy.generate(sample.tokens, max_tokens, greedy=greedy)
        sample.add_completion(completion)
        answer = final_number(tokenizer.decode(completion.tokens, skip_special_tokens=True))
        success = completion.finish_reason == "stop" and answer is not None and answer == problem.answer
        return sample.build(reward=float(success), success=success)
