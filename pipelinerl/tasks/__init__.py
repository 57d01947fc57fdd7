"""Built-in tasks. A task is picked by `spec.task.name`; `spec.task.params` go to its constructor.

Third-party tasks plug in by import path: `task.name: mypackage.module:MyTask`.
"""

from __future__ import annotations

from typing import Any

from pipelinerl.tasks.arith import ArithTask
from pipelinerl.tasks.base import Completion, Policy, Problem, PromptTooLong, SampleBuilder, Task, import_object
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

__all__ = [
    "BUILTIN",
    "Completion",
    "Policy",
    "Problem",
    "PromptTooLong",
    "SampleBuilder",
    "Task",
    "make_task",
    "param_problems",
]


def param_problems(name: str, params: dict[str, Any]) -> list[str]:
    """A built-in task's params against those its constructor takes (`seed` and `name` are the
    spec's, underscored ones its own): each unknown one named, with the closest known one; then,
    for a task that reads no files, their values (`check_param`)."""
    import inspect

    from pipelinerl.spec_base import closest

    cls = BUILTIN.get(name)
    if cls is None:
        return []  # module:Class: its constructor says so when the generator builds it
    known = [p for p in inspect.signature(cls).parameters if p not in ("seed", "name")]
    known = [p for p in known if not p.startswith("_")]
    problems = []
    for key in params:
        if key not in known:
            close = closest(key, known)
            hint = f"did you mean {close}? " if close else ""
            problems.append(
                f"task.params.{key}: unknown for the {name} task ({hint}its params: {', '.join(known) or 'none'})"
            )
    if not problems and name in FILELESS:  # built here as the generator would: their values checked
        try:
            cls(**params)
        except ValueError as err:
            problems.append(str(err))
    return problems


FILELESS = ("arith", "chain", "guess")  # built-in tasks that read no files: built at admission too


def make_task(name: str, params: dict[str, Any] | None = None, seed: int = 0) -> Task:
    if name in BUILTIN:
        cls = BUILTIN[name]
    elif ":" in name:
        cls = import_object(name, "spec.task.name", "Class")
    else:
        raise ValueError(f"spec.task.name: unknown task {name!r} (built-ins: {', '.join(BUILTIN)}; or module:Class)")
    try:
        return cls(**(params or {}), seed=seed)
    except TypeError as err:
        raise ValueError(f"spec.task.params: {err}") from None
