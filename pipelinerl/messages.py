"""Wire formats between the services, with one compact, versioned binary codec (msgpack).

Every message is a msgpack map {"v": SCHEMA_VERSION, "t": <type tag>, ...fields}. Decoding
checks the version and the type tag and validates the fields with pydantic, so a malformed
message raises `MessageError` naming the message type and the field at fault. A build also reads
the version before its own (`UPGRADES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelinerl.books import GeneratorBooks, StepLedger
from pipelinerl.claims import Claims

# 9: StepLedger.folded; 8: Checkpointed.redraw; 7: each ledger entry's reward_sum;
# 6: MicroBatch.ledger (one StepLedger) instead of step_samples, step_groups_filtered,
# step_groups_rejected, step_samples_stale, step_groups_by_generator, generator_books and
# settled_group_ids; 5: MicroBatch.settled_group_ids; 4: MicroBatch.lengths instead of sample_ids;
# 3: RolloutGroup.books;
# 2: without problem_id/start_version/gen_seconds, PolicyVersion without step
SCHEMA_VERSION = 9
# How a body of the version before this build's reads as one of its own. An upgrade rolls a running
# job onto the new build (the operator renders its pods with the new images) while its streams
# still hold what the old build wrote: queued groups, the step's micro-batches, the CONTROL records.
# Unreadable, they would stop its trainer and generators at every restart. A bump says here how
# its predecessor's bodies read (a test decodes each message type written the old way).
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    8: lambda body: body,  # 9 only added StepLedger.folded, which defaults to nothing folded
}


class MessageError(ValueError):
    """A message that cannot be decoded; it is never acked as if processed."""


class NewerSchema(MessageError):
    """A message of a schema version after this build's: written by a newer build (a service rolled
    onto it first, in an upgrade), which reads it. Left for that build, never refused as malformed."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    TYPE: ClassVar[str]


class Sample(BaseModel):
    """One attempt: the whole token sequence; `mask` marks the tokens the model generated."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]  # sampling logprob per token (0 where mask is 0)
    versions: list[int]  # policy version that produced each token (-1 where mask is 0)
    reward: float
    success: bool = False
    truncated: bool = False  # hit max tokens before end of sequence

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        n = len(self.tokens)
        for name in ("mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if not any(self.mask):
            raise ValueError("sample has no generated tokens")
        return self

    @property
    def num_generated(self) -> int:
        return sum(self.mask)


class RolloutGroup(Message):
    """G attempts at one prompt: the unit the generator publishes and advantages are computed on."""

    TYPE: ClassVar[str] = "rollout_group"
    group_id: str  # problem id, claimed index, generator (`generator.group_id`): the job's alone, the Nats-Msg-Id
    generator: int
    samples: list[Sample] = Field(min_length=1)
    books: GeneratorBooks = Field(default_factory=GeneratorBooks)

    @property
    def zero_variance(self) -> bool:
        """All attempts scored the same: every advantage is 0, the group carries no signal."""
        rewards = [s.reward for s in self.samples]
        return max(rewards) - min(rewards) <= 1e-12


class MicroBatch(Message):
    """Packed samples for one trainer rank: one row of ≤ micro-batch tokens.

    A step reaches the trainer as it is generated, in waves: every wave gives every rank the
    same number of micro-batches (empty sentinels included), so all ranks run the same number
    of forward/backward passes and their collectives stay in step. The final wave's micro-batches
    are marked `last`; the trainer steps after them. Every micro-batch carries the step's books as of
    its wave (`ledger`).
    """

    TYPE: ClassVar[str] = "micro_batch"
    step: int  # optimizer step this belongs to (0-based)
    rank: int
    index: int = Field(ge=0)  # position in the step on this rank
    last: bool = False  # the rank's final micro-batch of the step: the optimizer steps after it
    tokens: list[int] = Field(default_factory=list)
    positions: list[int] = Field(default_factory=list)  # restart at 0 for every packed sample
    mask: list[int] = Field(default_factory=list)
    advantages: list[float] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    weights: list[float] = Field(default_factory=list)  # per-token loss weight
    # Tokens of each packed sample, in row order: where every sequence starts, as data (the
    # trainer's variable-length attention takes them as they are, never re-derives them).
    lengths: list[int] = Field(default_factory=list)
    rewards: list[float] = Field(default_factory=list)  # per packed sample, for metrics
    group_ids: list[str] = Field(default_factory=list)  # per packed sample: which prompt group it came from
    # What the step has settled up to this wave (the final wave's: the step's), every generator's
    # newest books, and where the wave lies: `pipelinerl.books`.
    ledger: StepLedger = Field(default_factory=StepLedger)

    @model_validator(mode="after")
    def _aligned(self) -> MicroBatch:
        n = len(self.tokens)
        for name in ("positions", "mask", "advantages", "logprobs", "versions", "weights"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if sum(self.lengths) != n or any(k <= 0 for k in self.lengths):
            raise ValueError(f"lengths {self.lengths} are not positive and summing to the {n} tokens")
        if len(self.rewards) != len(self.lengths):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.lengths)} packed samples")
        return self

    @property
    def is_sentinel(self) -> bool:
        return not self.tokens


class PolicyVersion(Message):
    """Announced by trainer rank 0: once the weights of `version` are sent (the generators
    confirm loading them separately, `WeightUpdateDone`), and with `training` when step
    `version` has started."""

    TYPE: ClassVar[str] = "policy_version"
    version: int  # = optimizer steps taken
    finished: bool = False  # the trainer has taken its last step
    training: bool = False  # step `version` has started (its groups are consumed), not finished
    timestamp: float
    # Groups of each generator (by rank) settled by steps ≤ version (their ledgers' credits summed):
    # frees their admission budget.
    trained_groups: dict[str, int] = Field(default_factory=dict)


class WeightsSent(Message):
    """Trainer rank 0, before it broadcasts a version: a trainer killed between the broadcast and
    the announcement leaves the generators holding a version the stream never announced; its
    successor sends nothing older (`floor`). In the store: a store made again forgets it, as it
    forgets the announcements."""

    TYPE: ClassVar[str] = "weights_sent"
    version: int


class GeneratorHello(Message):
    """Generator → trainer and the other generators, every second and after it starts groups:
    I am alive, hold these weights, and have this admission queue (`Admission.on_peer`)."""

    TYPE: ClassVar[str] = "generator_hello"
    generator: int  # pod index
    incarnation: str  # this process: a restarted generator is a new member of the weight group
    version: int  # of the weights it holds; -1: none yet (it generates nothing until it gets some)
    queued: int = 0  # groups started and neither consumed nor discarded (`Admission.queued`)
    oldest: int | None = None  # weights version of its oldest group still generating; None: none runs
    # How long (its awake seconds) its engine has not answered: the weight update it is applying,
    # or a liveness check; 0: neither is under way.
    busy_seconds: float = 0.0

    def stuck(self, deadline_s: float) -> bool:
        """Its engine has not answered for longer than an update's deadline (weightSync.timeoutSeconds).
        The trainer invites it to no new epoch, its peers' admission counts it gone."""
        return self.busy_seconds > deadline_s


class WeightUpdate(Message):
    """Trainer → generators: the weights of `version` are broadcast now in weight group `group`
    (a membership epoch), in these buckets; `members` ((generator, incarnation) each) hold
    ranks 1.. in that order, a tensor-parallel engine one rank per worker."""

    TYPE: ClassVar[str] = "weight_update"
    version: int
    buckets: list[dict]
    group: str
    members: list[tuple[int, str]]


class WeightUpdateDone(Message):
    TYPE: ClassVar[str] = "weight_update_done"
    version: int
    generator: int
    incarnation: str
    pause_seconds: float
    running_requests: int  # requests kept alive across the update (in-flight)
    error: str | None = None


class Metrics(Message):
    """A row of metrics from any service (trainer steps, evaluations, generator stats)."""

    TYPE: ClassVar[str] = "metrics"
    source: str
    kind: str  # "train", "eval", "generator", ...
    values: dict[str, float | int | str | bool | None]
    timestamp: float


class StoreIdentity(Message):
    """Which store the job's streams are (one per JetStream store: a lost or replaced store has
    another), written once when the streams are first created (`store.store_identity`), anew
    where the store lost a stream the services' positions are counted in. The trainer's
    checkpoints name the store their stream positions belong to; a store that `pipelinerl
    recover-store` made for a checkpoint `adopts` its store."""

    TYPE: ClassVar[str] = "store_identity"
    id: str
    created: float  # wall clock
    adopts: str | None = None  # the lost store's id whose checkpoint this store goes on from
    adopted_step: int | None = None  # that checkpoint's step
    replaced: str | None = None  # why it replaced the identity of a damaged store (`store.ensure_streams`)


class Checkpointed(Message):
    """The trainer's newest checkpoint, once saved (rank 0 tells it on the CONTROL stream): what a
    job's store must go on from to resume it (`store.recover_store`). The operator reads it when
    it deletes a suspended job's streams, and makes the resumed job's store adopt it."""

    TYPE: ClassVar[str] = "checkpointed"
    store: str  # the store its stream positions belong to (`StoreIdentity.id`)
    step: int
    problems: int = Field(ge=0)  # the job's problem claims at that checkpoint (`claims.Claims`): their count
    redraw: str = ""  # ... and those under it the checkpoint's steps did not settle: drawn again ('3-5,9')

    @property
    def claims(self) -> Claims:
        return Claims.of(self.problems, self.redraw, "checkpointed.redraw")

    @model_validator(mode="after")
    def _claims_valid(self) -> Checkpointed:
        self.claims  # noqa: B018 - raises naming the field
        return self


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (
        RolloutGroup,
        MicroBatch,
        PolicyVersion,
        GeneratorHello,
        WeightUpdate,
        WeightUpdateDone,
        Metrics,
        StoreIdentity,
        Checkpointed,
        WeightsSent,
    )
}
M = TypeVar("M", bound=Message)


def encode(msg: Message) -> bytes:
    body = msg.model_dump(mode="python")
    body["v"] = SCHEMA_VERSION
    body["t"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, expected: type[M]) -> M:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several unrelated types
        raise MessageError(f"{expected.TYPE}: not valid msgpack ({err})") from None
    if not isinstance(body, dict):
        raise MessageError(f"{expected.TYPE}: expected a map, got {type(body).__name__}")
    version, tag = body.pop("v", None), body.pop("t", None)
    if version != SCHEMA_VERSION:
        upgrade = UPGRADES.get(version) if isinstance(version, int) else None
        if upgrade is None:
            readable = " and ".join(map(str, sorted([*UPGRADES, SCHEMA_VERSION])))
            newer = isinstance(version, int) and version > SCHEMA_VERSION
            raise (NewerSchema if newer else MessageError)(
                f"{expected.TYPE}: schema version {version!r} unsupported (this build reads {readable})"
            )
        body = upgrade(body)
    if tag != expected.TYPE:
        raise MessageError(f"expected a {expected.TYPE} message, got {tag!r}")
    try:
        return expected.model_validate(body)
    except ValidationError as err:
        fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise MessageError(f"{expected.TYPE}: {fields}") from None
