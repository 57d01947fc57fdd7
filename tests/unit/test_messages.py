import msgpack
import pytest

from pipelinerl.books import GeneratorBooks, GroupEntry, Outcome, StepLedger
from pipelinerl.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    UPGRADES,
    Checkpointed,
    GeneratorHello,
    MessageError,
    Metrics,
    MicroBatch,
    NewerSchema,
    PolicyVersion,
    RolloutGroup,
    Sample,
    StoreIdentity,
    WeightsSent,
    WeightUpdate,
    WeightUpdateDone,
    decode,
    encode,
)


def group() -> RolloutGroup:
    s = Sample(
        tokens=[5, 6, 7, 1],
        mask=[0, 0, 1, 1],
        logprobs=[0, 0, -0.25, -1.5],
        versions=[-1, -1, 3, 4],
        reward=1.0,
        success=True,
    )
    return RolloutGroup(group_id="g-1", generator=0, samples=[s, s])


def test_round_trip_is_exact_and_compact():
    g = group()
    data = encode(g)
    assert decode(data, RolloutGroup) == g
    assert len(data) < len(g.model_dump_json())  # binary beats the JSON form


def test_wrong_type_version_and_fields_are_named():
    data = encode(PolicyVersion(version=1, timestamp=0.0))
    with pytest.raises(MessageError, match="expected a rollout_group message, got 'policy_version'"):
        decode(data, RolloutGroup)
    body = msgpack.unpackb(encode(group()))
    body["v"] = 99
    with pytest.raises(NewerSchema, match="schema version 99"):  # a newer build's: left for it
        decode(msgpack.packb(body), RolloutGroup)
    for older in (1, "x", None):  # an older one's than the build before this one, or none at all
        body["v"] = older
        with pytest.raises(MessageError, match="schema version") as error:
            decode(msgpack.packb(body), RolloutGroup)
        assert not isinstance(error.value, NewerSchema)
    body["v"] = SCHEMA_VERSION
    body["samples"][0]["mask"] = [1]
    with pytest.raises(MessageError, match=r"samples\.0.*mask has 1 entries for 4 tokens"):
        decode(msgpack.packb(body), RolloutGroup)
    with pytest.raises(MessageError, match="not valid msgpack"):
        decode(b"\xc1", RolloutGroup)
    told = Checkpointed(store="s", step=4, problems=40, redraw="3-5,9")
    assert decode(encode(told), Checkpointed).claims.redraw == ((3, 6), (9, 10))
    body = msgpack.unpackb(encode(told)) | {"redraw": "9-3"}
    with pytest.raises(MessageError, match="checkpointed.redraw: '9-3' is not an index or a range"):
        decode(msgpack.packb(body), Checkpointed)


def one_of_each() -> list:
    """A message of each type, with its optional fields set."""
    ledger = StepLedger(
        groups=[GroupEntry(id="p#3@0", generator=0, outcome=Outcome.TRAINED, samples=2, credited=True, wave=0)],
        generators={"0": GeneratorBooks(published=4, discarded=1)},
        settled_through=7,
        waves=1,
        wave_last=0,
        closed=True,
    )
    mb = MicroBatch(
        step=2, rank=1, index=0, last=True, tokens=[5, 6], positions=[0, 1], mask=[0, 1], advantages=[0, 0.5],
        logprobs=[0, -0.1], versions=[-1, 2], weights=[0, 1], lengths=[2], rewards=[1.0], group_ids=["p#3@0"],
        ledger=ledger,
    )  # fmt: skip
    return [
        group().model_copy(update={"books": GeneratorBooks(published=3)}),
        mb,
        PolicyVersion(version=3, finished=True, training=True, timestamp=1.5, trained_groups={"0": 4}),
        WeightsSent(version=3),
        GeneratorHello(generator=1, incarnation="i", version=2, queued=3, oldest=1, busy_seconds=0.5),
        WeightUpdate(version=3, buckets=[{"names": ["w"]}], group="g", members=[(0, "i")]),
        WeightUpdateDone(version=3, generator=0, incarnation="i", pause_seconds=0.1, running_requests=2, error="e"),
        Metrics(source="trainer", kind="train", values={"loss": 0.5, "tag": "x", "none": None}, timestamp=2.0),
        StoreIdentity(id="s", created=1.0, adopts="t", adopted_step=4, replaced="why"),
        Checkpointed(store="s", step=4, problems=40),
    ]


# What version 8 of each type did not have, as paths into its body
ADDED_SINCE_8 = {"micro_batch": [("ledger", "folded")]}


def as_written_by_8(body: dict, tag: str) -> dict:
    old = {**body, "v": 8}
    for *parents, name in ADDED_SINCE_8.get(tag, []):
        node = old
        for key in parents:
            node[key] = node = dict(node[key])
        del node[name]
    return old


def test_what_the_previous_build_wrote_reads_the_same():
    """An upgrade rolls a running job onto this build with its streams full of what the build before
    wrote (queued groups, the step's micro-batches, the CONTROL records): each type reads as written
    by this build. Older versions are refused, naming what this build reads."""
    examples = one_of_each()
    assert {type(x) for x in examples} == set(MESSAGE_TYPES.values())
    assert sorted(UPGRADES) == [SCHEMA_VERSION - 1]
    for msg in examples:
        body = msgpack.unpackb(encode(msg), strict_map_key=False)
        old = as_written_by_8(body, msg.TYPE)
        assert decode(msgpack.packb(old), type(msg)) == msg, msg.TYPE
        with pytest.raises(
            MessageError, match=rf"{msg.TYPE}: schema version 7 unsupported \(this build reads 8 and 9\)"
        ):
            decode(msgpack.packb(old | {"v": 7}), type(msg))
    for version in (None, "9", [9], 9.5):
        with pytest.raises(MessageError, match="unsupported"):
            decode(msgpack.packb(body | {"v": version}), type(msg))


def test_zero_variance_groups_are_flagged():
    s = group().samples[0]
    assert RolloutGroup(group_id="a", generator=0, samples=[s, s.model_copy(update={"reward": 1.0})]).zero_variance
    assert not RolloutGroup(group_id="b", generator=0, samples=[s, s.model_copy(update={"reward": 0.0})]).zero_variance


def test_micro_batch_alignment():
    with pytest.raises(ValueError, match="positions has 0 entries for 1 tokens"):
        MicroBatch(step=0, rank=0, index=0, tokens=[1])
    with pytest.raises(ValueError, match="index"):
        MicroBatch(step=0, rank=0, index=-1)
