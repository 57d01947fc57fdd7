"""Reference attention for the packed-attention tests: the whole row under a block-diagonal
causal mask, and torch's documented `varlen_attn` contract computed by plain SDPA per sequence
(torch's own kernel needs CUDA)."""

import torch
import torch.nn.functional as F


def masked_reference(q, k, v, lengths, scale=None):
    """[H, T, D] → [T, H, D]: the whole row, block-diagonal causal mask."""
    dev = q.device  # the mask where q is: the GPU test calls this with CUDA tensors
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=dev), torch.tensor(lengths, device=dev))
    pos = torch.arange(len(seq), device=dev)
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    rep = q.shape[0] // k.shape[0]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def reference_varlen(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch's documented varlen_attn contract ([T, H, D] in and out, sequences from cu_seq), by
    plain SDPA per sequence; causal as (-1, 0) (torch ≥ 2.11)."""
    assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert enable_gqa == (query.shape[1] != key.shape[1])
    causal = tuple(window_size) == (-1, 0)
    out = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        out.append(
            F.scaled_dot_product_attention(
                query[a:b].transpose(0, 1),
                key[a:b].transpose(0, 1),
                value[a:b].transpose(0, 1),
                is_causal=causal,
                scale=scale,
                enable_gqa=enable_gqa,
            ).transpose(0, 1)
        )
    return torch.cat(out)


def reference_varlen_2_10(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None
):
    """The torch 2.10 signature: causality as a flag, no GQA flag (the kernel takes fewer KV heads)."""
    return reference_varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(-1, 0) if is_causal else (-1, -1),
        enable_gqa=query.shape[1] != key.shape[1],
    )
