"""What a row becomes: the data flags, prompts formatted with chat or plain templates, responses, and checked
fields (BadRow names the field). Each algorithm script's row function decides which fields and which tokens carry
loss with these; common/infra/datasets.py runs it over the data and reports bad rows by file and row.
"""

from dataclasses import dataclass
from typing import Optional

import tyro


@dataclass
class PromptArgs:
    """Which field of a row holds its prompt and how the prompt becomes text (format_prompt): the same flags in
    every script that reads prompts (DataArgs, grpo.py's and ppo.py's RLArgs, generate.py's Args derive from it)."""
    input_key: str = "input"
    """Field holding the prompt (a string, or a list of chat messages)."""
    input_template: Optional[str] = None
    """Plain prompt template with one '{}' for the prompt, e.g. 'User: {}\\nAssistant: ' (no chat template)."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template."""
    tokenizer_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own."""


@dataclass
class DataArgs(PromptArgs):
    dataset: str = tyro.MISSING
    """Comma list of datasets: local json/jsonl/csv/parquet/arrow files or folders, save_to_disk folders, `type@dir`,
    or hub names."""
    dataset_probs: Optional[str] = None
    """Comma list of mixing probabilities, one per dataset (default: concatenate)."""
    dataset_split: str = "train"
    """Split of --dataset to train on (local files have only 'train')."""
    eval_dataset: Optional[str] = None
    """Comma list of held-out datasets for periodic evaluation."""
    eval_split: str = "train"
    """Split of --eval_dataset."""
    max_samples: int = 100_000_000
    """Use at most this many training samples (after mixing)."""
    max_len: int = 2048
    """Longest sample in tokens; longer samples are an error (or skipped with --skip_bad_rows)."""
    skip_bad_rows: bool = False
    """Skip and count malformed or too-long rows instead of stopping with an error."""
    preprocess_num_workers: int = 1
    """Processes that tokenize the data."""
    packing_samples: bool = True
    """Bin-pack samples into rows without padding (--no_packing_samples: one padded sample per row)."""
    pack_max_tokens: int = 0
    """Longest packed row in tokens, for masked attention (sdpa, eager; 0: --max_len). Per-sample kernels
    (flash-attention, varlen_sdpa: the defaults) take each micro-batch as one row, padding-free."""


class BadRow(ValueError):
    """Raised by a row function for a row that cannot be used; the message names the field."""


def format_prompt(prompt, tokenizer, args: PromptArgs):
    """The prompt text the model sees: chat template (a string becomes one user turn), the
    plain --input_template, or the raw text."""
    if args.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise BadRow("is a list of messages: pass --apply_chat_template")
    return args.input_template.format(prompt) if args.input_template else prompt


def format_response(prompt, response, tokenizer, args: PromptArgs):
    """The response text appended to format_prompt(prompt): under a chat template, what the
    template adds for the assistant turn (end-of-turn tokens included); otherwise response + EOS."""
    if args.apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        if not full.startswith(prompt_text):
            raise BadRow("chat template output does not start with the templated prompt")
        return full[len(prompt_text):]
    return response if response.endswith(tokenizer.eos_token) else response + tokenizer.eos_token


def reward_model_ids(tokenizer, prompt_text, response_text, apply_chat_template):
    """What a reward model reads of a formatted prompt and its response: the ids rm.py trains on, and the ones RL,
    generate.py and launch/reward_server.py score. The prompt gets the tokenizer's special tokens (a BOS), as the
    policy's prompt ids do, unless a chat template wrote its own; the response is tokenized as it is (its EOS or
    end-of-turn tokens in the text)."""
    return (tokenizer(prompt_text, add_special_tokens=not apply_chat_template)["input_ids"]
            + tokenizer(response_text, add_special_tokens=False)["input_ids"])


def get_field(row, key, kind=str):
    """row[key], checked: a missing key, None, wrong type or empty string raises BadRow naming it."""
    if key not in row or row[key] is None:
        raise BadRow(f"missing field {key!r} (fields: {sorted(k for k, v in row.items() if v is not None)})")
    value = row[key]
    if kind is str and isinstance(value, list) and value and isinstance(value[0], dict):
        return value  # chat messages
    if not isinstance(value, kind):
        raise BadRow(f"field {key!r} should be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise BadRow(f"field {key!r} is empty")
    return value


