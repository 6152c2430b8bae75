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
"""

import torch
import torch.nn.functional as F


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
