"""Supervised fine-tuning: prompt/response pairs, multi-turn conversations (loss on assistant turns
only) and continued pretraining (loss on every token), packed by default.

    torchrun --nproc_per_node 2 algos/sft.py --pretrain assets/llama-0.5m \\
        --dataset assets/data/reverse/sft_train.jsonl --input_key prompt --output_key response \\
        --apply_chat_template --save_path outputs/sft

The loss is the mean over the loss tokens of the whole optimizer step (all micro-batches, all
ranks), so gradient accumulation and the number of ranks do not change it.  A plain `python
algos/sft.py` is a world of one.
"""

import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # algos/.. (README: Forking)
if importlib.util.find_spec("common") is None:
    sys.exit(f"error: {__file__} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>")
from common.data import BadRow, DataArgs, format_prompt, format_response, get_field  # noqa: E402
from common.infra.datasets import load_tokenizer, prepare_dataset, rank0_first, tokenization_cache_key  # noqa: E402
from common.infra.engine import (  # noqa: E402
    CkptArgs, ModelArgs, TrainArgs, accumulation_steps, all_reduce_sum, backward_step, device, is_rank0, maybe_save,
    parse_cli, resume, run, save_hf_model, script_ckpt_args, setup, train_engine, validate_common_args,
    validate_data_args, world_size_from_env,
)
from common.infra.rings import RingArgs, ring_model_args, validate_ring_args  # noqa: E402
from common.logprobs import model_settings, token_logps  # noqa: E402
from common.packing import collate, lockstep_shard, per_sample_sum, to_device  # noqa: E402
from common.infra.tracking import LogArgs, MetricsLogger, eval_due, progress  # noqa: E402


@dataclass
class Args:
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=lambda: TrainArgs(learning_rate=1e-5))
    data: DataArgs = field(default_factory=DataArgs)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    log: LogArgs = field(default_factory=LogArgs)
    ring: RingArgs = field(default_factory=RingArgs)
    output_key: str = "output"
    """Field holding the response (prompt/response data)."""
    multiturn: bool = False
    """--input_key holds a list of chat messages; loss on every assistant turn (needs --apply_chat_template)."""
    pretrain_mode: bool = False
    """Continued pretraining: --input_key holds plain text, no template, loss on every token."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    dp_world = validate_ring_args(args.ring, world_size_from_env(), args.model, args.data)  # world / ring size
    args.model = ring_model_args(args.model, args.ring)  # the ring is the attention implementation
    validate_common_args(args.model, args.train, args.ckpt, dp_world)
    validate_data_args(args.data, args.model.attn_implementation)
    if args.multiturn and not args.data.apply_chat_template:
        raise ValueError("--multiturn needs --apply_chat_template (turn boundaries come from the chat template)")
    if args.multiturn and args.pretrain_mode:
        raise ValueError("--multiturn and --pretrain_mode exclude each other")
    if args.pretrain_mode:  # plain text, no template
        for flag in ("apply_chat_template", "input_template", "tokenizer_chat_template"):
            if getattr(args.data, flag) not in (None, False):
                raise ValueError(f"--{flag} does not apply to --pretrain_mode (plain text, loss on every token)")
    if (args.pretrain_mode or args.multiturn) and args.output_key != Args.output_key:
        raise ValueError(f"--output_key is read only from prompt/response data, not with "
                         f"{'--pretrain_mode' if args.pretrain_mode else '--multiturn'} (the text is in --input_key)")
    return args


# ----------------------------------------------------------------------------------------------
# Data: which tokens a row holds and which of them carry loss  (forkers edit this)
# ----------------------------------------------------------------------------------------------
def tokenize(tokenizer, text, add_special_tokens=False):
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def sft_row(row, tokenizer, args: Args):
    """One row -> {"input_ids", "loss_mask"}; raises BadRow naming the field for unusable rows."""
    data = args.data
    if args.pretrain_mode:
        ids = tokenize(tokenizer, get_field(row, data.input_key) + tokenizer.eos_token, add_special_tokens=True)
        mask = [1] * len(ids)
    elif args.multiturn:
        messages = get_field(row, data.input_key, list)
        if not any(m.get("role") == "assistant" for m in messages):
            raise BadRow(f"field {data.input_key!r} has no assistant turn")
        ids, mask, before = [], [], ""
        for i, message in enumerate(messages):
            if not str(message.get("content") or "").strip():
                raise BadRow(f"field {data.input_key!r}: message {i} ({message.get('role')}) is empty")
            next_is_assistant = i + 1 < len(messages) and messages[i + 1].get("role") == "assistant"
            upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False,
                                                 add_generation_prompt=next_is_assistant)
            if not upto.startswith(before):
                raise BadRow(f"field {data.input_key!r}: the chat template does not render turn {i} as a suffix")
            piece = tokenize(tokenizer, upto[len(before):])
            ids += piece
            mask += [int(message["role"] == "assistant")] * len(piece)
            before = upto
    else:
        prompt = get_field(row, data.input_key)
        response = get_field(row, args.output_key)
        prompt_ids = tokenize(tokenizer, format_prompt(prompt, tokenizer, data), not data.apply_chat_template)
        response_ids = tokenize(tokenizer, format_response(prompt, response, tokenizer, data))
        ids, mask = prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)
    if len(ids) > data.max_len:
        raise BadRow(f"{len(ids)} tokens, more than --max_len {data.max_len}")
    return {"input_ids": ids, "loss_mask": mask}


def batches_of(ds, indices, micro):
    rows = ds[list(indices)]
    samples = [{"input_ids": i, "loss_mask": m} for i, m in zip(rows["input_ids"], rows["loss_mask"])]
    return [samples[k : k + micro] for k in range(0, len(samples), micro)]


# ----------------------------------------------------------------------------------------------
# Evaluation: loss and next-token accuracy over the response tokens of the held-out set
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(engine, eval_ds, args, pad_id):
    engine.eval()
    nll = tokens = correct = 0.0
    mine, padded = lockstep_shard(len(eval_ds))  # equal forward counts per rank keep ZeRO-3 gathers in step
    micro = args.train.micro_train_batch_size
    for start in progress(range(0, len(padded), micro), is_rank0(), desc="eval", leave=False):
        (samples,) = batches_of(eval_ds, padded[start : start + micro], micro)
        valid = len(mine[start : start + micro])  # the padding repeats item 0: count only real items
        batch = make_batch(samples, args, pad_id, model_settings(engine).layout)
        logps, _, hits = token_logps(engine, batch, return_argmax=True, ring=None)  # each rank its own items
        mask = batch["loss_mask"]
        nll -= per_sample_sum(logps * mask, batch)[:valid].sum().item()
        tokens += per_sample_sum(mask, batch)[:valid].sum().item()
        correct += per_sample_sum(hits * mask, batch)[:valid].sum().item()
    nll, tokens, correct = all_reduce_sum([nll, tokens, correct])
    engine.train()
    return {"eval/loss": nll / max(tokens, 1), "eval/token_accuracy": correct / max(tokens, 1)}


def make_batch(samples, args, pad_id, layout):
    """Packed rows (one row where `layout.one_row`, see common.packing.Layout), or padded rows, on the device."""
    batch = collate(samples, pad_id, packing=args.data.packing_samples,
                    max_tokens=args.data.pack_max_tokens or args.data.max_len, one_row=layout.one_row)
    return to_device(batch, device())


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    world = setup(args.ring, args.train.seed)  # ranks, data-parallel share, ring
    tokenizer = load_tokenizer(args.model.pretrain, args.data)

    # rank 0 tokenizes first and fills the datasets cache; the others then read it (a data error stops all)
    row_fn, columns = (lambda r: sft_row(r, tokenizer, args)), ("input_ids", "loss_mask")
    cache_key = tokenization_cache_key(__file__, tokenizer, args)

    def prepare():
        train = prepare_dataset(args.data.dataset, args.data.dataset_split, row_fn, columns, args.data, cache_key,
                                probs=args.data.dataset_probs, seed=args.train.seed, max_samples=args.data.max_samples)
        return train, args.data.eval_dataset and prepare_dataset(
            args.data.eval_dataset, args.data.eval_split, row_fn, columns, args.data, cache_key)

    train_ds, eval_ds = rank0_first(prepare)

    batch_size, micro = args.train.train_batch_size, args.train.micro_train_batch_size
    gas = accumulation_steps(batch_size, micro, world.dp_world)
    steps_per_epoch = len(train_ds) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_ds)} training samples is fewer than --train_batch_size {batch_size}")
    total_steps = steps_per_epoch * args.train.max_epochs

    engine = train_engine(args.model, args.train, total_steps, world)
    state = resume(engine, args.ckpt)
    start_step = state["global_step"] if state else 0
    logger = MetricsLogger(args.log, asdict(args), is_rank0())
    pad_id = tokenizer.pad_token_id

    bar = progress(range(start_step, total_steps), is_rank0(), desc="sft", initial=start_step, total=total_steps)
    for step in bar:
        t0 = time.time()
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(args.train.seed + epoch))
        step_indices = order[k * batch_size : (k + 1) * batch_size].tolist()
        micro_batches = [make_batch(s, args, pad_id, model_settings(engine).layout)
                         for s in batches_of(train_ds, world.shard(step_indices), micro)]

        # normaliser: loss tokens of the whole optimizer step, over every micro-batch and rank
        (step_tokens,) = all_reduce_sum([sum(b["loss_mask"].sum().item() for b in micro_batches)])
        lr = engine.get_lr()[0]
        step_nll = step_aux = 0.0
        for batch in micro_batches:
            logps, outputs = token_logps(engine, batch)
            nll = -(logps * batch["loss_mask"]).sum()
            aux = 0.0
            if args.model.aux_loss_coef > 0:  # MoE load balancing, a mean per micro-batch as DeepSpeed averages it
                aux = args.model.aux_loss_coef * outputs.aux_loss
                step_aux += outputs.aux_loss.item() / (gas * world.size)
            grad_norm = backward_step(engine, nll, step_tokens, averaged=aux)
            step_nll += nll.item()

        global_step = step + 1
        step_nll, step_aux = all_reduce_sum([step_nll, step_aux])
        metrics = {"train/loss": step_nll / step_tokens, "train/lr": lr, "train/epoch": epoch,
                   "perf/tokens_per_s": step_tokens / world.copies / (time.time() - t0),
                   "perf/samples_per_s": batch_size / (time.time() - t0), "train/grad_norm": grad_norm}
        if args.model.aux_loss_coef > 0:
            metrics["train/aux_loss"] = step_aux
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if eval_ds and eval_due(global_step, args.log.eval_steps, steps_per_epoch, total_steps):
            metrics.update(evaluate(engine, eval_ds, args, pad_id))
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
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(main, parse_args)
