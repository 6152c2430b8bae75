"""Driver for tests/test_logp_gap.py, run under `torchrun --nproc_per_node 2` (gloo): the trainer-vLLM log-prob gap at
a real shape, through every path that computes the trainer's log-probs. Per dtype (fp32; bf16: the trainer's bf16
autocast against a bf16 engine) one vLLM engine on rank 0 serves every path: a DeepSpeed trainer of the path takes
one optimizer step (AdamW, lr 2e-2: every weight moves, LoRA's B leaves 0), its weights go into the engine
(WeightSync: ZeRO-3 gathered, LoRA merged), the engine samples --prompts prompts at temperature 1 and reports each
sampled token's log-prob, and the trainer scores the same samples through the path (token_logps). logp_gap gives
the figures grpo.py logs every step. Paths:

    default               ZeRO as resolved for 2 ranks, full fine-tune, one packed row, the chunked LM head
    default_whole_logits  the same trainer and samples, whole logits (--logps_chunk_tokens 0)
    optin                 ZeRO-3, LoRA (rank 8), a ring of 2 (the row split over both ranks), the chunked head

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.scripts.logp_gap_check MODEL OUT.json

Writes {"<dtype>/<path>": {mismatch_kl, logp_abs_diff_mean, logp_abs_diff_max, tokens, entropy}, "seconds": ...}.
A random model at the default initialisation spreads its next-token distribution nearly evenly over the 151,936
tokens, where any two computations agree: GAP_INIT_STD peaks it (the entropy is in the result).
"""

import argparse
import dataclasses
import gc
import json
import time

import torch

SEED = 0
GAP_INIT_STD = 0.1  # initializer_range of the gap's model: logits of std ~3, as a trained LM's, entropy ~7.6 of 11.93
CHUNK_TOKENS = 32  # the chunked head's chunk: a few chunks per scored row
LEARNING_RATE = 2e-2
PATHS = {"default": {"zero_stage": None, "lora_rank": 0, "ring_attn_size": 1},
         "optin": {"zero_stage": 3, "lora_rank": 8, "ring_attn_size": 2}}


def build_gap_model(path, **overrides):
    """The 2-layer model of Qwen2.5-0.5B's shape and vocabulary with GAP_INIT_STD weights, saved to `path`."""
    from benchmarks.bench_real_shape import build_real_shape

    return build_real_shape(path, **{"num_hidden_layers": 2, "initializer_range": GAP_INIT_STD, **overrides})


def logp_gap(trainer, sampler):
    """The gap between the trainer's and the sampler's log-probs of the sampled tokens (one list per sample each),
    over every token, as grpo.py's actor loss logs it: mismatch_kl (k3 of KL(sampler || trainer) per token),
    logp_abs_diff_mean and logp_abs_diff_max."""
    log_ratio = (torch.tensor([x for s in trainer for x in s], dtype=torch.float64)
                 - torch.tensor([x for s in sampler for x in s], dtype=torch.float64))
    k3 = torch.exp(log_ratio.clamp(-20, 20)) - 1 - log_ratio
    return {"mismatch_kl": k3.mean().item(), "logp_abs_diff_mean": log_ratio.abs().mean().item(),
            "logp_abs_diff_max": log_ratio.abs().max().item(), "tokens": log_ratio.numel()}


@torch.no_grad()
def scored(model, samples, one_row, device="cpu"):
    """The trainer's log-prob of each sample's response tokens (samples: (prompt ids, response ids)) in one packed
    batch through token_logps, and the mean entropy of the distributions they were drawn from."""
    from common.logprobs import token_logps
    from common.packing import collate, to_device

    rows = [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)} for p, r in samples]
    batch = collate(rows, 0, one_row=one_row, max_tokens=sum(len(r["input_ids"]) for r in rows))
    logps, outputs = token_logps(model, to_device(batch, device), return_entropy=True)
    picks = [(row, start + len(p), start + n) for (p, _), (row, start, n) in zip(samples, batch["spans"])]
    entropy = torch.cat([outputs.entropy[row, a:b].float() for row, a, b in picks]).mean().item()
    return [logps[row, a:b].float().tolist() for row, a, b in picks], entropy


def train_rows(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(), "loss_mask": [1] * length}
            for _ in range(n)]


def one_step(engine, world, vocab):
    """One AdamW step on random rows (this rank's share; the ranks of a ring take the same one)."""
    from common.infra.engine import optimizer_step
    from common.logprobs import model_settings, token_logps
    from common.packing import collate

    engine.train()
    rows = train_rows(2, 24, vocab, SEED + 1 + world.dp_rank)
    batch = collate(rows, 0, one_row=model_settings(engine).layout.one_row, max_tokens=48)
    logps, _ = token_logps(engine, batch)
    engine.backward(-(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    optimizer_step(engine)
    engine.eval()


def path_gap(model_path, dtype, path, sync, llm, prompts, tokens, vocab):
    """One path's figures ({path: figures}; the default path also through whole logits)."""
    import torch.distributed as dist

    from common.infra.engine import ModelArgs, TrainArgs, setup, train_engine
    from common.infra.rings import RingArgs, ring_model_args
    from common.infra.vllm_engine import SamplingArgs, vllm_generate
    from common.kernels.chunked_head import hf_model
    from common.logprobs import logps_chunk_tokens, model_settings

    spec = PATHS[path]
    ring = RingArgs(ring_attn_size=spec["ring_attn_size"])
    world = setup(ring, SEED)
    model_args = ring_model_args(ModelArgs(pretrain=model_path, lora_rank=spec["lora_rank"],
                                           logps_chunk_tokens=CHUNK_TOKENS), ring)
    train = TrainArgs(train_batch_size=2 * world.dp_world, micro_train_batch_size=2, zero_stage=spec["zero_stage"],
                      learning_rate=LEARNING_RATE, lr_warmup_ratio=0.0, lr_scheduler="constant", param_dtype=dtype)
    engine = train_engine(model_args, train, 1, world)
    one_step(engine, world, vocab)
    sync.sync(engine)
    shared = [None]
    if llm is not None:
        sampling = SamplingArgs(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
        out = vllm_generate(llm, prompts, sampling, seeds=[SEED + i for i in range(len(prompts))])
        shared = [[(s.prompt_ids, s.output_ids, s.logprobs) for group in out for s in group]]
    dist.broadcast_object_list(shared, src=0)
    samples, sampler = [(p, r) for p, r, _ in shared[0]], [lp for _, _, lp in shared[0]]
    results = {}
    for name in [path, "default_whole_logits"] if path == "default" else [path]:
        if name == "default_whole_logits":
            hf_model(engine).minrlhf = dataclasses.replace(model_settings(engine), logps_chunk_tokens=0)
        trainer, entropy = scored(engine, samples, model_settings(engine).layout.one_row)
        with torch.no_grad():
            chunk = logps_chunk_tokens(engine)
        results[name] = {**logp_gap(trainer, sampler), "entropy": entropy, "chunk_tokens": chunk,
                         "zero_stage": engine.zero_optimization_stage()}
    engine.destroy()
    del engine
    gc.collect()
    return results


def main():
    import torch.distributed as dist

    from common.infra.engine import finish, init_distributed
    from common.infra.vllm_engine import EngineArgs, create_vllm_engine
    from common.infra.weight_sync import WeightSync

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24, help="sampled tokens per prompt")
    args = parser.parse_args()
    init_distributed()
    rank, start = dist.get_rank(), time.time()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]
    results, seconds = {}, {}
    for dtype in args.dtypes.split(","):
        t = time.time()
        bf16 = dtype == "bf16"
        llm = None
        if rank == 0:
            engine_args = EngineArgs(max_model_len=args.prompt_tokens + args.tokens, vllm_max_num_seqs=args.prompts)
            llm = create_vllm_engine(args.model, engine_args, bf16=bf16)
        sync = WeightSync([llm] if llm else [], colocated=True, dtype=torch.bfloat16 if bf16 else None)
        seconds[f"{dtype}/engine"] = time.time() - t
        for path in args.paths.split(","):
            t = time.time()
            for name, figures in path_gap(args.model, dtype, path, sync, llm, prompts, args.tokens, vocab).items():
                results[f"{dtype}/{name}"] = figures
            seconds[f"{dtype}/{path}"] = time.time() - t
    seconds["total"] = time.time() - start
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({**results, "seconds": seconds}, f, indent=1)
        print(json.dumps({**results, "seconds": seconds}, indent=1))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
