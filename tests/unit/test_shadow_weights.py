"""The second copy of a model's weights that staged updates load into (pure torch, no vLLM)."""

import torch

from pipelinerl_generator.weight_receiver import Shadow


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


def test_loading_the_shadow_leaves_the_live_model_alone_until_swap():
    model = Model()
    packed = [model.embed, *model.body]
    shadow = Shadow(model, packed)
    x = torch.randn(2, 4)
    before = model.body[0](x)
    live_ids = [id(p) for p in model.parameters()]

    new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    assert shadow.model.load_weights(new.items()) == set(new)
    for layer in shadow.packed:
        layer.cpu_linear = Linear.packed(layer.weight.detach().clone())

    torch.testing.assert_close(model.body[0](x), before)  # live weights untouched
    assert shadow.model.head is shadow.model.embed  # ties kept in the copy
    assert shadow.model.body[0].last_loaded_by is shadow.model.body[0]  # loaders re-bound to the copy
    assert not hasattr(model.body[0], "last_loaded_by")
    assert shadow.model.body[0].scale is model.body[0].scale  # buffers shared

    shadow.swap()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, new[name])
    torch.testing.assert_close(model.body[0](x), x @ new["body.0.weight"].t())  # packed GEMMs swapped too
    assert [id(p) for p in model.parameters()] == live_ids  # same Parameter objects, new storage
    torch.testing.assert_close(shadow.model.body[0](x), before)  # the copy now holds the old weights
