"""What a step is (pure): the rules that the generators, the preprocessor, the trainer and the
planner all apply, stated once.

- steps and versions, the conventions every service counts by: step N trains at version N (the
  optimizer steps taken before it, `step_version`) and makes version N + 1 (`version_after`); an
  announcement names the step in training (`training_step`); the newest weights that exist are the
  announced version + 1 (`newest_weights`: sent before announced); a token's lag is the version
  its step trains at minus the version that sampled it (`token_lag`), and it is too old past
  maxLag (`too_old`: the trainer's rule, per token); a group every token of which is too old for
  the step takes no place in it (`hopelessly_stale`: the preprocessor's rule, per group). The
  books these counts keep are `pipelinerl.books`;
- which groups go into no step (`counts_as_discarded`: `filtered`, or not trainable): their
  generator stops counting them as queued when they finish, the preprocessor settles them
  without a step;
- when part of a step leaves the preprocessor as a wave (`wave_capacity`, `next_wave`): the
  preprocessor streams by it, the planner simulates it;
- which step an announcement says is in training (`training_step`): the generators' admission
  counts from it;
- the conventional baseline's generation phases of k steps (`steps_left_in_phase`,
  `sends_weights`): the preprocessor publishes a phase once it is generated whole, the trainer
  sends the weights once per phase;
- the weight group's ranks (`weight_group_size`, `weight_group_rank`, `generator_of_rank`):
  the trainer is rank 0, generator i's workers follow it in the order of the membership.

The lag budget is `pipelinerl.admission.lag_budget`, which the planner's simulation calls too
(with the same arguments: test_admission replays a simulated trace into `Admission`).
"""

from __future__ import annotations

from typing import Any

from pipelinerl.group_checks import GroupLimits, group_problem


# -- steps and versions ------------------------------------------------------------------------
def step_version(step: int) -> int:
    """The policy version step `step` trains at: the optimizer steps taken before it."""
    return step


def version_after(step: int) -> int:
    """The version step `step` makes (its optimizer step taken)."""
    return step + 1


def training_step(announcement: Any) -> int:
    """The step a PolicyVersion says is in training: its version while step `version` trains
    (`training`), else the step that made it (version - 1)."""
    return announcement.version if announcement.training else announcement.version - 1


# How long the final evaluation is waited for after the last step: by the trainer, for its
# report and the trackers, and by generator 0, which abandons its rollouts first.
FINAL_EVAL_WAIT_S = 300.0


def is_final(announcement: Any, max_steps: int) -> bool:
    """A PolicyVersion that ends the job: the trainer's last (`finished`), and not a stale one read
    before a resume that raised `trainer.maxSteps` (its version is short of it)."""
    return announcement.finished and announcement.version >= max_steps


def newest_weights(announced_version: int) -> int:
    """The newest weights that can exist: the trainer sends version v + 1 before it announces it,
    so a token may carry it (the preprocessor refuses anything newer)."""
    return announced_version + 1


def token_lag(version: Any, token_versions: Any) -> Any:
    """Versions between the weights that sampled a token and the step training it at `version`
    (ints, or the trainer's tensors)."""
    return version - token_versions


def too_old(lag: Any, max_lag: int) -> Any:
    """A token past maxLag: the trainer gives it no loss weight (ints, or tensors: a mask)."""
    return lag > max_lag


def hopelessly_stale(group: Any, step: int, max_lag: int) -> bool:
    """Every generated token of `group` is too old for step `step`: the trainer would drop all of
    it, so it must not take a place in the step. (The steps fill in arrival order, so a
    generator's groups can wait behind another's backlog.)"""
    newest = max(v for s in group.samples for v, k in zip(s.versions, s.mask) if k)
    return bool(too_old(token_lag(step_version(step), newest), max_lag))


# -- which groups a step takes, and when ----------------------------------------------------------
def filtered(spec: Any, group: Any) -> bool:
    """All its attempts scored alike (no signal), and the job (`spec`) filters those."""
    return spec.rl.filter_zero_variance and group.zero_variance


def counts_as_discarded(spec: Any, group: Any) -> bool:
    """A group that goes into no step, as its generator can tell when it finishes: filtered, or
    it cannot be trained (`group_checks`: the preprocessor dead-letters it). Counted, it holds no
    place in admission: a conventional phase, whose first step waits for the whole phase, would
    wait for it forever."""
    return filtered(spec, group) or group_problem(group, GroupLimits(spec.model.max_seq_len)) is not None


def steps_left_in_phase(step: int, steps_per_generation: int) -> int:
    """Steps of the generation phase from `step` on, `step` included (phases of k steps start at
    multiples of k; pipeline mode: k = 1)."""
    return steps_per_generation - step % steps_per_generation


def sends_weights(version: int, steps_per_generation: int, last: bool) -> bool:
    """Whether the trainer sends the weights of `version`: at the end of each generation phase
    (the generators hold nothing in between) and after the last step."""
    return last or version % steps_per_generation == 0


def weight_group_size(members: int, workers_per_generator: int) -> int:
    return 1 + members * workers_per_generator


def weight_group_rank(member_index: int, workers_per_generator: int) -> int:
    """The first rank of the `member_index`-th generator of the membership (its workers follow)."""
    return 1 + member_index * workers_per_generator


def generator_of_rank(rank: int, workers_per_generator: int) -> int:
    """The membership index of the generator whose worker holds `rank` (≥ 1)."""
    return (rank - 1) // workers_per_generator


def wave_capacity(ranks: int, micro_batch_tokens: int, longest: int) -> int:
    """Tokens that first-fit decreasing is sure to pack into one row per rank when no sample is
    longer than `longest` (a sample of length L that fits in none of the rows would find each
    fuller than C - L, so ≤ ranks · (C - L_max) tokens always fit)."""
    return ranks * (micro_batch_tokens - longest)


def next_wave(
    pending: list[list[int]],
    in_step: int,
    groups_per_step: int,
    ranks: int,
    micro_batch_tokens: int,
    stream: bool,
    steps_left: int = 1,
) -> tuple[int, bool]:
    """How many pending groups (sample lengths each, in arrival order) to publish now as the next
    wave of a step that already holds `in_step` groups, and whether that wave ends the step.

    The rest of the step goes as soon as it is there, and the rest of its generation phase too
    (`steps_left` steps from this one: the conventional baseline trains only once a phase is
    generated whole, so its first step waits for the phase). Before that, when streaming, a wave leaves
    once more is pending than one full row per rank holds, so the trainer can start on it while
    the rest is generated: the longest prefix first-fit decreasing is sure to pack into `ranks`
    rows (`wave_capacity`). A first group too large for that goes alone.
    """
    need = max(0, groups_per_step - in_step)  # (a step continued under a job now of fewer groups: full)
    if len(pending) >= need + (steps_left - 1) * groups_per_step:
        return need, True
    if not stream:
        return 0, False
    total = longest = 0
    for n, lengths in enumerate(pending):
        total, longest = total + sum(lengths), max(longest, *lengths)
        if total > wave_capacity(ranks, micro_batch_tokens, longest):
            return max(n, 1), False
    return 0, False
