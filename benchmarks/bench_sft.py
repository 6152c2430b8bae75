"""SFT throughput benchmark: packed vs padded rows, same data, same model, same optimizer step.

    TOKENIZERS_PARALLELISM=false python -m benchmarks.bench_sft --model assets/llama-10m

Synthesises token sequences with a long-tailed (lognormal) length distribution, then for each layout
collates micro-batches with `common.packing.collate` exactly as algos/sft.py does and times
forward + backward + AdamW step, with the loss of algos/sft.py (token-mean NLL over loss tokens).
Reports real (non-pad) tokens/s and the padding fraction (pad tokens / all tokens fed to the model).
Each layout trains its own fresh copy of the model; the two alternate step by step, so that other load
on the machine slows both alike. "loss step 1" must agree between layouts (same weights, same samples).

It runs the plain Hugging Face model with torch.optim.AdamW, not DeepSpeed: DeepSpeed's start-up
costs seconds and adds nothing to a comparison of batch layouts. CPU: fp32; padded and packed rows
through transformers' SDPA (a block-diagonal mask over each packed row), and packed rows through
common/kernels/varlen_attention.py (attention within each sample, what the scripts use on CPU). CUDA: bf16,
and flash_attention_2 with one packed row per micro-batch when flash_attn imports (as sft.py's make_batch).
"""

import math
import random
import time
from dataclasses import dataclass

import torch
import tyro

from common.logprobs import token_logps
from common.packing import collate, to_device
from common.kernels.varlen_attention import NAME as VARLEN


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory to train."""
    num_samples: int = 64
    """Synthetic samples to generate; must cover (warmup_steps + steps) * micro_batch."""
    micro_batch: int = 16
    """Samples per forward/backward (one optimizer step each)."""
    max_len: int = 512
    """Longest sample in tokens, and the packed row limit."""
    steps: int = 3
    """Timed steps per layout."""
    warmup_steps: int = 1
    """Untimed steps per layout before timing."""
    seed: int = 0
    """Seed for the synthetic lengths and tokens."""


def synth_samples(n, vocab_size, pad_id, max_len, seed):
    """Lognormal lengths (median 64 tokens, long tail) clipped to [8, max_len]; random non-pad tokens;
    loss on every token but the first."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = min(max(int(rng.lognormvariate(math.log(64), 1.0)), 8), max_len)
        ids = [rng.randrange(vocab_size - 1) for _ in range(length)]
        ids = [t + (t >= pad_id) for t in ids]  # skip the pad id
        samples.append({"input_ids": ids, "loss_mask": [0] + [1] * (length - 1)})
    return samples


def has_flash_attn():
    try:
        import flash_attn  # noqa: F401

        return True
    except ImportError:
        return False


def train_step(model, optimizer, batch, dev):
    """One forward + backward + AdamW step with sft.py's loss; returns (loss, seconds)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    logps, _ = token_logps(model, batch)
    loss = -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.item()  # also waits for the device
    return loss, time.perf_counter() - t0


def main(args: Args):
    needed = (args.warmup_steps + args.steps) * args.micro_batch
    if args.steps < 1 or args.micro_batch < 1 or args.warmup_steps < 0:
        raise ValueError("--steps and --micro_batch must be >= 1, --warmup_steps >= 0")
    if args.num_samples < needed:
        raise ValueError(f"--num_samples {args.num_samples} < (warmup_steps + steps) * micro_batch = {needed}")
    if args.max_len < 8:
        raise ValueError(f"--max_len {args.max_len} must be >= 8")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flash = dev.type == "cuda" and has_flash_attn()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    attn = "flash_attention_2" if flash else "sdpa"

    samples = synth_samples(args.num_samples, config.vocab_size, pad_id, args.max_len, args.seed)
    micro_batches = [samples[k : k + args.micro_batch] for k in range(0, needed, args.micro_batch)]
    lengths = sorted(len(s["input_ids"]) for s in samples[:needed])
    print(f"samples: {needed} used, lengths min {lengths[0]} median {lengths[len(lengths) // 2]} "
          f"mean {sum(lengths) / len(lengths):.0f} max {lengths[-1]} (max_len {args.max_len})")

    # one fresh model + optimizer per layout; the layouts alternate step by step, so that load from other
    # processes on the machine slows both alike
    from transformers import AutoModelForCausalLM

    layouts = {"padded": (False, attn), "packed": (True, attn)}  # name: (packing, attention implementation)
    if dev.type == "cpu":
        layouts["varlen"] = (True, VARLEN)
    models = {name: AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                         attn_implementation=impl).to(dev).train()
              for name, (_, impl) in layouts.items()}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    stats = {name: [] for name in layouts}
    first_loss = {}
    for i, chunk in enumerate(micro_batches):
        for name, (packing, _) in layouts.items():
            batch = collate(chunk, pad_id, packing=packing, max_tokens=args.max_len, one_row=packing and flash)
            loss, seconds = train_step(models[name], optimizers[name], to_device(batch, dev), dev)
            first_loss.setdefault(name, loss)
            rows, width = batch["input_ids"].shape
            if i >= args.warmup_steps:
                real = sum(len(s["input_ids"]) for s in chunk)
                stats[name].append({"rows": rows, "width": width, "real": real, "total": rows * width, "s": seconds})
    params = sum(p.numel() for p in models["padded"].parameters())
    print(f"model: {args.model} ({params / 1e6:.1f}M parameters), device {dev.type}, {str(dtype)[6:]}, {attn}, "
          f"torch threads {torch.get_num_threads()}, micro_batch {args.micro_batch}, "
          f"{args.steps} timed step(s) after {args.warmup_steps} warmup\n")

    print(f"{'layout':<8} {'rows x width (mean)':>20} {'pad fraction':>13} {'tokens/s':>10} {'step s':>8} "
          f"{'loss step 1':>12}")
    throughput = {}
    for name in layouts:
        st = stats[name]
        n = len(st)
        shape = f"{sum(s['rows'] for s in st) / n:.1f} x {sum(s['width'] for s in st) / n:.0f}"
        real, total, seconds = (sum(s[k] for s in st) for k in ("real", "total", "s"))
        throughput[name] = real / seconds
        print(f"{name:<8} {shape:>20} {1 - real / total:>13.3f} {throughput[name]:>10.0f} {seconds / n:>8.3f} "
              f"{first_loss[name]:>12.5f}")
    for name in layouts:
        if name != "padded":
            print(f"speedup {name}/padded: {throughput[name] / throughput['padded']:.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
