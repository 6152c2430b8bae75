"""Critic-free RL with vLLM rollouts: GRPO, Dr. GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline.

    python algos/grpo.py --pretrain outputs/sft --prompt_data assets/data/reverse/rl_train.jsonl \\
        --input_key prompt --label_key answer --apply_chat_template \\
        --remote_rm_url launch/rewards/exact_match.py --n_samples_per_prompt 8 \\
        --rollout_batch_size 32 --train_batch_size 64 --micro_train_batch_size 16 \\
        --actor_num_gpus_per_node 2 --vllm_num_engines 1 --save_path outputs/grpo

This process is the Ray driver (a local Ray, or a cluster with --ray_address). Ray only places
models: trainer actors that form one torch.distributed group and run DeepSpeed (the policy, and
the reference model when a KL term is on), vLLM engine actors, and a reward-model actor when
--reward_pretrain is given. On CPU every role is a process; "GPUs" in flag names count trainer
ranks there. Each step reads top to bottom in `main`: prompts -> n samples per prompt -> rewards
-> log-probs (policy before the update, reference) -> advantages -> policy update -> weight sync.

Multi-turn agents (--agent_func_path env.py, a class Env with reset / step; launch/agent_lookup.py is the
built-in task's): each episode is a list of segments (token_ids, trainable, logprobs), the model's turns
appended as the tokens vLLM sampled and the environment's as tokens that carry no loss and take no part in
the advantages. With a chat template each next turn is rendered and must extend the text of the tokens so
far (only what it adds is tokenised), else the sample forks or the episode is rejected (counted).

Asynchronous rollouts (--async_train --max_staleness 1): the next step's rollout runs in a driver thread
while the trainer updates; the weight sync waits for it to finish (never overlaps a generation); those
samples are one update old, and vLLM's log-probs of them are the old policy of the clipped ratio.

Differences from OpenRLHF, on purpose: --init_kl_coef defaults to 0 (no reference model, as GRPO
recipes with verifiable rewards now run); `dr_grpo` also uses Dr. GRPO's constant loss normaliser
(OpenRLHF keeps the token mean); log-probs are of the untempered policy (the temperature only
shapes sampling), and vLLM's log-probs of the sampled tokens are checked against the trainer's
every step (`check/vllm_logp_max_abs_diff`).
"""

import concurrent.futures
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal, Optional

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.data import BadRow, format_prompt, load_one, load_tokenizer, validate_prompt_args  # noqa: E402
from common.engine import (  # noqa: E402
    CkptArgs, ModelArgs, TrainArgs, accumulation_steps, all_reduce_sum, create_eval_engine, create_train_engine,
    deepspeed_config, deepspeed_eval_config, device, finish, hold_ckpt_path, init_distributed, load_causal_lm,
    load_checkpoint, optimizer_step, parse_cli, save_checkpoint, save_hf_model, script_ckpt_args, set_seed,
    validate_common_args,
)
from common.packing import (  # noqa: E402
    branch_source_logits, collate, one_row_per_batch, to_device, token_logps, unpack,
)
from common.roles import RoleFailed, Roles, actor_class  # noqa: E402
from common.tracking import LogArgs, MetricsLogger, eval_due, exit_with_error, progress  # noqa: E402
from common.varlen_attention import NAME as VARLEN_ATTENTION  # noqa: E402
from common.vllm_engine import EngineArgs, SamplingArgs, default_max_num_seqs, resolve_max_model_len  # noqa: E402

ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline")
GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


@dataclass
class ActorTrainArgs(TrainArgs):
    train_batch_size: int = 64
    """Global samples (responses) per optimizer step, across all trainer ranks."""
    max_epochs: int = 1
    """Passes over each rollout's samples (PPO epochs)."""
    learning_rate: Annotated[float, tyro.conf.arg(name="actor_learning_rate")] = 1e-6
    """Peak learning rate of the policy (AdamW)."""
    lr_warmup_ratio: float = 0.0
    """Fraction of optimizer steps with linear warmup."""
    lr_scheduler: str = "constant_with_warmup"
    """Any transformers scheduler name."""


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
class Args:
    model: ModelArgs = field(default_factory=ModelArgs)
    train: ActorTrainArgs = field(default_factory=ActorTrainArgs)
    engine: RolloutEngineArgs = field(default_factory=RolloutEngineArgs)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    log: RolloutLogArgs = field(default_factory=RolloutLogArgs)
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
    served by `python -m common.remote_reward`."""
    remote_rm_token: Optional[str] = None
    """Bearer token for an HTTP --remote_rm_url (default: $MINRLHF_REWARD_TOKEN)."""
    reward_pretrain: Optional[str] = None
    """Comma list of reward models exported by rm.py; their scores are summed (and added to --remote_rm_url's)."""
    normalize_reward: bool = False
    """Normalise each reward model's score with the mean/std rm.py stored in its config."""
    reward_clip_range: tuple[float, float] = (-10.0, 10.0)
    """Clamp each sample's scalar reward to this range."""
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
    """Samples per forward pass when computing log-probs before the update."""
    num_episodes: int = 1
    """Passes over the prompt data."""
    max_steps: int = -1
    """Stop after this many rollout steps (-1: as many as --num_episodes give)."""
    prompt_max_len: int = 1024
    """Longest prompt in tokens."""
    generate_max_len: int = 1024
    """Longest response in tokens."""
    temperature: float = 1.0
    """Rollout sampling temperature."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass."""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample new prompts to refill the batch."""
    dynamic_filtering_max_rounds: int = 4
    """Sampling rounds per step for --dynamic_filtering; then the batch is topped up with dropped groups."""
    mask_truncated_responses: bool = False
    """Responses cut off at --generate_max_len carry no loss."""
    # -- loss
    advantage_estimator: Literal["group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"] = "group_norm"
    """group_norm: GRPO (r - mean) / (std + eps) in the group; dr_grpo: r - mean and a constant loss normaliser;
    rloo: leave-one-out baseline; reinforce: REINFORCE++ (KL in the reward, return-to-go, global whitening);
    reinforce_baseline: group-mean baseline, then global whitening."""
    gamma: float = 1.0
    """Discount of the return-to-go (reinforce only; the group estimators use 1)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """token: mean over every response token of the optimizer step; sequence: mean over samples of each
    sample's token mean (dr_grpo always sums and divides by train_batch_size x generate_max_len)."""
    eps_clip: float = 0.2
    """PPO ratio clip."""
    eps_clip_low_high: Optional[tuple[float, float]] = None
    """Asymmetric clip (DAPO clip-higher): clamp the ratio to [1 - low, 1 + high] instead of +-eps_clip."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1: for negative advantages the loss is at most -c x A."""
    init_kl_coef: float = 0.0
    """KL coefficient to the reference model (0: no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator: k1 log(p/p_ref), k2 log(p/p_ref)^2 / 2, k3 p_ref/p - 1 - log(p_ref/p)."""
    use_kl_loss: bool = False
    """Put the KL in the loss (GRPO style) instead of the reward."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient (entropy is logged either way)."""
    vllm_is_truncation: float = 0.0
    """Truncated importance sampling: weight each token's loss by min(p_trainer / p_vllm, this) (0: off)."""
    # -- agents: multi-turn environments
    agent_func_path: Optional[str] = None
    """A .py file defining `class Env` with reset(prompt, label) -> first observation text and step(action text) ->
    (observation text, reward, done), one Env per episode; the episode's reward is the sum of its steps' rewards
    (instead of --remote_rm_url / --reward_pretrain)."""
    max_turns: int = 4
    """Model turns per episode at most (--agent_func_path)."""
    max_episode_tokens: Optional[int] = None
    """Token budget of an episode: prompt, model and environment turns (default: --prompt_max_len + --max_turns x
    --generate_max_len); each model turn gets at most what is left."""
    episode_mismatch: Literal["fork", "reject"] = "fork"
    """When the chat template renders the next turn so that it does not extend what the episode's tokens say (it
    rewrites history): fork (the training sample restarts at the rendered conversation; earlier turns become context
    without loss) or reject (the episode carries no loss). Counted as train/episode_forks and train/episode_rejects."""
    # -- asynchronous rollouts
    async_train: bool = False
    """Generate the next step's samples while the trainer updates on this step's (one step off-policy)."""
    max_staleness: int = 1
    """With --async_train: the most policy updates between the weights that generated a sample and the update that
    trains on it (0: no overlap, the synchronous run). One rollout runs ahead, so any K >= 1 trains one update
    off-policy, with vLLM's log-probs as the old policy."""
    rollout_timeout: float = 1800.0
    """Seconds the driver waits for a step's rollout (engines, environment, rewards), and for the engines to finish
    it before a weight sync; then it stops naming who is late."""
    # -- placement
    actor_num_nodes: int = 1
    """Nodes for the trainer group."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks per node (devices on CUDA, processes on CPU)."""
    vllm_num_engines: int = 1
    """vLLM engines (each --vllm_tensor_parallel_size devices)."""
    colocate_all_models: bool = False
    """Put trainers, vLLM engines and reward models on the same devices (one placement-group bundle each)."""
    vllm_enable_sleep: bool = False
    """Sleep the vLLM engines while training (CUDA; a logged no-op on CPU)."""
    ray_address: Optional[str] = None
    """Join this Ray cluster (default: start a local Ray)."""
    startup_timeout: float = 900.0
    """Seconds every role (trainers, vLLM engines, reward models) may take to load its models and start."""
    rendezvous_timeout: float = 120.0
    """Seconds a group set-up (trainer group, weight-sync group) waits for its members; then it stops naming who
    did not join."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    validate_common_args(args.model, args.train, args.ckpt, world)
    if args.model.aux_loss_coef > 0:
        raise ValueError("--aux_loss_coef (MoE load balancing) is not implemented in grpo.py")
    n = args.n_samples_per_prompt
    if n < 1:
        raise ValueError(f"--n_samples_per_prompt must be >= 1, got {n}")
    if n == 1 and args.advantage_estimator in GROUP_ESTIMATORS:
        raise ValueError(f"--advantage_estimator {args.advantage_estimator} compares samples of the same prompt: "
                         f"set --n_samples_per_prompt >= 2 (or use --advantage_estimator reinforce)")
    rollout = args.rollout_batch_size * n
    if rollout % args.train.train_batch_size:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} x --n_samples_per_prompt {n} = {rollout} "
                         f"samples must be a multiple of --train_batch_size {args.train.train_batch_size}")
    if rollout % (args.micro_rollout_batch_size * world):
        raise ValueError(f"{rollout} samples per rollout must be a multiple of --micro_rollout_batch_size "
                         f"{args.micro_rollout_batch_size} x {world} trainer ranks")
    if args.agent_func_path:
        load_env(args.agent_func_path)  # a missing file or class fails now, not after the models load
        if args.remote_rm_url or args.reward_pretrain:
            raise ValueError("--agent_func_path: the environment's step() gives the rewards; drop --remote_rm_url "
                             "and --reward_pretrain")
        if args.max_turns < 1:
            raise ValueError(f"--max_turns must be >= 1, got {args.max_turns}")
        if args.overlong_buffer_len > 0:
            raise ValueError("--overlong_buffer_len is for single-turn responses, not --agent_func_path episodes")
        if args.max_episode_tokens is None:
            args.max_episode_tokens = args.prompt_max_len + args.max_turns * args.generate_max_len
        if args.max_episode_tokens <= args.prompt_max_len:
            raise ValueError(f"--max_episode_tokens {args.max_episode_tokens} leaves no room after --prompt_max_len "
                             f"{args.prompt_max_len}")
    elif not (args.remote_rm_url or args.reward_pretrain):
        raise ValueError("no reward: give --remote_rm_url (a .py reward file or an HTTP URL), --reward_pretrain, "
                         "or an environment (--agent_func_path)")
    if args.remote_rm_url and not args.remote_rm_url.startswith(("http://", "https://")):
        from common.remote_reward import load_reward_func

        # a missing file or function fails now, not after the models load
        load_reward_func(args.remote_rm_url, "--remote_rm_url")
    needed = max(args.prompt_max_len + args.generate_max_len, args.max_episode_tokens or 0)
    if args.engine.max_model_len is not None and args.engine.max_model_len < needed:
        raise ValueError(f"--max_model_len {args.engine.max_model_len} must be >= --prompt_max_len "
                         f"{args.prompt_max_len} + --generate_max_len {args.generate_max_len}"
                         + (f" and >= --max_episode_tokens {args.max_episode_tokens}" if args.agent_func_path else ""))
    args.engine.max_model_len = resolve_max_model_len(args.model.pretrain, args.engine.max_model_len, needed)
    if args.use_kl_loss and args.init_kl_coef <= 0:
        raise ValueError("--use_kl_loss needs --init_kl_coef > 0")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise ValueError(f"--dual_clip must be > 1, got {args.dual_clip}")
    if args.overlong_buffer_len >= args.generate_max_len:
        raise ValueError(f"--overlong_buffer_len {args.overlong_buffer_len} must be < --generate_max_len")
    if args.colocate_all_models and args.vllm_num_engines * args.engine.tp_size != world:
        raise ValueError(f"--colocate_all_models puts one engine device on each trainer device: --vllm_num_engines "
                         f"x --vllm_tensor_parallel_size must equal {world} trainer ranks")
    if args.vllm_enable_sleep and not args.colocate_all_models:
        raise ValueError("--vllm_enable_sleep only helps with --colocate_all_models")
    if args.max_staleness < 0:
        raise ValueError(f"--max_staleness must be >= 0, got {args.max_staleness}")
    if args.async_train and args.vllm_enable_sleep:
        raise ValueError("--async_train generates while the trainer updates: the engines cannot sleep "
                         "(drop --vllm_enable_sleep)")
    if off_policy(args):  # samples one update old: the clip is the trust region that keeps that stable
        eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
        if not (0 < eps_low < 1 and 0 < eps_high < 1):
            raise ValueError(f"--async_train with --max_staleness {args.max_staleness} needs a clipped ratio: "
                             f"--eps_clip / --eps_clip_low_high bounds in (0, 1), got {eps_low}, {eps_high}")
        if args.vllm_is_truncation > 0:
            raise ValueError("--vllm_is_truncation with --async_train --max_staleness > 0: the old policy is already "
                             "vLLM's (the ratio p_trainer / p_vllm is the clipped PPO ratio)")
    validate_prompt_args(args.input_template, args.apply_chat_template)
    return args


# ----------------------------------------------------------------------------------------------
# Advantages, KL and the policy loss: small pure functions  (forkers edit these)
# ----------------------------------------------------------------------------------------------
def group_baseline(rewards, estimator, eps=1e-9):
    """Scalar per sample from rewards of shape (prompts, n): the group-relative signal of each
    estimator (std is the unbiased one, as torch.std)."""
    if estimator == "group_norm":
        return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + eps)
    if estimator in ("dr_grpo", "reinforce_baseline"):
        return rewards - rewards.mean(1, keepdim=True)
    if estimator == "rloo":
        n = rewards.shape[1]
        return rewards - (rewards.sum(1, keepdim=True) - rewards) / (n - 1)
    return rewards  # reinforce: no baseline


def approx_kl(logps, ref_logps, estimator):
    """Per-token KL estimate of the policy to the reference, clamped to +-10."""
    log_ratio = logps - ref_logps
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio**2 / 2
    else:
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    return kl.clamp(-10, 10)


def returns_to_go(token_rewards, gamma):
    """G_t = sum_{k >= t} gamma^(k - t) r_k of one response."""
    out, running = torch.zeros_like(token_rewards), 0.0
    for t in range(len(token_rewards) - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def compute_advantages(rewards, kl_penalties, estimator, gamma=1.0, eps=1e-9):
    """Per-token advantages of every sample.

    rewards: (prompts, n) scalar rewards; kl_penalties: prompts x n 1-D tensors, beta x KL_t per
    response token (zeros when the KL is not in the reward). Token rewards are -beta x KL_t plus the
    group-relative scalar at the last token; advantages are their returns-to-go (gamma only for
    reinforce), whitened over all tokens of the rollout for reinforce and reinforce_baseline."""
    scalars = group_baseline(rewards, estimator, eps).flatten()
    g = gamma if estimator == "reinforce" else 1.0
    advantages = []
    for s, kl in zip(scalars, kl_penalties):
        token_rewards = -kl.clone().float()
        token_rewards[-1] += s
        advantages.append(returns_to_go(token_rewards, g))
    if estimator in ("reinforce", "reinforce_baseline"):
        flat = torch.cat(advantages)
        mean, std = flat.mean(), flat.std() if flat.numel() > 1 else torch.tensor(1.0)
        advantages = [(a - mean) / (std + eps) for a in advantages]
    return advantages


def sample_advantages(samples, rewards, args):
    """Per-response-token advantages of each sample (rewards: (prompts, n)). Only the model's tokens take part
    (their KL penalties, returns-to-go, the whitening); an episode's environment tokens get 0 and can never change
    the advantages of the model's tokens."""
    kl_in_reward = args.init_kl_coef > 0 and not args.use_kl_loss
    masks = [torch.tensor(s.get("trainable", [1] * len(s["response_ids"])), dtype=torch.bool) for s in samples]
    kls = [args.init_kl_coef * approx_kl(torch.tensor(s["old_logps"])[m], torch.tensor(s["ref_logps"])[m],
                                         args.kl_estimator)
           if kl_in_reward else torch.zeros(int(m.sum())) for s, m in zip(samples, masks)]
    out = []
    for m, a in zip(masks, compute_advantages(rewards, kls, args.advantage_estimator, args.gamma)):
        full = torch.zeros(len(m))
        full[m] = a
        out.append(full)
    return out


def policy_loss(logps, old_logps, advantages, eps_low, eps_high, dual_clip=None):
    """Per-token PPO clipped loss (asymmetric bounds, optional dual clip) and a clipped-token mask."""
    ratio = torch.exp((logps - old_logps).clamp(-20, 20))
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss, (surr2 < surr1).float()


def aggregate(per_token, mask, sample_index, num_samples, mode):
    """Sum of the loss terms of one micro-batch, to be divided by the step's normaliser (see
    step_normaliser): token and constant modes sum the tokens, sequence mode sums each sample's
    token mean. Splitting a step into micro-batches or ranks does not change the total."""
    if mode == "sequence":
        keep = sample_index >= 0
        sums = torch.zeros(num_samples,
                           dtype=per_token.dtype).index_add(0, sample_index[keep], (per_token * mask)[keep])
        counts = torch.zeros(num_samples, dtype=per_token.dtype).index_add(0, sample_index[keep], mask[keep])
        return (sums / counts.clamp(min=1)).sum()
    return (per_token * mask).sum()


def step_normaliser(mode, tokens, sequences, train_batch_size, generate_max_len):
    """What a step's summed loss is divided by: its loss tokens (token), its samples with loss
    tokens (sequence), or Dr. GRPO's constant train_batch_size x generate_max_len (constant)."""
    if mode == "constant":
        return float(train_batch_size * generate_max_len)
    return float(max(tokens if mode == "token" else sequences, 1))


def loss_mode(args):
    return "constant" if args.advantage_estimator == "dr_grpo" else args.loss_agg


def token_entropy(logits, batch):
    """Entropy of each position's next-token distribution, aligned like common.packing.token_logps."""
    def entropy(x):
        logps = x.float().log_softmax(-1)
        return -(logps.exp() * logps).sum(-1)

    out = torch.nn.functional.pad(entropy(logits[:, :-1]), (1, 0))
    branches = branch_source_logits(logits, batch)
    if branches is not None:  # a branch's first token is predicted from its root's prompt (make_batch)
        rows, tokens, source_logits = branches
        out = out.index_put((rows, tokens), entropy(source_logits))
    return out


def off_policy(args):
    """--async_train with --max_staleness > 0: samples come from the weights one update before the
    trainer's, and vLLM's log-probs of them (the behaviour policy) are the old policy of the clip."""
    return args.async_train and args.max_staleness > 0


def single_update(args):
    """Each rollout feeds exactly one optimizer step, and no KL to the reference goes into the
    reward: the log-probs before the update are the update's own (ratio 1), so the separate
    forward that computes them is skipped, as TRL and OpenRLHF skip it. Never off-policy: there
    the ratio to the behaviour policy is not 1."""
    if off_policy(args):
        return False
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    one_step = args.train.max_epochs == 1 and samples == args.train.train_batch_size
    return one_step and not (args.init_kl_coef > 0 and not args.use_kl_loss)


def micro_batch_loss(model, batch, args, normaliser, scale=1.0):
    """The policy loss of one collated micro-batch, already divided by the step's normaliser (times
    `scale`, which undoes DeepSpeed's averaging); returns (loss, metric sums). Without "old_logps"
    in the batch (single_update) the current log-probs stand in for them, detached."""
    logps, outputs = token_logps(model, batch)
    mask = batch["loss_mask"]
    old_logps = batch["old_logps"] if "old_logps" in batch else logps.detach()
    eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
    per_token, clipped = policy_loss(logps, old_logps, batch["advantages"], eps_low, eps_high, args.dual_clip)
    if args.vllm_is_truncation > 0:  # vLLM sampled from slightly different numbers than the trainer computes
        per_token = per_token * torch.exp(old_logps - batch["vllm_logps"]).clamp(max=args.vllm_is_truncation)
    mode = loss_mode(args)
    pieces = {"policy_loss": aggregate(per_token, mask, batch["sample_index"], batch["num_samples"], mode)}
    total = pieces["policy_loss"]
    if args.use_kl_loss:
        kl = approx_kl(logps, batch["ref_logps"], args.kl_estimator)
        pieces["kl_loss"] = aggregate(kl, mask, batch["sample_index"], batch["num_samples"], mode)
        total = total + args.init_kl_coef * pieces["kl_loss"]
    with torch.set_grad_enabled(args.entropy_loss_coef > 0):
        entropy = token_entropy(outputs.logits, batch)
        pieces["entropy"] = aggregate(entropy, mask, batch["sample_index"], batch["num_samples"], mode)
    if args.entropy_loss_coef > 0:
        total = total - args.entropy_loss_coef * pieces["entropy"]
    pieces["clip_ratio"] = aggregate(clipped, mask, batch["sample_index"], batch["num_samples"], mode)
    metrics = {k: v.item() for k, v in pieces.items()}
    # vLLM's log-probs of its samples vs the trainer's before this update (the weight-sync check)
    metrics["vllm_logp_max_abs_diff"] = ((old_logps - batch["vllm_logps"]).abs() * mask).max().item()
    return total * scale / normaliser, metrics


# ----------------------------------------------------------------------------------------------
# Samples: a response with its prompt, made into collated batches with per-token values
# ----------------------------------------------------------------------------------------------
def token_sample(s):
    """The input_ids/loss_mask dict collate() packs: loss on the response tokens the model wrote (an episode's
    environment tokens are not trainable), none if masked."""
    trainable = s.get("trainable", [1] * len(s["response_ids"]))
    return {"input_ids": s["prompt_ids"] + s["response_ids"],
            "loss_mask": [0] * len(s["prompt_ids"]) + [0 if s.get("masked") else t for t in trainable]}


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


def reference_args(args: Args):
    """The frozen reference model (--init_kl_coef > 0): the start policy, loaded as the policy is (attention
    kernel, 4-bit)."""
    return ModelArgs(pretrain=args.model.pretrain, attn_implementation=args.model.attn_implementation,
                     load_in_4bit=args.model.load_in_4bit)


# ----------------------------------------------------------------------------------------------
# The trainer: one Ray actor per rank; together one torch.distributed group running DeepSpeed
# ----------------------------------------------------------------------------------------------
class PolicyTrainer:
    def __init__(self, args: Args, rank, world, pad_id):
        self.args, self.rank, self.world, self.pad_id = args, rank, world, pad_id

    def address(self):
        """Rank 0's address and a free port for the group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, master_addr, master_port, num_training_steps):
        """Join the trainer group (bounded by --rendezvous_timeout) and load the models."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        init_distributed(timeout_s=self.args.rendezvous_timeout)
        args = self.args
        if not torch.cuda.is_available():  # Ray gives an actor num_cpus threads (1); the phases run one at a time
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.actor_num_gpus_per_node))
        set_seed(args.train.seed)
        ds_config = deepspeed_config(args.train, self.world)
        model = load_causal_lm(args.model, ds_config)
        self.one_row = one_row_per_batch(model.config._attn_implementation)
        self.share_prompt = model.config._attn_implementation == VARLEN_ATTENTION  # the kernel reads branches
        self.engine = create_train_engine(model, args.train, ds_config, num_training_steps)
        self.ref = None
        if args.init_kl_coef > 0:  # coefficient 0: no reference model at all
            ref_config = deepspeed_eval_config(args.train, self.world)
            ref_model = load_causal_lm(reference_args(args), ref_config)
            self.ref = create_eval_engine(ref_model, ref_config)
        return True

    def setup_weight_sync(self, engines):
        import ray

        from common.weight_sync import WeightSync

        self.weight_sync = WeightSync(engines if self.rank == 0 else [], colocated=self.args.colocate_all_models,
                                      tp_size=self.args.engine.tp_size, host=ray.util.get_node_ip_address(),
                                      timeout_s=self.args.rendezvous_timeout)
        return True

    def sync_weights(self):
        return self.weight_sync.sync(self.engine)

    @torch.no_grad()
    def logprobs(self, samples, policy=True):
        """Per-response-token log-probs under the reference, and under the policy before the update
        unless single_update makes them the update's own."""
        self.engine.eval()
        out = {"old_logps": [], "ref_logps": []}
        micro, max_tokens = self.args.micro_rollout_batch_size, self.max_tokens(samples)
        for start in range(0, len(samples), micro):
            chunk = samples[start : start + micro]
            batch = to_device(make_batch(chunk, self.pad_id, max_tokens, self.one_row, share_prompt=self.share_prompt),
                              device())
            for key, model in (("old_logps", self.engine if policy else None), ("ref_logps", self.ref)):
                if model is None:
                    continue
                logps, _ = token_logps(model, batch)
                out[key] += [t[p:].cpu().tolist() for p, t in zip(batch["response_offsets"], unpack(logps, batch))]
        self.engine.train()
        return out

    def max_tokens(self, samples):
        """Packed row length: the longest sample the run can produce (and at least this batch's longest)."""
        longest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
        return max(longest, self.args.prompt_max_len + self.args.generate_max_len)

    def train(self, steps):
        """steps: this rank's samples of each optimizer step (with advantages, old/ref/vLLM
        log-probs). Returns the step-averaged metrics (rank 0)."""
        args, engine = self.args, self.engine
        micro = args.train.micro_train_batch_size
        gas = accumulation_steps(args.train.train_batch_size, micro, self.world)
        values = (["advantages", "vllm_logps"] + ([] if single_update(args) else ["old_logps"])
                  + (["ref_logps"] if args.use_kl_loss else []))
        totals, grad_norms, lrs, vllm_diff = {}, [], [], 0.0
        for samples in steps:
            max_tokens = self.max_tokens(samples)
            batches = [to_device(make_batch(samples[i : i + micro], self.pad_id, max_tokens, self.one_row, values,
                                            self.share_prompt), device())
                       for i in range(0, len(samples), micro)]
            tokens, sequences = all_reduce_sum([sum(b["loss_mask"].sum().item() for b in batches),
                                                sum(not s.get("masked") for s in samples)])
            normaliser = step_normaliser(loss_mode(args), tokens, sequences, args.train.train_batch_size,
                                         args.generate_max_len)
            lrs.append(engine.get_lr()[0])
            step_metrics = {}
            for batch in batches:
                loss, metrics = micro_batch_loss(engine, batch, args, normaliser, scale=gas * self.world)
                engine.backward(loss)
                grad_norm = optimizer_step(engine)
                vllm_diff = max(vllm_diff, metrics.pop("vllm_logp_max_abs_diff"))
                for k, v in metrics.items():
                    step_metrics[k] = step_metrics.get(k, 0.0) + v / normaliser
            reduced = all_reduce_sum(list(step_metrics.values()))
            for k, v in zip(step_metrics, reduced):
                totals[k] = totals.get(k, 0.0) + v / len(steps)
            grad_norms.append(grad_norm)
        totals["grad_norm"] = sum(grad_norms) / len(grad_norms)
        totals["lr"] = sum(lrs) / len(lrs)
        diff = torch.tensor(vllm_diff, device=device())
        torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
        totals["vllm_logp_max_abs_diff"] = diff.item()
        return totals

    def save_checkpoint(self, step, client_state):
        save_checkpoint(self.engine, self.args.ckpt.ckpt_path, step, client_state, self.args.ckpt.max_ckpt_num)
        return True

    def load_checkpoint(self):
        return load_checkpoint(self.engine, self.args.ckpt.ckpt_path)

    def save_model(self, path):
        tokenizer = load_tokenizer(self.args.model.pretrain, self.args)
        save_hf_model(self.engine, tokenizer, path, merge_lora=self.args.ckpt.merge_lora,
                      base_path=self.args.model.pretrain)
        return True


class RewardModels:
    """Reward models from rm.py in their own Ray actor: one summed score per text."""

    def __init__(self, paths, normalize):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.models = [AutoModelForSequenceClassification.from_pretrained(p).eval() for p in paths]
        self.tokenizer, self.normalize = AutoTokenizer.from_pretrained(paths[0]), normalize

    def score(self, texts):
        from common.reward import score

        return score(self.models, texts, self.tokenizer, normalize=self.normalize).tolist()


# ----------------------------------------------------------------------------------------------
# Driver side: prompts, placement, rewards
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


def place_models(args, world, pad_id, roles):
    """Ray actors: trainers, vLLM engines, reward models; colocated in one placement group, or apart.
    Each is added to `roles` under the name errors give it."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from common.vllm_engine import create_vllm_actor

    gpu = ray.cluster_resources().get("GPU", 0) > 0
    share = 0.2 if args.colocate_all_models else 1  # up to five roles share one device when colocated
    bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
    selectors = None
    if args.actor_num_nodes > 1:  # PACK alone may fill one node: pick distinct nodes, then pin each rank's bundle
        per_node = args.actor_num_gpus_per_node
        probe = placement_group([{k: v * per_node for k, v in bundles[0].items()}] * args.actor_num_nodes,
                                strategy="STRICT_SPREAD")
        roles.get(probe.ready(), timeout_s=args.startup_timeout)
        node_ids = placement_group_table(probe)["bundles_to_node_id"]
        remove_placement_group(probe)
        selectors = [{"ray.io/node-id": node_ids[r // per_node]} for r in range(world)]
        print(f"trainer group: {world} ranks on {args.actor_num_nodes} nodes, {per_node} per node")
    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
    roles.get(pg.ready(), timeout_s=args.startup_timeout)

    def in_bundle(i):
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    cpus = 0.5 if args.colocate_all_models else 1  # colocated roles split their bundle's CPU
    trainers = [roles.add(f"trainer rank {r}", actor_class(PolicyTrainer).options(
                    num_cpus=cpus, num_gpus=share if gpu else 0,
                    scheduling_strategy=in_bundle(r)).remote(args, r, world, pad_id))
                for r in range(world)]
    # an engine holds at once every sample of its share of a rollout (or of an evaluation round)
    per_engine = math.ceil(args.rollout_batch_size / args.vllm_num_engines)
    max_num_seqs = default_max_num_seqs(per_engine * max(args.n_samples_per_prompt, args.eval_n_samples_per_prompt))
    engines = []
    for i in range(args.vllm_num_engines):
        options = {"scheduling_strategy": in_bundle(i * args.engine.tp_size)} if args.colocate_all_models else {}
        engines.append(roles.add(f"vLLM engine {i}", create_vllm_actor(
            args.model.pretrain, args.engine, num_cpus=cpus if args.colocate_all_models else 1,
            num_gpus=(share * args.engine.tp_size) if gpu else 0, enable_sleep=args.vllm_enable_sleep,
            colocated=args.colocate_all_models, options=options, max_num_seqs=max_num_seqs)))
    reward_models = None
    if args.reward_pretrain:
        options = {"scheduling_strategy": in_bundle(0)} if args.colocate_all_models else {}
        reward_models = roles.add("reward models", actor_class(RewardModels).options(
            num_cpus=cpus if args.colocate_all_models else 1, num_gpus=share if gpu else 0, **options).remote(
            [p for p in args.reward_pretrain.split(",") if p], args.normalize_reward))
    return trainers, engines, reward_models


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


def overlong_penalty(length, max_len, buffer, factor):
    """DAPO: the reward lost by a response of `length` tokens that runs into the last `buffer` tokens."""
    over = length - (max_len - buffer)
    return min(max(over, 0), buffer) / buffer * factor if buffer > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# Episodes (--agent_func_path): an environment file, and multi-turn rollouts token in / token out
# ----------------------------------------------------------------------------------------------
def load_env(path):
    """The `Env` class of an environment file; ValueError naming the file and what it lacks."""
    import importlib.util

    if not os.path.isfile(path):
        raise ValueError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"minrlhf_env_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--agent_func_path {path}: importing it raised {type(e).__name__}: {e}") from None
    env = getattr(module, "Env", None)
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if not isinstance(env, type) or missing:
        raise ValueError(f"--agent_func_path {path}: defines no class Env with reset(prompt, label) -> observation "
                         f"and step(action) -> (observation, reward, done)"
                         + (f" (Env lacks {', '.join(missing)})" if isinstance(env, type) else ""))
    return env


@dataclass
class Episode:
    """One episode as segments (token_ids, trainable, logprobs): the prompt and the environment's turns (not
    trainable, logprobs None) and the model's turns (trainable, with vLLM's log-probs). The segments concatenate to
    exactly the tokens the engine was given and produced: nothing the model wrote is re-tokenised."""

    env: object
    segments: list
    messages: list  # the conversation as chat messages, to render the next turn with the chat template
    reward: float = 0.0
    turns: int = 0
    forks: int = 0
    rejected: bool = False
    done: bool = False
    finish_reason: str = "stop"

    def tokens(self):
        return [t for ids, _, _ in self.segments for t in ids]


def env_call(method, path, episode, turn, *inputs):
    """An environment method, its errors and wrong return types named by file, episode and turn."""
    where = f"--agent_func_path {path}: episode {episode}, turn {turn}: Env.{method.__name__}"
    try:
        out = method(*inputs)
    except Exception as e:
        raise ValueError(f"{where} raised {type(e).__name__}: {e}") from None
    if method.__name__ == "reset" and not isinstance(out, str):
        raise ValueError(f"{where} must return the observation text (str), got {type(out).__name__}")
    if method.__name__ == "step" and not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], str)
                                          and isinstance(out[1], (int, float)) and not isinstance(out[1], bool)
                                          and isinstance(out[2], bool)):
        raise ValueError(f"{where} must return (observation: str, reward: float, done: bool), got {out!r}"[:400])
    return out


def append_observation(e, observation, action_text, tokenizer, args):
    """The environment's answer as tokens after the model's. Plain prompts: the observation's own tokens. Chat
    template: the conversation is rendered with the observation as the next user turn (and the generation prompt);
    where that text extends the text of the episode's tokens, the tokens of what it adds are appended (the model's
    tokens stay as sampled, even where they are not the tokenizer's own split of their text). Where it does not
    (the template rewrote history), fork or reject (--episode_mismatch)."""
    if not args.apply_chat_template:
        e.segments.append((tokenizer(observation, add_special_tokens=False)["input_ids"], False, None))
        return
    e.messages += [{"role": "assistant", "content": action_text}, {"role": "user", "content": observation}]
    text = tokenizer.apply_chat_template(e.messages, tokenize=False, add_generation_prompt=True)
    seen = tokenizer.decode(e.tokens(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if text.startswith(seen):
        e.segments.append((tokenizer(text[len(seen):], add_special_tokens=False)["input_ids"], False, None))
    elif args.episode_mismatch == "fork":
        e.segments, e.forks = [(tokenizer(text, add_special_tokens=False)["input_ids"], False, None)], e.forks + 1
    else:
        e.rejected = e.done = True


def run_episodes(args, env_cls, generate_fn, tokenizer, prompts, n, temperature, seeds):
    """n episodes per prompt, turn by turn: the tokens of every unfinished episode go to the engines at once
    (generate_fn(token lists, SamplingArgs list) -> lists of Sample), the model's turn is appended as the tokens
    it sampled, then the environment's answer. Returns one list of Episode per prompt."""
    path, budget, episodes = args.agent_func_path, args.max_episode_tokens, []
    for p in prompts:
        for _ in range(n):
            try:
                e = Episode(env_cls(), [], [])
            except Exception as error:
                raise ValueError(f"--agent_func_path {path}: episode {len(episodes)}: Env() raised "
                                 f"{type(error).__name__}: {error}") from None
            observation = env_call(e.env.reset, path, len(episodes), 0, p["raw"], p["label"])
            ids = tokenizer(format_prompt(observation, tokenizer, args),
                            add_special_tokens=not args.apply_chat_template)["input_ids"]
            if len(ids) >= budget:
                raise ValueError(f"--agent_func_path {path}: episode {len(episodes)}: the first observation is "
                                 f"{len(ids)} tokens, no room left in --max_episode_tokens {budget}")
            e.segments, e.messages = [(ids, False, None)], [{"role": "user", "content": observation}]
            episodes.append(e)
    for turn in range(args.max_turns):
        active = [(i, e) for i, e in enumerate(episodes) if not e.done]
        if not active:
            break
        # a seed per (prompt seed, sample, turn): hash() of ints is the same in every process and run
        samplings = [SamplingArgs(n=1, temperature=temperature, top_p=args.top_p,
                                  seed=hash((seeds[i // n], i % n, turn)) % 2**31,
                                  max_new_tokens=min(args.generate_max_len, budget - len(e.tokens())))
                     for i, e in active]
        for (i, e), (s,) in zip(active, generate_fn([e.tokens() for _, e in active], samplings)):
            e.segments.append((list(s.output_ids), True, list(s.logprobs)))
            e.turns, e.finish_reason = e.turns + 1, s.finish_reason
            # the text of the sampled tokens, as the check in append_observation decodes them (vLLM's own text
            # holds back a trailing partial UTF-8 character)
            text = tokenizer.decode(s.output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            observation, reward, done = env_call(e.env.step, path, i, turn, text)
            e.reward += float(reward)
            if done or turn + 1 == args.max_turns:
                e.done = True
                continue
            append_observation(e, observation, text, tokenizer, args)
            if len(e.tokens()) >= budget:  # no room for another turn: cut off, as a response at its length limit
                e.done, e.finish_reason = True, "length"
    return [episodes[k * n : (k + 1) * n] for k in range(len(prompts))]


def episode_sample(e, mask_truncated):
    """The training sample of an episode: its first segment is the prompt; the rest is the response, trainable
    where the model wrote it, with vLLM's log-probs there (0 at the environment's tokens, which carry no loss)."""
    (prompt, _, _), rest = e.segments[0], e.segments[1:]
    return {"prompt_ids": list(prompt), "response_ids": [t for ids, _, _ in rest for t in ids],
            "trainable": [int(trainable) for ids, trainable, _ in rest for _ in ids],
            "vllm_logps": [lp for ids, trainable, lps in rest for lp in (lps if trainable else [0.0] * len(ids))],
            "masked": e.rejected or (mask_truncated and e.finish_reason == "length")}


@torch.no_grad()
def evaluate(args, roles, engines, eval_prompts, reward_fn, reward_models, tokenizer, env_cls=None):
    n = args.eval_n_samples_per_prompt
    seeds = [args.train.seed + 7919 * i for i in range(len(eval_prompts))]
    if env_cls is not None:
        groups = run_episodes(args, env_cls, lambda ids, sp: generate(roles, engines, ids, sp, None,
                                                                      args.rollout_timeout),
                              tokenizer, eval_prompts, n, args.eval_temperature, seeds)
        rewards = torch.tensor([[e.reward for e in g] for g in groups])
        length = sum(len(ids) for g in groups for e in g for ids, trainable, _ in e.segments if trainable)
    else:
        sampling = SamplingArgs(n=n, temperature=args.eval_temperature, max_new_tokens=args.generate_max_len)
        groups = generate(roles, engines, [p["prompt_ids"] for p in eval_prompts], sampling, seeds,
                          args.rollout_timeout)
        rewards = compute_rewards(roles, reward_fn, reward_models, eval_prompts, groups, tokenizer)
        length = sum(len(s.output_ids) for g in groups for s in g)
    return {"eval/pass@1": rewards.mean().item(), f"eval/pass@{n}": rewards.max(1).values.mean().item(),
            "eval/response_length": length / rewards.numel()}


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    import ray

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tokenizer = load_tokenizer(args.model.pretrain, args)
    prompts = load_prompts(args.prompt_data, args.prompt_split, args, tokenizer, args.max_samples)
    eval_prompts = args.eval_dataset and load_prompts(args.eval_dataset, args.eval_split, args, tokenizer, 10**9)
    reward_fn = None
    if args.remote_rm_url:
        from common.remote_reward import make_reward_fn

        reward_fn = make_reward_fn(args.remote_rm_url, token=args.remote_rm_token, flag="--remote_rm_url")
        reward_fn([], [], [])  # an empty batch checks the URL and token (or the file) before any model starts
    env_cls = load_env(args.agent_func_path) if args.agent_func_path else None
    n, per_step = args.n_samples_per_prompt, args.rollout_batch_size * args.n_samples_per_prompt
    total_steps = args.num_episodes * len(prompts) // args.rollout_batch_size
    if args.max_steps > 0:
        total_steps = min(total_steps, args.max_steps)
    steps_per_episode = max(len(prompts) // args.rollout_batch_size, 1)
    if total_steps < 1:
        raise ValueError(f"{len(prompts)} prompts x --num_episodes {args.num_episodes} is fewer than one "
                         f"--rollout_batch_size {args.rollout_batch_size}")
    optimizer_steps = total_steps * per_step // args.train.train_batch_size * args.train.max_epochs

    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    else:  # a local Ray: logical CPUs for every role even on a 2-core machine
        ray.init(num_cpus=max(os.cpu_count() or 1, 2 * world + args.vllm_num_engines + 1), include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}})
    roles = Roles()
    trainers, engines, reward_models = place_models(args, world, tokenizer.pad_token_id, roles)
    roles.ready(args.startup_timeout)  # every role is up before anyone waits on another in a rendezvous
    addr, port = roles.get(trainers[0].address.remote())
    roles.get([t.setup.remote(addr, port, optimizer_steps) for t in trainers])
    roles.get([t.setup_weight_sync.remote(engines) for t in trainers])

    state = {"global_step": 0, "consumed_prompts": 0, "best_pass1": -math.inf}
    if args.ckpt.load_checkpoint:
        loaded = roles.get([t.load_checkpoint.remote() for t in trainers])[0]
        if loaded:
            state.update(loaded["grpo_state"])
            roles.get([t.sync_weights.remote() for t in trainers])  # the engines still hold the start weights
        print(f"resumed from {args.ckpt.ckpt_path} at step {state['global_step']}" if loaded else
              f"no checkpoint in {args.ckpt.ckpt_path}: starting from step 0")
    logger = MetricsLogger(args.log, asdict(args), True)
    if eval_prompts and state["global_step"] == 0:
        metrics = evaluate(args, roles, engines, eval_prompts, reward_fn, reward_models, tokenizer, env_cls)
        print("step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        logger.log(metrics, 0)

    sampling = SamplingArgs(n=n, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.generate_max_len)

    def collect(start, version):
        """Steps 1-2 from prompt position `start` with the engines holding policy `version`: sample prompts,
        generate n responses (or episodes) each, reward them, refilling dropped groups. Runs on the driver, or
        with --async_train in the rollout thread while the trainer updates on the previous step's samples."""
        kept, dropped, rounds, position = [], [], 0, start
        timing = {"time/generate": 0.0, "time/reward": 0.0}
        while len(kept) < args.rollout_batch_size and rounds < max(1, args.dynamic_filtering_max_rounds):
            need, rounds = args.rollout_batch_size - len(kept), rounds + 1
            positions = range(position, position + need)
            position += need
            batch_prompts = [prompt_at(prompts, i, args.train.seed) for i in positions]
            # a seed per prompt position: the same samples whatever the engine count or batching (resume is exact)
            seeds = [args.train.seed * 1_000_003 + i for i in positions]
            t0 = time.time()
            if env_cls is not None:  # the environment rewards each episode as it runs
                groups = run_episodes(args, env_cls, lambda ids, sp: generate(roles, engines, ids, sp, None,
                                                                              args.rollout_timeout),
                                      tokenizer, batch_prompts, n, args.temperature, seeds)
                rewards = torch.tensor([[e.reward for e in g] for g in groups])
                timing["time/generate"] += time.time() - t0
            else:
                groups = generate(roles, engines, [p["prompt_ids"] for p in batch_prompts], sampling, seeds,
                                  args.rollout_timeout)
                timing["time/generate"] += time.time() - t0
                t0 = time.time()
                rewards = compute_rewards(roles, reward_fn, reward_models, batch_prompts, groups, tokenizer)
                timing["time/reward"] += time.time() - t0
            for p, g, r in zip(batch_prompts, groups, rewards):
                all_equal = bool((r == r[0]).all())
                (dropped if args.dynamic_filtering and all_equal else kept).append((p, g, r))
            if not args.dynamic_filtering:
                break
        kept += dropped[: args.rollout_batch_size - len(kept)]  # rounds ran out: equal-reward groups carry no signal
        return {"kept": kept, "dropped": len(dropped), "rounds": rounds, "end": position, "version": version,
                "timing": timing}

    def finish_rollout(pending, step):
        """The result of a rollout running in the rollout thread (its errors re-raised), within --rollout_timeout."""
        try:
            return pending.result(timeout=args.rollout_timeout)
        except concurrent.futures.TimeoutError:
            raise RoleFailed(f"vLLM engines (the rollout of step {step + 1} in the rollout thread): not finished "
                             f"within {args.rollout_timeout:.0f} s (--rollout_timeout)") from None

    # --async_train: one rollout runs ahead in this thread, on the weights of the update before the trainer's
    rollout_thread = concurrent.futures.ThreadPoolExecutor(1, "rollout") if off_policy(args) else None
    ready = None  # the next step's rollout, finished before the last weight sync
    bar = progress(range(state["global_step"], total_steps), desc="grpo", initial=state["global_step"],
                   total=total_steps)
    for step in bar:
        t_step, timing = time.time(), {}
        phases = progress(total=5, desc=f"step {step + 1}", leave=False, position=1)

        def phase(name, t0):
            timing[f"time/{name}"] = timing.get(f"time/{name}", 0.0) + time.time() - t0
            phases.set_postfix_str(name)

        # 1-2. this step's prompts, n responses (episodes) each, rewards: collected now, or ahead in the rollout thread
        t0 = time.time()
        rollout = ready or collect(state["consumed_prompts"], state["global_step"])
        phase("rollout_wait", t0)
        timing.update(rollout["timing"])
        state["consumed_prompts"] = rollout["end"]
        pending = None
        if rollout_thread is not None and step + 1 < total_steps:  # the engines keep these weights until it is done
            pending = rollout_thread.submit(collect, rollout["end"], state["global_step"])
        staleness = state["global_step"] - rollout["version"]  # policy updates since the weights that sampled it
        phases.update(2)

        kept = rollout["kept"]
        raw_rewards = torch.stack([r for _, _, r in kept])
        samples = []
        for p, g, r in kept:
            for s, reward in zip(g, r.tolist()):
                if isinstance(s, Episode):
                    samples.append({**episode_sample(s, args.mask_truncated_responses), "reward": reward})
                    continue
                penalty = overlong_penalty(len(s.output_ids), args.generate_max_len, args.overlong_buffer_len,
                                           args.overlong_penalty_factor)
                samples.append({"prompt_ids": p["prompt_ids"], "response_ids": list(s.output_ids),
                                "vllm_logps": list(s.logprobs), "reward": reward - penalty,
                                "masked": args.mask_truncated_responses and s.finish_reason == "length"})

        # 3. log-probs before the update: policy (old, unless single_update or off-policy) and reference
        t0 = time.time()
        shard, policy_pass = per_step // world, not single_update(args) and not off_policy(args)
        if policy_pass or args.init_kl_coef > 0:
            outs = roles.get([t.logprobs.remote(samples[r * shard : (r + 1) * shard], policy_pass)
                              for r, t in enumerate(trainers)])
            for r, out in enumerate(outs):
                for k, s in enumerate(samples[r * shard : (r + 1) * shard]):
                    if policy_pass:
                        s["old_logps"] = out["old_logps"][k]
                    if out["ref_logps"]:
                        s["ref_logps"] = out["ref_logps"][k]
        if off_policy(args):  # the behaviour policy: the weights that sampled them, one update before the trainer's
            for s in samples:
                s["old_logps"] = s["vllm_logps"]
        phase("logprobs", t0)
        phases.update(1)

        # 4. advantages (driver, over the whole rollout; only the model's tokens)
        rewards = torch.tensor([s["reward"] for s in samples]).clamp(*args.reward_clip_range).view(-1, n)
        for s, a in zip(samples, sample_advantages(samples, rewards, args)):
            s["advantages"] = a.tolist()

        # 5. policy update: epochs x optimizer steps, each step's samples split over the ranks
        if args.vllm_enable_sleep:
            roles.get([e.sleep.remote() for e in engines])
        t0 = time.time()
        per_rank_steps = [[] for _ in range(world)]
        B = args.train.train_batch_size
        for epoch in range(args.train.max_epochs):
            order = torch.randperm(per_step,
                                   generator=torch.Generator().manual_seed(args.train.seed + 1000 * step + epoch))
            for k in range(per_step // B):
                chosen = [samples[i] for i in order[k * B : (k + 1) * B].tolist()]
                for r in range(world):
                    per_rank_steps[r].append(chosen[r * (B // world) : (r + 1) * (B // world)])
        train_metrics = roles.get([t.train.remote(per_rank_steps[r]) for r, t in enumerate(trainers)])[0]
        phase("train", t0)
        phases.update(1)

        # 6. push the new weights into every engine, once they have finished the rollout running ahead
        if args.vllm_enable_sleep:
            roles.get([e.wake_up.remote() for e in engines])
        t0 = time.time()
        ready = pending and finish_rollout(pending, step + 1)
        phase("rollout_wait", t0)
        t0 = time.time()
        sync = roles.get([t.sync_weights.remote() for t in trainers], args.rollout_timeout, "weight sync")[0]
        phase("sync", t0)
        phases.update(1)
        phases.close()

        # 7. log, evaluate, save
        state["global_step"] = global_step = step + 1
        model_tokens = [torch.tensor(s.get("trainable", [1] * len(s["response_ids"])), dtype=torch.bool)
                        for s in samples]
        lengths = [int(m.sum()) for m in model_tokens]  # the model's tokens (an episode's environment tokens apart)
        vllm_diff = train_metrics.pop("vllm_logp_max_abs_diff")
        metrics = {"train/reward": raw_rewards.mean().item(), "train/reward_std": raw_rewards.std().item(),
                   "train/response_length": sum(lengths) / len(lengths),
                   "train/truncated": sum(s["masked"] for s in samples) / len(samples),
                   "train/dropped_groups": rollout["dropped"], "train/sampling_rounds": rollout["rounds"],
                   "async/policy_version": rollout["version"], "async/staleness": staleness,
                   "perf/sync_mb": sync["bytes"] / 2**20, "perf/samples_per_s": per_step / (time.time() - t_step),
                   **timing, **{f"train/{k}": v for k, v in train_metrics.items()}}
        if not off_policy(args):  # the trainer's log-probs before the update vs vLLM's on the same weights
            metrics["check/vllm_logp_max_abs_diff"] = vllm_diff
        if env_cls is not None:
            episodes = [e for _, g, _ in rollout["kept"] for e in g]
            metrics.update({"train/episode_turns": sum(e.turns for e in episodes) / len(episodes),
                            "train/episode_length": sum(len(e.tokens()) for e in episodes) / len(episodes),
                            "train/episode_forks": sum(e.forks for e in episodes),
                            "train/episode_rejects": sum(e.rejected for e in episodes)})
        if all("ref_logps" in s and "old_logps" in s for s in samples):
            metrics["train/kl"] = (sum(approx_kl(torch.tensor(s["old_logps"])[m], torch.tensor(s["ref_logps"])[m],
                                                 "k1").sum().item()
                                       for s, m in zip(samples, model_tokens)) / sum(lengths))
        bar.set_postfix(reward=f"{metrics['train/reward']:.3f}")
        if eval_prompts and eval_due(global_step, args.log.eval_steps, steps_per_episode, total_steps):
            metrics.update(evaluate(args, roles, engines, eval_prompts, reward_fn, reward_models, tokenizer, env_cls))
            bar.write(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                          if k.startswith(("eval/", "train/reward"))))
            if metrics["eval/pass@1"] > state["best_pass1"]:
                state["best_pass1"] = metrics["eval/pass@1"]
                roles.get([t.save_model.remote(os.path.join(args.ckpt.save_path, "best")) for t in trainers])
        if global_step % args.log.logging_steps == 0 or "eval/pass@1" in metrics:
            logger.log(metrics, global_step)
        if args.ckpt.save_steps > 0 and (global_step % args.ckpt.save_steps == 0 or global_step == total_steps):
            roles.get([t.save_checkpoint.remote(global_step, {"grpo_state": dict(state)}) for t in trainers])

    if rollout_thread is not None:
        rollout_thread.shutdown()
    roles.get([t.save_model.remote(args.ckpt.save_path) for t in trainers])
    print(f"saved {args.ckpt.save_path}")
    logger.close()
    ray.shutdown()


if __name__ == "__main__":
    try:
        parsed = parse_args()
        hold_ckpt_path(parsed.ckpt)  # a second run on the same --ckpt_path stops here
    except ValueError as e:  # argument mistakes: say what to fix, before Ray or any model starts
        sys.exit(f"error: {e}")
    try:
        main(parsed)
    except ValueError as e:  # data mistakes found before training
        exit_with_error(e)
    except RoleFailed as e:  # a role died, raised or did not start: named, with its root cause
        exit_with_error(e)
    finish()  # exit without interpreter teardown (see common.engine.finish)
