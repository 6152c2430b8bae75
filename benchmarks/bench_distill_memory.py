"""Peak memory of algos/distill.py's loss at a real vocabulary: both LM heads chunked against whole logits.

The heads alone, at Qwen2.5-0.5B's shape (hidden 896, vocabulary 151,936; random weights): a student head and a
teacher head, and `tokens` response tokens' final hidden states of each. One measured step is distill.token_losses
(--divergence, --teacher_top_k) forward and backward to the student's hidden states and head weight. Chunked: both
as common.kernels.chunked_head.HeadLogits of --logps_chunk_tokens; whole (chunk 0): each (tokens x vocab) logits
made by one matmul, as a model's own head makes them. Each configuration runs in a fresh subprocess so peaks do not
carry over: peak RSS (ru_maxrss) on CPU, torch.cuda.max_memory_allocated on CUDA, beside the memory held before the
step (weights and hidden states).

    python -m benchmarks.bench_distill_memory --tokens 512,1024 --chunks 0,256
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, VOCAB = 896, 151936


def peak_gib():
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure(tokens, chunk, divergence, top_k):
    """One configuration in this process: {"before", "peak" (GiB), "seconds"}."""
    import importlib.util

    import torch

    from common.kernels.chunked_head import HeadLogits

    spec = importlib.util.spec_from_file_location("distill", os.path.join(ROOT, "algos", "distill.py"))
    distill = importlib.util.module_from_spec(spec)
    sys.modules["distill"] = distill
    spec.loader.exec_module(distill)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(dev).manual_seed(0)
    student_w = (0.02 * torch.randn(VOCAB, HIDDEN, generator=gen, device=dev)).requires_grad_()
    teacher_w = 0.02 * torch.randn(VOCAB, HIDDEN, generator=gen, device=dev)
    student_h = torch.randn(tokens, HIDDEN, generator=gen, device=dev, requires_grad=True)
    teacher_h = torch.randn(tokens, HIDDEN, generator=gen, device=dev)
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen, device=dev)
    args = distill.Args(teacher_model="-", divergence=divergence, teacher_top_k=top_k)
    before = peak_gib()
    t0 = time.perf_counter()
    if chunk:
        heads = [torch.nn.Linear(HIDDEN, VOCAB, bias=False, device="meta") for _ in range(2)]
        heads[0].weight, heads[1].weight = torch.nn.Parameter(student_w), torch.nn.Parameter(teacher_w, False)
        student = HeadLogits(student_h, heads[0], None, chunk)
        teacher = HeadLogits(teacher_h, heads[1], None, chunk, frozen=True)
    else:
        student, teacher = student_h @ student_w.T, teacher_h @ teacher_w.T
    kd, ce, _ = distill.token_losses(student, targets, teacher, args, VOCAB)
    ((0.5 * kd.sum() + 0.5 * ce.sum()) / tokens).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"before": before, "peak": peak_gib(), "seconds": time.perf_counter() - t0}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="512,1024", help="comma list of response tokens per micro-batch")
    parser.add_argument("--chunks", default="0,256", help="comma list of --logps_chunk_tokens (0: whole logits)")
    parser.add_argument("--divergence", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--teacher_top_k", type=int, default=0)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "tokens,chunk": measure in this process, print JSON
    args = parser.parse_args()
    if args.one:
        tokens, chunk = map(int, args.one.split(","))
        print(json.dumps(measure(tokens, chunk, args.divergence, args.teacher_top_k)))
        return
    print(f"distill.token_losses forward + backward, hidden {HIDDEN}, vocab {VOCAB:,}, {args.divergence}, "
          f"top-k {args.teacher_top_k or 'all'}, fp32")
    print(f"{'tokens':>7} {'chunk':>6} {'before GiB':>11} {'peak GiB':>9} {'added GiB':>10} {'seconds':>8}")
    for tokens in map(int, args.tokens.split(",")):
        for chunk in map(int, args.chunks.split(",")):
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_distill_memory", "--one", f"{tokens},{chunk}",
                                  "--divergence", args.divergence, "--teacher_top_k", str(args.teacher_top_k)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{tokens:>7} {chunk or 'whole':>6} {r['before']:>11.2f} {r['peak']:>9.2f} "
                  f"{r['peak'] - r['before']:>10.2f} {r['seconds']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
