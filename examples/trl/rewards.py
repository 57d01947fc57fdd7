"""Reward functions with TRL's signature (`completions` plus the dataset's columns as keyword
arguments, one list entry per completion), usable unchanged by GRPOTrainer and by a
`PipelineRLJob` with `task.name: dataset`."""

from __future__ import annotations


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion, stripped, is the row's `answer` column."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.strip() == str(a).strip()) for t, a in zip(texts, answer)]
