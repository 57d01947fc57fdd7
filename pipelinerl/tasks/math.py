"""`math`: GSM8K-style word problems from JSON-lines files, rewarded on the final number.

Each line: {"question": "...", "answer": "... #### 42"} (GSM8K's format; a bare "42" works too).
The prompt uses the model's chat template when it has one. The completion's number (the first
after '####', else the last) equals the reference's as a value: `1,234` is 1234, `18.00` is 18,
`-0` is 0, `.5` is `1/2`. Without `test_file` the last `test_rows` lines (100) of `train_file`
are held out, never trained on (a file of no more lines is refused: give a `test_file`). A job
run before this rule, without `test_file`, draws other problems for the same indices once
resumed on it (its training list is shorter).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from pipelinerl.messages import Sample
from pipelinerl.tasks.base import (
    Policy,
    Problem,
    SampleBuilder,
    Tokenizer,
    has_chat_template,
    held_out,
    prompt_ids,
)

# A number: thousands grouped by commas, or plain digits (over a denominator, or with decimals),
# or decimals alone; a sign before any.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+/\d+|\d+(?:\.\d+)?|\.\d+)")
LONGEST = 100  # digits: a longer "number" (a completion repeating digits) is no answer
INSTRUCTION = "Solve the problem step by step. Put the final answer after '####'."


def final_number(text: str) -> str | None:
    """The number after '####' if present, else the last in the text, as its value's canonical
    text (`Fraction`'s: '1234', '1/2', '-3'); None where there is none (or a zero denominator, or
    over LONGEST digits)."""
    tail = text.split("####")[-1] if "####" in text else text
    found = NUMBER.findall(tail)
    if not found:
        return None
    number = (found[0] if "####" in text else found[-1]).replace(",", "")
    if len(number) > LONGEST:
        return None
    try:
        return str(Fraction(number))
    except (ZeroDivisionError, ValueError):
        return None


def load_problems(path: str | Path, kind: str) -> list[Problem]:
    problems = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answer = final_number(str(row["answer"]))
        except (ValueError, KeyError) as err:
            raise ValueError(f"spec.task.params: {path} line {i + 1}: {err!r}") from None
        if answer is None:  # never solvable
            raise ValueError(f"spec.task.params: {path} line {i + 1}: the answer {row['answer']!r} holds no number")
        problems.append(Problem(id=f"{kind}-{i}", prompt=row["question"], answer=answer))
    if not problems:
        raise ValueError(f"spec.task.params: {path} holds no problems")
    return problems


@dataclass
class MathTask:
    train_file: str = ""
    test_file: str = ""
    test_rows: int = 100
    seed: int = 0
    name: str = "math"
    _train: list[Problem] = field(default_factory=list, repr=False)
    _test: list[Problem] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.train_file:
            raise ValueError("spec.task.params.train_file is required for the math task")
        train = load_problems(self.train_file, "train")
        if self.test_file:
            self._test = load_problems(self.test_file, "test")
        else:
            train, self._test = held_out(train, self.test_rows, "train_file")
        self._train = train

    def train_problem(self, index: int) -> Problem:
        # Epochs in a seeded order, so any index is reproducible.
        epoch, offset = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        random.Random(f"math-{self.seed}-{epoch}").shuffle(order)
        return self._train[order[offset]]

    def test_problems(self, count: int) -> list[Problem]:
        return self._test[:count]

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
