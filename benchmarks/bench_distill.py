"""Distillation throughput benchmark: cached teacher logits vs a live teacher forward, same data, same
student, same loss.

    TOKENIZERS_PARALLELISM=false python -m benchmarks.bench_distill --student assets/llama-0.5m \\
        --teacher assets/llama-10m --teacher_top_k 16

Synthesises prompt/response token sequences with a long-tailed (lognormal) length distribution (loss on
the second half of each sample), packs micro-batches with `common.packing.collate`, and times one
student step (forward + backward + AdamW) with algos/distill.py's loss, the teacher's logits coming
either from a cache filled beforehand (the cache pass is timed separately, as --teacher_cache does it
once per run) or from a teacher forward inside the step.  Reports response (loss) tokens/s and all
tokens/s; the two modes alternate step by step, so that other load on the machine slows both alike.
"loss step 1" must agree between modes (same weights, same samples).

It runs plain Hugging Face models with torch.optim.AdamW, not DeepSpeed: DeepSpeed's start-up costs
seconds and adds nothing to this comparison. CPU: fp32 + SDPA; CUDA: bf16 + SDPA.
"""

import importlib.util
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace

import torch
import tyro

from common.data import DataArgs
from common.logprobs import ModelSettings
from common.packing import collate, to_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_distill():
    """algos/distill.py as a module (algos/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("distill", os.path.join(ROOT, "algos", "distill.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["distill"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Args:
    student: str = "assets/llama-0.5m"
    """Hugging Face causal-LM directory of the student (trained)."""
    teacher: str = "assets/llama-10m"
    """Hugging Face causal-LM directory of the teacher (frozen), with the student's tokenizer."""
    num_samples: int = 96
    """Synthetic samples to generate; must cover (warmup_steps + steps) * micro_batch."""
    micro_batch: int = 16
    """Samples per forward/backward (one optimizer step each)."""
    max_len: int = 256
    """Longest sample in tokens, and the packed row limit."""
    teacher_top_k: int = 16
    """Teacher logits kept per token (0: all), as --teacher_top_k."""
    temperature: float = 1.0
    """Temperature of the KD term, as --temperature."""
    steps: int = 4
    """Timed steps per mode."""
    warmup_steps: int = 1
    """Untimed steps per mode before timing."""
    seed: int = 0
    """Seed for the synthetic lengths and tokens."""
    logps_chunk_tokens: int = 1024
    """Tokens per chunk of both models' LM heads, as --logps_chunk_tokens (0: whole logits)."""


def synth_samples(n, vocab_size, pad_id, max_len, seed):
    """Lognormal lengths (median 64 tokens, long tail) clipped to [8, max_len]; random non-pad tokens;
    loss on the second half (the 'response')."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = min(max(int(rng.lognormvariate(math.log(64), 1.0)), 8), max_len)
        ids = [rng.randrange(vocab_size - 1) for _ in range(length)]
        ids = [t + (t >= pad_id) for t in ids]  # skip the pad id
        samples.append({"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)})
    return samples


def main(args: Args):
    needed = (args.warmup_steps + args.steps) * args.micro_batch
    if args.steps < 1 or args.micro_batch < 1 or args.warmup_steps < 0:
        raise ValueError("--steps and --micro_batch must be >= 1, --warmup_steps >= 0")
    if args.num_samples < needed:
        raise ValueError(f"--num_samples {args.num_samples} < (warmup_steps + steps) * micro_batch = {needed}")
    distill = load_distill()
    from transformers import AutoModelForCausalLM

    dargs = distill.Args(model=distill.ModelArgs(pretrain=args.student), teacher_model=args.teacher,
                         teacher_top_k=args.teacher_top_k, temperature=args.temperature,
                         data=DataArgs(dataset="synthetic", max_len=args.max_len))
    vocab = distill.check_teacher(dargs)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(dev)
        model.minrlhf = ModelSettings(logps_chunk_tokens=args.logps_chunk_tokens)  # as load_causal_lm sets it
        return model

    teacher = load(args.teacher).eval().requires_grad_(False)
    pad_id = teacher.config.pad_token_id or 0
    samples = synth_samples(args.num_samples, vocab, pad_id, args.max_len, args.seed)
    micro_batches = [to_device(collate(samples[k : k + args.micro_batch], pad_id, max_tokens=args.max_len), dev)
                     for k in range(0, needed, args.micro_batch)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # the cache pass: the teacher's top-k logits of every loss token, computed once (after one untimed forward)
    distill.teacher_targets(teacher, micro_batches[0], args.teacher_top_k, vocab)
    sync()
    t0 = time.perf_counter()
    cache = [distill.teacher_targets(teacher, b, args.teacher_top_k, vocab)[:2] for b in micro_batches]
    sync()
    cache_s = time.perf_counter() - t0

    students = {mode: load(args.student).train() for mode in ("cached", "live")}
    optimizers = {mode: torch.optim.AdamW(m.parameters(), lr=1e-5) for mode, m in students.items()}
    seconds, first_loss = {mode: 0.0 for mode in students}, {}
    for i, batch in enumerate(micro_batches):
        for mode, student in students.items():
            sync()
            t0 = time.perf_counter()
            t = cache[i] if mode == "cached" else distill.teacher_logits(teacher, batch)
            logits, targets, _ = distill.response_logits(student, batch)
            kd, ce, _ = distill.token_losses(logits, targets, t, replace(dargs, kd_coef=0.5), vocab)
            loss = (0.5 * kd.sum() + 0.5 * ce.sum()) / len(targets)
            loss.backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=True)
            first_loss.setdefault(mode, loss.item())  # .item() also waits for the device
            if i >= args.warmup_steps:
                seconds[mode] += time.perf_counter() - t0
    timed = micro_batches[args.warmup_steps :]
    loss_tokens = sum(int(b["loss_mask"].sum()) for b in timed)
    all_tokens = sum(int((b["sample_index"] >= 0).sum()) for b in timed)
    n_params = lambda m: sum(p.numel() for p in m.parameters()) / 1e6  # noqa: E731
    print(f"student {args.student} ({n_params(students['live']):.1f}M), teacher {args.teacher} "
          f"({n_params(teacher):.1f}M), device {dev.type}, {str(dtype)[6:]}, torch threads {torch.get_num_threads()}, "
          f"micro_batch {args.micro_batch}, head chunk {args.logps_chunk_tokens or 'whole'}, "
          f"top-k {args.teacher_top_k or 'all'}, {args.steps} timed step(s) after "
          f"{args.warmup_steps} warmup; {loss_tokens} loss tokens of {all_tokens} in the timed steps\n")
    print(f"{'mode':<8} {'loss tokens/s':>14} {'all tokens/s':>13} {'step s':>8} {'loss step 1':>12}")
    for mode in students:
        print(f"{mode:<8} {loss_tokens / seconds[mode]:>14.0f} {all_tokens / seconds[mode]:>13.0f} "
              f"{seconds[mode] / args.steps:>8.3f} {first_loss[mode]:>12.5f}")
    all_loss = sum(int(b["loss_mask"].sum()) for b in micro_batches)
    print(f"speedup cached/live: {seconds['live'] / seconds['cached']:.2f}x; cache pass {cache_s:.2f}s for "
          f"{all_loss} loss tokens ({all_loss / cache_s:.0f} tokens/s), paid once per run")


if __name__ == "__main__":
    main(tyro.cli(Args, use_underscores=True, description=__doc__))
