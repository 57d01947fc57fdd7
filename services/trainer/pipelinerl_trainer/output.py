"""The trained model, kept outside the job's own volumes (`spec.output`), so that it outlives the job.

Layout of the output folder:
  final/  the last step's weights (Hugging Face format, with the tokenizer)
  best/   the trained version that scored highest on evaluation, with `pipelinerl-best.json`
  .candidates/version-<N>/  the weights of an evaluated version, until its result comes in

A version's evaluation arrives steps after the trainer moved on, so its weights are exported as a
candidate when it is published and promoted (renamed) or dropped once its accuracy is known. Each
folder appears complete or not at all (written under a temporary name, then renamed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

BEST_FILE = "pipelinerl-best.json"


def is_better(accuracy: float, best: dict | None) -> bool:
    """Strictly better than the best so far (an equal score keeps the earlier version)."""
    return best is None or accuracy > best["accuracy"]


def _settle_promotion(root: Path) -> None:
    """A promotion cut short (a kill between its renames) is settled: with no `best/` left, the
    earlier best is put back (its successor's candidate is still there); with one, the earlier
    best's removal is finished. Every rank starting on a shared folder may do it: once is enough."""
    best, old = root / "best", root / ".best.old"
    if old.exists():
        if best.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):  # another rank put it back first
                os.replace(old, best)


class Output:
    def __init__(self, root: Path, keep_best: bool):
        self.root, self.keep_best = root, keep_best
        self.candidates = root / ".candidates"
        _settle_promotion(root)
        found = root / "best" / BEST_FILE
        self.best: dict | None = json.loads(found.read_text()) if found.exists() else None  # a restart keeps it

    @property
    def final(self) -> Path:
        return self.root / "final"

    def candidate(self, version: int) -> Path:
        return self.candidates / f"version-{version}"

    def wants_candidate(self, version: int, eval_interval: int, last: bool = False) -> bool:
        """Evaluated versions (every `eval_interval`, and the last), trained ones only."""
        return self.keep_best and eval_interval > 0 and version > 0 and (last or version % eval_interval == 0)

    def evaluated(self, version: int, accuracy: float) -> bool:
        """Take `version`'s result (rank 0): promote its candidate if it is the best yet; drop the
        candidates it leaves behind. Whether it became the best."""
        candidate = self.candidate(version)
        promoted = candidate.exists() and is_better(accuracy, self.best)
        if promoted:
            record = {"version": version, "accuracy": accuracy}
            (candidate / BEST_FILE).write_text(json.dumps(record))
            best, old = self.root / "best", self.root / ".best.old"
            shutil.rmtree(old, ignore_errors=True)
            if best.exists():
                os.replace(best, old)
            try:
                os.replace(candidate, best)
            except OSError:  # the earlier best put back: never left without one
                _settle_promotion(self.root)
                raise
            shutil.rmtree(old, ignore_errors=True)
            self.best = record
        for other in self.candidates.glob("version-*") if self.candidates.exists() else []:
            number = other.name.removeprefix("version-").removesuffix(".tmp")
            if number.isdigit() and int(number) <= version:  # results come in version order
                shutil.rmtree(other, ignore_errors=True)
        return promoted
