"""The RL rollout, what grpo.py and ppo.py share of the algorithm: the flags they share, the prompts (which fields a
row has, when it is too long), whether the samples are off-policy, sampling n responses per prompt, reward
composition (reward file or URL plus reward models), DAPO's dynamic filtering and overlong shaping, masking, the
training samples and their packed batches, and evaluation (pass@1, pass@k). The advantages and losses stay in each
script; the Ray and vLLM mechanism is common/infra/cluster.py's.

# ---- forkers edit here: sampling, rewards, filtering and shaping are plain functions of the rollout ----
"""

import time
from dataclasses import dataclass, field
from typing import Annotated, Optional

import torch
import tyro

from common.data import BadRow, PromptArgs, format_prompt, format_response
from common.episodes import AgentArgs, Episode, run_episodes
from common.infra.cluster import ClusterArgs, generate
from common.infra.datasets import load_one
from common.infra.engine import CkptArgs, ModelArgs, TrainArgs
from common.infra.rings import RingArgs
from common.infra.tracking import LogArgs
from common.infra.vllm_engine import EngineArgs, SamplingArgs
from common.packing import collate


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
    """--async_train with --max_staleness K > 0: a step's samples come from weights up to K updates before the
    trainer's (step j's from update max(j - K, 0)), and vLLM's log-probs of them (the behaviour policy) are the old
    policy of the clip."""
    return args.async_rollout.async_train and args.async_rollout.max_staleness > 0


@dataclass
class ActorTrainArgs(TrainArgs):
    train_batch_size: int = 64
    """Global samples (responses) per optimizer step, across all trainer ranks."""
    max_epochs: int = 1
    """Passes over each rollout's samples (PPO epochs)."""
    learning_rate: Annotated[float, tyro.conf.arg(name="actor_learning_rate")] = 1e-6
    """Peak learning rate of the policy (AdamW)."""
    lr_warmup_ratio: float = 0.0
    """Fraction of optimizer steps with linear warmup (OpenRLHF's RL default: 0.03)."""
    lr_scheduler: str = "constant_with_warmup"
    """Any transformers scheduler name; constant by default (OpenRLHF's RL default: cosine_with_min_lr, down to
    --min_lr_ratio 0.1 of the peak)."""


@dataclass
class RLArgs(PromptArgs):
    """The flags of grpo.py and ppo.py that mean the same in both: prompts (the prompt flags of PromptArgs and
    these), evaluation, rewards, rollouts (each script's Args derives from it, so they read as its own fields)."""

    model: ModelArgs = field(default_factory=ModelArgs)
    train: ActorTrainArgs = field(default_factory=ActorTrainArgs)
    engine: RolloutEngineArgs = field(default_factory=RolloutEngineArgs)
    ckpt: CkptArgs = field(default_factory=CkptArgs)  # each script gives its own paths (script_ckpt_args)
    log: RolloutLogArgs = field(default_factory=RolloutLogArgs)
    agent: AgentArgs = field(default_factory=AgentArgs)  # multi-turn environments (common/episodes.py)
    async_rollout: AsyncArgs = field(default_factory=AsyncArgs)  # rollouts up to K steps ahead, their bound
    ring: RingArgs = field(default_factory=RingArgs)  # the trainer groups' rows split over rings
    cluster: ClusterArgs = field(default_factory=ClusterArgs)  # Ray, the vLLM engines, placement, time-outs
    # -- prompts
    prompt_data: str = tyro.MISSING
    """Prompt dataset (any spec common/data.py loads: file, folder, type@dir, hub name)."""
    prompt_split: str = "train"
    """Split of --prompt_data."""
    label_key: Optional[str] = None
    """Field holding the reference answer passed to the reward function (required in every row when set)."""
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
    served by `python -m launch.reward_server`."""
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
    """Rollout nucleus sampling mass. Below 1 the update, reading the whole policy's log-probs, trains on samples of
    another distribution, uncorrected (a warning says so)."""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose rewards as the advantages read them (less the overlong penalty,
    clipped) are all equal, or none of whose samples carries loss, and sample new prompts to refill the batch. The
    run's step count still comes from --num_episodes, so with refills it reads more than that many passes over the
    prompts."""
    dynamic_filtering_max_rounds: int = 4
    """Sampling rounds per step for --dynamic_filtering; then the batch is topped up with dropped groups."""
    mask_truncated_responses: bool = False
    """Responses cut off at --generate_max_len carry no loss (in ppo.py, neither for the actor nor for the critic);
    in grpo.py their rewards still count in their group's baseline (DAPO's overlong filtering)."""


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
# Samples: a response with its prompt, made into collated batches with per-token values
# ----------------------------------------------------------------------------------------------
@dataclass
class TrainingSample:
    """A prompt and the response (or episode) sampled after it, as a step trains on it. The token ids are lists,
    as collate packs them; each per-response-token value is a float32 tensor, None until the step computes it."""

    prompt_ids: list
    response_ids: list  # an episode's: every token after its prompt, the environment's included
    model_tokens: torch.Tensor  # bool: the response tokens the model wrote (an episode's own turns)
    vllm_logps: torch.Tensor  # as vLLM sampled the tokens (0 at an episode's environment tokens)
    reward: float = 0.0  # the reward the advantages read (advantage_rewards)
    masked: bool = False  # no loss: a rejected episode, or cut off under --mask_truncated_responses
    rejected: bool = False  # a rejected episode: its reward leaves its group's statistics too
    old_logps: Optional[torch.Tensor] = None  # per_token fills these three, the script the last two
    ref_logps: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    def loss_tokens(self):
        """The response tokens that carry loss (bool): the model's own, none if masked."""
        return self.model_tokens & (not self.masked)


def episode_sample(e, mask_truncated):
    """The TrainingSample of an episode: its first segment is the prompt; the rest is the response, trainable
    where the model wrote it, with vLLM's log-probs there (0 at the environment's tokens, which carry no loss)."""
    (prompt, _, _), rest = e.segments[0], e.segments[1:]
    logps = [lp for ids, trainable, lps in rest for lp in (lps if trainable else [0.0] * len(ids))]
    return TrainingSample(list(prompt), [t for ids, _, _ in rest for t in ids],
                          torch.tensor([trainable for ids, trainable, _ in rest for _ in ids], dtype=torch.bool),
                          torch.tensor(logps, dtype=torch.float32), rejected=e.rejected,
                          masked=e.rejected or (mask_truncated and e.finish_reason == "length"))


def token_sample(s):
    """The input_ids/loss_mask dict collate() packs: loss on the sample's loss_tokens."""
    return {"input_ids": s.prompt_ids + s.response_ids,
            "loss_mask": [0] * len(s.prompt_ids) + s.loss_tokens().int().tolist()}


def make_batch(samples, pad_id, max_tokens, one_row, values=(), share_prompt=False):
    """Collate TrainingSamples (packed; one row with a per-sample attention kernel), and lay each named
    per-response-token field out like the tokens. With share_prompt (the CPU kernel), the samples of a
    prompt after its first are branches of the first one's prompt: the row holds each prompt once.
    `response_offsets[i]`: where sample i's response starts in its span (common.packing.unpack)."""
    token_samples, first_of = [token_sample(s) for s in samples], {}
    for i, s in enumerate(samples):
        j = first_of.setdefault(tuple(s.prompt_ids), i)
        if share_prompt and j != i and s.response_ids:
            token_samples[i].update(prefix_of=j, prefix_len=len(s.prompt_ids))
    batch = collate(token_samples, pad_id, packing=True, max_tokens=max_tokens, one_row=one_row,
                    share_prefixes=share_prompt)
    batch["response_offsets"] = [len(s.prompt_ids) - t.get("prefix_len", 0)
                                 for s, t in zip(samples, token_samples)]
    for key in values:
        laid = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for s, p, (r, start, n) in zip(samples, batch["response_offsets"], batch["spans"]):
            laid[r, start + p : start + n] = getattr(s, key)
        batch[key] = laid
    return batch


# ----------------------------------------------------------------------------------------------
# Rollouts, rewards, evaluation
# ----------------------------------------------------------------------------------------------


def compute_rewards(roles, reward_fn, reward_models, prompts, groups, tokenizer, args):
    """One scalar reward per sample, shape (prompts, n): reward file / URL plus reward models."""
    queries = [p["prompt_text"] + s.text for p, g in zip(prompts, groups) for s in g]
    prompt_texts = [p["prompt_text"] for p, g in zip(prompts, groups) for _ in g]
    labels = [p["label"] for p, g in zip(prompts, groups) for _ in g]
    total = torch.zeros(len(queries))
    if reward_fn is not None:
        total += reward_fn(queries, prompt_texts, labels)
    if reward_models is not None:  # the RM reads the ids rm.py trained it on (common.data.reward_model_ids)
        responses = response_texts(prompts, groups, tokenizer, args)
        total += torch.tensor(roles.get(reward_models.score.remote(prompt_texts, responses)))
    return total.view(len(prompts), -1)


def response_texts(prompts, groups, tokenizer, args):
    """Each sampled response as the reward models read it: a finished one as rm.py formats a response (+ EOS, or
    the chat template's end of turn), a truncated one as it was cut off."""
    return [format_response(p["raw"], s.text, tokenizer, args) if s.finish_reason == "stop" else s.text
            for p, g in zip(prompts, groups) for s in g]


def carries_loss(sample, mask_truncated):
    """Whether a sampled response (or episode) trains: not a rejected episode, nor a response cut off at
    --generate_max_len under --mask_truncated_responses."""
    return not (getattr(sample, "rejected", False) or (mask_truncated and sample.finish_reason == "length"))


def no_signal(rewards, counted, rel_tol=1e-6):
    """A group whose counted members' rewards are equal (within `rel_tol` of their size, float32 round-off), or that
    has fewer than two counted members: its group baseline gives every sample 0."""
    r = rewards.double()[counted]
    return len(r) < 2 or (r.max() - r.min()).item() <= rel_tol * r.abs().max().item()


def carries_signal(group, rewards, args):
    """Whether a group teaches anything (DAPO's dynamic filtering drops it if not): some member carries loss, and
    the rewards the advantages read (advantage_rewards) differ among the members that set the group's statistics:
    all but rejected episodes (a response truncated under --mask_truncated_responses counts, as in DAPO)."""
    counted = torch.tensor([not getattr(s, "rejected", False) for s in group])
    return (any(carries_loss(s, args.mask_truncated_responses) for s in group)
            and not no_signal(advantage_rewards(group, rewards, args), counted))


def overlong_penalty(length, max_len, buffer, factor):
    """DAPO: the reward lost by a response of `length` tokens that runs into the last `buffer` tokens."""
    over = length - (max_len - buffer)
    return min(max(over, 0), buffer) / buffer * factor if buffer > 0 else 0.0


def advantage_rewards(group, rewards, args):
    """The rewards the advantages read, of a group's samples (or episodes) and their raw rewards: less DAPO's
    overlong penalty (a single-turn response's), clamped to --reward_clip_range."""
    low, high = args.reward_clip_range
    out = []
    for s, r in zip(group, rewards.tolist()):
        if not isinstance(s, Episode):
            r -= overlong_penalty(len(s.output_ids), args.generate_max_len, args.overlong_buffer_len,
                                  args.overlong_penalty_factor)
        out.append(min(max(r, low), high))
    return torch.tensor(out)


@dataclass
class Rollout:
    """A step's rollout (Sampler.collect): the kept groups as (prompt, responses or episodes, raw rewards (n,)),
    how many groups dynamic filtering dropped in how many rounds, the prompt position after it, the policy version
    that sampled it, and where the time went."""
    kept: list
    dropped: int
    rounds: int
    end: int
    version: int
    timing: dict


@dataclass
class Sampler:
    """What a step's rollout and an evaluation sample with, built once in a script's main: the script's args, the
    Roles waiting on the vLLM `engines`, the training `prompts` (load_prompts), and where rewards come from: a
    --remote_rm_url `reward_fn`, `reward_models` actors, or an --env_path `env_cls` (each None / [] when unused)."""
    args: object
    roles: object
    engines: list
    prompts: list
    reward_fn: object
    reward_models: list
    tokenizer: object
    env_cls: object

    def groups(self, prompts, n, temperature, top_p, seeds, timing):
        """n responses (or episodes) per prompt and their rewards (prompts, n); timing["time/..."] accumulates."""
        args, roles, engines = self.args, self.roles, self.engines
        timeout_s, t0 = args.async_rollout.rollout_timeout, time.time()
        if self.env_cls is not None:  # the environment rewards each episode as it runs
            groups = run_episodes(args, self.env_cls,
                                  lambda ids, sp: generate(roles, engines, ids, sp, None, timeout_s),
                                  self.tokenizer, prompts, n, temperature, seeds, top_p)
            timing["time/generate"] = timing.get("time/generate", 0.0) + time.time() - t0
            return groups, torch.tensor([[e.reward for e in g] for g in groups])
        sampling = SamplingArgs(n=n, temperature=temperature, top_p=top_p, max_new_tokens=args.generate_max_len)
        groups = generate(roles, engines, [p["prompt_ids"] for p in prompts], sampling, seeds, timeout_s)
        timing["time/generate"] = timing.get("time/generate", 0.0) + time.time() - t0
        t0 = time.time()
        rewards = compute_rewards(roles, self.reward_fn, self.reward_models, prompts, groups, self.tokenizer, args)
        timing["time/reward"] = timing.get("time/reward", 0.0) + time.time() - t0
        return groups, rewards

    def collect(self, start, version):
        """One step's rollout from prompt position `start` with the engines holding policy `version`:
        --rollout_batch_size prompts, n responses (or episodes) each, rewarded; with --dynamic_filtering groups of
        equal rewards are dropped and new prompts refill the batch. Runs on the driver, or with --async_train in the
        rollout thread while the trainer updates on the previous step's samples."""
        args = self.args
        kept, dropped, rounds, position, timing = [], [], 0, start, {}
        while len(kept) < args.rollout_batch_size and rounds < max(1, args.dynamic_filtering_max_rounds):
            need, rounds = args.rollout_batch_size - len(kept), rounds + 1
            positions = range(position, position + need)
            position += need
            batch_prompts = [prompt_at(self.prompts, i, args.train.seed) for i in positions]
            # a seed per prompt position: the same samples whatever the engine count or batching (resume is exact)
            groups, rewards = self.groups(batch_prompts, args.n_samples_per_prompt, args.temperature, args.top_p,
                                          [args.train.seed * 1_000_003 + i for i in positions], timing)
            for p, g, r in zip(batch_prompts, groups, rewards):
                (dropped if args.dynamic_filtering and not carries_signal(g, r, args) else kept).append((p, g, r))
            if not args.dynamic_filtering:
                break
        kept += dropped[: args.rollout_batch_size - len(kept)]  # rounds ran out: equal-reward groups carry no signal
        return Rollout(kept, len(dropped), rounds, position, version, timing)

    @torch.no_grad()
    def evaluate(self, eval_prompts):
        """eval/pass@1, pass@n and the model's tokens per sample, on `eval_prompts` (seeded)."""
        args = self.args
        n = args.eval_n_samples_per_prompt
        seeds = [args.train.seed + 7919 * i for i in range(len(eval_prompts))]
        groups, rewards = self.groups(eval_prompts, n, args.eval_temperature, 1.0, seeds, {})
        if self.env_cls is not None:  # the model's own tokens
            length = sum(len(ids) for g in groups for e in g for ids, trainable, _ in e.segments if trainable)
        else:
            length = sum(len(s.output_ids) for g in groups for s in g)
        return {"eval/pass@1": rewards.mean().item(), f"eval/pass@{n}": rewards.max(1).values.mean().item(),
                "eval/response_length": length / rewards.numel()}


def rollout_samples(rollout, args):
    """The TrainingSamples of a rollout (the reward the advantages read) and its raw rewards (prompts, n)."""
    samples, mask = [], args.mask_truncated_responses
    for p, g, r in rollout.kept:
        for s, reward in zip(g, advantage_rewards(g, r, args).tolist()):
            samples.append(episode_sample(s, mask) if isinstance(s, Episode) else TrainingSample(
                p["prompt_ids"], list(s.output_ids), torch.ones(len(s.output_ids), dtype=torch.bool),
                torch.tensor(s.logprobs, dtype=torch.float32), masked=not carries_loss(s, mask)))
            samples[-1].reward = reward
    return samples, torch.stack([r for _, _, r in rollout.kept])


def rollout_metrics(rollout, samples, raw_rewards, step):
    """What every RL driver logs of a rollout: rewards, lengths of the model's own tokens, filtering,
    staleness, and the episodes' turns, forks and rejects."""
    lengths = [int(s.model_tokens.sum()) for s in samples]
    metrics = {"train/reward": raw_rewards.mean().item(), "train/reward_std": raw_rewards.std().item(),
               "train/response_length": sum(lengths) / len(lengths),
               "train/truncated": sum(s.masked for s in samples) / len(samples),
               "train/dropped_groups": rollout.dropped, "train/sampling_rounds": rollout.rounds,
               "async/policy_version": rollout.version, "async/staleness": step - rollout.version,
               **rollout.timing}
    episodes = [e for _, g, _ in rollout.kept for e in g if isinstance(e, Episode)]
    if episodes:
        metrics.update({"train/episode_turns": sum(e.turns for e in episodes) / len(episodes),
                        "train/episode_length": sum(len(e.tokens()) for e in episodes) / len(episodes),
                        "train/episode_forks": sum(e.forks for e in episodes),
                        "train/episode_rejects": sum(e.rejected for e in episodes)})
    return metrics


def mismatch_metrics(train_metrics, stale, step, max_mismatch_kl):
    """The trainer-vLLM gap of a step, popped from the trainer's metrics (the actor-loss terms of grpo.py / ppo.py):
    rollout/mismatch_kl (k3 of KL(vLLM || trainer) per token), rollout/logp_abs_diff_mean and _max, and the shares of
    tokens and samples the correction changed. None for an off-policy step (vLLM's log-probs are its old policy).
    A mismatch past max_mismatch_kl raises ValueError naming the weight sync, the step and the flag."""
    names = ("mismatch_kl", "logp_abs_diff_mean", "logp_abs_diff_max", "corrected_token_share", "corrected_sequences")
    gap = {name: train_metrics.pop(name) for name in names}
    if stale:
        return {}
    if gap["mismatch_kl"] > max_mismatch_kl:
        raise ValueError(f"step {step}: vLLM sampled from other weights than the trainer's (a broken weight sync or "
                         f"model load): mismatch KL {gap['mismatch_kl']:.4g} > --max_mismatch_kl {max_mismatch_kl}, "
                         f"max |logp difference| {gap['logp_abs_diff_max']:.3g}; raise --max_mismatch_kl to go on")
    gap["corrected_sequence_share"] = gap.pop("corrected_sequences")
    return {f"rollout/{name}": v for name, v in gap.items()}


def kl_to_reference(samples):
    """train/kl: the k1 estimate of KL(policy || reference) per model token, from the log-probs before the update
    (when the step computed both)."""
    if any(s.ref_logps is None or s.old_logps is None for s in samples):
        return {}
    kl = sum((s.old_logps - s.ref_logps)[s.model_tokens].clamp(-10, 10).sum().item() for s in samples)
    return {"train/kl": kl / max(sum(int(s.model_tokens.sum()) for s in samples), 1)}
