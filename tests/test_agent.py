"""algos/grpo.py --agent_func_path (common/episodes.py): episodes token in / token out (segments concatenate to
what the engine saw, masks and log-probs line up token by token, a chat template that rewrites history forks or
rejects), advantages that the environment's tokens cannot change, bad environment files, and a multi-turn learning
run on the built-in task (launch/tiny.py data/lookup, launch/agent_lookup.py)."""

import dataclasses
import os

import pytest
import torch

from common.episodes import load_env, run_episodes
from common.rollout import episode_sample, make_batch
from conftest import ROOT, load_algo, read_jsonl, run_script, training_sample
from test_grpo import grpo_args

grpo = load_algo("grpo")
LOOKUP_ENV = os.path.join(ROOT, "launch", "agent_lookup.py")


def lookup_prompts(assets, tokenizer, args, n):
    return grpo.load_prompts(f"{assets}/data/lookup/rl_test.jsonl", "train", args, tokenizer, n)


def agent_args(assets, *extra):
    return grpo.parse_args(["--pretrain", f"{assets}/llama-0.5m", "--prompt_data", "d.jsonl", "--input_key", "prompt",
                            "--label_key", "letters", "--apply_chat_template", "--agent_func_path", LOOKUP_ENV,
                            "--max_turns", "3", "--prompt_max_len", "48", "--generate_max_len", "12", *extra])


class RecordingHF:
    """The Hugging Face backend (common.infra.vllm_engine.HFGenerator, the real model), keeping every token list it was
    given and every sample it returned, as run_episodes' generate_fn."""

    def __init__(self, model_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from common.infra.vllm_engine import HFGenerator

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_path)
        self.hf = HFGenerator(model, AutoTokenizer.from_pretrained(model_path))
        self.calls, self.samplings = [], []

    def __call__(self, prompt_ids, samplings):
        self.samplings += samplings
        out = [self.hf.generate([ids], s)[0] for ids, s in zip(prompt_ids, samplings)]
        self.calls += [(list(ids), group[0]) for ids, group in zip(prompt_ids, out)]
        return out


def test_episode_tokens_line_up_with_what_the_engine_saw(assets, rl_start_model):
    from transformers import AutoTokenizer

    args = agent_args(assets)
    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    gen = RecordingHF(rl_start_model)
    prompts = lookup_prompts(assets, tokenizer, args, 4)
    groups = run_episodes(args, load_env(LOOKUP_ENV), gen, tokenizer, prompts, 2, 1.0, [11, 12, 13, 14])
    episodes = [e for g in groups for e in g]
    assert sum(e.turns for e in episodes) == len(gen.calls) and all(e.turns >= 2 for e in episodes)
    assert sum(e.forks for e in episodes) == 0  # the tiny chat template only appends
    # the model's tokens stay as sampled even where they are not the tokenizer's split of their text (sampled "g" "a"
    # where the tokenizer writes "ga"): here 1 of the 8 episodes has such a turn, which re-rendering would rewrite
    drifted = [e for e in episodes if any(trainable and tokenizer(tokenizer.decode(ids), add_special_tokens=False)
                                          ["input_ids"] != ids for ids, trainable, _ in e.segments)]
    assert drifted
    calls = {(tuple(given), tuple(s.output_ids), tuple(s.logprobs)) for given, s in gen.calls}
    for e in episodes:
        seen = []
        for ids, trainable, logps in e.segments:
            if trainable:  # a model turn: the engine was given exactly the tokens before it, and sampled these
                assert (tuple(seen), tuple(ids), tuple(logps)) in calls
            else:
                assert logps is None
            seen += ids
        assert seen == e.tokens()
        # the training sample: loss on the model's tokens only, vLLM log-probs at the same positions
        s = episode_sample(e, mask_truncated=False)
        assert s.prompt_ids + s.response_ids == e.tokens()
        model = [lp for ids, trainable, lps in e.segments[1:] if trainable for lp in lps]
        assert s.vllm_logps[s.model_tokens].tolist() == torch.tensor(model).tolist()
        s.advantages = torch.arange(len(s.response_ids), dtype=torch.float32)
        batch = make_batch([s], 0, 256, False, ["vllm_logps", "advantages"])
        r, start, length = batch["spans"][0]
        mask = batch["loss_mask"][r, start + len(s.prompt_ids): start + length]
        assert mask.tolist() == s.model_tokens.float().tolist()
        laid = batch["vllm_logps"][r, start + len(s.prompt_ids): start + length]
        assert torch.allclose(laid, s.vllm_logps)
    # the environment's text is what the model saw: the second user turn shows the box's letters
    first = episodes[0]
    assert f"reverse: {prompts[0]['label']}" in tokenizer.decode(first.segments[2][0])


REWRITING_TEMPLATE = (  # renders earlier assistant turns as "(...)": the history the model saw is rewritten
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}(...){% else %}{{ message['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("mode", ["fork", "reject"])
def test_a_template_that_rewrites_history_forks_or_rejects(assets, rl_start_model, mode):
    from transformers import AutoTokenizer

    args = agent_args(assets, "--episode_mismatch", mode)
    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    tokenizer.chat_template = REWRITING_TEMPLATE
    gen = RecordingHF(rl_start_model)
    prompts = lookup_prompts(assets, tokenizer, args, 3)
    episodes = [e for g in run_episodes(args, load_env(LOOKUP_ENV), gen, tokenizer, prompts, 2, 1.0,
                                             [1, 2, 3]) for e in g]
    if mode == "reject":  # the first observation cannot be appended: every episode stops there, without loss
        assert all(e.rejected and e.turns == 1 and e.forks == 0 for e in episodes)
        assert all(episode_sample(e, False).masked for e in episodes)
        return
    assert all(e.forks == e.turns - 1 >= 1 and not e.rejected for e in episodes)
    calls = {(tuple(given), tuple(s.output_ids)) for given, s in gen.calls}
    for e in episodes:  # the sample restarts at the rendered conversation: what the engine was given for the last turn
        (prompt, trainable, _), (last, last_trainable, _) = e.segments[0], e.segments[1]
        assert not trainable and last_trainable and (tuple(prompt), tuple(last)) in calls
        assert "(...)" in tokenizer.decode(prompt)
        s = episode_sample(e, False)
        assert s.model_tokens[: len(last)].all() and not s.masked


@pytest.mark.quick
def test_environment_tokens_do_not_change_advantages():
    """The same model tokens and rewards with different environment tokens between them (other ids, other
    lengths, other old / reference log-probs there): the model tokens' advantages are the same for every estimator,
    KL in the reward included, and the same as for the model tokens alone."""
    g = torch.Generator().manual_seed(0)
    model_turns = [[torch.randint(10, 90, (k,), generator=g).tolist() for k in (3, 2, 4)] for _ in range(8)]
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.5]])

    def samples(env_len):
        out = []
        for i, turns in enumerate(model_turns):
            ids, trainable = [], []
            for t, turn in enumerate(turns):
                ids += turn
                trainable += [1] * len(turn)
                if t + 1 < len(turns) and env_len:
                    ids += torch.randint(100, 200, (env_len + i % 3,), generator=g).tolist()
                    trainable += [0] * (env_len + i % 3)
            old = torch.randn(len(ids), generator=g)
            ref = old + 0.1 * torch.randn(len(ids), generator=g)
            m = torch.tensor(trainable, dtype=torch.bool)
            old[m] = torch.linspace(-1, -0.1, int(m.sum())) * (i + 1) / 8  # the model tokens' log-probs: fixed
            ref[m] = old[m] + 0.05
            out.append(training_sample([1, 2], ids, trainable, old_logps=old, ref_logps=ref))
        return out

    base = grpo.Args(prompt_data="d", remote_rm_url="r", init_kl_coef=0.1)
    for estimator in grpo.ESTIMATORS:
        args = dataclasses.replace(base, advantage_estimator=estimator, n_samples_per_prompt=4, gamma=0.9)
        results = []
        for env_len in (0, 3, 7):
            ss = samples(env_len)
            adv = grpo.sample_advantages(ss, rewards, args)
            for s, a in zip(ss, adv):
                assert (a[~s.model_tokens] == 0).all()  # environment tokens: no advantage
            results.append([a[s.model_tokens] for s, a in zip(ss, adv)])
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert torch.equal(a, b), estimator
        assert results[0][0].abs().sum() > 0


@pytest.mark.quick
def test_bad_agent_files(assets, rl_start_model, tmp_path):
    from transformers import AutoTokenizer

    no_env = tmp_path / "no_env.py"
    no_env.write_text("def reset(prompt, label):\n    return prompt\n")
    with pytest.raises(ValueError, match=f"--agent_func_path {no_env}: defines no class Env with reset"):
        load_env(str(no_env))
    no_step = tmp_path / "no_step.py"
    no_step.write_text("class Env:\n    def reset(self, prompt, label):\n        return prompt\n")
    with pytest.raises(ValueError, match=r"defines no class Env .* \(Env lacks step\)"):
        load_env(str(no_step))
    # through the CLI: refused before Ray or any model starts
    args = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 16, "--train_batch_size", 64)
    at = args.index("--remote_rm_url")
    args[at: at + 2] = ["--agent_func_path", no_step]
    proc = run_script("grpo.py", args, expect_ok=False)
    assert proc.returncode != 0 and f"error: --agent_func_path {no_step}: defines no class Env" in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr.split("error:")[0]

    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    gen = RecordingHF(rl_start_model)
    raising = tmp_path / "raising.py"
    raising.write_text("class Env:\n    def reset(self, prompt, label):\n        self.n = 0\n        return prompt\n"
                       "    def step(self, action):\n        self.n += 1\n"
                       "        if self.n == 2:\n            raise KeyError('no such box')\n"
                       "        return 'look', 0.0, False\n")
    wrong = tmp_path / "wrong_types.py"
    wrong.write_text("class Env:\n    def reset(self, prompt, label):\n        return prompt\n"
                     "    def step(self, action):\n        return 'look', 1.0\n")
    for path, message in ((raising, "episode 0, turn 1: Env.step raised KeyError: 'no such box'"),
                          (wrong, r"episode 0, turn 0: Env.step must return \(observation: str, reward: float, "
                                  r"done: bool\), got \('look', 1.0\)")):
        args = agent_args(assets)
        args.agent.agent_func_path = str(path)
        prompts = lookup_prompts(assets, tokenizer, args, 2)
        with pytest.raises(ValueError, match=f"--agent_func_path {path}: {message}"):
            run_episodes(args, load_env(str(path)), gen, tokenizer, prompts, 2, 1.0, [1, 2])


def test_multiturn_lookup_task_learns(assets, rl_start_model, tmp_path):
    args = grpo_args(assets, rl_start_model, tmp_path, "--rollout_batch_size", 32, "--train_batch_size", 128,
                     "--max_epochs", 2, "--actor_learning_rate", 1e-4, "--max_steps", 12, "--eval_steps", 12,
                     "--max_turns", 3)
    for flag, value in (("--prompt_data", f"{assets}/data/lookup/rl_train.jsonl"),
                        ("--eval_dataset", f"{assets}/data/lookup/rl_test.jsonl"), ("--label_key", "letters")):
        args[args.index(flag) + 1] = value
    at = args.index("--remote_rm_url")
    args[at: at + 2] = ["--agent_func_path", LOOKUP_ENV]
    run_script("grpo.py", args, timeout=900)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [m for m in metrics if "train/reward" in m]
    evals = [m["eval/pass@1"] for m in metrics if "eval/pass@1" in m]
    assert len(steps) == 12 and all(m["train/episode_turns"] >= 2 for m in steps)
    rewards = [m["train/reward"] for m in steps]
    # measured: held-out greedy success 0.013 -> 0.460 (200 prompts); sampled reward 0.052 -> 0.245 (first / last 4)
    assert evals[-1] - evals[0] >= 0.15, evals
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.1, rewards
    assert max(m["rollout/logp_abs_diff_max"] for m in steps) <= 1e-4  # measured ~2e-5 on the model's tokens


# ----------------------------------------------------------------------------------------------
# The full-control form: an episode() function (launch/agent_lookup_episode.py)
# ----------------------------------------------------------------------------------------------
LOOKUP_EPISODE = os.path.join(ROOT, "launch", "agent_lookup_episode.py")


@pytest.mark.parametrize("template", ["own", "fork", "reject"])
def test_episode_function_is_the_env_on_the_same_samples(assets, rl_start_model, template):
    """The lookup task as an episode() function gives, with the same seeds, exactly the Env version's episodes:
    the same engine calls, segments (ids, trainable, log-probs), rewards, turns, forks and rejects, with the tiny
    chat template and with one that rewrites history (--episode_mismatch fork / reject); its segments concatenate
    to what the engine saw."""
    from transformers import AutoTokenizer

    # room for 3 turns: no episode is cut off by the budget
    args = agent_args(assets, "--max_episode_tokens", "128", *(["--episode_mismatch", template] * (template != "own")))
    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    if template != "own":
        tokenizer.chat_template = REWRITING_TEMPLATE
    prompts = lookup_prompts(assets, tokenizer, args, 8)
    seeds = list(range(21, 29))
    args.top_p = 0.9  # evaluation's 1.0, given below, must win over it
    by_env, by_function = RecordingHF(rl_start_model), RecordingHF(rl_start_model)
    env_episodes = [e for g in run_episodes(args, load_env(LOOKUP_ENV), by_env, tokenizer, prompts, 2, 1.0, seeds,
                                            top_p=1.0) for e in g]
    args.agent.agent_func_path = LOOKUP_EPISODE
    func = load_env(LOOKUP_EPISODE)
    assert not isinstance(func, type)
    episodes = [e for g in run_episodes(args, func, by_function, tokenizer, prompts, 2, 1.0, seeds, top_p=1.0)
                for e in g]
    # every turn at the top_p given (the run's --top_p in training, 1.0 in evaluation), not at the run's --top_p
    assert {s.top_p for s in by_env.samplings + by_function.samplings} == {1.0}
    assert len(episodes) == 16 and all(len(e.tokens()) < 128 for e in env_episodes)
    for e, want in zip(episodes, env_episodes):
        assert (e.reward, e.turns, e.forks, e.rejected, e.finish_reason) == (
            want.reward, want.turns, want.forks, want.rejected, want.finish_reason)
        # a rejected episode keeps its last model turn after what the engine was given, as one context segment
        assert e.segments == want.segments if not e.rejected else e.tokens() == want.tokens()
    assert sorted(map(tuple, (c[0] for c in by_function.calls))) == sorted(map(tuple, (c[0] for c in by_env.calls)))
    calls = {(tuple(given), tuple(s.output_ids), tuple(s.logprobs)) for given, s in by_function.calls}
    for e in episodes:
        seen = []
        for ids, trainable, logps in e.segments:
            assert not trainable or (tuple(seen), tuple(ids), tuple(logps)) in calls
            seen += ids
    if template == "own":  # measured: one episode right on its third turn (0.5), one on its second, the rest wrong
        assert [e.reward for e in episodes] == [0.0] * 6 + [0.5] + [0.0] * 6 + [1.0, 0.0, 0.0]
        assert [e.turns for e in episodes] == [3] * 13 + [2] + [3] * 2
        assert sum(e.forks for e in episodes) == 0
    elif template == "fork":
        assert all(e.forks == e.turns - 1 >= 1 and not e.rejected for e in episodes)
    else:
        assert all(e.rejected and e.turns == 1 for e in episodes)


def write_episode_file(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text("from common.episodes import Episode\n\n\ndef episode(generate, prompt, label, tokenizer, args):\n"
                    "    ids = tokenizer(tokenizer.apply_chat_template([{'role': 'user', 'content': prompt}], "
                    "tokenize=False, add_generation_prompt=True), add_special_tokens=False)['input_ids']\n"
                    + "".join(f"    {line}\n" for line in body))
    return str(path)


@pytest.mark.quick
def test_bad_episode_functions(assets, rl_start_model, tmp_path):
    from transformers import AutoTokenizer

    both = tmp_path / "both.py"
    both.write_text("class Env:\n    pass\n\n\ndef episode(generate, prompt, label, tokenizer, args):\n    pass\n")
    with pytest.raises(ValueError, match=f"--agent_func_path {both}: defines both class Env and episode"):
        load_env(str(both))
    two_args = tmp_path / "two_args.py"
    two_args.write_text("def episode(generate, prompt):\n    pass\n")
    with pytest.raises(ValueError, match=r"episode must be a function of \(generate, prompt, label, tokenizer, args\)"):
        load_env(str(two_args))
    neither = tmp_path / "neither.py"
    neither.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no class Env .* nor a function episode"):
        load_env(str(neither))

    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    gen = RecordingHF(rl_start_model)
    cases = {
        "a_string": (["generate(ids)", "return 'done'"],
                     r"episode 0: episode\(\) must return an Episode\(segments, reward\) or None, got str"),
        "no_logprobs": (["out, logps = generate(ids)", "return Episode([(ids, False, None), (out, True, None)], 1.0)"],
                        r"episode 0: segment 1 is trainable: it needs one log-prob per token \(\d+\), got None"),
        "made_up_logprobs": (["out, logps = generate(ids)",
                              "return Episode([(ids, False, None), (out, True, [0.0] * len(out))], 1.0)"],
                             "episode 0: segment 1 is trainable but is not a model turn as generate sampled it"),
        "prompt_trained": (["out, logps = generate(ids)", "return Episode([(ids + out, True, logps)], 1.0)"],
                           "episode 0: segment 0 is the prompt: it cannot be trainable"),
        "bool_reward": (["out, logps = generate(ids)",
                         "return Episode([(ids, False, None), (out, True, logps)], True)"],
                        "episode 0: the Episode's reward must be a finite number, got True"),
        "too_long": (["out, logps = generate(ids)",
                      "return Episode([(ids, False, None), (out, True, logps), ([5] * 200, False, None)], 1.0)"],
                     r"episode 0: the Episode has \d+ tokens, more than --max_episode_tokens 84"),
        "raising": (["raise KeyError('no such box')"], "episode 0: episode\\(\\) raised KeyError: 'no such box'"),
        "early_none": (["return None"], r"episode 0: episode\(\) returned None before any generate call"),
        "too_many_turns": (["for _ in range(4):", "    generate(ids)"],
                           "episode 0: generate called more than --max_turns 3 times"),
        "no_room": (["generate(ids * 20)"], r"episode 0: generate was given \d+ tokens, no room left in "
                                            r"--max_episode_tokens 84"),
    }
    for name, (body, message) in cases.items():
        args = agent_args(assets)
        args.agent.agent_func_path = path = write_episode_file(tmp_path, name, body)
        prompts = lookup_prompts(assets, tokenizer, args, 2)
        with pytest.raises(ValueError, match=f"--agent_func_path {path}: {message}"):
            run_episodes(args, load_env(path), gen, tokenizer, prompts, 2, 1.0, [1, 2])
    # through the CLI: refused before Ray or any model starts
    proc = run_script("grpo.py", ["--pretrain", rl_start_model, "--prompt_data", "d.jsonl",
                                  "--agent_func_path", two_args], expect_ok=False)
    assert proc.returncode != 0 and f"error: --agent_func_path {two_args}: episode must be a function" in proc.stderr


def test_episode_function_none_is_a_reject(assets, rl_start_model, tmp_path):
    """None rejects the episode: its last model turn stays as a sample without loss, counted in
    train/episode_rejects; the others train."""
    from transformers import AutoTokenizer

    from common.rollout import Rollout, rollout_metrics, rollout_samples

    path = write_episode_file(tmp_path, "odd_boxes", [
        "out, logps = generate(ids)",
        "if int(prompt.split()[-1]) % 2:  # odd boxes: rejected",
        "    return None",
        "return Episode([(ids, False, None), (out, True, logps)], 1.0)"])
    args = agent_args(assets)
    args.agent.agent_func_path = path
    tokenizer = AutoTokenizer.from_pretrained(rl_start_model)
    gen = RecordingHF(rl_start_model)
    prompts = lookup_prompts(assets, tokenizer, args, 4)  # boxes 2000-2003
    groups = run_episodes(args, load_env(path), gen, tokenizer, prompts, 3, 1.0, [5, 6, 7, 8])
    assert [[e.rejected for e in g] for g in groups] == [[False] * 3, [True] * 3, [False] * 3, [True] * 3]
    assert [[e.reward for e in g] for g in groups] == [[1.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]
    rollout = Rollout([(p, g, torch.tensor([e.reward for e in g])) for p, g in zip(prompts, groups)],
                      dropped=0, rounds=1, end=4, version=0, timing={})
    samples, rewards = rollout_samples(rollout, args)
    metrics = rollout_metrics(rollout, samples, rewards, 0)
    assert metrics["train/episode_rejects"] == 6 and metrics["train/episode_turns"] == 1.0
    assert [s.masked for s in samples] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    for (given, s), sample in zip(gen.calls, samples):  # a rejected episode's sample: its model turn, no loss
        assert sample.prompt_ids == given and sample.response_ids == s.output_ids
        assert sample.model_tokens.all() and sample.vllm_logps.tolist() == torch.tensor(s.logprobs).tolist()
        batch = make_batch([sample], 0, 256, False)
        assert batch["loss_mask"].sum().item() == (0 if sample.masked else len(s.output_ids))
