"""Weight-sync and generation throughput of the vLLM layer (common/infra/vllm_engine.py).

    python -m benchmarks.bench_sync --model assets/llama-10m

Prints (1) WeightSync.sync MB/s (gather + bucketed broadcast + vLLM layerwise reload + prefix-cache
reset, through vLLM's weight-transfer API)
against a raw broadcast of the same bytes over the same gloo group, and (2) generation tokens/s for
a batch of prompts with n samples each. Run it on an idle machine: on CPU everything shares cores.
"""

import time
from dataclasses import dataclass

import torch
import tyro

from common.infra.vllm_engine import EngineArgs, SamplingArgs, create_vllm_engine, vllm_generate
from common.infra.weight_sync import WeightSync, _broadcast_from_0, _in_thread


@dataclass
class Args:
    model: str = "assets/llama-10m"
    """Hugging Face causal-LM directory (vLLM engine and trainer-side copy)."""
    repeats: int = 3
    """Timed syncs (and raw broadcasts)."""
    bucket_mb: int = 64
    """Bucket size of the sync in MB."""
    prompts: int = 32
    """Prompts in the generation batch."""
    n: int = 4
    """Samples per prompt."""
    max_new_tokens: int = 64
    """Tokens generated per sample (EOS ignored, so every sample has exactly this many)."""


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    from transformers import AutoModelForCausalLM

    llm = create_vllm_engine(args.model, EngineArgs(max_model_len=256))
    model = AutoModelForCausalLM.from_pretrained(args.model)
    sync = WeightSync([llm], colocated=True, bucket_bytes=args.bucket_mb << 20)
    sync.sync(model)  # warm-up
    t0 = time.time()
    for _ in range(args.repeats):
        stats = sync.sync(model)
    sync_s = (time.time() - t0) / args.repeats
    numel = stats["bytes"] // 4
    receiving = _in_thread(llm.collective_rpc, "receive_raw", None, (numel, args.repeats))
    flat = torch.randn(numel)
    t0 = time.time()
    for _ in range(args.repeats):
        _broadcast_from_0(sync.transfer.group, flat)
    receiving.result()
    raw_s = (time.time() - t0) / args.repeats
    mb = stats["bytes"] / 2**20
    print(f"model {args.model}: {stats['tensors']} tensors, {mb:.1f} MB, torch threads {torch.get_num_threads()}")
    print(f"{'path':<34}{'s/sync':>9}{'MB/s':>9}")
    print(f"{'WeightSync.sync (all steps)':<34}{sync_s:>9.3f}{mb / sync_s:>9.1f}")
    print(f"{'raw gloo broadcast, same bytes':<34}{raw_s:>9.3f}{mb / raw_s:>9.1f}")

    prompt_ids = [[3] + [100 + (i * 7 + k) % 150 for k in range(16)] for i in range(args.prompts)]
    sampling = SamplingArgs(n=args.n, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=0)
    vllm_generate(llm, prompt_ids[:2], sampling)  # warm-up
    t0 = time.time()
    out = vllm_generate(llm, prompt_ids, sampling)
    seconds = time.time() - t0
    tokens = sum(len(s.output_ids) for per_prompt in out for s in per_prompt)
    print(f"generation: {args.prompts} prompts x n={args.n} x {args.max_new_tokens} tokens = {tokens} tokens "
          f"in {seconds:.2f} s: {tokens / seconds:.0f} tokens/s")
