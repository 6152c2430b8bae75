"""Tiny offline assets: a byte-level BPE tokenizer with a chat template, tiny Llama / Qwen2 models,
and synthetic tasks with verifiable answers in every data format the algorithms read.

Everything is built locally and deterministically (fixed seeds), so tests, the demo and the
benchmarks never touch a model hub.  Build them all with:

    python -m launch.tiny --out assets
"""

import argparse
import json
import os
import random

import torch

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LETTERS = "abcdefgh"

# name -> (architecture, hidden, layers, intermediate); head_dim is 64 everywhere (vLLM's CPU
# attention rejects 16), so heads = hidden / 64.
MODEL_SIZES = {
    "llama-0.5m": ("llama", 128, 2, 256),
    "qwen2-0.5m": ("qwen2", 128, 2, 256),
    "llama-10m": ("llama", 256, 8, 1024),
    "qwen2-10m": ("qwen2", 256, 8, 1024),
}


# ----------------------------------------------------------------------------------------------
# Synthetic tasks: each maps a random generator to (prompt, answer, wrong_answer)
# ----------------------------------------------------------------------------------------------
def reverse_example(rng):
    """Reverse a spaced string of 3-6 letters: 'reverse: c a d' -> 'd a c'."""
    letters = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
    answer = list(reversed(letters))
    wrong = letters if letters != answer else letters[1:] + letters[:1]
    return f"reverse: {' '.join(letters)}", " ".join(answer), " ".join(wrong)


def add_example(rng):
    """Add two numbers below 50, digits spaced: 'add: 1 2 + 7' -> '1 9'."""
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    wrong = a + b + rng.choice([-2, -1, 1, 2, 10])
    wrong = wrong if wrong >= 0 else a + b + 1
    spaced = lambda n: " ".join(str(n))  # noqa: E731
    return f"add: {spaced(a)} + {spaced(b)}", spaced(a + b), spaced(wrong)


TASKS = {"reverse": reverse_example, "add": add_example}

STEP_TAG = ";"  # ends each step of the PRM data; one token of the tiny tokenizer, used nowhere else


def count_chain_example(rng, wrong_prob=0.3):
    """Count up one step at a time: 'count: 3 to 7' -> '4; 5; 6; 7;'.  Each step is wrong (any other
    digit) with `wrong_prob`, and the next step goes on from the number as written; the chain stops
    after the requested number of steps or at 9.  Returns (prompt, steps, labels): labels[i] is '+'
    when step i is one more than the number before it, '-' when it is not.  (Full addition chains
    such as '3 + 4 = 7; 7 + 5 = 1 2;' are not learnt by the 0.4M-parameter test model in a few
    hundred steps; this successor check is.)"""
    start = rng.randint(0, 6)
    end = rng.randint(start + 3, 9)
    prev, steps, labels = start, [], []
    for _ in range(end - start):
        if prev == 9:
            break
        n = prev + 1 if rng.random() >= wrong_prob else rng.choice([d for d in range(10) if d != prev + 1])
        steps.append(f"{n}{STEP_TAG}")
        labels.append("+" if n == prev + 1 else "-")
        prev = n
    return f"count: {start} to {end}", " ".join(steps), labels


def write_prm_data(out_dir, n_train=3000, n_test=200, seed=0):
    """Step-labelled data for process reward models in out_dir/count/: prm_{train,test}.jsonl
    ({"prompt", "response", "labels"}: hard '+'/'-' per step) and prm_soft_{train,test}.jsonl (the same
    rows with soft labels: the probability that the step is right, 0.8-1.0 if it is, 0.0-0.2 if not).
    The prompts repeat (there are few), the (prompt, steps) rows do not, across both splits."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_test:
        prompt, steps, labels = count_chain_example(rng)
        if (prompt, steps) not in seen:
            seen.add((prompt, steps))
            rows.append({"prompt": prompt, "response": steps, "labels": labels})
    d = os.path.join(out_dir, "count")
    for split, part in (("train", rows[:n_train]), ("test", rows[n_train:])):
        write_jsonl(f"{d}/prm_{split}.jsonl", part)
        soft = [{**r, "labels": [rng.choice([0.8, 0.9, 1.0]) if lab == "+" else rng.choice([0.0, 0.1, 0.2])
                                 for lab in r["labels"]]} for r in part]
        write_jsonl(f"{d}/prm_soft_{split}.jsonl", soft)


def write_lookup_data(out_dir, n_train=2000, n_test=200, seed=0):
    """The built-in multi-turn task (environment: launch/agent_lookup.py) in out_dir/lookup/rl_{train,test}.jsonl:
    {"prompt": "lookup: box 17", "letters": "c a d"}. The prompt names a box and nothing else; the environment
    shows the box's letters only after the model's first turn, and the model must answer them reversed. The letter
    strings are the reversal task's, distinct across both splits."""
    test = task_rows("reverse", n_test, seed + 1)
    train = task_rows("reverse", n_train, seed, exclude={p for p, _, _ in test})
    for split, rows, first in (("train", train, 0), ("test", test, n_train)):
        write_jsonl(f"{out_dir}/lookup/rl_{split}.jsonl",
                    [{"prompt": f"lookup: box {first + i}", "letters": p[len("reverse: "):]}
                     for i, (p, _, _) in enumerate(rows)])


def task_rows(task, n, seed, exclude=()):
    """n distinct (prompt, answer, wrong) triples of `task`, skipping prompts in `exclude`."""
    rng, seen, rows = random.Random(seed), set(exclude), []
    for _ in range(100 * n):
        prompt, answer, wrong = TASKS[task](rng)
        if prompt not in seen:
            seen.add(prompt)
            rows.append((prompt, answer, wrong))
        if len(rows) == n:
            return rows
    raise ValueError(f"task {task!r} has fewer than {n} distinct prompts")


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_task_data(out_dir, task, n_train=2000, n_test=200, seed=0):
    """Write `task` in every format: sft, multiturn, pref, unpaired, rl, pretrain (train/test)."""
    test = task_rows(task, n_test, seed + 1)
    train = task_rows(task, n_train, seed, exclude={p for p, _, _ in test})
    rng = random.Random(seed + 2)
    for split, rows in (("train", train), ("test", test)):
        d = os.path.join(out_dir, task)
        write_jsonl(f"{d}/sft_{split}.jsonl", [{"prompt": p, "response": a} for p, a, _ in rows])
        write_jsonl(f"{d}/pref_{split}.jsonl", [{"prompt": p, "chosen": a, "rejected": w} for p, a, w in rows])
        write_jsonl(
            f"{d}/unpaired_{split}.jsonl",
            [{"prompt": p, "completion": a if i % 2 == 0 else w,
              "label": i % 2 == 0} for i, (p, a, w) in enumerate(rows)],
        )
        write_jsonl(f"{d}/rl_{split}.jsonl", [{"prompt": p, "answer": a} for p, a, _ in rows])
        write_jsonl(f"{d}/pretrain_{split}.jsonl", [{"text": f"{p} = {a}"} for p, a, _ in rows])
        turns = []
        for i in range(0, len(rows) - 1, 2):
            (p1, a1, _), (p2, a2, _) = rows[i], rows[i + 1]
            turns.append({"messages": [
                {"role": "user", "content": p1}, {"role": "assistant", "content": a1},
                {"role": "user", "content": p2}, {"role": "assistant", "content": a2},
            ]})
        rng.shuffle(turns)
        write_jsonl(f"{d}/multiturn_{split}.jsonl", turns)


# ----------------------------------------------------------------------------------------------
# Tokenizer and models
# ----------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size=512, pad_to=None):
    """Byte-level BPE trained on text from all tasks, wrapped as a PreTrainedTokenizerFast. `pad_to`: fill the
    vocabulary up to this many ids (a real model's size, e.g. Qwen2.5's 151,936) with tokens no text encodes to
    ("<unused0>", ... as plain BPE entries without merges: cheaper to load and encode with than added tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for task in sorted(TASKS):
        for prompt, answer, _ in task_rows(task, 1000, seed=123):
            corpus.append(f"<|user|>\n{prompt}<|end|>\n<|assistant|>\n{answer}<|end|>\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if pad_to is not None and pad_to > tok.get_vocab_size():
        state = json.loads(tok.model.__getstate__())
        vocab = state["vocab"]
        vocab.update({f"<unused{i}>": i for i in range(len(vocab), pad_to)})
        tok.model = models.BPE(vocab, [tuple(m.split(" ") if isinstance(m, str) else m) for m in state["merges"]])
    # unk_token None is written to tokenizer_config.json: beside a Qwen2 config, AutoTokenizer loads a Qwen2Tokenizer,
    # which otherwise adds its default unk "<|endoftext|>" as one more id than the model's vocabulary has
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", unk_token=None, chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_model(name, tokenizer, seed=0):
    """A randomly initialised tiny causal LM (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    arch, hidden, layers, inter = MODEL_SIZES[name]
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def build_assets(out_dir, models=tuple(MODEL_SIZES), tasks=tuple(TASKS)):
    """Write models (out_dir/<name>) and data (out_dir/data/<task>/..., the PRM data in out_dir/data/count/, the
    multi-turn task in out_dir/data/lookup/); skip what exists."""
    tokenizer = build_tokenizer()
    for name in models:
        path = os.path.join(out_dir, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            build_model(name, tokenizer).save_pretrained(path)
            tokenizer.save_pretrained(path)
    for task in tasks:
        if not os.path.exists(os.path.join(out_dir, "data", task, "rl_test.jsonl")):
            write_task_data(os.path.join(out_dir, "data"), task)
    if not os.path.exists(os.path.join(out_dir, "data", "count", "prm_soft_test.jsonl")):
        write_prm_data(os.path.join(out_dir, "data"))
    if not os.path.exists(os.path.join(out_dir, "data", "lookup", "rl_test.jsonl")):
        write_lookup_data(os.path.join(out_dir, "data"))
    return out_dir


# ----------------------------------------------------------------------------------------------
# Verification: exact-match accuracy of greedy answers
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def exact_match(model, tokenizer, rows, max_new_tokens=16, batch_size=64):
    """Fraction of rows {"prompt", "response"} whose greedy chat answer equals the response."""
    model.eval()
    tokenizer.padding_side = "left"
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                          add_generation_prompt=True)
            for r in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(a.strip() == r["response"] for a, r in zip(answers, chunk))
    return correct / len(rows)


def report(model_path, data_file, n=200, show=3):
    """Print the exact-match accuracy of `model_path` on a sft_*.jsonl file, and a few answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(data_file) as f:
        rows = [json.loads(line) for line in f][:n]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    print(f"{model_path}: exact match {exact_match(model, tokenizer, rows):.3f} on {len(rows)} held-out prompts")
    for row in rows[:show]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        print(f"  {row['prompt']!r} -> {answer!r} (expected {row['response']!r})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the tiny offline models, tokenizer and synthetic data, "
                                                 "or report a model's exact-match accuracy on a task.")
    parser.add_argument("--out", default="assets", help="output folder")
    parser.add_argument("--models", default=",".join(MODEL_SIZES), help=f"comma list of {list(MODEL_SIZES)}")
    parser.add_argument("--report", nargs=2, metavar=("MODEL", "SFT_JSONL"),
                        help="print exact match instead of building")
    args = parser.parse_args()
    if args.report:
        report(*args.report)
    else:
        build_assets(args.out, models=args.models.split(","))
        print(f"assets written to {args.out}")
