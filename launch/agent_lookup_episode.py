"""The built-in multi-turn task (launch/agent_lookup.py, same rewards) as an episode() function: the file runs the
whole episode itself and builds its segments, token in / token out. The prompt names a box; the model's first turn
is its lookup, the environment answers with the box's letters, and the model must answer them reversed (reward 1 on
its second turn, 0.5 on a later one, up to --max_turns).

    python algos/grpo.py --pretrain outputs/sft --prompt_data assets/data/lookup/rl_train.jsonl \\
        --input_key prompt --label_key letters --apply_chat_template \\
        --agent_func_path launch/agent_lookup_episode.py --max_turns 3 ...
"""

from common.episodes import Episode


def episode(generate, prompt, label, tokenizer, args):
    """prompt: the row's --input_key; label: its --label_key (the box's letters). generate(token_ids) -> (the
    model's sampled token ids, their log-probs). Returns Episode(segments, reward) (needs --apply_chat_template)."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    segments = [(tokenizer(text, add_special_tokens=False)["input_ids"], False, None)]
    answer, forks = " ".join(reversed(label.split())), 0
    for turn in range(1, args.agent.max_turns + 1):
        ids, logps = generate([t for seg, _, _ in segments for t in seg])
        segments.append((ids, True, logps))  # the model's turn, as sampled
        action = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if turn > 1 and action.strip() == answer:
            return Episode(segments, reward=1.0 if turn == 2 else 0.5, forks=forks)
        if turn == args.agent.max_turns:
            break
        # the environment's answer as the next user turn: the tokens of what the rendered conversation adds
        messages += [{"role": "assistant", "content": action},
                     {"role": "user", "content": f"reverse: {label}" if turn == 1 else f"wrong. reverse: {label}"}]
        seen = tokenizer.decode([t for seg, _, _ in segments for t in seg], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if text.startswith(seen):
            grown = segments + [(tokenizer(text[len(seen):], add_special_tokens=False)["input_ids"], False, None)]
        elif args.agent.episode_mismatch == "reject":  # the template rewrote history: no loss
            return None
        else:  # fork: the sample restarts at the rendered conversation, earlier turns become context without loss
            grown = [(tokenizer(text, add_special_tokens=False)["input_ids"], False, None)]
        if sum(len(seg) for seg, _, _ in grown) >= args.agent.max_episode_tokens:
            break  # no room for another model turn
        segments, forks = grown, forks + (not text.startswith(seen))
    return Episode(segments, reward=0.0, forks=forks)
