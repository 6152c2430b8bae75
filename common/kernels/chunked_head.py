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

Two implementations, the same numbers: ChunkedHead, an autograd function reading the head weight directly (a
plain nn.Linear head), and module_chunked_head, which calls the head *module* per chunk under
torch.utils.checkpoint, so the module's own hooks run in forward and again in backward: DeepSpeed ZeRO-3 gathers
a partitioned weight and routes its gradient to the partition, peft applies a LoRA or modules_to_save head.

forward_token_logps is what common.logprobs.token_logps runs for a batch a rank holds whole: this head where the
model type allows it, the model's whole logits elsewhere.

For other losses over the whole distribution (distillation's divergences, teacher and student together), HeadLogits
and map_logit_chunks give the same memory bound: the loss is a per-chunk function of the chunk's logits, run under
torch.utils.checkpoint so backward recomputes the chunk.
"""

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
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
            if with_entropy:  # H = -sum p log p (lse - sum p z cancels in float32 at logits of size 30-100)
                logq = torch.log_softmax(logits, -1)
                entropy[s:e] = -logq.exp().mul_(logq).sum(-1)
                del logq
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
    return requested(logp, lse, entropy, hit, with_entropy, with_argmax)


def agreed_chunks(tokens, chunk_tokens, heads, device):
    """Chunks of at most `chunk_tokens` for `tokens` tokens; where any of the head modules a chunk calls is ZeRO-3
    partitioned, the largest count any rank needs, since every call of that head gathers its weight collectively (a
    rank with fewer tokens takes smaller chunks)."""
    chunks = max(1, -(-tokens // int(chunk_tokens)))
    if dist.is_initialized() and any(hasattr(p, "ds_id") for head in heads for p in head.parameters()):
        count = torch.tensor(chunks, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        chunks = int(count)
    return chunks


def requested(logp, lse, entropy, hit, with_entropy, with_argmax):
    """The outputs dict of chunked_head: logp and lse, plus entropy and hit where asked."""
    out = {"logp": logp, "lse": lse}
    if with_entropy:
        out["entropy"] = entropy
    if with_argmax:
        out["hit"] = hit
    return out


def _head_chunk(head, hidden, targets, with_entropy, with_argmax, autocast_dtype):
    """(logp, lse, entropy, hit) of one chunk through the head module (entropy / hit empty unless asked)."""
    kind = hidden.device.type
    with torch.autocast(kind, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        logits = head(hidden).float()
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    empty = logits.new_empty(0)
    logq = torch.log_softmax(logits, -1) if with_entropy else empty  # -sum p log p: see ChunkedHead
    entropy = -(logq.exp() * logq).sum(-1) if with_entropy else empty
    hit = logits.argmax(-1) == targets if with_argmax else empty.bool()
    return logp, lse, entropy, hit


def module_chunked_head(head, hidden, targets, chunk_tokens, with_entropy=False, with_argmax=False,
                        autocast_dtype=None):
    """chunked_head's outputs through the head *module* `head`: each chunk's logits are `head(chunk)` (under
    autocast to `autocast_dtype` when given) inside torch.utils.checkpoint, so forward frees them and backward
    recomputes them one chunk at a time, the module's hooks running both times. Under ZeRO-3 every call gathers
    the head weight collectively, so the ranks agree on the number of chunks (the largest any rank needs; a rank
    with fewer tokens takes smaller chunks)."""
    chunks = agreed_chunks(hidden.shape[0], chunk_tokens, [head], hidden.device)
    parts = [checkpoint(_head_chunk, head, h, t, with_entropy, with_argmax, autocast_dtype, use_reentrant=False)
             for h, t in zip(hidden.tensor_split(chunks), targets.tensor_split(chunks))]
    logp, lse, entropy, hit = (torch.cat(values) for values in zip(*parts))
    return requested(logp, lse, entropy, hit, with_entropy, with_argmax)


# Causal LMs whose logits are exactly `lm_head(final hidden states)` (no scaling or soft-capping) and whose
# forward takes `logits_to_keep`; tested chunked = whole in tests/test_chunked_head.py.
CHUNKED_HEAD_MODEL_TYPES = ("llama", "mistral", "qwen2")


def head_chunk_tokens(model, chunk_tokens):
    """Tokens per chunk of the LM head for `model` (bare, in a DeepSpeed engine and / or a peft wrapper):
    `chunk_tokens` (--logps_chunk_tokens), or 0 (whole logits) where it is 0 or the model type is outside
    CHUNKED_HEAD_MODEL_TYPES. Any head module applies (plain, tied, LoRA or modules_to_save on lm_head, ZeRO-3
    partitioned): see uses_head_module. Except, where gradients flow, a frozen head that ZeRO-3 partitions (LoRA on
    the layers below it): checkpoint's recompute of the head module then sees the partitioned weight, not the
    gathered one, and refuses."""
    hf = hf_model(model)
    if not chunk_tokens or getattr(hf.config, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES:
        return 0
    head = getattr(hf, "lm_head", None)
    if torch.is_grad_enabled() and head is not None and any(
            hasattr(p, "ds_id") and not p.requires_grad for p in head.parameters()):
        return 0
    return chunk_tokens


def uses_head_module(head):
    """Whether the chunked head must call the head module (module_chunked_head) rather than read its weight
    (ChunkedHead, whose backward recomputes only each chunk's matmul, not an autograd graph of the log-softmax): a
    head that is not a plain nn.Linear (a peft wrapper), or one whose weight DeepSpeed ZeRO-3 partitions
    (`ds_id`)."""
    return type(head) is not torch.nn.Linear or any(hasattr(p, "ds_id") for p in head.parameters())


def hf_model(model):
    """The Hugging Face model inside a DeepSpeed engine and / or a peft wrapper (as common.packing.unwrap: this
    kernel imports nothing of the project)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class HeadOutputs:
    """A model's outputs on the chunked-head path: the model's own fields (aux_loss, ...) read through,
    `final_hidden` (rows, width, hidden), `head` (the LM head module), `autocast_dtype` (the autocast dtype the
    forward ran under, or None), and `logits` (rows, width, vocab) computed on first read as `head(final_hidden)`
    under that autocast (under ZeRO-3 a collective gather of the head: every rank must read them)."""

    def __init__(self, outputs, final_hidden, head, autocast_dtype):
        self._outputs, self.final_hidden, self.head, self.autocast_dtype = outputs, final_hidden, head, autocast_dtype
        self._logits = None

    def __getattr__(self, name):
        return getattr(self._outputs, name)

    @property
    def logits(self):
        if self._logits is None:
            kind, dtype = self.final_hidden.device.type, self.autocast_dtype
            with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
                self._logits = self.head(self.final_hidden)
        return self._logits


def forward_without_logits(model, **inputs):
    """Call `model` (a DeepSpeed engine keeps its autocast and hooks, peft its adapters) on `inputs` with an
    empty `logits_to_keep`, so it computes no logits; returns a HeadOutputs over the final hidden states, which a
    forward hook on the base model keeps with the autocast dtype they were made under."""
    hf = hf_model(model)
    kept = {}

    def keep(module, args, out):
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        kind = hidden.device.type
        kept["hidden"] = hidden
        kept["autocast"] = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None

    device = inputs["input_ids"].device
    handle = getattr(hf, hf.base_model_prefix).register_forward_hook(keep)
    try:
        outputs = model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    return HeadOutputs(outputs, kept["hidden"], hf.lm_head, kept["autocast"])


def head_token_values(outputs, hidden, targets, chunk, with_entropy=False, with_argmax=False):
    """The chunked head of `outputs` (a HeadOutputs) over `hidden` (tokens, hidden) predicting `targets`
    (tokens,): chunked_head's dict (logp, lse, and as asked entropy and hit), through ChunkedHead for a plain
    head and module_chunked_head where uses_head_module."""
    head, autocast = outputs.head, outputs.autocast_dtype
    if uses_head_module(head):
        return module_chunked_head(head, hidden, targets, chunk, with_entropy=with_entropy, with_argmax=with_argmax,
                                   autocast_dtype=autocast)
    return chunked_head(hidden, head.weight, targets, chunk, bias=head.bias, with_entropy=with_entropy,
                        with_argmax=with_argmax, compute_dtype=autocast or head.weight.dtype)


def forward_token_logps(model, batch, chunk_tokens, return_argmax=False, return_entropy=False):
    """common.logprobs.token_logps of a batch each rank holds whole: through the chunked head where `chunk_tokens`
    (head_chunk_tokens) is not 0 (chunked_token_logps: `outputs` is a HeadOutputs whose fields are the model's
    (aux_loss, ...) and whose `logits` are computed on first read from the kept final hidden states), else from the
    model's whole logits."""
    if chunk_tokens:
        return chunked_token_logps(model, batch, chunk_tokens, return_argmax, return_entropy)
    outputs = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
        use_cache=False,  # with the cache on, packed rows are silently attended as one sequence
    )
    logits = outputs.logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    starts = batch["position_ids"] == 0  # a sample's first token is not predicted from inside the sample
    logps = F.pad(logps, (1, 0)).masked_fill(starts, 0.0)
    hits = F.pad(logits.argmax(-1) == targets, (1, 0)) & ~starts if return_argmax else None
    if return_entropy:
        outputs.entropy = F.pad(_entropy(logits), (1, 0))
    branches = branch_source_logits(outputs.logits, batch)
    if branches is not None:  # a shared-prefix branch's first token: predicted from its root's prefix
        rows, tokens, source_logits = branches
        branch_targets = batch["input_ids"][rows, tokens]
        values = source_logits.gather(-1, branch_targets[:, None]).squeeze(-1) - torch.logsumexp(source_logits, -1)
        logps = logps.index_put((rows, tokens), values)
        if return_argmax:
            hits = hits.index_put((rows, tokens), source_logits.argmax(-1) == branch_targets)
        if return_entropy:
            outputs.entropy = outputs.entropy.index_put((rows, tokens), _entropy(source_logits))
    return (logps, outputs, hits) if return_argmax else (logps, outputs)


def _entropy(logits):
    logps = logits.float().log_softmax(-1)
    return -(logps.exp() * logps).sum(-1)


def branch_source_logits(logits, batch):
    """(rows, tokens, logits (n, vocab) in float32) for the first token of each shared-prefix branch of the
    batch (common.packing.collate's share_prefixes), whose prediction sits at its root's token s - 1 rather than at the
    token before it in the row; None without branches."""
    if not batch.get("branch_starts"):
        return None
    rows, tokens, sources = torch.tensor(batch["branch_starts"], device=logits.device).unbind(1)
    return rows, tokens, logits[rows, sources].float()


def chunked_token_logps(model, batch, chunk, return_argmax, return_entropy):
    """forward_token_logps through the chunked head: the model's forward makes no logits (forward_without_logits), and
    head_token_values runs over the row's predictions, shared-prefix branches' first tokens included."""
    input_ids = batch["input_ids"]
    outputs = forward_without_logits(model, input_ids=input_ids, attention_mask=batch["attention_mask"],
                                     position_ids=batch["position_ids"], use_cache=False)
    hidden = outputs.final_hidden
    rows, width = input_ids.shape
    flat, targets = hidden[:, :-1].reshape(-1, hidden.shape[-1]), input_ids[:, 1:].reshape(-1)
    if batch.get("branch_starts"):  # a branch's first token is predicted from its root's token s - 1
        b_rows, b_tokens, b_sources = torch.tensor(batch["branch_starts"], device=input_ids.device).unbind(1)
        flat = torch.cat([flat, hidden[b_rows, b_sources]])
        targets = torch.cat([targets, input_ids[b_rows, b_tokens]])
    out = head_token_values(outputs, flat, targets, chunk, with_entropy=return_entropy, with_argmax=return_argmax)
    n = rows * (width - 1)

    def layout(values):  # (rows, width): column t about token t, branch first tokens from their sources
        full = F.pad(values[:n].view(rows, width - 1), (1, 0))
        return full.index_put((b_rows, b_tokens), values[n:]) if len(values) > n else full

    starts = batch["position_ids"] == 0
    logps = layout(out["logp"]).masked_fill(starts, 0.0)
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
    """An LM head's logits of chosen tokens, never made whole: `logits[s:e]` is tokens s..e-1's (e - s, vocab)
    float32 logits, `head(hidden[s:e])` under the autocast the model's forward ran under (the head module's hooks
    run per call: ZeRO-3 gathers, peft adapters); map_logit_chunks visits them `chunk_tokens` at a time. It stands
    where a (tokens, vocab) logits tensor would."""

    hidden: torch.Tensor  # (tokens, hidden width): the final hidden states that predict them
    head: torch.nn.Module  # the LM head module
    autocast_dtype: Optional[torch.dtype]
    chunk_tokens: int
    frozen: bool = False  # no gradient to the head or the hidden states (a teacher's)

    def __len__(self):
        return self.hidden.shape[0]

    def __getitem__(self, tokens: slice):
        kind, dtype = self.hidden.device.type, self.autocast_dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen), \
                torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            return self.head(self.hidden[tokens]).float()

    def detach(self):
        return dataclasses.replace(self, hidden=self.hidden.detach(), frozen=True)


def head_logits_at(model, batch, rows, cols, chunk_tokens):
    """HeadLogits of `model` at positions (rows, cols) of a collated batch, in chunks of `chunk_tokens` (> 0:
    head_chunk_tokens); the model's forward makes no logits (forward_without_logits)."""
    outputs = forward_without_logits(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     position_ids=batch["position_ids"], use_cache=False)
    return HeadLogits(outputs.final_hidden[rows, cols], outputs.head, outputs.autocast_dtype, chunk_tokens)


def map_logit_chunks(logits, fn, also=()):
    """fn over the tokens of `logits`, concatenated: fn(chunk, s, e) takes tokens s..e-1's float32 logits
    (e - s, vocab) and returns a tuple of per-token tensors (e - s, ...) or Nones (which stay None). A (tokens,
    vocab) tensor goes to fn whole; a HeadLogits goes a chunk at a time, each under torch.utils.checkpoint where
    gradients flow, so the chunk's logits and fn's temporaries are freed after forward and recomputed in backward:
    the extra memory is O(chunk x vocab), the price the head once more per chunk (and whatever fn computes, such as
    a live teacher's logits). `also`: the other logits fn slices per chunk (a live teacher's; tensors or
    HeadLogits). Under ZeRO-3 every head call gathers its weight collectively, so where the head of `logits` or of
    any HeadLogits in `also` is partitioned the ranks agree on the number of chunks (the largest any rank needs),
    as module_chunked_head does."""
    if torch.is_tensor(logits):
        return tuple(fn(logits, 0, len(logits)))
    n = len(logits)
    heads = [x.head for x in (logits, *also) if isinstance(x, HeadLogits)]
    chunks = agreed_chunks(n, logits.chunk_tokens, heads, logits.hidden.device)
    grads = torch.is_grad_enabled() and not logits.frozen and (
        logits.hidden.requires_grad or any(p.requires_grad for p in logits.head.parameters()))
    parts, e = [], 0
    for size in [len(part) for part in torch.arange(n).tensor_split(chunks)]:  # as tensor_split divides them
        s, e = e, e + size
        if grads:  # no randomness in a head and a loss: the RNG state need not be kept for the recompute
            parts.append(checkpoint(lambda s=s, e=e: tuple(fn(logits[s:e], s, e)), use_reentrant=False,
                                    preserve_rng_state=False))
        else:
            parts.append(tuple(fn(logits[s:e], s, e)))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
