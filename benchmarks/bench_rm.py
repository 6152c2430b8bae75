"""Reward-model training throughput: packed vs padded rows, same pairs, same model, same optimizer step.

    TOKENIZERS_PARALLELISM=false python -m benchmarks.bench_rm --model assets/llama-10m

Synthesises preference pairs (a shared prompt and two responses, lognormal lengths with a long tail),
then for each layout collates each micro-batch's chosen and rejected sequences into one batch with
`common.packing.collate`, as algos/rm.py does, and times forward (`common.infra.reward.sequence_rewards`,
the value head read at each sample's last token) + backward + AdamW step with rm.py's loss
(-log sigmoid(r_chosen - r_rejected), mean over pairs). Reports pairs/s, real (non-pad) tokens/s and
the padding fraction. Each layout trains its own fresh copy of the model; the two alternate step by
step, so that other load on the machine slows both alike. "loss step 1" must agree between layouts.

The model is loaded as AutoModelForSequenceClassification (num_labels=1; the value head is seeded
the same for both copies) and run without DeepSpeed, whose start-up costs seconds and adds nothing to
a comparison of batch layouts. CPU: fp32 + SDPA. CUDA: bf16, and flash_attention_2 with one packed
row per micro-batch when flash_attn imports (as rm.py's make_batch).
"""

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro

from common.packing import collate, to_device
from common.infra.reward import sequence_rewards


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM (or reward model) directory to train as a reward model."""
    num_pairs: int = 64
    """Synthetic pairs to generate; must cover (warmup_steps + steps) * micro_batch."""
    micro_batch: int = 8
    """Pairs per forward/backward (one optimizer step each): 2 x micro_batch sequences."""
    max_len: int = 512
    """Longest sequence in tokens, and the packed row limit."""
    steps: int = 3
    """Timed steps per layout."""
    warmup_steps: int = 1
    """Untimed steps per layout before timing."""
    seed: int = 0
    """Seed for the synthetic lengths and tokens, and the value-head initialisation."""


def synth_pairs(n, vocab_size, pad_id, max_len, seed):
    """A prompt (median 48 tokens) and two responses (median 32 each), lognormal with a long tail,
    each sequence clipped to max_len; random non-pad tokens."""
    rng = random.Random(seed)

    def tokens(median):
        length = max(int(rng.lognormvariate(math.log(median), 1.0)), 2)
        return [t + (t >= pad_id) for t in (rng.randrange(vocab_size - 1) for _ in range(length))]  # skip the pad id

    pairs = []
    for _ in range(n):
        prompt = tokens(48)[: max_len // 2]
        pairs.append(((prompt + tokens(32))[:max_len], (prompt + tokens(32))[:max_len]))
    return pairs


def has_flash_attn():
    try:
        import flash_attn  # noqa: F401

        return True
    except ImportError:
        return False


def train_step(model, optimizer, batch, dev):
    """One forward + backward + AdamW step with rm.py's loss; returns (loss, seconds)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rewards = sequence_rewards(model, batch)
    m = len(rewards) // 2
    loss = -F.logsigmoid(rewards[:m] - rewards[m:]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.item()  # also waits for the device
    return loss, time.perf_counter() - t0


def main(args: Args):
    needed = (args.warmup_steps + args.steps) * args.micro_batch
    if args.steps < 1 or args.micro_batch < 1 or args.warmup_steps < 0:
        raise ValueError("--steps and --micro_batch must be >= 1, --warmup_steps >= 0")
    if args.num_pairs < needed:
        raise ValueError(f"--num_pairs {args.num_pairs} < (warmup_steps + steps) * micro_batch = {needed}")
    if args.max_len < 8:
        raise ValueError(f"--max_len {args.max_len} must be >= 8")
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(args.model)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flash = dev.type == "cuda" and has_flash_attn()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    attn = "flash_attention_2" if flash else "sdpa"

    pairs = synth_pairs(args.num_pairs, config.vocab_size, pad_id, args.max_len, args.seed)
    micro_batches = [pairs[k : k + args.micro_batch] for k in range(0, needed, args.micro_batch)]
    lengths = sorted(len(s) for pair in pairs[:needed] for s in pair)
    print(f"pairs: {needed} used, sequence lengths min {lengths[0]} median {lengths[len(lengths) // 2]} "
          f"mean {sum(lengths) / len(lengths):.0f} max {lengths[-1]} (max_len {args.max_len})")

    # one fresh model + optimizer per layout, the same seeded value head; the layouts alternate step
    # by step, so that load from other processes on the machine slows both alike
    layouts = {"padded": False, "packed": True}
    models = {}
    for name in layouts:
        torch.manual_seed(args.seed)
        models[name] = AutoModelForSequenceClassification.from_pretrained(
            args.model, num_labels=1, pad_token_id=pad_id, dtype=dtype, attn_implementation=attn).to(dev).train()
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    stats = {name: [] for name in layouts}
    first_loss = {}
    for i, chunk in enumerate(micro_batches):
        seqs = [c for c, _ in chunk] + [r for _, r in chunk]
        samples = [{"input_ids": s, "loss_mask": [0] * len(s)} for s in seqs]
        for name, packing in layouts.items():
            batch = collate(samples, pad_id, packing=packing, max_tokens=args.max_len, one_row=packing and flash)
            loss, seconds = train_step(models[name], optimizers[name], to_device(batch, dev), dev)
            first_loss.setdefault(name, loss)
            rows, width = batch["input_ids"].shape
            if i >= args.warmup_steps:
                real = sum(len(s) for s in seqs)
                stats[name].append({"rows": rows, "width": width, "real": real, "total": rows * width,
                                    "pairs": len(chunk), "s": seconds})
    params = sum(p.numel() for p in models["padded"].parameters())
    print(f"model: {args.model} ({params / 1e6:.1f}M parameters), device {dev.type}, {str(dtype)[6:]}, {attn}, "
          f"torch threads {torch.get_num_threads()}, micro_batch {args.micro_batch} pairs, "
          f"{args.steps} timed step(s) after {args.warmup_steps} warmup\n")

    print(f"{'layout':<8} {'rows x width (mean)':>20} {'pad fraction':>13} {'pairs/s':>9} {'tokens/s':>10} "
          f"{'step s':>8} {'loss step 1':>12}")
    throughput = {}
    for name in layouts:
        st = stats[name]
        n = len(st)
        shape = f"{sum(s['rows'] for s in st) / n:.1f} x {sum(s['width'] for s in st) / n:.0f}"
        real, total, n_pairs, seconds = (sum(s[k] for s in st) for k in ("real", "total", "pairs", "s"))
        throughput[name] = n_pairs / seconds
        print(f"{name:<8} {shape:>20} {1 - real / total:>13.3f} {throughput[name]:>9.2f} {real / seconds:>10.0f} "
              f"{seconds / n:>8.3f} {first_loss[name]:>12.5f}")
    print(f"speedup packed/padded: {throughput['packed'] / throughput['padded']:.2f}x")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
