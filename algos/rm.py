"""Reward models: pairwise (Bradley-Terry, optional margin) and process reward models (--prm).

    torchrun --nproc_per_node 2 algos/rm.py --pretrain outputs/sft \\
        --dataset assets/data/reverse/pref_train.jsonl --eval_dataset assets/data/reverse/pref_test.jsonl \\
        --prompt_key prompt --apply_chat_template --max_len 64 --skip_bad_rows --save_path outputs/rm

    torchrun --nproc_per_node 2 algos/rm.py --prm --pretrain assets/llama-0.5m \\
        --dataset assets/data/count/prm_train.jsonl --eval_dataset assets/data/count/prm_test.jsonl \\
        --prompt_key prompt --input_key response --label_key labels --placeholder_token ';' \\
        --apply_chat_template --max_len 64 --save_path outputs/prm

Pairwise: an `AutoModelForSequenceClassification` (num_labels=1) of the backbone; the reward of a
sequence is the value head at its last non-pad token. The chosen and rejected sequences of a
micro-batch run in one packed forward; the loss is -log sigmoid(r_chosen - r_rejected - margin),
averaged over the pairs of the whole optimizer step. The export loads with
`AutoModelForSequenceClassification.from_pretrained` and carries the reward mean / std of the last
evaluation in its config (`config.mean`, `config.std`) for reward normalisation in RL.

PRM (Math-Shepherd style): a causal LM; at each step tag (--placeholder_token) the logits of the
two reward tokens (--reward_tokens, good then bad) give p(step is right) = softmax(logits[good, bad])[0];
the loss is the cross-entropy against hard ('+'/'-') or soft (probability) labels at the tags only,
averaged over the labelled steps of the optimizer step. The export is a plain causal LM; read the
same softmax at each tag.
"""

import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # algos/.. (README: Forking)
if importlib.util.find_spec("common") is None:
    sys.exit(f"error: {__file__} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>")
from common.data import (  # noqa: E402
    BadRow, DataArgs, format_prompt, format_response, get_field, reward_model_ids,
)
from common.infra.datasets import load_tokenizer, prepare_dataset, rank0_first, tokenization_cache_key  # noqa: E402
from common.infra.engine import (  # noqa: E402
    CkptArgs, ModelArgs, TrainArgs, all_reduce_sum, backward_step, device, is_rank0, maybe_save, parse_cli, resume,
    run, save_hf_model, script_ckpt_args, setup, train_engine, validate_common_args, validate_data_args,
    world_size_from_env,
)
from common.logprobs import model_settings  # noqa: E402
from common.packing import collate, to_device, unwrap  # noqa: E402
from common.infra.reward import lockstep_forwards, sequence_rewards  # noqa: E402
from common.infra.rings import RingArgs, ring_model_args, validate_ring_args  # noqa: E402
from common.infra.tracking import LogArgs, MetricsLogger, eval_due, progress  # noqa: E402


@dataclass
class RMDataArgs(DataArgs):
    input_key: str = "input"
    """--prm only: field holding the solution with a step tag after each step (the response when --prompt_key is
    set)."""


@dataclass
class Args:
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=lambda: TrainArgs(learning_rate=9e-6))
    data: RMDataArgs = field(default_factory=RMDataArgs)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    log: LogArgs = field(default_factory=LogArgs)
    ring: RingArgs = field(default_factory=RingArgs)
    prompt_key: Optional[str] = None
    """Field holding the prompt (string or chat messages); unset: the response fields hold whole texts or
    conversations."""
    chosen_key: str = "chosen"
    """Field holding the preferred response (pairwise)."""
    rejected_key: str = "rejected"
    """Field holding the dispreferred response (pairwise)."""
    margin_loss: bool = False
    """Pairwise loss -log sigmoid(r_chosen - r_rejected - margin), the margin read from --margin_key of each row."""
    margin_key: str = "margin"
    """Field holding the margin (with --margin_loss)."""
    value_head_prefix: str = "score"
    """Name of the value head in the Hugging Face sequence-classification class (`score` for Llama, Qwen2, Mistral,
    Gemma, ...); the saved weights use it."""
    prm: bool = False
    """Train a process reward model: step labels read at --placeholder_token in --input_key."""
    label_key: str = "labels"
    """--prm: field holding one label per step: a --reward_tokens string (hard) or the probability the step is right
    (soft)."""
    placeholder_token: str = "ки"
    """--prm: the step tag that ends each step (must be one token of the tokenizer)."""
    reward_tokens: tuple[str, str] = ("+", "-")
    """--prm: the tokens whose logits at a step tag score it: good, then bad (each one token)."""


PAIRWISE_ONLY = ("chosen_key", "rejected_key", "margin_loss", "margin_key", "value_head_prefix")
PRM_ONLY = ("label_key", "placeholder_token", "reward_tokens")


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    dp_world = validate_ring_args(args.ring, world_size_from_env(), args.model, args.data)  # world / ring size
    args.model = ring_model_args(args.model, args.ring)  # the ring is the attention implementation
    validate_common_args(args.model, args.train, args.ckpt, dp_world)
    if args.prm and args.ring.ring_attn_size > 1:
        raise ValueError("--prm with --ring_attn_size > 1 is not supported (pairwise reward models only)")
    validate_data_args(args.data, args.model.attn_implementation)
    if args.model.aux_loss_coef > 0:
        raise ValueError("--aux_loss_coef (MoE load balancing) is not implemented in rm.py")
    defaults = {f.name: f.default for f in fields(Args)}
    for name in PAIRWISE_ONLY if args.prm else PRM_ONLY:  # no flag is parsed and then ignored
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"--{name} is for {'pairwise reward models' if args.prm else '--prm'} only")
    if not args.prm and args.data.input_key != RMDataArgs.input_key:
        raise ValueError(
            "--input_key is for --prm only: pairwise data uses --prompt_key, --chosen_key and --rejected_key")
    if not args.margin_loss and args.margin_key != defaults["margin_key"]:
        raise ValueError("--margin_key is read only with --margin_loss")
    if args.prm and len(set(args.reward_tokens)) != 2:
        raise ValueError(f"--reward_tokens must be two different tokens, got {args.reward_tokens}")
    if args.data.input_template is not None and args.prompt_key is None:
        raise ValueError("--input_template formats the prompt: set --prompt_key")
    return args


def single_token(tokenizer, text, flag):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens for this tokenizer "
                         f"({tokenizer.convert_ids_to_tokens(ids)}); pick a string that is one token")
    return ids[0]


def check_value_head(args: Args):
    """The value head named --value_head_prefix exists in the sequence-classification class (built on
    the meta device: no weights are loaded)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        skeleton = AutoModelForSequenceClassification.from_config(
            AutoConfig.from_pretrained(args.model.pretrain, num_labels=1))
    if not isinstance(getattr(skeleton, args.value_head_prefix, None), torch.nn.Linear):
        heads = [n for n, m in skeleton.named_children() if isinstance(m, torch.nn.Linear)]
        raise ValueError(f"--value_head_prefix {args.value_head_prefix!r}: {type(skeleton).__name__} has no such "
                         f"linear head (its head: {heads})")


# ----------------------------------------------------------------------------------------------
# Data: which tokens a row holds and what it is labelled with  (forkers edit this)
# ----------------------------------------------------------------------------------------------
def tokenize(tokenizer, text, add_special_tokens=False):
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def sequence_ids(row, key, tokenizer, args: Args):
    """Token ids of prompt + the response in `key` (formatted as in SFT), or of the whole text /
    conversation in `key` when there is no --prompt_key."""
    data = args.data
    value = get_field(row, key)
    if args.prompt_key is not None:
        prompt = get_field(row, args.prompt_key)
        if not isinstance(value, str):
            raise BadRow(f"field {key!r} should be a string response when --prompt_key is set")
        return reward_model_ids(tokenizer, format_prompt(prompt, tokenizer, data),
                                format_response(prompt, value, tokenizer, data), data.apply_chat_template)
    if isinstance(value, list):
        if not data.apply_chat_template:
            raise BadRow(f"field {key!r} is a list of messages: pass --apply_chat_template")
        return tokenize(tokenizer, tokenizer.apply_chat_template(value, tokenize=False))
    if data.apply_chat_template:
        raise BadRow(f"field {key!r} is a string: without --prompt_key, --apply_chat_template needs conversations")
    return tokenize(tokenizer,
                    value if args.prm or value.endswith(tokenizer.eos_token) else value + tokenizer.eos_token,
                    add_special_tokens=True)


def pair_row(row, tokenizer, args: Args):
    """One preference row -> {"chosen_ids", "rejected_ids", "margin"}; raises BadRow naming the field."""
    chosen = sequence_ids(row, args.chosen_key, tokenizer, args)
    rejected = sequence_ids(row, args.rejected_key, tokenizer, args)
    if chosen == rejected:
        raise BadRow(f"fields {args.chosen_key!r} and {args.rejected_key!r} are identical")
    for key, ids in ((args.chosen_key, chosen), (args.rejected_key, rejected)):
        if len(ids) > args.data.max_len:
            raise BadRow(f"{key!r}: {len(ids)} tokens, more than --max_len {args.data.max_len}")
    margin = 0.0
    if args.margin_loss:
        margin = row.get(args.margin_key)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise BadRow(f"field {args.margin_key!r} should be a number (--margin_loss), got {margin!r}")
    return {"chosen_ids": chosen, "rejected_ids": rejected, "margin": float(margin)}


def step_row(row, tokenizer, args: Args, tag_id, reward_tokens):
    """One step-labelled row -> {"input_ids", "step_labels"}: step_labels is p(step is right) at each
    step tag (1 / 0 for hard labels) and -1 elsewhere; raises BadRow naming the field."""
    ids = sequence_ids(row, args.data.input_key, tokenizer, args)
    labels = get_field(row, args.label_key, list)
    tags = [i for i, t in enumerate(ids) if t == tag_id]
    if not tags:
        raise BadRow(f"field {args.data.input_key!r} has no step tag {args.placeholder_token!r} (--placeholder_token)")
    if tags[0] == 0:
        raise BadRow(f"field {args.data.input_key!r} starts with a step tag: a step tag ends a step")
    if len(tags) != len(labels):
        raise BadRow(f"{len(tags)} step tags {args.placeholder_token!r} in the tokenized sample but {len(labels)} "
                     f"labels in field {args.label_key!r}")
    step_labels = [-1.0] * len(ids)
    for i, label in zip(tags, labels):
        if isinstance(label, str):
            if label not in reward_tokens:
                raise BadRow(f"field {args.label_key!r}: label {label!r} is not one of --reward_tokens {reward_tokens}")
            step_labels[i] = float(label == reward_tokens[0])
        elif isinstance(label, (int, float)) and 0 <= label <= 1:
            step_labels[i] = float(label)
        else:
            raise BadRow(
                f"field {args.label_key!r}: label {label!r} is neither a reward token nor a probability in [0, 1]")
    if len(ids) > args.data.max_len:
        raise BadRow(f"{len(ids)} tokens, more than --max_len {args.data.max_len}")
    return {"input_ids": ids, "step_labels": step_labels}


def micro_batches_of(ds, indices, micro, args: Args):
    """Lists of samples for collate: per micro-batch, the chosen sequences then the rejected ones
    (pairwise), or the step-labelled sequences (PRM, where loss_mask marks the step tags)."""
    rows = ds[list(indices)]
    if args.prm:
        samples = [{"input_ids": i, "loss_mask": [int(v >= 0) for v in s], "step_labels": s}
                   for i, s in zip(rows["input_ids"], rows["step_labels"])]
        return [samples[k : k + micro] for k in range(0, len(samples), micro)]
    n, batches = len(rows["margin"]), []
    for k in range(0, n, micro):
        pairs = range(k, min(k + micro, n))
        chosen = [{"input_ids": rows["chosen_ids"][i], "loss_mask": [0] * len(rows["chosen_ids"][i]),
                   "margin": rows["margin"][i]} for i in pairs]
        rejected = [{"input_ids": r, "loss_mask": [0] * len(r), "margin": rows["margin"][i], "prefix_of": j,
                     "prefix_len": shared_prefix_len(rows["chosen_ids"][i], r)}
                    for j, i in enumerate(pairs) for r in [rows["rejected_ids"][i]]]
        batches.append(chosen + rejected)
    return batches


def shared_prefix_len(chosen, rejected):
    """Leading tokens the rejected sequence shares with the chosen one (its prompt, as a rule), leaving it one."""
    n = 0
    while n < min(len(chosen), len(rejected) - 1) and chosen[n] == rejected[n]:
        n += 1
    return n


def make_batch(samples, args: Args, pad_id, layout):
    """Packed rows (one row where `layout.one_row`, see common.packing.Layout), or padded rows; plus the pair
    margins (pairwise) or the step labels laid out like input_ids (PRM). Where the kernel reads branches
    (`layout.share_prefixes`), each rejected sequence is a branch of its chosen one's shared prefix (pairwise). On
    the device."""
    batch = collate(samples, pad_id, packing=args.data.packing_samples,
                    max_tokens=args.data.pack_max_tokens or args.data.max_len, one_row=layout.one_row,
                    share_prefixes=not args.prm and args.data.packing_samples and layout.share_prefixes)
    if args.prm:
        labels = torch.full(batch["input_ids"].shape, -1.0)
        for sample, (r, s, n) in zip(samples, batch["spans"]):
            labels[r, s : s + n] = torch.tensor(sample["step_labels"])
        batch["step_labels"] = labels
    else:
        batch["margin"] = torch.tensor([s["margin"] for s in samples[: len(samples) // 2]])
    return to_device(batch, device())


# ----------------------------------------------------------------------------------------------
# Losses  (forkers edit this)
# ----------------------------------------------------------------------------------------------
def pairwise_loss(chosen, rejected, margin=None):
    """Per pair: -log sigmoid(r_chosen - r_rejected - margin)."""
    diff = chosen - rejected
    return -F.logsigmoid(diff if margin is None else diff - margin)


def prm_loss(logits, targets):
    """Per step: cross-entropy between softmax(logits) over (good, bad) reward tokens, shape (n, 2),
    and the target distribution (p, 1 - p); p = 1 / 0 for hard labels."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(targets * logp[:, 0] + (1 - targets) * logp[:, 1])


def forward_loss(engine, batch, args: Args, reward_ids, ring=None):
    """Summed loss of a micro-batch and its statistics (sums, so they add up across micro-batches and ranks);
    `ring`: the batch is split over this rank's ring (common.ring_attention)."""
    if args.prm:
        steps = batch["loss_mask"] > 0
        columns = steps.any(0).nonzero().squeeze(1)  # the LM head runs only where some row has a step tag
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=batch["position_ids"], use_cache=False, logits_to_keep=columns).logits
        step_logits, targets = logits[steps[:, columns]][:, reward_ids], batch["step_labels"][steps]
        losses = prm_loss(step_logits, targets)
        correct = ((step_logits[:, 0] > step_logits[:, 1]) == (targets >= 0.5)).sum()
        return losses.sum(), {"units": len(losses), "loss": losses.sum().item(), "correct": correct.item()}
    rewards = sequence_rewards(engine, batch, args.value_head_prefix, ring)
    m = len(rewards) // 2
    chosen, rejected = rewards[:m], rewards[m:]
    losses = pairwise_loss(chosen, rejected, batch["margin"] if args.margin_loss else None)
    return losses.sum(), {
        "units": m, "loss": losses.sum().item(), "correct": (chosen > rejected).sum().item(),
        "chosen": chosen.sum().item(), "rejected": rejected.sum().item(),
        "reward_sum": rewards.sum().item(), "reward_sq": (rewards.double() ** 2).sum().item(),
    }


# ----------------------------------------------------------------------------------------------
# Evaluation: pairwise accuracy, rewards and margins, or step accuracy, over the held-out set
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(engine, eval_ds, args, pad_id, reward_ids):
    engine.eval()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    chunks = micro_batches_of(eval_ds, range(rank, len(eval_ds), world), args.train.micro_train_batch_size, args)
    names = ("units", "loss", "correct") if args.prm else ("units", "loss", "correct", "chosen", "rejected",
                                                           "reward_sum", "reward_sq")
    totals = dict.fromkeys(names, 0.0)
    for i in progress(range(lockstep_forwards(engine, len(chunks))), is_rank0(), desc="eval", leave=False):
        # under ZeRO-3 a rank with fewer batches runs extra forwards (on row 0) in step with the busiest rank
        samples = chunks[i] if i < len(chunks) else micro_batches_of(eval_ds, [0], 1, args)[0]
        batch = make_batch(samples, args, pad_id, model_settings(engine).layout)
        _, stats = forward_loss(engine, batch, args, reward_ids)
        if i < len(chunks):
            for k in names:
                totals[k] += stats[k]
    t = dict(zip(names, all_reduce_sum([totals[k] for k in names])))
    engine.train()
    n = max(t["units"], 1)
    if args.prm:
        return {"eval/loss": t["loss"] / n, "eval/step_accuracy": t["correct"] / n}
    mean = t["reward_sum"] / (2 * n)
    var = (t["reward_sq"] - 2 * n * mean**2) / max(2 * n - 1, 1)  # unbiased, like torch.std
    return {"eval/loss": t["loss"] / n, "eval/accuracy": t["correct"] / n, "eval/chosen_reward": t["chosen"] / n,
            "eval/rejected_reward": t["rejected"] / n, "eval/margin": (t["chosen"] - t["rejected"]) / n,
            "eval/reward_mean": mean, "eval/reward_std": max(var, 0.0) ** 0.5}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    world = setup(args.ring, args.train.seed)  # ranks, data-parallel share, ring
    tokenizer = load_tokenizer(args.model.pretrain, args.data)
    if args.prm:
        tag_id = single_token(tokenizer, args.placeholder_token, "--placeholder_token")
        reward_ids = [single_token(tokenizer, t, "--reward_tokens") for t in args.reward_tokens]
        row_fn = lambda r: step_row(r, tokenizer, args, tag_id, args.reward_tokens)  # noqa: E731
        columns = ("input_ids", "step_labels")
    else:
        check_value_head(args)
        reward_ids = None
        row_fn, columns = (lambda r: pair_row(r, tokenizer, args)), ("chosen_ids", "rejected_ids", "margin")

    # rank 0 tokenizes first and fills the datasets cache; the others then read it (a data error stops all)
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
        raise ValueError(f"{len(train_ds)} training samples is fewer than --train_batch_size {batch_size}")
    total_steps = steps_per_epoch * args.train.max_epochs

    if args.prm:
        engine = train_engine(args.model, args.train, total_steps, world)
    else:
        from transformers import AutoModelForSequenceClassification

        engine = train_engine(args.model, args.train, total_steps, world, model_cls=AutoModelForSequenceClassification,
                              num_labels=1, pad_token_id=tokenizer.pad_token_id)
    state = resume(engine, args.ckpt)
    start_step = state["global_step"] if state else 0
    logger = MetricsLogger(args.log, asdict(args), is_rank0())
    pad_id = tokenizer.pad_token_id

    last_eval = None
    bar = progress(range(start_step, total_steps), is_rank0(), desc="prm" if args.prm else "rm", initial=start_step,
                   total=total_steps)
    for step in bar:
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(args.train.seed + epoch))
        step_indices = order[k * batch_size : (k + 1) * batch_size].tolist()
        micro_batches = [make_batch(s, args, pad_id, model_settings(engine).layout)
                         for s in micro_batches_of(train_ds, world.shard(step_indices), micro, args)]

        # normaliser: pairs (or labelled steps) of the whole optimizer step, over every micro-batch and rank (the
        # ranks of a ring each count the pairs they share)
        step_units = batch_size * world.copies
        if args.prm:
            (step_units,) = all_reduce_sum([sum(b["loss_mask"].sum().item() for b in micro_batches)])
        lr = engine.get_lr()[0]
        totals = {}
        for batch in micro_batches:
            loss_sum, stats = forward_loss(engine, batch, args, reward_ids, world.ring)
            grad_norm = backward_step(engine, loss_sum, step_units)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        sums = dict(zip(totals, all_reduce_sum(list(totals.values()))))

        global_step = step + 1
        n = sums["units"]
        metrics = {"train/loss": sums["loss"] / n, "train/lr": lr, "train/epoch": epoch,
                   "train/grad_norm": grad_norm, "perf/samples_per_s": batch_size / (time.time() - t0)}
        if args.prm:
            metrics["train/step_accuracy"] = sums["correct"] / n
        else:
            metrics.update({"train/accuracy": sums["correct"] / n, "train/chosen_reward": sums["chosen"] / n,
                            "train/rejected_reward": sums["rejected"] / n})
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if eval_ds and eval_due(global_step, args.log.eval_steps, steps_per_epoch, total_steps):
            last_eval = (global_step, evaluate(engine, eval_ds, args, pad_id, reward_ids))
            metrics.update(last_eval[1])
            if is_rank0():
                bar.write(f"step {global_step}: " + ", ".join(
                    f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("eval/") or k == "train/loss"))
        # ---- boilerplate: log and save (the same text in every script; tests/test_boilerplate.py) ----
        if global_step % args.log.logging_steps == 0 or "eval/loss" in metrics:
            logger.log(metrics, global_step)
        maybe_save(engine, args.ckpt, global_step, total_steps,
                   {"global_step": global_step, "consumed_samples": global_step * batch_size})
        # ---- end of boilerplate: log and save ----

    if eval_ds and (last_eval is None or last_eval[0] != total_steps):  # the export's statistics are the final model's
        last_eval = (total_steps, evaluate(engine, eval_ds, args, pad_id, reward_ids))
        logger.log(last_eval[1], total_steps)
    if not args.prm and last_eval is not None:  # read by RL for reward normalisation (OpenRLHF's keys)
        config = unwrap(engine).config
        config.mean, config.std = last_eval[1]["eval/reward_mean"], last_eval[1]["eval/reward_std"]
    save_hf_model(engine, tokenizer, args.ckpt.save_path, merge_lora=args.ckpt.merge_lora,
                  base_path=args.model.pretrain)
    if is_rank0():
        config = unwrap(engine).config
        print(f"saved {args.ckpt.save_path}" + (f" (reward mean {config.mean:.4f}, std {config.std:.4f})"
                                                if not args.prm and last_eval else ""))
    logger.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(main, parse_args)
