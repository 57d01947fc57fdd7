"""The staged commit against what a GPU engine really runs: a captured CUDA graph, which replays
the parameter addresses it recorded. After the project's commit (staged: the staging copy copied
in; in place: the model's loaders into the live weights) the graph computes exactly what the eager
model computes with the new weights. A `.data` swap, the commit this replaced, leaves the graph
on the old weights with no error: the control shows the check would catch it.

On a GPU (`bash bench/gpu_check.sh` runs it first) with a real CUDA graph; on CPU with a forward
that holds the parameter tensors it saw at capture, as a graph holds their addresses."""

from __future__ import annotations

import pytest
import torch

from pipelinerl.weight_group import side_stream
from pipelinerl_generator.staging import StagingCopy, Transfer

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    ),
]


class Linear(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.weight.weight_loader = self.load  # vLLM style: a bound loader on the parameter

    def load(self, param, value):
        param.data.copy_(value)  # vLLM's loaders copy in place

    def forward(self, x):
        return x @ self.weight.t()


class Model(torch.nn.Module):
    """A decoder-shaped stack (embedding, gated MLP blocks, norm, tied head): parameters as vLLM
    holds them, loaded by name through each parameter's loader."""

    def __init__(self, vocab: int = 64, hidden: int = 32, layers: int = 2):
        super().__init__()
        self.embed = Linear(hidden, vocab)  # rows are token embeddings; tied to the head
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"gate": Linear(hidden, 4 * hidden), "up": Linear(hidden, 4 * hidden),
                                 "down": Linear(4 * hidden, hidden)})
            for _ in range(layers)
        )  # fmt: skip

    def forward(self, ids):
        h = self.embed.weight[ids]
        for b in self.blocks:
            h = h + b["down"](torch.nn.functional.silu(b["gate"](h)) * b["up"](h))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h @ self.embed.weight.t()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, value in weights:
            params[name].weight_loader(params[name], value)
        return set(params)


def weights(model: Model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(p.shape, generator=g) * 0.3).to(p.device) for n, p in model.named_parameters()}


def capture(model: Model, ids: torch.Tensor):
    """What the engine replays: a CUDA graph of the forward on a GPU; on CPU the forward over the
    tensors the parameters held at capture (a graph's recorded addresses)."""
    if ids.is_cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids)  # warm-up outside the graph, as vLLM does before capturing
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids)

        def replay():
            graph.replay()
            return out.clone()

        return replay
    recorded = {n: p.data for n, p in model.named_parameters()}
    return lambda: torch.func.functional_call(model, recorded, (ids,))


def fresh_model(device: str) -> tuple[Model, torch.Tensor]:
    model = Model().to(device).eval()
    model.load_weights(weights(model, 0).items())
    ids = torch.arange(16, device=device).remainder(64)[None].repeat(4, 1)
    return model, ids


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_a_captured_forward_computes_with_the_weights_each_commit_brings(device):
    model, ids = fresh_model(device)
    replay = capture(model, ids)
    torch.testing.assert_close(replay(), model(ids))
    staging = StagingCopy(model, [])
    for seed in (1, 2):  # staged: loaded into the copy on a thread (and its own stream), then committed
        new = weights(model, seed)
        transfer = Transfer(lambda: staging.model.load_weights(new.items()), ids.device)
        transfer.thread.join(60)
        assert transfer.error is None
        staging.commit()
        torch.testing.assert_close(replay(), model(ids), rtol=0, atol=0)
        torch.testing.assert_close(model.blocks[1]["up"].weight, new["blocks.1.up.weight"], rtol=0, atol=0)
    model.load_weights(weights(model, 3).items())  # in place: the loaders straight into the live weights
    torch.testing.assert_close(replay(), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_control_a_data_swap_leaves_the_captured_forward_on_the_old_weights(device):
    model, ids = fresh_model(device)
    replay = capture(model, ids)
    old = replay()
    staging = StagingCopy(model, [])
    staging.model.load_weights(weights(model, 1).items())
    for live, staged in staging.pairs:  # the commit this project had: storage swapped
        live.data, staged.data = staged.data, live.data
    new = model(ids)
    assert not torch.allclose(new, old)
    torch.testing.assert_close(replay(), old, rtol=0, atol=0)  # silently stale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_staged_updates_run_on_a_stream_the_engine_never_draws():
    """vLLM draws its streams from torch's default-priority pool, handed out round-robin (32):
    two whole turns of it never hand out the staging stream, which stays one for every update."""
    device = torch.device("cuda", torch.cuda.current_device())
    staging = side_stream(device)
    drawn = {torch.cuda.Stream(device).cuda_stream for _ in range(64)}
    assert len(drawn) >= 2 and staging.cuda_stream not in drawn
    assert side_stream(device) is staging and staging.priority < 0
