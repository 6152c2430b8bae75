"""PPO with a critic: GAE advantages from a learned value function, vLLM rollouts.

    python algos/ppo.py --pretrain outputs/sft --prompt_data assets/data/reverse/rl_train.jsonl \\
        --input_key prompt --label_key answer --apply_chat_template \\
        --remote_rm_url launch/rewards/exact_match.py --n_samples_per_prompt 4 \\
        --rollout_batch_size 32 --train_batch_size 128 --micro_train_batch_size 16 \\
        --actor_num_gpus_per_node 2 --critic_num_gpus_per_node 1 --vllm_num_engines 1 --save_path outputs/ppo

This process is the Ray driver (a local Ray, or a cluster with --ray_address); Ray places each role
on devices of its own unless told to share (--colocate_*): the actor ranks (one torch.distributed
group running DeepSpeed), the critic ranks (a group of their own: a causal-LM backbone with a scalar
value head, its own optimizer and learning rate), the reference ranks when a KL term is on, vLLM
engines, and reward models with --reward_pretrain (on CPU each role is a process; "GPUs" count ranks).
A step, top to bottom in `main`: prompts -> samples -> rewards -> actor log-probs before the update,
reference log-probs, critic values -> per-token rewards (-beta x KL_t, the scalar reward on the last
model token) -> GAE advantages and returns -> actor PPO update (+ PPO-ptx's LM loss) beside the
critic's value update -> weight sync.

Multi-turn episodes (--agent_func_path), async rollouts (--async_train) and ring attention (--ring_attn_size,
every group) act as in grpo.py, through the same common/ code; GAE runs over the model's own tokens.

Differences from OpenRLHF, on purpose: GAE skips tokens that are not the model's own (they are not
steps: values and the running sum carry across them; OpenRLHF zeroes them and runs GAE through,
which decays over them for lambda < 1); the returns use their own lambda (--lambd_critic, VC-PPO /
VAPO's decoupled GAE; 1 by default); --init_kl_coef defaults to 0 as in grpo.py; the actor's
learning rate defaults to grpo.py's 1e-6; --use_kl_loss refuses k1 (as a loss its expected gradient is 0);
log-probs are of the untempered policy, and vLLM's log-probs of the sampled tokens are checked against the
trainer's every step.
"""

import dataclasses
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
from common.infra.datasets import load_one, load_tokenizer  # noqa: E402
from common.infra.cluster import (  # noqa: E402
    environment, reference_args, reward_function, resolve_rollout_args, rollout_steps, start_engines, start_ray,
    start_reward_models, trainer_bundles, validate_rollout_args,
)
from common.infra.roles import RoleFailed, Roles  # noqa: E402
from common.infra.engine import (  # noqa: E402
    CkptArgs, ModelArgs, accumulation_steps, parse_cli, run, script_ckpt_args, validate_common_args,
)
from common.infra.trainer_actor import TrainerSpec, each_ring, per_token, start_group, start_ranks  # noqa: E402
from common.packing import unwrap  # noqa: E402
from common.infra.rings import ring_model_args, validate_ring_args  # noqa: E402
from common.logprobs import token_logps  # noqa: E402
from common.rollout import (  # noqa: E402
    RLArgs, Sampler, kl_to_reference, load_prompts, mismatch_metrics, off_policy,
    prompt_at, rollout_metrics, rollout_samples, split_steps,
)
from common.infra.tracking import MetricsLogger, eval_due, progress  # noqa: E402


@dataclass
class Args(RLArgs):  # + the prompt, reward and rollout flags both RL drivers share (common/rollout.py)
    ckpt: CkptArgs = field(default_factory=lambda: script_ckpt_args(__file__))
    # -- the critic
    critic_pretrain: Optional[str] = None
    """Critic start point (default: the first --reward_pretrain if given, else --pretrain; the log says which).
    From a reward model (rm.py) the value head is its score head; from a causal LM it is freshly initialised."""
    critic_learning_rate: float = 9e-6
    """Peak learning rate of the critic (AdamW; the other optimizer flags are shared with the actor)."""
    value_clip: float = 0.5
    """PPO2 clipped value loss: the new value may move at most this far from the rollout's value (0: no clip)."""
    freezing_actor_steps: int = 0
    """Critic warm-up: the actor does not update (nor sync) for the first N rollout steps; the critic does."""
    value_head_prefix: str = "score"
    """Name of the value head in the Hugging Face sequence-classification class (as rm.py's flag)."""
    n_samples_per_prompt: int = 1
    """Responses sampled per prompt (the critic is the baseline: 1 is enough)."""
    # -- PPO-ptx
    pretrain_data: Optional[str] = None
    """PPO-ptx: plain-text dataset whose language-modelling loss is mixed into every actor micro-batch."""
    pretrain_split: str = "train"
    """Split of --pretrain_data."""
    pretrain_input_key: str = "text"
    """Field of --pretrain_data holding the text (cut to --prompt_max_len + --generate_max_len tokens)."""
    ptx_coef: float = 0.05
    """Weight of the --pretrain_data loss (the token mean of each micro-batch) in the actor's loss."""
    # -- advantages and the loss
    advantage_estimator: str = "gae"
    """Only gae (generalised advantage estimation with the critic); the critic-free estimators are grpo.py's."""
    gamma: float = 1.0
    """GAE discount."""
    lambd: float = 1.0
    """GAE lambda of the actor's advantages."""
    lambd_critic: float = 1.0
    """GAE lambda of the critic's returns (decoupled GAE, VC-PPO / VAPO; 1: Monte-Carlo returns)."""
    loss_agg: Literal["token", "sequence"] = "token"
    """token: mean over the step's response tokens; sequence: mean over samples of their token means (both models;
    --policy_loss gspo: sequence)."""
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
    """Put the KL in the actor's loss instead of the per-token reward."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient (entropy is logged either way)."""
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
    # -- placement (each role on devices of its own unless colocated)
    actor_num_nodes: int = 1
    """Nodes for the actor group (and the reference group, which mirrors it); rank r on node r // per node."""
    actor_num_gpus_per_node: int = 1
    """Actor trainer ranks per node (devices on CUDA, processes on CPU)."""
    critic_num_nodes: int = 1
    """Nodes for the critic group."""
    critic_num_gpus_per_node: int = 1
    """Critic trainer ranks per node (devices on CUDA, processes on CPU)."""
    colocate_actor_ref: bool = False
    """Put each reference rank on its actor rank's device (needs --init_kl_coef > 0)."""
    colocate_critic_reward: bool = False
    """Put the reward models on the critic's rank-0 device (needs --reward_pretrain)."""
    deepspeed_enable_sleep: bool = False
    """With --colocate_all_models: move the actor's and the critic's DeepSpeed states (weights, gradients, optimizer)
    off the device while they are idle, and train the two one after the other (ZeRO-1/2; ZeRO-3 needs CUDA)."""


def parse_args(argv=None):
    args = parse_cli(Args, argv, __doc__)
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    critic_world = args.critic_num_nodes * args.critic_num_gpus_per_node
    if args.advantage_estimator != "gae":
        raise ValueError(f"--advantage_estimator {args.advantage_estimator}: ppo.py learns a critic and uses gae "
                         f"only; the critic-free estimators are in algos/grpo.py")
    dp_world = validate_ring_args(args.ring, world, args.model)  # actor ranks / ring size
    args.model = ring_model_args(args.model, args.ring)  # the ring is the attention implementation
    critic_rings = validate_ring_args(args.ring, critic_world)
    validate_common_args(args.model, args.train, args.ckpt, dp_world)
    accumulation_steps(args.train.train_batch_size, args.train.micro_train_batch_size, critic_rings)
    validate_rollout_args(args, world, "ppo.py")
    check_loss_flags(args)  # beside the loss terms they configure
    if args.dynamic_filtering and args.n_samples_per_prompt < 2:
        raise ValueError("--dynamic_filtering drops prompts whose samples all got the same reward: set "
                         "--n_samples_per_prompt >= 2")
    if args.rollout_batch_size * args.n_samples_per_prompt % (args.micro_rollout_batch_size * critic_rings):
        raise ValueError(f"{args.rollout_batch_size * args.n_samples_per_prompt} samples per rollout must be a "
                         f"multiple of --micro_rollout_batch_size {args.micro_rollout_batch_size} x {critic_rings} "
                         f"data-parallel critic ranks")
    for name in ("gamma", "lambd", "lambd_critic"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name} must be in [0, 1], got {getattr(args, name)}")
    if args.value_clip < 0 or args.freezing_actor_steps < 0 or args.ptx_coef < 0:
        raise ValueError("--value_clip, --freezing_actor_steps and --ptx_coef must be >= 0")
    if args.cluster.colocate_all_models and critic_world > world:
        raise ValueError(f"--colocate_all_models puts each critic rank on an actor device: {critic_world} critic "
                         f"ranks for {world} actor ranks")
    if args.deepspeed_enable_sleep and not (args.cluster.colocate_all_models and args.train.zero_stage != 0
                                            and not args.train.adam_offload and not args.train.param_offload):
        raise ValueError("--deepspeed_enable_sleep moves ZeRO states off the device between phases: it needs "
                         "--colocate_all_models and --zero_stage 1-3 (unset: 2), without --adam_offload / "
                         "--param_offload")
    if args.colocate_actor_ref and args.init_kl_coef <= 0:
        raise ValueError("--colocate_actor_ref needs --init_kl_coef > 0 (without a KL term no reference is loaded)")
    if args.colocate_critic_reward and not args.reward_pretrain:
        raise ValueError("--colocate_critic_reward needs --reward_pretrain (there is no reward model to place)")
    # derived settings and the checks that read files, before any model loads
    references = world if args.init_kl_coef > 0 else 0
    copies = 4 * (world + critic_world) + references  # fp32 weight copies: trainers, reference
    # the reward and environment files load here; actor, critic and reference ranks compute beside the engines
    args = resolve_rollout_args(args, world, copies, world + critic_world + references)
    args.critic_pretrain = args.critic_pretrain or (args.reward_pretrain.split(",")[0] if args.reward_pretrain
                                                    else args.model.pretrain)
    if args.deepspeed_enable_sleep and args.train.zero_stage is None:  # the states it moves off the device are ZeRO's
        args.train = dataclasses.replace(args.train, zero_stage=2)
    check_critic(args)
    return args


def check_critic(args: Args):
    """The critic's directory exists, has a value head of that name, and shares the actor's tokenizer (the
    critic reads the actor's token ids); config and tokenizer files only, no weights."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(args.critic_pretrain, num_labels=1)
    except (OSError, ValueError) as e:
        raise ValueError(f"--critic_pretrain {args.critic_pretrain}: not a model directory "
                         f"({str(e).splitlines()[0]})") from None
    with torch.device("meta"):
        skeleton = AutoModelForSequenceClassification.from_config(config)
    if not isinstance(getattr(skeleton, args.value_head_prefix, None), torch.nn.Linear):
        raise ValueError(f"--value_head_prefix {args.value_head_prefix!r}: {type(skeleton).__name__} has no such head")
    if args.critic_pretrain != args.model.pretrain:
        actor_vocab = AutoTokenizer.from_pretrained(args.model.pretrain).get_vocab()
        if AutoTokenizer.from_pretrained(args.critic_pretrain).get_vocab() != actor_vocab:
            raise ValueError(f"--critic_pretrain {args.critic_pretrain} has another tokenizer than --pretrain "
                             f"{args.model.pretrain}: the critic must read the actor's token ids")


def critic_source(args: Args):
    """What the critic starts from, in words (the log and --help say it)."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(args.critic_pretrain).architectures or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return f"critic: {args.critic_pretrain} (a reward model: its {args.value_head_prefix} head is the value head)"
    return f"critic: {args.critic_pretrain} (backbone; a freshly initialised value head)"


# ----------------------------------------------------------------------------------------------
# GAE, the value loss, KL and the policy loss: small pure functions  (forkers edit these)
# ----------------------------------------------------------------------------------------------
def gae(rewards, values, mask, gamma, lambd):
    """Generalised advantage estimates of one response (1-D tensors, one entry per response token).

    delta_t = r_t + gamma V_next - V_t and A_t = delta_t + gamma lambda A_next, where "next" is the
    next token the model itself wrote: tokens with mask 0 (not the model's, e.g. tool output) are not
    steps; their rewards and values are never read and their advantages are 0. After the last model
    token V_next = 0 (the episode ends)."""
    advantages = torch.zeros_like(values, dtype=torch.float32)
    next_value, running = 0.0, 0.0
    for t in range(len(values) - 1, -1, -1):
        if not mask[t]:
            continue
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
        next_value = values[t]
    return advantages


def token_rewards(reward, kl, mask):
    """Per-token rewards: -beta x KL_t (kl already scaled) on the model's tokens, plus the scalar reward on the
    last model token (the last token of the response may be someone else's)."""
    out = -kl.float() * mask
    own = mask.nonzero()
    if len(own):
        out[own[-1, 0]] += reward
    return out


def advantages_and_returns(rewards, kls, values, masks, gamma, lambd, lambd_critic, min_var=1e-8):
    """Per-sample advantages (lambda, whitened over every model token of the rollout, the variance floored at
    `min_var` as OpenRLHF floors it: advantages that are all nearly equal, as from a critic that already predicts
    the returns, are not scaled up to unit size) and returns (their own lambda_critic: R_t = A_t(lambda_critic) +
    V_t). rewards: scalars; kls, values, masks: 1-D per sample."""
    advantages, returns = [], []
    for r, kl, v, m in zip(rewards, kls, values, masks):
        tr = token_rewards(float(r), kl, m)
        advantages.append(gae(tr, v, m, gamma, lambd))
        returns.append((gae(tr, v, m, gamma, lambd_critic) + v) * m)
    flat_mask = torch.cat(masks).bool()
    if flat_mask.sum() > 1:
        flat = torch.cat(advantages)[flat_mask].double()
        mean, scale = flat.mean(), flat.var().clamp(min=min_var).rsqrt()
        advantages = [((a - mean) * scale).float() * m for a, m in zip(advantages, masks)]
    return advantages, returns


def value_loss(values, old_values, returns, clip):
    """Per-token PPO2 value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2) and a clipped-token
    mask (clip 0: the plain squared error)."""
    plain = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.max(plain, clipped), (clipped > plain).float()


def mean(t):
    return t.mean().item() if t.numel() else 0.0


def explained_variance(values, returns):
    """1 - Var(R - V) / Var(R) over flat tensors of model tokens (1: the critic predicts the returns)."""
    var = returns.var()
    return (1 - (returns - values).var() / var).item() if var > 0 else 0.0


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
    """How a step's loss terms are summed and divided (aggregate, step_normaliser): --loss_agg (gspo: sequence)."""
    return "sequence" if args.policy_loss == "gspo" else args.loss_agg


def ptx_loss(model, batch, ring=None):
    """PPO-ptx: the token-mean language-modelling loss of a collated micro-batch of pretraining text."""
    logps, _ = token_logps(model, batch, ring=ring)
    return -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum().clamp(min=1)


def ptx_term(model, ptx_batch, args, ring=None):
    """PPO-ptx's term of the actor's loss: --ptx_coef x the LM loss of the micro-batch's pretraining rows (a mean per
    micro-batch, which DeepSpeed's averaging keeps right), and that LM loss to log."""
    lm = ptx_loss(model, ptx_batch, ring)
    return args.ptx_coef * lm, {"ptx_loss": lm.item()}


def token_values(model, batch, value_head_prefix="score", ring=None):
    """Critic forward of a collated batch: values[:, t] is the value of the state before token t (the value
    head's output at t - 1, 0 at each sample's first token), aligned like token_logps and loss_mask."""
    values = []
    handle = getattr(unwrap(model), value_head_prefix).register_forward_hook(lambda m, a, out: values.append(out))
    try:
        if ring is not None:  # this rank's slice of the row; the values of the whole row are gathered below
            from common.ring_attention import ring_forward

            ring_forward(model, batch, ring)
        else:  # with the cache on, packed rows are silently attended as one sequence
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"], use_cache=False)
    finally:
        handle.remove()
    if ring is not None:
        from common.ring_attention import ring_next_token_values

        return ring_next_token_values(values[0][0, :, 0].float(), batch, ring)
    out = torch.nn.functional.pad(values[0].squeeze(-1)[:, :-1].float(), (1, 0))
    return out.masked_fill(batch["position_ids"] == 0, 0.0)


def critic_micro_batch_loss(model, batch, args, ring=None):
    """The critic's clipped value loss of one micro-batch, summed as the step's normaliser expects; returns (loss
    sum, metric sums), as micro_batch_loss does."""
    values = token_values(model, batch, args.value_head_prefix, ring)
    mask = batch["loss_mask"]
    per_token, clipped = value_loss(values, batch["values"], batch["returns"], args.value_clip)
    loss = aggregate(per_token, mask, batch["sample_index"], batch["num_samples"], loss_mode(args))
    clip_ratio = aggregate(clipped, mask, batch["sample_index"], batch["num_samples"], loss_mode(args))
    return loss, {"value_loss": loss.item(), "value_clip_ratio": clip_ratio.item()}


def load_ptx(args: Args, tokenizer):
    """PPO-ptx rows {input_ids, loss_mask}: each text + EOS, cut to --prompt_max_len + --generate_max_len."""
    raw, rows = load_one(args.pretrain_data, args.pretrain_split), []
    limit = args.prompt_max_len + args.generate_max_len
    for i in range(len(raw)):
        text = raw[i].get(args.pretrain_input_key)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{args.pretrain_data}: row {i}: missing or empty field {args.pretrain_input_key!r} "
                             f"(--pretrain_input_key)")
        ids = tokenizer(text + tokenizer.eos_token, add_special_tokens=True)["input_ids"][:limit]
        rows.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
    return rows


def ptx_steps_for(ptx, per_rank_steps, position, seed):
    """Pretraining rows for each rank's optimizer steps (as many as its samples), read in a seeded order of the
    rows from stream position `position` on; returns them and the new position."""
    out = []
    for steps in per_rank_steps:
        out.append([])
        for samples in steps:
            out[-1].append([prompt_at(ptx, position + i, seed) for i in range(len(samples))])
            position += len(samples)
    return out, position


# ----------------------------------------------------------------------------------------------
# Driver side: placement
# ----------------------------------------------------------------------------------------------
def place_models(args, world, critic_world, pad_id, roles):
    """Ray actors: actor, reference and critic ranks (common.infra.trainer_actor, with this file's losses), vLLM
    engines, reward models. Each trainer group has a placement group of its own (spread over its nodes) unless
    colocated; colocated roles split a bundle's device. Each is added to `roles` under the name errors give it."""
    import ray
    from transformers import AutoModelForSequenceClassification

    gpu = ray.cluster_resources().get("GPU", 0) > 0
    everything = args.cluster.colocate_all_models
    share = 0.2 if everything else 0.5  # up to five roles share a device with --colocate_all_models, else two
    use_ref = args.init_kl_coef > 0

    def fraction(colocated):  # (num_cpus, num_gpus) of a role on a bundle it shares or owns
        return (share, share if gpu else 0) if colocated else (1, 1 if gpu else 0)

    actor_at = trainer_bundles(roles, args.actor_num_nodes, args.actor_num_gpus_per_node, gpu,
                               args.cluster.startup_timeout, "actor")
    ref_with_actor = everything or args.colocate_actor_ref
    ref_at = actor_at if ref_with_actor or not use_ref else trainer_bundles(  # the reference mirrors the actor
        roles, args.actor_num_nodes, args.actor_num_gpus_per_node, gpu, args.cluster.startup_timeout, "reference")
    critic_at = actor_at if everything else trainer_bundles(
        roles, args.critic_num_nodes, args.critic_num_gpus_per_node, gpu, args.cluster.startup_timeout, "critic")
    # CPU threads per rank: cores / the ranks of a node that compute at the same time
    ranks_per_node = args.actor_num_gpus_per_node * (2 if use_ref else 1) + args.critic_num_gpus_per_node
    ckpt, sleep = args.ckpt.ckpt_path, args.deepspeed_enable_sleep
    actor = TrainerSpec(args.model, "old_logps", train=args.train, loss=micro_batch_loss, normalisers=normalisers,
                        values=batch_values(args), extra_loss=ptx_term, ckpt_dir=os.path.join(ckpt, "actor"),
                        offload_states=sleep)
    # the critic: its own start point and learning rate, all weights trained (no LoRA); the actor's other settings.
    # A sequence-classification model whose value head is read at every token (rm.py's score head from an RM)
    critic = TrainerSpec(ModelArgs(pretrain=args.critic_pretrain, attn_implementation=args.model.attn_implementation,
                                   gradient_checkpointing=args.model.gradient_checkpointing),
                         "values", train=dataclasses.replace(args.train, learning_rate=args.critic_learning_rate),
                         forward=lambda m, b, a, ring: token_values(m, b, a.value_head_prefix, ring),
                         loss=critic_micro_batch_loss, normalisers=normalisers, values=("values", "returns"),
                         ckpt_dir=os.path.join(ckpt, "critic"), offload_states=sleep,
                         load_kwargs=dict(model_cls=AutoModelForSequenceClassification, num_labels=1,
                                          pad_token_id=pad_id))
    reference = TrainerSpec(reference_args(args), "ref_logps")  # the frozen start policy; ZeRO-3 shards it

    def ranks(name, spec, n, at, colocated):
        return start_ranks(roles, name, args, spec, n, pad_id, ranks_per_node, *fraction(colocated), at)

    trainers = ranks("actor", actor, world, actor_at, ref_with_actor)
    references = ranks("reference", reference, world, ref_at, ref_with_actor) if use_ref else []
    critics = ranks("critic", critic, critic_world, critic_at, everything or args.colocate_critic_reward)
    engines = start_engines(args, roles, *fraction(everything), actor_at if everything else None)
    with_critic = everything or args.colocate_critic_reward
    reward_models = start_reward_models(args, roles, *fraction(with_critic),
                                        (actor_at if everything else critic_at)(0) if with_critic else None)
    return trainers, references, critics, engines, reward_models


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------
def main(args: Args):
    import ray

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    critic_world, ring_size = args.critic_num_nodes * args.critic_num_gpus_per_node, args.ring.ring_attn_size
    tokenizer = load_tokenizer(args.model.pretrain, args)
    prompts = load_prompts(args.prompt_data, args.prompt_split, args, tokenizer, args.max_samples)
    eval_prompts = args.eval_dataset and load_prompts(args.eval_dataset, args.eval_split, args, tokenizer, 10**9)
    ptx = load_ptx(args, tokenizer) if args.pretrain_data else None
    per_step = args.rollout_batch_size * args.n_samples_per_prompt
    total_steps, steps_per_episode = rollout_steps(args, len(prompts))
    updates_per_rollout = per_step // args.train.train_batch_size * args.train.max_epochs
    timeout_s = args.async_rollout.rollout_timeout
    print(critic_source(args))

    start_ray(args, 2 * (2 * world + critic_world) + args.cluster.vllm_num_engines + 1)
    roles = Roles()
    trainers, references, critics, engines, reward_models = place_models(args, world, critic_world,
                                                                         tokenizer.pad_token_id, roles)
    if args.cluster.colocate_all_models:  # vLLM sizes its cache by the free device memory: it starts alone
        roles.ready(args.cluster.startup_timeout)
    setups = (start_group(roles, trainers, max(total_steps - args.freezing_actor_steps, 1) * updates_per_rollout)
              + start_group(roles, critics, total_steps * updates_per_rollout) + start_group(roles, references))
    roles.ready(args.cluster.startup_timeout)  # the groups load their models while the engines start
    roles.get(setups)
    roles.get([t.setup_weight_sync.remote(engines) for t in trainers])

    state = {"global_step": 0, "consumed_prompts": 0, "consumed_ptx": 0, "best_pass1": -math.inf}
    if args.ckpt.load_checkpoint:
        loaded = roles.get([t.restore.remote() for t in trainers])[0]
        if loaded:
            state.update(loaded["ppo_state"])
            roles.get([c.restore.remote(state["global_step"]) for c in critics])
            roles.get([t.sync_weights.remote() for t in trainers])  # the engines still hold the start weights
        print(f"resumed from {args.ckpt.ckpt_path} at step {state['global_step']}" if loaded else
              f"no checkpoint in {args.ckpt.ckpt_path}: starting from step 0")
    def rest(members):  # --deepspeed_enable_sleep: their DeepSpeed states off the device until next needed
        if args.deepspeed_enable_sleep:
            roles.get([m.sleep.remote() for m in members])

    rest(trainers + critics)
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
    bar = progress(range(state["global_step"], total_steps), desc="ppo", initial=state["global_step"],
                   total=total_steps)
    for step in bar:
        t_step, timing = time.time(), {}
        actor_frozen = step < args.freezing_actor_steps
        phases = progress(total=6, desc=f"step {step + 1}", leave=False, position=1)

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

        # 3. before the update, side by side, each group its contiguous shard: actor log-probs (unless
        # single_update makes them the update's own, or off-policy vLLM's are the old policy), reference
        # log-probs, critic values
        t0 = time.time()
        policy_pass = not single_update(args) and not stale

        per_token(roles, samples, [(critics, ["values"]), (references, ["ref_logps"]),
                                   (trainers, ["old_logps"] if policy_pass else [])], ring_size)
        if stale:  # the behaviour policy: the weights that sampled them, up to K updates before the actor's
            for s in samples:
                s.old_logps = s.vllm_logps
        rest(trainers)
        phase("logprobs_values", t0)
        phases.update(1)

        # 4. per-token rewards -> GAE advantages (lambd) and returns (lambd_critic), on the driver
        rewards = torch.tensor([s.reward for s in samples])
        kl_in_reward = args.init_kl_coef > 0 and not args.use_kl_loss
        kls = [args.init_kl_coef * approx_kl(s.old_logps, s.ref_logps, args.kl_estimator)
               if kl_in_reward else torch.zeros(len(s.response_ids)) for s in samples]
        masks = [s.loss_tokens().float() for s in samples]  # an episode's environment: no steps
        values = [s.values for s in samples]
        advantages, returns = advantages_and_returns(rewards, kls, values, masks, args.gamma, args.lambd,
                                                     args.lambd_critic)
        for s, a, ret in zip(samples, advantages, returns):
            s.advantages, s.returns = a, ret
        flat_mask = torch.cat(masks).bool()
        flat_values, flat_returns = torch.cat(values)[flat_mask], torch.cat(returns)[flat_mask]

        # 5. updates: the critic always, the actor after --freezing_actor_steps; side by side (one after the
        # other with --deepspeed_enable_sleep)
        if args.cluster.vllm_enable_sleep:
            roles.get([e.sleep.remote() for e in engines])
        t0 = time.time()
        critic_steps = split_steps(samples, args, step, critic_world // ring_size)  # per ring, as in step 3
        refs = each_ring(critics, "train", ring_size, critic_steps)
        if args.deepspeed_enable_sleep:  # the critic's states leave the device before the actor's return
            roles.get(refs)
            rest(critics)
        if not actor_frozen:
            actor_steps = split_steps(samples, args, step, world // ring_size)
            ptx_steps = [None] * len(actor_steps)
            if ptx:
                ptx_steps, state["consumed_ptx"] = ptx_steps_for(ptx, actor_steps, state["consumed_ptx"],
                                                                 args.train.seed)
            refs += [t.train.remote(actor_steps[r // ring_size], ptx_steps[r // ring_size])
                     for r, t in enumerate(trainers)]
        results = roles.get(refs)
        critic_metrics, actor_metrics = results[0], (results[critic_world] if not actor_frozen else {})
        phase("train", t0)
        phases.update(1)

        # 6. push the new weights (none while the actor is frozen) once the engines finish the old ones' rollouts
        if args.cluster.vllm_enable_sleep:
            roles.get([e.wake_up.remote() for e in engines])
        t0 = time.time()
        with rollouts.new_weights() if rollouts else contextlib.nullcontext():
            phase("rollout_wait", t0)
            t0 = time.time()
            sync = (roles.get([t.sync_weights.remote() for t in trainers], timeout_s, "weight sync")[0]
                    if not actor_frozen else {"bytes": 0})
            rest(trainers)
            phase("sync", t0)
        phases.update(1)
        phases.close()

        # 7. log, evaluate, save
        state["global_step"] = global_step = step + 1
        timing["time/critic_train"] = critic_metrics.pop("time_s")
        metrics = {**rollout_metrics(rollout, samples, raw_rewards, step),
                   "train/actor_frozen": float(actor_frozen),
                   "train/advantage_abs": mean(torch.cat(advantages)[flat_mask].abs()),
                   "critic/explained_variance": explained_variance(flat_values, flat_returns),
                   "critic/values": mean(flat_values), "critic/returns": mean(flat_returns),
                   "perf/sync_mb": sync["bytes"] / 2**20, "perf/samples_per_s": per_step / (time.time() - t_step),
                   **{f"critic/{k}": v for k, v in critic_metrics.items()}}
        if actor_metrics:
            timing["time/actor_train"] = actor_metrics.pop("time_s")
            metrics.update(mismatch_metrics(actor_metrics, stale, global_step, args.max_mismatch_kl))
            metrics.update({f"train/{k}": v for k, v in actor_metrics.items()})
        elif policy_pass:  # a frozen actor still had its log-probs computed: the engines must match them
            metrics["rollout/logp_abs_diff_max"] = max(
                (s.old_logps - s.vllm_logps).abs().max().item() for s in samples)
        metrics.update(timing)
        metrics.update(kl_to_reference(samples))
        bar.set_postfix(reward=f"{metrics['train/reward']:.3f}", ev=f"{metrics['critic/explained_variance']:.2f}")
        if eval_prompts and eval_due(global_step, args.log.eval_steps, steps_per_episode, total_steps):
            metrics.update(sampler.evaluate(eval_prompts))
            bar.write(f"step {global_step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                          if k.startswith(("eval/", "train/reward", "critic/exp"))))
            if metrics["eval/pass@1"] > state["best_pass1"]:
                state["best_pass1"] = metrics["eval/pass@1"]
                roles.get([t.save_model.remote(os.path.join(args.ckpt.save_path, "best")) for t in trainers])
        if global_step % args.log.logging_steps == 0 or "eval/pass@1" in metrics:
            logger.log(metrics, global_step)
        if args.ckpt.save_steps > 0 and (global_step % args.ckpt.save_steps == 0 or global_step == total_steps):
            # the critic first: the actor's `latest` is the commit point a resume reads
            roles.get([c.checkpoint.remote(global_step, {"ppo_state": dict(state)}) for c in critics])
            roles.get([t.checkpoint.remote(global_step, {"ppo_state": dict(state)}) for t in trainers])
        rest(trainers + critics)  # a save woke them

    roles.get([t.save_model.remote(args.ckpt.save_path) for t in trainers])
    roles.get([c.save_model.remote(os.path.join(args.ckpt.save_path, "critic")) for c in critics])
    print(f"saved {args.ckpt.save_path} (critic: {os.path.join(args.ckpt.save_path, 'critic')})")
    logger.close()
    ray.shutdown()


if __name__ == "__main__":
    run(main, parse_args, errors=(ValueError, RoleFailed))  # RoleFailed: a Ray role died, raised or did not start
