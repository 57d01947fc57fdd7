"""The staging copy that in-flight weight updates load into (pure torch, no vLLM).

A GPU engine captures CUDA graphs, which replay the storage addresses they recorded: the live
weights must keep their storage for the engine's life, so new values are copied INTO it, never
swapped in (`Parameter.data = ...` would leave the graphs computing with the old weights, with no
error). An update is therefore loaded into a second copy beside generation, which stays where it
was allocated (the next update's target too), and `commit` copies it into the live storage in
the short pause between two engine steps. The copy is one device-to-device pass over the weights
(bench/gpu_check.py times it for a 7B shard).
"""

from __future__ import annotations

import copy
import threading
from types import MethodType

import torch

from pipelinerl.weight_group import side_stream


class StagingCopy:
    """A second copy of a model's parameters, as a shallow copy of its module tree: each module
    copied with its own parameters (same class and loader attributes, bound loaders re-bound to
    the copy) and everything else shared. The model's own loader runs on `model` unchanged while
    the live one generates. `packed` are the layers whose CPU GEMM is packed from their weight
    (none on GPU): their copies' packed GEMMs are rebuilt after each load and exchanged at commit
    (a CPU engine has no graphs to keep true). Costs one more copy of the weights."""

    def __init__(self, model: torch.nn.Module, packed: list[torch.nn.Module]) -> None:
        modules: dict[int, torch.nn.Module] = {}
        params: dict[int, torch.nn.Parameter] = {}
        self.model = _copy_module(model, modules, params)
        self.packed = [modules[id(layer)] for layer in packed]
        self.pairs = [(live, params[id(live)]) for live in model.parameters()]
        self.packed_pairs = list(zip(packed, self.packed))

    @property
    def nbytes(self) -> int:
        return sum(staged.numel() * staged.element_size() for _, staged in self.pairs)

    def commit(self) -> None:
        """Copy the staged weights into the live storage (on the current stream: after whatever
        ran before, before whatever runs next). The staged copy keeps them: same values on both."""
        with torch.no_grad():
            for live, staged in self.pairs:
                live.data.copy_(staged.data)
        for layer, twin in self.packed_pairs:
            layer.cpu_linear, twin.cpu_linear = twin.cpu_linear, layer.cpu_linear


def _copy_module(module: torch.nn.Module, modules: dict, params: dict) -> torch.nn.Module:
    if id(module) in modules:  # shared (tied) submodules stay shared
        return modules[id(module)]
    twin = modules[id(module)] = copy.copy(module)
    twin._parameters = {
        name: None if p is None else _copy_param(p, module, twin, params) for name, p in module._parameters.items()
    }
    twin._buffers = dict(module._buffers)  # shared tensors: buffers are not in checkpoints
    twin._modules = {
        name: None if child is None else _copy_module(child, modules, params) for name, child in module._modules.items()
    }
    return twin


def _copy_param(
    p: torch.nn.Parameter, owner: torch.nn.Module, twin: torch.nn.Module, params: dict
) -> torch.nn.Parameter:
    if id(p) not in params:
        # The live values to start with: every staged load must write every parameter before a
        # commit (`coverage`), but not the padding a layer declares (`weight_loader_numel`),
        # which the commit copies over the live padding all the same.
        staged = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
        with torch.no_grad():
            staged.copy_(p)
        staged.__class__ = p.__class__
        staged.__dict__ = {
            key: value.__func__.__get__(twin) if isinstance(value, MethodType) and value.__self__ is owner else value
            for key, value in p.__dict__.items()
        }
        params[id(p)] = staged
    return params[id(p)]


class Transfer:
    """Weight-group work on a thread of its own, beside generation (a staged load, a join); keeps
    what it returned or raised. On a GPU it runs on this worker's device and issues its work on a
    stream of its own (`side_stream`), so its copies overlap the engine's steps instead of
    queueing between them, and waits for them before it counts as done."""

    def __init__(self, work, device: torch.device, name: str = "pipelinerl-stage-weights") -> None:
        self.result = None
        self.error: BaseException | None = None
        self.device = device
        self.thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            if self.device.type == "cuda":
                stream = side_stream(self.device)
                try:
                    with torch.cuda.device(self.device), torch.cuda.stream(stream):
                        self.result = work()
                finally:  # failed too: nothing it queued is left running over the staging copy
                    stream.synchronize()
            else:
                self.result = work()
        except BaseException as err:  # noqa: BLE001 - handed to the engine by the worker's poll
            self.error = err
