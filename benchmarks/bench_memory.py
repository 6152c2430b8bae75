"""Peak memory and tokens/s of one training micro-batch at a real vocabulary: the chunked LM head against whole
logits.

The model has Qwen2.5-0.5B's published shape (hidden 896, 24 layers, 14 query / 2 KV heads, head_dim 64,
intermediate 4,864, vocab 151,936, tied embeddings), built locally with random weights; the micro-batch is one
packed row of random token ids (several samples, as common.packing.collate lays them out for the varlen_sdpa
kernel). One measured step is common.logprobs.token_logps, loss = masked mean NLL, backward (no optimizer), after
`--warmup` unmeasured steps. Each configuration runs in a fresh subprocess so peaks do not carry over: peak RSS
(getrusage's ru_maxrss, the process's high-water mark) on CPU, torch.cuda.max_memory_allocated on CUDA, beside the
memory held before the measured step (the model, and the gradients of a warm-up step). A configuration whose
estimated need exceeds the memory available is skipped with the estimate printed, rather than run into the
kernel's OOM killer.

    python -m benchmarks.bench_memory --layers 2                       # quick CPU table, 1k-8k tokens
    python -m benchmarks.bench_memory --tokens 1024 --chunks 256,1024,2048 --checkpointing off
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
             intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)


def mem_available():
    """MemAvailable of /proc/meminfo in bytes (CPU), or the free device memory (CUDA)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def estimate_bytes(tokens, layers, chunk, checkpointing, dtype_bytes=4):
    """A rough upper estimate of a step's peak: weights and their gradients, the layers' saved activations
    (~8 x hidden + 4 x intermediate values per token per layer; one layer's input per layer with checkpointing,
    plus one layer recomputed) and the head: ~4.4 fp32 copies of (tokens x vocab) on the whole path (the model's
    logits, log-softmax temporaries, their gradients), ~4 copies of (chunk x vocab) chunked, plus the weight's
    fp32 gradient accumulator."""
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    per_layer = (h * 4 + 2 * 64 * 2) * h + 3 * h * i
    params = v * h + layers * per_layer
    weights = 2 * params * dtype_bytes
    act_layer = (8 * h + 4 * i) * tokens * dtype_bytes
    acts = (layers * h * tokens * dtype_bytes + act_layer) if checkpointing else layers * act_layer
    head = 4.4 * tokens * v * 4 if chunk == 0 else 4 * min(chunk, tokens) * v * 4 + v * h * 4
    return weights + acts + head


def packed_row(tokens, samples, vocab, seed=0):
    """One packed row of `samples` random samples totalling `tokens` tokens, every token but each sample's first
    a loss target."""
    from common.packing import collate

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, tokens), samples - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
    rows = [{"input_ids": [rng.randrange(vocab) for _ in range(n)], "loss_mask": [1] * n} for n in lengths]
    return collate(rows, 0, one_row=True)


def run_one(args):
    """One configuration, in this process: prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from common.kernels.varlen_attention import NAME  # registers varlen_sdpa
    from common.logprobs import ModelSettings, token_logps
    from common.packing import to_device

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = Qwen2Config(**{**SHAPE, "num_hidden_layers": args.layers}, attn_implementation=NAME)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    model.train()
    model.minrlhf = ModelSettings(logps_chunk_tokens=args.chunk)
    if args.checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = to_device(packed_row(args.tokens, args.samples, SHAPE["vocab_size"]), device)

    def step():
        logps, _ = token_logps(model, batch)
        mask = batch["loss_mask"]
        loss = -(logps * mask).sum() / mask.sum()
        loss.backward()
        return loss.item()

    for _ in range(args.warmup):  # allocator, gradient buffers
        step()
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        held = rss_now()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens": args.tokens, "chunk": args.chunk, "checkpointing": args.checkpointing,
                      "peak_gb": peak / 1e9, "held_gb": held / 1e9, "tokens_per_s": args.tokens / seconds,
                      "loss": loss, "device": device}))


def rss_now():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--tokens", default="1024,2048,4096,8192", help="comma list of tokens per micro-batch")
    parser.add_argument("--chunks", default="1024", help="comma list of chunk sizes to measure beside whole logits")
    parser.add_argument("--checkpointing", default="off,on", help="off, on or both (comma list)")
    parser.add_argument("--samples", type=int, default=8, help="samples packed into the row")
    parser.add_argument("--steps", type=int, default=1, help="measured steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (0: the peak still counts)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--no_whole", action="store_true", help="skip the whole-logits rows")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.tokens = int(args.tokens)
        return run_one(args)

    chunks = ([] if args.no_whole else [0]) + [int(c) for c in args.chunks.split(",") if c]
    print(f"Qwen2.5-0.5B shape, {args.layers} layers, vocab {SHAPE['vocab_size']}, {args.dtype}, "
          f"{args.samples} samples per packed row, {args.steps} measured step(s) after {args.warmup} warm-up step(s)")
    print(f"{'tokens':>7} {'ckpt':>4} {'head':>12} {'peak GB':>8} {'held GB':>8} {'tokens/s':>9}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for ckpt in args.checkpointing.split(","):
            for chunk in chunks:
                head = "whole" if chunk == 0 else f"chunk {chunk}"
                need = estimate_bytes(tokens, args.layers, chunk, ckpt == "on", 2 if args.dtype == "bf16" else 4)
                if need > 0.9 * mem_available():
                    print(f"{tokens:>7} {ckpt:>4} {head:>12}  skipped: needs ~{need / 1e9:.1f} GB", flush=True)
                    continue
                cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--one", "--tokens", str(tokens), "--chunk",
                       str(chunk), "--checkpointing", ckpt, "--layers", str(args.layers), "--samples",
                       str(args.samples), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--dtype", args.dtype]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                if proc.returncode or not lines:
                    print(f"{tokens:>7} {ckpt:>4} {head:>12}  failed (exit {proc.returncode}): "
                          f"{proc.stderr.strip().splitlines()[-1:] or ''}", flush=True)
                    continue
                r = json.loads(lines[-1])
                print(f"{tokens:>7} {ckpt:>4} {head:>12} {r['peak_gb']:>8.2f} {r['held_gb']:>8.2f} "
                      f"{r['tokens_per_s']:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
