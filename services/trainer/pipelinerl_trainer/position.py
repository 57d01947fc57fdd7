"""Where a trainer rank stands (pure): its version, its place in its micro-batch stream, and the
run's counts; what a checkpoint keeps and a restart goes on from, changed only in the moments
that change it (`took`, `consumed`, `stepped`, `saved`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelinerl.books import StepLedger
from pipelinerl.steps import version_after


@dataclass
class Position:
    version: int = 0  # = optimizer steps taken; step `version` trains next (`steps.step_version`)
    # Groups of each generator (by rank) the steps taken settled: their ledgers' credits summed.
    trained_groups: dict[str, int] = field(default_factory=dict)
    consumed_seq: int = 0  # this rank's stream sequence of the last micro-batch taken
    step_seq: int = 0  # ... where the last whole step taken ended (a checkpoint resumes there)
    checkpointed: int = 0  # the version of the newest checkpoint
    samples: int = 0  # trained, whole run
    rejected_groups: int = 0  # dead-lettered by the preprocessor, whole run
    rejected_samples: int = 0  # dead-lettered by the trainer (the model cannot take them), whole run

    @classmethod
    def restored(cls, state: dict, rank: int) -> Position:
        """From a checkpoint's state ({}: none, step 0)."""
        seq = state.get("consumed_seq", {}).get(str(rank), 0)
        rejected = state.get("rejected", {"groups": 0, "samples": 0})
        version = state.get("step", 0)
        return cls(
            version=version,
            trained_groups=dict(state.get("trained_groups", {})),
            consumed_seq=seq,
            step_seq=seq,
            checkpointed=version,
            samples=state.get("samples", 0),
            rejected_groups=rejected["groups"],
            rejected_samples=rejected["samples"],
        )

    def took(self, seq: int) -> None:
        """A micro-batch was taken from the stream (replayed ones too)."""
        self.consumed_seq = seq

    def consumed(self, ledger: StepLedger) -> None:
        """The step's final micro-batch is here: its groups are consumed, credited to their generators."""
        for g, c in ledger.credits.items():
            self.trained_groups[g] = self.trained_groups.get(g, 0) + c

    def stepped(self, samples: int, rejected_groups: int, rejected_samples: int) -> None:
        """The optimizer stepped: the next version, and the step's counts."""
        self.version = version_after(self.version)
        self.step_seq = self.consumed_seq
        self.samples += samples
        self.rejected_groups += rejected_groups
        self.rejected_samples += rejected_samples

    def saved(self) -> None:
        """A checkpoint of this version is written."""
        self.checkpointed = self.version

    def kept(self, step_seqs: dict[str, int]) -> dict:
        """A checkpoint's state (`step_seqs`: every rank's `step_seq`, by rank)."""
        return {
            "step": self.version,
            "samples": self.samples,
            "trained_groups": dict(self.trained_groups),
            "rejected": {"groups": self.rejected_groups, "samples": self.rejected_samples},
            "consumed_seq": step_seqs,
        }
