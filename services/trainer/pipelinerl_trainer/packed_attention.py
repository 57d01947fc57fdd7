"""Attention for packed rows that costs what the sequences cost, not what the row costs.

A packed row holds many samples back to back; their position ids restart at 0 at each one.
Hugging Face's SDPA path masks such a row block-diagonally, which still computes all T × T
scores of the row: with the tiny job's ~40 samples of ~13 tokens per 512-token row that is
~40x the attention work needed, a quarter of the trainer's step on CPU. Here the row's
sequences are gathered into batches of sequences of similar length (padded at their end, so
causal attention never lets a real token see padding), attended with one SDPA call per length
group, and put back in row order. Same result as the masked row, up to float rounding.

`use_packed_attention(model)` switches a loaded Hugging Face model to it. Calls that are not
one packed row (a batch of several rows, no position ids, a sliding window) take the stock SDPA
path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "pipelinerl_packed_sdpa"


def segments(positions: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each sequence of a packed row: a new one starts where the position
    does not follow the previous token's."""
    out: list[tuple[int, int]] = []
    for i, p in enumerate(positions):
        if i == 0 or p != positions[i - 1] + 1:
            out.append((i, 1))
        else:
            start, n = out[-1]
            out[-1] = (start, n + 1)
    return out


def padded_length(n: int) -> int:
    """The length a sequence is padded to in its group: at most 25% longer, and few groups."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def length_groups(segs: list[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
    groups: dict[int, list[tuple[int, int]]] = {}
    for start, n in segs:
        groups.setdefault(padded_length(n), []).append((start, n))
    return groups


def packed_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                sliding_window=None, position_ids=None, **kwargs):
    """Attention-interface function (query [1, H, T, D], key/value [1, Hkv, T, D]) returning
    [1, T, H, D], as Hugging Face's own SDPA function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if position_ids is None or query.shape[0] != 1 or sliding_window is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    order, parts = [], []
    for length, group in length_groups(segments(position_ids[0].tolist())).items():
        starts = torch.tensor([s for s, _ in group], device=q.device)
        lengths = torch.tensor([n for _, n in group], device=q.device)
        offsets = torch.arange(length, device=q.device)
        # Past a sequence's end, repeat its last token: only padded queries (dropped below) see it.
        index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)  # [n, L]
        out = F.scaled_dot_product_attention(
            q[:, index].transpose(0, 1), k[:, index].transpose(0, 1), v[:, index].transpose(0, 1),
            dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling,
            enable_gqa=q.shape[0] != k.shape[0])  # [n, H, L, D]
        real = offsets[None, :] < lengths[:, None]
        parts.append(out.transpose(1, 2)[real])  # [tokens, H, D]
        order.append(index[real])
    rows = torch.cat(parts)[torch.argsort(torch.cat(order))]
    return rows.unsqueeze(0), None


def use_packed_attention(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, packed_sdpa)
    # The stock SDPA mask: built (cheaply) for every call, used only by the fallback path.
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
