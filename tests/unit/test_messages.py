import msgpack
import pytest

from pipelinerl.messages import (
    SCHEMA_VERSION,
    Checkpointed,
    MessageError,
    MicroBatch,
    PolicyVersion,
    RolloutGroup,
    Sample,
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
    with pytest.raises(MessageError, match="schema version 99"):
        decode(msgpack.packb(body), RolloutGroup)
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


def test_zero_variance_groups_are_flagged():
    s = group().samples[0]
    assert RolloutGroup(group_id="a", generator=0, samples=[s, s.model_copy(update={"reward": 1.0})]).zero_variance
    assert not RolloutGroup(group_id="b", generator=0, samples=[s, s.model_copy(update={"reward": 0.0})]).zero_variance


def test_micro_batch_alignment():
    with pytest.raises(ValueError, match="positions has 0 entries for 1 tokens"):
        MicroBatch(step=0, rank=0, index=0, tokens=[1])
    with pytest.raises(ValueError, match="index"):
        MicroBatch(step=0, rank=0, index=-1)
