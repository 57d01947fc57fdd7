"""Whether a task's prompts fit the model's context (pure, given a task and a tokenizer).

A prompt as long as `model.maxSeqLen` leaves no room for a completion: vLLM refuses every such
request, so the job cannot run and is refused up front where the prompts can be known before it
starts (a built-in model's tokenizer and a task that needs no files: `static_prompt_fit`), and
else by its generator at start-up, naming the field. Prompts that fit but leave less room than
`generator.sampling.maxTokens` get their completions cut: a warning, not an error.
"""

from __future__ import annotations

from typing import Any

SAMPLED = 256  # training problems (and as many held-out ones) measured


def prompt_tokens(task: Any, tokenizer: Any, problem: Any) -> list[int]:
    """The token ids a task's rollout starts from (`Task.prompt_tokens` where the task says)."""
    own = getattr(task, "prompt_tokens", None)
    return own(tokenizer, problem) if own else tokenizer.encode(problem.prompt)


def prompt_fit(
    task: Any, tokenizer: Any, max_seq_len: int, max_tokens: int, sampled: int = SAMPLED
) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the longest of the task's first `sampled` training problems and
    held-out ones, against the context and the completion budget."""
    problems = [task.train_problem(i) for i in range(sampled)] + list(task.test_problems(sampled))
    longest = max(len(prompt_tokens(task, tokenizer, p)) for p in problems)
    where = f"the longest of {len(problems)} of the task's prompts is {longest} tokens"
    if longest >= max_seq_len:
        return [f"model.maxSeqLen: {max_seq_len} leaves no room for a completion: {where}"], []
    if longest + max_tokens > max_seq_len:
        return [], [
            f"generator.sampling.maxTokens: {max_tokens} tokens do not fit after every prompt in "
            f"model.maxSeqLen ({max_seq_len}): {where}, so its completions are cut at "
            f"{max_seq_len - longest} tokens"
        ]
    return [], []


def static_prompt_fit(job: Any) -> tuple[list[str], list[str]] | None:
    """`prompt_fit` before the job runs, where it can be known: a built-in model (its tokenizer is
    the project's) and a built-in task that reads no files. None where it cannot."""
    from pipelinerl.tasks import FILELESS, make_task
    from pipelinerl.tiny_model import BUILTIN_MODELS, make_tokenizer

    spec = job.spec
    if spec.model.path not in BUILTIN_MODELS or spec.task.name not in FILELESS:
        return None
    try:
        task = make_task(spec.task.name, spec.task.params, seed=spec.task.seed)
    except ValueError:
        return None  # the generator says what is wrong with the parameters
    return prompt_fit(task, make_tokenizer(), spec.model.max_seq_len, spec.generator.sampling.max_tokens)
