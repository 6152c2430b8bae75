"""The two plans of the CPU attention kernel (common/kernels/varlen_attention.py) side by side: per-length groups
(one fused call per group of samples of one length) against blocks (all samples in equal padded blocks,
one masked call), and the plan `batch_plan` picks, on the batch shapes of benchmarks/vs_trl.py.

    python -m benchmarks.bench_attention --model assets/llama-10m

Prints the median milliseconds of a forward + backward of a packed micro-batch (synthetic tokens, bf16
autocast where the CPU multiplies bf16 natively) per plan, the three alternating batch by batch so that
other load slows them alike. Shapes: 16 DPO pairs (prompt 8-16 tokens, responses 4-12, rejected as a
branch of the chosen sample's prompt), a GRPO micro-batch (4 prompts x 8 responses of 4-32 tokens as
branches), 64 SFT samples of 10-35 tokens, and the same with a long tail (1 in 20 of 200-500 tokens).
CALL_COST_IN_SCORES, which `batch_plan` weighs the plans by, was set from these figures.
"""

import random
import statistics
import time
from dataclasses import dataclass

import torch
import tyro

from common.kernels import varlen_attention
from common.infra.engine import cpu_has_native_bf16
from common.logprobs import response_logps
from common.packing import collate


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory."""
    batches: int = 30
    """Batches per shape (the first three not counted)."""


def sample(rng, prompt, response, prefix_of=None):
    ids = [rng.randrange(3, 250) for _ in range(len(prompt) + response)]
    ids[: len(prompt)] = prompt
    out = {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * response}
    return out if prefix_of is None else {**out, "prefix_of": prefix_of, "prefix_len": len(prompt)}


def shape_samples(name, rng):
    if name in ("dpo", "grpo"):
        groups, per_group, (low, high) = (16, 2, (4, 12)) if name == "dpo" else (4, 8, (4, 32))
        prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(8, 16))] for _ in range(groups)]
        if name == "dpo":  # chosen samples, then their rejected branches, as dpo.py lays them out
            return ([sample(rng, p, rng.randint(low, high)) for p in prompts]
                    + [sample(rng, p, rng.randint(low, high), i) for i, p in enumerate(prompts)])
        return [sample(rng, p, rng.randint(low, high), None if j == 0 else g * per_group)
                for g, p in enumerate(prompts) for j in range(per_group)]
    tail = name == "sft_long_tail"
    return [sample(rng, [], rng.randint(200, 500) if tail and rng.random() < 0.05 else rng.randint(10, 35))
            for _ in range(64)]


def main(args: Args):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=varlen_attention.NAME)
    plans = {"groups": 0.0, "blocks": 1e15, "picked": varlen_attention.CALL_COST_IN_SCORES}
    bf16 = cpu_has_native_bf16()
    print(f"{args.model}, forward + backward, {'bf16 autocast' if bf16 else 'fp32'}, median ms of "
          f"{args.batches - 3} batches")
    print(f"{'shape':<14} {'tokens':>7} {'groups':>8} {'blocks':>8} {'picked':>8}  picked")
    for name in ("dpo", "grpo", "sft", "sft_long_tail"):
        rng = random.Random(0)
        batches = [collate(shape_samples(name, rng), 0, one_row=True, share_prefixes=True)
                   for _ in range(args.batches)]
        times, picked = {plan: [] for plan in plans}, set()
        for i, batch in enumerate(batches):
            for plan, cost in (plans.items() if i % 2 else reversed(plans.items())):
                varlen_attention.CALL_COST_IN_SCORES = cost
                batch = {**batch, "position_ids": batch["position_ids"].clone()}  # a new batch: planned afresh
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    sums, _ = response_logps(model, batch)
                sums.sum().backward()
                model.zero_grad()
                times[plan].append(time.perf_counter() - start)
                if plan == "picked":
                    picked.add(type(varlen_attention._last_batch["plan"]).__name__)
        tokens = statistics.mean(b["input_ids"].numel() for b in batches)
        medians = {plan: 1000 * statistics.median(t[3:]) for plan, t in times.items()}
        print(f"{name:<14} {tokens:>7.0f} " + " ".join(f"{medians[p]:>8.1f}" for p in plans)
              + "  " + ", ".join(sorted(picked)))


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
