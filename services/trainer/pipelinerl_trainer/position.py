"""Where a trainer rank stands (pure): its version, its place in its micro-batch stream, and the
run's counts; what a checkpoint keeps and a restart goes on from, changed only in the moments
that change it (`took`, `consumed`, `stepped`, `saved`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelinerl.books import StepLedger
from pipelinerl.claims import MAX_GAPS, Claims, Range, gaps, newest_gaps, with_indices
from pipelinerl.messages import Checkpointed
from pipelinerl.spec import SpecError
from pipelinerl.steps import version_after

REDRAW_SAID = 1000  # characters of ranges to draw again a StoreLost message names at most


class StoreLost(SpecError):
    """The job's store is not the one the trainer's stream positions belong to (`check_store`)."""


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
    store: str = ""  # the job's store (`messages.StoreIdentity.id`) the stream positions belong to
    problems_claimed: int = 0  # the job's problem claims at the checkpoint (a recovered store goes on past them)
    # The problem indices the steps taken settled, whole run (`claims`: a recovered store draws the rest again).
    problems_settled: list[Range] = field(default_factory=list)

    @classmethod
    def restored(cls, state: dict, rank: int) -> Position:
        """From a checkpoint's state ({}: none, step 0)."""
        seq = state.get("consumed_seq", {}).get(str(rank), 0)
        rejected = state.get("rejected", {"groups": 0, "samples": 0})
        version = state.get("step", 0)
        claims = Claims.at_checkpoint(state)
        return cls(
            version=version,
            trained_groups=dict(state.get("trained_groups", {})),
            consumed_seq=seq,
            step_seq=seq,
            checkpointed=version,
            samples=state.get("samples", 0),
            rejected_groups=rejected["groups"],
            rejected_samples=rejected["samples"],
            store=state.get("store", ""),
            problems_claimed=claims.next,
            problems_settled=gaps(claims.redraw, claims.next),
        )

    def check_store(self, identity, starting: bool = True) -> str:
        """The job's store (`identity`, a StoreIdentity) against the one this position's stream
        sequences and credits belong to: "" where they go on in it, else why not (StoreLost). At a
        start, a position with no store yet (a first start, or a checkpoint from before stores had
        identities) takes it, and one `pipelinerl recover-store` made for this checkpoint is
        adopted: its streams start empty, so from sequence 0 and with no group credited yet."""
        if identity.id == self.store or starting and not self.store:
            self.store = identity.id
            return ""
        if starting and identity.adopts == self.store and identity.adopted_step == self.version:
            self.store, self.consumed_seq, self.step_seq, self.trained_groups = identity.id, 0, 0, {}
            return ""
        claims, said = self.claims(), ""
        options = f"--adopt {self.store} --step {self.version} --problems {claims.next}"
        if len(claims.redraw_text) > REDRAW_SAID:
            said = f" and the {len(claims.redraw)} ranges to draw again it names (too many to name here)"
        elif claims.redraw:
            options += f" --redraw {claims.redraw_text}"
        cluster = (
            "suspend the job, then resume it: the trainer has told this checkpoint on the new store, and the "
            "operator makes the resumed job's store go on from it (on a NATS of the job's own, with the job "
            "suspended: `pipelinerl recover-store JOB --nats URL -n NAMESPACE`, which reads that record; should it "
            f"be gone, add `{options}`{said})"
            if starting
            else "the restarted trainer says how"
        )
        return (
            f"StoreLost: the trainer's position (step {self.version}{', its checkpoint' if starting else ''}) "
            f"belongs to the job's NATS store {self.store}, but the store is now {identity.id} ("
            f"{identity.replaced or 'lost or replaced'}: its streams, positions and books are not the trainer's). "
            f"Nothing is trained until the new store goes on from the trainer's newest checkpoint: locally "
            f"`pipelinerl recover-store JOB --run-dir DIR`, then "
            f"`pipelinerl run JOB --run-dir DIR`; on a cluster, {cluster}"
        )

    def took(self, seq: int) -> None:
        """A micro-batch was taken from the stream (replayed ones too)."""
        self.consumed_seq = seq

    def consumed(self, ledger: StepLedger) -> None:
        """The step's final micro-batch is here: its groups are consumed, credited to their
        generators, and their problems settled."""
        for g, c in ledger.credits.items():
            self.trained_groups[g] = self.trained_groups.get(g, 0) + c
        settled = with_indices([*self.problems_settled, *ledger.settled_indices()], ())
        self.problems_settled = newest_gaps(settled, MAX_GAPS)

    def claims(self) -> Claims:
        """What a store made to go on from the newest checkpoint claims from (as it saved them)."""
        return Claims.unsettled(self.problems_claimed, self.problems_settled)

    def record(self, store: str) -> Checkpointed:
        """The newest checkpoint's record, told on the job's `store` (what a store goes on from)."""
        claims = self.claims()
        return Checkpointed(store=store, step=self.checkpointed, problems=claims.next, redraw=claims.redraw_text)

    def stepped(self, samples: int, rejected_groups: int, rejected_samples: int) -> None:
        """The optimizer stepped: the next version, and the step's counts."""
        self.version = version_after(self.version)
        self.step_seq = self.consumed_seq
        self.samples += samples
        self.rejected_groups += rejected_groups
        self.rejected_samples += rejected_samples

    def saved(self, state: dict) -> None:
        """A checkpoint of this version is written, with `state` (`kept`)."""
        self.checkpointed = self.version
        self.problems_claimed = state["problems_claimed"]

    def kept(self, step_seqs: dict[str, int], problems_claimed: int = 0) -> dict:
        """A checkpoint's state (`step_seqs`: every rank's `step_seq`, by rank; `problems_claimed`:
        the job's problem claims' count then, where a recovered store's claims go on, and which
        of those the steps settled: the rest it draws again)."""
        return {
            "step": self.version,
            "samples": self.samples,
            "trained_groups": dict(self.trained_groups),
            "rejected": {"groups": self.rejected_groups, "samples": self.rejected_samples},
            "consumed_seq": step_seqs,
            "store": self.store,
            "problems_claimed": max(problems_claimed, self.problems_claimed),
            "problems_settled": [list(r) for r in self.problems_settled],
        }
