"""Chunked LM head: per-token log-probs from the final hidden states and the head weight, never holding the
whole (tokens x vocab) logits.

At a real vocabulary the logits dominate a training micro-batch's memory: for 151,936 tokens of vocabulary and
an 8k-token packed row, one fp32 copy is 5 GB, and the whole-logits path keeps several (the model's logits, their
fp32 cast, the log-softmax temporaries, their gradients). Here the tokens go through the head `chunk_tokens` at a
time: each chunk's logits are computed, reduced to what the caller asked for (the target's log-prob, the
logsumexp, optionally the entropy and whether the argmax is the target) and freed; backward recomputes each
chunk's logits from the saved hidden states and weight, so the extra memory is O(chunk x vocab). The price is one
more head matmul per chunk in backward (the whole path keeps its logits instead).

The log-softmax math runs in fp32 whatever the input dtype, as the whole-logits path casts `.float()`; the head
matmul itself runs in `compute_dtype` (the autocast dtype the model's forward ran under, else the weight's).

For other losses over the whole distribution (distillation's divergences, teacher and student together), HeadLogits
and map_logit_chunks give the same memory bound: the loss is a per-chunk function of the chunk's logits, run under
torch.utils.checkpoint so backward recomputes the chunk.
"""

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class ChunkedHead(torch.autograd.Function):
    """(logp, lse, entropy, hit) per token of `hidden` (tokens, hidden) under the head `weight` (vocab, hidden)
    [+ `bias` (vocab,)]: log p(target), logsumexp of the logits, the entropy of the next-token distribution
    (empty unless `with_entropy`) and argmax == target (empty unless `with_argmax`; not differentiable), all
    float32 of shape (tokens,). Gradients flow to `hidden`, `weight` (summed over chunks) and `bias` from logp,
    lse and entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, with_entropy, with_argmax, compute_dtype):
        n = hidden.shape[0]
        device = hidden.device
        logp = torch.empty(n, dtype=torch.float32, device=device)
        lse = torch.empty(n, dtype=torch.float32, device=device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=device)
        hit = torch.empty(n if with_argmax else 0, dtype=torch.bool, device=device)
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            logits = F.linear(hidden[s:e].to(compute_dtype), w, b).float()
            t = targets[s:e]
            lse[s:e] = torch.logsumexp(logits, -1)
            logp[s:e] = logits.gather(-1, t[:, None]).squeeze(-1) - lse[s:e]
            if with_argmax:
                hit[s:e] = logits.argmax(-1) == t
            if with_entropy:  # H = lse - sum p z
                probs = logits.sub(lse[s:e, None]).exp_()
                entropy[s:e] = lse[s:e] - (probs * logits).sum(-1)
                del probs
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_tokens, ctx.compute_dtype, ctx.with_entropy = chunk_tokens, compute_dtype, with_entropy
        ctx.mark_non_differentiable(hit)
        return logp, lse, entropy, hit

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_entropy, _g_hit):
        """dz = onehot(t) g_logp + p (g_lse - g_logp - g_H (log p + H)) per chunk's logits z, p = softmax(z)."""
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        chunk, dtype = ctx.chunk_tokens, ctx.compute_dtype
        n = hidden.shape[0]
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        g_logp = zeros if g_logp is None else g_logp.float()
        g_lse = zeros if g_lse is None else g_lse.float()
        g_entropy = None if (g_entropy is None or not ctx.with_entropy) else g_entropy.float()
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e].to(dtype)
            z = F.linear(h, w, b).float()
            t = targets[s:e]
            coef = g_lse[s:e] - g_logp[s:e]
            z.sub_(lse[s:e, None])  # log p
            if g_entropy is not None:
                dz = z.add(entropy[s:e, None]).mul_(-g_entropy[s:e, None]).add_(coef[:, None])
                dz.mul_(z.exp_())
                del z
            else:
                dz = z.exp_().mul_(coef[:, None])
            dz[torch.arange(e - s, device=dz.device), t] += g_logp[s:e]
            dz = dz.to(dtype)
            if need_h:
                grad_h[s:e] = (dz @ w).to(hidden.dtype)
            if need_w:
                if dtype == torch.float32:
                    grad_w.addmm_(dz.T, h)
                else:
                    grad_w += dz.T @ h
            if need_b:
                grad_b += dz.float().sum(0)
            del dz
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_head(hidden, weight, targets, chunk_tokens, bias=None, with_entropy=False, with_argmax=False,
                 compute_dtype=None):
    """ChunkedHead over `hidden` (tokens, hidden) predicting `targets` (tokens,): returns a dict with `logp`,
    `lse` and, as asked, `entropy` and `hit`, each float32 (hit: bool) of shape (tokens,). `compute_dtype` is
    the head matmul's dtype (default: the weight's)."""
    logp, lse, entropy, hit = ChunkedHead.apply(
        hidden, weight, bias, targets, int(chunk_tokens), bool(with_entropy), bool(with_argmax),
        compute_dtype or weight.dtype,
    )
    out = {"logp": logp, "lse": lse}
    if with_entropy:
        out["entropy"] = entropy
    if with_argmax:
        out["hit"] = hit
    return out


# Causal LMs whose logits are exactly `lm_head(final hidden states)` (no scaling or soft-capping) and whose
# forward takes `logits_to_keep`; tested chunked = whole in tests/test_chunked_head.py.
CHUNKED_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2")


def head_chunk_tokens(model):
    """Tokens per chunk of the LM head for `model` (bare, in a DeepSpeed engine and / or a peft wrapper): the
    `logps_chunk_tokens` attribute common.infra.engine.load_causal_lm sets from --logps_chunk_tokens, or 0 (whole
    logits) where it is unset or the chunked head does not apply: a model type outside CHUNKED_HEAD_MODEL_TYPES,
    a head that is not a plain nn.Linear (LoRA or modules_to_save on lm_head, a quantised head), or ZeRO-3 (a
    partitioned head weight would have to be gathered in forward and again in backward, outside DeepSpeed's
    module hooks that route its gradient to the partition)."""
    from common.infra.engine import unwrap

    hf = unwrap(model)
    chunk = getattr(hf, "logps_chunk_tokens", 0)
    head = getattr(hf, "lm_head", None)
    if not chunk or getattr(hf.config, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES:
        return 0
    if type(head) is not torch.nn.Linear or hasattr(head.weight, "ds_id"):
        return 0
    return chunk


class HeadOutputs:
    """A model's outputs on the chunked-head path: the model's own fields (aux_loss, ...) read through, and
    `logits` (rows, width, vocab) computed on first read as the head of the final hidden states, in the dtype
    the head ran in."""

    def __init__(self, outputs, hidden, head, dtype):
        self._outputs, self._hidden, self._head, self._dtype, self._logits = outputs, hidden, head, dtype, None

    def __getattr__(self, name):
        return getattr(self._outputs, name)

    @property
    def logits(self):
        if self._logits is None:
            bias = None if self._head.bias is None else self._head.bias.to(self._dtype)
            self._logits = F.linear(self._hidden.to(self._dtype), self._head.weight.to(self._dtype), bias)
        return self._logits


def chunked_token_logps(model, batch, chunk, return_argmax, return_entropy):
    """token_logps through common.kernels.chunked_head. The model itself is called (a DeepSpeed engine keeps its
    autocast and hooks, peft its adapters) with an empty `logits_to_keep`, so it computes no logits; a forward
    hook on its base model keeps the final hidden states and the autocast dtype they were made under."""
    from common.infra.engine import unwrap

    hf = unwrap(model)
    head, kept = hf.lm_head, {}

    def keep(module, args, out):
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        kind = hidden.device.type
        kept["hidden"] = hidden
        kept["dtype"] = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else head.weight.dtype

    input_ids = batch["input_ids"]
    handle = getattr(hf, hf.base_model_prefix).register_forward_hook(keep)
    try:
        outputs = model(
            input_ids=input_ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
            use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
        )
    finally:
        handle.remove()
    hidden = kept["hidden"]
    rows, width = input_ids.shape
    flat, targets = hidden[:, :-1].reshape(-1, hidden.shape[-1]), input_ids[:, 1:].reshape(-1)
    if batch.get("branch_starts"):  # a branch's first token is predicted from its root's token s - 1
        b_rows, b_tokens, b_sources = torch.tensor(batch["branch_starts"], device=input_ids.device).unbind(1)
        flat = torch.cat([flat, hidden[b_rows, b_sources]])
        targets = torch.cat([targets, input_ids[b_rows, b_tokens]])
    out = chunked_head(flat, head.weight, targets, chunk, bias=head.bias, with_entropy=return_entropy,
                       with_argmax=return_argmax, compute_dtype=kept["dtype"])
    n = rows * (width - 1)

    def layout(values):  # (rows, width): column t about token t, branch first tokens from their sources
        full = F.pad(values[:n].view(rows, width - 1), (1, 0))
        return full.index_put((b_rows, b_tokens), values[n:]) if len(values) > n else full

    starts = batch["position_ids"] == 0
    logps = layout(out["logp"]).masked_fill(starts, 0.0)
    outputs = HeadOutputs(outputs, hidden, head, kept["dtype"])
    if return_entropy:
        outputs.entropy = layout(out["entropy"])
    if return_argmax:
        return logps, outputs, layout(out["hit"]) & ~starts
    return logps, outputs


# ----------------------------------------------------------------------------------------------
# Logits made a chunk at a time for losses other than token_logps' (distillation's divergences)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HeadLogits:
    """An LM head's logits of chosen tokens, never made whole: `logits[s:e]` computes tokens s..e-1's (e - s, vocab)
    float32 logits from their final hidden states and the head; map_logit_chunks visits them `chunk_tokens` at a
    time. It stands where a (tokens, vocab) logits tensor would."""

    hidden: torch.Tensor  # (tokens, hidden width): the final hidden states that predict them
    weight: torch.Tensor  # (vocab, hidden width)
    bias: Optional[torch.Tensor]
    dtype: torch.dtype  # of the head matmul: the autocast dtype the model's forward ran under, else the weight's
    chunk_tokens: int

    def __len__(self):
        return self.hidden.shape[0]

    def __getitem__(self, tokens: slice):
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return F.linear(self.hidden[tokens].to(self.dtype), self.weight.to(self.dtype), bias).float()

    def detach(self):
        return dataclasses.replace(self, hidden=self.hidden.detach(), weight=self.weight.detach(),
                                   bias=None if self.bias is None else self.bias.detach())


def head_logits_at(model, batch, rows, cols):
    """HeadLogits of `model` (bare, in a DeepSpeed engine and / or a peft wrapper; head_chunk_tokens(model) > 0) at
    positions (rows, cols) of a collated batch, in chunks of head_chunk_tokens(model). The model is called with an
    empty `logits_to_keep`, so it computes no logits; a forward hook on its base model keeps the final hidden states
    and the autocast dtype they were made under."""
    from common.infra.engine import unwrap

    hf = unwrap(model)
    head, kept = hf.lm_head, {}

    def keep(module, args, out):
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        kind = hidden.device.type
        kept["hidden"] = hidden
        kept["dtype"] = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else head.weight.dtype

    input_ids = batch["input_ids"]
    handle = getattr(hf, hf.base_model_prefix).register_forward_hook(keep)
    try:
        model(input_ids=input_ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
              use_cache=False, logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    finally:
        handle.remove()
    return HeadLogits(kept["hidden"][rows, cols], head.weight, head.bias, kept["dtype"], head_chunk_tokens(model))


def map_logit_chunks(logits, fn):
    """fn over the tokens of `logits`, concatenated: fn(chunk, s, e) takes tokens s..e-1's float32 logits
    (e - s, vocab) and returns a tuple of per-token tensors (e - s, ...) or Nones (which stay None). A (tokens,
    vocab) tensor goes to fn whole; a HeadLogits goes a chunk at a time, each under torch.utils.checkpoint where
    gradients flow, so the chunk's logits and fn's temporaries are freed after forward and recomputed in backward:
    the extra memory is O(chunk x vocab), the price the head's matmul once more per chunk (and any fn makes, such as
    a live teacher's logits)."""
    if torch.is_tensor(logits):
        return tuple(fn(logits, 0, len(logits)))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (logits.hidden, logits.weight, logits.bias))
    parts = []
    for s in range(0, len(logits), logits.chunk_tokens):
        e = min(s + logits.chunk_tokens, len(logits))
        if grads:  # no randomness in a head and a loss: the RNG state need not be kept for the recompute
            parts.append(checkpoint(lambda s=s, e=e: tuple(fn(logits[s:e], s, e)), use_reentrant=False,
                                    preserve_rng_state=False))
        else:
            parts.append(tuple(fn(logits[s:e], s, e)))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
