"""The staging copy that in-flight updates load into, and its commit into the live weights (pure
torch, no vLLM)."""

import torch

from pipelinerl_generator.staging import StagingCopy


class Linear(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n), requires_grad=False)
        self.weight.weight_loader = self.load  # vLLM style: a bound loader on the parameter
        self.weight.output_dim = 0
        self.register_buffer("scale", torch.ones(1))
        self.cpu_linear = self.packed(self.weight.detach().clone())

    def load(self, param, value):
        assert param.output_dim == 0
        param.data.copy_(value)
        self.last_loaded_by = self  # which module the loader ran as

    @staticmethod
    def packed(weight):  # stands for a GEMM packed from the weight at load time
        return lambda x: x @ weight.t()

    def forward(self, x):
        return self.cpu_linear(x) * self.scale


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Linear(4)
        self.body = torch.nn.ModuleList([Linear(4), Linear(4)])
        self.head = self.embed  # tied, as vLLM ties lm_head to the embedding module

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, value in weights:
            params[name].weight_loader(params[name], value)
        return set(params)


def test_loading_the_copy_leaves_the_live_model_alone_until_commit():
    model = Model()
    packed = [model.embed, *model.body]
    staging = StagingCopy(model, packed)
    x = torch.randn(2, 4)
    before = model.body[0](x)
    live = [(id(p), p.data_ptr()) for p in model.parameters()]
    assert staging.nbytes == sum(p.numel() * 4 for p in model.parameters())

    new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    assert staging.model.load_weights(new.items()) == set(new)
    for layer in staging.packed:
        layer.cpu_linear = Linear.packed(layer.weight.detach().clone())

    torch.testing.assert_close(model.body[0](x), before)  # live weights untouched
    assert staging.model.head is staging.model.embed  # ties kept in the copy
    assert staging.model.body[0].last_loaded_by is staging.model.body[0]  # loaders re-bound to the copy
    assert not hasattr(model.body[0], "last_loaded_by")
    assert staging.model.body[0].scale is model.body[0].scale  # buffers shared

    staging.commit()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, new[name])
    torch.testing.assert_close(model.body[0](x), x @ new["body.0.weight"].t())  # packed GEMMs exchanged too
    # Same Parameter objects AND the same storage: CUDA graphs replay the addresses they captured.
    assert [(id(p), p.data_ptr()) for p in model.parameters()] == live
    assert all(s.data_ptr() != p.data_ptr() for p, s in staging.pairs)  # the copy stays where it was


def test_every_commit_copies_into_the_same_storage():
    model = Model()
    staging = StagingCopy(model, [])
    live = [p.data_ptr() for p in model.parameters()]
    staged = [s.data_ptr() for _, s in staging.pairs]
    for _ in range(3):
        new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
        staging.model.load_weights(new.items())
        staging.commit()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, new[name])
        assert [p.data_ptr() for p in model.parameters()] == live
        assert [s.data_ptr() for _, s in staging.pairs] == staged


def test_the_copy_starts_from_the_live_values():
    """Padding a load never writes (`weight_loader_numel`) is committed over the live padding:
    it must hold the live values, not uninitialised memory."""
    model = Model()
    staging = StagingCopy(model, [])
    for (name, live), (_, staged) in zip(model.named_parameters(), staging.model.named_parameters()):
        assert staged.data_ptr() != live.data_ptr()
        torch.testing.assert_close(staged, live, msg=name)
