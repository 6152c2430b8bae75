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

Asynchronous rollouts (--async_train --max_staleness K): a driver thread collects the rollouts of the
next K steps while the trainer updates; step j's samples come from the weights of update j - K, and a
weight sync waits until the engines have finished the rollouts due on the old weights (it never
overlaps a generation); vLLM's log-probs of the samples are the old policy of the clipped ratio.

Differences from OpenRLHF, on purpose: --init_kl_coef defaults to 0 (no reference model, as GRPO
recipes with verifiable rewards now run); `dr_grpo` also uses Dr. GRPO's constant loss normaliser
(OpenRLHF keeps the token mean); group statistics are float64 and a group whose rewards are equal up to
round-off gets advantage 0 (OpenRLHF divides by std + 1e-9, which turns float32 round-off of equal rewards
into full-size advantages); rejected episodes set no group baseline, and masked samples (those, and truncated
responses under --mask_truncated_responses, whose rewards stay in the group as in DAPO) no whitening statistic;
--use_kl_loss refuses k1 (as a loss its expected gradient is 0); samples whose advantages are all 0 skip the
forward and backward (the update is the same); rewards are clipped before the group baseline;
the trainer-vLLM log-prob gap is corrected by default (--rollout_correction sequence_mask), logged every step
(`rollout/mismatch_kl`, `rollout/logp_abs_diff_mean` and `_max`) and a gap past --max_mismatch_kl stops the run;
log-probs are of the untempered policy (the temperature only shapes sampling).
"""

import contextlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # algos/.. (README: Forking)
if importlib.util.find_spec("common") is None:
    sys.exit(f"error: {__file__} cannot import common/: run it with PYTHONPATH=<the minrlhf checkout>")
from common.infra.datasets import load_tokenizer  # noqa: E402
from common.infra.cluster import (  # noqa: E402
    environment, reference_args, reward_function, resolve_rollout_args, rollout_steps, start_engines, start_ray,
    start_reward_models, trainer_bundles, validate_rollout_args,
)
from common.infra.roles import RoleFailed, Roles  # noqa: E402
from common.infra.engine import (  # noqa: E402
    CkptArgs, parse_cli, run, script_ckpt_args, validate_common_args,
)
from common.infra.trainer_actor import TrainerSpec, each_ring, per_token, start_group, start_ranks  # noqa: E402
from common.infra.rings import ring_model_args, validate_ring_args  # noqa: E402
from common.logprobs import token_logps  # noqa: E402
from common.rollout import (  # noqa: E402
    RLArgs, Sampler, kl_to_reference, load_prompts, mismatch_metrics, off_policy,
    rollout_metrics, rollout_samples, split_steps,
)
from common.infra.tracking import MetricsLogger, eval_due, progress  # noqa: E402

ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline")
GROUP_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")


@dataclass
class Args(RLArgs):  # + the prompt, reward and rollout flags both RL drivers share (common/rollout.py)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    # -- loss
    advantage_estimator: Literal["group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"] = "group_norm"
    """group_norm: GRPO (r - mean) / (std + eps) in the group; dr_grpo: r - mean and a constant loss normaliser;
    rloo: leave-one-out baseline; reinforce: REINFORCE++ (KL in the reward, return-to-go, global whitening);
    reinforce_baseline: group-mean baseline, then global whitening."""
    gamma: float = 1.0
    """Discount of the return-to-go (reinforce only; the group estimators use 1)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """token: mean over every response token of the optimizer step; sequence: mean over samples of each
    sample's token mean (dr_grpo always sums and divides by train_batch_size x generate_max_len; --policy_loss gspo
    is always sequence)."""
    eps_clip: float = 0.2
    """PPO ratio clip."""
    eps_clip_low_high: Optional[tuple[float, float]] = None
    """Asymmetric clip (DAPO clip-higher): clamp the ratio to [1 - low, 1 + high] instead of +-eps_clip."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1: for negative advantages the loss is at most -c x A."""
    init_kl_coef: float = 0.0
    """KL coefficient to the reference model (0: no reference model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator, per sampled token: k1 log(p/p_ref) (in the reward its mean is KL(policy||ref); as a loss its
    expected gradient is 0, so --use_kl_loss refuses it); k2 log(p/p_ref)^2 / 2 (as a loss: the gradient of
    KL(policy||ref)); k3 p_ref/p - 1 - log(p_ref/p) (as a loss: the gradient of KL(ref||policy), GRPO's)."""
    use_kl_loss: bool = False
    """Put the KL in the loss (GRPO style) instead of the reward."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient (entropy is logged either way)."""
    skip_zero_advantage: bool = True
    """Leave samples whose advantages are all 0 (or that are masked) out of the forward and backward when no KL
    loss or entropy bonus reads them: their gradient is exactly 0, the loss normaliser still counts them, so the
    update is the same (train/skipped_samples)."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """ppo: the clipped ratio per token; gspo: one clipped ratio per sample, the geometric mean of its tokens', each
    sample's tokens averaged (the step is a mean over samples whatever --loss_agg says); cispo: the clipped ratio as a
    constant weight on each token's REINFORCE term (no token loses its gradient). The clip bounds are --eps_clip /
    --eps_clip_low_high."""
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_mask"] = "sequence_mask"
    """Correct for vLLM sampling from slightly different log-probs than the trainer's (ratio = p_trainer / p_vllm):
    token_truncate weighs each token by its ratio clamped to the bounds; token_mask drops tokens whose ratio leaves
    them (IcePop); sequence_mask drops samples whose geometric-mean ratio leaves them. Off-policy runs (--async_train)
    have vLLM's log-probs as the old policy: the clipped ratio is the correction there."""
    rollout_correction_bounds: Optional[tuple[float, float]] = None
    """[low, high] of the ratio --rollout_correction keeps; unset: [0.5, 2] for token_mask, [0, 3] otherwise."""
    max_mismatch_kl: float = 0.1
    """Stop the run when a step's rollout/mismatch_kl (vLLM's log-probs of its samples against the trainer's,
    before the update) exceeds this: the weight sync into vLLM is broken."""
    # -- placement
    actor_num_nodes: int = 1
    """Nodes for the trainer group."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks per node (devices on CUDA, processes on CPU)."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    if args.dynamic_filtering and (args.n_samples_per_prompt < 2 or args.advantage_estimator == "reinforce"):
        raise ValueError("--dynamic_filtering drops groups whose samples all got the same reward, which carry no "
                         "signal only beside a group baseline: not with --n_samples_per_prompt 1 nor "
                         "--advantage_estimator reinforce (whitened over the whole batch)")
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    dp_world = validate_ring_args(args.ring, world, args.model)  # trainer ranks / ring size
    args.model = ring_model_args(args.model, args.ring)  # the ring is the attention implementation
    validate_common_args(args.model, args.train, args.ckpt, dp_world)
    if args.n_samples_per_prompt == 1 and args.advantage_estimator in GROUP_ESTIMATORS:
        raise ValueError(f"--advantage_estimator {args.advantage_estimator} compares samples of the same prompt: "
                         f"set --n_samples_per_prompt >= 2 (or use --advantage_estimator reinforce)")
    validate_rollout_args(args, world, "grpo.py")
    check_loss_flags(args)  # beside the loss terms they configure
    copies = 4 * world + (world if args.init_kl_coef > 0 else 0)  # fp32 weight copies: trainers, reference
    return resolve_rollout_args(args, world, copies)  # derived settings; the reward and environment files load here


# ----------------------------------------------------------------------------------------------
# Advantages, KL and the policy loss: small pure functions  (forkers edit these)
# ----------------------------------------------------------------------------------------------
def group_baseline(rewards, estimator, valid=None, rel_tol=1e-6):
    """Scalar per sample from rewards of shape (prompts, n): the group-relative signal of each estimator (std is
    the unbiased one, as torch.std). Only the `valid` members (default: all) set a group's mean and std and get a
    signal; the others (rejected episodes, masked responses) get 0. Statistics are float64, and a group whose
    valid rewards spread by no more than `rel_tol` of their size carries no signal: its members get 0 (float32
    round-off of equal rewards would otherwise be divided up to full-size advantages)."""
    r = rewards.double()
    w = torch.ones_like(r) if valid is None else valid.double()
    count = w.sum(1, keepdim=True)
    mean = (r * w).sum(1, keepdim=True) / count.clamp(min=1)
    centred = (r - mean) * w
    if estimator == "group_norm":
        std = ((centred**2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        flat = std <= rel_tol * (r.abs() * w).amax(1, keepdim=True)
        out = torch.where(flat, 0.0, centred / std.clamp(min=torch.finfo(torch.float64).tiny))
    elif estimator in ("dr_grpo", "reinforce_baseline"):
        out = centred
    elif estimator == "rloo":
        others = ((r * w).sum(1, keepdim=True) - r * w) / (count - 1).clamp(min=1)
        out = torch.where(count > 1, (r - others) * w, 0.0)
    else:  # reinforce: no baseline
        out = r * w
    return out.float()


def whiten(values, min_var=1e-8):
    """(x - mean) / std over all entries, the variance floored at `min_var` (as OpenRLHF): a rollout whose
    advantages are all (nearly) equal has no signal to scale up to unit size."""
    flat = values.double()
    var = flat.var() if flat.numel() > 1 else torch.tensor(1.0, dtype=torch.float64)
    return ((flat - flat.mean()) * var.clamp(min=min_var).rsqrt()).float()


def returns_to_go(token_rewards, gamma):
    """G_t = sum_{k >= t} gamma^(k - t) r_k of one response."""
    out, running = torch.zeros_like(token_rewards), 0.0
    for t in range(len(token_rewards) - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def compute_advantages(rewards, kl_penalties, estimator, gamma=1.0, valid=None, counted=None):
    """Per-token advantages of every sample.

    rewards: (prompts, n) scalar rewards; kl_penalties: prompts x n 1-D tensors, beta x KL_t per
    response token (zeros when the KL is not in the reward); valid: (prompts, n) bool, the samples that
    carry loss (default: all; the others get 0 and set no whitening statistic); counted: (prompts, n) bool, the
    samples whose rewards set their group's baseline (default: `valid`). Token rewards
    are -beta x KL_t plus the group-relative scalar at the last token; advantages are their returns-to-go
    (gamma only for reinforce), whitened over all valid tokens of the rollout for reinforce and
    reinforce_baseline."""
    valid = torch.ones(rewards.shape, dtype=torch.bool) if valid is None else valid
    scalars = group_baseline(rewards, estimator, valid if counted is None else counted).flatten()
    g = gamma if estimator == "reinforce" else 1.0
    advantages = []
    for s, kl, keep in zip(scalars, kl_penalties, valid.flatten()):
        token_rewards = -kl.clone().float()
        token_rewards[-1] += s
        advantages.append(returns_to_go(token_rewards, g) if keep else torch.zeros(len(kl)))
    if estimator in ("reinforce", "reinforce_baseline") and valid.any():
        kept = [i for i, keep in enumerate(valid.flatten()) if keep]
        whitened = whiten(torch.cat([advantages[i] for i in kept])).split([len(advantages[i]) for i in kept])
        for i, a in zip(kept, whitened):
            advantages[i] = a
    return advantages


def sample_advantages(samples, rewards, args):
    """Per-response-token advantages of each sample (rewards: (prompts, n)). Only the model's tokens take part
    (their KL penalties, returns-to-go, the whitening); an episode's environment tokens get 0 and can never change
    the advantages of the model's tokens. Masked samples (rejected, or truncated under --mask_truncated_responses)
    get 0 and take no part in the whitening; a truncated response's reward still counts in its group's baseline
    (DAPO's overlong filtering masks only its loss), a rejected episode's does not."""
    kl_in_reward = args.init_kl_coef > 0 and not args.use_kl_loss
    masks = [s.model_tokens for s in samples]
    kls = [args.init_kl_coef * approx_kl(s.old_logps[m], s.ref_logps[m], args.kl_estimator)
           if kl_in_reward else torch.zeros(int(m.sum())) for s, m in zip(samples, masks)]
    valid = torch.tensor([not s.masked for s in samples]).view(rewards.shape)
    counted = torch.tensor([not s.rejected for s in samples]).view(rewards.shape)
    out = []
    for m, a in zip(masks, compute_advantages(rewards, kls, args.advantage_estimator, args.gamma, valid, counted)):
        full = torch.zeros(len(m))
        full[m] = a
        out.append(full)
    return out


# ---- boilerplate: actor loss terms (the same text in grpo.py and ppo.py; tests/test_boilerplate.py) ----
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


def policy_loss(logps, old_logps, advantages, eps_low, eps_high, dual_clip=None):
    """Per-token PPO clipped loss (asymmetric bounds, optional dual clip) and a clipped-token mask."""
    ratio = torch.exp((logps - old_logps).clamp(-20, 20))
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss, (surr2 < surr1).float()


def gspo_loss(logps, old_logps, advantages, mask, sample_index, num_samples, eps_low, eps_high):
    """Per-token GSPO loss: one ratio per sample, s = exp(mean over its loss tokens of logps - old_logps), clipped to
    [1 - eps_low, 1 + eps_high]; each of its tokens carries -min(s A, clip(s) A) with the value s and the gradient
    s x d logp (so a sample's token mean has the gradient of s, the paper's objective). Returns (loss, clipped mask)."""
    keep = sample_index >= 0
    index = sample_index.clamp(min=0)
    sums = torch.zeros(num_samples, dtype=logps.dtype).index_add(0, index[keep], ((logps - old_logps) * mask)[keep])
    counts = torch.zeros(num_samples, dtype=logps.dtype).index_add(0, index[keep], mask[keep])
    sequence_log_ratio = (sums / counts.clamp(min=1)).clamp(-20, 20).detach()[index]
    ratio = torch.exp(sequence_log_ratio + logps - logps.detach())
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.min(surr1, surr2), (surr2 < surr1).float()


def cispo_loss(logps, old_logps, advantages, eps_low, eps_high):
    """Per-token CISPO loss: -sg(clip(r, 1 - eps_low, 1 + eps_high)) x A x logp, r = exp(logps - old_logps): the
    clipped ratio is a constant weight, so every token keeps the gradient of its log-prob. Returns (loss, clipped
    mask)."""
    ratio = torch.exp((logps - old_logps).clamp(-20, 20)).detach()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -weight * advantages * logps, (weight != ratio).float()


def rollout_correction(log_ratio, mask, sample_index, num_samples, mode, bounds):
    """Per-token loss weights for the gap between the trainer's log-probs and those vLLM sampled with (log_ratio =
    trainer - vLLM per sampled token, ratio = exp(log_ratio); [low, high] = bounds): token_truncate weighs each token
    by its ratio clamped to [low, high] (truncated importance sampling, one-sided with low 0); token_mask gives a
    token whose ratio leaves [low, high] no loss (IcePop); sequence_mask gives every token of a sample whose
    geometric-mean ratio leaves [low, high] no loss; none weighs 1. Returns (weights, corrected tokens, dropped
    samples): 0/1 per token, and per token of each sample that sequence_mask dropped."""
    ratio = torch.exp(log_ratio.clamp(-20, 20))
    low, high = bounds
    none = torch.zeros_like(ratio)
    if mode == "token_truncate":
        return ratio.clamp(low, high), ((ratio < low) | (ratio > high)).float() * mask, none
    if mode == "token_mask":
        out = ((ratio < low) | (ratio > high)).float() * mask
        return 1 - out, out, none
    if mode == "sequence_mask":
        keep = sample_index >= 0
        index = sample_index.clamp(min=0)
        sums = torch.zeros(num_samples, dtype=ratio.dtype).index_add(0, index[keep], (log_ratio * mask)[keep])
        counts = torch.zeros(num_samples, dtype=ratio.dtype).index_add(0, index[keep], mask[keep])
        geometric = torch.exp((sums / counts.clamp(min=1)).clamp(-20, 20))
        out = ((geometric < low) | (geometric > high)).float()[index] * mask
        return 1 - out, out, out
    return torch.ones_like(ratio), none, none


def correction_bounds(args):
    """--rollout_correction_bounds, or the mode's default: [0.5, 2] for token_mask (IcePop's), [0, 3] otherwise
    (TRL's cap)."""
    return args.rollout_correction_bounds or ((0.5, 2.0) if args.rollout_correction == "token_mask" else (0.0, 3.0))

def check_loss_flags(args):
    """The checks of the flags these terms read (parse_args calls it; raises ValueError naming the flag)."""
    if args.use_kl_loss and args.init_kl_coef <= 0:
        raise ValueError("--use_kl_loss needs --init_kl_coef > 0")
    if args.use_kl_loss and args.kl_estimator == "k1":  # E[grad k1] = E[grad log p] = 0 under the policy
        raise ValueError("--use_kl_loss with --kl_estimator k1 regularises nothing (the expected gradient of k1 as a "
                         "loss is 0): use --kl_estimator k3 (the gradient of KL(ref||policy), GRPO's) or k2 (of "
                         "KL(policy||ref))")
    if args.dual_clip is not None and args.dual_clip <= 1:
        raise ValueError(f"--dual_clip must be > 1, got {args.dual_clip}")
    if off_policy(args):  # samples up to K updates old: the clip is the trust region that keeps that stable
        eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
        if not (0 < eps_low < 1 and 0 < eps_high < 1):
            raise ValueError(f"--async_train with --max_staleness {args.async_rollout.max_staleness} needs a clipped "
                             f"ratio: --eps_clip / --eps_clip_low_high bounds in (0, 1), got {eps_low}, {eps_high}")
    if args.policy_loss == "gspo" and args.advantage_estimator == "dr_grpo":
        raise ValueError("--policy_loss gspo averages each sample's tokens, --advantage_estimator dr_grpo divides "
                         "every token by one constant: use another estimator with gspo")
    low, high = correction_bounds(args)
    if not 0 <= low < 1 < high:
        raise ValueError(f"--rollout_correction_bounds must hold 0 <= low < 1 < high, got {low}, {high}")
    if args.max_mismatch_kl <= 0:
        raise ValueError(f"--max_mismatch_kl must be > 0, got {args.max_mismatch_kl}")


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


def normalisers(args, counts):
    """The step's loss divisor (step_normaliser) and its metrics' (means over the samples that ran: token means, or
    sample means in sequence mode), from the step's counts over every rank (common.infra.trainer_actor)."""
    mode = loss_mode(args)
    return (step_normaliser(mode, counts["tokens"], counts["sequences"],
                            args.train.train_batch_size * args.ring.ring_attn_size, args.generate_max_len),
            step_normaliser("sequence" if mode == "sequence" else "token", counts["run_tokens"],
                            counts["run_sequences"], 0, 0))


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


def batch_values(args):
    """The per-token values micro_batch_loss reads from a training batch."""
    return (("advantages", "vllm_logps") + (() if single_update(args) else ("old_logps",))
            + (("ref_logps",) if args.use_kl_loss else ()))


def micro_batch_loss(model, batch, args, ring=None):
    """The policy loss of one collated micro-batch, summed as the step's normaliser expects (see aggregate); returns
    (loss, metric sums). Under single_update the current log-probs, detached, stand in for the old ones."""
    logps, outputs = token_logps(model, batch, return_entropy=True, ring=ring)
    mask = batch["loss_mask"]
    old_logps = logps.detach() if single_update(args) else batch["old_logps"]
    eps_low, eps_high = args.eps_clip_low_high or (args.eps_clip, args.eps_clip)
    if args.policy_loss == "gspo":
        per_token, clipped = gspo_loss(logps, old_logps, batch["advantages"], mask, batch["sample_index"],
                                       batch["num_samples"], eps_low, eps_high)
    elif args.policy_loss == "cispo":
        per_token, clipped = cispo_loss(logps, old_logps, batch["advantages"], eps_low, eps_high)
    else:
        per_token, clipped = policy_loss(logps, old_logps, batch["advantages"], eps_low, eps_high, args.dual_clip)
    # vLLM sampled from slightly different numbers than the trainer computes (off-policy runs: its log-probs are
    # the old policy, the log-ratio is 0 and every weight 1)
    log_ratio = old_logps - batch["vllm_logps"]
    weights, corrected, dropped = rollout_correction(log_ratio, mask, batch["sample_index"], batch["num_samples"],
                                                     args.rollout_correction, correction_bounds(args))
    per_token = per_token * weights

    def agg(per_token_values):  # summed as the step's normaliser expects (loss_mode)
        return aggregate(per_token_values, mask, batch["sample_index"], batch["num_samples"], loss_mode(args))

    pieces = {"policy_loss": agg(per_token)}
    total = pieces["policy_loss"]
    if args.use_kl_loss:
        pieces["kl_loss"] = agg(approx_kl(logps, batch["ref_logps"], args.kl_estimator))
        total = total + args.init_kl_coef * pieces["kl_loss"]
    pieces["entropy"] = agg(outputs.entropy if args.entropy_loss_coef > 0 else outputs.entropy.detach())
    if args.entropy_loss_coef > 0:
        total = total - args.entropy_loss_coef * pieces["entropy"]
    pieces["clip_ratio"] = agg(clipped)
    # vLLM's log-probs of its samples vs the trainer's before this update: k3 of KL(vLLM || trainer) per token,
    # |difference| mean and max, and the share of tokens and of samples the correction changed
    pieces["mismatch_kl"] = agg(torch.exp(log_ratio.clamp(-20, 20)) - 1 - log_ratio)
    pieces["logp_abs_diff_mean"] = agg(log_ratio.abs())
    pieces["corrected_token_share"] = agg(corrected)
    metrics = {k: v.item() for k, v in pieces.items()}
    metrics["corrected_sequences"] = aggregate(dropped, mask, batch["sample_index"], batch["num_samples"],
                                               "sequence").item()
    metrics["logp_abs_diff_max"] = (log_ratio.abs() * mask).max().item()
    return total, metrics
# ---- end of boilerplate: actor loss terms ----


def loss_mode(args):
    """How a step's loss terms are summed and divided (aggregate, step_normaliser): Dr. GRPO's constant normaliser,
    else --loss_agg."""
    if args.policy_loss == "gspo":  # the paper's objective: a mean over samples of each sample's term
        return "sequence"
    return "constant" if args.advantage_estimator == "dr_grpo" else args.loss_agg


def micro_batches(samples, micro, args):
    """This rank's samples of one optimizer step as its micro-batches, and how many samples were skipped. With
    --skip_zero_advantage (and no KL loss or entropy bonus) the samples whose gradient is exactly 0 are left out and
    the rest spread over as many micro-batches as before, each keeping at least one sample: DeepSpeed counts
    micro-batches to find the optimizer step, and under ZeRO every rank makes the same forward and backward calls."""
    count = math.ceil(len(samples) / micro)
    if not args.skip_zero_advantage or args.use_kl_loss or args.entropy_loss_coef > 0:
        return [samples[i * micro : (i + 1) * micro] for i in range(count)], 0
    idle = [s.masked or not s.advantages.any() for s in samples]
    fillers = set([i for i, z in enumerate(idle) if z][: max(0, count - idle.count(False))])
    run = [s for i, (s, z) in enumerate(zip(samples, idle)) if not z or i in fillers]
    sizes = [len(run) // count + (k < len(run) % count) for k in range(count)]
    starts = [sum(sizes[:k]) for k in range(count)]
    return [run[a : a + n] for a, n in zip(starts, sizes)], len(samples) - len(run)


# ----------------------------------------------------------------------------------------------
# Driver side: placement
# ----------------------------------------------------------------------------------------------
def place_models(args, world, pad_id, roles):
    """Ray actors: trainers (common.infra.trainer_actor, with this file's loss), vLLM engines, reward models;
    colocated in the trainers' bundles, or apart. Each is added to `roles` under the name errors give it."""
    import ray

    gpu = ray.cluster_resources().get("GPU", 0) > 0
    at = trainer_bundles(roles, args.actor_num_nodes, args.actor_num_gpus_per_node, gpu, args.cluster.startup_timeout,
                         "trainer")
    colocated = args.cluster.colocate_all_models
    # colocated: up to five roles share one device, and roles split their bundle's CPU
    cpus, gpus = (0.5, 0.2 if gpu else 0) if colocated else (1, 1 if gpu else 0)
    spec = TrainerSpec(args.model, "old_logps", train=args.train, loss=micro_batch_loss, normalisers=normalisers,
                       micro_batches=micro_batches, values=batch_values(args), ckpt_dir=args.ckpt.ckpt_path,
                       share_prompts=True,
                       reference=reference_args(args) if args.init_kl_coef > 0 else None)  # 0: no reference at all
    # the phases run one at a time: each rank takes the node's cores
    trainers = start_ranks(roles, "trainer", args, spec, world, pad_id, args.actor_num_gpus_per_node, cpus, gpus, at)
    engines = start_engines(args, roles, cpus, gpus, at if colocated else None)
    return trainers, engines, start_reward_models(args, roles, cpus, gpus, at(0) if colocated else None)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    import ray

    world, ring_size = args.actor_num_nodes * args.actor_num_gpus_per_node, args.ring.ring_attn_size
    tokenizer = load_tokenizer(args.model.pretrain, args)
    prompts = load_prompts(args.prompt_data, args.prompt_split, args, tokenizer, args.max_samples)
    eval_prompts = args.eval_dataset and load_prompts(args.eval_dataset, args.eval_split, args, tokenizer, 10**9)
    n, per_step = args.n_samples_per_prompt, args.rollout_batch_size * args.n_samples_per_prompt
    total_steps, steps_per_episode = rollout_steps(args, len(prompts))
    optimizer_steps = total_steps * per_step // args.train.train_batch_size * args.train.max_epochs
    timeout_s = args.async_rollout.rollout_timeout

    start_ray(args, 2 * world + args.cluster.vllm_num_engines + 1)
    roles = Roles()
    trainers, engines, reward_models = place_models(args, world, tokenizer.pad_token_id, roles)
    roles.ready(args.cluster.startup_timeout)  # every role is up before anyone waits on another in a rendezvous
    roles.get(start_group(roles, trainers, optimizer_steps))
    roles.get([t.setup_weight_sync.remote(engines) for t in trainers])

    state = {"global_step": 0, "consumed_prompts": 0, "best_pass1": -math.inf}
    if args.ckpt.load_checkpoint:
        loaded = roles.get([t.restore.remote() for t in trainers])[0]
        if loaded:
            state.update(loaded["grpo_state"])
            roles.get([t.sync_weights.remote() for t in trainers])  # the engines still hold the start weights
        print(f"resumed from {args.ckpt.ckpt_path} at step {state['global_step']}" if loaded else
              f"no checkpoint in {args.ckpt.ckpt_path}: starting from step 0")
    # ---- boilerplate: rollout set-up (the same text in grpo.py and ppo.py; tests/test_boilerplate.py) ----
    logger = MetricsLogger(args.log, asdict(args), True)
    # steps 1-2 of each step: prompts, n responses (episodes) each, rewards
    sampler = Sampler(args, roles, engines, prompts, reward_function(args), reward_models, tokenizer, environment(args))
    if eval_prompts and state["global_step"] == 0:
        metrics = sampler.evaluate(eval_prompts)
        print("step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        logger.log(metrics, 0)

    stale = off_policy(args)  # samples from weights up to K updates before the trainer's (--async_train)
    rollouts = None  # synchronous: each step's rollout is collected when the step asks for it
    if stale:  # --async_train: a thread collects the next steps' rollouts while the trainer updates
        from common.async_rollouts import Rollouts

        rollouts = Rollouts(args, sampler.collect, state["global_step"], total_steps, state["consumed_prompts"])
    # ---- end of boilerplate: rollout set-up ----
    bar = progress(range(state["global_step"], total_steps), desc="grpo", initial=state["global_step"],
                   total=total_steps)
    for step in bar:
        t_step, timing = time.time(), {}
        phases = progress(total=5, desc=f"step {step + 1}", leave=False, position=1)

        # ---- boilerplate: step rollout (the same text in grpo.py and ppo.py; tests/test_boilerplate.py) ----
        def phase(name, t0):
            timing[f"time/{name}"] = timing.get(f"time/{name}", 0.0) + time.time() - t0
            phases.set_postfix_str(name)

        # 1-2. this step's prompts, n responses (episodes) each, rewards: collected now, or ahead in the rollout thread
        t0 = time.time()
        rollout = rollouts.next(step) if rollouts else sampler.collect(state["consumed_prompts"], step)
        phase("rollout_wait", t0)
        state["consumed_prompts"] = rollout.end
        samples, raw_rewards = rollout_samples(rollout, args)
        phases.update(2)
        # ---- end of boilerplate: step rollout ----

        # 3. log-probs before the update: policy (old, unless single_update or off-policy) and reference;
        # each ring its contiguous shard (trainer rank r is in ring r // ring size; its first rank answers)
        t0 = time.time()
        keys = ["old_logps"] * (not single_update(args) and not stale) + ["ref_logps"] * (args.init_kl_coef > 0)
        per_token(roles, samples, [(trainers, keys)], ring_size)
        if stale:  # the behaviour policy: the weights that sampled them, up to K updates before the trainer's
            for s in samples:
                s.old_logps = s.vllm_logps
        phase("logprobs", t0)
        phases.update(1)

        # 4. advantages (driver, over the whole rollout; only the model's tokens)
        rewards = torch.tensor([s.reward for s in samples]).view(-1, n)
        for s, a in zip(samples, sample_advantages(samples, rewards, args)):
            s.advantages = a

        # 5. policy update: epochs x optimizer steps, each step's samples split over the rings
        if args.cluster.vllm_enable_sleep:
            roles.get([e.sleep.remote() for e in engines])
        t0 = time.time()
        ring_steps = split_steps(samples, args, step, world // ring_size)
        train_metrics = roles.get(each_ring(trainers, "train", ring_size, ring_steps))[0]
        train_metrics.pop("time_s")  # the driver times the phase
        phase("train", t0)
        phases.update(1)

        # 6. push the new weights into every engine, once they have finished the rollouts due on the old ones
        if args.cluster.vllm_enable_sleep:
            roles.get([e.wake_up.remote() for e in engines])
        t0 = time.time()
        with rollouts.new_weights() if rollouts else contextlib.nullcontext():
            phase("rollout_wait", t0)
            t0 = time.time()
            sync = roles.get([t.sync_weights.remote() for t in trainers], timeout_s, "weight sync")[0]
            phase("sync", t0)
        phases.update(1)
        phases.close()

        # 7. log, evaluate, save
        state["global_step"] = global_step = step + 1
        gap = mismatch_metrics(train_metrics, stale, global_step, args.max_mismatch_kl)
        metrics = {**rollout_metrics(rollout, samples, raw_rewards, step), **gap,
                   "perf/sync_mb": sync["bytes"] / 2**20, "perf/samples_per_s": per_step / (time.time() - t_step),
                   **timing, **{f"train/{k}": v for k, v in train_metrics.items()}}
        metrics.update(kl_to_reference(samples))
        bar.set_postfix(reward=f"{metrics['train/reward']:.3f}")
        if eval_prompts and eval_due(global_step, args.log.eval_steps, steps_per_episode, total_steps):
            metrics.update(sampler.evaluate(eval_prompts))
            bar.write(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                          if k.startswith(("eval/", "train/reward"))))
            if metrics["eval/pass@1"] > state["best_pass1"]:
                state["best_pass1"] = metrics["eval/pass@1"]
                roles.get([t.save_model.remote(os.path.join(args.ckpt.save_path, "best")) for t in trainers])
        if global_step % args.log.logging_steps == 0 or "eval/pass@1" in metrics:
            logger.log(metrics, global_step)
        if args.ckpt.save_steps > 0 and (global_step % args.ckpt.save_steps == 0 or global_step == total_steps):
            roles.get([t.checkpoint.remote(global_step, {"grpo_state": dict(state)}) for t in trainers])

    roles.get([t.save_model.remote(args.ckpt.save_path) for t in trainers])
    print(f"saved {args.ckpt.save_path}")
    logger.close()
    ray.shutdown()


if __name__ == "__main__":
    run(main, parse_args, errors=(ValueError, RoleFailed))  # RoleFailed: a Ray role died, raised or did not start
