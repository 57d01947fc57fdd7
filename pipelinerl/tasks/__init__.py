"""Built-in tasks. A task is picked by `spec.task.name`; `spec.task.params` go to its constructor.

Third-party tasks plug in by import path: `task.name: mypackage.module:MyTask`.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipelinerl.tasks.arith import ArithTask
from pipelinerl.tasks.base import Completion, Policy, Problem, SampleBuilder, Task
from pipelinerl.tasks.chain import ChainTask
from pipelinerl.tasks.dataset import DatasetTask
from pipelinerl.tasks.guess import GuessTask
from pipelinerl.tasks.math import MathTask

BUILTIN: dict[str, type] = {
    "arith": ArithTask,
    "chain": ChainTask,
    "dataset": DatasetTask,
    "guess": GuessTask,
    "math": MathTask,
}

__all__ = ["BUILTIN", "Completion", "Policy", "Problem", "SampleBuilder", "Task", "make_task"]


def make_task(name: str, params: dict[str, Any] | None = None, seed: int = 0) -> Task:
    if name in BUILTIN:
        cls = BUILTIN[name]
    elif ":" in name:
        module, attr = name.split(":", 1)
        cls = getattr(importlib.import_module(module), attr)
    else:
        raise ValueError(f"spec.task.name: unknown task {name!r} (built-ins: {', '.join(BUILTIN)}; or module:Class)")
    try:
        return cls(**(params or {}), seed=seed)
    except TypeError as err:
        raise ValueError(f"spec.task.params: {err}") from None
