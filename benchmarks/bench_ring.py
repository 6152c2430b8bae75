"""Ring attention on CPU: the contiguous split common/ring_attention.py uses (ring-flash-attn's llama3 varlen
path, as OpenRLHF) against the load-balanced zigzag split (ring-flash-attn's zigzag varlen path), same packed
row, same CPU kernels, attention forward + backward only.

    torchrun --nproc_per_node 2 -m benchmarks.bench_ring                 # ring of 2, bf16, 8 samples x 1024

Contiguous: rank r keeps tokens [r L/N, (r+1) L/N) of the row; its queries attend to every key before them,
so under causal attention the last rank does most of the work (rank 0 of 2 ~1/4 of the score blocks, rank 1
~3/4) while the first waits at the gather. Zigzag: every sample is cut into 2N chunks and rank r keeps
chunks r and 2N-1-r, so each rank does the same work, at the price of N ring passes of K/V (send/recv) in
place of one all-gather, and every sample length a multiple of 2N. bf16: ring-flash-attn's zigzag backward is
wrong in fp32 on CPU (../shared/reference/ring-attention-notes.md); both paths are checked against one process
attending the whole row (max |out diff|, max |dq diff|) before the timings. A step's time is the slowest rank's.
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro

from common.ring_attention import import_ring_flash_attn
from common.kernels.varlen_attention import varlen_attention_forward


@dataclass
class Args:
    samples: int = 8
    """Samples in the packed row."""
    sample_len: int = 1024
    """Mean sample length in tokens (lengths vary by up to +-50 %, rounded to a multiple of 2 x ring size)."""
    heads: int = 8
    """Query heads."""
    kv_heads: int = 4
    """Key / value heads (grouped-query attention)."""
    head_dim: int = 64
    """Head dimension."""
    steps: int = 5
    """Timed forward + backward steps per split (after one warm-up step)."""
    seed: int = 0
    """Seed of the lengths and the inputs."""
    dtype: str = "bf16"
    """bf16, or fp32 (where ring-flash-attn's zigzag backward is wrong on CPU: its dq check fails)."""


def packed_inputs(args, world):
    """q, k, v of the whole row (bf16, same on every rank) and its cu_seqlens."""
    g = torch.Generator().manual_seed(args.seed)
    unit = 2 * world
    lengths = [max(unit, round(args.sample_len * (0.5 + torch.rand(1, generator=g).item()) / unit) * unit)
               for _ in range(args.samples)]
    total = sum(lengths)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    q, k, v = (torch.randn(total, h, args.head_dim, generator=g).to(dtype) for h in (args.heads, args.kv_heads,
                                                                                      args.kv_heads))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, cu, lengths


def reference(q, k, v, lengths):
    """One process, the whole row: the varlen_sdpa kernel; returns out and dq for a fixed upstream gradient."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    out, _ = varlen_attention_forward(None, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], None, scaling=q.shape[-1] ** -0.5,
                                      position_ids=position_ids)
    out = out[0]
    out.backward(upstream(out))
    return out.detach(), q.grad


def upstream(out):
    """A fixed gradient for the whole row's output (each rank takes its tokens' rows)."""
    return torch.linspace(-1, 1, out.numel(), dtype=torch.float32).view(out.shape)


def contiguous_index(cu, rank, world):
    total = int(cu[-1])
    return torch.arange(rank * total // world, (rank + 1) * total // world)


def zigzag_index(cu, rank, world):
    """Chunks rank and 2N-1-rank of every sample, in row order."""
    parts = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        chunk = (end - start) // (2 * world)
        for c in (rank, 2 * world - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts)


def run_split(name, q, k, v, cu, args, grad_out):
    """(out, dq) of this rank's tokens, and per-step seconds (wall, this rank), for one split."""
    rank, world = dist.get_rank(), dist.get_world_size()
    llama3, prepare = import_ring_flash_attn()
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func  # bound to the same kernels by that import

    index = (contiguous_index if name == "contiguous" else zigzag_index)(cu, rank, world)
    scale = args.head_dim ** -0.5
    lengths = (cu[1:] - cu[:-1]).tolist()

    def step():
        ql, kl, vl = (t[index].detach().clone().requires_grad_() for t in (q, k, v))
        if name == "contiguous":
            cu_q, cu_k, max_q, max_k, k_slice = prepare(cu, True, rank, world)
            out = llama3(ql, kl, vl, cu_q, cu_k, max_q, max_k, 1, k_slice, softmax_scale=scale, causal=True,
                         group=dist.group.WORLD)
        else:
            local_cu = cu // world
            out = zigzag_ring_flash_attn_varlen_func(ql, kl, vl, local_cu, max(lengths) // world,
                                                     softmax_scale=scale, causal=True, group=dist.group.WORLD)
        out.backward(grad_out[index].to(out.dtype))
        return out.detach(), ql.grad

    step()  # warm-up
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        out, dq = step()
        times.append(time.perf_counter() - t0)
    return index, out, dq, times


def main(args: Args):
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, cu, lengths = packed_inputs(args, world)
    ref_out, ref_dq = reference(q, k, v, lengths)
    if rank == 0:
        print(f"ring of {world}, {args.dtype}, {args.samples} samples, {int(cu[-1])} tokens, {args.heads} heads "
              f"({args.kv_heads} KV) x {args.head_dim}; {args.steps} timed forward + backward steps")
    for name in ("contiguous", "zigzag"):
        index, out, dq, times = run_split(name, q, k, v, cu, args, upstream(ref_out))
        out_diff = (out.float() - ref_out[index]).abs().max().item()
        dq_diff = (dq.float() - ref_dq[index]).abs().max().item()
        mean = torch.tensor([sum(times) / len(times), out_diff, dq_diff], dtype=torch.float64)
        gathered = [torch.zeros_like(mean) for _ in range(world)]
        dist.all_gather(gathered, mean)
        if rank == 0:
            per_rank = ", ".join(f"rank {r} {g[0]:.3f} s" for r, g in enumerate(gathered))
            worst = max(g[0].item() for g in gathered)
            print(f"{name:>10}: step {worst:.3f} s (slowest rank; {per_rank}); "
                  f"max |out diff| {max(g[1].item() for g in gathered):.2e}, "
                  f"max |dq diff| {max(g[2].item() for g in gathered):.2e} vs one process "
                  f"(max |out| {ref_out.abs().max():.2f}, max |dq| {ref_dq.abs().max():.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Args))
