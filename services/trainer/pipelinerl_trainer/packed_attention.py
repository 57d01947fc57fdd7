"""Attention over packed rows at the cost of each sample's own tokens, not the row's.

The preprocessor packs many samples into one row and sends each sample's length with it. The
trainer turns the lengths into a `Packing` once per micro-batch (cumulative lengths on the
device, the longest length on the host), and every attention layer takes it from there: no
layer looks at position ids and nothing waits on the device.

Two kernels behind one attention function, chosen by the device and the dtype attention computes
in (`kernel_for`, `compute_dtype`: autocast's where it is on):

- ``varlen``: PyTorch's variable-length flash attention (`torch.nn.attention.varlen`, CUDA,
  bf16/fp16): one kernel call per layer over the whole row, no padding, no gathers.
- ``grouped``: the row's sequences gathered into batches of similar length (padded at their
  end, so causal attention never lets a real token see padding), one SDPA call per length
  group, scattered back into row order. Runs anywhere: the CPU path. Its gather plan is built
  once per micro-batch on the host, not per layer.

Both equal attention over the row under a block-diagonal causal mask (tests; the varlen kernel
itself on a GPU, `bench/gpu_check.sh`). A call without a packing (one plain sequence, e.g. an
evaluation) is causal attention over the row; a padded batch is refused, never mis-masked.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

NAME = "pipelinerl_packed"


def padded_length(n: int) -> int:
    """The length a sequence is padded to in its group: at most 25% longer, and few groups."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def length_groups(lengths: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Padded length → the (start, length) of the row's sequences padded to it."""
    groups: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for n in lengths:
        groups.setdefault(padded_length(n), []).append((start, n))
        start += n
    return groups


@dataclass(eq=False)
class Packing:
    """Where the sequences of one packed row are, in the forms the attention kernels take."""

    lengths: list[int]  # of each sequence, in row order (host data)
    cu_seqlens: torch.Tensor  # [N + 1] int32 on the device: where each sequence starts, and the row's end
    max_length: int  # the longest sequence (a host integer: the varlen kernel takes it so)
    _plan: tuple | None = None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device | str = "cpu") -> Packing:
        """Built on the host from the lengths (data), moved without waiting on the device."""
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(list(lengths), to(cu, device), max(lengths, default=0))

    def grouped_plan(self) -> tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], torch.Tensor]:
        """For the grouped kernel, built on the host at its first use and kept for every layer:
        per length group, the row index of each (sequence, offset) [n, L] (past a sequence's end
        its last token, which only padded queries see) and, flat, which entries are real (integer
        indices: a boolean mask would make the device report its count to the host); and the
        permutation that puts the groups' outputs back in row order."""
        if self._plan is None:
            device = self.cu_seqlens.device
            plans, rows = [], []
            for length, members in length_groups(self.lengths).items():
                starts = torch.tensor([s for s, _ in members])
                ns = torch.tensor([n for _, n in members])
                offsets = torch.arange(length)
                index = starts[:, None] + torch.minimum(offsets[None, :], ns[:, None] - 1)
                real = (offsets[None, :] < ns[:, None]).flatten().nonzero()[:, 0]
                plans.append((to(index, device), to(real, device)))
                rows.append(index.flatten()[real])
            self._plan = tuple(plans), to(torch.argsort(torch.cat(rows)), device)
        return self._plan


def to(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied without making the host wait (pinned memory on CUDA)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's where autocast is on for `t`'s device, else
    `t`'s. Under bf16 autocast with fp32 weights, Hugging Face's rotary embedding hands over q and
    k in fp32 (its cos/sin follow the fp32 hidden states) and v in bf16: SDPA casts them to bf16
    itself, so the varlen kernel must be chosen, and fed, by autocast's dtype too."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """varlen flash attention where it runs (CUDA, half precision, a torch that has it); else grouped."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen() is not None:
        return "varlen"
    return "grouped"


@functools.cache
def _varlen():
    """torch's varlen_attn and the keywords its version takes (causality was `is_causal=True` in
    torch 2.10 and is `window_size=(-1, 0)` since; GQA needs `enable_gqa` where it exists)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, scale: float | None, kernel=None
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] → [T, H, D], causal within each sequence. `kernel` stands in
    for torch's varlen_attn (tests on CPU pass a reference with the same contract)."""
    if kernel is None:
        kernel, params = _varlen()
    else:
        params = set(inspect.signature(kernel).parameters)
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    if scale is not None:
        kwargs["scale"] = scale
    cu, n = packing.cu_seqlens, packing.max_length
    return kernel(q, k, v, cu, cu, n, n, **kwargs)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, scale: float | None, dropout: float = 0.0
) -> torch.Tensor:
    """q [H, T, D], k/v [Hkv, T, D] → [T, H, D]: one SDPA call per length group."""
    groups, order = packing.grouped_plan()
    parts = []
    for index, real in groups:
        out = F.scaled_dot_product_attention(
            q[:, index].transpose(0, 1),
            k[:, index].transpose(0, 1),
            v[:, index].transpose(0, 1),
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[0] != k.shape[0],
        )  # [n, H, L, D]
        parts.append(out.transpose(1, 2).flatten(0, 1)[real])  # [tokens, H, D]
    return torch.cat(parts)[order]


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    packing: Packing | None = None,
    **kwargs,
):
    """Hugging Face attention-interface function: query [1, H, T, D], key/value [1, Hkv, T, D]
    → ([1, T, H, D], None), as HF's own SDPA function returns."""
    if sliding_window is not None:
        raise NotImplementedError("the trainer's packed attention has no sliding window (this model uses one)")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("the trainer's attention takes one packed row (no padding mask)")
    dropout = dropout if module.training else 0.0
    if packing is None:  # one plain sequence
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2), None
    dtype = compute_dtype(query)
    if kernel_for(query.device, dtype) == "varlen":
        if dropout:
            raise NotImplementedError("attention dropout with the varlen kernel")
        # torch's varlen op is not autocast-aware: it gets q, k, v in the compute dtype.
        q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))
        out = varlen_attention(q, k, v, packing, scaling)
    else:
        out = grouped_attention(query[0], key[0], value[0], packing, scaling, dropout)
    return out.unsqueeze(0), None


def use_packed_attention(model) -> None:
    """Switch a loaded Hugging Face model to `packed_attention`. No mask function is registered
    for it, so transformers builds no [T, T] mask and never scans the position ids for packed
    sequences (a device sync per forward)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    model.set_attn_implementation(NAME)
