"""Direct preference optimisation: DPO, IPO (--ipo) and conservative DPO (--label_smoothing), with an
optional NLL term on the chosen response (--nll_loss_coef).

    torchrun --nproc_per_node 2 algos/dpo.py --pretrain outputs/sft \\
        --dataset assets/data/reverse/pref_train.jsonl --eval_dataset assets/data/reverse/pref_test.jsonl \\
        --apply_chat_template --max_len 64 --beta 0.1 --learning_rate 3e-4 --save_path outputs/dpo

Each row holds a prompt, a chosen and a rejected response.  log π(y) is the sum of the log-probs of
the response tokens, h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)), and the loss
of a pair is -(1-ε)·log σ(βh) - ε·log σ(-βh) (DPO; ε = --label_smoothing), or (h - 1/(2β))² (IPO).
Chosen and rejected responses run in one packed forward; with the CPU kernel (varlen_sdpa) each rejected
response is a branch of its chosen sample's prompt, so the prompt is computed once per pair (equal to two
whole samples: tests/test_packing.py; common.packing.collate's share_prefixes).

Normalisation: the loss is the mean over all pairs of the optimizer step.  Every micro-batch holds
--micro_train_batch_size pairs, so the micro-batch mean, which DeepSpeed divides by the accumulation
steps and averages over ranks, is that global mean.  The NLL term is the mean over the chosen
responses of their per-token mean NLL (as OpenRLHF: per sample, not SFT's global token mean).

Logged per pair (means), under train/ and eval/: loss (the preference loss), nll_loss (without its
coefficient), rewards/chosen and rewards/rejected (β·(log π - log π_ref)), rewards/accuracy (chosen
reward > rejected), rewards/margin, logps/chosen, logps/rejected, logps/ref_chosen, logps/ref_rejected.

Reference model (--ref_pretrain, default --pretrain): with --ref_cache (the default) it runs once,
before the policy loads, over the training and eval pairs (sharded over the ranks); the sums of its
response log-probs are kept in memory per sample index (two floats a pair) and the model is freed.
The cache lives for one run: it is recomputed at every start, resumes included, so it always matches
that run's data, reference model and options.  --no_ref_cache keeps the reference beside the policy
and runs it on every micro-batch (ZeRO-3 partitioned when training uses ZeRO-3; --ref_offload keeps
its parameters on the CPU, in the cache pass too).  A plain `python algos/dpo.py` is a world of one.
"""

import gc
import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # algos/.. (README: Forking)
if importlib.util.find_spec("common") is None:
    sys.exit(f"error: {__file__} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>")
from common.data import BadRow, DataArgs, format_prompt, format_response, get_field  # noqa: E402
from common.infra.datasets import load_tokenizer, prepare_dataset, rank0_first, tokenization_cache_key  # noqa: E402
from common.infra.engine import (  # noqa: E402
    CkptArgs, ModelArgs, TrainArgs, all_reduce_sum, backward_step, device, frozen_engine, is_rank0, maybe_save,
    parse_cli, resume, run, save_hf_model, script_ckpt_args, setup, train_engine, validate_common_args,
    validate_data_args, world_size_from_env,
)
from common.infra.rings import RingArgs, ring_model_args, validate_ring_args  # noqa: E402
from common.logprobs import model_settings, response_logps, sharded_logps  # noqa: E402
from common.packing import collate, per_sample_sum, to_device  # noqa: E402
from common.infra.tracking import LogArgs, MetricsLogger, eval_due, progress  # noqa: E402


@dataclass
class PrefDataArgs(DataArgs):
    input_key: Annotated[str, tyro.conf.arg(aliases=("--prompt_key",))] = "prompt"
    """Field holding the prompt (a string, or a list of chat messages ending with a user turn)."""


@dataclass
class Args:
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=lambda: TrainArgs(learning_rate=5e-7))
    data: PrefDataArgs = field(default_factory=PrefDataArgs)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    log: LogArgs = field(default_factory=LogArgs)
    ring: RingArgs = field(default_factory=RingArgs)
    chosen_key: str = "chosen"
    """Field holding the preferred response (a string)."""
    rejected_key: str = "rejected"
    """Field holding the dispreferred response (a string)."""
    beta: float = 0.1
    """DPO temperature β: strength of the implicit KL constraint to the reference."""
    ipo: bool = False
    """IPO: squared loss (h - 1/(2β))² instead of the sigmoid loss."""
    label_smoothing: float = 0.0
    """Conservative DPO: probability ε in [0, 0.5) that a preference label is flipped."""
    nll_loss_coef: float = 0.0
    """Weight of the NLL term on the chosen response (per-sample token mean; 0: off)."""
    ref_pretrain: Optional[str] = None
    """Reference model directory (default: --pretrain)."""
    ref_offload: bool = False
    """Keep the reference model's parameters on the CPU (ZeRO-3 inference)."""
    ref_cache: bool = True
    """Cache reference log-probs in one pass before training, then free the reference (--no_ref_cache: run it live)."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    dp_world = validate_ring_args(args.ring, world_size_from_env(), args.model, args.data)  # world / ring size
    args.model = ring_model_args(args.model, args.ring)  # the ring is the attention implementation
    validate_common_args(args.model, args.train, args.ckpt, dp_world)
    validate_data_args(args.data, args.model.attn_implementation)
    if args.beta <= 0:
        raise ValueError(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {args.label_smoothing}")
    if args.ipo and args.label_smoothing > 0:
        raise ValueError("--label_smoothing applies to the sigmoid DPO loss, not to --ipo")
    if args.nll_loss_coef < 0:
        raise ValueError(f"--nll_loss_coef must be >= 0, got {args.nll_loss_coef}")
    return args


# ----------------------------------------------------------------------------------------------
# Data: a row -> prompt, chosen and rejected token ids  (forkers edit this)
# ----------------------------------------------------------------------------------------------
def tokenize(tokenizer, text, add_special_tokens=False):
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def pref_row(row, tokenizer, args: Args):
    """One row -> {"prompt_ids", "chosen_ids", "rejected_ids"}; raises BadRow naming the field."""
    data = args.data
    prompt = get_field(row, data.input_key)
    out = {"prompt_ids": tokenize(tokenizer, format_prompt(prompt, tokenizer, data), not data.apply_chat_template)}
    for key, name in ((args.chosen_key, "chosen_ids"), (args.rejected_key, "rejected_ids")):
        response = get_field(row, key)
        if not isinstance(response, str):
            raise BadRow(f"field {key!r} should be a string (the response), got {type(response).__name__}")
        out[name] = tokenize(tokenizer, format_response(prompt, response, tokenizer, data))
        if len(out["prompt_ids"]) + len(out[name]) > data.max_len:
            raise BadRow(f"prompt + {key!r} is {len(out['prompt_ids']) + len(out[name])} tokens, "
                         f"more than --max_len {data.max_len}")
    return out


def pair_samples(ds, indices):
    """The chosen samples of the pairs `indices`, then their rejected samples (one packed forward); each
    rejected sample names the prompt it shares with its chosen one (make_batch lays it out once where the
    kernel reads branches)."""
    rows = ds[list(indices)]
    chosen = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)}
              for p, c in zip(rows["prompt_ids"], rows["chosen_ids"])]
    rejected = [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r), "prefix_of": i, "prefix_len": len(p)}
                for i, (p, r) in enumerate(zip(rows["prompt_ids"], rows["rejected_ids"]))]
    return chosen + rejected


def make_batch(samples, args, pad_id, layout):
    """Packed rows (one row where `layout.one_row`, see common.packing.Layout), or padded rows; where the kernel
    reads branches (`layout.share_prefixes`), rejected responses as branches of their chosen samples' prompts; on
    the device."""
    batch = collate(samples, pad_id, packing=args.data.packing_samples,
                    max_tokens=args.data.pack_max_tokens or args.data.max_len, one_row=layout.one_row,
                    share_prefixes=args.data.packing_samples and layout.share_prefixes)
    return to_device(batch, device())


# ----------------------------------------------------------------------------------------------
# Log-probs and loss  (forkers edit dpo_loss)
# ----------------------------------------------------------------------------------------------
def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, ipo=False, label_smoothing=0.0):
    """Per-pair losses and the implicit rewards β·(log π - log π_ref) of chosen and rejected."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if ipo:
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def chosen_nll(chosen, chosen_tokens):
    """NLL term per pair: the chosen response's per-token mean NLL."""
    return -(chosen / chosen_tokens)


def pair_stats(losses, chosen_rewards, rejected_rewards, chosen, rejected, ref_chosen, ref_rejected):
    """Sums over pairs of what is logged (divided by the pair count by the caller)."""
    return {
        "loss": losses.detach().sum().item(),
        "rewards/chosen": chosen_rewards.sum().item(),
        "rewards/rejected": rejected_rewards.sum().item(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).sum().item(),
        "rewards/margin": (chosen_rewards - rejected_rewards).sum().item(),
        "logps/chosen": chosen.detach().sum().item(),
        "logps/rejected": rejected.detach().sum().item(),
        "logps/ref_chosen": ref_chosen.sum().item(),
        "logps/ref_rejected": ref_rejected.sum().item(),
    }


@torch.no_grad()
def evaluate(engine, ref, eval_ds, eval_ref, args, batch_fn):
    """Preference loss, implicit-reward accuracy (chosen > rejected), rewards and log-probs over the
    held-out pairs; `eval_ref` holds cached reference log-probs, else `ref` runs."""
    engine.eval()
    n, micro = len(eval_ds), args.train.micro_train_batch_size
    samples_of = lambda idx: pair_samples(eval_ds, idx)  # noqa: E731
    policy = sharded_logps(engine, n, samples_of, micro, batch_fn, device())
    if eval_ref is None:
        eval_ref = sharded_logps(ref, n, samples_of, micro, batch_fn, device())
    engine.train()
    losses, r_w, r_l = dpo_loss(policy[:, 0], policy[:, 1], eval_ref[:, 0], eval_ref[:, 1], args.beta, args.ipo,
                                args.label_smoothing)
    stats = pair_stats(losses, r_w, r_l, policy[:, 0], policy[:, 1], eval_ref[:, 0], eval_ref[:, 1])
    return {f"eval/{k}": v / n for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    world = setup(args.ring, args.train.seed)  # ranks, data-parallel share, ring
    tokenizer = load_tokenizer(args.model.pretrain, args.data)

    # rank 0 tokenizes first and fills the datasets cache; the others then read it (a data error stops all)
    row_fn, columns = (lambda r: pref_row(r, tokenizer, args)), ("prompt_ids", "chosen_ids", "rejected_ids")
    cache_key = tokenization_cache_key(__file__, tokenizer, args)

    def prepare():
        train = prepare_dataset(args.data.dataset, args.data.dataset_split, row_fn, columns, args.data, cache_key,
                                probs=args.data.dataset_probs, seed=args.train.seed, max_samples=args.data.max_samples)
        return train, args.data.eval_dataset and prepare_dataset(
            args.data.eval_dataset, args.data.eval_split, row_fn, columns, args.data, cache_key)

    train_ds, eval_ds = rank0_first(prepare)

    batch_size, micro = args.train.train_batch_size, args.train.micro_train_batch_size
    steps_per_epoch = len(train_ds) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_ds)} training pairs is fewer than --train_batch_size {batch_size}")
    total_steps = steps_per_epoch * args.train.max_epochs
    pad_id = tokenizer.pad_token_id

    # the frozen reference: cache its log-probs and free it, or keep it for live use
    ref_args = ModelArgs(pretrain=args.ref_pretrain or args.model.pretrain,
                         attn_implementation=args.model.attn_implementation, load_in_4bit=args.model.load_in_4bit)
    ref = frozen_engine(ref_args, args.train, world, offload=args.ref_offload)
    layout = model_settings(ref).layout  # the policy's too: the same attention kernel
    batch_fn = lambda samples: make_batch(samples, args, pad_id, layout)  # noqa: E731
    ref_cache = eval_ref_cache = None
    if args.ref_cache:
        t0 = time.time()
        ref_cache = sharded_logps(ref, len(train_ds), lambda idx: pair_samples(train_ds, idx), micro, batch_fn,
                                  device())
        if eval_ds:
            eval_ref_cache = sharded_logps(ref, len(eval_ds), lambda idx: pair_samples(eval_ds, idx), micro, batch_fn,
                                           device())
        ref.destroy()
        ref = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if is_rank0():
            print(f"cached reference log-probs of {len(train_ds)} training and {len(eval_ds) if eval_ds else 0} eval "
                  f"pairs in {time.time() - t0:.1f}s; reference model freed")

    engine = train_engine(args.model, args.train, total_steps, world)
    state = resume(engine, args.ckpt)
    start_step = state["global_step"] if state else 0
    logger = MetricsLogger(args.log, asdict(args), is_rank0())

    bar = progress(range(start_step, total_steps), is_rank0(), desc="dpo", initial=start_step, total=total_steps)
    for step in bar:
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(args.train.seed + epoch))
        step_indices = order[k * batch_size : (k + 1) * batch_size].tolist()
        local = world.shard(step_indices)

        lr = engine.get_lr()[0]
        sums = {}
        for m in range(0, len(local), micro):
            idx = local[m : m + micro]
            batch = batch_fn(pair_samples(train_ds, idx))
            logps, outputs = response_logps(engine, batch)
            chosen, rejected = logps[: len(idx)], logps[len(idx) :]
            if ref_cache is not None:
                ref_chosen, ref_rejected = ref_cache[idx].unbind(1)
            else:
                with torch.no_grad():
                    ref_logps, _ = response_logps(ref, batch)
                ref_chosen, ref_rejected = ref_logps[: len(idx)], ref_logps[len(idx) :]
            losses, r_w, r_l = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta, args.ipo,
                                        args.label_smoothing)
            loss_sum, aux = losses.sum(), 0.0  # the step's loss: the mean over its pairs
            stats = pair_stats(losses, r_w, r_l, chosen, rejected, ref_chosen, ref_rejected)
            if args.nll_loss_coef > 0:
                nll = chosen_nll(chosen, per_sample_sum(batch["loss_mask"], batch)[: len(idx)])
                loss_sum = loss_sum + args.nll_loss_coef * nll.sum()
                stats["nll_loss"] = nll.detach().sum().item()
            if args.model.aux_loss_coef > 0:  # MoE load balancing, a mean per micro-batch as DeepSpeed averages it
                aux = args.model.aux_loss_coef * outputs.aux_loss
                stats["aux_loss"] = outputs.aux_loss.item() * micro  # / step pairs = mean over micro-batches
            # the step's pairs, counted on every rank
            grad_norm = backward_step(engine, loss_sum, len(local) * world.size, averaged=aux)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value

        global_step = step + 1
        totals = all_reduce_sum(list(sums.values()))
        metrics = {f"train/{key}": total / (batch_size * world.copies) for key, total in zip(sums, totals)}
        metrics.update({"train/lr": lr, "train/epoch": epoch, "train/grad_norm": grad_norm,
                        "perf/pairs_per_s": batch_size / (time.time() - t0)})
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['train/rewards/accuracy']:.2f}")
        if eval_ds and eval_due(global_step, args.log.eval_steps, steps_per_epoch, total_steps):
            metrics.update(evaluate(engine, ref, eval_ds, eval_ref_cache, args, batch_fn))
            if is_rank0():
                bar.write(f"step {global_step}: " + ", ".join(
                    f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/") or k == "train/loss"))
        # ---- boilerplate: log and save (the same text in every script; tests/test_boilerplate.py) ----
        if global_step % args.log.logging_steps == 0 or "eval/loss" in metrics:
            logger.log(metrics, global_step)
        maybe_save(engine, args.ckpt, global_step, total_steps,
                   {"global_step": global_step, "consumed_samples": global_step * batch_size})
        # ---- end of boilerplate: log and save ----

    save_hf_model(engine, tokenizer, args.ckpt.save_path, merge_lora=args.ckpt.merge_lora,
                  base_path=args.model.pretrain)
    if is_rank0():
        print(f"saved {args.ckpt.save_path}")
    logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main, parse_args)
