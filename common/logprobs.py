"""Per-token log-probs of a collated batch (common.packing) and the sums built on them: the one face every script
calls. Beneath it, called and never calling back: common.kernels.chunked_head computes the values (through the
chunked LM head where the model type allows it, else from whole logits), and where a model runs over a ring
(--ring_attn_size > 1) common.ring_attention splits each row over it, imported only then.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from common.kernels.chunked_head import forward_token_logps, head_chunk_tokens, hf_model
from common.packing import lockstep_shard, per_sample_sum, to_device


@dataclass(frozen=True)
class ModelSettings:
    """This project's settings of a model it loaded (common.infra.engine.load_causal_lm keeps them as the Hugging
    Face model's `minrlhf`); a model without them takes the defaults."""
    logps_chunk_tokens: int = 0
    """Tokens per chunk of the LM head (--logps_chunk_tokens); 0: whole logits."""
    ring: Optional[object] = None
    """The common.ring_attention.Ring the model's rows are split over (--ring_attn_size > 1), else None."""
    export_use_cache: Optional[bool] = None
    """The model's own config.use_cache, which training turns off (packed rows) and save_hf_model exports; None:
    the config's."""
    layout: Optional[object] = None
    """How the model's micro-batches become rows (common.packing.Layout: from its attention kernel and ring)."""
    clip_grad_norm_in_step: float = 0.0
    """The max norm common.infra.engine.optimizer_step clips the gradients to (plain ZeRO-0, set by
    create_train_engine); 0: DeepSpeed clips, or nothing does."""


def model_settings(model):
    """The ModelSettings of `model` (bare, in a DeepSpeed engine and / or a peft wrapper)."""
    return getattr(hf_model(model), "minrlhf", ModelSettings())


def logps_chunk_tokens(model):
    """Tokens per chunk of the LM head of `model`, 0 where it takes whole logits (common.kernels.chunked_head's
    head_chunk_tokens says where the chunked head applies)."""
    return head_chunk_tokens(model, model_settings(model).logps_chunk_tokens)


def token_logps(model, batch, return_argmax=False, return_entropy=False, ring="model"):
    """Forward a collated batch; returns (logps, outputs[, hits]) where logps[:, t] is
    log p(input_ids[:, t] | earlier tokens of its sample) (0 at each sample's first token), aligned with
    `loss_mask`, and hits[:, t] whether that token is the argmax. With `return_entropy`, `outputs.entropy` is each
    position's next-token entropy laid out the same way (0 at column 0; differentiable).

    `ring`: "model", the ring the model runs over (model_settings), where every rank of the ring holds the same
    one-row batch; None, this rank's batch whole (ranks holding different items: lockstep_shard); or a Ring."""
    chunk = logps_chunk_tokens(model)
    ring = model_settings(model).ring if ring == "model" else ring
    if ring is not None:
        from common.ring_attention import ring_token_logps

        return ring_token_logps(model, batch, ring, chunk, return_argmax, return_entropy)
    return forward_token_logps(model, batch, chunk, return_argmax, return_entropy)


def response_logps(model, batch, ring="model"):
    """Sum of the loss-token (response) log-probs of each sample; returns (sums, model outputs)."""
    logps, outputs = token_logps(model, batch, ring=ring)
    return per_sample_sum(logps * batch["loss_mask"], batch), outputs


@torch.no_grad()
def sharded_logps(model, n, samples_of, micro, batch_fn, device):
    """Response log-prob sums of items 0..n-1, computed with the items split over the ranks and
    summed back: shape (n, k) on every rank, where samples_of(items) gives k samples per item,
    grouped (every item's first sample, then every item's second, ...)."""
    mine, padded = lockstep_shard(n)
    out = None
    for start in range(0, len(padded), micro):
        chunk, valid = padded[start : start + micro], mine[start : start + micro]
        sums, _ = response_logps(model, to_device(batch_fn(samples_of(chunk)), device), ring=None)
        sums = sums.view(-1, len(chunk)).T
        if out is None:
            out = torch.zeros(n, sums.shape[1], dtype=sums.dtype, device=sums.device)
        out[valid] = sums[: len(valid)]
    if dist.is_initialized():
        dist.all_reduce(out)
    return out
