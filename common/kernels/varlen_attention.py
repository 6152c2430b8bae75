"""The CPU attention kernel, a dependency like flash-attn (tested on its own: tests/test_varlen_attention.py).

Causal attention per packed sample on CPU: a varlen kernel with flash-attention's contract, and the
transformers attention implementation (`varlen_sdpa`) that packed and padded batches use on CPU.

A packed row holds several samples whose `position_ids` restart at 0. transformers' `sdpa` path builds
an L x L block-diagonal mask for such a row and attends over all of it (L² work, ~36 ms per call for a
2,500-token row of 16 samples on 2 cores); attending within each sample does Σ lᵢ² (~3.5 ms). The kernel
here runs torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward,
the ops `scaled_dot_product_attention` itself dispatches to) once per group of samples of one length
(`SampleGroups`), in flash-attention's varlen layout: tokens of all samples concatenated, (total, heads,
head_dim), samples delimited by `cu_seqlens`; forward returns the output and the log-sum-exp of each
query, backward the gradients. Keys longer than queries (a query block at the end of its sample, as in
ring attention) are aligned bottom-right, as flash-attention aligns them.

The attention implementation takes sample boundaries from `position_ids` (every collated batch of
common.packing carries them: packed rows, and padded rows whose padding tail restarts at 0), so it gets
no mask: transformers builds none for a name it has no mask function for. A row may also hold
shared-prefix branches (a DPO pair's rejected response after its chosen sample, whose prompt it reuses:
see `attention_segments`), which attend to their root's prefix without a copy of it. The plan is
worked out once per batch, at the first layer (`batch_plan`), not in every layer's forward and
backward: at a DPO step's shape that bookkeeping had cost more than the kernels.

Short samples take another route (`SampleBlocks`): each sample, with its branches, is laid out in one
of equal blocks as long as the longest, padded, and the blocks are attended in a single call of the
fused op with a mask of who sees whom. That does more arithmetic than per-length groups (a block is
attended whole) but makes one call per layer instead of one per group; at a DPO step's shape (16 pairs,
~25 groups per layer) forward + backward went ~178 -> ~151 ms. `batch_plan` weighs the blocks' extra
arithmetic against the groups' extra calls (a long-tailed row keeps the groups). Calls with a KV cache
(generation: fewer queries than keys) go to transformers' sdpa; generate from models loaded with the
default `sdpa`, as exports are (save_pretrained does not store the name).
"""

import torch
from transformers import AttentionInterface

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common.kernels import VARLEN_SDPA as NAME  # no "flash" in it: transformers takes such names for flash-attn
from common.kernels.bins import pack_sequences


def cu_seqlens_from_position_ids(position_ids):
    """Offsets of every sample in the rows flattened (a sample starts where its position is 0),
    ending with the total token count: [0, l0, l0 + l1, ...]."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts + [flat.numel()]


class SampleGroups:
    """A batch's samples grouped by (query length, key length): each group runs as one batched call of the
    fused op, so a row of short samples is a few calls, not one per sample. Built once per batch (every
    layer's forward and backward reuse it). The tokens are reordered so that each group's samples lie
    together: `q_order` / `k_order` index q and k (None where the order is already that), and a group's
    queries, keys and values are views of the one gathered tensor. With `key_index` (the keys are
    k[key_index]: branches that reuse a root's prefix, q and k being the same tokens) `k_order` repeats keys,
    and their gradients are summed back."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, device, key_index=None):
        by_shape = {}
        for i in range(len(cu_seqlens_q) - 1):
            lq, lk = cu_seqlens_q[i + 1] - cu_seqlens_q[i], cu_seqlens_k[i + 1] - cu_seqlens_k[i]
            if lq > 0:
                by_shape.setdefault((lq, lk), []).append(i)
        self.shapes = [(len(ids), lq, lk) for (lq, lk), ids in by_shape.items()]
        q_order = [t for (lq, _), ids in by_shape.items() for i in ids
                   for t in range(cu_seqlens_q[i], cu_seqlens_q[i] + lq)]
        k_order = [t for (_, lk), ids in by_shape.items() for i in ids
                   for t in range(cu_seqlens_k[i], cu_seqlens_k[i] + lk)]
        self.total_q, self.total_k = cu_seqlens_q[-1], cu_seqlens_k[-1]
        in_order = q_order == list(range(self.total_q))
        self.q_order = None if in_order else torch.tensor(q_order, device=device)
        self.q_restore = None if in_order else torch.argsort(self.q_order)
        if key_index is not None:
            self.k_order, self.total_k = key_index[torch.tensor(k_order, device=device)], self.total_q
        else:
            in_order = k_order == list(range(self.total_k))
            self.k_order = None if in_order else torch.tensor(k_order, device=device)
        self._masks = {}

    def mask(self, lq, lk, like):
        """Additive bottom-right causal mask (the fused op wants the query's dtype): query i, one of the
        last lq positions, sees keys up to lk - lq + i."""
        key = (lq, lk, like.dtype)
        if key not in self._masks:
            visible = torch.ones(lq, lk, dtype=torch.bool, device=like.device).tril(lk - lq)
            self._masks[key] = torch.zeros(lq, lk, dtype=like.dtype, device=like.device).masked_fill(
                ~visible, float("-inf"))
        return self._masks[key]

    def order_q(self, x):
        """Rows of x (q's order) in group order."""
        return x if self.q_order is None else x.index_select(0, self.q_order)

    def order_k(self, x):
        """Rows of x (k's order) in group order."""
        return x if self.k_order is None else x.index_select(0, self.k_order)

    def restore_q(self, x):
        """Rows of x, in group order, back in q's order."""
        return x if self.q_restore is None else x.index_select(0, self.q_restore)

    def sum_into_k(self, x):
        """Key gradients in group order summed into k's rows."""
        if self.k_order is None:
            return x
        return x.new_zeros(self.total_k, *x.shape[1:]).index_add_(0, self.k_order, x)

    def lse_heads_first(self, lse):
        """The log-sum-exp of grouped_forward (per group (n, heads, lq), flattened) as (heads, total_q) in q's
        order, flash-attention's layout."""
        parts, at = [], 0
        heads = lse.numel() // self.total_q
        for n, lq, _ in self.shapes:
            parts.append(lse[at: at + n * heads * lq].view(n, heads, lq).transpose(0, 1).reshape(heads, n * lq))
            at += n * heads * lq
        out = torch.cat(parts, 1)
        return out if self.q_restore is None else out.index_select(1, self.q_restore)

    def lse_grouped(self, lse):
        """The inverse of lse_heads_first."""
        lse = lse if self.q_order is None else lse.index_select(1, self.q_order)
        parts, at = [], 0
        for n, lq, _ in self.shapes:
            parts.append(lse[:, at: at + n * lq].view(-1, n, lq).transpose(0, 1).reshape(-1))
            at += n * lq
        return torch.cat(parts)


def _views(x, groups, which, heads):
    """Each group's (n, heads, length, dim) view of x, a (tokens, heads, dim) tensor in group order."""
    at = 0
    for shape in groups.shapes:
        n, length = shape[0], shape[which]
        yield x[at: at + n * length].view(n, length, heads, x.shape[2]).transpose(1, 2)
        at += n * length


def _repeat_kv(x, heads):
    """(tokens, kv heads, dim) -> (tokens, heads, dim) for grouped queries."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def grouped_forward(q, k, v, groups, softmax_scale, causal=True):
    """q (total_q, heads, dim), k, v (total_k, kv_heads, dim), all in the group order of `groups`.
    Returns out (total_q, heads, dim) in group order and the log-sum-exp (fp32, flat in group order)."""
    heads = q.shape[1]
    outs, lses = [], []
    for (n, lq, lk), gq, gk, gv in zip(groups.shapes, _views(q, groups, 1, heads),
                                       _views(_repeat_kv(k, heads), groups, 2, heads),
                                       _views(_repeat_kv(v, heads), groups, 2, heads)):
        mask = groups.mask(lq, lk, q) if causal and lq != lk else None
        o, s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            gq, gk, gv, 0.0, causal and lq == lk, attn_mask=mask, scale=softmax_scale)
        outs.append(o.transpose(1, 2).reshape(n * lq, heads, -1))
        lses.append(s.reshape(-1))
    return torch.cat(outs), torch.cat(lses)


def grouped_backward(dout, q, k, v, out, lse, groups, softmax_scale, causal=True):
    """Gradients (dq, dk, dv) of grouped_forward, in group order, shaped like q, k, v (grouped heads summed
    back)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    dqs, dks, dvs, at = [], [], [], 0
    for (n, lq, lk), gdo, gq, gk, gv, go in zip(
            groups.shapes, _views(dout, groups, 1, heads), _views(q, groups, 1, heads),
            _views(_repeat_kv(k, heads), groups, 2, heads), _views(_repeat_kv(v, heads), groups, 2, heads),
            _views(out, groups, 1, heads)):
        mask = groups.mask(lq, lk, q) if causal and lq != lk else None
        glse = lse[at: at + n * heads * lq].view(n, heads, lq)
        at += n * heads * lq
        gradients = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            gdo, gq, gk, gv, go, glse, 0.0, causal and lq == lk, attn_mask=mask, scale=softmax_scale)
        for grad, parts, length in zip(gradients, (dqs, dks, dvs), (lq, lk, lk)):
            parts.append(grad.transpose(1, 2).reshape(n * length, heads, -1))
    dk, dv = torch.cat(dks), torch.cat(dvs)
    if kv_heads != heads:
        dk, dv = (d.view(d.shape[0], kv_heads, heads // kv_heads, -1).sum(2) for d in (dk, dv))
    return torch.cat(dqs), dk, dv


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True):
    """q: (total_q, heads, dim); k, v: (total_k, kv_heads, dim); sample i is rows
    cu_seqlens[i]:cu_seqlens[i + 1]. Returns out (total_q, heads, dim) and lse (heads, total_q), fp32."""
    groups = SampleGroups(cu_seqlens_q, cu_seqlens_k, q.device)
    out, lse = grouped_forward(groups.order_q(q), groups.order_k(k), groups.order_k(v), groups, softmax_scale, causal)
    return groups.restore_q(out), groups.lse_heads_first(lse)


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True):
    """Gradients (dq, dk, dv) of varlen_forward, shaped like q, k, v (grouped heads summed back)."""
    groups = SampleGroups(cu_seqlens_q, cu_seqlens_k, q.device)
    dq, dk, dv = grouped_backward(
        groups.order_q(dout), groups.order_q(q), groups.order_k(k), groups.order_k(v), groups.order_q(out),
        groups.lse_grouped(lse), groups, softmax_scale, causal)
    return groups.restore_q(dq), groups.sum_into_k(dk), groups.sum_into_k(dv)


class _VarlenAttention(torch.autograd.Function):
    """Attention of q, k, v in their own order; the group-ordered copies are kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, groups, softmax_scale):
        q, k, v = groups.order_q(q), groups.order_k(k), groups.order_k(v)
        out, lse = grouped_forward(q, k, v, groups, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.groups, ctx.softmax_scale = groups, softmax_scale
        return groups.restore_q(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups = ctx.groups
        dq, dk, dv = grouped_backward(groups.order_q(dout), q, k, v, out, lse, groups, ctx.softmax_scale)
        return groups.restore_q(dq), groups.sum_into_k(dk), groups.sum_into_k(dv), None, None


def _segments(flat):
    """Segment bounds [a0, a1, ..., total] of flattened positions (a segment starts at position 0 or where
    positions do not follow on) and each segment's first position."""
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = (flat[1:] == 0) | (flat[1:] != flat[:-1] + 1)
    bounds = torch.nonzero(starts).flatten().tolist() + [flat.numel()]
    return bounds, flat[bounds[:-1]].tolist()


def attention_segments(position_ids):
    """(cu_seqlens_q, key index, cu_seqlens_k) of the flattened rows. A segment starts where a position is 0
    (a new sample) or does not follow the previous one: a segment starting at position s > 0 is a branch
    (common.packing.collate's `share_prefixes`) of the last sample that started at 0, and attends to that
    sample's first s tokens, then to itself. The key index gathers each segment's keys (None: no branches,
    every segment attends to itself)."""
    bounds, first_positions = _segments(position_ids.reshape(-1))
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


class SampleBlocks:
    """A batch's samples, each with the branches that follow it (a unit), in `count` blocks of `size` tokens
    (the longest unit's; first-fit decreasing), the rest of a block padding. `slot_token` gathers tokens
    into block slots (a padding slot reads token 0) and `token_slot` reads them back. In a block a query
    sees the earlier tokens of its own segment and, in a branch starting at position s, the first s tokens
    of its root sample (`mask`); a padding slot sees only itself, so that its softmax is defined, and no
    real query sees it."""

    def __init__(self, flat_positions):
        bounds, first_positions = _segments(flat_positions)
        units, roots = [], []  # units: [start, end) of a sample and its branches; roots: each segment's sample
        for i, (a, b, s) in enumerate(zip(bounds[:-1], bounds[1:], first_positions)):
            if s == 0 or not units:
                units.append([a, b])
                root = i
            else:
                units[-1][1] = b
            roots.append(root)
        self.size = max(b - a for a, b in units)
        blocks = pack_sequences([b - a for a, b in units], self.size)
        self.count = len(blocks)
        slots = []
        for block in blocks:
            tokens = [t for u in block for t in range(*units[u])]
            slots += tokens + [-1] * (self.size - len(tokens))
        device = flat_positions.device
        slot_token = torch.tensor(slots, device=device)
        real = slot_token >= 0
        self.slot_token = slot_token.clamp(min=0)
        self.token_slot = torch.nonzero(real).flatten()[torch.argsort(slot_token[real])]
        segment = torch.repeat_interleave(torch.arange(len(roots), device=device),
                                          torch.tensor(bounds, device=device).diff())[self.slot_token]
        alone = -1 - torch.arange(len(slots), device=device)  # a padding slot's own segment
        self._segment = torch.where(real, segment, alone).view(self.count, self.size)
        self._position = torch.where(real, flat_positions[self.slot_token], 0).view(self.count, self.size)
        self._root = torch.where(real, torch.tensor(roots, device=device)[segment], alone).view(self.count, self.size)
        self._first = torch.where(real, torch.tensor(first_positions, device=device)[segment], 0).view(
            self.count, self.size)
        self._masks = {}

    def mask(self, like):
        """Additive mask (count, 1, size, size) in like's dtype: 0 where a query sees a key, -inf elsewhere."""
        if like.dtype not in self._masks:
            seg, pos, root, first = self._segment, self._position, self._root, self._first
            own = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
            prefix = (root[:, :, None] == seg[:, None, :]) & (pos[:, None, :] < first[:, :, None])
            self._masks[like.dtype] = torch.zeros(own.shape, dtype=like.dtype, device=like.device).masked_fill(
                ~(own | prefix), float("-inf"))[:, None]
        return self._masks[like.dtype]

    def to_blocks(self, x):
        """(tokens, heads, dim) -> (count, heads, size, dim)."""
        return x.index_select(0, self.slot_token).view(self.count, self.size, *x.shape[1:]).transpose(1, 2)

    def from_blocks(self, x):
        """(count, heads, size, dim) -> (tokens, heads, dim)."""
        blocks = x.transpose(1, 2).reshape(self.count * self.size, x.shape[1], x.shape[3])
        return blocks.index_select(0, self.token_slot)


class _BlockAttention(torch.autograd.Function):
    """Attention of q, k, v (tokens, heads, dim) as SampleBlocks: one call of the fused op, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, softmax_scale):
        heads, kv_heads = q.shape[1], k.shape[1]
        q, k, v = blocks.to_blocks(q), blocks.to_blocks(_repeat_kv(k, heads)), blocks.to_blocks(_repeat_kv(v, heads))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=blocks.mask(q), scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.softmax_scale, ctx.kv_heads = blocks, softmax_scale, kv_heads
        return blocks.from_blocks(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks = ctx.blocks
        gradients = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            blocks.to_blocks(dout), q, k, v, out, lse, 0.0, False, attn_mask=blocks.mask(q), scale=ctx.softmax_scale)
        dq, dk, dv = (blocks.from_blocks(g) for g in gradients)
        heads = dq.shape[1]
        if ctx.kv_heads != heads:
            dk, dv = (d.view(d.shape[0], ctx.kv_heads, heads // ctx.kv_heads, -1).sum(2) for d in (dk, dv))
        return dq, dk, dv, None, None


# What one more fused call costs, in attention scores (query x key pairs) of one head-dim computed forward and
# backward in the same time: ~0.15 ms a call against ~18 ns a score of the 8.5M Llama's 4 x 64 head-dims
# (benchmarks/bench_attention.py), so SampleBlocks while their extra scores cost less
# than the groups' calls.
CALL_COST_IN_SCORES = 2_000_000
_last_batch = {}


def batch_plan(position_ids, head_dims):
    """SampleBlocks or SampleGroups for a batch's rows, whichever is cheaper by CALL_COST_IN_SCORES (heads x
    head_dim = `head_dims`); built at its first layer and reused by the others (transformers hands every
    layer the same position_ids tensor)."""

    def build(position_ids):
        cu_seqlens_q, key_index, cu_seqlens_k = attention_segments(position_ids)  # raises on a bad branch
        blocks = SampleBlocks(position_ids.reshape(-1))
        shapes = [(cu_seqlens_q[i + 1] - cu_seqlens_q[i], cu_seqlens_k[i + 1] - cu_seqlens_k[i])
                  for i in range(len(cu_seqlens_q) - 1)]
        group_scores = sum(lq * lk for lq, lk in shapes)
        call_cost = CALL_COST_IN_SCORES / head_dims
        calls = len({shape for shape in shapes if shape[0] > 0})  # SampleGroups: one call per (lq, lk)
        if blocks.count * blocks.size**2 + call_cost <= group_scores + call_cost * calls:
            return blocks
        return SampleGroups(cu_seqlens_q, cu_seqlens_k, position_ids.device, key_index)

    return _plan_for(position_ids, "cpu_fused", build)


class VarlenPlan:
    """A batch's packed-row arguments for torch's varlen kernel, built once per batch (every layer reuses them):
    cu_seqlens of queries and keys (int32 on the device), the longest of each, and the key index of branches
    (attention_segments)."""

    def __init__(self, position_ids):
        cu_q, self.key_index, cu_k = attention_segments(position_ids)
        device = position_ids.device
        self.cu_q = torch.tensor(cu_q, dtype=torch.int32, device=device)
        self.cu_k = self.cu_q if cu_k is cu_q else torch.tensor(cu_k, dtype=torch.int32, device=device)
        self.max_q = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
        self.max_k = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))


def packed_kernel(device_type, dtype, torch_varlen_available):
    """The kernel varlen_sdpa runs for packed rows: 'torch_varlen' (torch.nn.attention.varlen.varlen_attn, the
    flash kernels bundled with torch's CUDA build: bf16 / fp16 on CUDA), 'sdpa_groups' (per-sample
    scaled_dot_product_attention on any other device or dtype, fp32 on CUDA included) or 'cpu_fused' (this
    module's CPU kernel). A pure function of the facts it names, so a CPU test pins what a CUDA run does."""
    if device_type == "cpu":
        return "cpu_fused"
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and torch_varlen_available:
        return "torch_varlen"
    return "sdpa_groups"


def torch_varlen_kwargs(parameters, heads, kv_heads):
    """Keyword arguments of torch's varlen_attn for causal attention with `heads` query and `kv_heads` key heads,
    given its parameter names: torch 2.10 takes is_causal, later versions window_size=(-1, 0); enable_gqa where it
    exists. Returns (kwargs, repeat_kv): repeat_kv when grouped heads must be repeated before the call."""
    kwargs = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    grouped = kv_heads != heads
    if grouped and "enable_gqa" in parameters:
        kwargs["enable_gqa"] = True
    return kwargs, grouped and "enable_gqa" not in parameters


def _torch_varlen_parameters():
    """The parameter names of torch's varlen_attn (torch >= 2.10), or None where it does not exist."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    import inspect

    return tuple(inspect.signature(varlen_attn).parameters)


def torch_varlen_attention(q, k, v, plan, scale):
    """Causal attention of q (tokens, heads, dim), k, v (tokens, kv heads, dim) within each sample of `plan` (a
    VarlenPlan) through torch.nn.attention.varlen.varlen_attn (forward and backward: the flash kernels bundled
    with torch's CUDA build). Branches attend to their root's prefix: their keys are gathered, and the kernel
    aligns a shorter query block bottom-right, as flash-attention does."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs, repeat = torch_varlen_kwargs(_torch_varlen_parameters(), q.shape[1], k.shape[1])
    if plan.key_index is not None:
        k, v = k.index_select(0, plan.key_index), v.index_select(0, plan.key_index)
    if repeat:
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    return varlen_attn(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scale, **kwargs)


def grouped_sdpa(q, k, v, groups, scale):
    """Causal attention within each sample through torch's scaled_dot_product_attention, one call per group of
    `groups` (a SampleGroups), differentiated by autograd: the packed-row kernel on devices and dtypes torch's
    varlen kernel does not take (fp32 on CUDA)."""
    import torch.nn.functional as F

    heads = q.shape[1]
    outs = []
    for (n, lq, lk), gq, gk, gv in zip(groups.shapes, _views(groups.order_q(q), groups, 1, heads),
                                       _views(_repeat_kv(groups.order_k(k), heads), groups, 2, heads),
                                       _views(_repeat_kv(groups.order_k(v), heads), groups, 2, heads)):
        mask = groups.mask(lq, lk, q) if lq != lk else None
        o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask, is_causal=lq == lk, scale=scale)
        outs.append(o.transpose(1, 2).reshape(n * lq, heads, -1))
    return groups.restore_q(torch.cat(outs))


def _plan_for(position_ids, kind, build):
    """build(position_ids), made at a batch's first layer and reused by the others (transformers hands every layer
    the same position_ids tensor); `kind` names the kernel it is for."""
    if (_last_batch.get("position_ids") is not position_ids or _last_batch["version"] != position_ids._version
            or _last_batch["kind"] != kind):
        _last_batch.update(position_ids=position_ids, version=position_ids._version, kind=kind,
                           plan=build(position_ids))
    return _last_batch["plan"]


def _groups(position_ids):
    cu_q, key_index, cu_k = attention_segments(position_ids)
    return SampleGroups(cu_q, cu_k, position_ids.device, key_index)


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
    kernel = packed_kernel(q.device.type, dtype, _TORCH_VARLEN)
    if kernel == "torch_varlen":
        out = torch_varlen_attention(q, k, v, _plan_for(position_ids, kernel, VarlenPlan), scale)
        return out.view(batch, length, heads, dim), None
    if kernel == "sdpa_groups":
        out = grouped_sdpa(q, k, v, _plan_for(position_ids, kernel, _groups), scale)
        return out.view(batch, length, heads, dim), None
    plan = batch_plan(position_ids, heads * dim)
    attend = _BlockAttention if isinstance(plan, SampleBlocks) else _VarlenAttention
    out = attend.apply(q, k, v, plan, scale)
    return out.view(batch, length, heads, dim), None


_TORCH_VARLEN = _torch_varlen_parameters() is not None
AttentionInterface.register(NAME, varlen_attention_forward)


def default_attn_implementation():
    """varlen_sdpa on every device: it attends within each packed sample, with torch's flash kernels on CUDA in
    bf16 / fp16, per-sample sdpa otherwise on CUDA, the fused CPU kernel on CPU (packed_kernel)."""
    return NAME
