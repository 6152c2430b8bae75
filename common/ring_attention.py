"""Ring attention (context parallelism, OpenRLHF's --ring_attn_size / --ring_head_stride): the ranks of a ring
share one packed row, each keeps a contiguous slice of its tokens, and attention all-gathers keys / values over
the ring: ring-flash-attn 0.1.8's `llama3_flash_attn_varlen_func`, registered with transformers under NAME (no
"flash" in it: transformers treats such names as flash-attention builds). On CUDA it runs over flash-attn when
installed, else over torch's own flash kernels (bf16 / fp16); on CPU over common.kernels.varlen_attention's kernels;
both stand-ins are shown to ring-flash-attn as flash_attn only while it imports.

Opt-in: imported only where --ring_attn_size > 1 (by common.logprobs, common.infra.engine, common.infra.rings and
common.infra.reward, in the branch that has a ring); it imports only the kernels.

`ring_token_logps` pads a one-row micro-batch to a multiple of the ring size, forwards this rank's slice with its
global position ids (next-token targets taken before the split; sample boundaries passed as the `ring_params`
call keyword) and all-gathers the log-probs with an autograd all-gather: it returns what
`common.logprobs.token_logps` returns for the whole row, through the chunked LM head (common.kernels.chunked_head)
where token_logps would take it (the slice's tokens through the head, their targets from the whole row).
DeepSpeed counts every rank as data-parallel, so it gets `train_batch_size x ring size`; a loss normalised by a
token count all-reduced over the world needs no change (the gather's backward sums ring-size equal copies of each
gradient, which that count cancels).
"""

import sys
import types
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from common.kernels.chunked_head import HeadLogits, forward_without_logits, head_token_values
from common.kernels.varlen_attention import cu_seqlens_from_position_ids, varlen_attention_forward, varlen_backward
from common.kernels.varlen_attention import varlen_forward

NAME = "ring_attention"


# ----------------------------------------------------------------------------------------------
# ring-flash-attn over flash-attn's kernels (CUDA) or common.kernels.varlen_attention's (CPU)
# ----------------------------------------------------------------------------------------------
def _unsupported(dropout_p, window_left, window_right, softcap, alibi_slopes):
    if dropout_p or (window_left, window_right) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the CPU ring kernel has no dropout, sliding window, softcap or ALiBi")


def _cpu_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                        causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                        return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False):
    """flash-attn 2.8's `_flash_attn_varlen_forward` contract over varlen_forward: (out, lse, None, None)."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    out, lse = varlen_forward(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), softmax_scale, causal)
    return out, lse, None, None


def _cpu_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                         softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None, zero_tensors=False):
    """flash-attn 2.8's `_flash_attn_varlen_backward` contract: writes the gradients into dq, dk, dv (views
    into ring-flash-attn's buffers)."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    grads = varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(),
                            softmax_scale, causal)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)


def _torch_flash_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                seqused_k=None, zero_tensors=False):
    """flash-attn 2.8's `_flash_attn_varlen_forward` contract over torch's own flash kernel (CUDA, bf16 / fp16:
    the op torch.nn.attention.varlen.varlen_attn calls): (out, lse (heads, total_q), None, None)."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q.int(), cu_seqlens_k.int(), max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=softmax_scale)
    return out, lse, None, None


def _torch_flash_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                 window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                 rng_state=None, zero_tensors=False):
    """flash-attn 2.8's `_flash_attn_varlen_backward` contract over torch's own flash kernel: writes the
    gradients into dq, dk, dv."""
    _unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device)
    grads = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q.int(), cu_seqlens_k.int(), max_seqlen_q, max_seqlen_k, 0.0,
        causal, no_dropout, torch.empty(0, device=q.device), scale=softmax_scale)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)


def ring_kernel(device_type, dtype, flash_attn_installed):
    """What ring-flash-attn runs over: 'flash_attn' (installed, CUDA, bf16 / fp16), 'torch_flash' (torch's
    aten flash ops, CUDA, bf16 / fp16) or 'cpu' (common.kernels.varlen_attention's kernels); ValueError for fp32
    on CUDA, which neither flash kernel takes. A pure function of the facts it names, so a CPU test pins what a
    CUDA run does."""
    if device_type == "cpu":
        return "cpu"
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--ring_attn_size > 1 on CUDA runs flash kernels, which take bf16 / fp16, not "
                         f"{str(dtype).split('.')[-1]}: set --param_dtype bf16")
    return "flash_attn" if flash_attn_installed else "torch_flash"


def _by_device(cpu, cuda):
    """One function of flash-attn's contract that runs `cpu` on CPU tensors and `cuda` on CUDA tensors (read off
    its first argument, q or dout, passed by position or by name)."""
    def kernel(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        return (cuda if first.is_cuda else cpu)(*args, **kwargs)
    return kernel


def _no_dense_kernel(*args, **kwargs):
    raise NotImplementedError("only the varlen kernels exist on CPU (ring-flash-attn's llama3 varlen path)")


@cache
def import_ring_flash_attn():
    """ring_flash_attn's `llama3_flash_attn_varlen_func` and `llama3_flash_attn_prepare_cu_seqlens`, imported
    over the real flash_attn when it imports, else over a stand-in (in sys.modules only during the import) whose
    kernels are torch's own flash kernels for CUDA tensors and common.kernels.varlen_attention's for CPU tensors."""
    import transformers.modeling_flash_attention_utils as mfa
    import transformers.modeling_utils  # noqa: F401  (transformers probes flash_attn before the stand-in exists)

    if not hasattr(mfa, "is_flash_attn_greater_or_equal_2_10"):  # ring-flash-attn 0.1.8 imports it from there
        from transformers import utils

        mfa.is_flash_attn_greater_or_equal_2_10 = getattr(utils, "is_flash_attn_greater_or_equal_2_10", lambda: True)
    try:
        import flash_attn  # noqa: F401

        stand_in = None
    except ImportError:
        package, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
        interface._flash_attn_varlen_forward = _by_device(_cpu_varlen_forward, _torch_flash_varlen_forward)
        interface._flash_attn_varlen_backward = _by_device(_cpu_varlen_backward, _torch_flash_varlen_backward)
        interface._flash_attn_forward = interface._flash_attn_backward = _no_dense_kernel
        package.flash_attn_interface = interface
        stand_in = {"flash_attn": package, "flash_attn.flash_attn_interface": interface}
        sys.modules.update(stand_in)
    try:
        from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
    finally:
        for name in stand_in or ():
            del sys.modules[name]
    return llama3_flash_attn_varlen_func, llama3_flash_attn_prepare_cu_seqlens


# ----------------------------------------------------------------------------------------------
# Rings of ranks and the model check
# ----------------------------------------------------------------------------------------------
@dataclass
class Ring:
    size: int
    """Ranks in this ring."""
    rank: int
    """This rank's place in its ring (which slice of each row it keeps)."""
    group: object
    """The ring's process group."""
    head_stride: int
    """KV heads gathered per step."""
    dp_rank: int
    """Index of this ring among the data-parallel replicas."""
    dp_world: int
    """Number of rings (data-parallel size)."""


def setup_ring(ring):
    """The rings of consecutive ranks for `ring` (common.infra.rings.RingArgs; every rank creates every group, in
    the same order); None with --ring_attn_size 1."""
    if ring.ring_attn_size == 1:
        return None
    rank, world, n = dist.get_rank(), dist.get_world_size(), ring.ring_attn_size
    mine = None
    for first in range(0, world, n):
        group = dist.new_group(list(range(first, first + n)))
        if first <= rank < first + n:
            mine = group
    return Ring(size=n, rank=rank % n, group=mine, head_stride=ring.ring_head_stride, dp_rank=rank // n,
                dp_world=world // n)


def check_ring_args(model=None, data=None):
    """The checks of --ring_attn_size > 1 against the model's and the data's option groups
    (common.infra.engine.ModelArgs, common.data.DataArgs) that need no model: ValueError naming the flag."""
    if data is not None and not data.packing_samples:
        raise ValueError("--ring_attn_size > 1 splits one packed row per micro-batch: drop --no_packing_samples")
    if data is not None and data.pack_max_tokens:
        raise ValueError("--pack_max_tokens does not apply with --ring_attn_size > 1 (each micro-batch is one row, "
                         "split over the ring: size it with --micro_train_batch_size)")
    if model is not None:
        if model.attn_implementation not in (None, NAME):
            raise ValueError(f"--attn_implementation {model.attn_implementation} cannot run with --ring_attn_size > 1 "
                             f"(the ring is the attention implementation {NAME!r}): drop --attn_implementation")
        if model.aux_loss_coef > 0:
            raise ValueError("--aux_loss_coef with --ring_attn_size > 1 is not supported (the router loss would be "
                             "averaged over slices, not over the row)")


def check_ring_model(model, ring):
    """Raise ValueError (naming the flags) for a model the ring cannot run exactly."""
    if ring is None:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = base.config.model_type
    if base.config._attn_implementation != NAME:
        raise ValueError(f"--ring_attn_size needs the model loaded with attn_implementation={NAME!r}, "
                         f"not {base.config._attn_implementation!r} (drop --attn_implementation)")
    if not type(base).is_backend_compatible():
        raise ValueError(f"--ring_attn_size: {kind} models do not route their attention through transformers' "
                         "attention registry, so the ring cannot run them")
    if not base.supports_context_parallel:
        raise ValueError(f"--ring_attn_size: {kind} uses sliding-window, chunked or recurrent layers, which a ring "
                         "of full causal attention cannot express")
    config = base.config.get_text_config()
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % ring.head_stride:
        raise ValueError(f"--ring_head_stride {ring.head_stride} must divide the model's {kv_heads} KV heads")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"--ring_attn_size: the ring kernel has no attention dropout ({kind} sets "
                         f"attention_dropout={config.attention_dropout})")


# ----------------------------------------------------------------------------------------------
# The attention implementation and the log-prob forward
# ----------------------------------------------------------------------------------------------
def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                           sliding_window=None, softcap=None, ring_params=None, **kwargs):
    """transformers attention function. With `ring_params` (this rank's slice of a packed row, batch 1):
    query (1, heads, local len, dim) -> (1, local len, heads, dim) through the ring. Without: the whole
    rows are here, and each sample attends within itself (common.kernels.varlen_attention's varlen_sdpa)."""
    if ring_params is None:  # varlen_sdpa: torch's flash kernels on CUDA, the CPU kernel on CPU
        return varlen_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                        position_ids=position_ids, sliding_window=sliding_window, softcap=softcap,
                                        **kwargs)
    if query.shape[0] != 1 or attention_mask is not None or sliding_window or softcap or (dropout and module.training):
        raise ValueError("ring attention takes one packed row, full causal attention, no mask, softcap or dropout")
    ring_fn, _ = import_ring_flash_attn()
    if query.is_cuda:  # fp32 on CUDA: neither flash kernel takes it; refused here, at the first forward
        ring_kernel("cuda", value.dtype, "flash_attn" in sys.modules)
    # under CPU autocast the rotary embedding hands back fp32 queries and keys beside bf16 values: attend in fp32
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (len, heads, dim)
    p = ring_params
    out = ring_fn(q, k, v, p["cu_seqlens_q"], p["cu_seqlens_k"], p["max_seqlen_q"], p["max_seqlen_k"],
                  p["heads_k_stride"], p["local_k_slice"], dropout_p=0.0, softmax_scale=scaling, causal=True,
                  group=p["group"])
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, ring_attention_forward)


def _gather(x, ring):
    """All-gather a per-token tensor (local len,) over the ring into (ring size x local len,); the backward
    sums each slice's gradient over the ring. (Do not .wait() the result: that drops requires_grad.)"""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(x.contiguous(), 0, ring.group)


def ring_forward(model, batch, ring, without_logits=False):
    """Forward this rank's slice of a one-row batch padded to a multiple of the ring size; returns the model
    outputs, the padded row's input ids and the slice bounds [lo, hi). `without_logits`: the model makes no
    logits and the outputs are common.kernels.chunked_head's HeadOutputs (the slice's final hidden states)."""
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if input_ids.shape[0] != 1 or batch.get("attention_mask") is not None:
        raise ValueError("--ring_attn_size: each micro-batch must be one packed row (collate(..., one_row=True))")
    pad = -input_ids.shape[1] % ring.size
    if pad:  # the pad tail is one more sample, its positions restarting at 0
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], 1)
    local = input_ids.shape[1] // ring.size
    lo, hi = ring.rank * local, (ring.rank + 1) * local
    _, prepare = import_ring_flash_attn()
    cu_seqlens = torch.tensor(cu_seqlens_from_position_ids(position_ids), dtype=torch.int32, device=input_ids.device)
    cu_q, cu_k, max_q, max_k, k_slice = prepare(cu_seqlens, True, ring.rank, ring.size)
    params = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
              "local_k_slice": k_slice, "heads_k_stride": ring.head_stride, "group": ring.group}
    inputs = dict(input_ids=input_ids[:, lo:hi], position_ids=position_ids[:, lo:hi], attention_mask=None,
                  use_cache=False, ring_params=params)
    outputs = forward_without_logits(model, **inputs) if without_logits else model(**inputs)
    return outputs, input_ids, lo, hi


def ring_next_token_values(local, batch, ring):
    """Per-position values of this rank's slice (local len,), each about the token after its position (as the
    log-prob of the next token is), all-gathered over the ring (autograd) and laid out like
    common.logprobs.token_logps: (1, width), column t about token t, 0 at each sample's first token."""
    full = _gather(local, ring)[None, : batch["input_ids"].shape[1] - 1]
    return F.pad(full, (1, 0)).masked_fill(batch["position_ids"] == 0, 0)


def ring_token_logps(model, batch, ring, chunk, return_argmax=False, return_entropy=False):
    """`common.logprobs.token_logps` for a one-row batch split over `ring`: the same (logps, outputs[, argmax])
    for the whole row on every rank of the ring (`outputs` are this rank's slice's model outputs, with
    `outputs.entropy` for the whole row when asked). Where `chunk` (common.kernels.chunked_head.head_chunk_tokens)
    is not 0 the slice's LM head runs chunked (`outputs` a HeadOutputs, the slice's logits computed on read)."""
    outputs, input_ids, lo, hi = ring_forward(model, batch, ring, without_logits=bool(chunk))
    targets = F.pad(input_ids[0], (0, 1))[lo + 1 : hi + 1]  # next tokens, taken from the whole row
    if chunk:
        values = head_token_values(outputs, outputs.final_hidden[0], targets, chunk, with_entropy=return_entropy,
                                   with_argmax=return_argmax)
    else:
        logits = outputs.logits[0].float()
        lse = torch.logsumexp(logits, -1)
        values = {"logp": logits.gather(-1, targets[:, None]).squeeze(-1) - lse}
        if return_entropy:
            slice_logps = logits.log_softmax(-1)
            values["entropy"] = -(slice_logps.exp() * slice_logps).sum(-1)
        if return_argmax:
            values["hit"] = logits.argmax(-1) == targets
    logps = ring_next_token_values(values["logp"], batch, ring)
    if return_entropy:
        outputs.entropy = ring_next_token_values(values["entropy"], batch, ring)
    if return_argmax:
        hits = ring_next_token_values(values["hit"].float(), batch, ring).detach()
        return logps, outputs, hits.bool()
    return logps, outputs


def ring_row_values(local, batch, ring):
    """Per-token values of this rank's slice (local len,), all-gathered over the ring (autograd) into the whole
    row's (width,): a value head's outputs, read at each sample's last token by common.infra.reward."""
    return _gather(local, ring)[: batch["input_ids"].shape[1]]


def ring_response_logits(model, batch, ring, chunk):
    """For a one-row batch split over `ring`: (logits, targets (N,), loss tokens per sample) of the N loss tokens
    in row order, as algos/distill.py's response_logits gives them. Each rank runs its slice; the rows that predict
    the loss tokens are all-gathered (autograd): where `chunk` (head_chunk_tokens) is not 0 their final hidden
    states, so logits is a HeadLogits that makes (chunk, V) at a time, else their float32 (N, V) logits."""
    mask, index = batch["loss_mask"][0], batch["sample_index"][0]
    cols = mask.nonzero().squeeze(1)  # one row, samples in order: row order is sample order
    outputs, input_ids, lo, hi = ring_forward(model, batch, ring, without_logits=bool(chunk))
    local = hi - lo
    owner = (cols - 1) // local  # the rank whose slice holds the position that predicts each loss token
    counts = torch.bincount(owner, minlength=ring.size).tolist()
    rows = cols[owner == ring.rank] - 1 - lo
    mine = outputs.final_hidden[0, rows] if chunk else outputs.logits[0, rows].float()
    width = max(counts)
    gathered = _gather(F.pad(mine, (0, 0, 0, width - len(mine))), ring).view(ring.size, width, -1)
    gathered = torch.cat([gathered[r, : counts[r]] for r in range(ring.size)])
    logits = HeadLogits(gathered, outputs.head, outputs.autocast_dtype, chunk) if chunk else gathered
    return logits, input_ids[0, cols], torch.bincount(index[cols], minlength=batch["num_samples"])
