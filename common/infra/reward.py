"""Trust tier: read the faces, trust the body.

Reward scoring shared by algos/rm.py (training and evaluation), RL and generation.

A reward model is a Hugging Face `AutoModelForSequenceClassification` with `num_labels=1`; the
reward of a sequence is its value-head output at the sequence's own last token (its EOS when it has one),
so a model saved by rm.py gives the same reward here, in rm.py and in RL. Plain `transformers` reads the
last token that is not the pad id: the same token unless the tokenizer's pad token is its EOS (then it
reads the token before a final EOS; give such a tokenizer a pad token of its own to make the two agree).
Batches may be packed (see common/packing.py): the value head is read at
each sample's own last token rather than at the end of each row.

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from common.infra.reward import score

    rm = AutoModelForSequenceClassification.from_pretrained("outputs/rm").eval()
    rewards = score(rm, texts, AutoTokenizer.from_pretrained("outputs/rm"), normalize=True)
"""

import torch
import torch.distributed as dist

from common.packing import unwrap
from common.packing import collate, to_device


def reward_index(batch):
    """Flat index (row x width + column) of each sample's last token, in the order samples were given: the EOS of
    a finished response, the last token of a truncated one. Read from the sample's span, not by skipping pad ids:
    where a tokenizer's pad token is its EOS, Hugging Face's pooling (the last token that is not the pad id) reads
    `abc<eos>` at `c`, as it reads a truncated `abc`, so such a reward model could not tell the two apart."""
    width = batch["input_ids"].shape[1]
    return torch.tensor([r * width + s + n - 1 for r, s, n in batch["spans"]], device=batch["input_ids"].device)


def sequence_rewards(model, batch, value_head_prefix="score", ring=None):
    """Reward of each sample of a collated batch (packed or padded), float32, shape (num_samples,).

    `model` is a sequence-classification model, bare or inside a DeepSpeed engine (training or
    eval, any ZeRO stage) or a peft wrapper. The model's own forward runs (so DeepSpeed's hooks and
    Hugging Face's packing detection work as usual); the per-token values are taken from the value
    head named `value_head_prefix` as it runs, and read at each sample's own last token. With `ring` (a
    common.ring_attention.Ring, --ring_attn_size > 1) each rank of it forwards its slice of the one-row batch and
    the values are gathered over the ring (autograd)."""
    hf_model = unwrap(model)
    values = []
    handle = getattr(hf_model, value_head_prefix).register_forward_hook(lambda module, args, out: values.append(out))
    try:
        if ring is None:  # with the cache on, packed rows are silently attended as one sequence
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"], use_cache=False)
        else:  # this rank's slice of the row; the whole row's values are gathered below
            from common.ring_attention import ring_forward, ring_row_values

            ring_forward(model, batch, ring)
    finally:
        handle.remove()
    flat = values[0].squeeze(-1).flatten() if ring is None else ring_row_values(values[0][0, :, 0], batch, ring)
    return flat[reward_index(batch)].float()


def lockstep_forwards(model, num_local):
    """How many forward passes this rank must make to run `num_local` batches: under ZeRO-3 every
    forward gathers the weights collectively, so each rank makes as many as the busiest rank (the
    extra ones on a dummy batch); otherwise just `num_local`."""
    zero3 = hasattr(model, "zero_optimization_stage") and model.zero_optimization_stage() == 3
    if not (dist.is_initialized() and zero3):
        return num_local
    count = torch.tensor([num_local], device=next(unwrap(model).parameters()).device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@torch.no_grad()
def score(models, sequences, tokenizer=None, normalize=False, weights=None, batch_size=16, max_tokens=None,
          add_special_tokens=False, value_head_prefix="score"):
    """Score sequences with one or several reward models: one float per sequence (a float32 CPU tensor).

    models: a reward model or a list of them: `AutoModelForSequenceClassification` (num_labels=1) as
        loaded by transformers, or inside a DeepSpeed engine (common.infra.engine.create_eval_engine with
        common.infra.engine.deepspeed_eval_config: plain replica or ZeRO-3; under ZeRO-3 each rank scores
        its own sequences and the ranks' forward passes are kept in step). The models must share
        the tokenizer (the sequences are tokenized once).
    sequences: texts (tokenized with `tokenizer`, `add_special_tokens` as given: pass the exact text
        the model was trained on, chat template included) or lists of token ids (common.data.reward_model_ids
        gives rm.py's ids of a prompt and a response).
    normalize: use (reward - config.mean) / config.std, the statistics rm.py stores from its eval set.
    weights: with several models, the result is sum_k weights[k] x reward_k (default: all 1).
    batch_size: sequences per forward pass, packed into rows of at most `max_tokens` tokens
        (default: the longest sequence); one row per batch with flash-attention.
    """
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    weights = [1.0] * len(models) if weights is None else list(weights)
    if len(weights) != len(models):
        raise ValueError(f"{len(weights)} weights for {len(models)} reward models")
    if any(isinstance(s, str) for s in sequences):
        if tokenizer is None:
            raise ValueError("scoring texts needs a tokenizer (or pass lists of token ids)")
        sequences = [tokenizer(s, add_special_tokens=add_special_tokens)["input_ids"] for s in sequences]
    samples = [{"input_ids": list(ids), "loss_mask": [0] * len(ids)} for ids in sequences]
    if any(not s["input_ids"] for s in samples):
        raise ValueError("cannot score an empty sequence")
    chunks = [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]
    total = torch.zeros(len(samples), dtype=torch.float32)
    for model, weight in zip(models, weights):
        hf_model = unwrap(model)
        config, dev = hf_model.config, next(hf_model.parameters()).device
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        if normalize and (getattr(config, "mean", None) is None or getattr(config, "std", None) is None):
            raise ValueError(f"normalize=True but the config of {config.name_or_path or 'this model'} has no mean/std "
                             "(rm.py stores them when trained with --eval_dataset)")
        flash = config._attn_implementation.startswith("flash")
        rewards = []
        for i in range(lockstep_forwards(model, len(chunks))):
            chunk = chunks[i] if i < len(chunks) else [{"input_ids": [pad_id], "loss_mask": [0]}]  # ZeRO-3 filler
            width = max_tokens or max(len(s["input_ids"]) for s in chunk)
            batch = to_device(collate(chunk, pad_id, packing=True, max_tokens=width, one_row=flash), dev)
            values = sequence_rewards(model, batch, value_head_prefix).cpu()
            if i < len(chunks):
                rewards.append(values)
        rewards = torch.cat(rewards) if rewards else total.clone()
        if normalize:
            rewards = (rewards - config.mean) / config.std
        total += weight * rewards
    return total


def load_reward_models(paths, device):
    """rm.py's exports at `paths` (AutoModelForSequenceClassification) in eval mode on `device` (RL's reward-model
    actor and generate.py pass common.infra.engine.device(): the GPU Ray or the launcher gave the process, else the
    CPU), and the first one's tokenizer (score() needs them to share it)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    models = [AutoModelForSequenceClassification.from_pretrained(p).to(device).eval() for p in paths]
    return models, AutoTokenizer.from_pretrained(paths[0])
