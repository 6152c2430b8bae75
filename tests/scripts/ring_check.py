"""Driver for tests/test_ring_attention.py, run under `torchrun --nproc_per_node 2` (gloo): a ring of the two
ranks against one process with full attention, written as max differences to a JSON file by rank 0.

    ring_check.py model  OUT MODEL_DIR...   per-token log-probs, per-sample sums, loss and gradients of packed
                                            rows (24 tokens, and 25: one pad token), --ring_head_stride 1 and 2,
                                            plus the negative control (the same split, no K/V exchange) and
                                            the chunked LM head (chunked ring = whole-logits ring = one process)
    ring_check.py step   OUT MODEL_DIR      one SGD step under DeepSpeed ZeRO-2 and ZeRO-3 with a ring of 2,
                                            against the same step taken by one process
    ring_check.py all    OUT MODEL_DIR...   both (the step on the last model)
    ... --zero3_head MODEL_DIR...           after the other arguments: the chunked LM head against whole logits
                                            under DeepSpeed ZeRO-3 on these models, each rank on its own row;
                                            and distill.py's token_losses of a plain student head beside an
                                            offloaded ZeRO-3 teacher on the first
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from common.infra.engine import (
    ModelArgs, TrainArgs, deepspeed_config, finish, init_distributed, load_causal_lm,
)
from common.infra.rings import RingArgs
from common.logprobs import ModelSettings, logps_chunk_tokens, token_logps
from common.packing import collate, per_sample_sum
from common.ring_attention import (
    NAME, check_ring_model, setup_ring,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a 24-token row whose second sample crosses the ranks' boundary (12); 25 tokens need one pad token
LENGTHS = {24: [5, 10, 7, 2], 25: [5, 10, 7, 3]}


def packed_row(total, seed=0):
    g = torch.Generator().manual_seed(seed + total)
    samples = []
    for n in LENGTHS[total]:
        ids = torch.randint(3, 250, (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)})
    return collate(samples, 0, packing=True, one_row=True)


@torch.no_grad()
def plant_hits(path, batch, every=4):
    """Set every `every`-th token of the row that is not a sample's first to the model's argmax prediction of it
    (left to right, each from the tokens before it), so that argmax hits are there to compare."""
    model, ids = load(path, "sdpa"), batch["input_ids"]
    for t in range(1, ids.shape[1], every):
        if batch["position_ids"][0, t] > 0:
            logits = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits
            ids[0, t] = logits[0, t - 1].argmax()
    return batch


def load(path, impl):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32)
    model.config.use_cache = False
    return model


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare_model(path, ring, total, exchange=True):
    """Max differences between the ring (or, exchange=False, the split without any K/V exchange) and one
    process's token_logps on one packed row: log-probs, per-sample sums, loss (relative), grads (relative)."""
    batch = packed_row(total)
    full_model = load(path, "sdpa")  # transformers' own sdpa: independent of the kernels under test
    want, _ = token_logps(full_model, batch)
    want_loss = -(want * batch["loss_mask"]).sum()
    want_loss.backward()
    model = load(path, NAME)
    check_ring_model(model, ring)
    call = model if exchange else (lambda **kw: model(**{k: v for k, v in kw.items() if k != "ring_params"}))
    calls = count_kernel_calls()
    got, _ = token_logps(call, batch, ring=ring)
    calls = count_kernel_calls() - calls
    loss = -(got * batch["loss_mask"]).sum()
    loss.backward()
    grads = {}
    for (name, p), (_, q) in zip(model.named_parameters(), full_model.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=ring.group)  # each rank holds its slice's share, ring size times over
        grads[name] = rel(g / ring.size, q.grad)
    return {
        "logps": (got - want).abs().max().item(),
        "sample_sums": (per_sample_sum(got * batch["loss_mask"], batch)
                        - per_sample_sum(want * batch["loss_mask"], batch)).abs().max().item(),
        "loss_rel": abs(loss.item() - want_loss.item()) / abs(want_loss.item()),
        "grads_rel": max(grads.values()),
        "same_on_ring": float(_spread(got.detach(), ring)),
        "kernel_calls": calls,
    }


def chunked_ring_check(path, ring, total=25, chunk=5):
    """The chunked LM head through the ring (chunks of 5 over each rank's slice of 13 tokens) against the ring
    with whole logits and against one process, on a row where some tokens are the argmax: log-probs, entropy and
    argmax hits of the row, and every gradient of a loss using both (the head weight's included), as max
    absolute differences."""
    batch = plant_hits(path, packed_row(total))
    weights = torch.linspace(0.5, 1.5, batch["input_ids"].shape[1])
    inside = batch["position_ids"] > 0  # the ring's entropy is 0 at a sample's first token, token_logps' is not

    def run(model, logps_fn):
        logps, outputs, hits = logps_fn(model, batch, return_argmax=True, return_entropy=True)
        mask = batch["loss_mask"]
        (-((logps * weights + 0.1 * outputs.entropy) * mask).sum() / mask.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return logps.detach(), outputs.entropy.detach(), hits, grads, outputs

    one = run(load(path, "sdpa"), token_logps)
    runs = {}
    for name, chunk_tokens in (("whole", 0), ("chunked", chunk)):
        model = load(path, NAME)
        model.minrlhf = ModelSettings(logps_chunk_tokens=chunk_tokens)
        *values, grads, outputs = run(model, lambda m, b, **kw: token_logps(m, b, ring=ring, **kw))
        for g in grads.values():
            dist.all_reduce(g, group=ring.group)  # each rank holds its slice's share, ring size times over
        runs[name] = (*values, {n: g / ring.size for n, g in grads.items()}, outputs)
    (c_logps, c_entropy, c_hits, c_grads, c_outputs), whole = runs["chunked"], runs["whole"]
    diffs = lambda a, b: max((a[n] - b[n]).abs().max().item() for n in a)  # noqa: E731
    return {
        "logps_vs_whole": (c_logps - whole[0]).abs().max().item(),
        "logps_vs_one": (c_logps - one[0]).abs().max().item(),
        "entropy_vs_whole": (c_entropy - whole[1]).abs().max().item(),
        "entropy_vs_one": (c_entropy - one[1])[inside].abs().max().item(),
        "hits_equal": bool(torch.equal(c_hits, whole[2]) and torch.equal(c_hits, one[2])), "hits": int(c_hits.sum()),
        "grads_vs_whole": diffs(c_grads, whole[3]), "grads_vs_one": diffs(c_grads, one[3]),
        "head_grad": c_grads["lm_head.weight"].abs().max().item(),
        "no_logits_made": c_outputs._outputs.logits.shape[1] == 0,
        "slice_logits": (c_outputs.logits - whole[4].logits).abs().max().item(),
    }


def zero3_head_check(path, chunk=16):
    """token_logps with the chunked LM head (chunks of 16) against whole logits under DeepSpeed ZeRO-3 (the head
    weight partitioned over both ranks), each rank on its own packed row (40 and 66 predictions: 3 and 5 chunks,
    the ranks must still gather the head as often), some tokens the argmax: log-probs, entropy, argmax hits and
    every full gradient (deepspeed.utils.safe_get_full_grad) of a loss using them, as max absolute differences
    over both ranks."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from common.packing import unwrap
    from common.kernels.chunked_head import uses_head_module

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    lengths = [7, 20, 14] if rank == 0 else [9, 30, 12, 16]
    samples = [{"input_ids": torch.randint(3, 250, (n,), generator=g).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)}
               for n in lengths]
    batch = plant_hits(path, collate(samples, 0, packing=True, one_row=True))
    weights = torch.linspace(0.5, 1.5, batch["input_ids"].shape[1])
    runs = {}
    for chunk_tokens in (0, chunk):
        train = TrainArgs(train_batch_size=world, micro_train_batch_size=1, zero_stage=3, max_norm=0.0,
                          param_dtype="fp32")
        ds_config = deepspeed_config(train, world)
        model = load_causal_lm(ModelArgs(pretrain=path, logps_chunk_tokens=chunk_tokens), ds_config)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=ds_config)
        head = unwrap(engine).lm_head
        assert logps_chunk_tokens(engine) == chunk_tokens and uses_head_module(head) and head.weight.numel() == 0
        logps, outputs, hits = token_logps(engine, batch, return_argmax=True, return_entropy=True)
        mask = batch["loss_mask"]
        engine.backward(-((logps * weights + 0.1 * outputs.entropy) * mask).sum() / mask.sum())
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        runs[chunk_tokens] = (logps.detach(), outputs.entropy.detach(), hits, grads)
    (logps, entropy, hits, grads), (c_logps, c_entropy, c_hits, c_grads) = runs[0], runs[chunk]
    head_name = "lm_head.weight" if "lm_head.weight" in grads else "model.embed_tokens.weight"  # tied: one name
    out = torch.tensor([(c_logps - logps).abs().max(), (c_entropy - entropy).abs().max(),
                        max((c_grads[n] - grads[n]).abs().max() for n in grads), float(not torch.equal(c_hits, hits))])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {"logps": out[0].item(), "entropy": out[1].item(), "grads": out[2].item(), "hits_differ": out[3].item(),
            "head_grad": grads[head_name].abs().max().item(), "tied": head_name != "lm_head.weight",
            "hits": int(hits.sum()), "same_grad_names": c_grads.keys() == grads.keys()}


def zero3_teacher_check(path, chunk=4):
    """distill.py's token_losses with --teacher_offload beside a student that is not ZeRO-3: the student's chunked
    head is a plain module, the live teacher's head ZeRO-3 partitioned with its parameters on the CPU, and each
    student chunk reads the teacher's logits of the same tokens (a collective gather). The ranks hold 5 and 13 loss
    tokens (2 and 4 chunks of 4), so they must agree on 4 to gather the teacher as often, in forward and in the
    backward's recompute. KD + CE losses and the student's gradients against whole logits, as max absolute
    differences over both ranks."""
    import importlib.util
    from types import SimpleNamespace

    import deepspeed

    from common.infra.engine import create_eval_engine, deepspeed_eval_config
    from common.kernels.chunked_head import HeadLogits
    from common.packing import unwrap

    spec = importlib.util.spec_from_file_location("distill", os.path.join(ROOT, "algos", "distill.py"))
    distill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(distill)
    rank, world = dist.get_rank(), dist.get_world_size()
    student_head = load(path, "sdpa").lm_head
    ds_config = deepspeed_eval_config(TrainArgs(train_batch_size=world, micro_train_batch_size=1,
                                                param_dtype="fp32"), world, offload=True)
    teacher = create_eval_engine(load_causal_lm(ModelArgs(pretrain=path), ds_config), ds_config)
    teacher_head = unwrap(teacher).lm_head
    assert teacher_head.weight.numel() == 0 and student_head.weight.numel() > 0
    g = torch.Generator().manual_seed(rank)
    tokens, (vocab, width) = (5, 13)[rank], student_head.weight.shape
    hidden, t_hidden = torch.randn(tokens, width, generator=g), 3 * torch.randn(tokens, width, generator=g)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    args = SimpleNamespace(teacher_top_k=0, divergence="forward_kl", jsd_beta=0.5, temperature=2.0)
    chunked_in = hidden.clone().requires_grad_()
    kd, ce, _ = distill.token_losses(HeadLogits(chunked_in, student_head, None, chunk),
                                     targets, HeadLogits(t_hidden, teacher_head, None, chunk).detach(), args, vocab)
    grads = torch.autograd.grad((kd + ce).sum(), [chunked_in, student_head.weight])
    with deepspeed.zero.GatheredParameters([teacher_head.weight]):
        t_weight = teacher_head.weight.detach().clone()
    whole_in = hidden.clone().requires_grad_()
    w_kd, w_ce, _ = distill.token_losses(student_head(whole_in).float(), targets, t_hidden @ t_weight.T, args, vocab)
    w_grads = torch.autograd.grad((w_kd + w_ce).sum(), [whole_in, student_head.weight])
    kd, ce, w_kd, w_ce = (t.detach() for t in (kd, ce, w_kd, w_ce))
    out = torch.tensor([(kd - w_kd).abs().max(), (ce - w_ce).abs().max(),
                        max((a - b).abs().max() for a, b in zip(grads, w_grads))])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    least = kd.min().detach()  # the KD term is not trivially 0 on either rank
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return {"kd": out[0].item(), "ce": out[1].item(), "grads": out[2].item(), "kd_min": least.item()}


def count_kernel_calls(_count=[0]):
    """Varlen kernel calls so far (ring-flash-attn's llama3 module calls it once per group of --ring_head_stride
    KV heads per layer): the first call puts a counter around the function that module imported."""
    from common.ring_attention import import_ring_flash_attn

    import_ring_flash_attn()  # (the module imports only through it, on CPU)
    llama3 = sys.modules["ring_flash_attn.llama3_flash_attn_varlen"]
    if not hasattr(llama3._flash_attn_varlen_forward, "counted"):
        kernel = llama3._flash_attn_varlen_forward

        def counted(*args, **kwargs):
            _count[0] += 1
            return kernel(*args, **kwargs)

        counted.counted = True  # (ring-flash-attn fills the arguments by name; the kernel's defaults do the rest)
        llama3._flash_attn_varlen_forward = counted
    return _count[0]


def _spread(x, ring):
    """Largest difference between the ring's ranks' copies of x."""
    lo, hi = x.clone(), x.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=ring.group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=ring.group)
    return (hi - lo).abs().max().item()


def model_checks(paths):
    out = {}
    for path in paths:
        arch = os.path.basename(path)
        for stride in (1, 2):
            ring = setup_ring(RingArgs(ring_attn_size=2, ring_head_stride=stride))
            for total in (24, 25):
                out[f"{arch}/stride{stride}/T{total}"] = compare_model(path, ring, total)
        out[f"{arch}/no_kv_exchange"] = compare_model(path, ring, 24, exchange=False)
        out[f"{arch}/chunked_head"] = chunked_ring_check(path, ring)
    return out


def step_checks(path):
    """One SGD step (lr 1, no clipping) with sft.py's loss normalisation: ring of 2 under ZeRO-2 / ZeRO-3 (the
    chunked LM head, chunks of 5) against plain torch on one process with whole logits; max parameter difference
    and the largest parameter change."""
    import deepspeed

    from common.infra.engine import gathered_state_dict

    batch = packed_row(25)
    ref = load(path, "sdpa")
    logps, _ = token_logps(ref, batch)
    tokens = batch["loss_mask"].sum()
    (-(logps * batch["loss_mask"]).sum() / tokens).backward()
    with torch.no_grad():
        want = {n: p - 1.0 * p.grad for n, p in ref.named_parameters()}
    ring = setup_ring(RingArgs(ring_attn_size=2, ring_head_stride=1))
    world, out = dist.get_world_size(), {}
    for stage in (2, 3):
        train = TrainArgs(train_batch_size=1, micro_train_batch_size=1, zero_stage=stage, max_norm=0.0)
        ds_config = deepspeed_config(train, world, ring_size=ring.size)
        model = load_causal_lm(ModelArgs(pretrain=path, attn_implementation=NAME, logps_chunk_tokens=5), ds_config)
        check_ring_model(model, ring)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        gas = ds_config["gradient_accumulation_steps"]
        step_tokens = batch["loss_mask"].sum().clone()
        dist.all_reduce(step_tokens)  # over the whole world: ring size x the row's loss tokens
        got, _ = token_logps(engine, batch, ring=ring)
        engine.backward(-(got * batch["loss_mask"]).sum() * (gas * world) / step_tokens)
        engine.step()
        state = gathered_state_dict(engine)
        if dist.get_rank() == 0:
            out[f"zero{stage}"] = {
                "param_diff": max((state[n].float() - w).abs().max().item() for n, w in want.items()),
                "largest_change": max((w - p).abs().max().item() for (n, w), p in zip(want.items(), ref.parameters())),
                "ds_train_batch_size": ds_config["train_batch_size"], "gas": gas,
            }
        dist.barrier()
    return out


if __name__ == "__main__":
    mode, out_file, *paths = sys.argv[1:]
    head_paths = paths[paths.index("--zero3_head") + 1:] if "--zero3_head" in paths else []
    paths = paths[: len(paths) - len(head_paths) - bool(head_paths)]
    init_distributed()
    torch.manual_seed(0)
    result = {**(model_checks(paths) if mode in ("model", "all") else {}),
              **(step_checks(paths[-1]) if mode in ("step", "all") else {}),
              **{f"zero3_head/{os.path.basename(p)}": zero3_head_check(p) for p in head_paths},
              **({"zero3_teacher": zero3_teacher_check(head_paths[0])} if head_paths else {})}
    result["flash_attn_imported"] = "flash_attn" in sys.modules
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    finish()
