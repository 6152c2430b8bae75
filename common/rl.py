"""What the Ray RL drivers (ppo.py, grpo.py) share and is no algorithm: prompts, Ray start-up and
placement, rollouts with vLLM (single-turn samples or multi-turn episodes, synchronous or one step
ahead), rewards, evaluation, and the packed batches of samples. The advantages and losses stay in
each script.

Every function takes the script's own `args` and reads the flags both scripts name the same way.
"""

import contextlib
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Optional

import torch
import tyro

from common.data import BadRow, format_prompt, validate_prompt_args

from common.infra.datasets import load_one
from common.infra.engine import ModelArgs, free_port, init_distributed, set_seed, uses_bf16
from common.infra.gpu import check_colocation, check_weight_sync_model
from common.episodes import Episode, episode_sample, load_env, run_episodes, validate_agent_args
from common.packing import collate
from common.infra.roles import RoleFailed
from common.infra.tracking import LogArgs
from common.infra.vllm_engine import EngineArgs, SamplingArgs, resolve_max_model_len


@dataclass
class RLArgs:
    """The flags of grpo.py and ppo.py that mean the same in both: prompts, evaluation, rewards, rollouts (each
    script's Args derives from it, so they read as its own fields)."""

    # -- prompts
    prompt_data: str = tyro.MISSING
    """Prompt dataset (any spec common/data.py loads: file, folder, type@dir, hub name)."""
    prompt_split: str = "train"
    """Split of --prompt_data."""
    input_key: str = "input"
    """Field holding the prompt (a string, or a list of chat messages)."""
    label_key: Optional[str] = None
    """Field holding the reference answer passed to the reward function (required in every row when set)."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template."""
    input_template: Optional[str] = None
    """Plain prompt template with one '{}' for the prompt (no chat template)."""
    tokenizer_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own."""
    max_samples: int = 100_000_000
    """Use at most this many prompts."""
    skip_bad_rows: bool = False
    """Skip and count prompts that are missing fields or longer than --prompt_max_len instead of stopping."""
    eval_dataset: Optional[str] = None
    """Held-out prompts (same keys), evaluated every --eval_steps rollout steps and at the start and end."""
    eval_split: str = "train"
    """Split of --eval_dataset."""
    eval_n_samples_per_prompt: int = 4
    """Samples per held-out prompt: pass@1 is their mean reward, pass@k the mean of each prompt's best."""
    eval_temperature: float = 0.6
    """Sampling temperature of the evaluation (0: greedy)."""
    # -- rewards
    remote_rm_url: Optional[str] = None
    """Rule-based or remote reward: a .py file defining reward_func(queries, prompts, labels), or an HTTP URL
    served by `python launch/reward_server.py`."""
    remote_rm_token: Optional[str] = None
    """Bearer token for an HTTP --remote_rm_url (default: $MINRLHF_REWARD_TOKEN)."""
    reward_pretrain: Optional[str] = None
    """Comma list of reward models exported by rm.py; their scores are summed (and added to --remote_rm_url's)."""
    normalize_reward: bool = False
    """Normalise each reward model's score with the mean/std rm.py stored in its config."""
    reward_clip_range: tuple[float, float] = (-10.0, 10.0)
    """Clamp each sample's scalar reward to this range, before the group baseline (OpenRLHF clips after it)."""
    overlong_buffer_len: int = 0
    """DAPO overlong penalty: responses longer than --generate_max_len minus this lose reward linearly (0: off)."""
    overlong_penalty_factor: float = 1.0
    """Reward lost by a response that fills the whole overlong buffer."""
    # -- rollouts
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (a group)."""
    rollout_batch_size: int = 32
    """Prompts per rollout step; samples per step = this x --n_samples_per_prompt."""
    micro_rollout_batch_size: int = 16
    """Samples per forward pass when computing log-probs (and ppo.py's values) before the update."""
    num_episodes: int = 1
    """Passes over the prompt data."""
    max_steps: int = -1
    """Stop after this many rollout steps (-1: as many as --num_episodes give)."""
    prompt_max_len: int = 1024
    """Longest prompt in tokens."""
    generate_max_len: int = 1024
    """Longest response in tokens."""
    temperature: float = 1.0
    """Rollout sampling temperature. The update reads the untempered policy's log-probs, so at a temperature other
    than 1 it trains on samples of another distribution, uncorrected (a warning says so; OpenRLHF divides the
    logits by it)."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass."""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (their unmasked samples') and sample new
    prompts to refill the batch. The run's step count still comes from --num_episodes, so with refills it reads
    more than that many passes over the prompts."""
    dynamic_filtering_max_rounds: int = 4
    """Sampling rounds per step for --dynamic_filtering; then the batch is topped up with dropped groups."""
    mask_truncated_responses: bool = False
    """Responses cut off at --generate_max_len carry no loss (in ppo.py, neither for the actor nor for the critic)."""


@dataclass
class RolloutEngineArgs(EngineArgs):
    tp_size: Annotated[int, tyro.conf.arg(name="vllm_tensor_parallel_size")] = 1
    """Tensor-parallel size of each vLLM engine."""
    max_model_len: Optional[int] = None
    """Longest prompt + response an engine serves (default: --prompt_max_len + --generate_max_len, at most the
    model's max_position_embeddings)."""
    seed: tyro.conf.Suppress[int] = 0  # unused: every request carries its own seed (derived from --seed)


@dataclass
class RolloutLogArgs(LogArgs):
    logging_steps: int = 1
    """Log training scalars every N rollout steps."""
    eval_steps: int = -1
    """Evaluate on --eval_dataset every N rollout steps (-1: after each pass over the prompts), before the first
    and after the last rollout step."""


@dataclass
class AsyncArgs:
    async_train: bool = False
    """Generate the next steps' samples (up to --max_staleness ahead) while the trainer updates on this step's."""
    max_staleness: int = 1
    """With --async_train: K, the policy updates between the weights that generate a step's samples and the update
    that trains on them: rollouts run up to K steps ahead, step j's on the weights of update max(j - K, 0) exactly
    (0: no overlap, the synchronous run). vLLM's log-probs are the old policy of the clipped ratio."""
    rollout_timeout: float = 1800.0
    """Seconds the driver waits for a step's rollout (engines, environment, rewards), and for the engines to finish
    it before a weight sync; then it stops naming who is late."""


def off_policy(args):
    """--async_train with --max_staleness > 0: samples come from the weights one update before the
    trainer's, and vLLM's log-probs of them (the behaviour policy) are the old policy of the clip."""
    return args.async_rollout.async_train and args.async_rollout.max_staleness > 0


def validate_rollout_args(args, world, script):
    """The checks of the flags every RL driver shares (world: actor trainer ranks; the script checked its ring
    flags first); fills --max_model_len."""
    if args.model.aux_loss_coef > 0:
        raise ValueError(f"--aux_loss_coef (MoE load balancing) is not implemented in {script}")
    n = args.n_samples_per_prompt
    if n < 1:
        raise ValueError(f"--n_samples_per_prompt must be >= 1, got {n}")
    rollout = args.rollout_batch_size * n
    if rollout % args.train.train_batch_size:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} x --n_samples_per_prompt {n} = {rollout} "
                         f"samples must be a multiple of --train_batch_size {args.train.train_batch_size}")
    rings = world // args.ring.ring_attn_size  # the ranks of a ring share their samples (validate_ring_args)
    if rollout % (args.micro_rollout_batch_size * rings):
        raise ValueError(f"{rollout} samples per rollout must be a multiple of --micro_rollout_batch_size "
                         f"{args.micro_rollout_batch_size} x {rings} data-parallel trainer ranks (trainer ranks / "
                         f"--ring_attn_size)")
    if args.agent.agent_func_path:
        validate_agent_args(args)
    elif not (args.remote_rm_url or args.reward_pretrain):
        raise ValueError("no reward: give --remote_rm_url (a .py reward file or an HTTP URL), --reward_pretrain, "
                         "or an environment (--agent_func_path)")
    if args.remote_rm_url and not args.remote_rm_url.startswith(("http://", "https://")):
        from common.infra.remote_reward import load_reward_func

        # a missing file or function fails now, not after the models load
        load_reward_func(args.remote_rm_url, "--remote_rm_url")
    needed = max(args.prompt_max_len + args.generate_max_len, args.agent.max_episode_tokens or 0)
    if args.engine.max_model_len is not None and args.engine.max_model_len < needed:
        raise ValueError(f"--max_model_len {args.engine.max_model_len} must be >= --prompt_max_len "
                         f"{args.prompt_max_len} + --generate_max_len {args.generate_max_len}"
                         + (f" and >= --max_episode_tokens {args.agent.max_episode_tokens}"
                            if args.agent.agent_func_path else ""))
    args.engine.max_model_len = resolve_max_model_len(args.model.pretrain, args.engine.max_model_len, needed)
    if args.use_kl_loss and args.init_kl_coef <= 0:
        raise ValueError("--use_kl_loss needs --init_kl_coef > 0")
    if args.use_kl_loss and args.kl_estimator == "k1":  # E[grad k1] = E[grad log p] = 0 under the policy
        raise ValueError("--use_kl_loss with --kl_estimator k1 regularises nothing (the expected gradient of k1 as a "
                         "loss is 0): use --kl_estimator k3 (the gradient of KL(ref||policy), GRPO's) or k2 (of "
                         "KL(policy||ref))")
    if args.temperature != 1:
        print(f"warning: --temperature {args.temperature}: the update reads the untempered policy's log-probs, so it "
              "trains on samples of another distribution, uncorrected", file=sys.stderr)
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise ValueError(f"--dual_clip must be > 1, got {args.dual_clip}")
    if args.overlong_buffer_len >= args.generate_max_len:
        raise ValueError(f"--overlong_buffer_len {args.overlong_buffer_len} must be < --generate_max_len")
    if args.colocate_all_models and args.vllm_num_engines * args.engine.tp_size != world:
        raise ValueError(f"--colocate_all_models puts one engine device on each trainer device: --vllm_num_engines "
                         f"x --vllm_tensor_parallel_size must equal {world} trainer ranks")
    if args.vllm_enable_sleep and not args.colocate_all_models:
        raise ValueError("--vllm_enable_sleep only helps with --colocate_all_models")
    check_colocation(args.colocate_all_models, args.engine.vllm_gpu_memory_utilization, args.engine.tp_size,
                     torch.cuda.is_available())  # common.infra.gpu: what a CUDA device cannot hold
    check_weight_sync_model(args.model.load_in_4bit, True, script)
    overlap = args.async_rollout
    if overlap.max_staleness < 0:
        raise ValueError(f"--max_staleness must be >= 0, got {overlap.max_staleness}")
    if overlap.async_train and args.vllm_enable_sleep:
        raise ValueError("--async_train generates while the trainer updates: the engines cannot sleep "
                         "(drop --vllm_enable_sleep)")
    if off_policy(args):  # samples one update old: the clip is the trust region that keeps that stable
        eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
        if not (0 < eps_low < 1 and 0 < eps_high < 1):
            raise ValueError(f"--async_train with --max_staleness {overlap.max_staleness} needs a clipped ratio: "
                             f"--eps_clip / --eps_clip_low_high bounds in (0, 1), got {eps_low}, {eps_high}")
        if args.vllm_is_truncation > 0:
            raise ValueError("--vllm_is_truncation with --async_train --max_staleness > 0: the old policy is already "
                             "vLLM's (the ratio p_trainer / p_vllm is the clipped PPO ratio)")
    validate_prompt_args(args.input_template, args.apply_chat_template)


# ----------------------------------------------------------------------------------------------
# Prompts and steps
# ----------------------------------------------------------------------------------------------
def load_prompts(spec, split, args, tokenizer, max_samples):
    """[{prompt_text, prompt_ids, label}]; rows missing a field or too long fail naming the file and row."""
    raw = load_one(spec, split)
    prompts, skipped = [], 0
    for i in range(min(len(raw), max_samples)):
        row = raw[i]
        try:
            if row.get(args.input_key) in (None, "", []):
                raise BadRow(f"missing or empty field {args.input_key!r} (--input_key)")
            if args.label_key and row.get(args.label_key) is None:
                raise BadRow(f"missing field {args.label_key!r} (--label_key), which the reward needs")
            text = format_prompt(row[args.input_key], tokenizer, args)
            ids = tokenizer(text, add_special_tokens=not args.apply_chat_template)["input_ids"]
            limit = min(args.prompt_max_len, args.engine.max_model_len - 1)  # the engine needs room for a response
            if len(ids) > limit:
                raise BadRow(f"{len(ids)} prompt tokens, more than {limit} (--prompt_max_len {args.prompt_max_len}, "
                             f"--max_model_len {args.engine.max_model_len})")
        except BadRow as e:
            if not args.skip_bad_rows:
                raise ValueError(f"{spec}: row {i}: {e}") from None
            skipped += 1
            continue
        prompts.append({"prompt_text": text, "prompt_ids": ids, "raw": row[args.input_key],
                        "label": row[args.label_key] if args.label_key else None})
    if not prompts:
        raise ValueError(f"{spec}: no usable prompts ({len(raw)} rows, {skipped} skipped)")
    if skipped:
        print(f"{spec}: skipped {skipped} bad rows")
    return prompts


def prompt_at(prompts, position, seed):
    """The prompt at stream position `position`: episode after episode, each in its own shuffled order."""
    episode, k = divmod(position, len(prompts))
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + episode))
    return prompts[order[k].item()]


def rollout_steps(args, num_prompts):
    """(rollout steps of the run, rollout steps per pass over the prompts)."""
    total_steps = args.num_episodes * num_prompts // args.rollout_batch_size
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    if total_steps < 1:
        raise ValueError(f"{num_prompts} prompts x --num_episodes {args.num_episodes} is fewer than one "
                         f"--rollout_batch_size {args.rollout_batch_size}")
    return total_steps, max(num_prompts // args.rollout_batch_size, 1)


def split_steps(samples, args, step, ranks):
    """Epochs x optimizer steps of --train_batch_size samples (a seeded shuffle), each split over `ranks`."""
    per_rank, B, per_step = [[] for _ in range(ranks)], args.train.train_batch_size, len(samples)
    for epoch in range(args.train.max_epochs):
        order = torch.randperm(per_step, generator=torch.Generator().manual_seed(args.train.seed + 1000 * step + epoch))
        for k in range(per_step // B):
            chosen = [samples[i] for i in order[k * B : (k + 1) * B].tolist()]
            for r in range(ranks):
                per_rank[r].append(chosen[r * (B // ranks) : (r + 1) * (B // ranks)])
    return per_rank


# ----------------------------------------------------------------------------------------------
# Ray: start-up, placement, trainer groups
# ----------------------------------------------------------------------------------------------
def start_ray(args, num_roles, root):
    """Join --ray_address, or start a local Ray with a logical CPU for every role even on a 2-core machine."""
    import ray

    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env={"env_vars": {"PYTHONPATH": root}})
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_roles), include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": root, "TOKENIZERS_PARALLELISM": "false"}})


def trainer_bundles(roles, num_nodes, per_node, gpu, timeout_s, name):
    """A placement group of num_nodes x per_node bundles (one per trainer rank), rank r on node r // per_node
    (PACK alone may fill one node: a STRICT_SPREAD probe picks distinct nodes, then each bundle is pinned);
    returns bundle index -> scheduling strategy."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle, world = ({"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}), num_nodes * per_node
    selectors = None
    if num_nodes > 1:
        probe = placement_group([{k: v * per_node for k, v in bundle.items()}] * num_nodes, strategy="STRICT_SPREAD")
        roles.get(probe.ready(), timeout_s=timeout_s)
        node_ids = placement_group_table(probe)["bundles_to_node_id"]
        remove_placement_group(probe)
        selectors = [{"ray.io/node-id": node_ids[r // per_node]} for r in range(world)]
        print(f"{name} group: {world} ranks on {num_nodes} nodes, {per_node} per node")
    pg = placement_group([bundle] * world, strategy="PACK", bundle_label_selector=selectors)
    roles.get(pg.ready(), timeout_s=timeout_s)
    return lambda i: PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)


def reference_args(args):
    """The frozen reference model (--init_kl_coef > 0): the start policy, loaded as the policy is (attention
    kernel, 4-bit)."""
    return ModelArgs(pretrain=args.model.pretrain, attn_implementation=args.model.attn_implementation,
                     load_in_4bit=args.model.load_in_4bit)


def rendezvous_address():
    """This node's address and a free port, for a trainer group's rendezvous (asked of its rank 0)."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")


def join_group(rank, world, master_addr, master_port, timeout_s, seed, ranks_per_node):
    """Join a trainer group as `rank` (bounded by timeout_s); on CPU take cores / ranks_per_node threads (Ray
    gives an actor num_cpus threads, 1)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    init_distributed(timeout_s=timeout_s)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_node))
    set_seed(seed)


def weight_sync(args, rank, engines):
    """The actor rank's side of the weight sync into the vLLM engines (rank 0 sends; the others take part in
    the gathers)."""
    import ray

    from common.infra.weight_sync import WeightSync

    return WeightSync(engines if rank == 0 else [], colocated=args.colocate_all_models, tp_size=args.engine.tp_size,
                      host=ray.util.get_node_ip_address(), timeout_s=args.rendezvous_timeout,
                      dtype=torch.bfloat16 if uses_bf16(args.train) else None)


def start_engines(args, roles, cpus, gpus, at=None):
    """The --vllm_num_engines engine actors (each --vllm_tensor_parallel_size devices; colocated with `at`: engine
    i in trainer rank i x tp size's bundle), added to `roles`."""
    from common.infra.vllm_engine import create_vllm_actor, default_max_num_seqs

    # an engine holds at once every sample of its share of a rollout (or of an evaluation round)
    per_engine = math.ceil(args.rollout_batch_size / args.vllm_num_engines)
    max_num_seqs = default_max_num_seqs(per_engine * max(args.n_samples_per_prompt, args.eval_n_samples_per_prompt))
    return [roles.add(f"vLLM engine {i}", create_vllm_actor(
                args.model.pretrain, args.engine, num_cpus=cpus, num_gpus=gpus * args.engine.tp_size,
                enable_sleep=args.vllm_enable_sleep, colocated=at is not None, max_num_seqs=max_num_seqs,
                bf16=uses_bf16(args.train),
                options={"scheduling_strategy": at(i * args.engine.tp_size)} if at else {}))
            for i in range(args.vllm_num_engines)]


def start_reward_models(args, roles, cpus, gpus, strategy=None):
    """The --reward_pretrain models in one actor (on `strategy`'s bundle when colocated), or None."""
    from common.infra.roles import actor_class

    if not args.reward_pretrain:
        return None
    return roles.add("reward models", actor_class(RewardModels).options(
        num_cpus=cpus, num_gpus=gpus, **({"scheduling_strategy": strategy} if strategy else {})).remote(
        [p for p in args.reward_pretrain.split(",") if p], args.normalize_reward))


def start_group(roles, members, *setup_args):
    """Start every member's setup(addr, port, *setup_args), rendezvous at rank 0; returns the refs to wait on."""
    if not members:
        return []
    addr, port = roles.get(members[0].address.remote())
    return [m.setup.remote(addr, port, *setup_args) for m in members]


# ----------------------------------------------------------------------------------------------
# Samples: a response with its prompt, made into collated batches with per-token values
# ----------------------------------------------------------------------------------------------
def token_sample(s):
    """The input_ids/loss_mask dict collate() packs: loss on the response tokens the model wrote (an episode's
    environment tokens are not trainable), none if masked."""
    return {"input_ids": s["prompt_ids"] + s["response_ids"],
            "loss_mask": [0] * len(s["prompt_ids"]) + [0 if s.get("masked") else int(t) for t in model_tokens(s)]}


def model_tokens(s):
    """Which response tokens the model wrote (bool): all of a single-turn response, an episode's own turns."""
    return torch.tensor(s.get("trainable", [1] * len(s["response_ids"])), dtype=torch.bool)


def make_batch(samples, pad_id, max_tokens, one_row, values=(), share_prompt=False):
    """Collate samples (packed; one row with a per-sample attention kernel), and lay each named
    per-response-token value out like the tokens. With share_prompt (the CPU kernel), the samples of a
    prompt after its first are branches of the first one's prompt: the row holds each prompt once.
    `response_offsets[i]`: where sample i's response starts in its span (common.packing.unpack)."""
    token_samples, first_of = [token_sample(s) for s in samples], {}
    for i, s in enumerate(samples):
        j = first_of.setdefault(tuple(s["prompt_ids"]), i)
        if share_prompt and j != i and s["response_ids"]:
            token_samples[i].update(prefix_of=j, prefix_len=len(s["prompt_ids"]))
    batch = collate(token_samples, pad_id, packing=True, max_tokens=max_tokens, one_row=one_row,
                    share_prefixes=share_prompt)
    batch["response_offsets"] = [len(s["prompt_ids"]) - t.get("prefix_len", 0)
                                 for s, t in zip(samples, token_samples)]
    for key in values:
        laid = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for s, p, (r, start, n) in zip(samples, batch["response_offsets"], batch["spans"]):
            laid[r, start + p : start + n] = torch.as_tensor(s[key], dtype=torch.float32)
        batch[key] = laid
    return batch


# ----------------------------------------------------------------------------------------------
# Rollouts, rewards, evaluation
# ----------------------------------------------------------------------------------------------
class RewardModels:
    """Reward models from rm.py in their own Ray actor: one summed score per text."""

    def __init__(self, paths, normalize):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.models = [AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
        self.tokenizer, self.normalize = AutoTokenizer.from_pretrained(paths[0]), normalize

    def score(self, texts):
        from common.infra.reward import score

        return score(self.models, texts, self.tokenizer, normalize=self.normalize).tolist()


def reward_function(args):
    """--remote_rm_url as a function, checked on an empty batch (the URL and token, or the file) before any
    model starts; None without it."""
    if not args.remote_rm_url:
        return None
    from common.infra.remote_reward import make_reward_fn

    reward_fn = make_reward_fn(args.remote_rm_url, token=args.remote_rm_token, flag="--remote_rm_url")
    reward_fn([], [], [])
    return reward_fn


def generate(roles, engines, prompt_ids, sampling, seeds, timeout_s):
    """Split the tokenized prompts over the engines; one list of Sample per prompt, in order. `sampling`: one
    SamplingArgs, or one per prompt; `seeds`: one per prompt, or None (then each SamplingArgs carries its own)."""
    per = math.ceil(len(prompt_ids) / len(engines))
    futures = [e.generate.remote(prompt_ids[i * per : (i + 1) * per],
                                 sampling[i * per : (i + 1) * per] if isinstance(sampling, list) else sampling,
                                 seeds and seeds[i * per : (i + 1) * per])
               for i, e in enumerate(engines) if prompt_ids[i * per : (i + 1) * per]]
    return [group for chunk in roles.get(futures, timeout_s, "vLLM engines (generating)") for group in chunk]


def compute_rewards(roles, reward_fn, reward_models, prompts, groups, tokenizer):
    """One scalar reward per sample, shape (prompts, n): reward file / URL plus reward models."""
    queries = [p["prompt_text"] + s.text for p, g in zip(prompts, groups) for s in g]
    prompt_texts = [p["prompt_text"] for p, g in zip(prompts, groups) for _ in g]
    labels = [p["label"] for p, g in zip(prompts, groups) for _ in g]
    total = torch.zeros(len(queries))
    if reward_fn is not None:
        total += reward_fn(queries, prompt_texts, labels)
    if reward_models is not None:  # the RM reads prompt + response + EOS, as rm.py trained it
        texts = [p["prompt_text"] + tokenizer.decode(s.output_ids) for p, g in zip(prompts, groups) for s in g]
        total += torch.tensor(roles.get(reward_models.score.remote(texts)))
    return total.view(len(prompts), -1)


def carries_loss(sample, mask_truncated):
    """Whether a sampled response (or episode) trains: not a rejected episode, nor a response cut off at
    --generate_max_len under --mask_truncated_responses."""
    return not (getattr(sample, "rejected", False) or (mask_truncated and sample.finish_reason == "length"))


def no_signal(rewards, live, rel_tol=1e-6):
    """A group whose live members' rewards are equal (within `rel_tol` of their size, float32 round-off), or that
    has fewer than two live members: comparing its samples teaches nothing (DAPO's dynamic filtering drops it)."""
    r = rewards.double()[live]
    return len(r) < 2 or (r.max() - r.min()).item() <= rel_tol * r.abs().max().item()


def overlong_penalty(length, max_len, buffer, factor):
    """DAPO: the reward lost by a response of `length` tokens that runs into the last `buffer` tokens."""
    over = length - (max_len - buffer)
    return min(max(over, 0), buffer) / buffer * factor if buffer > 0 else 0.0


def rollout_groups(args, roles, engines, prompts, n, temperature, top_p, seeds, reward_fn, reward_models, tokenizer,
                   env_cls, timing):
    """n responses (or episodes) per prompt and their rewards (prompts, n); timing["time/..."] accumulates."""
    timeout_s, t0 = args.async_rollout.rollout_timeout, time.time()
    if env_cls is not None:  # the environment rewards each episode as it runs
        groups = run_episodes(args, env_cls, lambda ids, sp: generate(roles, engines, ids, sp, None, timeout_s),
                              tokenizer, prompts, n, temperature, seeds, top_p)
        timing["time/generate"] = timing.get("time/generate", 0.0) + time.time() - t0
        return groups, torch.tensor([[e.reward for e in g] for g in groups])
    sampling = SamplingArgs(n=n, temperature=temperature, top_p=top_p, max_new_tokens=args.generate_max_len)
    groups = generate(roles, engines, [p["prompt_ids"] for p in prompts], sampling, seeds, timeout_s)
    timing["time/generate"] = timing.get("time/generate", 0.0) + time.time() - t0
    t0 = time.time()
    rewards = compute_rewards(roles, reward_fn, reward_models, prompts, groups, tokenizer)
    timing["time/reward"] = timing.get("time/reward", 0.0) + time.time() - t0
    return groups, rewards


def collect_rollout(args, roles, engines, prompts, start, version, reward_fn, reward_models, tokenizer, env_cls):
    """One step's rollout from prompt position `start` with the engines holding policy `version`:
    --rollout_batch_size prompts, n responses (or episodes) each, rewarded; with --dynamic_filtering groups of
    equal rewards are dropped and new prompts refill the batch. Runs on the driver, or with --async_train in the
    rollout thread while the trainer updates on the previous step's samples."""
    kept, dropped, rounds, position, timing = [], [], 0, start, {}
    while len(kept) < args.rollout_batch_size and rounds < max(1, args.dynamic_filtering_max_rounds):
        need, rounds = args.rollout_batch_size - len(kept), rounds + 1
        positions = range(position, position + need)
        position += need
        batch_prompts = [prompt_at(prompts, i, args.train.seed) for i in positions]
        # a seed per prompt position: the same samples whatever the engine count or batching (resume is exact)
        groups, rewards = rollout_groups(args, roles, engines, batch_prompts, args.n_samples_per_prompt,
                                         args.temperature, args.top_p,
                                         [args.train.seed * 1_000_003 + i for i in positions],
                                         reward_fn, reward_models, tokenizer, env_cls, timing)
        for p, g, r in zip(batch_prompts, groups, rewards):
            live = torch.tensor([carries_loss(s, args.mask_truncated_responses) for s in g])
            (dropped if args.dynamic_filtering and no_signal(r, live) else kept).append((p, g, r))
        if not args.dynamic_filtering:
            break
    kept += dropped[: args.rollout_batch_size - len(kept)]  # rounds ran out: equal-reward groups carry no signal
    return {"kept": kept, "dropped": len(dropped), "rounds": rounds, "end": position, "version": version,
            "timing": timing}


class Rollouts:
    """Each step's rollout (collect(prompt position, policy version) -> rollout). Synchronous: collected when the
    step asks. With --async_train (K = --max_staleness > 0) a thread collects them ahead: step j's on the weights
    of update max(j - K, 0) exactly, and a weight sync waits until every rollout due on the weights it replaces is
    collected, so it never overlaps a generation. Every wait is bounded by --rollout_timeout."""

    def __init__(self, args, collect, first_step, total_steps, position):
        self.collect, self.position, self.version, self.total = collect, position, first_step, total_steps
        self.ahead = args.async_rollout.max_staleness if off_policy(args) else None
        self.timeout_s, self.changed = args.async_rollout.rollout_timeout, threading.Condition()
        if self.ahead is not None:
            self.ready, self.collected, self.error = queue.Queue(), first_step, None
            threading.Thread(target=self._collect_ahead, args=(first_step,), daemon=True, name="rollout").start()

    def _collect_ahead(self, first_step):
        try:
            for j in range(first_step, self.total):
                with self.changed:
                    self.changed.wait_for(lambda: self.version >= j - self.ahead)
                rollout = self.collect(self.position, self.version)
                self.position = rollout["end"]
                self.ready.put(rollout)
                with self.changed:
                    self.collected = j + 1
                    self.changed.notify_all()
        except BaseException as e:  # re-raised where the driver waits
            self.ready.put(e)
            with self.changed:
                self.error = e
                self.changed.notify_all()

    def next(self, step):
        """The rollout of `step` (0-based)."""
        if self.ahead is None:
            rollout = self.collect(self.position, self.version)
            self.position = rollout["end"]
            return rollout
        try:
            rollout = self.ready.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RoleFailed(f"vLLM engines (the rollout of step {step + 1} in the rollout thread): not finished "
                             f"within {self.timeout_s:.0f} s (--rollout_timeout)") from None
        if isinstance(rollout, BaseException):
            raise rollout
        return rollout

    @contextlib.contextmanager
    def new_weights(self):
        """Around a weight sync (or an update that changed no weight): first the engines finish the rollouts due
        on the weights they hold."""
        if self.ahead is not None:
            due = min(self.version + self.ahead + 1, self.total)
            with self.changed:
                if not self.changed.wait_for(lambda: self.collected >= due or self.error, timeout=self.timeout_s):
                    raise RoleFailed(f"vLLM engines (the rollouts up to step {due} in the rollout thread): not "
                                     f"finished within {self.timeout_s:.0f} s (--rollout_timeout)")
                if self.error is not None:
                    raise self.error
        yield
        with self.changed:
            self.version += 1
            self.changed.notify_all()


def rollout_samples(rollout, args):
    """The training samples of a rollout (prompt and response ids, vLLM's log-probs, reward less DAPO's
    overlong penalty, masked) and its raw rewards (prompts, n)."""
    samples = []
    for p, g, r in rollout["kept"]:
        for s, reward in zip(g, r.tolist()):
            if isinstance(s, Episode):
                samples.append({**episode_sample(s, args.mask_truncated_responses), "reward": reward})
                continue
            penalty = overlong_penalty(len(s.output_ids), args.generate_max_len, args.overlong_buffer_len,
                                       args.overlong_penalty_factor)
            samples.append({"prompt_ids": p["prompt_ids"], "response_ids": list(s.output_ids),
                            "vllm_logps": list(s.logprobs), "reward": reward - penalty,
                            "masked": not carries_loss(s, args.mask_truncated_responses)})
    return samples, torch.stack([r for _, _, r in rollout["kept"]])


def rollout_metrics(rollout, samples, raw_rewards, step):
    """What every RL driver logs of a rollout: rewards, lengths of the model's own tokens, filtering,
    staleness, and the episodes' turns, forks and rejects."""
    lengths = [int(model_tokens(s).sum()) for s in samples]
    metrics = {"train/reward": raw_rewards.mean().item(), "train/reward_std": raw_rewards.std().item(),
               "train/response_length": sum(lengths) / len(lengths),
               "train/truncated": sum(s["masked"] for s in samples) / len(samples),
               "train/dropped_groups": rollout["dropped"], "train/sampling_rounds": rollout["rounds"],
               "async/policy_version": rollout["version"], "async/staleness": step - rollout["version"],
               **rollout["timing"]}
    episodes = [e for _, g, _ in rollout["kept"] for e in g if isinstance(e, Episode)]
    if episodes:
        metrics.update({"train/episode_turns": sum(e.turns for e in episodes) / len(episodes),
                        "train/episode_length": sum(len(e.tokens()) for e in episodes) / len(episodes),
                        "train/episode_forks": sum(e.forks for e in episodes),
                        "train/episode_rejects": sum(e.rejected for e in episodes)})
    return metrics


def kl_to_reference(samples):
    """train/kl: the k1 estimate of KL(policy || reference) per model token, from the log-probs before the update
    (when the step computed both)."""
    if not all("ref_logps" in s and "old_logps" in s for s in samples):
        return {}
    masks = [model_tokens(s) for s in samples]
    kl = sum((torch.tensor(s["old_logps"])[m] - torch.tensor(s["ref_logps"])[m]).clamp(-10, 10).sum().item()
             for s, m in zip(samples, masks))
    return {"train/kl": kl / max(sum(int(m.sum()) for m in masks), 1)}


def environment(args):
    """The Env class of --agent_func_path, or None."""
    return load_env(args.agent.agent_func_path) if args.agent.agent_func_path else None


@torch.no_grad()
def evaluate(args, roles, engines, eval_prompts, reward_fn, reward_models, tokenizer, env_cls=None):
    n, timing = args.eval_n_samples_per_prompt, {}
    seeds = [args.train.seed + 7919 * i for i in range(len(eval_prompts))]
    groups, rewards = rollout_groups(args, roles, engines, eval_prompts, n, args.eval_temperature, 1.0, seeds,
                                     reward_fn, reward_models, tokenizer, env_cls, timing)
    if env_cls is not None:  # the model's own tokens
        length = sum(len(ids) for g in groups for e in g for ids, trainable, _ in e.segments if trainable)
    else:
        length = sum(len(s.output_ids) for g in groups for s in g)
    return {"eval/pass@1": rewards.mean().item(), f"eval/pass@{n}": rewards.max(1).values.mean().item(),
            "eval/response_length": length / rewards.numel()}
