"""DPO / KTO training throughput: this implementation (packed forwards, reference log-probs cached in
one pass before training) against a plain padded implementation of the same loss (separate padded
forwards, live reference), same model, same data, same optimizer steps.

    TOKENIZERS_PARALLELISM=false python -m benchmarks.bench_dpo --algo dpo --model assets/llama-10m
    TOKENIZERS_PARALLELISM=false python -m benchmarks.bench_dpo --algo kto --model assets/llama-10m

Synthesises prompts and responses with long-tailed (lognormal) lengths.  Variants, each training its
own fresh copy of the model (alternating step by step, so that other load slows all alike):

- padded:         DPO: policy forwards chosen and rejected as two padded batches, and so does the
                  live reference.  KTO: policy forward of the examples (padded), gradient-free policy
                  forward of the mismatched KL pairs (padded), live reference forwards of both.
- packed live:    algos/{dpo,kto}.py with --no_ref_cache: chosen + rejected (DPO) in one packed
                  forward; the reference runs packed on each micro-batch.
- packed cached:  algos/{dpo,kto}.py's default: packed forwards, the reference log-probs come from a
                  cache pass (algos' sharded_logps over every pair / example, and for KTO every
                  mismatched pair), whose time is added to the training time.  The pass runs in
                  micro-batch chunks interleaved with the training steps, so load spikes hit it
                  like the other variants.

Throughput counts pairs (DPO) or examples (KTO) per second; "loss step 2" must agree between the
variants (same weights after the same first step).  Plain Hugging Face model with torch AdamW, no
DeepSpeed (its start-up adds nothing to a comparison of batch layouts).  CPU: fp32 + SDPA.  CUDA:
bf16, and flash_attention_2 with one packed row per micro-batch when flash_attn imports.
"""

import importlib.util
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from common.packing import collate, to_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    algo: Literal["dpo", "kto"] = "dpo"
    """Which loss to benchmark."""
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory (policy and reference start from it)."""
    micro_batch: int = 8
    """Pairs (DPO) or examples (KTO) per forward/backward; one optimizer step each."""
    max_len: int = 512
    """Longest prompt + response in tokens, and the packed row limit."""
    steps: int = 3
    """Timed steps per variant."""
    warmup_steps: int = 1
    """Untimed steps per variant before timing."""
    beta: float = 0.1
    """β of the loss."""
    seed: int = 0
    """Seed for the synthetic lengths and tokens."""


def load_algo(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "algos", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def synth_rows(n, vocab_size, pad_id, max_len, seed, paired):
    """Prompts (median 64 tokens) and responses (median 96), lognormal, cut so prompt + response fits."""
    rng = random.Random(seed)

    def tokens(median, limit):
        length = min(max(int(rng.lognormvariate(math.log(median), 0.8)), 4), limit)
        return [t + (t >= pad_id) for t in (rng.randrange(vocab_size - 1) for _ in range(length))]

    rows = []
    for i in range(n):
        prompt = tokens(64, max_len // 2)
        if paired:
            rows.append({"prompt_ids": prompt, "chosen_ids": tokens(96, max_len - len(prompt)),
                         "rejected_ids": tokens(96, max_len - len(prompt))})
        else:
            rows.append({"prompt_ids": prompt, "completion_ids": tokens(96, max_len - len(prompt)),
                         "label": i % 2 == 0})
    return rows


def sample(prompt, response):
    return {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}


def padded_sums(model, samples, pad_id, dev):
    from common.logprobs import token_logps

    batch = to_device(collate(samples, pad_id, packing=False), dev)
    logps, _ = token_logps(model, batch)
    return (logps * batch["loss_mask"]).sum(-1)


def timed(dev, fn):
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(args: Args):
    if args.steps < 1 or args.micro_batch < 2 or args.warmup_steps < 0 or args.max_len < 16:
        raise ValueError("need --steps >= 1, --micro_batch >= 2, --warmup_steps >= 0, --max_len >= 16")
    import datasets
    from transformers import AutoConfig, AutoModelForCausalLM

    algo = load_algo(args.algo)
    config = AutoConfig.from_pretrained(args.model)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import flash_attn  # noqa: F401

        flash = dev.type == "cuda"
    except ImportError:
        flash = False
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    attn = "flash_attention_2" if flash else "sdpa"

    n = (args.warmup_steps + args.steps) * args.micro_batch
    ds = datasets.Dataset.from_list(synth_rows(n, config.vocab_size, pad_id, args.max_len, args.seed,
                                               args.algo == "dpo"))
    micro_batches = [list(range(k, k + args.micro_batch)) for k in range(0, n, args.micro_batch)]
    if args.algo == "dpo":
        run_args = algo.Args(data=algo.PrefDataArgs(max_len=args.max_len), beta=args.beta)
    else:
        run_args = algo.Args(data=algo.KTODataArgs(max_len=args.max_len), beta=args.beta)
    batch_fn = lambda samples: algo.make_batch(samples, run_args, pad_id, flash)  # noqa: E731

    def load():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attn).to(dev)

    variants = ["padded", "packed live", "packed cached"]
    models = {v: load().train() for v in variants}
    optimizers = {v: torch.optim.AdamW(models[v].parameters(), lr=1e-5) for v in variants}
    ref = load().eval().requires_grad_(False)

    # the cache pass of "packed cached", one micro-batch chunk at a time (see cache_chunk below)
    if args.algo == "dpo":
        cache = torch.zeros(n, 2, device=dev)
    else:
        cache = torch.zeros(n, device=dev), torch.zeros(n, device=dev)  # examples; their mismatched pairs

    def cache_chunk(idx):
        if args.algo == "dpo":
            cache[idx] = algo.sharded_logps(ref, len(idx), lambda pos: algo.pair_samples(ds, [idx[p] for p in pos]),
                                            args.micro_batch, batch_fn)
        else:
            items = [(i, i) for i in idx] + algo.kl_pairs(idx)
            values = algo.sharded_logps(ref, len(items), lambda pos: algo.kto_samples(ds, [items[p] for p in pos],
                                                                                      args.max_len),
                                        args.micro_batch, batch_fn)[:, 0]
            cache[0][idx], cache[1][idx] = values[: len(idx)], values[len(idx) :]

    labels_all = torch.tensor(ds["label"], device=dev) if args.algo == "kto" else None

    def dpo_step(variant, idx):
        model, m = models[variant], len(idx)
        if variant == "padded":
            rows = ds[idx]
            chosen_samples = [sample(p, c) for p, c in zip(rows["prompt_ids"], rows["chosen_ids"])]
            rejected_samples = [sample(p, r) for p, r in zip(rows["prompt_ids"], rows["rejected_ids"])]
            chosen = padded_sums(model, chosen_samples, pad_id, dev)
            rejected = padded_sums(model, rejected_samples, pad_id, dev)
            with torch.no_grad():
                ref_chosen = padded_sums(ref, chosen_samples, pad_id, dev)
                ref_rejected = padded_sums(ref, rejected_samples, pad_id, dev)
        else:
            batch = to_device(batch_fn(algo.pair_samples(ds, idx)), dev)
            logps, _ = algo.response_logps(model, batch)
            chosen, rejected = logps[:m], logps[m:]
            if variant == "packed live":
                with torch.no_grad():
                    ref_logps, _ = algo.response_logps(ref, batch)
                ref_chosen, ref_rejected = ref_logps[:m], ref_logps[m:]
            else:
                ref_chosen, ref_rejected = cache[idx].unbind(1)
        losses, _, _ = algo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta)
        return losses.mean()

    def kto_step(variant, idx):
        model, m = models[variant], len(idx)
        examples, mismatched = [(i, i) for i in idx], algo.kl_pairs(idx)
        if variant == "padded":
            example_samples = algo.kto_samples(ds, examples, args.max_len)
            kl_samples = algo.kto_samples(ds, mismatched, args.max_len)
            with torch.no_grad():
                kl_logps = padded_sums(model, kl_samples, pad_id, dev)
                ref_logps = padded_sums(ref, example_samples, pad_id, dev)
                ref_kl_logps = padded_sums(ref, kl_samples, pad_id, dev)
            logps = padded_sums(model, example_samples, pad_id, dev)
        else:
            if variant == "packed live":
                with torch.no_grad():
                    both = to_device(batch_fn(algo.kto_samples(ds, examples + mismatched, args.max_len)), dev)
                    ref_both, _ = algo.response_logps(ref, both)
                ref_logps, ref_kl_logps = ref_both[:m], ref_both[m:]
            else:
                ref_logps, ref_kl_logps = cache[0][idx], cache[1][idx]
            with torch.no_grad():
                kl_batch = to_device(batch_fn(algo.kto_samples(ds, mismatched, args.max_len)), dev)
                kl_logps, _ = algo.response_logps(model, kl_batch)
            batch = to_device(batch_fn(algo.kto_samples(ds, examples, args.max_len)), dev)
            logps, _ = algo.response_logps(model, batch)
        z = algo.kl_reference_point(kl_logps, ref_kl_logps)
        losses, _ = algo.kto_loss(logps, ref_logps, labels_all[idx], z, args.beta)
        return losses.mean()

    def train_step(variant, idx):
        loss = (dpo_step if args.algo == "dpo" else kto_step)(variant, idx)
        loss.backward()
        optimizers[variant].step()
        optimizers[variant].zero_grad(set_to_none=True)
        return loss.item()

    seconds = {v: 0.0 for v in variants}
    losses = {v: [] for v in variants}
    cache_s = 0.0
    for i, idx in enumerate(micro_batches):
        _, s = timed(dev, lambda: cache_chunk(idx))
        cache_s += s if i >= args.warmup_steps else 0.0
        for v in variants:
            loss, s = timed(dev, lambda: train_step(v, idx))
            losses[v].append(loss)
            if i >= args.warmup_steps:
                seconds[v] += s

    unit = "pairs" if args.algo == "dpo" else "examples"
    timed_items = args.steps * args.micro_batch
    params = sum(p.numel() for p in ref.parameters())
    lengths = sorted(len(p) for p in ds["prompt_ids"])
    print(f"{args.algo.upper()} | model: {args.model} ({params / 1e6:.1f}M parameters), device {dev.type}, "
          f"{str(dtype)[6:]}, {attn}, torch threads {torch.get_num_threads()} | micro-batch {args.micro_batch} {unit}, "
          f"{args.steps} timed step(s) after {args.warmup_steps} warmup | prompt tokens median "
          f"{lengths[len(lengths) // 2]}, max_len {args.max_len}\n")
    print(f"{'variant':<14} {'train s/step':>13} {'ref cache s/step':>17} {unit + '/s':>12} {'speedup':>8} "
          f"{'loss step 2':>12}")
    base = None
    for v in variants:
        cache_per_step = cache_s / args.steps if v == "packed cached" else 0.0
        rate = timed_items / (seconds[v] + cache_per_step * args.steps)
        base = base or rate
        loss2 = f"{losses[v][1]:.6f}" if len(losses[v]) > 1 else "-"
        print(f"{v:<14} {seconds[v] / args.steps:>13.3f} {cache_per_step:>17.3f} {rate:>12.2f} {rate / base:>7.2f}x "
              f"{loss2:>12}")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
