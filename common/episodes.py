"""Multi-turn episodes for the RL drivers (grpo.py, ppo.py; --agent_func_path): an environment file, and
rollouts token in / token out. An episode is a list of segments (token_ids, trainable, logprobs): the prompt and the
environment's turns (not trainable) and the model's turns as the tokens vLLM sampled, with vLLM's log-probs. Nothing
the model wrote is re-tokenised; with a chat template each next turn must extend the text of the tokens so far.

The file defines one of two forms. `class Env` (reset / step): run_episodes drives every episode turn by turn, all
unfinished episodes' turns in one engine call. Or, for full control, a function

    episode(generate, prompt, label, tokenizer, args) -> Episode | None

that runs one whole episode itself: generate(token_ids, max_new_tokens=None) -> (sampled token ids, their log-probs)
samples one model turn on the engines (the run's temperature, a seed per episode and call). It returns
Episode(segments, reward) with its own tokens (prompt, environment) not trainable and the model's turns as generate
sampled them, trainable with generate's log-probs, or None to reject the episode (no loss; train/episode_rejects).
The framework checks what it returns; episodes run one after another, one engine call per model turn.
"""

import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from common.data import format_prompt
from common.infra.vllm_engine import SamplingArgs


@dataclass
class AgentArgs:
    agent_func_path: Optional[str] = None
    """A .py file defining `class Env` with reset(prompt, label) -> first observation text and step(action text) ->
    (observation text, reward, done), one Env per episode, the episode's reward the sum of its steps' rewards; or a
    function episode(generate, prompt, label, tokenizer, args) -> Episode(segments, reward) | None that runs a whole
    episode, generate(token_ids, max_new_tokens=None) -> (token ids, log-probs) sampling each model turn (None:
    rejected). Instead of --remote_rm_url / --reward_pretrain."""
    max_turns: int = 4
    """Model turns per episode at most (--agent_func_path)."""
    max_episode_tokens: Optional[int] = None
    """Token budget of an episode: prompt, model and environment turns (default: --prompt_max_len + --max_turns x
    --generate_max_len); each model turn gets at most what is left."""
    episode_mismatch: Literal["fork", "reject"] = "fork"
    """When the chat template renders the next turn so that it does not extend what the episode's tokens say (it
    rewrites history): fork (the training sample restarts at the rendered conversation; earlier turns become context
    without loss) or reject (the episode carries no loss). Counted as train/episode_forks and train/episode_rejects."""


def validate_agent_args(args):
    """The --agent_func_path checks that need no file (common.infra.cluster.resolve_rollout_args loads the
    environment and fills --max_episode_tokens)."""
    agent = args.agent
    if args.remote_rm_url or args.reward_pretrain:
        raise ValueError("--agent_func_path: the environment's step() gives the rewards; drop --remote_rm_url "
                         "and --reward_pretrain")
    if agent.max_turns < 1:
        raise ValueError(f"--max_turns must be >= 1, got {agent.max_turns}")
    if args.overlong_buffer_len > 0:
        raise ValueError("--overlong_buffer_len is for single-turn responses, not --agent_func_path episodes")
    if episode_tokens(args) <= args.prompt_max_len:
        raise ValueError(f"--max_episode_tokens {episode_tokens(args)} leaves no room after --prompt_max_len "
                         f"{args.prompt_max_len}")


def episode_tokens(args):
    """--max_episode_tokens, by default the prompt and --max_turns responses."""
    return args.agent.max_episode_tokens or args.prompt_max_len + args.agent.max_turns * args.generate_max_len


def load_env(path):
    """The `Env` class or the `episode` function of an environment file; ValueError naming the file and what it
    lacks."""
    import importlib.util

    if not os.path.isfile(path):
        raise ValueError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"minrlhf_env_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--agent_func_path {path}: importing it raised {type(e).__name__}: {e}") from None
    env, func = getattr(module, "Env", None), getattr(module, "episode", None)
    if env is not None and func is not None:
        raise ValueError(f"--agent_func_path {path}: defines both class Env and episode(); keep one")
    if func is not None:
        try:
            inspect.signature(func).bind(*[None] * 5)
        except (TypeError, ValueError):
            raise ValueError(f"--agent_func_path {path}: episode must be a function of (generate, prompt, label, "
                             f"tokenizer, args)") from None
        return func
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if not isinstance(env, type) or missing:
        raise ValueError(f"--agent_func_path {path}: defines no class Env with reset(prompt, label) -> observation "
                         f"and step(action) -> (observation, reward, done), nor a function episode(generate, prompt, "
                         f"label, tokenizer, args)"
                         + (f" (Env lacks {', '.join(missing)})" if isinstance(env, type) else ""))
    return env


@dataclass
class Episode:
    """One episode as segments (token_ids, trainable, logprobs): the prompt and the environment's turns (not
    trainable, logprobs None) and the model's turns (trainable, with vLLM's log-probs). The segments concatenate to
    exactly the tokens the engine was given and produced: nothing the model wrote is re-tokenised."""

    segments: list
    reward: float = 0.0
    env: object = None  # the Env that ran it (None for an episode() function's)
    messages: list = field(default_factory=list)  # the conversation as chat messages, to render the next turn
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
    elif args.agent.episode_mismatch == "fork":
        e.segments, e.forks = [(tokenizer(text, add_special_tokens=False)["input_ids"], False, None)], e.forks + 1
    else:
        e.rejected = e.done = True


def turn_seed(prompt_seed, sample, turn):
    """The seed of one model turn: hash() of ints is the same in every process and run."""
    return hash((prompt_seed, sample, turn)) % 2**31


def run_episodes(args, env, generate_fn, tokenizer, prompts, n, temperature, seeds, top_p=1.0):
    """n episodes per prompt of `env` (what load_env returned: an Env class, or an episode() function, which
    run_function_episodes runs). Env: turn by turn, the tokens of every unfinished episode go to the engines at once
    (generate_fn(token lists, SamplingArgs list) -> lists of Sample), the model's turn is appended as the tokens
    it sampled, then the environment's answer, each turn sampled at `temperature` and `top_p` (the run's in training,
    1.0 in evaluation as single-turn evaluation). Returns one list of Episode per prompt."""
    if not isinstance(env, type):
        return run_function_episodes(args, env, generate_fn, tokenizer, prompts, n, temperature, seeds, top_p)
    path, budget, episodes = args.agent.agent_func_path, args.agent.max_episode_tokens, []
    for p in prompts:
        for _ in range(n):
            try:
                e = Episode([], env=env())
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
    for turn in range(args.agent.max_turns):
        active = [(i, e) for i, e in enumerate(episodes) if not e.done]
        if not active:
            break
        samplings = [SamplingArgs(n=1, temperature=temperature, top_p=top_p,
                                  seed=turn_seed(seeds[i // n], i % n, turn),
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
            if done or turn + 1 == args.agent.max_turns:
                e.done = True
                continue
            before = list(e.segments), e.forks
            append_observation(e, observation, text, tokenizer, args)
            if len(e.tokens()) >= budget:  # no room for another turn: cut off, as a response at its length limit
                e.segments, e.forks = before  # (the observation would carry no loss and overrun the budget)
                e.done, e.finish_reason = True, "length"
    return [episodes[k * n : (k + 1) * n] for k in range(len(prompts))]


class EpisodeGenerate:
    """What an episode() function gets as `generate`: generate(token_ids, max_new_tokens=None) -> (token ids,
    log-probs) samples one model turn on the engines, at the run's temperature, with a seed per (prompt, sample,
    call) as run_episodes' per turn, at most --max_turns calls; max_new_tokens is at most --generate_max_len and what
    is left of --max_episode_tokens (the default). It keeps every call, to check the episode returned against."""

    def __init__(self, args, generate_fn, where, temperature, top_p, seed, sample):
        self.args, self.generate_fn, self.where = args, generate_fn, where
        self.temperature, self.top_p, self.seed, self.sample = temperature, top_p, seed, sample
        self.calls, self.error = [], None  # (given ids, sampled ids, log-probs, finish reason); what it raised

    def __call__(self, token_ids, max_new_tokens=None):
        try:
            return self.sample_turn(token_ids, max_new_tokens)
        except Exception as error:  # raised as it is, not as an error of the episode() function
            self.error = error
            raise

    def sample_turn(self, token_ids, max_new_tokens):
        if not (isinstance(token_ids, (list, tuple)) and token_ids
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids)):
            raise ValueError(f"{self.where}: generate takes a non-empty list of token ids, got {token_ids!r}"[:400])
        if len(self.calls) == self.args.agent.max_turns:
            raise ValueError(f"{self.where}: generate called more than --max_turns {self.args.agent.max_turns} times")
        room = min(self.args.generate_max_len, self.args.agent.max_episode_tokens - len(token_ids))
        if room < 1:
            raise ValueError(f"{self.where}: generate was given {len(token_ids)} tokens, no room left in "
                             f"--max_episode_tokens {self.args.agent.max_episode_tokens}")
        sampling = SamplingArgs(n=1, temperature=self.temperature, top_p=self.top_p,
                                seed=turn_seed(self.seed, self.sample, len(self.calls)),
                                max_new_tokens=min(max_new_tokens or room, room))
        ((s,),) = self.generate_fn([list(token_ids)], [sampling])
        self.calls.append((list(token_ids), list(s.output_ids), list(s.logprobs), s.finish_reason))
        return list(s.output_ids), list(s.logprobs)


def run_function_episodes(args, func, generate_fn, tokenizer, prompts, n, temperature, seeds, top_p=1.0):
    """n episodes per prompt of an episode() function, one after another; what each returns is checked
    (checked_episode). Returns one list of Episode per prompt."""
    path, groups = args.agent.agent_func_path, []
    for k, p in enumerate(prompts):
        groups.append([])
        for sample in range(n):
            where = f"--agent_func_path {path}: episode {k * n + sample}"
            generate = EpisodeGenerate(args, generate_fn, where, temperature, top_p, seeds[k], sample)
            try:
                out = func(generate, p["raw"], p["label"], tokenizer, args)
            except Exception as error:
                if error is generate.error:
                    raise
                raise ValueError(f"{where}: episode() raised {type(error).__name__}: {error}") from None
            groups[-1].append(checked_episode(out, generate, where, args.agent.max_episode_tokens))
    return groups


def checked_episode(out, generate, where, budget):
    """The Episode an episode() function returned, checked: segments (token ids, trainable, log-probs), the first
    (the prompt) not trainable, each trainable one a model turn as generate sampled it (or its start) right after the
    tokens generate was given, one log-prob per token; a finite reward; at most `budget` tokens. None: the episode
    is rejected, its last model turn kept as a sample without loss. Reward, forks (the times the function restarted
    the sample) and rejected are the function's; turns and finish reason generate's."""
    calls = generate.calls
    if out is None:
        if not calls:
            raise ValueError(f"{where}: episode() returned None before any generate call: a rejected episode is "
                             f"counted by its model turn (leave such prompts out of the data instead)")
        given, ids, logps, _ = calls[-1]
        out = Episode([(given, False, None), (ids, True, logps)], rejected=True)
    if not isinstance(out, Episode):
        raise ValueError(f"{where}: episode() must return an Episode(segments, reward) or None, got "
                         f"{type(out).__name__}")
    if not (isinstance(out.reward, (int, float)) and not isinstance(out.reward, bool) and math.isfinite(out.reward)):
        raise ValueError(f"{where}: the Episode's reward must be a finite number, got {out.reward!r}"[:400])
    if not (isinstance(out.forks, int) and not isinstance(out.forks, bool) and out.forks >= 0):
        raise ValueError(f"{where}: the Episode's forks must be a count (int >= 0), got {out.forks!r}"[:400])
    if not isinstance(out.segments, (list, tuple)) or not out.segments:
        raise ValueError(f"{where}: the Episode's segments must be a non-empty list of (token_ids, trainable, "
                         f"logprobs), got {out.segments!r}"[:400])
    segments, seen = [], []
    for j, segment in enumerate(out.segments):
        if not (isinstance(segment, (list, tuple)) and len(segment) == 3):
            raise ValueError(f"{where}: segment {j} must be (token_ids, trainable, logprobs), got {segment!r}"[:400])
        ids, trainable, logps = segment
        if not (isinstance(ids, (list, tuple)) and ids
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ValueError(f"{where}: segment {j}: token_ids must be a non-empty list of token ids, "
                             f"got {ids!r}"[:400])
        if not isinstance(trainable, bool):
            raise ValueError(f"{where}: segment {j}: trainable must be True or False, got {trainable!r}")
        if trainable and j == 0:
            raise ValueError(f"{where}: segment 0 is the prompt: it cannot be trainable")
        if trainable:
            if not isinstance(logps, (list, tuple)) or len(logps) != len(ids):
                raise ValueError(f"{where}: segment {j} is trainable: it needs one log-prob per token ({len(ids)}), "
                                 f"got {logps!r}"[:400])
            if not any(given == seen and out_ids[: len(ids)] == list(ids) and out_logps[: len(ids)] == list(logps)
                       for given, out_ids, out_logps, _ in calls):
                raise ValueError(f"{where}: segment {j} is trainable but is not a model turn as generate sampled it "
                                 f"after the tokens before it (keep the model's tokens and log-probs as sampled, "
                                 f"after exactly the tokens generate was given)")
        segments.append((list(ids), trainable, list(logps) if trainable else None))
        seen += ids
    if not any(trainable for _, trainable, _ in segments):
        raise ValueError(f"{where}: the Episode has no trainable segment (return None to reject an episode)")
    if len(seen) > budget:
        raise ValueError(f"{where}: the Episode has {len(seen)} tokens, more than --max_episode_tokens {budget}")
    return Episode(segments, float(out.reward), turns=len(calls), forks=out.forks, rejected=out.rejected, done=True,
                   finish_reason=calls[-1][3])

