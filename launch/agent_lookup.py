"""Environment of the built-in multi-turn task (launch/tiny.py writes its prompts in data/lookup/): the prompt
names a box and nothing else; the model's first turn is its lookup (any text), the environment answers with the
box's letters ("reverse: c a d"), and the model must answer them reversed ("d a c": reward 1). A wrong answer gets
one more try (reward 0.5), then the episode ends.

    python algos/grpo.py --pretrain outputs/sft --prompt_data assets/data/lookup/rl_train.jsonl \\
        --input_key prompt --label_key letters --apply_chat_template \\
        --agent_func_path launch/agent_lookup.py --max_turns 3 ...
"""


class Env:
    """One episode; grpo.py makes one per episode and calls reset once, then step once per model turn."""

    def reset(self, prompt, label):
        """prompt: the row's --input_key; label: its --label_key (the box's letters). Returns the first user turn."""
        self.letters, self.turn = label, 0
        return prompt

    def step(self, action):
        """The model's turn as text -> (the environment's answer, reward, done)."""
        self.turn += 1
        if self.turn == 1:
            return f"reverse: {self.letters}", 0.0, False
        if action.strip() == " ".join(reversed(self.letters.split())):
            return "", 1.0 if self.turn == 2 else 0.5, True
        return f"wrong. reverse: {self.letters}", 0.0, False
