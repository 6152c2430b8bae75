"""Kahneman-Tversky optimisation (KTO): learn from unpaired feedback, a completion marked desirable or
undesirable for its prompt; paired preference rows are accepted too.

    torchrun --nproc_per_node 2 algos/kto.py --pretrain outputs/sft \\
        --dataset assets/data/reverse/unpaired_train.jsonl --eval_dataset assets/data/reverse/pref_test.jsonl \\
        --apply_chat_template --max_len 64 --beta 0.1 --learning_rate 3e-4 --save_path outputs/kto

Data: a row with --output_key and a boolean --label_key is one example; a row with --chosen_key and
--rejected_key is split into a desirable and an undesirable example (rows of both kinds may be mixed;
--max_samples counts rows; --train_batch_size and --micro_train_batch_size count examples).

Loss: with r = log π(y|x) - log π_ref(y|x) (sums over response tokens) and the reference point
z = max(0, mean over the micro-batch, averaged over the ranks, of r(y'|x)), where y' is the
completion of the next example in the micro-batch paired with this prompt (a mismatched pair, as in
the KTO paper; cut to fit --max_len), detached, the loss of an example is
λ_D·(1 - σ(β(r - z))) when desirable and λ_U·(1 - σ(β(z - r))) when undesirable.  The policy
log-probs of the mismatched pairs come from a second, gradient-free packed forward.  A micro-batch
needs no example of either kind: with only desirable examples the undesirable term is simply empty.

Normalisation: the loss is the mean over all examples of the optimizer step.  Every micro-batch holds
--micro_train_batch_size examples, so the micro-batch mean, which DeepSpeed divides by the
accumulation steps and averages over ranks, is that global mean.  z is per micro-batch.

Logged under train/ and eval/: loss and kl (z) as means over examples; rewards/, logps/ and logps/ref_
of desirable and of undesirable examples as means over each kind (absent when a step has none); eval
also rewards/accuracy and rewards/margin over the held-out paired rows (desirable reward > undesirable).

Reference model (--ref_pretrain, default --pretrain): with --ref_cache (the default) it runs once,
before the policy loads, over every example and every mismatched pair the run will use (all epochs;
the data order is fixed by --seed), sharded over the ranks; the sums of its response log-probs are
kept in memory per example index (and per epoch for the mismatched pairs), and the model is freed.  The cache lives
for one run: it is recomputed at every start, resumes included.  --no_ref_cache keeps the reference
beside the policy and runs it on every micro-batch (ZeRO-3 partitioned when training uses ZeRO-3;
--ref_offload keeps its parameters on the CPU, in the cache pass too).
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
from common.packing import collate, to_device  # noqa: E402
from common.infra.tracking import LogArgs, MetricsLogger, eval_due, progress  # noqa: E402


@dataclass
class KTODataArgs(DataArgs):
    input_key: Annotated[str, tyro.conf.arg(aliases=("--prompt_key",))] = "prompt"
    """Field holding the prompt (a string, or a list of chat messages ending with a user turn)."""


@dataclass
class Args:
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=lambda: TrainArgs(learning_rate=5e-7))
    data: KTODataArgs = field(default_factory=KTODataArgs)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    log: LogArgs = field(default_factory=LogArgs)
    ring: RingArgs = field(default_factory=RingArgs)
    output_key: str = "completion"
    """Field holding the completion of an unpaired row."""
    label_key: str = "label"
    """Field holding an unpaired row's label: true (desirable) or false (undesirable); JSON booleans only."""
    chosen_key: str = "chosen"
    """Field holding the preferred response of a paired row (becomes a desirable example)."""
    rejected_key: str = "rejected"
    """Field holding the dispreferred response of a paired row (becomes an undesirable example)."""
    beta: float = 0.1
    """KTO temperature β."""
    desirable_loss_weight: float = 1.0
    """λ_D, weight of desirable examples (the paper suggests λ_D·n_D / (λ_U·n_U) in [1, 4/3])."""
    undesirable_loss_weight: float = 1.0
    """λ_U, weight of undesirable examples."""
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
    if args.desirable_loss_weight < 0 or args.undesirable_loss_weight < 0:
        raise ValueError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")
    if args.train.micro_train_batch_size < 2:
        raise ValueError("--micro_train_batch_size must be >= 2: the KL reference point pairs each prompt with "
                         "the completion of another example of the micro-batch")
    return args


# ----------------------------------------------------------------------------------------------
# Data: a row -> one or two examples (prompt ids, completion ids, label)  (forkers edit this)
# ----------------------------------------------------------------------------------------------
def tokenize(tokenizer, text, add_special_tokens=False):
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def kto_row(row, tokenizer, args: Args):
    """One row -> lists (one entry per example) of prompt_ids, completion_ids, label, paired;
    raises BadRow naming the field."""
    data = args.data
    prompt = get_field(row, data.input_key)
    paired = row.get(args.chosen_key) is not None or row.get(args.rejected_key) is not None
    if paired:
        fields = [(args.chosen_key, True), (args.rejected_key, False)]
    elif row.get(args.output_key) is None:
        raise BadRow(f"missing field {args.output_key!r}: a row needs {args.output_key!r} and {args.label_key!r} "
                     f"(unpaired) or {args.chosen_key!r} and {args.rejected_key!r} (paired) "
                     f"(fields: {sorted(k for k, v in row.items() if v is not None)})")
    else:
        fields = [(args.output_key, get_field(row, args.label_key, bool))]
    prompt_ids = tokenize(tokenizer, format_prompt(prompt, tokenizer, data), not data.apply_chat_template)
    out = {"prompt_ids": [], "completion_ids": [], "label": [], "paired": []}
    for key, label in fields:
        completion = get_field(row, key)
        if not isinstance(completion, str):
            raise BadRow(f"field {key!r} should be a string (the completion), got {type(completion).__name__}")
        ids = tokenize(tokenizer, format_response(prompt, completion, tokenizer, data))
        if len(prompt_ids) + len(ids) > data.max_len:
            raise BadRow(f"prompt + {key!r} is {len(prompt_ids) + len(ids)} tokens, more than --max_len {data.max_len}")
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(ids)
        out["label"].append(label)
        out["paired"].append(paired)
    return out


def one_example_per_row(ds):
    """Flatten the per-row lists of kto_row: a paired row becomes two consecutive examples."""
    return ds.map(lambda b: {c: [x for xs in b[c] for x in xs] for c in b}, batched=True,
                  remove_columns=ds.column_names, desc="Splitting pairs")


def kto_samples(ds, pairs, max_len):
    """Samples "prompt i + completion j" for (i, j) in `pairs`: (i, i) is example i itself, (i, j != i)
    a mismatched pair for the KL reference point (the completion cut to fit max_len)."""
    prompts = ds[[i for i, _ in pairs]]["prompt_ids"]
    completions = ds[[j for _, j in pairs]]["completion_ids"]
    samples = []
    for p, c in zip(prompts, completions):
        c = c[: max_len - len(p)]
        samples.append({"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)})
    return samples


def kl_pairs(idx):
    """The mismatched pairs of a micro-batch: prompt k with the completion of example k + 1 (cyclic)."""
    return [(idx[k], idx[(k + 1) % len(idx)]) for k in range(len(idx))]


def make_batch(samples, args, pad_id, layout):
    """Packed rows (one row where `layout.one_row`, see common.packing.Layout), or padded rows; on the device."""
    return to_device(collate(samples, pad_id, packing=args.data.packing_samples,
                             max_tokens=args.data.pack_max_tokens or args.data.max_len, one_row=layout.one_row),
                     device())


# ----------------------------------------------------------------------------------------------
# Log-probs and loss  (forkers edit kto_loss)
# ----------------------------------------------------------------------------------------------
def kl_reference_point(kl_logps, ref_kl_logps):
    """z = max(0, mean of log π/π_ref over the mismatched pairs, averaged over the ranks), detached."""
    z = (kl_logps - ref_kl_logps).mean().detach()
    if dist.is_initialized():
        dist.all_reduce(z)
        z = z / dist.get_world_size()
    return z.clamp(min=0)


def kto_loss(logps, ref_logps, labels, z, beta, desirable_weight=1.0, undesirable_weight=1.0):
    """Per-example losses and implicit rewards β·(log π - log π_ref), given the reference point z."""
    r = logps - ref_logps
    losses = torch.where(labels, desirable_weight * (1 - torch.sigmoid(beta * (r - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - r))))
    return losses, beta * r.detach()


def example_stats(losses, rewards, labels, logps, ref_logps):
    """Sums of what is logged: the loss over all examples, the rest per label (with counts)."""
    stats = {"loss": losses.detach().sum().item()}
    for name, mask in (("desirable", labels), ("undesirable", ~labels)):
        stats[f"count/{name}"] = mask.sum().item()
        stats[f"rewards/{name}"] = rewards[mask].sum().item()
        stats[f"logps/{name}"] = logps.detach()[mask].sum().item()
        stats[f"logps/ref_{name}"] = ref_logps[mask].sum().item()
    return stats


def stats_to_metrics(totals, n, prefix):
    """Means: the loss, KL (and MoE aux loss) over the n examples, the rest over their label's examples."""
    metrics = {f"{prefix}/{key}": totals[key] / n for key in ("loss", "kl", "aux_loss") if key in totals}
    for name in ("desirable", "undesirable"):
        if totals[f"count/{name}"] > 0:
            for key in (f"rewards/{name}", f"logps/{name}", f"logps/ref_{name}"):
                metrics[f"{prefix}/{key}"] = totals[key] / totals[f"count/{name}"]
    return metrics


def eval_items(n):
    """Held-out samples: every example, then each prompt with the completion of the example half the
    set away as its mismatched pair (never the other half of its own split pair)."""
    return [(i, i) for i in range(n)] + [(i, (i + n // 2) % n) for i in range(n)]


@torch.no_grad()
def evaluate(engine, ref, eval_ds, eval_ref, args, batch_fn):
    """KTO loss, KL reference point and per-label rewards / log-probs over the held-out examples, and
    for paired rows the implicit-reward accuracy (desirable > undesirable)."""
    engine.eval()
    n, micro = len(eval_ds), args.train.micro_train_batch_size
    items = eval_items(n)
    samples_of = lambda pos: kto_samples(eval_ds, [items[p] for p in pos], args.data.max_len)  # noqa: E731
    policy = sharded_logps(engine, len(items), samples_of, micro, batch_fn, device())[:, 0]
    if eval_ref is None:
        eval_ref = sharded_logps(ref, len(items), samples_of, micro, batch_fn, device())[:, 0]
    engine.train()
    labels = torch.tensor(eval_ds["label"], device=policy.device)
    z = (policy[n:] - eval_ref[n:]).mean().clamp(min=0)
    losses, rewards = kto_loss(policy[:n], eval_ref[:n], labels, z, args.beta, args.desirable_loss_weight,
                               args.undesirable_loss_weight)
    totals = {**example_stats(losses, rewards, labels, policy[:n], eval_ref[:n]), "kl": z.item() * n}
    metrics = stats_to_metrics(totals, n, "eval")
    paired = torch.tensor(eval_ds["paired"], device=policy.device)
    if paired.any():  # split pairs are consecutive: (desirable, undesirable)
        first = paired.nonzero()[::2, 0]
        margins = rewards[first] - rewards[first + 1]
        metrics.update({"eval/rewards/accuracy": (margins > 0).float().mean().item(),
                        "eval/rewards/margin": margins.mean().item()})
    return metrics


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    world = setup(args.ring, args.train.seed)  # ranks, data-parallel share, ring
    tokenizer = load_tokenizer(args.model.pretrain, args.data)

    # rank 0 tokenizes first and fills the datasets cache; the others then read it (a data error stops all)
    row_fn, columns = (lambda r: kto_row(r, tokenizer, args)), ("prompt_ids", "completion_ids", "label", "paired")
    cache_key = tokenization_cache_key(__file__, tokenizer, args)

    def prepare():
        train = one_example_per_row(prepare_dataset(
            args.data.dataset, args.data.dataset_split, row_fn, columns, args.data, cache_key,
            probs=args.data.dataset_probs, seed=args.train.seed, max_samples=args.data.max_samples))
        return train, args.data.eval_dataset and one_example_per_row(prepare_dataset(
            args.data.eval_dataset, args.data.eval_split, row_fn, columns, args.data, cache_key))

    train_ds, eval_ds = rank0_first(prepare)

    batch_size, micro = args.train.train_batch_size, args.train.micro_train_batch_size
    steps_per_epoch = len(train_ds) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_ds)} training examples is fewer than --train_batch_size {batch_size}")
    total_steps = steps_per_epoch * args.train.max_epochs
    pad_id = tokenizer.pad_token_id
    n_desirable = sum(train_ds["label"])
    n_undesirable = len(train_ds) - n_desirable
    if is_rank0():
        ratio = (args.desirable_loss_weight * n_desirable / (args.undesirable_loss_weight * n_undesirable)
                 if args.undesirable_loss_weight * n_undesirable > 0 else float("inf"))
        print(f"{len(train_ds)} training examples: {n_desirable} desirable, {n_undesirable} undesirable; "
              f"λ_D·n_D / (λ_U·n_U) = {ratio:.3f} (the KTO paper suggests 1 to 4/3)")

    def order_of(epoch):
        return torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(args.train.seed + epoch)).tolist()

    def local_micro_batches(order, k, r):
        """Data-parallel rank r's micro-batches (lists of example indices) at step k of an epoch with this order."""
        per_rank = batch_size // world.dp_world
        local = order[k * batch_size + r * per_rank : k * batch_size + (r + 1) * per_rank]
        return [local[m : m + micro] for m in range(0, per_rank, micro)]

    # the frozen reference: cache its log-probs and free it, or keep it for live use
    ref_args = ModelArgs(pretrain=args.ref_pretrain or args.model.pretrain,
                         attn_implementation=args.model.attn_implementation, load_in_4bit=args.model.load_in_4bit)
    ref = frozen_engine(ref_args, args.train, world, offload=args.ref_offload)
    layout = model_settings(ref).layout  # the policy's too: the same attention kernel
    batch_fn = lambda samples: make_batch(samples, args, pad_id, layout)  # noqa: E731
    ref_cache = eval_ref_cache = None
    if args.ref_cache:
        t0 = time.time()
        # every example, then each epoch's mismatched pairs; within an epoch example i has one partner
        n, epoch_pairs = len(train_ds), []
        for epoch in range(args.train.max_epochs):
            order = order_of(epoch)
            epoch_pairs.append([p for k in range(steps_per_epoch) for r in range(world.dp_world)
                                for idx in local_micro_batches(order, k, r) for p in kl_pairs(idx)])
        items = [(i, i) for i in range(n)] + [p for pairs in epoch_pairs for p in pairs]
        values = sharded_logps(ref, len(items), lambda pos: kto_samples(
            train_ds, [items[p] for p in pos], args.data.max_len), micro, batch_fn, device())[:, 0]
        kl_cache, start = torch.zeros(len(epoch_pairs), n, dtype=values.dtype, device=values.device), n
        for epoch, pairs in enumerate(epoch_pairs):  # kl_cache[epoch, i]: prompt i with its partner's completion
            kl_cache[epoch, [i for i, _ in pairs]] = values[start : start + len(pairs)]
            start += len(pairs)
        ref_cache = (values[:n], kl_cache)
        if eval_ds:
            held_out = eval_items(len(eval_ds))
            eval_ref_cache = sharded_logps(ref, len(held_out), lambda pos: kto_samples(
                eval_ds, [held_out[p] for p in pos], args.data.max_len), micro, batch_fn, device())[:, 0]
        ref.destroy()
        ref = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if is_rank0():
            print(f"cached reference log-probs of {len(items)} training samples (examples and mismatched pairs) and "
                  f"{2 * len(eval_ds) if eval_ds else 0} eval samples in {time.time() - t0:.1f}s; "
                  "reference model freed")

    engine = train_engine(args.model, args.train, total_steps, world)
    state = resume(engine, args.ckpt)
    start_step = state["global_step"] if state else 0
    logger = MetricsLogger(args.log, asdict(args), is_rank0())
    labels_all = torch.tensor(train_ds["label"], device=device())

    bar = progress(range(start_step, total_steps), is_rank0(), desc="kto", initial=start_step, total=total_steps)
    for step in bar:
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        lr = engine.get_lr()[0]
        sums = {}
        for idx in local_micro_batches(order_of(epoch), k, world.dp_rank):
            examples, mismatched = [(i, i) for i in idx], kl_pairs(idx)
            if ref_cache is not None:
                ref_logps, ref_kl_logps = ref_cache[0][idx], ref_cache[1][epoch, idx]
            else:
                with torch.no_grad():
                    both = batch_fn(kto_samples(train_ds, examples + mismatched, args.data.max_len))
                    ref_both, _ = response_logps(ref, both)
                ref_logps, ref_kl_logps = ref_both[: len(idx)], ref_both[len(idx) :]
            with torch.no_grad():  # the reference point needs no gradient: a forward-only pass
                kl_batch = batch_fn(kto_samples(train_ds, mismatched, args.data.max_len))
                kl_logps, _ = response_logps(engine, kl_batch)
            z = kl_reference_point(kl_logps, ref_kl_logps)
            batch = batch_fn(kto_samples(train_ds, examples, args.data.max_len))
            logps, outputs = response_logps(engine, batch)
            labels = labels_all[idx]
            losses, rewards = kto_loss(logps, ref_logps, labels, z, args.beta, args.desirable_loss_weight,
                                       args.undesirable_loss_weight)
            stats = {**example_stats(losses, rewards, labels, logps, ref_logps), "kl": z.item() * len(idx)}
            aux = 0.0
            if args.model.aux_loss_coef > 0:  # MoE load balancing, a mean per micro-batch as DeepSpeed averages it
                aux = args.model.aux_loss_coef * outputs.aux_loss
                stats["aux_loss"] = outputs.aux_loss.item() * micro  # / step examples = mean over micro-batches
            # the step's loss: the mean over its examples, counted on every rank
            grad_norm = backward_step(engine, losses.sum(), batch_size // world.dp_world * world.size, averaged=aux)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value

        global_step = step + 1
        totals = dict(zip(sums, all_reduce_sum(list(sums.values()))))
        metrics = stats_to_metrics(totals, batch_size * world.copies, "train")  # a ring counts alike
        metrics.update({"train/lr": lr, "train/epoch": epoch, "train/grad_norm": grad_norm,
                        "perf/examples_per_s": batch_size / (time.time() - t0)})
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", kl=f"{metrics['train/kl']:.3f}")
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
