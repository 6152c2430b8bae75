"""Packing: variable-length samples in rows with `position_ids` restarting at 0 per sample and no
attention mask. With a per-sample kernel (varlen_sdpa: torch's varlen flash kernels on CUDA, its own on CPU) a
micro-batch is one row; with masked attention (sdpa, eager) samples are bin-packed into bounded rows.
Plus the padded layout kept for comparison; common.logprobs forwards either.

A sample is a dict with `input_ids` (list of ints) and `loss_mask` (list of 0/1: 1 where the token
is a target whose log-prob counts).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kernels import VARLEN_SDPA
from common.kernels.bins import pack_sequences


def unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine and / or a peft wrapper (the reward and value heads take
    either)."""
    model = getattr(model, "module", model)  # DeepSpeed engine
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft


def one_row_per_batch(attn_implementation=None):
    """Whether a micro-batch packs as one row: kernels that attend within each packed sample
    (flash-attention's varlen, common.kernels.varlen_attention's varlen_sdpa) do Σ lᵢ² work on any row
    length, so one row needs no padding; masked attention (sdpa, eager) does L², so rows stay short.
    None is the default kernel, varlen_sdpa on every device."""
    name = attn_implementation or VARLEN_SDPA
    return name.startswith("flash") or name == VARLEN_SDPA


@dataclass(frozen=True)
class Layout:
    """How one model's micro-batches become rows (common.infra.engine.load_causal_lm keeps it in the model's
    common.logprobs.ModelSettings; a script's make_batch passes it to collate)."""
    one_row: bool
    """One padding-free row per micro-batch: a per-sample attention kernel (one_row_per_batch) or a ring."""
    share_prefixes: bool
    """Samples with a common prompt may lay it out once (collate's share_prefixes): the varlen_sdpa kernel reads
    branches from the positions; never with a ring."""


def batch_layout(attn_implementation, ring=None):
    """The Layout for a model loaded with `attn_implementation`, split over `ring` or not."""
    return Layout(one_row=ring is not None or one_row_per_batch(attn_implementation),
                  share_prefixes=ring is None and attn_implementation == VARLEN_SDPA)


def collate(samples, pad_token_id, packing=True, max_tokens=None, one_row=False, share_prefixes=False):
    """Batch samples as tensors of shape (rows, length).

    packing=True: bin-packed rows of at most `max_tokens` (one row for all with `one_row`, as
    per-sample kernels want), no attention mask. packing=False: one right-padded
    sample per row with an attention mask. Either way `sample_index` maps each token to its
    sample (-1 on padding) and `spans[i] = (row, start, length)` locates sample i.

    share_prefixes (one row; for common.kernels.varlen_attention's kernel, which reads branches from the
    positions): a sample with `prefix_of` j and `prefix_len` s, whose first s tokens are sample j's, is
    laid out right after sample j without them, its positions starting at s (a branch). Its span holds
    its own tokens only, and `branch_starts` lists (row, token, source) where the logits predicting a
    branch's first token sit (its root's token s - 1) for common.logprobs.token_logps.
    """
    shared = [s.get("prefix_len", 0) if share_prefixes else 0 for s in samples]
    if share_prefixes:
        if not (packing and one_row):
            raise ValueError("share_prefixes needs one packed row per micro-batch")
        for i, s in enumerate(samples):
            j = s.get("prefix_of")
            if shared[i] and (shared[j] or s["input_ids"][: shared[i]] != samples[j]["input_ids"][: shared[i]]
                              or shared[i] >= len(s["input_ids"])):
                raise ValueError(f"sample {i} does not extend the first {shared[i]} tokens of sample {j}, a root")
    lengths = [len(s["input_ids"]) - n for s, n in zip(samples, shared)]
    if packing and one_row:
        branches = {}
        for i, s in enumerate(samples):
            if shared[i]:
                branches.setdefault(s["prefix_of"], []).append(i)
        rows = [[k for i in range(len(samples)) if not shared[i] for k in [i, *branches.get(i, [])]]]
    elif packing:
        rows = pack_sequences(lengths, max_tokens or max(lengths))
    else:
        rows = [[i] for i in range(len(samples))]
    width = max(sum(lengths[i] for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    sample_index = torch.full(shape, -1, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    spans, branch_starts, root_start = [None] * len(samples), [], {}
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n, skip = lengths[i], shared[i]
            input_ids[r, start : start + n] = torch.tensor(samples[i]["input_ids"][skip:])
            position_ids[r, start : start + n] = torch.arange(skip, skip + n)
            loss_mask[r, start : start + n] = torch.tensor(samples[i]["loss_mask"][skip:], dtype=torch.float32)
            if skip:  # predicted from the root's token skip - 1
                branch_starts.append((r, start, root_start[samples[i]["prefix_of"]] + skip - 1))
            else:
                loss_mask[r, start] = 0  # a sample's first token has no prediction inside the sample
                root_start[i] = start
            sample_index[r, start : start + n] = i
            attention_mask[r, start : start + n] = 1
            spans[i] = (r, start, n)
            start += n
        # the padding tail counts as one more sequence, so it never joins the last sample's attention
        position_ids[r, start:] = torch.arange(width - start)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": None if packing else attention_mask,
        "loss_mask": loss_mask,
        "sample_index": sample_index,
        "spans": spans,
        "num_samples": len(samples),
        "branch_starts": branch_starts,
    }


def to_device(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def per_sample_sum(values, batch):
    """Sum token values (already masked as wanted) per sample, in the order samples were given."""
    index = batch["sample_index"]
    keep = index >= 0
    out = torch.zeros(batch["num_samples"], dtype=values.dtype, device=values.device)
    return out.index_add(0, index[keep], values[keep])


def unpack(values, batch):
    """Per-sample token tensors, in the order samples were given."""
    return [values[r, s : s + n] for r, s, n in batch["spans"]]


def lockstep_shard(n):
    """This rank's items of 0..n-1 (round robin), padded with item 0 so every rank has the same
    count: under ZeRO-3 each forward gathers weights collectively, so ranks must run as many."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, n, world))
    return mine, mine + [0] * (math.ceil(n / world) - len(mine))
