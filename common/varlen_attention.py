"""Causal attention per packed sample on CPU: a varlen kernel with flash-attention's contract, and the
transformers attention implementation (`varlen_sdpa`) that packed and padded batches use on CPU.

A packed row holds several samples whose `position_ids` restart at 0. transformers' `sdpa` path
builds an L x L block-diagonal mask for such a row and attends over all of it (L² work, ~36 ms per
call for a 2,500-token row of 16 samples on 2 cores); attending within each sample does Σ lᵢ²
(~3.5 ms). The kernel here runs torch's fused CPU attention (`_scaled_dot_product_flash_attention
_for_cpu` and its backward, the ops `scaled_dot_product_attention` itself dispatches to) once per
sample, in flash-attention's varlen layout: tokens of all samples concatenated, (total, heads,
head_dim), samples delimited by `cu_seqlens`; forward returns the output and the log-sum-exp of
each query, backward the gradients. Keys longer than queries (a query block at the end of its
sample, as in ring attention) are aligned bottom-right, as flash-attention aligns them.

The attention implementation takes sample boundaries from `position_ids` (every collated batch
of common.packing carries them: packed rows, and padded rows whose padding tail restarts at 0),
so it gets no mask: transformers builds none for a name it has no mask function for. A row may also
hold shared-prefix branches (a DPO pair's rejected response after its chosen sample, whose prompt it
reuses: see `attention_segments`), which attend to their root's prefix without a copy of it. Calls with
a KV cache (generation: fewer queries than keys) go to transformers' sdpa; generate from models
loaded with the default `sdpa`, as exports are (save_pretrained does not store the name).
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "varlen_sdpa"  # no "flash" in it: transformers treats any such name as a flash-attention build


def cu_seqlens_from_position_ids(position_ids):
    """Offsets of every sample in the rows flattened (a sample starts where its position is 0),
    ending with the total token count: [0, l0, l0 + l1, ...]."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [flat.numel()]


def _causal_mask(lq, lk, like):
    """Additive bottom-right causal mask (the fused op wants the query's dtype): query i, one of the
    last lq positions, sees keys up to lk - lq + i."""
    visible = torch.ones(lq, lk, dtype=torch.bool, device=like.device).tril(lk - lq)
    return torch.zeros(lq, lk, dtype=like.dtype, device=like.device).masked_fill(~visible, float("-inf"))


def _same_length_groups(cu_seqlens_q, cu_seqlens_k, device):
    """Samples grouped by (query length, key length): each group runs as one batched call of the fused
    op (a packed row of short samples is a few calls, not one per sample). Yields the group's token
    indices into q and into k / v, sample count, query length and key length."""
    groups = {}
    for i in range(len(cu_seqlens_q) - 1):
        lq, lk = cu_seqlens_q[i + 1] - cu_seqlens_q[i], cu_seqlens_k[i + 1] - cu_seqlens_k[i]
        if lq > 0:
            groups.setdefault((lq, lk), []).append(i)
    for (lq, lk), ids in groups.items():
        q_starts = torch.tensor([cu_seqlens_q[i] for i in ids], device=device)
        k_starts = torch.tensor([cu_seqlens_k[i] for i in ids], device=device)
        q_index = (q_starts[:, None] + torch.arange(lq, device=device)).flatten()
        k_index = (k_starts[:, None] + torch.arange(lk, device=device)).flatten()
        yield q_index, k_index, len(ids), lq, lk


def _heads_first(x, index, n, heads):
    """Rows `index` of (tokens, kv heads, dim), n samples of equal length -> (n, heads, length, dim),
    repeating KV heads for grouped queries."""
    x = x[index].view(n, -1, x.shape[1], x.shape[2]).transpose(1, 2)
    if x.shape[1] != heads:
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
    return x.contiguous()


def _tokens_first(x, n, length):
    """(n, heads, length, dim) -> (n * length, heads, dim)."""
    return x.transpose(1, 2).reshape(n * length, x.shape[1], x.shape[3])


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True):
    """q: (total_q, heads, dim); k, v: (total_k, kv_heads, dim); sample i is rows
    cu_seqlens[i]:cu_seqlens[i + 1]. Returns out (total_q, heads, dim) and lse (heads, total_q), fp32."""
    heads = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(heads, q.shape[0], dtype=torch.float32, device=q.device)
    for q_index, k_index, n, lq, lk in _same_length_groups(cu_seqlens_q, cu_seqlens_k, q.device):
        mask = _causal_mask(lq, lk, q) if causal and lq != lk else None
        o, s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _heads_first(q, q_index, n, heads), _heads_first(k, k_index, n, heads),
            _heads_first(v, k_index, n, heads), 0.0, causal and lq == lk, attn_mask=mask, scale=softmax_scale)
        out[q_index] = _tokens_first(o, n, lq)
        lse[:, q_index] = s.transpose(0, 1).reshape(heads, n * lq)
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True):
    """Gradients (dq, dk, dv) of varlen_forward, shaped like q, k, v (grouped heads summed back)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_index, k_index, n, lq, lk in _same_length_groups(cu_seqlens_q, cu_seqlens_k, q.device):
        mask = _causal_mask(lq, lk, q) if causal and lq != lk else None
        group_lse = lse[:, q_index].view(heads, n, lq).transpose(0, 1).contiguous()
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _heads_first(dout, q_index, n, heads), _heads_first(q, q_index, n, heads),
            _heads_first(k, k_index, n, heads), _heads_first(v, k_index, n, heads),
            _heads_first(out, q_index, n, heads), group_lse, 0.0, causal and lq == lk, attn_mask=mask,
            scale=softmax_scale)
        dq[q_index] = _tokens_first(gq, n, lq)
        group = heads // kv_heads
        dk[k_index] = _tokens_first(gk.view(n, kv_heads, group, lk, -1).sum(2), n, lk)
        dv[k_index] = _tokens_first(gv.view(n, kv_heads, group, lk, -1).sum(2), n, lk)
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.softmax_scale = (cu_seqlens_q, cu_seqlens_k), softmax_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = varlen_backward(dout.contiguous(), q, k, v, out, lse, *ctx.cu_seqlens, ctx.softmax_scale)
        return dq, dk, dv, None, None, None


def attention_segments(position_ids):
    """(cu_seqlens_q, key index, cu_seqlens_k) of the flattened rows. A segment starts where a position is 0
    (a new sample) or does not follow the previous one: a segment starting at position s > 0 is a branch
    (common.packing.collate's `share_prefixes`) of the last sample that started at 0, and attends to that
    sample's first s tokens, then to itself. The key index gathers each segment's keys (None: no branches,
    every segment attends to itself)."""
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = (flat[1:] == 0) | (flat[1:] != flat[:-1] + 1)
    bounds = torch.nonzero(starts).flatten().tolist() + [flat.numel()]
    first_positions = flat[bounds[:-1]].tolist()
    if not any(first_positions):
        return bounds, None, bounds
    cu_k, keys, root, root_len = [0], [], 0, 0
    for a, b, s in zip(bounds[:-1], bounds[1:], first_positions):
        if s == 0 or a == 0:  # a sample (or a row that starts inside one, as a ring's slice may)
            root, root_len, s = a, b - a, 0
        elif s > root_len:
            raise ValueError(f"a branch at token {a} shares {s} tokens of a sample that has {root_len}")
        else:
            keys.append(torch.arange(root, root + s))
        keys.append(torch.arange(a, b))
        cu_k.append(cu_k[-1] + b - a + s)
    if len(keys) == len(bounds) - 1:  # no branch after all
        return bounds, None, bounds
    return bounds, torch.cat(keys).to(position_ids.device), cu_k


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                             sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: query (batch, heads, len, dim), key / value (batch, kv_heads,
    len, dim) -> (batch, len, heads, dim), each sample of each row attending only within itself."""
    batch, heads, length, dim = query.shape
    plain = (position_ids is None or tuple(position_ids.shape) != (batch, length) or key.shape[2] != length
             or sliding_window or softcap or (dropout and module.training))
    if plain:  # generation with a KV cache, or what the per-sample kernel does not cover
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    # under autocast the rotary embedding hands back fp32 queries and keys beside bf16 values: attend in fp32
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], dim)
    scale = scaling if scaling is not None else dim**-0.5
    cu_seqlens_q, key_index, cu_seqlens_k = attention_segments(position_ids)
    if key_index is not None:  # a branch attends to its root's shared prefix, then to itself (bottom-right causal)
        k, v = k[key_index], v[key_index]
    out = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return out.view(batch, length, heads, dim), None


AttentionInterface.register(NAME, varlen_attention_forward)


def default_attn_implementation():
    """flash_attention_2 on CUDA when installed (sdpa without it); on CPU common.varlen_attention's
    varlen_sdpa, which attends within each packed sample instead of over a block-diagonal mask."""
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            return "sdpa"
    return NAME
