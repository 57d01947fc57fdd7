"""Whether an update wrote every weight (pipelinerl_generator.coverage): writes counted into each
parameter's memory on the in-place paths, and an MoE layer's expert shards on the reload path."""

import torch

from pipelinerl_generator.coverage import WriteCounter, missing_expert_shards, not_covered


def test_writes_are_credited_to_the_parameter_whose_memory_they_fall_in():
    buffer = torch.zeros(10)  # two parameters in one buffer, as an offloader packs them
    params = {"a.weight": buffer[:4], "b.weight": buffer[4:], "c.weight": torch.zeros(2, 3)}
    counter = WriteCounter(params)
    with counter:
        params["a.weight"].copy_(torch.ones(4))
        params["b.weight"][:3].copy_(torch.ones(3))  # a shard: 3 of 6
        params["c.weight"][0].fill_(1.0)
        params["c.weight"][1].zero_()
        torch.ones(5).copy_(torch.zeros(5))  # not a parameter's
    assert counter.written == {"a.weight": 4, "b.weight": 3, "c.weight": 6}
    assert counter.uncovered() == ["b.weight (3 of 6 elements)"]
    assert "did not cover 1 weights, e.g. b.weight (3 of 6 elements)" in str(not_covered(counter.uncovered()))


def test_padding_declared_and_parameters_no_checkpoint_holds_are_not_due():
    padded = torch.zeros(8)
    padded.weight_loader_numel = 6  # vLLM's declaration of a layer's padding
    params = {"moe.w13_weight": padded, "gate.e_score_correction_bias": torch.zeros(4), "empty": torch.zeros(0)}
    counter = WriteCounter(params)
    with counter:
        padded[:6].copy_(torch.ones(6))
    assert counter.uncovered() == []  # the router's bias is never loaded (vLLM's SKIP_LOAD_TENSORS)
    assert set(counter.written) == {"moe.w13_weight"}


def test_an_moe_layer_is_complete_when_every_expert_s_every_shard_came():
    every = {(e, s) for e in range(3) for s in ("w1", "w2", "w3")}
    assert missing_expert_shards(every, 3, ("w1", "w2", "w3")) == []
    assert missing_expert_shards(every - {(1, "w3")}, 3, ("w1", "w2", "w3")) == ["1/w3"]
    assert missing_expert_shards({(0, "w1"), (0, "w2")}, 2, ("w1", "w2")) == ["1/w1", "1/w2"]
