"""Batch generation: n samples per prompt with vLLM (or Hugging Face generate), optional scoring
with reward models from rm.py and / or a reward function (a Python file or a reward server, see
common/infra/remote_reward.py), and post-processing into new training data: best-of-n, rejection
sampling (SFT data), conditional SFT (SFT data with the score in the prompt) and iterative-DPO
pairs (best vs worst, DPO data).

    python algos/generate.py --pretrain outputs/sft --dataset assets/data/reverse/rl_test.jsonl \\
        --input_key prompt --label_key answer --apply_chat_template --best_of_n 4 \\
        --reward_func launch/rewards/exact_match.py --post_processor rs --output_path outputs/gen.jsonl

Generations go to --output_path, one JSON line per prompt ({"index", "prompt", "label",
"responses", "rewards", "finish_reasons"}), appended and flushed every --generate_batch_size
prompts: re-running the same command skips the prompts already written. The post-processed data
goes to --processed_path (default: <output_path without .jsonl>.<post_processor>.jsonl) with the
keys sft.py (`prompt`, `response`) and dpo.py (`prompt`, `chosen`, `rejected`) read.
"""

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # algos/.. (README: Forking)
if importlib.util.find_spec("common") is None:
    sys.exit(f"error: {__file__} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>")
from common.data import PromptArgs, format_prompt, format_response, reward_model_ids  # noqa: E402
from common.infra.datasets import load_one, load_tokenizer# noqa: E402
from common.infra.engine import device, run, parse_cli, validate_prompt_args  # noqa: E402
from common.infra.remote_reward import make_reward_fn  # noqa: E402
from common.infra.tracking import progress  # noqa: E402
from common.infra.vllm_engine import (  # noqa: E402
    EngineArgs, EngineError, HFGenerator, SamplingArgs, create_vllm_engine, default_max_num_seqs, model_max_len,
    resolve_max_model_len, vllm_generate,
)


@dataclass
class Args(PromptArgs):  # + the prompt flags every script shares (common/data.py)
    pretrain: str = tyro.MISSING
    """Model to generate with (a Hugging Face directory)."""
    dataset: str = tyro.MISSING
    """Prompt dataset (any spec common/data.py loads: file, folder, type@dir, hub name)."""
    output_path: str = tyro.MISSING
    """JSONL file of generations; an existing file is resumed, not overwritten."""
    dataset_split: str = "train"
    """Split of --dataset."""
    label_key: Optional[str] = None
    """Field holding a reference answer, passed to the reward function and kept in the output."""
    max_samples: int = 100_000_000
    """Use at most this many prompts."""
    iter: Optional[int] = None
    """Iteration k of a loop: use only prompts [k x rollout_batch_size, (k + 1) x rollout_batch_size)."""
    rollout_batch_size: int = 512
    """Prompts per --iter slice."""
    generate_batch_size: int = 64
    """Prompts per generation call; the output is flushed after each (the resume granularity)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """vLLM engine, or Hugging Face generate (for architectures vLLM lacks, and debugging)."""
    best_of_n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample from the k most likely tokens (-1: all)."""
    max_new_tokens: int = 64
    """Longest response in tokens."""
    engine: EngineArgs = field(default_factory=EngineArgs)
    reward_pretrain: Optional[str] = None
    """Comma list of reward models (rm.py exports) to score with; their rewards are summed."""
    normalize_reward: bool = False
    """Normalise each reward model's output with the mean/std rm.py stored in its config."""
    reward_func: Optional[str] = None
    """A Python file defining reward_func(queries, prompts, labels) -> one float per query (added to RM rewards)."""
    remote_rm_url: Optional[str] = None
    """A reward server's URL (python -m launch.reward_server) or a .py reward file, instead of --reward_func;
    queries are sent as prompt text + response."""
    remote_rm_token: Optional[str] = None
    """Bearer token of the --remote_rm_url server (default: $MINRLHF_REWARD_TOKEN, which keeps it out of `ps`)."""
    post_processor: Literal["none", "best_of_n", "rs", "csft", "iter_dpo"] = "none"
    """best_of_n: best response per prompt; rs: best per prompt if its reward >= --reward_threshold (SFT data);
    csft: every response, prompt prefixed with its normalised reward (SFT data); iter_dpo: best vs worst (DPO data)."""
    reward_threshold: Optional[float] = None
    """rs: keep a prompt's best response only if its reward is at least this."""
    reward_template: str = "<rm_score>: {reward:.2f} {prompt}"
    """csft: how the normalised reward is written into the prompt."""
    processed_path: Optional[str] = None
    """Where the post-processed data goes (default: derived from --output_path)."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    if args.best_of_n < 1:
        raise ValueError(f"--best_of_n must be >= 1, got {args.best_of_n}")
    if args.reward_func and args.remote_rm_url:
        raise ValueError("give --reward_func or --remote_rm_url, not both (--remote_rm_url also takes a .py file)")
    if args.remote_rm_token and not (args.remote_rm_url or "").lower().startswith(("http://", "https://")):
        raise ValueError("--remote_rm_token applies to an http(s):// --remote_rm_url only")
    if args.post_processor != "none" and not (args.reward_pretrain or args.reward_func or args.remote_rm_url):
        raise ValueError(f"--post_processor {args.post_processor} needs rewards: give --reward_pretrain and/or "
                         "--reward_func / --remote_rm_url")
    if args.post_processor == "iter_dpo" and args.best_of_n < 2:
        raise ValueError("--post_processor iter_dpo needs --best_of_n >= 2 (best and worst of several samples)")
    if args.reward_threshold is not None and args.post_processor != "rs":
        raise ValueError("--reward_threshold applies to --post_processor rs only")
    if args.reward_func or args.remote_rm_url:  # fail now, not after generating: an empty batch loads the file
        make_reward_fn(args.reward_func or args.remote_rm_url, args.remote_rm_token,  # or asks the server
                       flag="--reward_func" if args.reward_func else "--remote_rm_url")([], [], [])
    validate_prompt_args(args)
    if args.engine.max_model_len is not None:  # more than the model allows fails now, not in vLLM
        resolve_max_model_len(args.pretrain, args.engine.max_model_len, args.engine.max_model_len)
    if args.processed_path is None and args.post_processor != "none":
        args.processed_path = f"{os.path.splitext(args.output_path)[0]}.{args.post_processor}.jsonl"
    return args


# ----------------------------------------------------------------------------------------------
# Prompts, resume
# ----------------------------------------------------------------------------------------------
def load_prompts(args, tokenizer):
    raw = load_one(args.dataset, args.dataset_split)
    indices = range(min(len(raw), args.max_samples))
    if args.iter is not None:
        indices = indices[args.iter * args.rollout_batch_size : (args.iter + 1) * args.rollout_batch_size]
    if len(indices) == 0:
        raise ValueError(f"{args.dataset}: no prompts to generate from (rows {len(raw)}, --max_samples "
                         f"{args.max_samples}, --iter {args.iter}, --rollout_batch_size {args.rollout_batch_size})")
    prompts = []
    for i in indices:
        row = raw[i]
        if args.input_key not in row or row[args.input_key] in (None, "", []):
            raise ValueError(f"{args.dataset}: row {i}: missing or empty field {args.input_key!r}")
        if args.label_key and args.label_key not in row:
            raise ValueError(f"{args.dataset}: row {i}: missing field {args.label_key!r} (--label_key)")
        text = format_prompt(row[args.input_key], tokenizer, args)
        prompts.append({"index": i, "prompt": row[args.input_key], "prompt_text": text,
                        "prompt_ids": tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"],
                        "label": row[args.label_key] if args.label_key else None})
    return prompts


def read_done(path):
    """Rows already written (a torn last line from a crash is dropped and the file truncated)."""
    if not os.path.exists(path):
        return []
    rows, good_bytes = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
                good_bytes += len(line)
            except json.JSONDecodeError:
                break
    with open(path, "r+b") as f:
        f.truncate(good_bytes)
    return rows


# ----------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------
def compute_rewards(args, chunk, responses, reward_models, rm_tokenizer, reward_fn):
    """One float per response: the sum of the reward models' scores and the reward function's."""
    prompts = [p["prompt_text"] for p in chunk for _ in range(args.best_of_n)]
    total = torch.zeros(len(prompts))
    if reward_models:  # the RM reads the ids rm.py trained it on: templated prompt + templated response
        from common.infra.reward import score

        pairs = [(p["prompt_text"], format_response(p["prompt"], r, rm_tokenizer, args))
                 for p, rs in zip(chunk, responses) for r in rs]
        ids = [reward_model_ids(rm_tokenizer, *pair, args.apply_chat_template) for pair in pairs]
        total += score(reward_models, ids, normalize=args.normalize_reward)
    if reward_fn:  # checked: one finite float per query, or an error naming the file / server
        queries = [p["prompt_text"] + r for p, rs in zip(chunk, responses) for r in rs]
        labels = [p["label"] for p in chunk for _ in range(args.best_of_n)]
        total += reward_fn(queries, prompts, labels)
    return total.view(len(chunk), args.best_of_n).tolist()


# ----------------------------------------------------------------------------------------------
# Post-processing (forkers edit this)
# ----------------------------------------------------------------------------------------------
def post_process(args, rows):
    out = []
    if args.post_processor in ("best_of_n", "rs"):
        for row in rows:
            best = max(range(len(row["rewards"])), key=lambda k: row["rewards"][k])
            threshold = args.reward_threshold
            if args.post_processor == "rs" and threshold is not None and row["rewards"][best] < threshold:
                continue
            out.append({"prompt": row["prompt"], "response": row["responses"][best], "reward": row["rewards"][best],
                        "label": row["label"]})
    elif args.post_processor == "csft":
        flat = torch.tensor([r for row in rows for r in row["rewards"]])
        mean, std = flat.mean().item(), max(flat.std().item() if flat.numel() > 1 else 0.0, 1e-6)
        for row in rows:
            for response, reward in zip(row["responses"], row["rewards"]):
                prompt = args.reward_template.format(reward=(reward - mean) / std, prompt=row["prompt"])
                out.append({"prompt": prompt, "response": response, "reward": reward})
    elif args.post_processor == "iter_dpo":
        for row in rows:
            best = max(range(len(row["rewards"])), key=lambda k: row["rewards"][k])
            worst = min(range(len(row["rewards"])), key=lambda k: row["rewards"][k])
            if row["rewards"][best] > row["rewards"][worst] and row["responses"][best] != row["responses"][worst]:
                out.append({"prompt": row["prompt"], "chosen": row["responses"][best],
                            "rejected": row["responses"][worst],
                            "margin": row["rewards"][best] - row["rewards"][worst]})
    return out


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    tokenizer = load_tokenizer(args.pretrain, args)
    sampling = SamplingArgs(n=args.best_of_n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.engine.seed)
    prompts = load_prompts(args, tokenizer)
    done = {row["index"] for row in read_done(args.output_path)}
    todo = [p for p in prompts if p["index"] not in done]
    print(f"{len(prompts)} prompts, {len(prompts) - len(todo)} already in {args.output_path}, {len(todo)} to generate")

    reward_spec, reward_flag = ((args.reward_func, "--reward_func") if args.reward_func
                                else (args.remote_rm_url, "--remote_rm_url"))
    reward_fn = make_reward_fn(reward_spec, args.remote_rm_token, flag=reward_flag) if reward_spec else None
    reward_models, rm_tokenizer = [], None
    if args.reward_pretrain:  # on the GPU where there is one
        from common.infra.reward import load_reward_models

        reward_models, rm_tokenizer = load_reward_models([p for p in args.reward_pretrain.split(",") if p], device())
    if todo:
        if args.backend == "vllm":
            longest = max(len(p["prompt_ids"]) for p in todo)
            limit = args.engine.max_model_len or model_max_len(args.pretrain)
            if limit is not None and longest >= limit:
                row = next(p["index"] for p in todo if len(p["prompt_ids"]) == longest)
                raise ValueError(f"{args.dataset}: row {row}: the prompt has {longest} tokens, which leaves no room "
                                 f"for a response in --max_model_len {limit}")
            args.engine.max_model_len = resolve_max_model_len(args.pretrain, args.engine.max_model_len,
                                                              longest + args.max_new_tokens)
            engine = create_vllm_engine(args.pretrain, args.engine,
                                        max_num_seqs=default_max_num_seqs(args.generate_batch_size * args.best_of_n))
            generate = lambda ids: vllm_generate(engine, ids, sampling)  # noqa: E731
        else:
            from transformers import AutoModelForCausalLM

            hf = HFGenerator(AutoModelForCausalLM.from_pretrained(args.pretrain).eval(), tokenizer)
            generate = lambda ids: hf.generate(ids, sampling)  # noqa: E731
    os.makedirs(os.path.dirname(os.path.abspath(args.output_path)), exist_ok=True)
    chunks = [todo[i : i + args.generate_batch_size] for i in range(0, len(todo), args.generate_batch_size)]
    for chunk in progress(chunks, desc="generate"):
        samples = generate([p["prompt_ids"] for p in chunk])
        responses = [[s.text for s in per_prompt] for per_prompt in samples]
        rewards = (compute_rewards(args, chunk, responses, reward_models, rm_tokenizer, reward_fn)
                   if reward_models or reward_fn else [[None] * args.best_of_n for _ in chunk])
        with open(args.output_path, "a") as f:
            for p, per_prompt, resp, rew in zip(chunk, samples, responses, rewards):
                f.write(json.dumps({"index": p["index"], "prompt": p["prompt"], "label": p["label"], "responses": resp,
                                    "rewards": rew, "finish_reasons": [s.finish_reason for s in per_prompt]}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    rows = read_done(args.output_path)
    if args.post_processor != "none":
        processed = post_process(args, rows)
        with open(args.processed_path, "w") as f:
            for row in processed:
                f.write(json.dumps(row) + "\n")
        print(f"{args.post_processor}: {len(processed)} rows from {len(rows)} prompts -> {args.processed_path}")
    scored = [r for row in rows for r in row["rewards"] if r is not None]
    if scored:
        best = [max(row["rewards"]) for row in rows]
        print(
            f"reward: mean {sum(scored) / len(scored):.4f}, best-of-{args.best_of_n} mean {sum(best) / len(best):.4f}")


if __name__ == "__main__":
    run(main, parse_args, errors=(ValueError, EngineError), parse_errors=(ValueError, RuntimeError),
        holds_ckpt=False)  # RuntimeError: the reward server refused or did not answer
